// SwiGLU: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/kernels.h"

namespace keep::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void swiglu_kernel(T* out,         // (n)
                              const T* gate,  // (n)
                              const T* up,    // (n)
                              int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = detail::load(gate + i);
    detail::store(out + i, g / (1.0f + expf(-g)) * detail::load(up + i));
  }
}

template <typename T>
cudaError_t launch(T* out, const T* gate, const T* up, int64_t n, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (out == nullptr || gate == nullptr || up == nullptr) return cudaErrorInvalidValue;
  swiglu_kernel<T>
      <<<detail::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(out, gate, up, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t swiglu(float* out, const float* gate, const float* up, int64_t n, cudaStream_t stream) {
  return launch(out, gate, up, n, stream);
}
cudaError_t swiglu(__nv_bfloat16* out, const __nv_bfloat16* gate, const __nv_bfloat16* up,
                   int64_t n, cudaStream_t stream) {
  return launch(out, gate, up, n, stream);
}

}  // namespace keep::kernels
