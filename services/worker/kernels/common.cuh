// Device helpers shared by the kernels of this folder (not a public header).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace keep::kernels::detail {

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Whether a pointer allows 16-byte vector accesses (host side, before choosing a kernel form).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Grid size for an elementwise kernel over `n` items, capped (the kernels stride over the rest).
inline unsigned int elementwise_blocks(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 65536 ? blocks : 65536);
}

}  // namespace keep::kernels::detail
