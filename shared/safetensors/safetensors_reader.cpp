#include "shared/safetensors/safetensors_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "shared/common/json_limits.h"

namespace keep::safetensors {

namespace {

using nlohmann::json;

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kF64, "F64", 8},   {DType::kF32, "F32", 4},        {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kI64, "I64", 8},        {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},   {DType::kI8, "I8", 1},          {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1}, {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
};

const DTypeInfo& info(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d;
  }
  KEEP_CHECK_MSG(false, "unknown DType value");
  return kDTypes[0];
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Status malformed(const std::string& path, const std::string& what) {
  return Status(Code::kMalformed, "safetensors file '" + path + "': " + what);
}

}  // namespace

// ---- dtypes
// ---------------------------------------------------------------------------------------

size_t dtype_size(DType dtype) { return info(dtype).size; }
const char* dtype_name(DType dtype) { return info(dtype).name; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {  // inf / nan
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {  // signed zero
    bits = sign;
  } else {  // subnormal: normalise the mantissa
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float bf16_to_fp32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---- TensorView
// -----------------------------------------------------------------------------------

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated at open: no overflow
  return n;
}

std::string TensorView::shape_string() const { return shape_str(shape); }

Status to_fp32(const TensorView& view, float* out, size_t out_count) {
  const size_t n = static_cast<size_t>(view.numel());
  if (out_count < n) {
    return Status(Code::kInvalidArgument, "tensor '" + std::string(view.name) + "': output holds " +
                                              std::to_string(out_count) + " floats, need " +
                                              std::to_string(n));
  }
  const uint8_t* p = view.data;
  switch (view.dtype) {
    case DType::kF32:
      // An empty tensor's output may be nullptr (an empty vector), which memcpy must not get.
      if (n > 0) std::memcpy(out, p, n * sizeof(float));
      return Status::ok();
    case DType::kF16:
    case DType::kBF16: {
      const bool half = view.dtype == DType::kF16;
      for (size_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, p + 2 * i, 2);  // the data may be unaligned
        out[i] = half ? fp16_to_fp32(bits) : bf16_to_fp32(bits);
      }
      return Status::ok();
    }
    default:
      return Status(Code::kInvalidArgument, "tensor '" + std::string(view.name) + "' has dtype " +
                                                dtype_name(view.dtype) +
                                                "; only F32, F16 and BF16 convert to fp32");
  }
}

Result<std::vector<float>> to_fp32(const TensorView& view) {
  std::vector<float> out(static_cast<size_t>(view.numel()));
  KEEP_RETURN_IF_ERROR(to_fp32(view, out.data(), out.size()));
  return out;
}

// ---- MappedFile
// -----------------------------------------------------------------------------------

// Read-only private mapping of a whole file; unmapped in the destructor.
class MappedFile {
 public:
  static Result<std::unique_ptr<MappedFile>> open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return Status(Code::kIoError,
                    "safetensors file '" + path + "': cannot open: " + std::strerror(errno));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      const std::string why = S_ISREG(st.st_mode) ? std::strerror(errno) : "not a regular file";
      ::close(fd);
      return Status(Code::kIoError, "safetensors file '" + path + "': " + why);
    }
    auto m = std::unique_ptr<MappedFile>(new MappedFile());
    m->size_ = static_cast<size_t>(st.st_size);
    if (m->size_ > 0) {
      void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        return Status(Code::kIoError,
                      "safetensors file '" + path + "': mmap failed: " + std::strerror(err));
      }
      m->base_ = static_cast<const uint8_t*>(p);
    }
    ::close(fd);  // the mapping stays valid
    return m;
  }
  ~MappedFile() {
    if (base_) ::munmap(const_cast<uint8_t*>(base_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return base_; }
  size_t size() const { return size_; }
  // Drops the resident pages (read again from the file on the next access).
  void release() const {
    if (base_) ::madvise(const_cast<uint8_t*>(base_), size_, MADV_DONTNEED);
  }

 private:
  MappedFile() = default;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
};

// ---- SafetensorsFile
// ------------------------------------------------------------------------------

SafetensorsFile::~SafetensorsFile() = default;

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  KEEP_ASSIGN_OR_RETURN(auto map, MappedFile::open(path));
  KEEP_ASSIGN_OR_RETURN(auto file, parse(map->data(), map->size(), path));
  file->map_ = std::move(map);
  return file;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::parse(const uint8_t* data,
                                                                size_t file_size,
                                                                std::string path) {
  if (file_size < 8) {
    return malformed(path, "file is " + std::to_string(file_size) +
                               " bytes, shorter than the 8-byte header length");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];  // little endian
  if (header_len > kMaxHeaderBytes) {
    return malformed(path, "header length " + std::to_string(header_len) + " exceeds the limit " +
                               std::to_string(kMaxHeaderBytes));
  }
  if (header_len > file_size - 8) {
    return malformed(path, "header length " + std::to_string(header_len) +
                               " runs past the end of the file (" + std::to_string(file_size) +
                               " bytes): truncated?");
  }
  if (header_len < 2) return malformed(path, "header of " + std::to_string(header_len) + " bytes");

  const char* hbegin = reinterpret_cast<const char*>(data + 8);
  if (json_nesting_exceeds({hbegin, header_len})) {
    return malformed(path, "header nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  }
  json header = json::parse(hbegin, hbegin + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return malformed(path, "header is not valid JSON");
  if (!header.is_object()) return malformed(path, "header is not a JSON object");

  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = path;
  file->file_size_ = file_size;
  file->data_ = data + 8 + header_len;
  file->data_bytes_ = file_size - 8 - header_len;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return malformed(path, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return malformed(path, "__metadata__ value '" + m.key() + "' is not a string");
        }
        file->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return malformed(path, "tensor '" + name + "': " + what);
    };
    if (!v.is_object()) return bad("entry is not an object");
    const auto dt = v.find("dtype");
    const auto sh = v.find("shape");
    const auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return bad("missing or non-string 'dtype'");
    if (sh == v.end() || !sh->is_array()) return bad("missing or non-array 'shape'");
    if (off == v.end() || !off->is_array() || off->size() != 2) {
      return bad("'data_offsets' must be an array [begin, end]");
    }
    Entry e{};
    const auto dtype = parse_dtype(dt->get<std::string>());
    if (!dtype) return bad("unknown dtype '" + dt->get<std::string>() + "'");
    e.dtype = *dtype;

    uint64_t numel = 1;
    uint64_t nonzero_numel = 1;  // TensorView::numel() multiplies in int64, zeros last included
    for (const json& d : *sh) {
      if (!d.is_number_unsigned()) return bad("shape " + sh->dump() + " has a non-natural dim");
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(numel, dim, &numel) ||
          (dim != 0 && (__builtin_mul_overflow(nonzero_numel, dim, &nonzero_numel) ||
                        nonzero_numel > static_cast<uint64_t>(INT64_MAX)))) {
        return bad("shape " + sh->dump() + " overflows");
      }
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    uint64_t expect_bytes = 0;
    if (__builtin_mul_overflow(numel, dtype_size(e.dtype), &expect_bytes)) {
      return bad("shape " + sh->dump() + " overflows");
    }
    if (!(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned()) {
      return bad("data_offsets " + off->dump() + " are not natural numbers");
    }
    e.begin = (*off)[0].get<uint64_t>();
    e.end = (*off)[1].get<uint64_t>();
    if (e.begin > e.end) return bad("data_offsets " + off->dump() + " has begin > end");
    if (e.end > file->data_bytes_) {
      return bad("data_offsets " + off->dump() + " run past the data buffer (" +
                 std::to_string(file->data_bytes_) + " bytes): truncated?");
    }
    if (e.end - e.begin != expect_bytes) {
      return bad("shape " + shape_str(e.shape) + " x " + dtype_name(e.dtype) + " is " +
                 std::to_string(expect_bytes) + " bytes but data_offsets " + off->dump() +
                 " span " + std::to_string(e.end - e.begin));
    }
    file->tensors_.emplace(name, std::move(e));
  }

  // No two tensors may share bytes. Zero-sized tensors occupy nothing.
  std::vector<std::pair<const std::string*, const Entry*>> order;
  for (const auto& [n, e] : file->tensors_) {
    if (e.end > e.begin) order.emplace_back(&n, &e);
  }
  std::sort(order.begin(), order.end(),
            [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (size_t i = 1; i < order.size(); ++i) {
    if (order[i].second->begin < order[i - 1].second->end) {
      return malformed(path, "tensors '" + *order[i - 1].first + "' and '" + *order[i].first +
                                 "' overlap in the data buffer");
    }
  }
  return file;
}

TensorView SafetensorsFile::make_view(const std::string& name, const Entry& e) const {
  TensorView v;
  v.name = name;
  v.dtype = e.dtype;
  v.shape = e.shape;
  v.data = data_ + e.begin;
  v.bytes = static_cast<size_t>(e.end - e.begin);
  return v;
}

bool SafetensorsFile::contains(std::string_view name) const {
  return tensors_.find(name) != tensors_.end();
}

Result<TensorView> SafetensorsFile::tensor(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return Status(Code::kNotFound,
                  "safetensors file '" + path_ + "': no tensor '" + std::string(name) + "'");
  }
  return make_view(it->first, it->second);
}

Result<TensorView> SafetensorsFile::tensor(std::string_view name,
                                           const std::vector<int64_t>& expected_shape) const {
  KEEP_ASSIGN_OR_RETURN(TensorView v, tensor(name));
  if (v.shape != expected_shape) {
    return Status(Code::kInvalidArgument, "safetensors file '" + path_ + "': tensor '" +
                                              std::string(name) + "' has shape " +
                                              v.shape_string() + ", expected " +
                                              shape_str(expected_shape));
  }
  return v;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::pair<uint64_t, std::string>> order;
  for (const auto& [n, e] : tensors_) order.emplace_back(e.begin, n);
  std::sort(order.begin(), order.end());
  std::vector<std::string> out;
  for (auto& [b, n] : order) out.push_back(std::move(n));
  return out;
}

// ---- SafetensorsModel
// -----------------------------------------------------------------------------

Result<std::unique_ptr<SafetensorsModel>> SafetensorsModel::open_file(const std::string& path) {
  KEEP_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(path));
  auto model = std::unique_ptr<SafetensorsModel>(new SafetensorsModel());
  model->where_ = path;
  for (const auto& n : file->names()) model->index_.emplace(n, 0);
  model->shards_.push_back(std::move(file));
  return model;
}

Result<std::unique_ptr<SafetensorsModel>> SafetensorsModel::open_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir) / "model.safetensors";
  std::error_code ec;
  if (!fs::exists(index_path, ec)) {
    if (!fs::exists(single_path, ec)) {
      return Status(Code::kNotFound, "model directory '" + dir +
                                         "': neither model.safetensors nor "
                                         "model.safetensors.index.json exists");
    }
    return open_file(single_path.string());
  }

  // Sharded: {"metadata": {...}, "weight_map": {"tensor": "model-00001-of-00002.safetensors"}}.
  std::ifstream in(index_path);
  std::stringstream ss;
  ss << in.rdbuf();
  if (!in) return Status(Code::kIoError, "cannot read '" + index_path.string() + "'");
  json index = json_nesting_exceeds(ss.str())
                   ? json(json::value_t::discarded)
                   : json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
      !index["weight_map"].is_object()) {
    return Status(Code::kMalformed,
                  "'" + index_path.string() + "': not a JSON object with a 'weight_map' object");
  }
  auto model = std::unique_ptr<SafetensorsModel>(new SafetensorsModel());
  model->where_ = dir;
  std::map<std::string, size_t> shard_of_file;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    if (!it.value().is_string()) {
      return Status(Code::kMalformed,
                    "'" + index_path.string() + "': shard of '" + it.key() + "' is not a string");
    }
    const std::string shard = it.value().get<std::string>();
    // A shard is a plain file name inside the directory: no path traversal.
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      return Status(Code::kMalformed, "'" + index_path.string() + "': tensor '" + it.key() +
                                          "' names an invalid shard file '" + shard + "'");
    }
    auto found = shard_of_file.find(shard);
    if (found == shard_of_file.end()) {
      KEEP_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open((fs::path(dir) / shard).string()));
      found = shard_of_file.emplace(shard, model->shards_.size()).first;
      model->shards_.push_back(std::move(file));
    }
    const SafetensorsFile& f = *model->shards_[found->second];
    if (!f.contains(it.key())) {
      return Status(Code::kCorrupt, "'" + index_path.string() + "' maps tensor '" + it.key() +
                                        "' to '" + f.path() + "', which does not contain it");
    }
    model->index_.emplace(it.key(), found->second);
  }
  return model;
}

void SafetensorsFile::release_pages() const {
  if (map_) map_->release();
}

size_t SafetensorsModel::shard_of(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? shards_.size() : it->second;
}

bool SafetensorsModel::contains(std::string_view name) const {
  return index_.find(name) != index_.end();
}

Result<TensorView> SafetensorsModel::tensor(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return Status(Code::kNotFound,
                  "safetensors model '" + where_ + "': no tensor '" + std::string(name) + "'");
  }
  return shards_[it->second]->tensor(name);
}

Result<TensorView> SafetensorsModel::tensor(std::string_view name,
                                            const std::vector<int64_t>& expected_shape) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return Status(Code::kNotFound,
                  "safetensors model '" + where_ + "': no tensor '" + std::string(name) + "'");
  }
  return shards_[it->second]->tensor(name, expected_shape);
}

std::vector<std::string> SafetensorsModel::names() const {
  std::vector<std::string> out;
  for (const auto& [n, s] : index_) out.push_back(n);
  return out;
}

}  // namespace keep::safetensors
