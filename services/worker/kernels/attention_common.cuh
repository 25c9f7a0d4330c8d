// Device helpers shared by the split-key attention kernels attention_decode.cu and
// attention_pool.cu (not a public header): vector loads of K/V rows, the warp's walk over a row's
// key spans, the per-block coordinates, q in registers and the key-wise reduce-scatter of partial
// dot products. Both kernels run 32-lane warps over keys whose head_dim is split across the lanes
// (E = head_dim / 32 elements each) and HP q heads of one kv head per block.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "services/worker/kernels/layout.h"

namespace keep::kernels::detail {

constexpr unsigned kFull = 0xffffffffu;  // every lane of a warp
constexpr float kLog2e = 1.4426950408889634f;

// cp.async (sm_80+): 16 bytes global -> shared, asynchronously; src_bytes = 0 zero-fills the
// destination. A thread's copies form groups (commit); wait<N> returns once at most its N newest
// groups are pending (the data is then visible to this thread; a barrier shares it).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// How load_vec reads memory: plain loads (any memory; shared memory in the decode kernel) or the
// read-only data path (global memory that no thread writes during the kernel).
struct PlainLoad {
  template <typename W>
  __device__ __forceinline__ static W load(const W* p) {
    return *p;
  }
};
struct ReadOnlyLoad {
  template <typename W>
  __device__ __forceinline__ static W load(const W* p) {
    return __ldg(p);
  }
};

// E consecutive bf16 elements at p, as fp32, with the widest aligned loads: p is aligned to the
// largest power of two (<= 16) dividing E * 2 bytes.
template <int E, typename Load>
__device__ __forceinline__ void load_vec(const __nv_bfloat16* p, float (&f)[E]) {
  constexpr int kBytes = E * 2;
  if constexpr (kBytes % 4 == 0) {
    constexpr int kWords = kBytes / 4;
    uint32_t w[kWords];
    if constexpr (kWords % 4 == 0) {
#pragma unroll
      for (int i = 0; i < kWords / 4; ++i) {
        const uint4 x = Load::load(reinterpret_cast<const uint4*>(p) + i);
        w[4 * i] = x.x;
        w[4 * i + 1] = x.y;
        w[4 * i + 2] = x.z;
        w[4 * i + 3] = x.w;
      }
    } else if constexpr (kWords % 2 == 0) {
#pragma unroll
      for (int i = 0; i < kWords / 2; ++i) {
        const uint2 x = Load::load(reinterpret_cast<const uint2*>(p) + i);
        w[2 * i] = x.x;
        w[2 * i + 1] = x.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] = Load::load(reinterpret_cast<const uint32_t*>(p) + i);
    }
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);  // little endian: the first element is the low half
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {  // odd E: 2-byte loads
#pragma unroll
    for (int i = 0; i < E; ++i) {
      f[i] = __uint_as_float(
          static_cast<uint32_t>(Load::load(reinterpret_cast<const uint16_t*>(p) + i)) << 16);
    }
  }
}

// Which (row, kv head g, head pack, key split) a block of the grid computes, blocks numbered with
// the split fastest, and the q heads [h0, h0 + nh) of its pack (HP per pack, the last may be
// short).
struct BlockCoords {
  int split;
  int pack;
  int g;
  int64_t r;
  int h0;
  int nh;
};

template <int HP>
__device__ __forceinline__ BlockCoords block_coords(int splits, int packs, int heads,
                                                    int kv_heads) {
  BlockCoords b;
  int64_t bid = blockIdx.x;
  b.split = static_cast<int>(bid % splits);
  bid /= splits;
  b.pack = static_cast<int>(bid % packs);
  bid /= packs;
  b.g = static_cast<int>(bid % kv_heads);
  b.r = bid / kv_heads;
  const int group = heads / kv_heads;
  b.h0 = b.g * group + b.pack * HP;
  b.nh = min(HP, group - b.pack * HP);
  return b;
}

// Finds, with the whole warp, the span of spans[sb, se) holding visible-key ordinal `target` (the
// ordinal of a key is its index in the concatenation of the spans). On success si is that span and
// os the ordinal of its first key. Uniform across the warp.
__device__ __forceinline__ bool find_span(const KeyRange* __restrict__ spans, int sb, int se,
                                          int target, int lane, int& si, int& os) {
  int before = 0;  // keys in spans[sb, s0)
  for (int s0 = sb; s0 < se; s0 += 32) {
    const int s = s0 + lane;
    int len = 0;
    if (s < se) {
      const KeyRange kr = spans[s];
      len = kr.end - kr.begin;
    }
    int incl = len;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(kFull, incl, off);
      if (lane >= off) incl += y;
    }
    const unsigned hit = __ballot_sync(kFull, s < se && before + incl > target);
    if (hit != 0) {
      const int f = __ffs(hit) - 1;
      si = s0 + f;
      os = before + __shfl_sync(kFull, incl - len, f);
      return true;
    }
    before += __shfl_sync(kFull, incl, 31);
  }
  return false;
}

