// Element-wise and normalisation kernels of the bf16 transformer block (kernels.h, "misc.cu"):
// the residual stream stays fp32, the matrix products read and write bf16, and these kernels sit
// at those boundaries. References: reference_misc.cpp.
//
// Memory-bound all of them, so each moves 16 bytes per access (8 bf16 or 2 x 4 fp32) when every
// pointer it touches is 16-byte aligned and the row widths are multiples of 8 (the vector path,
// W = 8); otherwise the same code runs one element at a time (W = 1). Row-wise kernels run one
// block per row, grid-strided over rows; element-wise ones are grid-stride loops. No fast math:
// expf and sincosf are the accurate ones, as in rope.cu.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/kernels.h"

namespace keep::kernels {

namespace {
std::atomic<bool> g_dependent_launch{true};
}  // namespace

void set_dependent_launch(bool on) { g_dependent_launch.store(on, std::memory_order_relaxed); }
bool dependent_launch() { return g_dependent_launch.load(std::memory_order_relaxed); }
bool detail::dependent_launch_on() { return dependent_launch(); }

int detail::sm_count() {
  static DeviceMemo sms;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 132;
  }
  return sms.get(device, [](int d) {
    int v = 0;
    const bool ok = cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, d) == cudaSuccess;
    if (!ok) cudaGetLastError();
    return std::pair<int, bool>{ok && v > 0 ? v : 132, ok && v > 0};
  });
}

namespace {

constexpr int kMaxGrid = 65536;  // blocks per launch; the kernels stride over the rest

using detail::aligned16;

unsigned int row_blocks(int64_t rows) {
  return static_cast<unsigned int>(rows < kMaxGrid ? rows : kMaxGrid);
}

// Threads for a block that covers `chunks` work items once: a multiple of 32 in [32, max_threads].
int threads_for(int64_t chunks, int max_threads) {
  const int64_t t = (chunks + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > max_threads ? max_threads : t));
}

// ---- W-wide loads and stores between storage and fp32 registers ----
// W == 1: one element. W a multiple of 8 (fp32: of 4): 16-byte accesses, p 16-byte aligned.

__device__ __forceinline__ void unpack_bf16x2(uint32_t w, float* v) {
  v[0] = __uint_as_float(w << 16);  // the element at the lower address is the low half
  v[1] = __uint_as_float(w & 0xffff0000u);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x = lo, both round to nearest even
  return static_cast<uint32_t>(__bfloat16_as_ushort(h.x)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(h.y)) << 16);
}

template <int W>
__device__ __forceinline__ void ld(const float* p, float (&v)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int k = 0; k < W / 4; ++k) {
      const float4 f = reinterpret_cast<const float4*>(p)[k];
      v[4 * k + 0] = f.x;
      v[4 * k + 1] = f.y;
      v[4 * k + 2] = f.z;
      v[4 * k + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = p[k];
  }
}

template <int W>
__device__ __forceinline__ void ld(const __nv_bfloat16* p, float (&v)[W]) {
  if constexpr (W % 8 == 0) {
#pragma unroll
    for (int k = 0; k < W / 8; ++k) {
      const uint4 u = reinterpret_cast<const uint4*>(p)[k];
      unpack_bf16x2(u.x, v + 8 * k + 0);
      unpack_bf16x2(u.y, v + 8 * k + 2);
      unpack_bf16x2(u.z, v + 8 * k + 4);
      unpack_bf16x2(u.w, v + 8 * k + 6);
    }
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = __bfloat162float(p[k]);
  }
}

template <int W>
__device__ __forceinline__ void st(float* p, const float (&v)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int k = 0; k < W / 4; ++k) {
      reinterpret_cast<float4*>(p)[k] =
          make_float4(v[4 * k + 0], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) p[k] = v[k];
  }
}

