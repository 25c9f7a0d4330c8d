#include "shared/model/gguf_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <sstream>

namespace keep::engine {

static_assert(std::endian::native == std::endian::little,
              "GGUF parsing assumes a little-endian host");

// RAII read-only mapping of a whole file.
class GgufFile::Mapping {
 public:
  Mapping(void* addr, size_t size) : addr_(addr), size_(size) {}
  ~Mapping() {
    if (addr_ != nullptr && size_ > 0) munmap(addr_, size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const uint8_t* data() const { return static_cast<const uint8_t*>(addr_); }

 private:
  void* addr_;
  size_t size_;
};

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as little-endian uint32

// A bounds-checked little-endian reader over [data, data + size).
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  size_t pos() const { return pos_; }
  size_t left() const { return size_ - pos_; }

  template <typename T>
  bool read(T* out) {
    if (left() < sizeof(T)) return false;
    std::memcpy(out, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool read_string(std::string* out) {
    uint64_t len = 0;
    if (!read(&len)) return false;
    if (len > left() || len > kGgufMaxStringBytes) return false;
    out->assign(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return true;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// Minimum encoded size of one value of `t` (to bound counts before allocating).
uint64_t min_value_bytes(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kU16:
    case GgufValueType::kI16:
      return 2;
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kF32:
      return 4;
    case GgufValueType::kU64:
    case GgufValueType::kI64:
    case GgufValueType::kF64:
    case GgufValueType::kString:
      return 8;
    case GgufValueType::kArray:
      return 12;
  }
  return 1;
}

bool valid_value_type(uint32_t t) { return t <= 12; }

}  // namespace

const char* gguf_value_type_name(GgufValueType type) {
  static const char* const kNames[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                       "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(type);
  return i < 13 ? kNames[i] : "unknown";
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kU16:
    case GgufValueType::kI16:
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kU64:
    case GgufValueType::kI64:
      return true;
    default:
      return false;
  }
}
bool GgufValue::is_float() const {
  return type == GgufValueType::kF32 || type == GgufValueType::kF64;
}
uint64_t GgufValue::array_size() const {
  if (type != GgufValueType::kArray) return 0;
  return int_array.size() + float_array.size() + str_array.size() + arr_array.size();
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // validated against overflow at parse
  return n;
}
std::vector<int64_t> GgufTensorInfo::shape() const { return {ne.rbegin(), ne.rend()}; }
std::string GgufTensorInfo::shape_string() const {
  std::ostringstream os;
  os << "[";
  auto s = shape();
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

GgufFile::~GgufFile() = default;

namespace {

// Parses one value of type `t` (depth counts array nesting).
bool parse_value(Cursor& c, GgufValueType t, int depth, GgufValue* v, std::string* err) {
  v->type = t;
  auto fail = [&](const char* what) {
    *err = what;
    return false;
  };
  switch (t) {
    case GgufValueType::kU8: {
      uint8_t x;
      if (!c.read(&x)) return fail("truncated u8");
      v->i = x;
      v->u = x;
      return true;
    }
    case GgufValueType::kI8: {
      int8_t x;
      if (!c.read(&x)) return fail("truncated i8");
      v->i = x;
      return true;
    }
    case GgufValueType::kU16: {
      uint16_t x;
      if (!c.read(&x)) return fail("truncated u16");
      v->i = x;
      v->u = x;
      return true;
    }
    case GgufValueType::kI16: {
      int16_t x;
      if (!c.read(&x)) return fail("truncated i16");
      v->i = x;
      return true;
    }
    case GgufValueType::kU32: {
      uint32_t x;
      if (!c.read(&x)) return fail("truncated u32");
      v->i = x;
      v->u = x;
      return true;
    }
    case GgufValueType::kI32: {
      int32_t x;
      if (!c.read(&x)) return fail("truncated i32");
      v->i = x;
      return true;
    }
    case GgufValueType::kU64: {
      uint64_t x;
      if (!c.read(&x)) return fail("truncated u64");
      v->u = x;
      v->i = x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                 ? std::numeric_limits<int64_t>::max()
                 : static_cast<int64_t>(x);
      return true;
    }
    case GgufValueType::kI64: {
      int64_t x;
      if (!c.read(&x)) return fail("truncated i64");
      v->i = x;
      return true;
    }
    case GgufValueType::kF32: {
      float x;
      if (!c.read(&x)) return fail("truncated f32");
      v->f = x;
      return true;
    }
    case GgufValueType::kF64: {
      double x;
      if (!c.read(&x)) return fail("truncated f64");
      v->f = x;
      return true;
    }
    case GgufValueType::kBool: {
      uint8_t x;
      if (!c.read(&x)) return fail("truncated bool");
      if (x > 1) return fail("bool value is neither 0 nor 1");
      v->b = x != 0;
      v->i = x;
      return true;
    }
    case GgufValueType::kString:
      if (!c.read_string(&v->s)) return fail("truncated or oversized string");
      return true;
    case GgufValueType::kArray: {
      if (depth >= kGgufMaxArrayDepth) return fail("arrays nested too deeply");
      uint32_t et = 0;
      uint64_t count = 0;
      if (!c.read(&et) || !c.read(&count)) return fail("truncated array header");
      if (!valid_value_type(et)) return fail("array of an unknown value type");
      v->elem_type = static_cast<GgufValueType>(et);
      if (count > c.left() / min_value_bytes(v->elem_type)) {
        return fail("array count exceeds the bytes left in the file");
      }
      const auto n = static_cast<size_t>(count);
      GgufValue e;
      switch (v->elem_type) {
        case GgufValueType::kString:
          v->str_array.reserve(n);
          for (size_t k = 0; k < n; ++k) {
            std::string s;
            if (!c.read_string(&s)) return fail("truncated or oversized string in array");
            v->str_array.push_back(std::move(s));
          }
          return true;
        case GgufValueType::kArray:
          v->arr_array.reserve(n);
          for (size_t k = 0; k < n; ++k) {
            GgufValue sub;
            if (!parse_value(c, GgufValueType::kArray, depth + 1, &sub, err)) return false;
            v->arr_array.push_back(std::move(sub));
          }
          return true;
        case GgufValueType::kF32:
        case GgufValueType::kF64:
          v->float_array.reserve(n);
          for (size_t k = 0; k < n; ++k) {
            if (!parse_value(c, v->elem_type, depth + 1, &e, err)) return false;
            v->float_array.push_back(e.f);
          }
          return true;
        default:
          v->int_array.reserve(n);
          for (size_t k = 0; k < n; ++k) {
            if (!parse_value(c, v->elem_type, depth + 1, &e, err)) return false;
            v->int_array.push_back(e.i);
          }
          return true;
      }
    }
  }
  return fail("unknown value type");
}

}  // namespace

Result<std::unique_ptr<GgufFile>> GgufFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status(Code::kIoError, path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return Status(Code::kIoError, path + ": stat failed: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status(Code::kIoError, path + ": not a regular file");
  }
  const auto size = static_cast<size_t>(st.st_size);
  if (size < 24) {
    ::close(fd);
    return Status(Code::kMalformed,
                  path + ": file too short for a GGUF header (" + std::to_string(size) + " bytes)");
  }
  void* addr = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int e = errno;
  ::close(fd);
  if (addr == MAP_FAILED)
    return Status(Code::kIoError, path + ": mmap failed: " + std::strerror(e));
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = path;
  f->map_ = std::make_unique<Mapping>(addr, size);
  f->base_ = f->map_->data();
  f->size_ = size;
  KEEP_RETURN_IF_ERROR(f->parse_all());
  return f;
}

Result<std::unique_ptr<GgufFile>> GgufFile::parse(const uint8_t* data, size_t size,
                                                  std::string where) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = std::move(where);
  f->base_ = data;
  f->size_ = size;
  KEEP_RETURN_IF_ERROR(f->parse_all());
  return f;
}

Status GgufFile::parse_all() {
  auto malformed = [&](const std::string& what) {
    return Status(Code::kMalformed, path_ + ": " + what);
  };
  Cursor c(base_, size_);
  uint32_t magic = 0;
  uint64_t n_tensors = 0, n_kv = 0;
  if (!c.read(&magic)) return malformed("truncated header");
  if (magic != kMagic) return malformed("not a GGUF file (bad magic)");
  if (!c.read(&version_)) return malformed("truncated header");
  if (version_ != 2 && version_ != 3) {
    return Status(Code::kVersionMismatch, path_ + ": unsupported GGUF version " +
                                              std::to_string(version_) + " (supported: 2, 3)");
  }
  if (!c.read(&n_tensors) || !c.read(&n_kv)) return malformed("truncated header");
  if (n_tensors > kGgufMaxTensors || n_tensors > c.left() / 24) {
    return malformed("tensor count " + std::to_string(n_tensors) + " is implausible");
  }
  if (n_kv > kGgufMaxKeys || n_kv > c.left() / 12) {
    return malformed("metadata count " + std::to_string(n_kv) + " is implausible");
  }

  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key;
    uint32_t vt = 0;
    if (!c.read_string(&key)) {
      return malformed("metadata entry " + std::to_string(k) + ": truncated key");
    }
    if (!c.read(&vt)) return malformed("metadata \"" + key + "\": truncated value type");
    if (!valid_value_type(vt)) {
      return malformed("metadata \"" + key + "\": unknown value type " + std::to_string(vt));
    }
    GgufValue v;
    std::string err;
    if (!parse_value(c, static_cast<GgufValueType>(vt), 0, &v, &err)) {
      return malformed("metadata \"" + key + "\": " + err);
    }
    if (kv_.count(key) != 0) return malformed("metadata \"" + key + "\" appears twice");
    kv_.emplace(std::move(key), std::move(v));
  }

  if (const GgufValue* a = find("general.alignment")) {
    if (!a->is_integer() || a->i <= 0 || (a->i & (a->i - 1)) != 0 || a->i > (1 << 20)) {
      return malformed("general.alignment must be a power of two integer");
    }
    alignment_ = static_cast<uint64_t>(a->i);
  }

  tensors_.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensorInfo t;
    uint32_t n_dims = 0;
    if (!c.read_string(&t.name)) {
      return malformed("tensor info " + std::to_string(k) + ": truncated name");
    }
    const std::string tn = "tensor \"" + t.name + "\": ";
    if (!c.read(&n_dims)) return malformed(tn + "truncated dimensions");
    if (n_dims < 1 || n_dims > 4) {
      return malformed(tn + "n_dims " + std::to_string(n_dims) + " outside 1..4");
    }
    uint64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t ne = 0;
      if (!c.read(&ne)) return malformed(tn + "truncated dimensions");
      if (ne == 0 || ne > (uint64_t{1} << 40) || numel > (uint64_t{1} << 62) / ne) {
        return malformed(tn + "dimension " + std::to_string(ne) + " is invalid or overflows");
      }
      numel *= ne;
      t.ne.push_back(static_cast<int64_t>(ne));
    }
    if (!c.read(&t.type) || !c.read(&t.offset)) return malformed(tn + "truncated type/offset");
    auto info = ggml_type_info(t.type);
    if (!info) return malformed(tn + "unknown ggml type " + std::to_string(t.type));
    auto row = ggml_row_bytes(t.type, t.ne[0]);
    if (!row) {
      return malformed(tn + "row length " + std::to_string(t.ne[0]) + " is not a multiple of the " +
                       info->name + " block size " + std::to_string(info->block_elems));
    }
    const uint64_t rows = numel / static_cast<uint64_t>(t.ne[0]);
    if (rows != 0 && *row > std::numeric_limits<uint64_t>::max() / rows) {
      return malformed(tn + "byte size overflows");
    }
    t.bytes = *row * rows;
    if (t.offset % alignment_ != 0) {
      return malformed(tn + "offset " + std::to_string(t.offset) + " is not a multiple of the " +
                       "alignment " + std::to_string(alignment_));
    }
    if (tensor_index_.count(t.name) != 0) return malformed(tn + "appears twice");
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment.
  const uint64_t info_end = c.pos();
  const uint64_t data_start = (info_end + alignment_ - 1) / alignment_ * alignment_;
  if (data_start > size_ && !tensors_.empty()) {
    return malformed("truncated: the data section starts at " + std::to_string(data_start) +
                     " but the file has " + std::to_string(size_) + " bytes");
  }
  const uint64_t data_bytes = data_start <= size_ ? size_ - data_start : 0;
  std::vector<size_t> order(tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  uint64_t prev_end = 0;
  std::string prev_name;
  for (size_t idx : order) {
    GgufTensorInfo& t = tensors_[idx];
    if (t.offset > data_bytes || t.bytes > data_bytes - t.offset) {
      return Status(Code::kCorrupt,
                    path_ + ": tensor \"" + t.name + "\" (" + ggml_type_name(t.type) + " " +
                        t.shape_string() + ", " + std::to_string(t.bytes) +
                        " bytes at data offset " + std::to_string(t.offset) +
                        ") extends past the end of the file (" + std::to_string(data_bytes) +
                        " data bytes): truncated file?");
    }
    if (t.offset < prev_end) {
      return Status(Code::kCorrupt,
                    path_ + ": tensor \"" + t.name + "\" overlaps tensor \"" + prev_name + "\"");
    }
    prev_end = t.offset + t.bytes;
    prev_name = t.name;
    t.data = base_ + data_start + t.offset;
  }
  return Status::ok();
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

Result<int64_t> GgufFile::get_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr)
    return Status(Code::kNotFound, path_ + ": missing metadata \"" + std::string(key) + "\"");
  if (!v->is_integer()) {
    return Status(Code::kInvalidArgument, path_ + ": metadata \"" + std::string(key) + "\" is " +
                                              gguf_value_type_name(v->type) +
                                              ", expected an integer");
  }
  if (v->type == GgufValueType::kU64 &&
      v->u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Status(Code::kInvalidArgument,
                  path_ + ": metadata \"" + std::string(key) + "\" is too large");
  }
  return v->i;
}

Result<double> GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr)
    return Status(Code::kNotFound, path_ + ": missing metadata \"" + std::string(key) + "\"");
  if (v->is_float()) return v->f;
  if (v->is_integer()) return static_cast<double>(v->i);
  return Status(Code::kInvalidArgument, path_ + ": metadata \"" + std::string(key) + "\" is " +
                                            gguf_value_type_name(v->type) + ", expected a number");
}

Result<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr)
    return Status(Code::kNotFound, path_ + ": missing metadata \"" + std::string(key) + "\"");
  if (v->type != GgufValueType::kString) {
    return Status(Code::kInvalidArgument, path_ + ": metadata \"" + std::string(key) + "\" is " +
                                              gguf_value_type_name(v->type) +
                                              ", expected a string");
  }
  return v->s;
}

Result<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr)
    return Status(Code::kNotFound, path_ + ": missing metadata \"" + std::string(key) + "\"");
  if (v->type != GgufValueType::kBool) {
    return Status(Code::kInvalidArgument, path_ + ": metadata \"" + std::string(key) + "\" is " +
                                              gguf_value_type_name(v->type) + ", expected a bool");
  }
  return v->b;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

Status GgufFile::tensor_to_fp32(const GgufTensorInfo& t, float* out, size_t out_count) const {
  if (out_count != static_cast<size_t>(t.numel())) {
    return Status(Code::kInvalidArgument, path_ + ": tensor \"" + t.name + "\": output holds " +
                                              std::to_string(out_count) + " floats, need " +
                                              std::to_string(t.numel()));
  }
  Status st = dequantize(t.type, t.data, static_cast<size_t>(t.bytes), out, t.numel());
  if (!st.is_ok()) return st.with_context(path_ + ": tensor \"" + t.name + "\"");
  return Status::ok();
}

}  // namespace keep::engine
