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

// Cached K/V rows into a bf16 view in one pass (the loader: keep-worker's reused segments). One
// thread per (row, head, i < half) pair: reads the pre-RoPE K pair and the V pair (bf16; from
// device memory or, zero-copy, from the registered region), rotates K in fp32 exactly as
// rope_kernel, rounds once.
__global__ void load_kv_rope_kernel(__nv_bfloat16* __restrict__ k_out,
                                    __nv_bfloat16* __restrict__ v_out,
                                    const __nv_bfloat16* __restrict__ k_pre,
                                    const __nv_bfloat16* __restrict__ v,
                                    const int32_t* __restrict__ positions,
                                    const float* __restrict__ inv_freq, int64_t n, int64_t heads,
                                    int64_t half) {
  const int64_t total = n * heads * half;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k % half;
    const int64_t h = (k / half) % heads;
    const int64_t r = k / (half * heads);
    const int64_t at = r * heads * 2 * half + h * 2 * half + i;
    const float angle = __fmul_rn(static_cast<float>(positions[r]), inv_freq[i]);
    float s;
    float c;
    sincosf(angle, &s, &c);
    const float x1 = __bfloat162float(k_pre[at]);
    const float x2 = __bfloat162float(k_pre[at + half]);
    k_out[at] = __float2bfloat16(x1 * c - x2 * s);
    k_out[at + half] = __float2bfloat16(x2 * c + x1 * s);
    v_out[at] = v[at];
    v_out[at + half] = v[at + half];
  }
}

// The same over many runs in one launch. Units of V consecutive i (< half) of one (row, head)
// are numbered across the runs in table order; thread t takes units t, t + stride, ... The run
// table is small and read by every thread (cached).
template <int V>
__global__ void load_kv_runs_kernel(const KvLoadRun* __restrict__ runs, int32_t n_runs,
                                    const float* __restrict__ inv_freq, int64_t heads,
                                    int64_t half) {
  const int64_t per_head = half / V;
  const int64_t per_row = heads * per_head;
  const int64_t row_elems = heads * 2 * half;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t base = 0;  // the first unit of run ri
  for (int32_t ri = 0; ri < n_runs; ++ri) {
    const KvLoadRun run = runs[ri];
    const int64_t units = run.count * per_row;
    // The first unit of this run that is thread t's: u >= base, u = t (mod stride).
    int64_t u = base + ((t - base) % stride + stride) % stride;
    for (; u < base + units; u += stride) {
      const int64_t k = u - base;
      const int64_t r = k / per_row;
      const int64_t h = (k / per_head) % heads;
      const int64_t i0 = (k % per_head) * V;
      const int64_t src = r * row_elems + h * 2 * half + i0;
      const int64_t dst = (run.slot + r) * row_elems + h * 2 * half + i0;
      const float pos = static_cast<float>(run.slot + r);
      if constexpr (V == 8) {
        const uint4 a = *reinterpret_cast<const uint4*>(run.k_pre + src);
        const uint4 b = *reinterpret_cast<const uint4*>(run.k_pre + src + half);
        uint4 va{}, vb{};  // loaded with K: the four reads in flight together
        if (run.v != nullptr) {
          va = *reinterpret_cast<const uint4*>(run.v + src);
          vb = *reinterpret_cast<const uint4*>(run.v + src + half);
        }
        const auto* x1 = reinterpret_cast<const __nv_bfloat16*>(&a);
        const auto* x2 = reinterpret_cast<const __nv_bfloat16*>(&b);
        uint4 oa, ob;
        auto* y1 = reinterpret_cast<__nv_bfloat16*>(&oa);
        auto* y2 = reinterpret_cast<__nv_bfloat16*>(&ob);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float s;
          float c;
          sincosf(__fmul_rn(pos, inv_freq[i0 + e]), &s, &c);
          const float f1 = __bfloat162float(x1[e]);
          const float f2 = __bfloat162float(x2[e]);
          y1[e] = __float2bfloat16(f1 * c - f2 * s);
          y2[e] = __float2bfloat16(f2 * c + f1 * s);
        }
        *reinterpret_cast<uint4*>(run.k_view + dst) = oa;
        *reinterpret_cast<uint4*>(run.k_view + dst + half) = ob;
        if (run.v != nullptr) {
          *reinterpret_cast<uint4*>(run.v_view + dst) = va;
          *reinterpret_cast<uint4*>(run.v_view + dst + half) = vb;
        }
      } else {
        float s;
        float c;
        sincosf(__fmul_rn(pos, inv_freq[i0]), &s, &c);
        const float x1 = __bfloat162float(run.k_pre[src]);
        const float x2 = __bfloat162float(run.k_pre[src + half]);
        run.k_view[dst] = __float2bfloat16(x1 * c - x2 * s);
        run.k_view[dst + half] = __float2bfloat16(x2 * c + x1 * s);
        if (run.v != nullptr) {
          run.v_view[dst] = run.v[src];
          run.v_view[dst + half] = run.v[src + half];
        }
      }
    }
    base += units;
  }
}

}  // namespace

cudaError_t load_kv_runs(const KvLoadRun* runs, int32_t n_runs, const float* inv_freq,
                         int64_t heads, int64_t head_dim, int32_t max_blocks, bool vec,
                         cudaStream_t stream) {
  if (n_runs < 0 || heads < 0 || head_dim < 0 || head_dim % 2 != 0 || max_blocks < 1 ||
      (vec && head_dim % 16 != 0)) {
    return cudaErrorInvalidValue;
  }
  if (n_runs == 0 || heads == 0 || head_dim == 0) return cudaSuccess;
  if (runs == nullptr || inv_freq == nullptr) return cudaErrorInvalidValue;
  const int64_t half = head_dim / 2;
  if (vec) {
    load_kv_runs_kernel<8>
        <<<max_blocks, kThreads, 0, stream>>>(runs, n_runs, inv_freq, heads, half);
  } else {
    load_kv_runs_kernel<1>
        <<<max_blocks, kThreads, 0, stream>>>(runs, n_runs, inv_freq, heads, half);
  }
  return cudaGetLastError();
}

cudaError_t load_kv_rope(__nv_bfloat16* k_out, __nv_bfloat16* v_out, const __nv_bfloat16* k_pre,
                         const __nv_bfloat16* v, const int32_t* positions, const float* inv_freq,
                         int64_t n, int64_t heads, int64_t head_dim, cudaStream_t stream) {
  if (n < 0 || heads < 0 || head_dim < 0 || head_dim % 2 != 0) return cudaErrorInvalidValue;
  if (n == 0 || heads == 0 || head_dim == 0) return cudaSuccess;
  if (k_out == nullptr || v_out == nullptr || k_pre == nullptr || v == nullptr ||
      positions == nullptr || inv_freq == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t half = head_dim / 2;
  load_kv_rope_kernel<<<detail::elementwise_blocks(n * heads * half, kThreads), kThreads, 0,
                        stream>>>(k_out, v_out, k_pre, v, positions, inv_freq, n, heads, half);
  return cudaGetLastError();
}

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