template <int W>
__device__ __forceinline__ void st(__nv_bfloat16* p, const float (&v)[W]) {
  if constexpr (W % 8 == 0) {
#pragma unroll
    for (int k = 0; k < W / 8; ++k) {
      uint4 u;
      u.x = pack_bf16x2(v[8 * k + 0], v[8 * k + 1]);
      u.y = pack_bf16x2(v[8 * k + 2], v[8 * k + 3]);
      u.z = pack_bf16x2(v[8 * k + 4], v[8 * k + 5]);
      u.w = pack_bf16x2(v[8 * k + 6], v[8 * k + 7]);
      reinterpret_cast<uint4*>(p)[k] = u;
    }
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) p[k] = __float2bfloat16_rn(v[k]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// ---- embedding: bf16 table -> fp32 rows ----

// The ids of embedding_host_ids, carried in the kernel's parameters: kMax of them, n used.
template <int kMax>
struct ParamIds {
  int32_t v[kMax];
  __device__ int32_t operator[](int64_t t) const { return v[t]; }
};

// One block per token (grid-strided); threads stride over the row's W-chunks. Ids: a device
// pointer (embedding) or a ParamIds (embedding_host_ids).
template <int W, typename Ids>
__global__ void embedding_kernel(float* __restrict__ out,                  // (n, hidden)
                                 const __nv_bfloat16* __restrict__ table,  // (vocab, hidden)
                                 const Ids ids,                            // (n)
                                 int64_t n, int64_t hidden, int64_t vocab) {
  const int64_t chunks = hidden / W;
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t id = ids[t];
    const bool in = id >= 0 && id < vocab;
    float* o = out + t * hidden;
    const __nv_bfloat16* row = table + (in ? id : 0) * hidden;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[W];
      if (in) {
        ld<W>(row + c * W, v);
      } else {
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] = 0.0f;
      }
      st<W>(o + c * W, v);
    }
  }
}

// Both embedding entry points: the vector form where the row width and pointers allow it.
template <typename Ids>
cudaError_t launch_embedding(float* out, const __nv_bfloat16* table, const Ids& ids, int64_t n,
                             int64_t hidden, int64_t vocab, cudaStream_t stream) {
  if (hidden % 8 == 0 && aligned16(out) && aligned16(table)) {
    embedding_kernel<8, Ids><<<row_blocks(n), threads_for(hidden / 8, 256), 0, stream>>>(
        out, table, ids, n, hidden, vocab);
  } else {
    embedding_kernel<1, Ids>
        <<<row_blocks(n), threads_for(hidden, 256), 0, stream>>>(out, table, ids, n, hidden, vocab);
  }
  return cudaGetLastError();
}

// The host's ids copied into the smallest parameter block that holds them.
template <int kMax>
cudaError_t launch_embedding_param(float* out, const __nv_bfloat16* table, const int32_t* host_ids,
                                   int64_t n, int64_t hidden, int64_t vocab, cudaStream_t stream) {
  ParamIds<kMax> ids;
  std::memcpy(ids.v, host_ids, static_cast<size_t>(n) * sizeof(int32_t));
  return launch_embedding(out, table, ids, n, hidden, vocab, stream);
}

// ---- gather_rows: fp32 rows by index ----

template <int W>
__global__ void gather_rows_kernel(float* __restrict__ out,           // (n, cols)
                                   const float* __restrict__ in,      // (>= max(rows) + 1, cols)
                                   const int32_t* __restrict__ rows,  // (n)
                                   int64_t n, int64_t cols) {
  const int64_t chunks = cols / W;
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const float* src = in + static_cast<int64_t>(rows[t]) * cols;
    float* o = out + t * cols;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[W];
      ld<W>(src + c * W, v);
      st<W>(o + c * W, v);
    }
  }
}

// ---- add_rmsnorm: fp32 residual += bf16 x [+ bias]; bf16 out = rmsnorm(residual) * weight ----

constexpr int kNormMaxThreads = 512;  // a multiple of 32
constexpr int kNormMaxWarps = kNormMaxThreads / 32;
// No register cap: with kHeld > 0 the norm's weights load with the residual, before the sum of
// squares, so a block's path has one load round trip less (the weights were read after the
// reduction, which let 32 registers hold the norm-only form and 4 blocks of 512 threads share an
// SM). Two held chunks now take 54 registers (a 14B row: 3 blocks of 320 threads an SM), and the
// norm is faster for it (benchmarks/RESULTS.md run 22).

