// Split-key ("flash-decoding") attention for few rows: kernels.h attention_decode.
//
// The visible keys of each row (the concatenation of its spans, in order) are cut into chunks of
// `chunk` keys. Kernel 1 runs one block per (row, kv head, head pack, chunk) and writes, for each q
// head of the pack, the chunk's running max m (log2 domain), sum l = Σ 2^(s2 - m) and unnormalised
// output o = Σ 2^(s2 - m) v to the workspace (s2 = q·k * scale * log2(e)). Kernel 2 merges the
// chunks of each (row, head) in chunk order and writes out and lse. Every sum runs in a fixed
// order, so the result is deterministic.
//
// Kernel 1, per block: 4 warps; each warp owns every 4th batch of kKB consecutive keys of the
// chunk and keeps its own online softmax (m, l, acc), merged across warps at the end through shared
// memory. A warp streams its batches' K and V rows into a private shared-memory ring with cp.async
// (kStages deep, invalid keys zero-filled), so the next batches are in flight while one is
// computed. Lanes split head_dim (E = head_dim / 32 elements each, q held in registers pre-scaled
// by scale * log2(e)); the kKB x HP partial dot products are summed across lanes with a
// reduce-scatter (after which lane bits 4.. pick the key, the low bits replicate it), which costs
// about one shuffle per dot product instead of five.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "services/worker/kernels/attention_common.cuh"
#include "services/worker/kernels/kernels.h"

