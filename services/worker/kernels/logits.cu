// Logits kernels over fp32 logits (rows, vocab): greedy argmax, token log-probabilities (candidate
// scoring) and temperature / top-k / top-p sampling. One block of 1024 threads per row, rows
// grid-strided; each thread reads 4 consecutive logits per step (one float4 when the rows are
// 16-byte aligned).
//
// sample reproduces ref::sample (reference_logits.cpp, where the exact rule is written out) bit for
// bit: token masses are integers w_i = floor(p_i * 2^40) with p_i from our own fma polynomial
// (exp_neg, the same code as the reference's), so counts, masses and the draw are exact. The keep
// set (the shortest prefix of the tokens ordered by (logit desc, index asc) whose mass reaches the
// target, cut to top_k tokens) is found without sorting, by narrowing an interval of order keys
// (order_key: logit order as uint32) that holds the pivot, the key of the last kept token:
//   - pass 1 counts tokens and sums masses into 8 bins of keys placed at fixed distances below the
//     max (in units of the temperature), which gives the total mass W as well;
//   - each further pass splits the interval into 8 bins again (thresholds spread both uniformly
//     in key and in value), over the row in global memory, or over a compacted copy in shared
//     memory (key, mass) once the interval holds at most kCompactCap tokens;
//   - the bin kept is the highest one whose cumulative count / mass from the top satisfies the
//     cut (mass >= target or count >= top_k); its cumulative above is carried along. Per-thread bin
//     counters in shared memory avoid atomics.
// With the pivot key λ known, the kept tokens are those with key > λ plus the first jf tokens (in
// index order) with key == λ; a final pass walks the row in index order (block-wide scans per chunk
// of 4096 logits) to the token where the running kept mass passes t = floor(u * kept_mass).
// top_p == 1 without top_k skips the search: every token with mass is kept.
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>

#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/kernels.h"

namespace keep::kernels {
namespace {

constexpr int kThreads = 1024;  // one block per row, all three kernels
constexpr int kWarps = kThreads / 32;
constexpr int64_t kPerStep = 4 * kThreads;  // logits a block reads per step

constexpr int kBins = 8;                    // sample: bins per narrowing pass
constexpr int kCompactCap = 8192;           // sample: tokens the shared-memory copy holds
constexpr uint64_t kUnitMass = 1ull << 40;  // mass of p == 1
constexpr size_t kSampleSmem =
    static_cast<size_t>(kBins) * kThreads * (sizeof(uint64_t) + sizeof(uint32_t)) +
    static_cast<size_t>(kCompactCap) * (sizeof(uint64_t) + sizeof(uint32_t));
static_assert(kWarps == 4 * kBins, "bin reduction: 4 warps per bin");

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

// ---------------------------------------------------------------------------------------------
// sample

// Logit order as uint32: a < b iff key(a) < key(b); −0 and +0 share a key; NaN is 0 (below −inf,
// whose key is 0x007fffff). The largest key, +inf's, is 0xff800000, so key + 1 never wraps.
__device__ __forceinline__ uint32_t order_key(float v) {
  if (isnan(v)) return 0u;
  uint32_t b = __float_as_uint(v);
  if (b == 0x80000000u) b = 0u;
  return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}

// Inverse of order_key (key 0 gives a NaN).
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) != 0u ? (k & 0x7fffffffu) : ~k);
}

// exp(y) for y in [-28, 0]: exactly reference_logits.cpp's exp_neg (explicit roundings, no
// contraction), so both sides get the same bits.
__device__ __forceinline__ float exp_neg(float y) {
  const float k = rintf(__fmul_rn(y, 1.44269504088896341f));  // in [-41, 0]
  float r = fmaf(k, -0.693359375f, y);
  r = fmaf(k, 2.12194440e-4f, r);
  float q = 1.9875691500e-4f;
  q = fmaf(q, r, 1.3981999507e-3f);
  q = fmaf(q, r, 8.3334519073e-3f);
  q = fmaf(q, r, 4.1665795894e-2f);
  q = fmaf(q, r, 1.6666665459e-1f);
  q = fmaf(q, r, 5.0000001201e-1f);
  q = fmaf(q, r, 1.0f);
  const float e = fmaf(q, r, 1.0f);
  const float scale = __uint_as_float(static_cast<uint32_t>(127 + static_cast<int>(k)) << 23);
  return __fmul_rn(e, scale);
}

