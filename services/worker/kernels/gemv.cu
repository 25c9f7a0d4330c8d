// Few-row products for decode (kernels.h, "gemv.cu"): y = x W^T for 1 to 8 rows of x, bf16 W and
// x, fp32 accumulation. At one row a product is a read of W and nothing else; every warp here owns
// one output and streams its W row with 16-byte non-caching loads, four in flight per lane, while
// the x rows (a few KB, shared by all warps) come through L1. At one and two rows this beats
// cuBLAS (tests/gpu/test_gemm.cu times both; benchmarks/RESULTS.md); from 4 rows cuBLAS is faster
// (each W piece is reused from registers, but the x loads grow with the rows), so the CUDA backend
// uses this up to CudaBackendOptions::gemv_rows (2). Reference: ref::gemv.
#include <algorithm>
#include <cstdint>

#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/kernels.h"

namespace keep::kernels {
namespace {

constexpr int kWarps = 8;   // outputs per block
constexpr int kUnroll = 4;  // 16-byte W loads in flight per lane

__device__ __forceinline__ uint4 load_stream(const __nv_bfloat16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = __uint_as_float(w[k] << 16);  // lower address = low half
    f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}

// 8 consecutive x elements as floats: one 16-byte load of bf16, two of fp32.
__device__ __forceinline__ void load_x8(const __nv_bfloat16* p, float (&f)[8]) {
  unpack8(__ldg(reinterpret_cast<const uint4*>(p)), f);
}
__device__ __forceinline__ void load_x8(const float* p, float (&f)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x;
  f[1] = a.y;
  f[2] = a.z;
  f[3] = a.w;
  f[4] = b.x;
  f[5] = b.y;
  f[6] = b.z;
  f[7] = b.w;
}

// The products of the warp's W row `wr` (in elements) with each of the R x rows, summed over the
// warp: every lane ends with the totals in acc. load_x(r, i, f) fetches x row r's 8 elements at i
// (from global memory or shared). W streams with kUnroll 16-byte loads in flight per lane.
template <int R, typename LoadX>
__device__ __forceinline__ void warp_dot(float (&acc)[R], const __nv_bfloat16* wr, int in, int lane,
                                         LoadX load_x) {
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  // Adds the 8 products of one 16-byte piece of W (wf) with the same piece of each x row.
  auto fma_piece = [&](const float(&wf)[8], int i) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float xf[8];
      load_x(r, i, xf);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r] = fmaf(wf[e], xf[e], acc[r]);
    }
  };
  constexpr int kStep = 32 * 8;  // elements per warp-wide 16-byte load
  int i = lane * 8;
  for (; i + (kUnroll - 1) * kStep < in; i += kUnroll * kStep) {
    uint4 u[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) u[k] = load_stream(wr + i + k * kStep);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      float wf[8];
      unpack8(u[k], wf);
      fma_piece(wf, i + k * kStep);
    }
  }
  for (; i < in; i += kStep) {
    float wf[8];
    unpack8(load_stream(wr + i), wf);
    fma_piece(wf, i);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
  }
}

// Lane r < R writes row r's total of output o: bf16 or fp32, overwritten, or added (kAcc).
template <int R, typename Y, bool kAcc>
__device__ __forceinline__ void store_rows(Y* y, int64_t y_stride, int o, const float (&acc)[R],
                                           int lane) {
  if (lane >= R) return;
  float v = acc[0];
#pragma unroll
  for (int r = 1; r < R; ++r) v = lane == r ? acc[r] : v;
  Y* dst = y + static_cast<int64_t>(lane) * y_stride + o;
  if constexpr (kAcc) {
    *dst += v;
  } else if constexpr (sizeof(Y) == 4) {
    *dst = v;
  } else {
    *dst = __float2bfloat16_rn(v);
  }
}