namespace keep::kernels {
namespace {

using KV = __nv_bfloat16;  // the KV view's storage

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
using detail::kFull;
using detail::kLog2e;
constexpr int kMinChunk = 16;              // chunks are multiples of this many keys
constexpr int kTargetBlocks = 384;         // kernel-1 blocks to aim for: about one wave on an H200
constexpr int kMaxChunks = kTargetBlocks;  // so a row has at most this many chunks
constexpr float kLn2 = 0.6931471805599453f;

// Kernel 1's q heads per block (HP): 8 when head_dim <= 128 and the GQA group has more than 4
// heads, else 4 (fewer registers); larger groups take several packs.
constexpr int heads_per_block(int head_dim, int group) {
  return head_dim / 32 <= 4 && group > 4 ? 8 : 4;
}

// Chunk size and the most chunks a row can have, from the call's sizes only (the spans live on the
// device). `units` is kernel 1's blocks per (row, chunk), kv_heads * packs; the plan aims at
// kTargetBlocks blocks in all: chunk = max(16, ceil(rows * num_keys * units / kTargetBlocks)
// rounded up to 16), at most num_keys rounded up to 16. So rows * max_chunks <= kTargetBlocks /
// units + rows and max_chunks <= kMaxChunks: the workspace stays small for any row count, and few
// rows over few keys still get short chunks. Why about one wave of blocks with short chunks: a
// warp's batches run one after another with long dependency chains, so the keys per warp set the
// time; more blocks than fit at once add waves.
// units = 1 gives the most chunks any call of these sizes can have (the workspace bound).
struct ChunkPlan {
  int64_t chunk = kMinChunk;
  int64_t max_chunks = 0;
};

ChunkPlan plan_chunks(int64_t rows, int64_t num_keys, int64_t units) {
  ChunkPlan p;
  if (rows <= 0 || num_keys <= 0) return p;
  const int64_t target = std::max<int64_t>(1, kTargetBlocks / std::max<int64_t>(units, 1));
  int64_t c = (rows * num_keys + target - 1) / target;
  c = (c + kMinChunk - 1) / kMinChunk * kMinChunk;
  const int64_t keys_up = (num_keys + kMinChunk - 1) / kMinChunk * kMinChunk;
  p.chunk = std::max<int64_t>(kMinChunk, std::min(c, keys_up));
  p.max_chunks = (num_keys + p.chunk - 1) / p.chunk;
  return p;
}

// Per-(E, HP) shape of kernel 1. A stage holds the K and V rows of one batch of kKB keys (at
// most 4 KB); 4 stages when a stage is at most 2 KB, else 2.
template <int E, int HP>
struct DecodeShape {
  static constexpr int kD = 32 * E;
  static constexpr int kRowBytes = kD * static_cast<int>(sizeof(KV));
  static constexpr int kKeysFit = 2048 / kRowBytes;
  static constexpr int kKeysMax = HP == 8 ? 4 : 8;  // registers: kKB x HP partial dot products
  static constexpr int kKB = kKeysFit >= kKeysMax ? kKeysMax : kKeysFit >= 4 ? 4 : 2;
  static constexpr int kLogKB = kKB == 8 ? 3 : kKB == 4 ? 2 : 1;
  static constexpr int kGroupLanes = 32 / kKB;  // lanes holding the same key after the reduction
  static constexpr int kStageBytes = 2 * kKB * kRowBytes;
  static constexpr int kStages = kStageBytes <= 2048 ? 4 : 2;
  static constexpr int kPiecesPerRow = kRowBytes / 16;  // 16-byte cp.async pieces
  static constexpr int kPiecesPerLane = 2 * kKB * kPiecesPerRow / 32;
  static_assert(kRowBytes % 64 == 0, "rows are whole 16-byte pieces, 64-byte aligned");
  static_assert((2 * kKB * kPiecesPerRow) % 32 == 0, "a stage is a whole number of warp copies");
};

// ---- small device helpers ----

using detail::cp_async16;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::SpanCursor;

// Starts the cp.async copies of one batch (the keys of ordinals ob + [0, kKB)) of K rows then V
// rows into the stage st, zero-filling keys that do not exist, advances the cursor, and returns how
// many keys exist (a prefix of the batch: ordinals past chunk_end or past the row's last span do
// not). Always commits one cp.async group, so wait_group counts stay aligned with batches. When k
// or v is not 16-byte aligned (aligned == false) the rows are copied element by element with
// plain loads instead (correct, not fast).
template <typename Shape>
__device__ __forceinline__ int issue_batch(unsigned char* st, int64_t ob, int chunk_end, int sp_end,
                                           SpanCursor& cur, const KeyRange* __restrict__ spans,
                                           const KV* __restrict__ k, const KV* __restrict__ v,
                                           int kv_heads, int g, int lane, bool aligned) {
  constexpr int kKB = Shape::kKB;
  int nvalid = 0;
  if (ob < chunk_end) {
    const int slot = detail::batch_slot<kKB>(ob, chunk_end, sp_end, cur, spans, lane);
    nvalid = __popc(__ballot_sync(kFull, slot >= 0));
    if (!aligned) {
      KV* const dst = reinterpret_cast<KV*>(st);
      for (int idx = lane; idx < 2 * kKB * Shape::kD; idx += 32) {  // 2 kKB kD: a multiple of 32
        const int row = idx / Shape::kD;
        const int col = idx - row * Shape::kD;
        const int s = __shfl_sync(kFull, slot, row & (kKB - 1));
        const KV* base = row < kKB ? k : v;
        dst[idx] = s >= 0 ? base[(static_cast<int64_t>(s) * kv_heads + g) * Shape::kD + col]
                          : static_cast<KV>(0.0f);
      }
      cp_async_commit();
      return nvalid;
    }
#pragma unroll
    for (int j = 0; j < Shape::kPiecesPerLane; ++j) {
      const int piece = lane + 32 * j;
      const int row = piece / Shape::kPiecesPerRow;  // 0..kKB-1: K rows, kKB..2kKB-1: V rows
      const int col = piece - row * Shape::kPiecesPerRow;
      const int s = __shfl_sync(kFull, slot, row & (kKB - 1));
      const KV* base = row < kKB ? k : v;
      const KV* src = s >= 0 ? base + (static_cast<int64_t>(s) * kv_heads + g) * Shape::kD +
                                   col * (16 / static_cast<int>(sizeof(KV)))
                             : base;
      cp_async16(st + row * Shape::kRowBytes + col * 16, src, s >= 0 ? 16 : 0);  // 0: zero-fill
    }
  }
  cp_async_commit();
  return nvalid;
}

// ---- kernel 1: one chunk of one row for the q heads [h0, h0 + nh) of one kv head ----
template <int E, int HP>
__global__ void __launch_bounds__(kThreads)
    decode_chunk_kernel(float* __restrict__ ws_o,             // (rows, heads, max_chunks, head_dim)
                        float* __restrict__ ws_m,             // (rows, heads, max_chunks)
                        float* __restrict__ ws_l,             // (rows, heads, max_chunks)
                        const __nv_bfloat16* __restrict__ q,  // (rows, q_stride)
                        int64_t q_stride,
                        const KV* __restrict__ k,                 // (num_keys, kv_heads, head_dim)
                        const KV* __restrict__ v,                 // (num_keys, kv_heads, head_dim)
                        const int32_t* __restrict__ row_offsets,  // (rows + 1)
                        const KeyRange* __restrict__ spans,       // (row_offsets[rows])
                        int heads, int kv_heads, int packs, int chunk, int max_chunks,
                        float scale_log2, bool aligned) {
  using Shape = DecodeShape<E, HP>;
  constexpr int kD = Shape::kD;
  constexpr int kKB = Shape::kKB;
  constexpr int kLogKB = Shape::kLogKB;
  constexpr int kGroupLanes = Shape::kGroupLanes;
  constexpr int kStages = Shape::kStages;
  constexpr int kStageBytes = Shape::kStageBytes;
  constexpr int kRingBytes = kWarps * kStages * kStageBytes;
  static_assert(kWarps * HP * kD * 4 <= kRingBytes, "the block merge reuses the ring");

  __shared__ __align__(16) unsigned char ring[kRingBytes];  // per warp: kStages x (K rows, V rows)
  __shared__ __align__(16) float p_s[kWarps][HP][kKB];      // a batch's probabilities
  __shared__ float m_s[kWarps][HP];
  __shared__ float l_s[kWarps][HP];

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const detail::BlockCoords bc = detail::block_coords<HP>(max_chunks, packs, heads, kv_heads);
  const int c = bc.split;
  const int g = bc.g;
  const int64_t r = bc.r;
  const int h0 = bc.h0;
  const int nh = bc.nh;

  // c < max_chunks = ceil(num_keys / chunk), so chunk_start < num_keys: no int32 overflow.
  const int chunk_start = static_cast<int>(static_cast<int64_t>(c) * chunk);
  const int chunk_end =
      static_cast<int>(min(static_cast<int64_t>(chunk_start) + chunk, int64_t{0x7fffffff}));
  const int sp_end = row_offsets[r + 1];
  SpanCursor cur;
  // Same answer in every warp: a block whose chunk starts past the row's keys leaves as a whole.
  if (!detail::start_cursor(spans, row_offsets[r], sp_end, chunk_start, lane, cur)) return;

  float qr[HP][E];
  detail::load_q<E, HP>(qr, q, r, q_stride, h0, nh, lane, scale_log2, [](int) {});
  float m[HP];
  float l[HP];  // this lane's share: the probabilities of the keys it holds after the reduction
  float acc[HP][E];
#pragma unroll
  for (int h = 0; h < HP; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[h][e] = 0.0f;
  }

  unsigned char* const my_ring = ring + warp * kStages * kStageBytes;
  // Batch i of this warp holds the ordinals chunk_start + (i * kWarps + warp) * kKB + [0, kKB)
  // and goes to stage i % kStages.
  auto issue = [&](int i) {
    return issue_batch<Shape>(my_ring + (i % kStages) * kStageBytes,
                              chunk_start + (static_cast<int64_t>(i) * kWarps + warp) * kKB,
                              chunk_end, sp_end, cur, spans, k, v, kv_heads, g, lane, aligned);
  };

  int nvq[kStages];  // valid keys of the batches in flight, oldest first
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) nvq[j] = issue(j);
  nvq[kStages - 1] = 0;