// One block per row (grid-strided over rows). Thread tid owns the W-chunks tid + j * blockDim.x
// of the row. kHeld > 0: the launcher sized the block so that every chunk is owned with
// j < kHeld, and the thread keeps its chunks of the residual in registers between the sum of
// squares and the normalisation (loads of all its chunks issued before any arithmetic).
// kHeld == 0 (rows too wide): the normalisation pass re-reads the residual the thread itself
// wrote. No thread reads another's residual elements, so only the reduction needs barriers.
// out may equal x: each thread reads its chunks of x before writing the same chunks of out.
template <int W, int kHeld, bool kAdd>
__global__ void __launch_bounds__(kNormMaxThreads)
    add_rmsnorm_kernel(__nv_bfloat16* out,                // (rows, cols) or null
                       float* __restrict__ residual,      // (rows, cols)
                       const __nv_bfloat16* x,            // (rows, cols) or null
                       const float* __restrict__ bias,    // (cols) or null
                       const float* __restrict__ weight,  // (cols); unused when out is null
                       int64_t rows, int64_t cols, float eps) {
  __shared__ float partial[kNormMaxWarps];
  __shared__ float inv_rms;
  detail::wait_previous_grid();  // residual and x come from the previous kernels
  detail::allow_next_grid();
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t chunks = cols / W;
  constexpr int kSlots = kHeld > 0 ? kHeld : 1;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* res = residual + r * cols;
    const __nv_bfloat16* xr = kAdd ? x + r * cols : nullptr;
    float ss = 0.0f;
    float held[kSlots][W];
    float wt[kSlots][W];  // kHeld > 0: the norm's weights, loaded with the residual
    if constexpr (kHeld > 0) {
      float xs[kSlots][W];
#pragma unroll
      for (int j = 0; j < kHeld; ++j) {
        const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
        if (c < chunks) {
          ld<W>(res + c * W, held[j]);
          if constexpr (kAdd) ld<W>(xr + c * W, xs[j]);
          if (out != nullptr) ld<W>(weight + c * W, wt[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kHeld; ++j) {
        const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
        if (c < chunks) {
          if constexpr (kAdd) {
            if (bias != nullptr) {
              float b[W];
              ld<W>(bias + c * W, b);
#pragma unroll
              for (int k = 0; k < W; ++k) xs[j][k] = xs[j][k] + b[k];
            }
#pragma unroll
            for (int k = 0; k < W; ++k) held[j][k] = held[j][k] + xs[j][k];
            st<W>(res + c * W, held[j]);
          }
#pragma unroll
          for (int k = 0; k < W; ++k) ss += held[j][k] * held[j][k];
        }
      }
    } else {
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[W];
        ld<W>(res + c * W, v);
        if constexpr (kAdd) {
          float xv[W];
          ld<W>(xr + c * W, xv);
          if (bias != nullptr) {
            float b[W];
            ld<W>(bias + c * W, b);
#pragma unroll
            for (int k = 0; k < W; ++k) xv[k] = xv[k] + b[k];
          }
#pragma unroll
          for (int k = 0; k < W; ++k) v[k] = v[k] + xv[k];
          st<W>(res + c * W, v);
        }
#pragma unroll
        for (int k = 0; k < W; ++k) ss += v[k] * v[k];
      }
    }
    if (out == nullptr) continue;  // add only (uniform over the grid: no barrier skipped unevenly)

    ss = warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
      float s = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : 0.0f;
      s = warp_sum(s);
      if (lane == 0) inv_rms = 1.0f / sqrtf(s / static_cast<float>(cols) + eps);
    }
    __syncthreads();
    const float inv = inv_rms;
    __nv_bfloat16* o = out + r * cols;
    if constexpr (kHeld > 0) {
#pragma unroll
      for (int j = 0; j < kHeld; ++j) {
        const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
        if (c < chunks) {
#pragma unroll
          for (int k = 0; k < W; ++k) wt[j][k] = wt[j][k] * (held[j][k] * inv);
          st<W>(o + c * W, wt[j]);
        }
      }
    } else {
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[W];
        float w[W];
        ld<W>(res + c * W, v);
        ld<W>(weight + c * W, w);
#pragma unroll
        for (int k = 0; k < W; ++k) w[k] = w[k] * (v[k] * inv);
        st<W>(o + c * W, w);
      }
    }
    __syncthreads();  // partial and inv_rms are reused by the block's next row
  }
}

