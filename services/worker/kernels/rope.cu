// RoPE in place, HF half-split layout; the semantics of services/worker/engine/core/rope.h.
#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/kernels.h"

namespace keep::kernels {
namespace {

constexpr int kThreads = 256;

// One thread per (row, head, i < half) pair, grid-strided. The angle is the fp32 product
// float(pos) * inv_freq[i] (as HF and the CPU engine), its sin/cos the accurate sincosf (this
// folder never builds with fast math).
__global__ void rope_kernel(float* __restrict__ x,                  // (n, row_stride)
                            const int32_t* __restrict__ positions,  // (n)
                            const float* __restrict__ inv_freq,     // (half)
                            int64_t n, int64_t heads, int64_t half, int64_t row_stride) {
  const int64_t total = n * heads * half;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k % half;
    const int64_t h = (k / half) % heads;
    const int64_t r = k / (half * heads);
    const float angle = __fmul_rn(static_cast<float>(positions[r]), inv_freq[i]);
    float s;
    float c;
    sincosf(angle, &s, &c);
    float* xh = x + r * row_stride + h * 2 * half;
    const float x1 = xh[i];
    const float x2 = xh[i + half];
    xh[i] = x1 * c - x2 * s;
    xh[i + half] = x2 * c + x1 * s;
  }
}

}  // namespace

cudaError_t rope(float* x, const int32_t* positions, const float* inv_freq, int64_t n,
                 int64_t heads, int64_t head_dim, int64_t row_stride, cudaStream_t stream) {
  if (n < 0 || heads < 0 || head_dim < 0 || head_dim % 2 != 0 || row_stride < heads * head_dim) {
    return cudaErrorInvalidValue;
  }
  if (n == 0 || heads == 0 || head_dim == 0) return cudaSuccess;
  if (x == nullptr || positions == nullptr || inv_freq == nullptr) return cudaErrorInvalidValue;
  const int64_t half = head_dim / 2;
  rope_kernel<<<detail::elementwise_blocks(n * heads * half, kThreads), kThreads, 0, stream>>>(
      x, positions, inv_freq, n, heads, half, row_stride);
  return cudaGetLastError();
}

}  // namespace keep::kernels