  for (int i = 0;; ++i) {
    nvq[kStages - 1] = issue(i + kStages - 1);
    cp_async_wait<kStages - 1>();  // batch i has landed (this lane's copies) ...
    __syncwarp();                  // ... and every lane's
    const int nv = nvq[0];
    if (nv == 0) break;  // batches only shrink: nothing left for this warp
    const KV* kst = reinterpret_cast<const KV*>(my_ring + (i % kStages) * kStageBytes);
    const KV* vst = kst + kKB * kD;

    // Partial dot products over this lane's E dims: part[key][head].
    float part[kKB][HP];
#pragma unroll
    for (int kk = 0; kk < kKB; ++kk) {
      float kf[E];
      detail::load_vec<E, detail::PlainLoad>(kst + kk * kD + lane * E, kf);
#pragma unroll
      for (int h = 0; h < HP; ++h) {
        float s = 0.0f;
        if (h < nh) {
#pragma unroll
          for (int e = 0; e < E; ++e) s = fmaf(qr[h][e], kf[e], s);
        }
        part[kk][h] = s;
      }
    }
    // Summed across the lanes: part[0][h] is now the score of key kidx.
    const int kidx = detail::reduce_scatter_keys<kKB, HP>(part, nh, lane);

    // Online softmax over the batch (log2 domain); p of this lane's key to shared memory.
    const bool valid = kidx < nv;
    float alpha[HP];
#pragma unroll
    for (int h = 0; h < HP; ++h) {
      alpha[h] = 1.0f;
      if (h < nh) {
        const float s = valid ? part[0][h] : -INFINITY;
        float bm = s;
#pragma unroll
        for (int st = 0; st < kLogKB; ++st) bm = fmaxf(bm, __shfl_xor_sync(kFull, bm, 16 >> st));
        const float mn = fmaxf(m[h], bm);
        alpha[h] = mn == m[h] ? 1.0f : exp2f(m[h] - mn);
        const float p = valid ? exp2f(s - mn) : 0.0f;
        l[h] = l[h] * alpha[h] + p;
        m[h] = mn;
        if ((h & (kGroupLanes - 1)) == (lane & (kGroupLanes - 1))) p_s[warp][h][kidx] = p;
      }
    }
    __syncwarp();

    // acc = acc * alpha + Σ_key p * v over this lane's E dims.
    float vf[kKB][E];
#pragma unroll
    for (int kk = 0; kk < kKB; ++kk)
      detail::load_vec<E, detail::PlainLoad>(vst + kk * kD + lane * E, vf[kk]);
#pragma unroll
    for (int h = 0; h < HP; ++h) {
      if (h < nh) {
        float pv[kKB];
        if constexpr (kKB % 4 == 0) {
#pragma unroll
          for (int j = 0; j < kKB / 4; ++j) {
            const float4 x = reinterpret_cast<const float4*>(p_s[warp][h])[j];
            pv[4 * j] = x.x;
            pv[4 * j + 1] = x.y;
            pv[4 * j + 2] = x.z;
            pv[4 * j + 3] = x.w;
          }
        } else {
          const float2 x = reinterpret_cast<const float2*>(p_s[warp][h])[0];
          pv[0] = x.x;
          pv[1] = x.y;
        }
#pragma unroll
        for (int e = 0; e < E; ++e) {
          float a = acc[h][e] * alpha[h];
#pragma unroll
          for (int kk = 0; kk < kKB; ++kk) a = fmaf(pv[kk], vf[kk][e], a);
          acc[h][e] = a;
        }
      }
    }
    __syncwarp();  // the stage and p_s are overwritten next
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) nvq[j] = nvq[j + 1];
  }
  cp_async_wait<0>();