// A token's mass w = floor(p * 2^40) (reference_logits.cpp's token_mass).
__device__ __forceinline__ uint64_t token_mass(float l, float mx, float inv_t) {
  if (isnan(l)) return 0;
  if (l == mx) return kUnitMass;
  const float y = __fmul_rn(__fsub_rn(l, mx), inv_t);
  if (!(y >= -28.0f)) return 0;
  return __float2ull_rz(__fmul_rn(exp_neg(y), 0x1p40f));
}

// Per-row state of the sample kernel, in static shared memory. Written by thread 0 between
// barriers (or atomically where noted), read by all.
struct SampleShared {
  uint64_t part_mass[kBins][4];  // bin reduction: per bin, per quarter of the block
  uint64_t scan_mass[kWarps];    // block scans
  uint64_t chunk_mass;
  uint64_t total;     // W
  uint64_t target;    // mass the kept prefix must reach
  uint64_t m_above;   // mass of the tokens with key > khi
  uint64_t m_int;     // mass of the tokens with key in [klo, khi]
  uint64_t w_lambda;  // mass of one token with key == lambda
  uint64_t t;         // the draw: floor(u * kept_mass)
  uint32_t part_cnt[kBins][4];
  uint32_t scan_cnt[kWarps];
  uint32_t chunk_cnt;
  uint32_t thr[kBins + 1];  // bin b holds keys [thr[b], thr[b + 1]); thr[0] = klo, thr[8] = khi + 1
  uint32_t klo, khi;        // the interval of keys that holds the pivot
  uint32_t c_above, c_int;  // counts, as m_above / m_int
  uint32_t lambda, jf;      // kept: key > lambda, and the first jf tokens with key == lambda
  uint32_t n_compact;       // tokens in the shared-memory copy (atomic)
  float mx;
  float red[kWarps];
  int32_t found;      // the drawn token (atomicMin), INT32_MAX until found
  int32_t last_kept;  // fallback (atomicMax)
  int mode;           // 0: done (all NaN), 1: keep everything, 2: search
  int in_smem;        // the interval's tokens are in the shared-memory copy
};

// Bin of a key: the largest b in 0..7 with key >= thr[b] (thr sorted, key >= thr[0]).
__device__ __forceinline__ int bin_of(const SampleShared& sh, uint32_t key) {
  int b = key >= sh.thr[4] ? 4 : 0;
  if (key >= sh.thr[b + 2]) b += 2;
  if (key >= sh.thr[b + 1]) b += 1;
  return b;
}

// Counts and masses of the tokens with key in [lo, hi] per bin of sh.thr, from the row or from
// the shared-memory copy, into sh.part_cnt / sh.part_mass (summed over quarters by the caller).
// Ends with a barrier.
__device__ void bins_pass(SampleShared& sh, uint32_t* bin_cnt, uint64_t* bin_mass,
                          const uint32_t* ckey, const uint64_t* cmass, bool from_copy,
                          const float* __restrict__ row, int64_t vocab, bool vec, float mx,
                          float inv_t, uint32_t lo, uint32_t hi) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int b = 0; b < kBins; ++b) {
    bin_cnt[b * kThreads + tid] = 0;
    bin_mass[b * kThreads + tid] = 0;
  }
  if (from_copy) {
    const int n = static_cast<int>(sh.n_compact);
    for (int i = tid; i < n; i += kThreads) {
      const uint32_t key = ckey[i];
      if (key < lo || key > hi) continue;
      const int b = bin_of(sh, key);
      bin_cnt[b * kThreads + tid] += 1;
      bin_mass[b * kThreads + tid] += cmass[i];
    }
  } else {
    for (int64_t i = 4 * static_cast<int64_t>(tid); i < vocab; i += kPerStep) {
      float v[4];
      const int n = load4(row, vocab, vec, i, v);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t key = order_key(v[e]);
        if (e >= n || key < lo || key > hi) continue;
        const int b = bin_of(sh, key);
        bin_cnt[b * kThreads + tid] += 1;
        bin_mass[b * kThreads + tid] += token_mass(v[e], mx, inv_t);
      }
    }
  }
  __syncthreads();
  // Warp w sums bin w % 8 over the quarter w / 8 of the threads.
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int b = warp % kBins;
  const int quarter = warp / kBins;
  uint32_t c = 0;
  uint64_t m = 0;
