// Logits kernels over fp32 logits (rows, vocab): greedy argmax and token log-probabilities
// (candidate scoring). One block of 1024 threads per row, rows grid-strided; each thread reads 4
// consecutive logits per step (one float4 when the rows are 16-byte aligned).
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>

#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/kernels.h"

namespace keep::kernels {
namespace {

constexpr int kThreads = 1024;  // one block per row, both kernels
constexpr int kWarps = kThreads / 32;
constexpr int64_t kPerStep = 4 * kThreads;  // logits a block reads per step

// Logits [i, i + 4) of a row into v; returns how many of them exist (0..4). vec: the row is 16-byte
// aligned and vocab % 4 == 0, so a whole float4 exists whenever i < vocab.
__device__ __forceinline__ int load4(const float* __restrict__ row, int64_t vocab, bool vec,
                                     int64_t i, float (&v)[4]) {
  if (i >= vocab) return 0;
  if (vec) {
    const float4 f = *reinterpret_cast<const float4*>(row + i);
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
    return 4;
  }
  const int n = vocab - i < 4 ? static_cast<int>(vocab - i) : 4;
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] = e < n ? row[i + e] : 0.0f;
  return n;
}

// ---------------------------------------------------------------------------------------------
// argmax

__device__ __forceinline__ bool better(float v, int32_t i, float bv, int32_t bi) {
  return v > bv || (v == bv && i < bi);
}

// The best (value, index) pair across the warp, in every lane.
__device__ __forceinline__ void warp_argmax(float& bv, int32_t& bi) {
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
    if (better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    argmax_kernel(int32_t* __restrict__ out,         // (rows)
                  const float* __restrict__ logits,  // (rows, vocab)
                  int64_t rows, int64_t vocab, bool vec) {
  __shared__ float s_v[kWarps];
  __shared__ int32_t s_i[kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = logits + r * vocab;
    float bv = -INFINITY;  // (−inf, INT32_MAX): nothing yet; a real −inf logit beats it on index
    int32_t bi = INT32_MAX;
    for (int64_t i = 4 * static_cast<int64_t>(threadIdx.x); i < vocab; i += kPerStep) {
      float v[4];
      const int n = load4(row, vocab, vec, i, v);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const auto idx = static_cast<int32_t>(i + e);
        if (e < n && !isnan(v[e]) && better(v[e], idx, bv, bi)) {
          bv = v[e];
          bi = idx;
        }
      }
    }
    warp_argmax(bv, bi);
    if (lane == 0) {
      s_v[warp] = bv;
      s_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
      bv = s_v[lane];
      bi = s_i[lane];
      warp_argmax(bv, bi);
      if (lane == 0) out[r] = bi == INT32_MAX ? 0 : bi;  // all NaN: token 0
    }
    __syncthreads();  // s_v / s_i are reused by the next row
  }
}

// ---------------------------------------------------------------------------------------------
// token_logprob

// (m, s) represents s * exp(m), m the running max; m == −inf is the empty sum. Infinite maxima
// leave s meaningless (the result is then m alone, see below).
__device__ __forceinline__ void lse_add(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
  } else if (m2 > m) {
    s = s * expf(m - m2) + s2;
    m = m2;
  } else {
    s += s2 * expf(m2 - m);
  }
}

// The warp's combined (m, s), in every lane.
__device__ __forceinline__ void warp_lse(float& m, float& s) {
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
    lse_add(m, s, m2, s2);
  }
}

__global__ void __launch_bounds__(kThreads)
    token_logprob_kernel(float* __restrict__ out,             // (rows)
                         const float* __restrict__ logits,    // (rows, vocab)
                         const int32_t* __restrict__ tokens,  // (rows)
                         int64_t rows, int64_t vocab, bool vec) {
  __shared__ float s_m[kWarps];
  __shared__ float s_s[kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = logits + r * vocab;
    float m = -INFINITY;
    float s = 0.0f;
    int nan = 0;
    for (int64_t i = 4 * static_cast<int64_t>(threadIdx.x); i < vocab; i += kPerStep) {
      float v[4];
      const int n = load4(row, vocab, vec, i, v);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (e >= n) continue;
        if (isnan(v[e])) {
          nan = 1;
        } else {
          lse_add(m, s, v[e], 1.0f);
        }
      }
    }
    warp_lse(m, s);
    if (lane == 0) {
      s_m[warp] = m;
      s_s[warp] = s;
    }
    const int any_nan = __syncthreads_or(nan);
    if (warp == 0) {
      m = s_m[lane];
      s = s_s[lane];
      warp_lse(m, s);
      if (lane == 0) {
        const int32_t tok = tokens[r];
        if (any_nan || tok < 0 || tok >= vocab) {
          out[r] = NAN;
        } else {
          const float lse = isinf(m) ? m : m + logf(s);
          out[r] = row[tok] - lse;
        }
      }
    }
    __syncthreads();  // s_m / s_s are reused by the next row
  }
}

bool aligned_rows(const float* logits, int64_t vocab) {
  return reinterpret_cast<uintptr_t>(logits) % 16 == 0 && vocab % 4 == 0;
}

unsigned int row_blocks(int64_t rows) {
  return static_cast<unsigned int>(rows < 65536 ? rows : 65536);
}

}  // namespace

cudaError_t argmax(int32_t* out, const float* logits, int64_t rows, int64_t vocab,
                   cudaStream_t stream) {
  if (rows < 0 || vocab < 0 || vocab > INT32_MAX) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (vocab == 0 || out == nullptr || logits == nullptr) return cudaErrorInvalidValue;
  argmax_kernel<<<row_blocks(rows), kThreads, 0, stream>>>(out, logits, rows, vocab,
                                                           aligned_rows(logits, vocab));
  return cudaGetLastError();
}

cudaError_t token_logprob(float* out, const float* logits, const int32_t* tokens, int64_t rows,
                          int64_t vocab, cudaStream_t stream) {
  if (rows < 0 || vocab < 0 || vocab > INT32_MAX) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (vocab == 0 || out == nullptr || logits == nullptr || tokens == nullptr) {
    return cudaErrorInvalidValue;
  }
  token_logprob_kernel<<<row_blocks(rows), kThreads, 0, stream>>>(out, logits, tokens, rows, vocab,
                                                                  aligned_rows(logits, vocab));
  return cudaGetLastError();
}

}  // namespace keep::kernels