  // Each lane holds l for its key position only: sum over the key lane bits.
#pragma unroll
  for (int h = 0; h < HP; ++h) {
    if (h < nh) {
#pragma unroll
      for (int st = 0; st < kLogKB; ++st) l[h] += __shfl_xor_sync(kFull, l[h], 16 >> st);
    }
  }

  // Merge the warps (fixed order) and write the chunk's partial result.
  __syncthreads();                                    // every warp is done with its ring: reuse it
  float* const o_s = reinterpret_cast<float*>(ring);  // (kWarps, HP, kD)
#pragma unroll
  for (int h = 0; h < HP; ++h) {
    if (h < nh) {
#pragma unroll
      for (int e = 0; e < E; ++e) o_s[(warp * HP + h) * kD + lane * E + e] = acc[h][e];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < HP; ++h) {
      m_s[warp][h] = m[h];
      l_s[warp][h] = l[h];
    }
  }
  __syncthreads();
  const int64_t ws0 = (r * heads + h0) * max_chunks + c;  // entry of (r, h0, c)
  for (int idx = static_cast<int>(threadIdx.x); idx < nh * kD; idx += kThreads) {
    const int h = idx / kD;
    const int d = idx - h * kD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_s[w][h]);
    float o = 0.0f;
    float ls = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = m_s[w][h];
      if (mw != -INFINITY) {  // a warp that saw no key contributes nothing
        const float f = exp2f(mw - mx);
        o = fmaf(o_s[(w * HP + h) * kD + d], f, o);
        ls = fmaf(l_s[w][h], f, ls);
      }
    }
    const int64_t wi = ws0 + static_cast<int64_t>(h) * max_chunks;
    ws_o[wi * kD + d] = o;
    if (d == 0) {
      ws_m[wi] = mx;
      ws_l[wi] = ls;
    }
  }
}