// ---- swiglu_rows: [gate | up] per row -> silu(gate) * up ----

constexpr int kSwigluThreads = 256;

// blockIdx.y strides over rows, blockIdx.x (with threads) over the row's W-chunks.
template <int W>
__global__ void swiglu_rows_kernel(__nv_bfloat16* __restrict__ out,            // (rows, inter)
                                   const __nv_bfloat16* __restrict__ gate_up,  // (rows, 2*inter)
                                   int64_t rows, int64_t inter) {
  const int64_t chunks = inter / W;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const __nv_bfloat16* gate = gate_up + r * 2 * inter;
    const __nv_bfloat16* up = gate + inter;
    __nv_bfloat16* o = out + r * inter;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      float g[W];
      float u[W];
      ld<W>(gate + c * W, g);
      ld<W>(up + c * W, u);
#pragma unroll
      for (int k = 0; k < W; ++k) g[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
      st<W>(o + c * W, g);
    }
  }
}

// ---- qkv_finish: bias, RoPE on q in place, pre-RoPE K / V out, rotated K and V to the view ----

// A block of 128 threads per row: a thread per work unit of the row (fewer rows in flight per
// SM), or a thread per (row, unit) over all rows reading the cos/sin from a table made once per
// plan, are both slower (benchmarks/RESULTS.md).
constexpr int kQkvThreads = 128;

// One block per row (grid-strided over rows). The row's cos/sin (half each) are computed once
// into shared memory, exactly as rope.cu computes them (angle = fp32 product float(pos) *
// inv_freq[i], accurate sincosf), then the threads stride over the row's work units, hc = half / W
// of them per head: first the Q heads' (unit u: head u / hc, the pairs at j = u % hc * W .. j + W
// and half + j ..), then the same over the K heads, then the V units (W consecutive elements each).
// Each unit reads and writes only its own elements.
template <int W>
__global__ void __launch_bounds__(kQkvThreads)
    qkv_finish_kernel(__nv_bfloat16* __restrict__ qkv,   // (rows, (heads + 2*kv_heads) * head_dim)
                      float* __restrict__ k_pre,         // (rows, kv_heads * head_dim) or null
                      float* __restrict__ v_out,         // (rows, kv_heads * head_dim) or null
                      __nv_bfloat16* __restrict__ kv_k,  // (capacity, kv_heads, head_dim)
                      __nv_bfloat16* __restrict__ kv_v,  // (capacity, kv_heads, head_dim)
                      const float* __restrict__ bq,      // (heads * head_dim) or null
                      const float* __restrict__ bk,      // (kv_heads * head_dim) or null
                      const float* __restrict__ bv,      // (kv_heads * head_dim) or null
                      const int32_t* __restrict__ positions,  // (rows)
                      const int32_t* __restrict__ slots,      // (rows)
                      const float* __restrict__ inv_freq,     // (head_dim / 2)
                      int64_t rows, int heads, int kv_heads, int head_dim) {
  extern __shared__ float cs[];  // cos (half), then sin (half)
  const int half = head_dim / 2;
  const int hc = half / W;
  const int q_units = heads * hc;
  const int rot_units = (heads + kv_heads) * hc;
  const int units = rot_units + kv_heads * head_dim / W;
  const int64_t qd = static_cast<int64_t>(heads) * head_dim;
  const int64_t kvd = static_cast<int64_t>(kv_heads) * head_dim;
  const int64_t stride = qd + 2 * kvd;
  detail::wait_previous_grid();  // qkv comes from the previous kernel
  detail::allow_next_grid();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float pos = static_cast<float>(positions[r]);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      const float angle = __fmul_rn(pos, inv_freq[i]);
      float s;
      float c;
      sincosf(angle, &s, &c);
      cs[i] = c;
      cs[half + i] = s;
    }
    __syncthreads();
    __nv_bfloat16* row = qkv + r * stride;
    const int64_t slot = slots[r];
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      if (u < rot_units) {
        const bool is_q = u < q_units;
        const int h = is_q ? u / hc : (u - q_units) / hc;  // head within Q or within K
        const int j = (u % hc) * W;
        __nv_bfloat16* p = row + (is_q ? 0 : qd) + static_cast<int64_t>(h) * head_dim;
        const float* b = is_q ? bq : bk;
        float x1[W];
        float x2[W];
        ld<W>(p + j, x1);
        ld<W>(p + half + j, x2);
        if (b != nullptr) {
          float b1[W];
          float b2[W];
          ld<W>(b + static_cast<int64_t>(h) * head_dim + j, b1);
          ld<W>(b + static_cast<int64_t>(h) * head_dim + half + j, b2);
#pragma unroll
          for (int k = 0; k < W; ++k) {
            x1[k] = x1[k] + b1[k];
            x2[k] = x2[k] + b2[k];
          }
        }
        if (!is_q && k_pre != nullptr) {
          float* kp = k_pre + r * kvd + static_cast<int64_t>(h) * head_dim;
          st<W>(kp + j, x1);
          st<W>(kp + half + j, x2);
        }
        float o1[W];
        float o2[W];
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const float c = cs[j + k];
          const float s = cs[half + j + k];
          o1[k] = x1[k] * c - x2[k] * s;  // as rope.cu
          o2[k] = x2[k] * c + x1[k] * s;
        }
        if (is_q) {
          st<W>(p + j, o1);
          st<W>(p + half + j, o2);
        } else {
          __nv_bfloat16* dst = kv_k + slot * kvd + static_cast<int64_t>(h) * head_dim;
          st<W>(dst + j, o1);
          st<W>(dst + half + j, o2);
        }
      } else {
        const int64_t e = static_cast<int64_t>(u - rot_units) * W;  // within the row's V
        float v[W];
        ld<W>(row + qd + kvd + e, v);
        if (bv != nullptr) {
          float b[W];
          ld<W>(bv + e, b);
#pragma unroll
          for (int k = 0; k < W; ++k) v[k] = v[k] + b[k];
        }
        if (v_out != nullptr) st<W>(v_out + r * kvd + e, v);
        st<W>(kv_v + slot * kvd + e, v);
      }
    }
    __syncthreads();  // cs is rewritten for the block's next row
  }
}

