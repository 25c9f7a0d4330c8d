// ggml tensor types and their dequantisation to fp32, bit-exact with ggml's reference
// (ggml/src/ggml-quants.c dequantize_row_*, ggml-impl.h fp16/bf16 conversion).
//
// Block formats (little-endian, packed; QK = elements per block):
//   F32   4 bytes per element.             F16 / BF16: 2 bytes per element.
//   Q8_0  QK=32, 34 bytes: f16 d, int8 qs[32];                 x[j] = d * qs[j]
//   Q4_0  QK=32, 18 bytes: f16 d, uint8 qs[16];                x[j]    = d * ((qs[j] & 0xF) - 8)
//                                                              x[j+16] = d * ((qs[j] >> 4) - 8)
//   Q4_1  QK=32, 20 bytes: f16 d, f16 m, uint8 qs[16];         x[j]    = d * (qs[j] & 0xF) + m
//                                                              x[j+16] = d * (qs[j] >> 4) + m
//   Q5_0  QK=32, 22 bytes: f16 d, uint32 qh, uint8 qs[16];     the 5th bit of x[j] is bit j of qh,
//                                                              of x[j+16] bit j+16; value - 16
//   Q5_1  QK=32, 24 bytes: f16 d, f16 m, uint32 qh, uint8 qs[16];   d * q + m
// Other ggml types are recognised (name, block size) so errors can name them, but not converted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "shared/common/status.h"

namespace keep::engine {

// ggml_type values (ggml.h). Only the ones we name; any uint32 may appear in a file.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kBF16 = 30,
};

struct GgmlTypeInfo {
  const char* name;     // "Q4_1"
  int64_t block_elems;  // elements per block (1 for plain types)
  int64_t block_bytes;  // bytes per block
  bool dequantizable;   // dequantize() supports it
};

// Info for a raw ggml type value; nullopt for values ggml does not define (or removed types).
std::optional<GgmlTypeInfo> ggml_type_info(uint32_t type);
const char* ggml_type_name(uint32_t type);  // "Q4_1", or "type#N" for unknown values

// Bytes of `n` elements of `type`; nullopt when n is not a multiple of the block size, the type is
// unknown, or the size overflows.
std::optional<uint64_t> ggml_row_bytes(uint32_t type, int64_t n);

// Dequantises `n` elements from `src` (exactly ggml_row_bytes(type, n) bytes expected in
// src_bytes) into `dst`. kInvalidArgument for unsupported types or size mismatches.
Status dequantize(uint32_t type, const uint8_t* src, size_t src_bytes, float* dst, int64_t n);

}  // namespace keep::engine