// X = __nv_bfloat16 or float (rows of x); Y = __nv_bfloat16 (overwrite) or float (overwrite, or
// accumulate into y with kAcc). `in` % 8 == 0, x rows and W 16-byte aligned.
template <int R, typename X, typename Y, bool kAcc>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_kernel(Y* __restrict__ y, int64_t y_stride, const X* __restrict__ x, int64_t x_stride,
                const __nv_bfloat16* __restrict__ w, int out, int in) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int o = static_cast<int>(blockIdx.x) * kWarps + (static_cast<int>(threadIdx.x) >> 5);
  if (o >= out) return;
  float acc[R];
  warp_dot<R>(acc, w + static_cast<int64_t>(o) * in, in, lane,
              [&](int r, int i, float(&f)[8]) { load_x8(x + r * x_stride + i, f); });
  store_rows<R, Y, kAcc>(y, y_stride, o, acc, lane);
}

template <typename X, typename Y, bool kAcc>
cudaError_t launch(Y* y, int64_t y_stride, const X* x, int64_t x_stride, const __nv_bfloat16* w,
                   int64_t rows, int64_t out, int64_t in, cudaStream_t stream) {
  if (rows < 0 || rows > kGemvMaxRows || out < 0 || in < 0 || out > 0x7fffffff || in > 0x7fffffff ||
      y_stride < out || x_stride < in) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || out == 0) return cudaSuccess;
  if (y == nullptr || x == nullptr || w == nullptr || in % 8 != 0 || x_stride % 8 != 0 ||
      !detail::aligned16(x) || !detail::aligned16(w)) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks = static_cast<unsigned>((out + kWarps - 1) / kWarps);
  const int o = static_cast<int>(out), n = static_cast<int>(in);
  switch (rows) {
#define KEEP_GEMV_CASE(R_)                                                       \
  case R_:                                                                       \
    gemv_kernel<R_, X, Y, kAcc>                                                  \
        <<<blocks, kWarps * 32, 0, stream>>>(y, y_stride, x, x_stride, w, o, n); \
    break;
    KEEP_GEMV_CASE(1)
    KEEP_GEMV_CASE(2)
    KEEP_GEMV_CASE(3)
    KEEP_GEMV_CASE(4)
    KEEP_GEMV_CASE(5)
    KEEP_GEMV_CASE(6)
    KEEP_GEMV_CASE(7)
    KEEP_GEMV_CASE(8)
#undef KEEP_GEMV_CASE
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// ---- RMSNorm in the prologue (gemv_rmsnorm) ----
// Each block normalises the R residual rows itself into shared memory (bf16, add_rmsnorm's rule),
// then its warps take outputs grid-stride. The grid is a few blocks per SM, so the redundant norms
// cost a few reads of the rows from L2, not a kernel launch.
constexpr int kNormBlocksPerSm = 8;

__device__ __forceinline__ void load_x8_shared(const __nv_bfloat16* p, float (&f)[8]) {
  unpack8(*reinterpret_cast<const uint4*>(p), f);
}

template <int R>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_rmsnorm_kernel(__nv_bfloat16* __restrict__ y, int64_t y_stride,
                        const float* __restrict__ res, int64_t res_stride,
                        const float* __restrict__ norm_w, float eps,
                        const __nv_bfloat16* __restrict__ w, int out, int in) {
  extern __shared__ __align__(16) unsigned char x_raw[];
  __nv_bfloat16* const xs = reinterpret_cast<__nv_bfloat16*>(x_raw);  // (R, in)
  __shared__ float red[kWarps][R];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  constexpr int kThreads = kWarps * 32;

  // Sum of squares of each row.
  float ss[R];
#pragma unroll
  for (int r = 0; r < R; ++r) ss[r] = 0.0f;
  for (int i = tid * 4; i < in; i += kThreads * 4) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(res + r * res_stride + i));
      ss[r] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], off);
    if (lane == 0) red[warp][r] = ss[r];
  }
  __syncthreads();
  float inv[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float t = 0.0f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) t += red[k][r];
    inv[r] = 1.0f / sqrtf(t / static_cast<float>(in) + eps);
  }
  // x = bf16(norm_w * (res * inv)), 8 elements per step.
  for (int i = tid * 8; i < in; i += kThreads * 8) {
    const float4 n0 = __ldg(reinterpret_cast<const float4*>(norm_w + i));
    const float4 n1 = __ldg(reinterpret_cast<const float4*>(norm_w + i) + 1);
    const float nv[8] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(res + r * res_stride + i));
      const float4 b = __ldg(reinterpret_cast<const float4*>(res + r * res_stride + i) + 1);
      const float rv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      uint32_t packed[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(nv[2 * k] * (rv[2 * k] * inv[r]),
                                                       nv[2 * k + 1] * (rv[2 * k + 1] * inv[r]));
        packed[k] = static_cast<uint32_t>(__bfloat16_as_ushort(h.x)) |
                    (static_cast<uint32_t>(__bfloat16_as_ushort(h.y)) << 16);
      }
      *reinterpret_cast<uint4*>(xs + r * in + i) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
  __syncthreads();

  for (int o = static_cast<int>(blockIdx.x) * kWarps + warp; o < out;
       o += static_cast<int>(gridDim.x) * kWarps) {
    float acc[R];
    warp_dot<R>(acc, w + static_cast<int64_t>(o) * in, in, lane,
                [&](int r, int i, float(&f)[8]) { load_x8_shared(xs + r * in + i, f); });
    store_rows<R, __nv_bfloat16, false>(y, y_stride, o, acc, lane);
  }
}

}  // namespace