// ---- fill_uniform: counter-based uniform values (bit-identical to ref::fill_uniform) ----

// splitmix64's output function (Steele, Lea, Flood 2014); reference_misc.cpp has the same.
__host__ __device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Value i: the top 24 bits of mix64(key + (i + 1) * golden) as u = m * 2^-24 in [0, 1) (exact),
// v = fma(hi - lo, u, lo) (one rounding), one fp32 step below hi if the rounding reached hi.
__device__ __forceinline__ float uniform_at(uint64_t key, int64_t i, float lo, float hi) {
  const uint64_t z = mix64(key + (static_cast<uint64_t>(i) + 1) * 0x9e3779b97f4a7c15ull);
  const float u = __uint2float_rn(static_cast<uint32_t>(z >> 40)) * 0x1p-24f;
  const float v = __fmaf_rn(__fsub_rn(hi, lo), u, lo);
  return v < hi ? v : nextafterf(hi, lo);
}

template <int W>
__device__ __forceinline__ void fill_store(float* p, const float (&v)[W], float, float) {
  st<W>(p, v);
}

// bf16: if rounding to nearest left [lo, hi), one bf16 step back in (as the reference).
__device__ __forceinline__ uint16_t bf16_in_range(float v, float lo, float hi) {
  uint16_t b = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  if (__uint_as_float(static_cast<uint32_t>(b) << 16) < lo) {
    if ((b & 0x7fffu) == 0) {
      b = 0x0001u;
    } else if ((b & 0x8000u) != 0) {
      --b;
    } else {
      ++b;
    }
  }
  if (__uint_as_float(static_cast<uint32_t>(b) << 16) >= hi) {
    if ((b & 0x7fffu) == 0) {
      b = 0x8001u;
    } else if ((b & 0x8000u) != 0) {
      ++b;
    } else {
      --b;
    }
  }
  return b;
}