// ---- kernel 2: merge the chunks of one (row, head) ----
// 256 threads. The chunk maxima, weights 2^(m_c - max) and the sum l are computed with the chunks
// spread over the threads (max_chunks <= kMaxChunks); then thread t accumulates dim t % head_dim
// over the chunks c = t / head_dim (mod the 256 / head_dim thread groups), and the groups are
// added in order. Every reduction has a fixed shape: deterministic.
constexpr int kCombineThreads = 256;

__device__ __forceinline__ float block_reduce(float v, bool is_max, float* scratch) {  // 256 thr
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(kFull, v, off);
    v = is_max ? fmaxf(v, o) : v + o;
  }
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kCombineThreads / 32; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
}

__global__ void __launch_bounds__(kCombineThreads)
    decode_combine_kernel(__nv_bfloat16* __restrict__ out,  // (rows, out_stride)
                          int64_t out_stride,
                          float* __restrict__ lse,         // (rows, heads) or null
                          const float* __restrict__ ws_o,  // (rows, heads, max_chunks, head_dim)
                          const float* __restrict__ ws_m,  // (rows, heads, max_chunks)
                          const float* __restrict__ ws_l,  // (rows, heads, max_chunks)
                          const int32_t* __restrict__ row_offsets,  // (rows + 1)
                          const KeyRange* __restrict__ spans,       // (row_offsets[rows])
                          int heads, int head_dim, int chunk, int max_chunks) {
  __shared__ float scratch[kCombineThreads / 32];
  __shared__ float weight_s[kMaxChunks];
  __shared__ float part_s[kCombineThreads];
  const int64_t r = blockIdx.x / heads;
  const int h = static_cast<int>(blockIdx.x % heads);
  const int t = static_cast<int>(threadIdx.x);

  // The row's visible keys, hence its chunk count (the blocks of kernel 1 past it wrote nothing).
  const int sb = row_offsets[r];
  const int se = row_offsets[r + 1];
  int n = 0;
  for (int s = sb + t; s < se; s += kCombineThreads) n += spans[s].end - spans[s].begin;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) n += __shfl_xor_sync(kFull, n, off);
  __shared__ int warp_keys[kCombineThreads / 32];
  if ((t & 31) == 0) warp_keys[t >> 5] = n;
  __syncthreads();
  int total = 0;