// The warp's position in a row's spans: span si, whose first key has ordinal os, covers slots
// [begin, begin + len). Uniform across the warp.
struct SpanCursor {
  int si = 0;
  int os = 0;
  int begin = 0;
  int len = 0;
};

// Puts the cursor on the span of spans[sb, se) holding ordinal `target`; false (uniform across
// the warp) when the row has no key that far.
__device__ __forceinline__ bool start_cursor(const KeyRange* __restrict__ spans, int sb, int se,
                                             int target, int lane, SpanCursor& cur) {
  if (!find_span(spans, sb, se, target, lane, cur.si, cur.os)) return false;
  const KeyRange kr = spans[cur.si];
  cur.begin = kr.begin;
  cur.len = kr.end - kr.begin;
  return true;
}

// The slot of key ordinal ob + lane for lanes < kKB, found by walking the spans forward from the
// cursor; -1 for other lanes and for ordinals at or past `end` or past the row's last span (those
// form a suffix of the batch). The cursor then follows the batch's last lane (the largest
// ordinal), for the next batch.
template <int kKB>
__device__ __forceinline__ int batch_slot(int64_t ob, int end, int sp_end, SpanCursor& cur,
                                          const KeyRange* __restrict__ spans, int lane) {
  int slot = -1;
  SpanCursor w = cur;
  if (lane < kKB && ob + lane < end) {
    const int o = static_cast<int>(ob) + lane;
    while (o >= w.os + w.len && w.si + 1 < sp_end) {  // spans are non-empty: few steps
      w.os += w.len;
      ++w.si;
      const KeyRange kr = spans[w.si];
      w.begin = kr.begin;
      w.len = kr.end - kr.begin;
    }
    if (o < w.os + w.len) slot = w.begin + (o - w.os);
  }
  cur.si = __shfl_sync(kFull, w.si, kKB - 1);
  cur.os = __shfl_sync(kFull, w.os, kKB - 1);
  cur.begin = __shfl_sync(kFull, w.begin, kKB - 1);
  cur.len = __shfl_sync(kFull, w.len, kKB - 1);
  return slot;
}

// q of the heads [h0, h0 + nh) of row r, this lane's E dims (kD = 32 * E per head), pre-scaled by
// scale_log2; 0 for the heads past nh. per_head(h) runs before head h's loads (the pool kernel
// loads its lse there: the same load order as one loop over the heads).
template <int E, int HP, typename PerHead>
__device__ __forceinline__ void load_q(float (&qr)[HP][E], const __nv_bfloat16* __restrict__ q,
                                       int64_t r, int64_t q_stride, int h0, int nh, int lane,
                                       float scale_log2, PerHead per_head) {
  constexpr int kD = 32 * E;
#pragma unroll
  for (int h = 0; h < HP; ++h) {
    per_head(h);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qr[h][e] = h < nh ? __bfloat162float(
                              q[r * q_stride + static_cast<int64_t>(h0 + h) * kD + lane * E + e]) *
                              scale_log2
                        : 0.0f;
    }
  }
}

// Sums part[key][h] (this lane's partial dot products over its E dims, heads h < nh) across the
// warp. Reduce-scatter over the key index: at step st, lanes with bit (16 >> st) set keep the upper
// half of the remaining keys and hand the lower half to their partner; then the low lane bits,
// which all hold the same key, are summed. Afterwards part[0][h] is the full dot product of key
// `kidx` (returned; lane bits 4.. pick it, the low 32 / kKB bits replicate it).
template <int kKB, int HP>
__device__ __forceinline__ int reduce_scatter_keys(float (&part)[kKB][HP], int nh, int lane) {
  static_assert(kKB == 2 || kKB == 4 || kKB == 8, "2, 4 or 8 keys per batch");
  constexpr int kLogKB = kKB == 8 ? 3 : kKB == 4 ? 2 : 1;
  int kidx = 0;
#pragma unroll
  for (int st = 0; st < kLogKB; ++st) {
    const int half = (kKB >> st) >> 1;
    const int off = 16 >> st;
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int h = 0; h < HP; ++h) {
      if (h < nh) {
#pragma unroll
        for (int kk = 0; kk < half; ++kk) {
          const float send = upper ? part[kk][h] : part[kk + half][h];
          const float keep = upper ? part[kk + half][h] : part[kk][h];
          part[kk][h] = keep + __shfl_xor_sync(kFull, send, off);
        }
      }
    }
    if (upper) kidx += half;
  }
#pragma unroll
  for (int off = 16 >> kLogKB; off > 0; off >>= 1) {
#pragma unroll
    for (int h = 0; h < HP; ++h) {
      if (h < nh) part[0][h] += __shfl_xor_sync(kFull, part[0][h], off);
    }
  }
  return kidx;
}

}  // namespace keep::kernels::detail
