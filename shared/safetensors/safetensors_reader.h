// Reading safetensors files: memory-mapped, validated, zero-copy tensor views.
//
// Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
// N bytes of JSON, then the data buffer. The JSON maps tensor names to
//   {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]}
// with offsets relative to the start of the data buffer; an optional "__metadata__" object maps
// strings to strings.
//
// Validation is strict, and every failure is a Status naming the file (and the tensor): the header
// length must fit in the file and under kMaxHeaderBytes, the JSON must be an object of well-formed
// entries, begin <= end <= data size, numel(shape) * dtype size == end - begin (with overflow
// checks), and no two tensors may overlap. Gaps between tensors are allowed (some writers pad for
// alignment). Nothing is read outside the mapping.
//
// A SafetensorsFile is one file; a SafetensorsModel is a model directory: one model.safetensors or
// the shards listed by model.safetensors.index.json (the Hugging Face sharding convention).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"

namespace keep::safetensors {

// The dtypes of the safetensors spec that we can size. Only the float ones convert to fp32.
enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
  kF8E4M3,
  kF8E5M2,
};

size_t dtype_size(DType dtype);                           // bytes per element
const char* dtype_name(DType dtype);                      // "F32", "BF16", ... (spec spelling)
std::optional<DType> parse_dtype(std::string_view name);  // nullopt for unknown names

// Largest header we accept. Real headers are a few KiB to a few MiB (many-shard LLMs); the
// reference implementation caps at 100 MB.
inline constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

// A validated view into the mapping. `data` may be unaligned (the data buffer starts at 8 + N):
// read it with memcpy or through to_fp32(); it lives as long as the SafetensorsFile.
struct TensorView {
  std::string_view name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // empty for a scalar
  const uint8_t* data = nullptr;
  size_t bytes = 0;

  int64_t numel() const;
  std::string shape_string() const;  // "[30522, 384]"
};

// Converts an F32/F16/BF16 tensor to fp32. `out` must hold view.numel() floats.
// kInvalidArgument (naming the tensor) for other dtypes.
Status to_fp32(const TensorView& view, float* out, size_t out_count);
Result<std::vector<float>> to_fp32(const TensorView& view);

// Scalar conversions, exposed for tests and for other loaders (GGUF).
float fp16_to_fp32(uint16_t bits);
float bf16_to_fp32(uint16_t bits);

class MappedFile;  // RAII read-only mmap (defined in the .cpp)

// One safetensors file, mapped read-only for the lifetime of the object. Immutable after open(),
// so const methods may be called from several threads.
class SafetensorsFile {
 public:
  // Maps and validates `path`. kIoError if it cannot be opened or mapped, kMalformed/kCorrupt
  // when the contents are inconsistent; the message names the file (and the tensor).
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  // Validates a whole file held in memory (what open() does on the mapping); the caller keeps
  // [data, data + size) alive as long as the result. `where` names it in messages.
  static Result<std::unique_ptr<SafetensorsFile>> parse(const uint8_t* data, size_t size,
                                                        std::string where);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  size_t file_size() const { return file_size_; }
  size_t size() const { return tensors_.size(); }

  bool contains(std::string_view name) const;
  // kNotFound naming the file and the tensor when absent.
  Result<TensorView> tensor(std::string_view name) const;
  // Like tensor(), and checks the shape: kInvalidArgument "... has shape [a, b], expected [c, d]".
  Result<TensorView> tensor(std::string_view name,
                            const std::vector<int64_t>& expected_shape) const;
  // Tensor names in file order (by data offset).
  std::vector<std::string> names() const;
  // The "__metadata__" object (string values only; others are refused at open).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Drops the mapping's resident pages (madvise DONTNEED; views stay valid and read the file
  // again when touched): a streaming reader keeps one shard resident at a time.
  void release_pages() const;

 private:
  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    uint64_t begin;  // offset in the data buffer
    uint64_t end;
  };
  SafetensorsFile() = default;
  TensorView make_view(const std::string& name, const Entry& e) const;

  std::string path_;
  std::unique_ptr<MappedFile> map_;  // null for parse()
  size_t file_size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the data buffer inside the mapping
  uint64_t data_bytes_ = 0;
  std::map<std::string, Entry, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A model's weights: `dir/model.safetensors`, or the shards named by
// `dir/model.safetensors.index.json` ({"weight_map": {tensor: shard file}}). Every shard is
// validated at open; a tensor listed in the index but missing from its shard is an error.
class SafetensorsModel {
 public:
  static Result<std::unique_ptr<SafetensorsModel>> open_dir(const std::string& dir);
  // One file, as a single-shard model.
  static Result<std::unique_ptr<SafetensorsModel>> open_file(const std::string& path);

  bool contains(std::string_view name) const;
  Result<TensorView> tensor(std::string_view name) const;
  Result<TensorView> tensor(std::string_view name,
                            const std::vector<int64_t>& expected_shape) const;
  std::vector<std::string> names() const;  // sorted
  size_t shard_count() const { return shards_.size(); }
  const SafetensorsFile& shard(size_t i) const { return *shards_.at(i); }
  // The shard holding `name`, shard_count() when none does.
  size_t shard_of(std::string_view name) const;

 private:
  std::string where_;  // directory or file, for messages
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, size_t, std::less<>> index_;  // tensor name -> shard
};

}  // namespace keep::safetensors
