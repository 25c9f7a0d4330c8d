// A host-side bfloat16 storage type for the CPU references and tests: the same 2 bytes as CUDA's
// __nv_bfloat16 (the top half of an IEEE fp32), so buffers copy between them bit for bit. Float to
// bf16 rounds to nearest, ties to even, as __float2bfloat16 does; NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>

namespace keep::kernels {

struct Bf16 {
  uint16_t bits = 0;
};
static_assert(sizeof(Bf16) == 2, "Bf16 must be 2 bytes, like __nv_bfloat16");

inline float bf16_to_float(Bf16 v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline Bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return Bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN
  }
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>((u + rounding) >> 16)};
}

// Overloads so that templated references read and write float and Bf16 alike.
inline float to_float(float v) { return v; }
inline float to_float(Bf16 v) { return bf16_to_float(v); }
template <typename T>
T from_float(float v);
template <>
inline float from_float<float>(float v) {
  return v;
}
template <>
inline Bf16 from_float<Bf16>(float v) {
  return float_to_bf16(v);
}

}  // namespace keep::kernels