#pragma unroll
  for (int j = 0; j < kThreads / 4 / 32; ++j) {
    const int t = quarter * (kThreads / 4) + j * 32 + lane;
    c += bin_cnt[b * kThreads + t];
    m += bin_mass[b * kThreads + t];
  }
  for (int off = 16; off > 0; off >>= 1) {
    c += __shfl_xor_sync(0xffffffffu, c, off);
    m += __shfl_xor_sync(0xffffffffu, m, off);
  }
  if (lane == 0) {
    sh.part_cnt[b][quarter] = c;
    sh.part_mass[b][quarter] = m;
  }
  __syncthreads();
}

// Thread 0: the bin totals of the last bins_pass.
__device__ __forceinline__ void bin_totals(const SampleShared& sh, uint32_t (&cnt)[kBins],
                                           uint64_t (&mass)[kBins]) {
  for (int b = 0; b < kBins; ++b) {
    cnt[b] = sh.part_cnt[b][0] + sh.part_cnt[b][1] + sh.part_cnt[b][2] + sh.part_cnt[b][3];
    mass[b] = sh.part_mass[b][0] + sh.part_mass[b][1] + sh.part_mass[b][2] + sh.part_mass[b][3];
  }
}

// Thread 0: narrow [klo, khi] to the highest bin whose cumulative count / mass (with everything
// above it) satisfies the cut. Invariant: the cut holds at klo (cumulative from klo up) and fails
// above khi (c_above, m_above), so the pivot lies in [klo, khi]; bin 0's cumulative is the one at
// klo, so a bin is always found.
__device__ void choose_bin(SampleShared& sh, const uint32_t (&cnt)[kBins],
                           const uint64_t (&mass)[kBins], int64_t top_k) {
  uint32_t c_above = sh.c_above;
  uint64_t m_above = sh.m_above;
  int b = kBins - 1;
  for (; b > 0; --b) {
    const uint32_t c = c_above + cnt[b];
    const uint64_t m = m_above + mass[b];
    if (m >= sh.target || (top_k > 0 && c >= top_k)) break;
    c_above = c;
    m_above = m;
  }
  sh.klo = sh.thr[b];
  sh.khi = sh.thr[b + 1] - 1;
  sh.c_above = c_above;
  sh.m_above = m_above;
  sh.c_int = cnt[b];
  sh.m_int = mass[b];
}

// Thread 0: thresholds for a narrowing pass over [klo, khi] (klo < khi): 4 spread uniformly in key
// and 3 uniformly in value (which matters when the interval spans binades), each within
// [klo + 1, khi] so that every pass narrows the interval. Where they fall only affects speed.
__device__ void place_thresholds(SampleShared& sh) {
  const uint32_t lo = sh.klo;
  const uint32_t hi = sh.khi;
  const uint64_t span = hi - lo;
  uint32_t c[kBins - 1];
  for (int j = 0; j < 4; ++j) c[j] = lo + static_cast<uint32_t>(span * (j + 1) / 5);
  const float vlo = key_value(lo);
  const float vhi = key_value(hi);
  for (int j = 0; j < 3; ++j) {
    if (isfinite(vlo) && isfinite(vhi)) {
      const double v = static_cast<double>(vlo) +
                       (static_cast<double>(vhi) - static_cast<double>(vlo)) * (0.25 * (j + 1));
      c[4 + j] = order_key(static_cast<float>(v));
    } else {
      c[4 + j] = lo + static_cast<uint32_t>(span * (j + 1) / 4);
    }
  }
  for (int j = 0; j < kBins - 1; ++j) c[j] = min(max(c[j], lo + 1), hi);
  for (int j = 1; j < kBins - 1; ++j) {  // insertion sort
    const uint32_t x = c[j];
    int i = j - 1;
    while (i >= 0 && c[i] > x) {
      c[i + 1] = c[i];
      --i;
    }
    c[i + 1] = x;
  }
  sh.thr[0] = lo;
  for (int j = 0; j < kBins - 1; ++j) sh.thr[j + 1] = c[j];
  sh.thr[kBins] = hi + 1;
}