template <int W>
__device__ __forceinline__ void fill_store(__nv_bfloat16* p, const float (&v)[W], float lo,
                                           float hi) {
  if constexpr (W % 8 == 0) {
#pragma unroll
    for (int k = 0; k < W / 8; ++k) {
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        w[e] = static_cast<uint32_t>(bf16_in_range(v[8 * k + 2 * e], lo, hi)) |
               (static_cast<uint32_t>(bf16_in_range(v[8 * k + 2 * e + 1], lo, hi)) << 16);
      }
      reinterpret_cast<uint4*>(p)[k] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) p[k] = __ushort_as_bfloat16(bf16_in_range(v[k], lo, hi));
  }
}

// Grid-stride over W-chunks, then the last n % W elements one by one.
template <int W, typename T>
__global__ void fill_uniform_kernel(T* __restrict__ out,  // (n)
                                    int64_t n, uint64_t key, float lo, float hi) {
  const int64_t start = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t chunks = n / W;
  for (int64_t c = start; c < chunks; c += step) {
    float v[W];
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = uniform_at(key, c * W + k, lo, hi);
    fill_store<W>(out + c * W, v, lo, hi);
  }
  for (int64_t i = chunks * W + start; i < n; i += step) {
    const float v[1] = {uniform_at(key, i, lo, hi)};
    fill_store<1>(out + i, v, lo, hi);
  }
}

// ---- convert: fp32 <-> bf16 ----

template <int W, typename To, typename From>
__global__ void convert_kernel(To* __restrict__ out,         // (n)
                               const From* __restrict__ in,  // (n)
                               int64_t n) {
  const int64_t start = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t chunks = n / W;
  for (int64_t c = start; c < chunks; c += step) {
    float v[W];
    ld<W>(in + c * W, v);
    st<W>(out + c * W, v);
  }
  for (int64_t i = chunks * W + start; i < n; i += step) {
    float v[1];
    ld<1>(in + i, v);
    st<1>(out + i, v);
  }
}

constexpr int kElementwiseThreads = 256;

// Blocks for a grid-stride kernel over n elements taken W at a time (at least one block).
unsigned int chunk_blocks(int64_t n, int w) {
  const int64_t chunks = n / w > 0 ? n / w : 1;
  return detail::elementwise_blocks(chunks, kElementwiseThreads);
}

