// Fused residual add + RMSNorm (HF LlamaRMSNorm in fp32): residual += x; out = rmsnorm(residual) *
// w.
#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/kernels.h"

namespace keep::kernels {
namespace {

constexpr int kThreads = 256;  // a multiple of 32, at most 1024
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// One block per row (grid-strided over rows). Pass 1: each thread adds x into its elements of the
// residual, stores them, and sums their squares; a warp-then-block reduction gives the row's sum.
// Pass 2: each thread normalises the same elements it wrote (no cross-thread reads of the
// residual, so no barrier is needed between the passes beyond the reduction's).
__global__ void __launch_bounds__(kThreads)
    rmsnorm_residual_kernel(float* out,                        // (rows, cols)
                            float* residual,                   // (rows, cols)
                            const float* x,                    // (rows, cols) or null
                            const float* __restrict__ weight,  // (cols)
                            int64_t rows, int64_t cols, float eps) {
  __shared__ float partial[kWarps];
  __shared__ float inv_rms;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* res = residual + r * cols;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      float v = res[i];
      if (x != nullptr) {
        v += x[r * cols + i];
        res[i] = v;
      }
      ss += v * v;
    }
    ss = warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
      float s = lane < kWarps ? partial[lane] : 0.0f;
      s = warp_sum(s);
      if (lane == 0) inv_rms = 1.0f / sqrtf(s / static_cast<float>(cols) + eps);
    }
    __syncthreads();
    const float inv = inv_rms;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      out[r * cols + i] = weight[i] * (res[i] * inv);
    }
    __syncthreads();  // partial and inv_rms are reused by the next row
  }
}

}  // namespace

cudaError_t rmsnorm_residual(float* out, float* residual, const float* x, const float* weight,
                             int64_t rows, int64_t cols, float eps, cudaStream_t stream) {
  if (rows < 0 || cols < 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (out == nullptr || residual == nullptr || weight == nullptr) return cudaErrorInvalidValue;
  const unsigned int blocks = static_cast<unsigned int>(rows < 65536 ? rows : 65536);
  rmsnorm_residual_kernel<<<blocks, kThreads, 0, stream>>>(out, residual, x, weight, rows, cols,
                                                           eps);
  return cudaGetLastError();
}

}  // namespace keep::kernels
