// GgufReader: a strict, memory-mapped parser of GGUF files (llama.cpp's model format, v2/v3).
//
// Layout (little-endian; gguf.md in ggml):
//   uint32 magic "GGUF", uint32 version (2 or 3), uint64 tensor_count, uint64 metadata_kv_count,
//   metadata_kv_count x { string key, uint32 value_type, value },
//   tensor_count x { string name, uint32 n_dims, uint64 ne[n_dims], uint32 ggml_type,
//                    uint64 offset },
//   padding to `general.alignment` (default 32), then the tensor data; each tensor's offset is
//   relative to the data start and a multiple of the alignment.
//   string = uint64 length + bytes (no NUL); array = uint32 elem_type, uint64 count, elements.
//   value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array,
//   10 u64, 11 i64, 12 f64.
//
// Validation: every read is bounds-checked against the mapping; counts are checked against the
// bytes left before anything is allocated; keys and tensor names are unique; n_dims in 1..4,
// every ne >= 1, element counts without overflow, ne[0] a multiple of the type's block size, each
// tensor's bytes inside the file, offsets aligned, tensors not overlapping. Failures are kMalformed
// / kCorrupt (kIoError for the OS) with "<file>: ..." and the key or tensor name.
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
#include "shared/model/gguf_dequant.h"

namespace keep::engine {

enum class GgufValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
const char* gguf_value_type_name(GgufValueType type);

// One metadata value. Scalars: integers in `i` (u64 above INT64_MAX in `u` only), floats in `f`,
// bool in `b`, strings in `s`. Arrays: elem_type plus exactly one of the *_array vectors (integer
// and bool elements in int_array, float elements in float_array, strings in str_array, nested
// arrays in arr_array).
struct GgufValue {
  GgufValueType type = GgufValueType::kU8;
  GgufValueType elem_type = GgufValueType::kU8;  // arrays only
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  bool b = false;
  std::string s;
  std::vector<int64_t> int_array;
  std::vector<double> float_array;
  std::vector<std::string> str_array;
  std::vector<GgufValue> arr_array;

  bool is_integer() const;  // any integer scalar type
  bool is_float() const;    // f32 / f64
  uint64_t array_size() const;
};

struct GgufTensorInfo {
  std::string name;
  uint32_t type = 0;              // raw ggml_type (see gguf_dequant.h)
  std::vector<int64_t> ne;        // ggml order: ne[0] is the contiguous (fastest) dimension
  uint64_t offset = 0;            // relative to the data section
  uint64_t bytes = 0;             // ggml_row_bytes(type, ne[0]) * rows
  const uint8_t* data = nullptr;  // into the mapping

  int64_t numel() const;
  std::vector<int64_t> shape() const;  // row-major (reversed ne): [rows, ne[0]] for a matrix
  std::string shape_string() const;    // row-major, "[49152, 576]"
};

class GgufFile {
 public:
  // Maps and validates `path`.
  static Result<std::unique_ptr<GgufFile>> open(const std::string& path);
  // Parses a buffer the caller keeps alive (tests; `where` names it in messages).
  static Result<std::unique_ptr<GgufFile>> parse(const uint8_t* data, size_t size,
                                                 std::string where);

  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  size_t file_size() const { return size_; }

  // Metadata.
  const std::map<std::string, GgufValue, std::less<>>& metadata() const { return kv_; }
  const GgufValue* find(std::string_view key) const;  // nullptr when absent
  // Typed getters: kNotFound when absent, kInvalidArgument naming file and key on a type mismatch.
  Result<int64_t> get_int(std::string_view key) const;   // any integer type (u64 must fit)
  Result<double> get_float(std::string_view key) const;  // f32/f64 (integers accepted)
  Result<std::string> get_string(std::string_view key) const;
  Result<bool> get_bool(std::string_view key) const;

  // Tensors, in file order.
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;  // nullptr when absent

  // Dequantises one tensor into fp32 (numel floats, row-major). Errors name file and tensor.
  Status tensor_to_fp32(const GgufTensorInfo& t, float* out, size_t out_count) const;

 private:
  class Mapping;
  GgufFile() = default;
  Status parse_all();

  std::string path_;
  std::unique_ptr<Mapping> map_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue, std::less<>> kv_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// Limits on hostile input (generous for real files).
inline constexpr uint64_t kGgufMaxStringBytes = 64ull << 20;
inline constexpr uint64_t kGgufMaxKeys = 1ull << 20;
inline constexpr uint64_t kGgufMaxTensors = 1ull << 20;
inline constexpr int kGgufMaxArrayDepth = 4;

}  // namespace keep::engine