template <typename To, typename From>
cudaError_t launch_convert(To* out, const From* in, int64_t n, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (out == nullptr || in == nullptr) return cudaErrorInvalidValue;
  if (aligned16(out) && aligned16(in)) {
    convert_kernel<8, To, From><<<chunk_blocks(n, 8), kElementwiseThreads, 0, stream>>>(out, in, n);
  } else {
    convert_kernel<1, To, From><<<chunk_blocks(n, 1), kElementwiseThreads, 0, stream>>>(out, in, n);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fill(T* out, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t stream) {
  if (n < 0 || !(lo < hi) || !std::isfinite(hi - lo)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (out == nullptr) return cudaErrorInvalidValue;
  const uint64_t key = mix64(seed);
  if (aligned16(out)) {
    fill_uniform_kernel<8, T>
        <<<chunk_blocks(n, 8), kElementwiseThreads, 0, stream>>>(out, n, key, lo, hi);
  } else {
    fill_uniform_kernel<1, T>
        <<<chunk_blocks(n, 1), kElementwiseThreads, 0, stream>>>(out, n, key, lo, hi);
  }
  return cudaGetLastError();
}

template <int W, bool kAdd>
cudaError_t launch_add_rmsnorm_wa(__nv_bfloat16* out, float* residual, const __nv_bfloat16* x,
                                  const float* bias, const float* weight, int64_t rows,
                                  int64_t cols, float eps, cudaStream_t stream) {
  const int64_t chunks = cols / W;
  const unsigned int blocks = row_blocks(rows);
  const auto go = [&](auto kernel, int threads) {
    return detail::launch_dependent(kernel, blocks, threads, 0, stream, out, residual, x, bias,
                                    weight, rows, cols, eps);
  };
  // Registers for up to 4 chunks a thread, the block as narrow as covers the row that way: one
  // chunk a thread up to 256 threads, then two (the widest block the fewest registers allow),
  // then four.
  if (chunks <= 256) return go(add_rmsnorm_kernel<W, 1, kAdd>, threads_for(chunks, 256));
  if (chunks <= 2 * kNormMaxThreads) {
    return go(add_rmsnorm_kernel<W, 2, kAdd>, threads_for((chunks + 1) / 2, kNormMaxThreads));
  }
  if (chunks <= 4 * kNormMaxThreads) {
    return go(add_rmsnorm_kernel<W, 4, kAdd>, threads_for((chunks + 3) / 4, kNormMaxThreads));
  }
  return go(add_rmsnorm_kernel<W, 0, kAdd>, kNormMaxThreads);
}

template <int W>
cudaError_t launch_add_rmsnorm_w(__nv_bfloat16* out, float* residual, const __nv_bfloat16* x,
                                 const float* bias, const float* weight, int64_t rows, int64_t cols,
                                 float eps, cudaStream_t stream) {
  return x != nullptr ? launch_add_rmsnorm_wa<W, true>(out, residual, x, bias, weight, rows, cols,
                                                       eps, stream)
                      : launch_add_rmsnorm_wa<W, false>(out, residual, x, bias, weight, rows, cols,
                                                        eps, stream);
}

}  // namespace

cudaError_t qkv_finish(__nv_bfloat16* qkv, float* k_pre, float* v_out, __nv_bfloat16* kv_k,
                       __nv_bfloat16* kv_v, const float* bq, const float* bk, const float* bv,
                       const int32_t* positions, const int32_t* slots, const float* inv_freq,
                       int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       cudaStream_t stream) {
  if (rows < 0 || heads < 0 || kv_heads < 0 || head_dim < 0 || head_dim % 2 != 0) {
    return cudaErrorInvalidValue;
  }
  // Per-row sizes are ints in the kernel; the cos/sin of a row must fit the default shared memory.
  if ((heads + 2 * kv_heads) * head_dim > INT32_MAX / 2 || head_dim * sizeof(float) > 48 * 1024) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || head_dim == 0 || heads + kv_heads == 0) return cudaSuccess;
  if (qkv == nullptr || kv_k == nullptr || kv_v == nullptr || positions == nullptr ||
      slots == nullptr || inv_freq == nullptr) {
    return cudaErrorInvalidValue;
  }
  const bool vec = (head_dim / 2) % 8 == 0 && aligned16(qkv) && aligned16(k_pre) &&
                   aligned16(v_out) && aligned16(kv_k) && aligned16(kv_v) && aligned16(bq) &&
                   aligned16(bk) && aligned16(bv);
  const size_t smem = static_cast<size_t>(head_dim) * sizeof(float);
  const int h = static_cast<int>(heads);
  const int kvh = static_cast<int>(kv_heads);
  const int hd = static_cast<int>(head_dim);
  return detail::launch_dependent(vec ? qkv_finish_kernel<8> : qkv_finish_kernel<1>,
                                  row_blocks(rows), kQkvThreads, smem, stream, qkv, k_pre, v_out,
                                  kv_k, kv_v, bq, bk, bv, positions, slots, inv_freq, rows, h, kvh,
                                  hd);
}

cudaError_t embedding(float* out, const __nv_bfloat16* table, const int32_t* ids, int64_t n,
                      int64_t hidden, int64_t vocab, cudaStream_t stream) {
  if (n < 0 || hidden < 0 || vocab < 0) return cudaErrorInvalidValue;
  if (n == 0 || hidden == 0) return cudaSuccess;
  if (out == nullptr || ids == nullptr || (vocab > 0 && table == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return launch_embedding(out, table, ids, n, hidden, vocab, stream);
}

cudaError_t embedding_host_ids(float* out, const __nv_bfloat16* table, const int32_t* host_ids,
                               int64_t n, int64_t hidden, int64_t vocab, cudaStream_t stream) {
  if (n < 0 || hidden < 0 || vocab < 0 || n > kEmbedParamIds) return cudaErrorInvalidValue;
  if (n == 0 || hidden == 0) return cudaSuccess;
  if (out == nullptr || host_ids == nullptr || (vocab > 0 && table == nullptr)) {
    return cudaErrorInvalidValue;
  }
  // The smallest parameter block that holds the ids (a decode step's launch carries 64 bytes).
  if (n <= 16) return launch_embedding_param<16>(out, table, host_ids, n, hidden, vocab, stream);
  if (n <= 1024) {
    return launch_embedding_param<1024>(out, table, host_ids, n, hidden, vocab, stream);
  }
  return launch_embedding_param<kEmbedParamIds>(out, table, host_ids, n, hidden, vocab, stream);
}

cudaError_t add_rmsnorm(__nv_bfloat16* out, float* residual, const __nv_bfloat16* x,
                        const float* bias, const float* weight, int64_t rows, int64_t cols,
                        float eps, cudaStream_t stream) {
  if (rows < 0 || cols < 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0 || (out == nullptr && x == nullptr)) return cudaSuccess;
  if (residual == nullptr || (out != nullptr && weight == nullptr)) return cudaErrorInvalidValue;
  const bool vec = cols % 8 == 0 && aligned16(out) && aligned16(residual) && aligned16(x) &&
                   aligned16(bias) && aligned16(weight);
  return vec ? launch_add_rmsnorm_w<8>(out, residual, x, bias, weight, rows, cols, eps, stream)
             : launch_add_rmsnorm_w<1>(out, residual, x, bias, weight, rows, cols, eps, stream);
}

cudaError_t gather_rows(float* out, const float* in, const int32_t* rows, int64_t n, int64_t cols,
                        cudaStream_t stream) {
  if (n < 0 || cols < 0) return cudaErrorInvalidValue;
  if (n == 0 || cols == 0) return cudaSuccess;
  if (out == nullptr || in == nullptr || rows == nullptr) return cudaErrorInvalidValue;
  if (cols % 4 == 0 && aligned16(out) && aligned16(in)) {
    gather_rows_kernel<4>
        <<<row_blocks(n), threads_for(cols / 4, 256), 0, stream>>>(out, in, rows, n, cols);
  } else {
    gather_rows_kernel<1>
        <<<row_blocks(n), threads_for(cols, 256), 0, stream>>>(out, in, rows, n, cols);
  }
  return cudaGetLastError();
}

cudaError_t swiglu_rows(__nv_bfloat16* out, const __nv_bfloat16* gate_up, int64_t rows,
                        int64_t inter, cudaStream_t stream) {
  if (rows < 0 || inter < 0) return cudaErrorInvalidValue;
  if (rows == 0 || inter == 0) return cudaSuccess;
  if (out == nullptr || gate_up == nullptr) return cudaErrorInvalidValue;
  const bool vec = inter % 8 == 0 && aligned16(out) && aligned16(gate_up);
  const int64_t chunks = vec ? inter / 8 : inter;
  const int64_t bx = (chunks + kSwigluThreads - 1) / kSwigluThreads;
  const dim3 grid(static_cast<unsigned int>(bx < kMaxGrid ? bx : kMaxGrid),
                  static_cast<unsigned int>(rows < 65535 ? rows : 65535));
  if (vec) {
    swiglu_rows_kernel<8><<<grid, kSwigluThreads, 0, stream>>>(out, gate_up, rows, inter);
  } else {
    swiglu_rows_kernel<1><<<grid, kSwigluThreads, 0, stream>>>(out, gate_up, rows, inter);
  }
  return cudaGetLastError();
}

cudaError_t fill_uniform(__nv_bfloat16* out, int64_t n, uint64_t seed, float lo, float hi,
                         cudaStream_t stream) {
  return launch_fill(out, n, seed, lo, hi, stream);
}
cudaError_t fill_uniform(float* out, int64_t n, uint64_t seed, float lo, float hi,
                         cudaStream_t stream) {
  return launch_fill(out, n, seed, lo, hi, stream);
}

cudaError_t convert(__nv_bfloat16* out, const float* in, int64_t n, cudaStream_t stream) {
  return launch_convert(out, in, n, stream);
}
cudaError_t convert(float* out, const __nv_bfloat16* in, int64_t n, cudaStream_t stream) {
  return launch_convert(out, in, n, stream);
}

}  // namespace keep::kernels
