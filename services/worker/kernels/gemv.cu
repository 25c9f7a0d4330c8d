// Few-row products for decode (kernels.h, "gemv.cu"): y = x W^T for 1 to 8 rows of x, bf16 W and
// x, fp32 accumulation. At one row a product is a read of W and nothing else; every warp here owns
// one output and streams its W row with 16-byte non-caching loads, four in flight per lane, while
// the x rows (a few KB, shared by all warps) come through L1. H200, one row of Qwen2.5-7B's four
// products: 2.5-3.9 TB/s against cuBLAS's 1.5-3.5 (tests/gpu/test_gemm.cu prints both); from 4 rows
// cuBLAS is faster (each W piece is reused from registers, but the x loads grow with the rows), so
// the CUDA backend uses this up to CudaBackendOptions::gemv_rows (2). Reference: ref::gemv.
#include <cstdint>

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

// Adds the 8 products of one 16-byte piece of W (wf) with the same piece of each x row.
template <int R, typename X>
__device__ __forceinline__ void fma_piece(float (&acc)[R], const float (&wf)[8], const X* x,
                                          int64_t x_stride, int i) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float xf[8];
    load_x8(x + r * x_stride + i, xf);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r] = fmaf(wf[e], xf[e], acc[r]);
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
  const __nv_bfloat16* wr = w + static_cast<int64_t>(o) * in;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
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
      fma_piece<R>(acc, wf, x, x_stride, i + k * kStep);
    }
  }
  for (; i < in; i += kStep) {
    float wf[8];
    unpack8(load_stream(wr + i), wf);
    fma_piece<R>(acc, wf, x, x_stride, i);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
  }
  if (lane < R) {
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
}

template <typename X, typename Y, bool kAcc>
cudaError_t launch(Y* y, int64_t y_stride, const X* x, int64_t x_stride, const __nv_bfloat16* w,
                   int64_t rows, int64_t out, int64_t in, cudaStream_t stream) {
  if (rows < 0 || rows > kGemvMaxRows || out < 0 || in < 0 || out > 0x7fffffff || in > 0x7fffffff ||
      y_stride < out || x_stride < in) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || out == 0) return cudaSuccess;
  const auto a16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (y == nullptr || x == nullptr || w == nullptr || in % 8 != 0 || x_stride % 8 != 0 || !a16(x) ||
      !a16(w)) {
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

}  // namespace keep::kernels
