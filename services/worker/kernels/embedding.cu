// Embedding gather: out[t, :] = table[ids[t], :].
#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/kernels.h"

namespace keep::kernels {
namespace {

constexpr int kThreads = 256;

// One block per token (grid-strided over tokens); threads stride over the hidden dimension.
template <typename T>
__global__ void embedding_kernel(T* __restrict__ out,              // (n, hidden)
                                 const T* __restrict__ table,      // (vocab, hidden)
                                 const int32_t* __restrict__ ids,  // (n)
                                 int64_t n, int64_t hidden, int64_t vocab) {
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t id = ids[t];
    T* o = out + t * hidden;
    if (id < 0 || id >= vocab) {
      for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) detail::store(o + i, 0.0f);
      continue;
    }
    const T* row = table + id * hidden;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = row[i];
  }
}

template <typename T>
cudaError_t launch(T* out, const T* table, const int32_t* ids, int64_t n, int64_t hidden,
                   int64_t vocab, cudaStream_t stream) {
  if (n < 0 || hidden < 0 || vocab < 0) return cudaErrorInvalidValue;
  if (n == 0 || hidden == 0) return cudaSuccess;
  if (out == nullptr || ids == nullptr || (vocab > 0 && table == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const unsigned int blocks = static_cast<unsigned int>(n < 65536 ? n : 65536);
  embedding_kernel<T><<<blocks, kThreads, 0, stream>>>(out, table, ids, n, hidden, vocab);
  return cudaGetLastError();
}

}  // namespace

cudaError_t embedding(float* out, const float* table, const int32_t* ids, int64_t n, int64_t hidden,
                      int64_t vocab, cudaStream_t stream) {
  return launch(out, table, ids, n, hidden, vocab, stream);
}
cudaError_t embedding(__nv_bfloat16* out, const __nv_bfloat16* table, const int32_t* ids, int64_t n,
                      int64_t hidden, int64_t vocab, cudaStream_t stream) {
  return launch(out, table, ids, n, hidden, vocab, stream);
}

}  // namespace keep::kernels