// Copies the tokens with key in [klo, khi] (key, mass) into shared memory; the caller made sure
// they fit. Ends with a barrier.
__device__ void compact(SampleShared& sh, uint32_t* ckey, uint64_t* cmass,
                        const float* __restrict__ row, int64_t vocab, bool vec, float mx,
                        float inv_t) {
  const int lane = threadIdx.x % 32;
  const uint32_t lo = sh.klo;
  const uint32_t hi = sh.khi;
  for (int64_t base = 0; base < vocab; base += kPerStep) {  // uniform trip count: ballots below
    const int64_t i = base + 4 * static_cast<int64_t>(threadIdx.x);
    float v[4];
    const int n = load4(row, vocab, vec, i, v);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t key = order_key(v[e]);
      const bool in = e < n && key >= lo && key <= hi;
      const unsigned mask = __ballot_sync(0xffffffffu, in);
      if (mask == 0u) continue;
      const int leader = __ffs(mask) - 1;
      uint32_t pos = 0;
      if (lane == leader) pos = atomicAdd(&sh.n_compact, static_cast<uint32_t>(__popc(mask)));
      pos = __shfl_sync(0xffffffffu, pos, leader);
      if (in) {
        pos += static_cast<uint32_t>(__popc(mask & ((1u << lane) - 1u)));
        if (pos < static_cast<uint32_t>(kCompactCap)) {
          ckey[pos] = key;
          cmass[pos] = token_mass(v[e], mx, inv_t);
        }
      }
    }
  }
  __syncthreads();
}

// Inclusive scan of (count, mass) pairs across one warp's lanes, in place.
__device__ __forceinline__ void warp_inclusive_scan(uint32_t& c, uint64_t& m, int lane) {
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t oc = __shfl_up_sync(0xffffffffu, c, off);
    const uint64_t om = __shfl_up_sync(0xffffffffu, m, off);
    if (lane >= off) {
      c += oc;
      m += om;
    }
  }
}

// Inclusive block scan of (count, mass) pairs; returns the exclusive prefix of this thread and
// leaves the block totals in sh.chunk_cnt / sh.chunk_mass. Two barriers; the caller must barrier
// again before the next call (the scan scratch is reused).
__device__ __forceinline__ void block_scan(SampleShared& sh, uint32_t c, uint64_t m,
                                           uint32_t& c_excl, uint64_t& m_excl) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  uint32_t ic = c;
  uint64_t im = m;
  warp_inclusive_scan(ic, im, lane);
  if (lane == 31) {
    sh.scan_cnt[warp] = ic;
    sh.scan_mass[warp] = im;
  }
  __syncthreads();
  if (warp == 0) {
    const uint32_t wc = sh.scan_cnt[lane];
    const uint64_t wm = sh.scan_mass[lane];
    uint32_t sc = wc;
    uint64_t sm = wm;
    warp_inclusive_scan(sc, sm, lane);
    sh.scan_cnt[lane] = sc - wc;  // exclusive prefix of warp `lane`
    sh.scan_mass[lane] = sm - wm;
    if (lane == 31) {
      sh.chunk_cnt = sc;
      sh.chunk_mass = sm;
    }
  }
  __syncthreads();
  c_excl = sh.scan_cnt[warp] + (ic - c);
  m_excl = sh.scan_mass[warp] + (im - m);
}