cudaError_t gemv(__nv_bfloat16* y, int64_t y_stride, const __nv_bfloat16* x, int64_t x_stride,
                 const __nv_bfloat16* w, int64_t rows, int64_t out, int64_t in,
                 cudaStream_t stream) {
  return launch<__nv_bfloat16, __nv_bfloat16, false>(y, y_stride, x, x_stride, w, rows, out, in,
                                                     stream);
}

cudaError_t gemv_accumulate(float* y, int64_t y_stride, const __nv_bfloat16* x, int64_t x_stride,
                            const __nv_bfloat16* w, int64_t rows, int64_t out, int64_t in,
                            cudaStream_t stream) {
  return launch<__nv_bfloat16, float, true>(y, y_stride, x, x_stride, w, rows, out, in, stream);
}

cudaError_t gemv(float* y, int64_t y_stride, const float* x, int64_t x_stride,
                 const __nv_bfloat16* w, int64_t rows, int64_t out, int64_t in,
                 cudaStream_t stream) {
  return launch<float, float, false>(y, y_stride, x, x_stride, w, rows, out, in, stream);
}

cudaError_t gemv_rmsnorm(__nv_bfloat16* y, int64_t y_stride, const float* residual,
                         int64_t residual_stride, const float* norm_weight, float eps,
                         const __nv_bfloat16* w, int64_t rows, int64_t out, int64_t in,
                         cudaStream_t stream) {
  if (rows < 0 || rows > kGemvMaxRows || out < 0 || in < 0 || out > 0x7fffffff || in > 0x7fffffff ||
      y_stride < out || residual_stride < in) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || out == 0) return cudaSuccess;
  const size_t smem = static_cast<size_t>(rows) * static_cast<size_t>(in) * 2;
  if (y == nullptr || residual == nullptr || norm_weight == nullptr || w == nullptr ||
      in % 8 != 0 || residual_stride % 4 != 0 || !detail::aligned16(residual) ||
      !detail::aligned16(norm_weight) || !detail::aligned16(w) || smem > kGemvNormMaxSmem) {
    return cudaErrorInvalidValue;
  }
  const int64_t want = (out + kWarps - 1) / kWarps;
  const unsigned blocks = static_cast<unsigned>(
      std::min<int64_t>(want, int64_t{kNormBlocksPerSm} * detail::sm_count()));
  const int o = static_cast<int>(out), n = static_cast<int>(in);
  switch (rows) {
#define KEEP_GEMV_NORM_CASE(R_)                                             \
  case R_:                                                                  \
    gemv_rmsnorm_kernel<R_><<<blocks, kWarps * 32, smem, stream>>>(         \
        y, y_stride, residual, residual_stride, norm_weight, eps, w, o, n); \
    break;
    KEEP_GEMV_NORM_CASE(1)
    KEEP_GEMV_NORM_CASE(2)
    KEEP_GEMV_NORM_CASE(3)
    KEEP_GEMV_NORM_CASE(4)
    KEEP_GEMV_NORM_CASE(5)
    KEEP_GEMV_NORM_CASE(6)
    KEEP_GEMV_NORM_CASE(7)
    KEEP_GEMV_NORM_CASE(8)
#undef KEEP_GEMV_NORM_CASE
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace keep::kernels