#pragma unroll
  for (int w = 0; w < kCombineThreads / 32; ++w) total += warp_keys[w];
  const int nc = min(total == 0 ? 0 : (total - 1) / chunk + 1, min(max_chunks, kMaxChunks));

  __nv_bfloat16* o = out + r * out_stride + static_cast<int64_t>(h) * head_dim;
  if (nc == 0) {  // block-uniform
    if (t < head_dim) o[t] = __float2bfloat16_rn(0.0f);
    if (lse != nullptr && t == 0) lse[r * heads + h] = -INFINITY;
    return;
  }
  const int64_t base = (r * heads + h) * max_chunks;
  float mc = -INFINITY;
  for (int c = t; c < nc; c += kCombineThreads) mc = fmaxf(mc, ws_m[base + c]);
  const float mx = block_reduce(mc, true, scratch);
  float lc = 0.0f;
  for (int c = t; c < nc; c += kCombineThreads) {
    const float w = exp2f(ws_m[base + c] - mx);
    weight_s[c] = w;
    lc = fmaf(ws_l[base + c], w, lc);
  }
  const float ls = block_reduce(lc, false, scratch);  // its barriers also publish weight_s

  const int groups = kCombineThreads / head_dim;  // >= 1
  const int d = t % head_dim;
  const int grp = t / head_dim;
  if (grp < groups) {
    float acc = 0.0f;
#pragma unroll 8
    for (int c = grp; c < nc; c += groups)
      acc = fmaf(ws_o[(base + c) * head_dim + d], weight_s[c], acc);
    part_s[t] = acc;
  }
  __syncthreads();
  if (t < head_dim) {
    float acc = part_s[t];
    for (int g = 1; g < groups; ++g) acc += part_s[g * head_dim + t];
    o[t] = __float2bfloat16_rn(acc / ls);
  }
  if (lse != nullptr && t == 0) lse[r * heads + h] = (mx + log2f(ls)) * kLn2;
}

template <int E, int HP>
void launch_chunks(float* ws_o, float* ws_m, float* ws_l, const __nv_bfloat16* q, int64_t q_stride,
                   const KV* k, const KV* v, const AttentionRows& rows, int heads, int kv_heads,
                   int chunk, int max_chunks, float scale_log2, bool aligned, cudaStream_t stream) {
  const int group = heads / kv_heads;
  const int packs = (group + HP - 1) / HP;
  const int64_t blocks = static_cast<int64_t>(rows.rows) * kv_heads * packs * max_chunks;
  // (The launcher checked blocks < 2^31: rows * max_chunks <= rows + kTargetBlocks.)
  decode_chunk_kernel<E, HP><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      ws_o, ws_m, ws_l, q, q_stride, k, v, rows.row_offsets, rows.spans, heads, kv_heads, packs,
      chunk, max_chunks, scale_log2, aligned);
}

// HP from heads_per_block.
template <int E>
void dispatch_hp(float* ws_o, float* ws_m, float* ws_l, const __nv_bfloat16* q, int64_t q_stride,
                 const KV* k, const KV* v, const AttentionRows& rows, int heads, int kv_heads,
                 int chunk, int max_chunks, float scale_log2, bool aligned, cudaStream_t stream) {
  if constexpr (E <= 4) {
    if (heads_per_block(32 * E, heads / kv_heads) == 8) {
      launch_chunks<E, 8>(ws_o, ws_m, ws_l, q, q_stride, k, v, rows, heads, kv_heads, chunk,
                          max_chunks, scale_log2, aligned, stream);
      return;
    }
  }
  launch_chunks<E, 4>(ws_o, ws_m, ws_l, q, q_stride, k, v, rows, heads, kv_heads, chunk, max_chunks,
                      scale_log2, aligned, stream);
}

size_t decode_workspace_floats(int64_t rows, int heads, int head_dim, int64_t num_keys) {
  if (rows <= 0 || heads <= 0 || head_dim <= 0 || num_keys <= 0) return 0;
  const ChunkPlan p = plan_chunks(rows, num_keys, 1);  // the bound over every head layout
  return static_cast<size_t>(rows) * static_cast<size_t>(heads) *
         static_cast<size_t>(p.max_chunks) * static_cast<size_t>(head_dim + 2);
}