__global__ void __launch_bounds__(kThreads, 1)
    sample_kernel(int32_t* __restrict__ out,           // (rows)
                  const float* __restrict__ logits,    // (rows, vocab)
                  const float* __restrict__ uniforms,  // (rows)
                  int64_t rows, int64_t vocab, bool vec, float temperature, float inv_t,
                  float top_p,
                  int64_t top_k) {  // 0: no cap (already 0 when >= vocab)
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* bin_mass = reinterpret_cast<uint64_t*>(smem);                // (kBins, kThreads)
  uint64_t* cmass = bin_mass + kBins * kThreads;                         // (kCompactCap)
  uint32_t* bin_cnt = reinterpret_cast<uint32_t*>(cmass + kCompactCap);  // (kBins, kThreads)
  uint32_t* ckey = bin_cnt + kBins * kThreads;                           // (kCompactCap)
  __shared__ SampleShared sh;

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = logits + r * vocab;
    if (tid == 0) {
      sh.found = INT32_MAX;
      sh.last_kept = -1;
      sh.n_compact = 0;
      sh.in_smem = 0;
    }

    // ---- max of the non-NaN logits ----
    float mx = -INFINITY;
    for (int64_t i = 4 * static_cast<int64_t>(tid); i < vocab; i += kPerStep) {
      float v[4];
      const int n = load4(row, vocab, vec, i, v);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (e < n) mx = fmaxf(mx, v[e]);  // fmaxf drops NaN
      }
    }
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) sh.red[warp] = mx;
    __syncthreads();
    if (warp == 0) {
      mx = sh.red[lane];
      for (int off = 16; off > 0; off >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      }
      if (lane == 0) {
        sh.mx = mx;
        // Pass 1's bins: keys below thr[1] = key(mx − 30 T) have y < −28 (no mass) and are
        // skipped; the others fall at 14, 8, 4.5, 2.5 and 1 temperatures below the max, and the
        // max itself gets a bin of its own.
        const uint32_t top = order_key(mx);
        const float dist[kBins - 2] = {30.0f, 14.0f, 8.0f, 4.5f, 2.5f, 1.0f};
        uint32_t prev = 1;
        sh.thr[0] = 0;
        for (int j = 0; j < kBins - 2; ++j) {
          const uint32_t k = order_key(mx - dist[j] * temperature);
          prev = min(max(k, prev), top);
          sh.thr[j + 1] = prev;
        }
        sh.thr[kBins - 1] = top;
        sh.thr[kBins] = top + 1;
        sh.klo = 0;
        sh.khi = top;
        sh.c_above = 0;
        sh.m_above = 0;
      }
    }
    __syncthreads();
    mx = sh.mx;

    // ---- pass 1: total mass and the first bins ----
    bins_pass(sh, bin_cnt, bin_mass, ckey, cmass, false, row, vocab, vec, mx, inv_t, sh.thr[1],
              sh.khi);
    if (tid == 0) {
      uint32_t cnt[kBins];
      uint64_t mass[kBins];
      bin_totals(sh, cnt, mass);
      uint32_t above0 = 0;
      uint64_t total = 0;
      for (int b = 1; b < kBins; ++b) above0 += cnt[b];
      for (int b = 0; b < kBins; ++b) total += mass[b];
      cnt[0] = static_cast<uint32_t>(vocab) - above0;  // the skipped tokens: no mass
      sh.total = total;
      uint64_t target = total;
      if (top_p < 1.0f) {
        const double c = ceil(static_cast<double>(top_p) * static_cast<double>(total));
        const auto ci = static_cast<uint64_t>(c);
        target = ci < 1 ? 1 : (ci > total ? total : ci);
      }
      sh.target = target;
      if (total == 0) {
        sh.mode = 0;
        out[r] = 0;  // all NaN
      } else if (top_p >= 1.0f && top_k == 0) {
        sh.mode = 1;
        sh.lambda = 0;  // every non-NaN token (the NaN ones have no mass anyway)
        sh.jf = 0;
        sh.w_lambda = 0;
        sh.m_above = total;
      } else {
        sh.mode = 2;
        choose_bin(sh, cnt, mass, top_k);
      }
    }
    __syncthreads();
    const int mode = sh.mode;
    if (mode == 0) continue;  // uniform; the next row starts after the barrier above

    // ---- narrow the pivot interval ----
    if (mode == 2) {
      for (int iter = 0; iter < 64; ++iter) {  // 32 bits, >= 2 bits a pass: never reaches 64
        if (sh.klo >= sh.khi) break;           // uniform: written before the last barrier
        if (!sh.in_smem && sh.c_int <= static_cast<uint32_t>(kCompactCap)) {
          compact(sh, ckey, cmass, row, vocab, vec, mx, inv_t);
          if (tid == 0) sh.in_smem = 1;
        }
        if (tid == 0) place_thresholds(sh);
        __syncthreads();
        bins_pass(sh, bin_cnt, bin_mass, ckey, cmass, sh.in_smem != 0, row, vocab, vec, mx, inv_t,
                  sh.klo, sh.khi);
        if (tid == 0) {
          uint32_t cnt[kBins];
          uint64_t mass[kBins];
          bin_totals(sh, cnt, mass);
          choose_bin(sh, cnt, mass, top_k);
        }
        __syncthreads();
      }
      if (tid == 0) {
        // The pivot: key lambda = klo, its c_int tokens all have the same mass.
        const uint64_t target = sh.target;
        const uint32_t c_g = sh.c_int;
        const uint64_t w = c_g > 0 ? sh.m_int / c_g : 0;
        uint32_t jf = UINT32_MAX;
        if (sh.m_above + sh.m_int >= target && w > 0) {
          jf = static_cast<uint32_t>((target - sh.m_above + w - 1) / w);
        }
        if (top_k > 0 && sh.c_above + c_g >= top_k) {
          jf = min(jf, static_cast<uint32_t>(top_k - sh.c_above));
        }
        if (jf == UINT32_MAX) jf = c_g;  // unreachable: the cut holds at klo
        sh.lambda = sh.klo;
        sh.jf = jf;
        sh.w_lambda = w;
        sh.m_above += static_cast<uint64_t>(jf) * w;  // now the kept mass
      }
    }
    if (tid == 0) {
      double u = uniforms[r];
      if (!(u > 0.0)) u = 0.0;
      u = fmin(u, static_cast<double>(0x1.fffffep-1f));
      sh.t = static_cast<uint64_t>(u * static_cast<double>(sh.m_above));
    }
    __syncthreads();

    // ---- the draw: walk the kept tokens in index order ----
    const uint32_t lambda = sh.lambda;
    const uint32_t jf = sh.jf;
    const uint64_t w_lambda = sh.w_lambda;
    const uint64_t t = sh.t;
    uint32_t carry_c = 0;  // tokens with key == lambda before this chunk
    uint64_t carry_m = 0;  // mass of the tokens with key > lambda before this chunk
    int32_t last = -1;
    for (int64_t base = 0; base < vocab; base += kPerStep) {
      const int64_t i = base + 4 * static_cast<int64_t>(tid);
      float v[4];
      const int n = load4(row, vocab, vec, i, v);
      uint64_t w[4];
      unsigned gt = 0, eq = 0;  // bit e: element e has key > / == lambda
      uint32_t c = 0;
      uint64_t m = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        w[e] = 0;
        if (e >= n) continue;
        const uint32_t key = order_key(v[e]);
        if (key > lambda) {
          gt |= 1u << e;
          w[e] = token_mass(v[e], mx, inv_t);
          m += w[e];
        } else if (key == lambda) {
          eq |= 1u << e;
          ++c;
        }
      }
      uint32_t c_excl;
      uint64_t m_excl;
      block_scan(sh, c, m, c_excl, m_excl);
      uint32_t eq_before = carry_c + c_excl;
      uint64_t run = carry_m + m_excl + w_lambda * min(eq_before, jf);
      carry_c += sh.chunk_cnt;
      carry_m += sh.chunk_mass;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        uint64_t mm;
        if ((gt >> e) & 1u) {
          mm = w[e];
        } else if ((eq >> e) & 1u) {
          const bool kept = eq_before < jf;
          ++eq_before;
          if (!kept) continue;
          mm = w_lambda;
        } else {
          continue;
        }
        const auto idx = static_cast<int32_t>(i + e);
        last = idx;
        if (run <= t && t - run < mm) atomicMin(&sh.found, idx);
        run += mm;
      }
      __syncthreads();
      if (sh.found != INT32_MAX) break;  // uniform
    }
    if (sh.found == INT32_MAX) {  // unreachable while kept_mass > 0; kept for safety
      if (last >= 0) atomicMax(&sh.last_kept, last);
      __syncthreads();
      if (tid == 0) out[r] = sh.last_kept >= 0 ? sh.last_kept : 0;
    } else if (tid == 0) {
      out[r] = sh.found;
    }
    __syncthreads();  // sh is reset by the next row
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

cudaError_t sample(int32_t* out, const float* logits, const float* uniforms, int64_t rows,
                   int64_t vocab, float temperature, float top_p, int32_t top_k,
                   cudaStream_t stream) {
  // vocab < 2^24 keeps the total mass (vocab * 2^40 at most) inside 64 bits.
  if (rows < 0 || vocab < 0 || vocab >= (int64_t{1} << 24)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (vocab == 0 || out == nullptr || logits == nullptr || uniforms == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (!(temperature > 0.0f) || !std::isfinite(temperature)) return cudaErrorInvalidValue;
  if (!(top_p > 0.0f && top_p <= 1.0f)) return cudaErrorInvalidValue;
  const float inv_t = 1.0f / temperature;  // on the host, as ref::sample computes it
  const int64_t k = (top_k > 0 && top_k < vocab) ? top_k : 0;
  cudaError_t err = cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kSampleSmem));
  if (err != cudaSuccess) return err;
  sample_kernel<<<row_blocks(rows), kThreads, kSampleSmem, stream>>>(
      out, logits, uniforms, rows, vocab, aligned_rows(logits, vocab), temperature, inv_t, top_p,
      k);
  return cudaGetLastError();
}

}  // namespace keep::kernels