cudaError_t launch(__nv_bfloat16* out, int64_t out_stride, float* lse, const __nv_bfloat16* q,
                   int64_t q_stride, const KV* k, const KV* v, const AttentionRows& rows, int heads,
                   int kv_heads, int head_dim, float scale, float* workspace, size_t workspace_size,
                   cudaStream_t stream) {
  if (rows.rows < 0 || rows.num_keys < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 ||
      head_dim < 32 || head_dim > 256 || head_dim % 32 != 0) {
    return cudaErrorInvalidValue;
  }
  if (rows.rows == 0) return cudaSuccess;
  const int64_t width = static_cast<int64_t>(heads) * head_dim;
  if (out == nullptr || q == nullptr || rows.row_offsets == nullptr || out_stride < width ||
      q_stride < width) {
    return cudaErrorInvalidValue;
  }
  const int group = heads / kv_heads;
  const int hp = heads_per_block(head_dim, group);
  const ChunkPlan plan = plan_chunks(rows.rows, rows.num_keys,
                                     static_cast<int64_t>(kv_heads) * ((group + hp - 1) / hp));
  const size_t need = static_cast<size_t>(rows.rows) * static_cast<size_t>(heads) *
                      static_cast<size_t>(plan.max_chunks) * static_cast<size_t>(head_dim + 2);
  if (workspace_size < need || (need > 0 && workspace == nullptr)) return cudaErrorInvalidValue;
  const int64_t entries = static_cast<int64_t>(rows.rows) * heads * plan.max_chunks;
  float* const ws_o = workspace;
  float* const ws_m = need > 0 ? ws_o + entries * head_dim : nullptr;
  float* const ws_l = need > 0 ? ws_m + entries : nullptr;
  const int chunk = static_cast<int>(plan.chunk);
  const int max_chunks = static_cast<int>(plan.max_chunks);
  const int64_t chunk_blocks = entries / (heads / kv_heads) * ((heads / kv_heads + 3) / 4);
  if (max_chunks > kMaxChunks || chunk_blocks > 0x7fffffff ||
      static_cast<int64_t>(rows.rows) * heads > 0x7fffffff) {
    return cudaErrorInvalidValue;  // beyond a 1-D grid
  }
  if (max_chunks > 0) {
    if (k == nullptr || v == nullptr || rows.spans == nullptr) return cudaErrorInvalidValue;
    // cp.async moves 16-byte pieces: rows are 64-byte multiples, so 16-aligned bases suffice.
    const bool aligned =
        (reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v)) % 16 == 0;
    const float scale_log2 = scale * kLog2e;
    switch (head_dim / 32) {
#define KEEP_DECODE_CASE(E_)                                                                       \
  case E_:                                                                                         \
    dispatch_hp<E_>(ws_o, ws_m, ws_l, q, q_stride, k, v, rows, heads, kv_heads, chunk, max_chunks, \
                    scale_log2, aligned, stream);                                                  \
    break;
      KEEP_DECODE_CASE(1)
      KEEP_DECODE_CASE(2)
      KEEP_DECODE_CASE(3)
      KEEP_DECODE_CASE(4)
      KEEP_DECODE_CASE(5)
      KEEP_DECODE_CASE(6)
      KEEP_DECODE_CASE(7)
      KEEP_DECODE_CASE(8)
#undef KEEP_DECODE_CASE
      default:
        return cudaErrorInvalidValue;
    }
  }
  const int64_t blocks = static_cast<int64_t>(rows.rows) * heads;
  decode_combine_kernel<<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(
      out, out_stride, lse, ws_o, ws_m, ws_l, rows.row_offsets, rows.spans, heads, head_dim, chunk,
      max_chunks);
  return cudaGetLastError();
}

}  // namespace

size_t attention_decode_workspace_floats(int64_t rows, int heads, int head_dim, int64_t num_keys) {
  return decode_workspace_floats(rows, heads, head_dim, num_keys);
}

cudaError_t attention_decode(__nv_bfloat16* out, int64_t out_stride, float* lse,
                             const __nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, const AttentionRows& rows, int heads,
                             int kv_heads, int head_dim, float scale, float* workspace,
                             size_t workspace_floats, cudaStream_t stream) {
  return launch(out, out_stride, lse, q, q_stride, k, v, rows, heads, kv_heads, head_dim, scale,
                workspace, workspace_floats, stream);
}

}  // namespace keep::kernels
