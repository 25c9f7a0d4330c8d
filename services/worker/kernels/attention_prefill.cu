// Prefill attention: a FlashAttention-2 style kernel on tensor cores (mma.sync m16n8k16 bf16,
// fp32 accumulation), driven by the host-built tile schedule of attention_schedule.h.
//
// One block = one row tile (kPrefillRowTile = 64 rows of Q) x one head; 4 warps, warp w owns rows
// [16w, 16w + 16) of the tile. Q is staged through shared memory once and kept in registers as
// mma A fragments. The block walks the key tiles (kPrefillKeyTile = 64 keys) its schedule lists,
// with K/V tiles double-buffered in shared memory as bf16 (row stride HD + 8 elements, so the
// 8 rows an ldmatrix reads fall in distinct banks):
//   S = Q K^T                  mma, B fragments from ldmatrix on the K tile (keys are the n axis)
//   mask                       S = -inf outside the rows' spans unless the schedule marks the
//                              tile full
//   online softmax in fp32     running max m (exp2 domain: scale * log2(e) times the score's)
//                              and thread-partial sums l per row; P = exp2(S * scale * log2(e)
//                              - m) in one FMA and exp2
//   O = O * alpha + P V        P rounded to bf16 in registers (the S accumulators are exactly the
//                              A fragments of P), V fragments from ldmatrix.trans
// At the end O / l is staged through shared memory and stored with 16-byte writes; lse = (m +
// log2 l) * ln 2. A row that sees no key (or a padding row past `rows`) has l = 0: out 0, lse -inf.
//
// On Hopper (an sm_90a build on a compute 9.0 device) the same kernel runs its two products on
// wgmma instead (PrefillKernel::kWgmma, the default there): the warpgroup of the block computes
// S = Q K^T (m64n64k16, Q and K from shared memory) and O += P V (m64n{HD}k16, P from registers,
// V from shared memory in the transposed form), so no operand of B passes through registers and
// the tensor cores run at Hopper's rate. Q, K and V then live in shared memory as 128-byte
// swizzled panels (wgmma.cuh) instead of padded rows; Q gets a buffer of its own. The
// schedule, masks, softmax and epilogue are the same code.
//
// K/V loads: 16-byte aligned rows go through cp.async straight into shared memory; others are
// loaded into registers and stored. The V of a tile the schedule does
// not mark full has its non-finite values replaced by 0: such a tile may hold keys no row of the
// block sees (slots never written, possibly NaN), and a masked P = 0 times a NaN V would still
// poison the mma. Through registers that happens on the way; after cp.async, each thread cleans
// the chunks it copied once they have landed, before the barrier that publishes the tile
// (sanitize_v). A schedule whose visited tiles hold no key unseen by their row tile
// (PrefillSchedule::sanitize_v false: causal rows, a KEEP layer's recomputed rows) skips it all.
// Keys past num_keys are zero-filled. The schedule's entries and the rows' spans
// (plan data) are read before the wait for the previous kernels, and the entries a step ahead.
#include <cuda_bf16.h>

#include <cstdint>

#include "services/worker/kernels/attention_common.cuh"
#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/kernels.h"
#include "services/worker/kernels/tma.cuh"
#include "services/worker/kernels/tma_map.h"
#include "services/worker/kernels/wgmma.cuh"

namespace keep::kernels {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = kPrefillRowTile;  // rows of Q per block
constexpr int kKeys = kPrefillKeyTile;  // keys per tile
static_assert(kRows == kWarps * 16, "each warp owns 16 rows (one mma M)");
static_assert(kKeys == 64, "the span mask of a row within a key tile is one 64-bit word");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared-memory geometry per head dimension: padded rows for mma.sync / ldmatrix, or wgmma's
// 128-byte swizzled panels (kSwizzled, below).
template <int HD, bool kSwizzled>
struct Geometry {
  static_assert(HD % 64 == 0 || !kSwizzled, "swizzled panels are 64 elements wide");
  static_assert(HD % 16 == 0, "head_dim must be a multiple of 16");
  static constexpr int kStride = HD + 8;        // padded row, bf16 elements
  static constexpr int kChunksPerRow = HD / 8;  // 16-byte chunks per row
  static constexpr int kTileElems = kSwizzled ? kKeys * HD : kKeys * kStride;  // Q, K or V tile
  static constexpr int kPasses = kKeys * kChunksPerRow / kThreads;  // chunks per thread per tile
  // The loaders' mapping: thread tid moves chunk tid % kChunksPerRow of rows
  // tid / kChunksPerRow + i * kRowsPerPass (consecutive threads, consecutive chunks of a row).
  // A multiple of 8, so a row's swizzle phase r % 8 is the same in every pass.
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static_assert(kRowsPerPass % 8 == 0, "rows per pass keep the swizzle phase");
  // mma.sync: K[2], V[2] (Q and the O staging reuse a K buffer); wgmma: K[2], V[2], Q (the O
  // staging, padded rows, reuses the start once every product is done), plus the slack that
  // aligns the panels to 1024 bytes (kBlockSmemBytes below: one K buffer fewer with kOneK).
  static constexpr size_t kSmemBytes =
      kSwizzled ? 5 * kTileElems * sizeof(bf16) + 1024 : 4 * kTileElems * sizeof(bf16);
  static_assert(kKeys * kChunksPerRow % kThreads == 0, "tile mapping");
  static_assert(kRows == kKeys, "Q tiles have the shape of key tiles");
  static_assert(kSmemBytes >= kRows * kStride * sizeof(bf16), "O staging fits");
};
// wgmma tiles: columns [64p, 64p + 64) of a tile's 64 rows form panel p (8 KiB, 1024-byte
// aligned); row r of a panel is 128 bytes at r * 128, its 16-byte chunk c stored as chunk
// c ^ (r % 8) (the 128-byte swizzle the descriptors name). The 8 chunks one 128-byte line of a
// global row holds land in one 128-byte line of shared memory, so cp.async makes one L2 request
// of them (a layout scattering them costs a request each), and the 8 rows a wgmma core matrix
// reads lie in distinct banks.
constexpr uint32_t kPanelBytes = kKeys * 128;

// Where the 16-byte chunk c of tile row r goes (elements from the tile's start).
template <int HD, bool kSwizzled>
__device__ __forceinline__ int chunk_offset(int r, int c) {
  if constexpr (kSwizzled) {
    return (c >> 3) * static_cast<int>(kPanelBytes / 2) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
  } else {
    return r * (HD + 8) + c * 8;
  }
}

struct Params {
  bf16* out;  // (rows, out_stride)
  int64_t out_stride;
  float* lse;     // (rows, heads) or null
  const bf16* q;  // (rows, q_stride)
  int64_t q_stride;
  const bf16* k;                // (num_keys, kv_heads, head_dim)
  const bf16* v;                // (num_keys, kv_heads, head_dim)
  const int32_t* row_offsets;   // (rows + 1)
  const KeyRange* spans;        // (row_offsets[rows])
  const int32_t* tile_offsets;  // (row_tiles + 1)
  const int32_t* tiles;         // (tile_offsets[row_tiles])
  int32_t rows;
  int32_t num_keys;
  int32_t row_tiles;
  // Split-key runs (> 1: block (row tile, run, head) takes the run's share of the row tile's key
  // tiles and writes its normalised output and lse to the parts, which combine_kernel merges).
  int32_t splits;
  bf16* part_out;   // (splits, rows, heads * HD)
  float* part_lse;  // (splits, rows, heads)
  int heads;
  int group;  // heads / kv_heads
  int kv_heads;
  float scale_log2;  // scale * log2(e)
  bool q_vec;        // q and q_stride allow 16-byte loads
  bool out_vec;      // out and out_stride allow 16-byte stores
  bool kv_vec;       // k and v allow 16-byte loads
  bool sanitize_v;   // PrefillSchedule::sanitize_v: else no V tile needs cleaning
  // The pooling in the same pass (attention_prefill_pool; the wide kernel only): each key's
  // group, and per (row, head) the probability sums of groups [0, kPoolFusedMaxGroups).
  const int32_t* key_group;  // (num_keys)
  float* pool_heads;         // (rows, heads, kPoolFusedMaxGroups)
};

// ---- PTX wrappers ----
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

using detail::cp_async16;
using detail::cp_async_commit;
using detail::cp_async_wait;

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c (16x8 fp32) += a (16x16 bf16, row) * b (16x8 bf16, col).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Zeroes the non-finite halves (exponent all ones) of two packed bf16.
__device__ __forceinline__ uint32_t finite_bf16x2(uint32_t w) {
  uint32_t keep = 0;
  if ((w & 0x7f80u) != 0x7f80u) keep |= 0x0000ffffu;
  if ((w & 0x7f800000u) != 0x7f800000u) keep |= 0xffff0000u;
  return w & keep;
}
// The same for one 16-byte chunk of 8 bf16.
__device__ __forceinline__ uint4 finite_bf16x8(uint4 u) {
  return make_uint4(finite_bf16x2(u.x), finite_bf16x2(u.y), finite_bf16x2(u.z), finite_bf16x2(u.w));
}

// ---- loads of 8 consecutive elements (one 16-byte smem chunk) ----
__device__ __forceinline__ uint4 load8(const bf16* p, bool vec, bool sanitize) {
  uint4 u;
  if (vec) {
    u = __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    const auto* s = reinterpret_cast<const unsigned short*>(p);
    u.x = static_cast<uint32_t>(__ldg(s + 0)) | (static_cast<uint32_t>(__ldg(s + 1)) << 16);
    u.y = static_cast<uint32_t>(__ldg(s + 2)) | (static_cast<uint32_t>(__ldg(s + 3)) << 16);
    u.z = static_cast<uint32_t>(__ldg(s + 4)) | (static_cast<uint32_t>(__ldg(s + 5)) << 16);
    u.w = static_cast<uint32_t>(__ldg(s + 6)) | (static_cast<uint32_t>(__ldg(s + 7)) << 16);
  }
  return sanitize ? finite_bf16x8(u) : u;
}

// ---- tile loaders: 64 rows of HD elements into a shared-memory tile ----
// Source row `r` is src + (first + r) * row_stride; rows at or past `limit` are zero.

// Asynchronous (cp.async, 16-byte aligned source rows).
template <int HD, bool kSwizzled, typename T>
__device__ __forceinline__ void tile_async(bf16* dst, const T* src, int64_t row_stride,
                                           int32_t first, int32_t limit, int tid) {
  using G = Geometry<HD, kSwizzled>;
  // One source pointer and one destination offset, stepped per pass (Geometry's mapping).
  constexpr int kRowsPerPass = G::kRowsPerPass;
  constexpr int kDstStep = kRowsPerPass * (kSwizzled ? 64 : G::kStride);
  const int r0 = tid / G::kChunksPerRow;
  const T* s = src + static_cast<int64_t>(first + r0) * row_stride + (tid % G::kChunksPerRow) * 8;
  bf16* d = dst + chunk_offset<HD, kSwizzled>(r0, tid % G::kChunksPerRow);
  const int64_t src_step = kRowsPerPass * row_stride;
  if (first + kKeys <= limit) {  // every row exists (all tiles but a view's last)
#pragma unroll
    for (int i = 0; i < G::kPasses; ++i) cp_async16(d + i * kDstStep, s + i * src_step, 16);
  } else {
#pragma unroll
    for (int i = 0; i < G::kPasses; ++i) {
      const bool ok = first + r0 + i * kRowsPerPass < limit;
      cp_async16(d + i * kDstStep, ok ? s + i * src_step : src, ok ? 16 : 0);
    }
  }
}

// Through registers (unaligned sources, sanitising non-finite values to 0), for N tiles at once
// (K and V: their loads are in flight together), in batches of at most 64 registers of loaded
// data.
template <int HD, bool kSwizzled, int N, typename T>
__device__ __forceinline__ void tile_regs(bf16* const (&dst)[N], const T* const (&src)[N],
                                          const bool (&sanitize)[N], int64_t row_stride,
                                          int32_t first, int32_t limit, int tid, bool vec) {
  using G = Geometry<HD, kSwizzled>;
  constexpr int kMaxBatch = 64 / (N * 2 * static_cast<int>(sizeof(T)));  // chunks per tile
  constexpr int kBatch = G::kPasses < kMaxBatch ? G::kPasses : kMaxBatch;
  static_assert(G::kPasses % kBatch == 0, "batches");
  const int c = tid % G::kChunksPerRow;  // Geometry's mapping
#pragma unroll
  for (int b = 0; b < G::kPasses; b += kBatch) {
    uint4 val[N][kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int r = tid / G::kChunksPerRow + (b + i) * G::kRowsPerPass;
      const int64_t offset = static_cast<int64_t>(first + r) * row_stride + c * 8;
#pragma unroll
      for (int n = 0; n < N; ++n) {
        val[n][i] = make_uint4(0, 0, 0, 0);
        if (first + r < limit) val[n][i] = load8(src[n] + offset, vec, sanitize[n]);
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int r = tid / G::kChunksPerRow + (b + i) * G::kRowsPerPass;
#pragma unroll
      for (int n = 0; n < N; ++n) {
        *reinterpret_cast<uint4*>(dst[n] + chunk_offset<HD, kSwizzled>(r, c)) = val[n][i];
      }
    }
  }
}

// Starts loading the K or V tile of schedule entry `entry` into dst: src = the K or V storage at
// the block's kv head. V of a tile not marked full is sanitised: through registers, or (bf16
// storage, 16-byte aligned rows: cp.async like any tile) afterwards by sanitize_v.
template <int HD, bool kSwizzled>
__device__ __forceinline__ void issue_half_tile(bf16* dst, const Params& p, const bf16* src,
                                                int32_t entry, bool is_v, int tid) {
  const int32_t first = (entry >> 1) * kKeys;
  const bool sanitize = is_v && p.sanitize_v && (entry & 1) == 0;
  const int64_t stride = static_cast<int64_t>(p.kv_heads) * HD;
  if (p.kv_vec) {
    tile_async<HD, kSwizzled>(dst, src, stride, first, p.num_keys, tid);
    return;
  }
  bf16* const d[1] = {dst};
  const bf16* const s[1] = {src};
  const bool z[1] = {sanitize};
  tile_regs<HD, kSwizzled>(d, s, z, stride, first, p.num_keys, tid, p.kv_vec);
}

// Both tiles of the entry into sk / sv. Where they go through registers (unaligned storage), their
// loads are in flight together.
template <int HD, bool kSwizzled>
__device__ __forceinline__ void issue_kv_tile(bf16* sk, bf16* sv, const Params& p, const bf16* kg,
                                              const bf16* vg, int32_t entry, int tid) {
  if (p.kv_vec) {
    issue_half_tile<HD, kSwizzled>(sk, p, kg, entry, false, tid);
    issue_half_tile<HD, kSwizzled>(sv, p, vg, entry, true, tid);
    return;
  }
  bf16* const dst[2] = {sk, sv};
  const bf16* const src[2] = {kg, vg};
  const bool sanitize[2] = {false, p.sanitize_v && (entry & 1) == 0};
  tile_regs<HD, kSwizzled>(dst, src, sanitize, static_cast<int64_t>(p.kv_heads) * HD,
                           (entry >> 1) * kKeys, p.num_keys, tid, p.kv_vec);
}

// V of a tile not marked full that came by cp.async (aligned rows): once the thread's own copies
// have landed (cp_async_wait), it zeroes the non-finite values of the chunks it copied itself
// (tile_async's mapping), before the barrier that publishes the tile. Through registers instead,
// the loads' latency would sit on the step's critical path.
template <int HD, bool kSwizzled>
__device__ __forceinline__ void sanitize_v(bf16* sv, const Params& p, int32_t entry, int tid) {
  if (!p.kv_vec || !p.sanitize_v || (entry & 1) != 0) return;
  using G = Geometry<HD, kSwizzled>;
  const int r0 = tid / G::kChunksPerRow;
  const int c = tid % G::kChunksPerRow;
#pragma unroll
  for (int i = 0; i < G::kPasses; ++i) {
    auto* q =
        reinterpret_cast<uint4*>(sv + chunk_offset<HD, kSwizzled>(r0 + i * G::kRowsPerPass, c));
    *q = finite_bf16x8(*q);
  }
}

// Bits [lo, hi) of a 64-bit word, 0 <= lo < hi <= 64.
__device__ __forceinline__ uint64_t bit_range(int lo, int hi) {
  const int n = hi - lo;
  const uint64_t ones = n >= 64 ? ~0ull : ((1ull << n) - 1ull);
  return ones << lo;
}

// One span, in one 8-byte load (the plan's span arrays are 8-byte aligned).
__device__ __forceinline__ KeyRange load_span(const KeyRange* __restrict__ spans, int32_t i) {
  const int2 v = __ldg(reinterpret_cast<const int2*>(spans + i));
  return KeyRange{v.x, v.y};
}

// Which keys of the tile [first, first + 64) a row sees, as bits; `cursor` (the row's first span
// not wholly before the tile) only moves forward since the tiles come in ascending order.
// kCached: `cur` holds a copy of spans[cursor] (while cursor < end), so that a row with one span
// (the causal prefill's) reads no memory here; the wide kernel, at its register limit, reads
// them.
template <bool kCached>
__device__ __forceinline__ uint64_t span_mask(const KeyRange* __restrict__ spans, int32_t& cursor,
                                              int32_t end, KeyRange& cur, int32_t first) {
  const auto at = [&](int32_t c) { return kCached && c == cursor ? cur : load_span(spans, c); };
  while (cursor < end && at(cursor).end <= first) {
    if (++cursor < end && kCached) cur = load_span(spans, cursor);
  }
  uint64_t mask = 0;
  for (int32_t c = cursor; c < end; ++c) {
    const KeyRange s = at(c);
    if (s.begin >= first + kKeys) break;
    const int lo = s.begin > first ? s.begin - first : 0;
    const int hi = s.end < first + kKeys ? s.end - first : kKeys;
    mask |= bit_range(lo, hi);
  }
  return mask;
}

// The span lists of a thread's two rows (row_base + local_row and + 8; none past p.rows), walked
// forward by the masks of the schedule's entries in their ascending order.
template <bool kCached>
struct RowSpans {
  int32_t cursor[2];
  int32_t end[2];
  KeyRange cur[2];  // kCached: spans[cursor[i]] while cursor[i] < end[i]
  __device__ __forceinline__ RowSpans(const Params& p, int32_t row_base, int local_row) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int32_t r = row_base + local_row + 8 * i;
      cursor[i] = r < p.rows ? __ldg(p.row_offsets + r) : 0;
      end[i] = r < p.rows ? __ldg(p.row_offsets + r + 1) : 0;
      cur[i] = kCached && cursor[i] < end[i] ? load_span(p.spans, cursor[i]) : KeyRange{0, 0};
    }
  }
  // Which keys of the key tile [first, first + 64) each row sees (span_mask of both rows).
  __device__ __forceinline__ void mask(const KeyRange* __restrict__ spans, int32_t first,
                                       uint64_t (&m)[2]) {
    m[0] = span_mask<kCached>(spans, cursor[0], end[0], cur[0], first);
    m[1] = span_mask<kCached>(spans, cursor[1], end[1], cur[1], first);
  }
};

// ---- one key tile: S = Q K^T, masking, online softmax update, O += P V ----
// Thread (lane) holds rows g = lane / 4 and g + 8 of its warp's 16 and, of every 8-column block,
// columns 2 * (lane % 4) and + 1 (the mma C layout, which wgmma's accumulators share).

// S of the warp's 16 rows on mma.sync: B fragments from ldmatrix on the (padded) K tile.
template <int HD>
__device__ __forceinline__ void scores_mma(float (&s)[kKeys / 8][4],
                                           const uint32_t (&qa)[HD / 16][4], const bf16* sk,
                                           int lane) {
  using G = Geometry<HD, false>;
#pragma unroll
  for (int n = 0; n < kKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
  // ldmatrix.x4 on K: matrices (keys +0..7, dims +0..7), (+0..7, +8..15), (+8..15, +0..7),
  // (+8..15, +8..15) = B fragments (b0, b1) of key blocks 2np and 2np + 1.
  const int k_row = (lane & 7) + ((lane >> 4) & 1) * 8;
  const int k_col = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
#pragma unroll
    for (int np = 0; np < kKeys / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, sk + (np * 16 + k_row) * G::kStride + ks * 16 + k_col);
      mma_bf16(s[2 * np], qa[ks], b[0], b[1]);
      mma_bf16(s[2 * np + 1], qa[ks], b[2], b[3]);
    }
  }
}

// A row's reference max m (exp2 domain) moves only where the row's scores exceed it by more than
// kRescaleSlack: P then stays below 2^8, which bf16 (8 bits of mantissa at any exponent) and the
// fp32 sums hold as well as values below 1, and a warp whose rows all kept their m skips O's
// rescale (rescale_o: 64 multiplications a thread at head_dim 128). The running max of a causal
// row grows mostly over its first key tiles (FlashAttention-4's conditional rescaling).
constexpr float kRescaleSlack = 8.0f;

// Scales and masks S (exp2 domain), moves the reference max and l, and turns S into P; O is to
// be multiplied by alpha (rescale_o), which the wgmma pipeline defers until the product in flight
// on O is done. kBlocks / 8 key tiles of 64 keys side by side (one, or the wide kernel's two);
// mask[t][i]: which keys of tile t row i of the thread sees.
template <bool kFull, int kBlocks>
__device__ __forceinline__ void softmax_scores(float (&s)[kBlocks][4], float (&m)[2], float (&l)[2],
                                               float (&alpha)[2], int lane, float scale_log2,
                                               const uint64_t (&mask)[kBlocks / 8][2]) {
  // m is kept in the exp2 domain (scaled); the scale is folded into the exponent's FMA.
  const int tig = lane & 3;
  float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < kBlocks; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (!kFull) {
        const int col = (n % 8) * 8 + tig * 2 + (e & 1);
        if (((mask[n / 8][e >> 1] >> col) & 1ull) == 0) s[n][e] = -INFINITY;
      }
      row_max[e >> 1] = fmaxf(row_max[e >> 1], s[n][e]);
    }
  }
  float m_use[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffffu, row_max[i], 1));
    row_max[i] = fmaxf(row_max[i], __shfl_xor_sync(0xffffffffu, row_max[i], 2));
    const float m_max = fmaxf(m[i], row_max[i] * scale_log2);
    // Kept unless exceeded by more than the slack (from -inf always moves: inf > slack; -inf to
    // -inf compares NaN and keeps it).
    const float m_new = m_max - m[i] > kRescaleSlack ? m_max : m[i];
    // Nothing seen yet: subtract 0 instead of -inf (exp2(-inf - -inf) would be NaN); every
    // masked score then gives exp2(-inf) = 0. A kept m (-inf included: O and l are still 0) gives
    // alpha = 1 exactly.
    m_use[i] = m_new == -INFINITY ? 0.0f : m_new;
    alpha[i] = m_new == m[i] ? 1.0f : fast_exp2(m[i] - m_use[i]);
    m[i] = m_new;
    l[i] *= alpha[i];
  }
#pragma unroll
  for (int n = 0; n < kBlocks; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pe = fast_exp2(fmaf(s[n][e], scale_log2, -m_use[e >> 1]));
      s[n][e] = pe;
      l[e >> 1] += pe;
    }
  }
}

// kSkip: not where no row of the warp moved its reference max (softmax_scores). The wgmma kernels
// skip; the mma.sync kernel, which rescales right before its P V products, gains nothing from the
// vote and always multiplies.
template <int HD, bool kSkip = true>
__device__ __forceinline__ void rescale_o(float (&o)[HD / 8][4], const float (&alpha)[2]) {
  if (kSkip && !__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) return;
#pragma unroll
  for (int d = 0; d < HD / 8; ++d) {
    o[d][0] *= alpha[0];
    o[d][1] *= alpha[0];
    o[d][2] *= alpha[1];
    o[d][3] *= alpha[1];
  }
}

// softmax_scores, branching on whether the tiles need their masks.
template <int kBlocks>
__device__ __forceinline__ void softmax_tile(bool full, float (&s)[kBlocks][4], float (&m)[2],
                                             float (&l)[2], float (&alpha)[2], int lane,
                                             float scale_log2,
                                             const uint64_t (&mask)[kBlocks / 8][2]) {
  if (full) {
    softmax_scores<true>(s, m, l, alpha, lane, scale_log2, mask);
  } else {
    softmax_scores<false>(s, m, l, alpha, lane, scale_log2, mask);
  }
}

// The A fragment of P for keys [16kk, 16kk + 16): the C fragments of key blocks 2kk and 2kk + 1,
// rounded to bf16.
template <int kBlocks>
__device__ __forceinline__ void p_fragment(uint32_t (&a)[4], const float (&s)[kBlocks][4], int kk) {
  a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// O += P V on mma.sync: ldmatrix.x4.trans on the (padded) V tile: matrices (keys +0..7, dims
// +0..7), (+8..15, +0..7), (+0..7, +8..15), (+8..15, +8..15) = B fragments of dim blocks 2dp and
// 2dp + 1.
template <int HD>
__device__ __forceinline__ void accumulate_pv_mma(float (&o)[HD / 8][4],
                                                  const float (&s)[kKeys / 8][4], const bf16* sv,
                                                  int lane) {
  using G = Geometry<HD, false>;
  const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int v_col = ((lane >> 4) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    uint32_t a[4];
    p_fragment(a, s, kk);
#pragma unroll
    for (int dp = 0; dp < HD / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sv + (kk * 16 + v_row) * G::kStride + dp * 16 + v_col);
      mma_bf16(o[2 * dp], a, b[0], b[1]);
      mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// S of the block's 64 rows on wgmma, issued (the caller commits and waits).
// kBlocks * 8 keys (64, or the wide kernel's 128); k_panel_bytes: the K tile's 64-dim panels
// apart (kPanelBytes for 64 keys, as Q's).
template <int HD, int kBlocks>
__device__ __forceinline__ void issue_scores_wgmma(float (&s)[kBlocks][4], uint64_t q_desc,
                                                   const bf16* sk,
                                                   uint32_t k_panel_bytes = kPanelBytes) {
  static_assert(kBlocks == 8 || kBlocks == 16, "64 or 128 keys");
  // K-major, swizzled: 8-row groups 1024 bytes apart; step ks reads dims [16ks, 16ks + 16): 32
  // bytes into the line of panel ks / 4 (the hardware applies the swizzle to that address).
  const uint64_t k_desc = detail::wgmma_desc_sw128(sk, 16, 1024);
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    const uint32_t col = (ks & 3) * 32;
    const uint64_t a = detail::wgmma_desc_add(q_desc, (ks >> 2) * kPanelBytes + col);
    const uint64_t b = detail::wgmma_desc_add(k_desc, (ks >> 2) * k_panel_bytes + col);
    if constexpr (kBlocks == 8) {
      detail::wgmma_m64n64k16_ss(s, a, b, ks > 0);
    } else {
      detail::wgmma_m64n128k16_ss(s, a, b, ks > 0);
    }
  }
}

// O += P V on wgmma, issued: P from registers (`a`, which must stay untouched until the product
// is waited for), V's tile as the transposed B.
// kSlices * 16 keys; panel_bytes: the tile's 64-dim panels apart (kPanelBytes for 64 keys).
template <int HD, int kSlices>
__device__ __forceinline__ void issue_pv_wgmma(float (&o)[HD / 8][4],
                                               const uint32_t (&a)[kSlices][4], const bf16* sv,
                                               uint32_t panel_bytes = kPanelBytes) {
  // N-major (transposed), swizzled: the 64 dims of a panel along a 128-byte row, panels (the next
  // 64 dims) panel_bytes apart, 8-key groups 1024 bytes apart; step kk reads keys
  // [16kk, 16kk + 16).
  const uint64_t v_desc = detail::wgmma_desc_sw128(sv, panel_bytes, 1024);
#pragma unroll
  for (int kk = 0; kk < kSlices; ++kk) {
    const uint64_t b = detail::wgmma_desc_add(v_desc, kk * 2048);
    if constexpr (HD == 128) {
      detail::wgmma_m64n128k16_rs(o, a[kk], b);
    } else {
      detail::wgmma_m64n64k16_rs(o, a[kk], b);
    }
  }
}

// A row's thread-partial sum over the 4 lanes that hold its columns (the mma C layout).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Normalises the warp's 16 rows of O (O / l; 0 where l = 0), writes their lse (ln domain; -inf
// where l = 0), stages them as bf16 in `so` (the warpgroup's 64 rows, of which the warp writes and
// reads only its own) and stores them with 16-byte writes. Staging rows: padded (HD + 8), or
// (kSwizzled) HD apart with 16-byte chunk c of row r at c ^ (r % 8), either way free of bank
// conflicts.
template <int HD, bool kSwizzled = false>
__device__ __forceinline__ void store_o(bf16* so, const float (&o)[HD / 8][4], const float (&m)[2],
                                        const float (&l)[2], const Params& p, int h,
                                        int32_t row_base, int local_row, int warp, int lane) {
  constexpr int kChunksPerRow = HD / 8;
  constexpr int kOStride = kSwizzled ? HD : HD + 8;
  const auto chunk = [](int r, int c) { return kSwizzled ? c ^ (r & 7) : c; };
  const int tig = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float sum = quad_sum(l[i]);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int lr = local_row + 8 * i;
#pragma unroll
    for (int d = 0; d < HD / 8; ++d) {
      *reinterpret_cast<uint32_t*>(so + lr * kOStride + chunk(lr, d) * 8 + tig * 2) =
          pack_bf16x2(o[d][2 * i] * inv, o[d][2 * i + 1] * inv);
    }
    const int32_t r = row_base + lr;
    if (p.lse != nullptr && tig == 0 && r < p.rows) {
      p.lse[static_cast<int64_t>(r) * p.heads + h] =
          sum > 0.0f ? (m[i] + log2f(sum)) * kLn2 : -INFINITY;
    }
  }
  __syncwarp();
  bf16* const out_h = p.out + static_cast<int64_t>(h) * HD;
#pragma unroll
  for (int i = 0; i < 16 * kChunksPerRow / 32; ++i) {
    const int c = lane + 32 * i;
    const int lr = warp * 16 + c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    const int32_t r = row_base + lr;
    if (r >= p.rows) continue;
    const uint4 val =
        *reinterpret_cast<const uint4*>(so + lr * kOStride + chunk(lr, c % kChunksPerRow) * 8);
    bf16* const dst = out_h + static_cast<int64_t>(r) * p.out_stride + col;
    if (p.out_vec) {
      *reinterpret_cast<uint4*>(dst) = val;
    } else {
      auto* d = reinterpret_cast<unsigned short*>(dst);
      const uint32_t w[4] = {val.x, val.y, val.z, val.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        d[2 * e] = static_cast<unsigned short>(w[e] & 0xffffu);
        d[2 * e + 1] = static_cast<unsigned short>(w[e] >> 16);
      }
    }
  }
}

// kAligned: Q, O, K and V allow 16-byte accesses (launch() checked), so the loaders' and the
// store's element-wise fallbacks are compiled out: they made the main loop's code several times
// longer, and instruction fetch a stall of its own (benchmarks/RESULTS.md run 11).
// kOneK (wgmma only): one K buffer instead of two, 65 KB of shared memory a block at head_dim
// 128, so that three blocks share an SM (the aligned instance fits the 168 registers that allows).
template <bool kOneK>
constexpr int kKBuffers = kOneK ? 1 : 2;
template <int HD, bool kWgmma, bool kOneK>
constexpr size_t kBlockSmemBytes = Geometry<HD, kWgmma>::kSmemBytes -
                                   (kOneK ? Geometry<HD, kWgmma>::kTileElems * sizeof(bf16) : 0);
static_assert(kBlockSmemBytes<128, true, true> >= kRows * (128 + 8) * sizeof(bf16),
              "O staging fits with one K buffer");
static_assert(3 * (kBlockSmemBytes<128, true, true> + 1024) <= 228 * 1024,
              "three blocks an SM with one K buffer");

template <int HD, bool kWgmma, bool kAligned, bool kOneK>
__global__ void __launch_bounds__(kThreads, HD <= 64 || kOneK ? 3 : 2)
    attention_prefill_kernel(const Params p_arg) {
  static_assert(kWgmma || !kOneK, "one K buffer: the wgmma pipeline");
  Params p = p_arg;
  if constexpr (kAligned) p.q_vec = p.out_vec = p.kv_vec = true;
  using G = Geometry<HD, kWgmma>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // wgmma: the swizzled panels start 1024-byte aligned (kSmemBytes has the slack).
  unsigned char* const smem =
      kWgmma ? smem_raw + ((1024 - (detail::smem_u32(smem_raw) & 1023)) & 1023) : smem_raw;
  bf16* const sk = reinterpret_cast<bf16*>(smem);          // K tiles [2], or one
  bf16* const sv = sk + kKBuffers<kOneK> * G::kTileElems;  // V tiles [2]
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  // Heaviest row tiles first (the last rows see the most keys in the usual layouts), all heads of
  // a row tile next to each other (GQA heads share their K/V tiles in L2).
  // Split-key runs of a row tile next to each other too (they read the same Q).
  const int64_t block = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const int h = static_cast<int>(block % p.heads);
  const int64_t tile_run = block / p.heads;
  const int32_t row_tile = p.row_tiles - 1 - static_cast<int32_t>(tile_run / p.splits);
  const int32_t row_base = row_tile * kRows;
  const int64_t kv_offset = static_cast<int64_t>(h / p.group) * HD;
  const bf16* const kg = p.k + kv_offset;
  const bf16* const vg = p.v + kv_offset;
  int32_t sched_begin = __ldg(p.tile_offsets + row_tile);
  int32_t n_tiles = __ldg(p.tile_offsets + row_tile + 1) - sched_begin;
  if (p.splits > 1) {  // this run's key tiles (none for the last runs of a short row tile)
    const int32_t run = static_cast<int32_t>(tile_run % p.splits);
    const int32_t per = (n_tiles + p.splits - 1) / p.splits;
    const int32_t first = min(run * per, n_tiles);
    sched_begin += first;
    n_tiles = min(per, n_tiles - first);
    const int64_t part = static_cast<int64_t>(run) * p.rows;
    p.out = p.part_out + part * p.heads * HD;
    p.out_stride = static_cast<int64_t>(p.heads) * HD;
    p.lse = p.part_lse + part * p.heads;
  }
  // The schedule's first entries and the rows' span lists: plan data, read before waiting for the
  // previous kernels (which write Q, K and V), so that their latency overlaps those kernels' end.
  auto tile = [&](int32_t j) { return j < n_tiles ? __ldg(p.tiles + sched_begin + j) : 0; };
  int32_t entry = tile(0);
  int32_t e_next = tile(1);   // the wgmma loop's tile j + 1 ...
  int32_t e_after = tile(2);  // ... and j + 2, each loaded a step before it is needed
  const int local_row = warp * 16 + lane / 4;  // the thread's two rows: local_row and + 8
  RowSpans<true> spans(p, row_base, local_row);
  detail::wait_previous_grid();  // Q, K and V come from the previous kernels
  detail::allow_next_grid();

  // Stage Q (rows past `rows` zero): in K buffer 1 for mma.sync (read once into registers), in a
  // buffer of its own for wgmma (read by every product). Start the first K/V tile into buffer 0.
  bf16* const sq = kWgmma ? sv + 2 * G::kTileElems : sk + G::kTileElems;
  const bf16* const qh = p.q + static_cast<int64_t>(h) * HD;
  if (p.q_vec) {
    tile_async<HD, kWgmma>(sq, qh, p.q_stride, row_base, p.rows, tid);
  } else {
    bf16* const dst[1] = {sq};
    const bf16* const src[1] = {qh};
    const bool sanitize[1] = {false};
    tile_regs<HD, kWgmma>(dst, src, sanitize, p.q_stride, row_base, p.rows, tid, false);
  }
  if constexpr (kWgmma) {
    // Q and K of tile 0 in one group, then V of tile 0 (and with two K buffers K and V of tile
    // 1) in more: the first product waits for Q and K0 only, and the other loads overlap it and
    // the first softmax. With one K buffer, K1 and V1 follow once every warp is done with K0.
    if (n_tiles > 0) issue_half_tile<HD, true>(sk, p, kg, entry, false, tid);
    cp_async_commit();
    if (n_tiles > 0) issue_half_tile<HD, true>(sv, p, vg, entry, true, tid);
    cp_async_commit();
    if constexpr (kOneK) {
      cp_async_wait<1>();  // Q and K of tile 0
    } else {
      if (n_tiles > 1) issue_half_tile<HD, true>(sk + G::kTileElems, p, kg, e_next, false, tid);
      cp_async_commit();
      if (n_tiles > 1) issue_half_tile<HD, true>(sv + G::kTileElems, p, vg, e_next, true, tid);
      cp_async_commit();
      cp_async_wait<3>();  // Q and K of tile 0
    }
    detail::fence_proxy_async_shared();
  } else {
    if (n_tiles > 0) issue_kv_tile<HD, false>(sk, sv, p, kg, vg, entry, tid);
    cp_async_commit();
    cp_async_wait<0>();
    if (n_tiles > 0) sanitize_v<HD, false>(sv, p, entry, tid);
  }
  __syncthreads();

  // mma.sync: Q A fragments of the warp's 16 rows: matrices (rows +0..7, dims +0..7), (+8..15,
  // +0..7), (+0..7, +8..15), (+8..15, +8..15). wgmma: a descriptor of the Q tile.
  uint32_t qa[kWgmma ? 1 : HD / 16][4];
  uint64_t q_desc = 0;
  if constexpr (kWgmma) {
    q_desc = detail::wgmma_desc_sw128(sq, 16, 1024);
  } else {
    const int q_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    const int q_col = ((lane >> 4) & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
      ldmatrix_x4(qa[ks], sq + q_row * G::kStride + ks * 16 + q_col);
    }
  }

  float o[HD / 8][4];
#pragma unroll
  for (int d = 0; d < HD / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};

  auto tile_mask = [&](int32_t e, uint64_t(&mask)[1][2]) {
    mask[0][0] = mask[0][1] = ~0ull;
    if ((e & 1) == 0) spans.mask(p.spans, (e >> 1) * kKeys, mask[0]);
  };
  if constexpr (kWgmma) {
    // Software pipeline over the key tiles: with tile j's P in registers, S of tile j + 1 and
    // O += P_j V_j are issued together; the softmax of tile j + 1 runs while the second product
    // is still in flight, and O is rescaled once it is done. Loads run ahead: K of tile j + 2
    // as soon as its buffer is free (two K buffers: S of tile j is done, start of step j; one K
    // buffer: every warp's S of tile j + 1 is, mid step j), V of tile j + 2 once O += P_j V_j is
    // (end of step j); step j waits for all but the newest group (V of j + 1). One K buffer keeps
    // a block at 65 KB of shared memory, so three blocks share an SM instead of two; where a launch
    // has too few blocks to fill the third slot, K's shorter lead costs more than that gains
    // (kPrefillOneKMinBlocksPerSm; benchmarks/RESULTS.md run 15).
    float s[kKeys / 8][4];
    float alpha[2];
    uint64_t mask[1][2];
    if (n_tiles > 0) {
      tile_mask(entry, mask);
      __syncwarp();  // wgmma is issued by converged warps
      detail::wgmma_fence();
      issue_scores_wgmma<HD>(s, q_desc, sk);
      detail::wgmma_commit();
      detail::wgmma_wait<0>();
      detail::wgmma_fence_operands(s);
    }
    if constexpr (kOneK) {
      __syncthreads();  // every warp is done with K0: its buffer takes K1
      if (n_tiles > 1) issue_half_tile<HD, true>(sk, p, kg, e_next, false, tid);
      cp_async_commit();
      if (n_tiles > 1) issue_half_tile<HD, true>(sv + G::kTileElems, p, vg, e_next, true, tid);
      cp_async_commit();
    }
    if (n_tiles > 0) {
      softmax_tile((entry & 1) != 0, s, m, l, alpha, lane, p.scale_log2, mask);  // O is 0 yet
    }
    uint32_t a[kKeys / 16][4];
    for (int32_t j = 0; j + 1 < n_tiles; ++j) {
      const int32_t next = e_next;    // tile j + 1
      const int32_t after = e_after;  // tile j + 2
      e_next = after;
      e_after = tile(j + 3);
      cp_async_wait<1>();  // K of tile j + 1 and V of tile j in place
      sanitize_v<HD, true>(sv + (j & 1) * G::kTileElems, p, entry, tid);
      detail::fence_proxy_async_shared();
      __syncthreads();  // ... for every thread; and every thread is done with S of tile j
      if constexpr (!kOneK) {
        if (j + 2 < n_tiles) {
          issue_half_tile<HD, true>(sk + (j & 1) * G::kTileElems, p, kg, after, false, tid);
        }
        cp_async_commit();  // (an empty group at the end keeps the count)
      }
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) p_fragment(a[kk], s, kk);
      __syncwarp();
      detail::wgmma_fence();
      issue_scores_wgmma<HD>(s, q_desc, sk + (kOneK ? 0 : ((j + 1) & 1) * G::kTileElems));
      detail::wgmma_commit();
      issue_pv_wgmma<HD>(o, a, sv + (j & 1) * G::kTileElems);
      detail::wgmma_commit();
      tile_mask(next, mask);
      detail::wgmma_wait<1>();  // S of tile j + 1 (committed first)
      detail::wgmma_fence_operands(s);
      if constexpr (kOneK) {
        __syncthreads();  // every warp is done with K of tile j + 1: the buffer takes tile j + 2
        if (j + 2 < n_tiles) issue_half_tile<HD, true>(sk, p, kg, after, false, tid);
        cp_async_commit();  // (an empty group at the end keeps the count)
      }
      softmax_tile((next & 1) != 0, s, m, l, alpha, lane, p.scale_log2, mask);
      detail::wgmma_wait<0>();  // O += P_j V_j
      detail::wgmma_fence_operands(o);
      rescale_o<HD>(o, alpha);
      __syncthreads();  // every warp past its wait: V buffer j & 1 is free
      if (j + 2 < n_tiles) {
        issue_half_tile<HD, true>(sv + (j & 1) * G::kTileElems, p, vg, after, true, tid);
      }
      cp_async_commit();
      entry = next;
    }
    if (n_tiles > 0) {  // O += P V of the last tile
      cp_async_wait<0>();
      sanitize_v<HD, true>(sv + ((n_tiles - 1) & 1) * G::kTileElems, p, entry, tid);
      detail::fence_proxy_async_shared();
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) p_fragment(a[kk], s, kk);
      __syncwarp();
      detail::wgmma_fence();
      issue_pv_wgmma<HD>(o, a, sv + ((n_tiles - 1) & 1) * G::kTileElems);
      detail::wgmma_commit();
      detail::wgmma_wait<0>();
      detail::wgmma_fence_operands(o);
    }
  } else {
    for (int32_t j = 0; j < n_tiles; ++j) {
      // Tile j is in buffer j & 1. The barrier publishes it and guarantees that every warp is
      // done with tile j - 1 (and, for j = 0, with the Q staging), whose buffer the next load
      // reuses.
      cp_async_wait<0>();
      if (j > 0) sanitize_v<HD, false>(sv + (j & 1) * G::kTileElems, p, entry, tid);
      __syncthreads();
      int32_t next = 0;
      if (j + 1 < n_tiles) {
        next = __ldg(p.tiles + sched_begin + j + 1);
        const int buf = (j + 1) & 1;
        issue_kv_tile<HD, false>(sk + buf * G::kTileElems, sv + buf * G::kTileElems, p, kg, vg,
                                 next, tid);
      }
      cp_async_commit();
      float s[kKeys / 8][4];
      float alpha[2];
      uint64_t mask[1][2];
      tile_mask(entry, mask);
      scores_mma<HD>(s, qa, sk + (j & 1) * G::kTileElems, lane);
      softmax_tile((entry & 1) != 0, s, m, l, alpha, lane, p.scale_log2, mask);
      rescale_o<HD, false>(o, alpha);
      accumulate_pv_mma<HD>(o, s, sv + (j & 1) * G::kTileElems, lane);
      entry = next;
    }
  }

  // Normalise, stage the warp's 16 rows of O as bf16 (padded rows), then store them with 16-byte
  // writes. mma.sync: in the K buffer the last tile did not use (for no tiles, buffer 0; for one
  // tile, buffer 1 = the Q staging, whose rows each warp only read for itself). wgmma: at the
  // start of shared memory, after a barrier: every product of the block is then complete.
  if constexpr (kWgmma) __syncthreads();
  bf16* const so = kWgmma ? sk : sk + (n_tiles & 1) * G::kTileElems;
  store_o<HD>(so, o, m, l, p, h, row_base, local_row, warp, lane);
}

// ---- the two-warpgroup kernel (PrefillKernel::kWgmmaWide) ----
// A block covers two row tiles (128 rows; consumer warpgroup c owns the rows of tile 2i + c) of one
// head and steps over the keys 128 at a time (two schedule entries), so that a step has twice the
// tensor work of the one-warpgroup kernel per wait, rescale of O and load round trip (that kernel
// is latency bound at two warpgroups per SM). Both consumers walk the union of their tiles'
// schedules (merged on the fly; an entry is full only where both tiles have it full) and share
// every K/V tile; a key tile only one of them sees is masked to nothing for the other.
// Warp-specialized, like gemm_swiglu: warpgroup 0's first warp loads Q, K and V by TMA (two K and
// two V buffers, mbarriers full / empty); its second warp sanitises V (non-finite values of a tile
// not marked full to 0, and zeros for the missing half of a step of one tile) before the
// consumers may read it; warpgroups 1 and 2 run the products and the softmax, each at its own
// pace (cp.async loads and __syncthreads would run them in lockstep). Shared memory: K and V of a
// step as 64-dim panels of 128 key rows (tile 2j's keys in rows 0..63, tile 2j + 1's in 64..127:
// one K-major B of N = 128 for S = Q K^T, one transposed B of K = 128 for O += P V); Q per consumer
// as in the other kernel (and its O staging at the end). bf16 K/V and 16-byte aligned Q, K, V
// only (launch() falls back to kWgmma otherwise). The pipeline, masks, softmax and epilogue are
// the other kernel's wgmma path.
constexpr int kWideThreads = 384;
// kAuto's choice (kPrefillWideMinKeys), from test_attention's timings on the H200: this kernel
// from 4096 keys on, the one-warpgroup kernel below that and at head_dim 64
// (benchmarks/RESULTS.md).
constexpr int kWideKeys = 2 * kKeys;
constexpr uint32_t kWidePanelBytes = kWideKeys * 128;  // 128 key rows of one 64-dim panel
constexpr uint32_t kBoxBytes = kKeys * 128;            // one TMA box: 64 rows x 64 elements
constexpr int kWideProducerRegs = 24;
constexpr int kWideConsumerRegs = 240;
static_assert(kWideProducerRegs * 128 + kWideConsumerRegs * 256 <= 65536, "registers");

// kPool: the pooling of attention_prefill_pool in the same pass. A step's 128 keys also get a
// one-hot tile of their groups (kPoolCols columns, laid out as a 64-dim V panel), built by the
// producer warpgroup's idle warps 2 and 3, and each consumer adds P times it to a second
// accumulator (m64n64: 32 more registers a thread) rescaled as O is; at the end each (row,
// head)'s sums / l are written in fp32 and pool_sum_heads_kernel adds the heads. That saves the
// pool's own attention pass (attention_pool_tiled: S, softmax and a P V of head_dim columns again).
constexpr int kPoolCols = kPoolFusedMaxGroups;
static_assert(kPoolCols == 64, "the one-hot tile is one 64-column panel");

template <int HD, bool kPool = false>
struct WideGeometry {
  static_assert(HD % 64 == 0, "swizzled panels are 64 elements wide");
  static constexpr int kPanels = HD / 64;
  static constexpr int kPairElems = kPanels * static_cast<int>(kWidePanelBytes) / 2;
  static constexpr int kQElems = kPanels * static_cast<int>(kPanelBytes) / 2;
  static constexpr int kPoolElems = kPool ? kWideKeys * kPoolCols : 0;  // a step's one-hot tile
  // q_full, k_full[2], k_empty[2], v_full[2], v_empty[2], v_ready[2] (+ g_ready[2] with kPool)
  static constexpr int kBarriers = kPool ? 13 : 11;
  // K[2], V[2], Q[2], one-hot[2], the barriers, and the slack that aligns the panels to 1024
  // bytes.
  static constexpr size_t kSmemBytes =
      (4 * kPairElems + 2 * kQElems + 2 * kPoolElems) * sizeof(bf16) + kBarriers * 8 + 1024;
  static_assert(kQElems >= kRows * HD, "a consumer's O staging fits in its Q buffer");
};

struct WideArgs {
  Params p;
  CUtensorMap q;  // (rows, heads * HD), q_stride apart, 64 x 64 boxes
  CUtensorMap k;  // (num_keys, kv_heads * HD), 64 x 64 boxes
  CUtensorMap v;
};

// The union of two row tiles' schedules, in ascending key-tile order: entries key_tile * 2 +
// full, full where both tiles have the key tile full -- or, for a block with one row tile (`solo`:
// the last of an odd count), where that tile has it full. Without that, such a block masked every
// step and its V warp sanitised every tile: 64 rows over 4.2k keys (14B heads) took 0.29 ms on
// the H100 against 0.08 for 128 rows, and the lone tile is the heaviest, scheduled first.
struct EntryMerge {
  const int32_t* tiles;
  int32_t a, a_end, b, b_end;
  bool solo;
  __device__ __forceinline__ int32_t next() {  // -1 when done
    const int32_t ea = a < a_end ? __ldg(tiles + a) : INT32_MAX;
    const int32_t eb = b < b_end ? __ldg(tiles + b) : INT32_MAX;
    if (ea == INT32_MAX && eb == INT32_MAX) return -1;
    const int32_t ta = ea >> 1, tb = eb >> 1;
    if (ta == tb) {
      ++a, ++b;
      return (ta << 1) | (ea & eb & 1);
    }
    if (ta < tb) {
      ++a;
      return (ta << 1) | (solo ? ea & 1 : 0);
    }
    ++b;
    return tb << 1;
  }
};

// One step's entries: e[1] = -1 for a last step of one tile; e[0] = -1: no step.
struct StepTiles {
  int32_t e[2];
  __device__ __forceinline__ bool valid() const { return e[0] >= 0; }
  __device__ __forceinline__ bool full() const { return e[1] >= 0 && (e[0] & e[1] & 1) != 0; }
};

// Every non-finite value of `elems` bf16 (a multiple of 256) in shared memory to 0 (or all to 0),
// by one warp.
__device__ __forceinline__ void sanitize_smem(bf16* p, int elems, bool zero, int lane) {
  for (int i = lane; i < elems / 8; i += 32) {
    uint4* q = reinterpret_cast<uint4*>(p) + i;
    *q = zero ? make_uint4(0, 0, 0, 0) : finite_bf16x8(*q);
  }
}

// Key rows [0, 64) of a one-hot group tile for key tile entry e (-1: none, all zeros), by one
// warp: key row r is 128 bytes at r * 128, its 16-byte chunk c (groups [8c, 8c + 8)) stored at
// c ^ (r % 8), as a V panel's; bf16 1 in the key's group column, 0 elsewhere (a key past num_keys,
// of group -1 or of a group >= kPoolCols: a row of zeros).
__device__ __forceinline__ void write_onehot(bf16* dst, int32_t e, const Params& p, int lane) {
  constexpr uint32_t kOne = 0x3F80u;  // bf16 1.0
#pragma unroll
  for (int i = 0; i < kKeys / 32; ++i) {
    const int r = lane + 32 * i;
    int32_t grp = -1;
    if (e >= 0) {
      const int32_t key = (e >> 1) * kKeys + r;
      if (key < p.num_keys) grp = __ldg(p.key_group + key);
    }
#pragma unroll
    for (int c = 0; c < kPoolCols / 8; ++c) {
      const int at = grp - 8 * c;  // the 1's element in this chunk where in [0, 8)
      uint4 val;
      val.x = (at == 0 ? kOne : 0u) | (at == 1 ? kOne << 16 : 0u);
      val.y = (at == 2 ? kOne : 0u) | (at == 3 ? kOne << 16 : 0u);
      val.z = (at == 4 ? kOne : 0u) | (at == 5 ? kOne << 16 : 0u);
      val.w = (at == 6 ? kOne : 0u) | (at == 7 ? kOne << 16 : 0u);
      *reinterpret_cast<uint4*>(dst + r * kPoolCols + ((c ^ (r & 7)) << 3)) = val;
    }
  }
}

// The warp's 16 rows of the pooling accumulator / l (0 where l = 0) to p.pool_heads, fp32.
__device__ __forceinline__ void store_pool(const float (&po)[kPoolCols / 8][4], const float (&l)[2],
                                           const Params& p, int h, int32_t row_base, int local_row,
                                           int lane) {
  const int tig = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float sum = quad_sum(l[i]);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int32_t r = row_base + local_row + 8 * i;
    if (r >= p.rows) continue;
    float* const dst = p.pool_heads + (static_cast<int64_t>(r) * p.heads + h) * kPoolCols + tig * 2;
#pragma unroll
    for (int n = 0; n < kPoolCols / 8; ++n) {
      *reinterpret_cast<float2*>(dst + n * 8) =
          make_float2(po[n][2 * i] * inv, po[n][2 * i + 1] * inv);
    }
  }
}

template <int HD, bool kPool>
__global__ void __launch_bounds__(kWideThreads, 1)
    attention_prefill_wide_kernel(const __grid_constant__ WideArgs args) {
  using W = WideGeometry<HD, kPool>;
  const Params& p = args.p;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + ((1024 - (detail::smem_u32(smem_raw) & 1023)) & 1023);
  bf16* const sk = reinterpret_cast<bf16*>(smem);  // K of a step [2]
  bf16* const sv = sk + 2 * W::kPairElems;         // V of a step [2]
  bf16* const sq = sv + 2 * W::kPairElems;         // Q [consumer]
  bf16* const sg = sq + 2 * W::kQElems;            // one-hot group tile of a step [2] (kPool)
  uint64_t* const q_full = reinterpret_cast<uint64_t*>(sg + 2 * W::kPoolElems);
  uint64_t* const k_full = q_full + 1;    // [2]: loaded
  uint64_t* const k_empty = q_full + 3;   // [2]: both consumers' S done with it
  uint64_t* const v_full = q_full + 5;    // [2]: loaded
  uint64_t* const v_empty = q_full + 7;   // [2]: both consumers' O += P V done with it
  uint64_t* const v_ready = q_full + 9;   // [2]: sanitised
  uint64_t* const g_ready = q_full + 11;  // [2]: one-hot tile written (kPool; both its warps)
  const int tid = threadIdx.x;
  const int wg = tid / 128;
  const int warp = (tid % 128) / 32;
  const int lane = tid % 32;
  detail::wait_previous_grid();  // as the other kernel
  detail::allow_next_grid();

  // Heaviest row tiles first, all heads of a row tile next to each other (as the other kernel).
  const int64_t block = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const int h = static_cast<int>(block % p.heads);
  const int32_t pairs = (p.row_tiles + 1) / 2;
  const int32_t tile_a = 2 * (pairs - 1 - static_cast<int32_t>(block / p.heads));
  const bool has_b = tile_a + 1 < p.row_tiles;
  // Every role walks the same steps, each with its own merge.
  EntryMerge merge{p.tiles,
                   __ldg(p.tile_offsets + tile_a),
                   __ldg(p.tile_offsets + tile_a + 1),
                   has_b ? __ldg(p.tile_offsets + tile_a + 1) : 0,
                   has_b ? __ldg(p.tile_offsets + tile_a + 2) : 0,
                   !has_b};
  auto next_step = [&] {
    StepTiles st;
    st.e[0] = merge.next();
    st.e[1] = st.e[0] >= 0 ? merge.next() : -1;
    return st;
  };
  if (tid == 0) {
    detail::mbar_init(q_full, 1);
    for (int b = 0; b < 2; ++b) {
      detail::mbar_init(&k_full[b], 1);
      detail::mbar_init(&k_empty[b], 2);
      detail::mbar_init(&v_full[b], 1);
      detail::mbar_init(&v_empty[b], 2);
      detail::mbar_init(&v_ready[b], 1);
      if (kPool) detail::mbar_init(&g_ready[b], 2);
    }
    detail::mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    detail::setmaxnreg_dec<kWideProducerRegs>();
    if (warp == 0 && lane == 0) {  // the loads
      const int kv_col = (h / p.group) * HD;
      detail::mbar_arrive_expect_tx(q_full, 2 * W::kPanels * kBoxBytes);
      for (int c = 0; c < 2; ++c) {
        for (int pn = 0; pn < W::kPanels; ++pn) {
          detail::tma_load_2d(sq + c * W::kQElems + pn * (kPanelBytes / 2), &args.q, q_full,
                              h * HD + 64 * pn, (tile_a + c) * kRows);
        }
      }
      for (int s = 0;; ++s) {
        const StepTiles st = next_step();
        if (!st.valid()) break;
        const int b = s & 1;
        const uint32_t bytes = (st.e[1] >= 0 ? 2 : 1) * W::kPanels * kBoxBytes;
        for (int kind = 0; kind < 2; ++kind) {  // K, then V
          uint64_t* const full = kind == 0 ? &k_full[b] : &v_full[b];
          if (s >= 2) detail::mbar_wait(kind == 0 ? &k_empty[b] : &v_empty[b], ((s >> 1) - 1) & 1);
          detail::mbar_arrive_expect_tx(full, bytes);
          bf16* const buf = (kind == 0 ? sk : sv) + b * W::kPairElems;
          for (int t = 0; t < 2; ++t) {
            if (st.e[t] < 0) continue;
            for (int pn = 0; pn < W::kPanels; ++pn) {
              detail::tma_load_2d(buf + pn * (kWidePanelBytes / 2) + t * kKeys * 64,
                                  kind == 0 ? &args.k : &args.v, full, kv_col + 64 * pn,
                                  (st.e[t] >> 1) * kKeys);
            }
          }
        }
      }
    } else if (warp == 1) {  // V sanitised before the consumers read it
      for (int s = 0;; ++s) {
        const StepTiles st = next_step();
        if (!st.valid()) break;
        const int b = s & 1;
        detail::mbar_wait(&v_full[b], (s >> 1) & 1);
        bool wrote = false;
        for (int t = 0; t < 2; ++t) {
          // A full tile, or any tile when every key visited is seen, is read as it is.
          if (st.e[t] >= 0 && ((st.e[t] & 1) != 0 || !p.sanitize_v)) continue;
          for (int pn = 0; pn < W::kPanels; ++pn) {
            sanitize_smem(sv + b * W::kPairElems + pn * (kWidePanelBytes / 2) + t * kKeys * 64,
                          kKeys * 64, st.e[t] < 0, lane);
          }
          wrote = true;
        }
        if (wrote) detail::fence_proxy_async_shared();  // for the consumers' wgmma
        __syncwarp();
        if (lane == 0) detail::mbar_arrive(&v_ready[b]);
      }
    } else if (kPool && warp >= 2) {  // the one-hot tile of the step's first / second key tile
      // (warp 0's other lanes, idle, must not come here)
      const int t = warp - 2;
      for (int s = 0;; ++s) {
        const StepTiles st = next_step();
        if (!st.valid()) break;
        const int b = s & 1;
        // Free once both consumers' products of step s - 2 are done (they release V with it).
        if (s >= 2) detail::mbar_wait(&v_empty[b], ((s >> 1) - 1) & 1);
        // (st.e[t] with a run-time t would put st in local memory)
        write_onehot(sg + b * W::kPoolElems + t * kKeys * kPoolCols, t == 0 ? st.e[0] : st.e[1], p,
                     lane);
        detail::fence_proxy_async_shared();  // for the consumers' wgmma
        __syncwarp();
        if (lane == 0) detail::mbar_arrive(&g_ready[b]);
      }
    }
    return;
  }
  detail::setmaxnreg_inc<kWideConsumerRegs>();
  const int c = wg - 1;  // this consumer's row tile: tile_a + c
  const int32_t row_base = (tile_a + c) * kRows;
  const int wtid = tid % 128;
  // This consumer is done with a buffer: one arrival (of the two its empty barrier counts).
  auto release = [&](uint64_t* bar) {
    if (wtid == 0) detail::mbar_arrive(bar);
  };
  const uint64_t q_desc = detail::wgmma_desc_sw128(sq + c * W::kQElems, 16, 1024);
  // The thread's two rows and their span lists.
  const int local_row = warp * 16 + lane / 4;  // and local_row + 8
  RowSpans<false> spans(p, row_base, local_row);
  auto step_mask = [&](const StepTiles& st, uint64_t(&mask)[2][2]) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int32_t e = st.e[t];
      mask[t][0] = mask[t][1] = e < 0 ? 0ull : ~0ull;  // no tile: nothing seen
      if (e >= 0 && (e & 1) == 0) spans.mask(p.spans, (e >> 1) * kKeys, mask[t]);
    }
  };
  // S of the consumer's 64 rows against the step's 128 keys, issued.
  auto issue_scores = [&](float(&s)[kWideKeys / 8][4], const bf16* k) {
    issue_scores_wgmma<HD>(s, q_desc, k, kWidePanelBytes);
  };
  // O += P V over the step's 128 keys (the missing half of a step of one tile is zeros), issued.
  auto issue_pv = [&](float(&o)[HD / 8][4], const uint32_t(&a)[kWideKeys / 16][4], const bf16* v) {
    issue_pv_wgmma<HD>(o, a, v, kWidePanelBytes);
  };

  // The pooling's P times the step's one-hot tile, issued into the same commit group as P V.
  auto issue_pool = [&](float(&po)[kPoolCols / 8][4], const uint32_t(&a)[kWideKeys / 16][4],
                        int b) {
    if constexpr (kPool) issue_pv_wgmma<kPoolCols>(po, a, sg + b * W::kPoolElems, kWidePanelBytes);
  };

  float o[HD / 8][4];
#pragma unroll
  for (int d = 0; d < HD / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float po[kPoolCols / 8][4];  // kPool: the rows' probability sums per group (unused otherwise)
#pragma unroll
  for (int d = 0; d < kPoolCols / 8; ++d) po[d][0] = po[d][1] = po[d][2] = po[d][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  float s[kWideKeys / 8][4];
  float alpha[2];
  uint64_t mask[2][2];
  StepTiles cur = next_step();
  StepTiles nxt = next_step();
  detail::mbar_wait(q_full, 0);
  if (cur.valid()) {
    step_mask(cur, mask);
    detail::mbar_wait(&k_full[0], 0);
    __syncwarp();
    detail::wgmma_fence();
    issue_scores(s, sk);
    detail::wgmma_commit();
    detail::wgmma_wait<0>();
    detail::wgmma_fence_operands(s);
    release(&k_empty[0]);
    softmax_tile(cur.full(), s, m, l, alpha, lane, p.scale_log2, mask);  // O is 0 yet
  }
  // The other kernel's pipeline: with step j's P in registers, S of step j + 1 and O += P_j V_j
  // are issued together; the softmax of step j + 1 runs while the second product is in flight.
  uint32_t a[kWideKeys / 16][4];
  int j = 0;
  for (; nxt.valid(); ++j) {
    const StepTiles after = next_step();
    const int b1 = (j + 1) & 1, b0 = j & 1;
    detail::mbar_wait(&k_full[b1], ((j + 1) >> 1) & 1);
    detail::mbar_wait(&v_ready[b0], (j >> 1) & 1);
    if (kPool) detail::mbar_wait(&g_ready[b0], (j >> 1) & 1);
#pragma unroll
    for (int kk = 0; kk < kWideKeys / 16; ++kk) p_fragment(a[kk], s, kk);
    __syncwarp();
    detail::wgmma_fence();
    issue_scores(s, sk + b1 * W::kPairElems);
    detail::wgmma_commit();
    issue_pv(o, a, sv + b0 * W::kPairElems);
    issue_pool(po, a, b0);
    detail::wgmma_commit();
    step_mask(nxt, mask);
    detail::wgmma_wait<1>();
    detail::wgmma_fence_operands(s);
    release(&k_empty[b1]);
    softmax_tile(nxt.full(), s, m, l, alpha, lane, p.scale_log2, mask);
    detail::wgmma_wait<0>();
    detail::wgmma_fence_operands(o);
    if (kPool) detail::wgmma_fence_operands(po);
    release(&v_empty[b0]);  // and the one-hot tile
    if (!kPool) {
      rescale_o<HD>(o, alpha);
    } else if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {  // one vote
      rescale_o<HD, false>(o, alpha);
      rescale_o<kPoolCols, false>(po, alpha);
    }
    cur = nxt;
    nxt = after;
  }
  if (cur.valid()) {
    detail::mbar_wait(&v_ready[j & 1], (j >> 1) & 1);
    if (kPool) detail::mbar_wait(&g_ready[j & 1], (j >> 1) & 1);
#pragma unroll
    for (int kk = 0; kk < kWideKeys / 16; ++kk) p_fragment(a[kk], s, kk);
    __syncwarp();
    detail::wgmma_fence();
    issue_pv(o, a, sv + (j & 1) * W::kPairElems);
    issue_pool(po, a, j & 1);
    detail::wgmma_commit();
    detail::wgmma_wait<0>();
    detail::wgmma_fence_operands(o);
    if (kPool) detail::wgmma_fence_operands(po);
  }
  // This consumer's products are done: its Q buffer takes the O staging.
  detail::named_barrier(1 + c, 128);
  store_o<HD, true>(sq + c * W::kQElems, o, m, l, p, h, row_base, local_row, warp, lane);
  if (kPool) store_pool(po, l, p, h, row_base, local_row, lane);
}

// pooled[r, g] = Σ_h pool_heads[r, h, g] for g < num_groups (fp32, heads in order).
__global__ void pool_sum_heads_kernel(float* __restrict__ pooled,
                                      const float* __restrict__ pool_heads, int32_t rows, int heads,
                                      int num_groups) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<int64_t>(rows) * num_groups) return;
  const int64_t r = i / num_groups;
  const float* src = pool_heads + r * heads * kPoolCols + i % num_groups;
  float sum = 0.0f;
  for (int h = 0; h < heads; ++h) sum += src[h * kPoolCols];
  pooled[i] = sum;
}

// Raises the dynamic shared-memory limit of a kernel once per device (detail::DeviceMemo).
template <auto kKernel>
cudaError_t configure_once(size_t smem_bytes) {
  static detail::DeviceMemo configured;
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  return static_cast<cudaError_t>(configured.get(device, [&](int) {
    cudaError_t e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem_bytes));
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
    }
    return std::pair<int, bool>{static_cast<int>(e), e == cudaSuccess};
  }));
}

template <int HD, bool kWgmma, bool kAligned, bool kOneK = false>
cudaError_t launch_hd_as(const Params& p, cudaStream_t stream) {
  constexpr size_t kBytes = kBlockSmemBytes<HD, kWgmma, kOneK>;
  constexpr auto kKernel = attention_prefill_kernel<HD, kWgmma, kAligned, kOneK>;
  const cudaError_t err = configure_once<kKernel>(kBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned int>(p.row_tiles * p.splits),
                  static_cast<unsigned int>(p.heads));
  return detail::launch_dependent(kKernel, grid, kThreads, kBytes, stream, p);
}

// Every access 16-byte aligned (the engine's layouts): the kernel without the element-wise
// fallbacks, and at head_dim 128 on wgmma with one_k the one-K-buffer form.
template <int HD, bool kWgmma>
cudaError_t launch_hd(const Params& p, bool one_k, cudaStream_t stream) {
  if (p.q_vec && p.out_vec && p.kv_vec) {
    if constexpr (kWgmma && HD == 128) {
      if (one_k) return launch_hd_as<HD, kWgmma, true, true>(p, stream);
    }
    return launch_hd_as<HD, kWgmma, true>(p, stream);
  }
  return launch_hd_as<HD, kWgmma, false>(p, stream);
}

template <int HD, bool kPool>
cudaError_t launch_wide(const Params& p, cudaStream_t stream) {
  constexpr size_t kBytes = WideGeometry<HD, kPool>::kSmemBytes;
  WideArgs args;
  args.p = p;
  const int64_t kv_width = static_cast<int64_t>(p.kv_heads) * HD;
  if (!detail::encode_bf16_map(&args.q, p.q, p.rows, static_cast<int64_t>(p.heads) * HD, p.q_stride,
                               kKeys) ||
      !detail::encode_bf16_map(&args.k, p.k, p.num_keys, kv_width, kv_width, kKeys) ||
      !detail::encode_bf16_map(&args.v, p.v, p.num_keys, kv_width, kv_width, kKeys)) {
    return cudaErrorInvalidValue;
  }
  constexpr auto kKernel = attention_prefill_wide_kernel<HD, kPool>;
  const cudaError_t err = configure_once<kKernel>(kBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned int>((p.row_tiles + 1) / 2),
                  static_cast<unsigned int>(p.heads));
  return detail::launch_dependent(kKernel, grid, kWideThreads, kBytes, stream, args);
}

// ---- merging split-key runs ----
// One warp per (row, head): with m = max_s lse_s and w_s = exp(lse_s - m),
//   out = Σ_s w_s O_s / Σ_s w_s,   lse = m + log Σ_s w_s
// (each O_s is its run's normalised output; a run that saw no key has lse_s = -inf and weight 0;
// no key in any run: out 0, lse -inf, as the unsplit kernel). Reads the parts with coherent loads:
// launched dependent on the attention kernel that writes them.
struct CombineParams {
  bf16* out;
  int64_t out_stride;
  float* lse;  // or null
  const bf16* part_out;
  const float* part_lse;
  int32_t rows;
  int heads;
  int splits;
};
constexpr int kCombineWarps = 4;

template <int HD>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const CombineParams c) {
  const int lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  detail::wait_previous_grid();
  detail::allow_next_grid();
  if (item >= static_cast<int64_t>(c.rows) * c.heads) return;
  const int32_t r = static_cast<int32_t>(item / c.heads);
  const int h = static_cast<int>(item % c.heads);
  const int64_t width = static_cast<int64_t>(c.heads) * HD;
  float m = -INFINITY;
  for (int s = 0; s < c.splits; ++s) {
    m = fmaxf(m, c.part_lse[(static_cast<int64_t>(s) * c.rows + r) * c.heads + h]);
  }
  float acc[HD / 32] = {};
  float sum = 0.0f;
  if (m != -INFINITY) {
    for (int s = 0; s < c.splits; ++s) {
      const int64_t at = static_cast<int64_t>(s) * c.rows + r;
      const float ls = c.part_lse[at * c.heads + h];
      if (ls == -INFINITY) continue;
      const float w = expf(ls - m);
      sum += w;
      const bf16* const src = c.part_out + at * width + static_cast<int64_t>(h) * HD;
#pragma unroll
      for (int j = 0; j < HD / 32; ++j) acc[j] += w * __bfloat162float(src[lane + 32 * j]);
    }
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  bf16* const dst = c.out + static_cast<int64_t>(r) * c.out_stride + static_cast<int64_t>(h) * HD;
#pragma unroll
  for (int j = 0; j < HD / 32; ++j) dst[lane + 32 * j] = __float2bfloat16(acc[j] * inv);
  if (c.lse != nullptr && lane == 0) {
    c.lse[static_cast<int64_t>(r) * c.heads + h] = sum > 0.0f ? m + logf(sum) : -INFINITY;
  }
}

cudaError_t launch_combine(const CombineParams& c, int head_dim, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(c.rows) * c.heads;
  const dim3 grid(static_cast<unsigned int>((items + kCombineWarps - 1) / kCombineWarps));
  return head_dim == 64
             ? detail::launch_dependent(combine_kernel<64>, grid, kCombineWarps * 32, 0, stream, c)
             : detail::launch_dependent(combine_kernel<128>, grid, kCombineWarps * 32, 0, stream,
                                        c);
}

// pool_heads non-null: attention_prefill_pool's call (key_group set, the wide kernel, never split;
// checked by the caller).
cudaError_t launch(bf16* out, int64_t out_stride, float* lse, const bf16* q, int64_t q_stride,
                   const bf16* k, const bf16* v, const AttentionRows& rows,
                   const PrefillSchedule& schedule, int heads, int kv_heads, int head_dim,
                   float scale, PrefillKernel kernel, const PrefillSplit& split,
                   cudaStream_t stream, const int32_t* key_group = nullptr,
                   float* pool_heads = nullptr) {
  // Split-key runs: asked for, or kAuto's choice for too few blocks (then the one-warpgroup
  // kernel: the wide one does not split).
  int splits = 1;
  if (pool_heads == nullptr && split.workspace != nullptr && split.splits != 1) {
    if (split.splits > 1) {
      splits = split.splits;
    } else if (kernel != PrefillKernel::kWgmmaWide) {
      splits = prefill_key_splits(rows.rows, rows.num_keys, heads, detail::sm_count());
      if (splits > 1 && kernel == PrefillKernel::kAuto) {
        kernel = wgmma_available() ? PrefillKernel::kWgmma : PrefillKernel::kMma;
      }
    }
  }
  if (split.splits < 0 || splits > 65535 || (splits > 1 && kernel == PrefillKernel::kWgmmaWide)) {
    return cudaErrorInvalidValue;
  }
  if (kernel == PrefillKernel::kAuto) {
    kernel = resolve_prefill_kernel(kernel, rows.rows, rows.num_keys, heads, head_dim,
                                    detail::sm_count(), wgmma_available());
  } else if (prefill_kernel_needs_wgmma(kernel) && !wgmma_available()) {
    return cudaErrorNotSupported;
  }
  if (rows.rows < 0 || rows.num_keys < 0 || heads <= 0 || kv_heads <= 0 || heads > 65535 ||
      heads % kv_heads != 0 || (head_dim != 64 && head_dim != 128)) {
    return cudaErrorInvalidValue;
  }
  const int64_t width = static_cast<int64_t>(heads) * head_dim;
  if (q_stride < width || out_stride < width) return cudaErrorInvalidValue;
  if (rows.rows == 0) return cudaSuccess;
  if (out == nullptr || q == nullptr || rows.row_offsets == nullptr ||
      schedule.tile_offsets == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (rows.num_keys > 0 &&
      (k == nullptr || v == nullptr || rows.spans == nullptr || schedule.tiles == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (splits > 1 && (reinterpret_cast<uintptr_t>(split.workspace) % 256 != 0 ||
                     split.bytes < prefill_split_bytes(rows.rows, heads, head_dim, splits))) {
    return cudaErrorInvalidValue;
  }
  Params p{};
  p.out = out;
  p.out_stride = out_stride;
  p.lse = lse;
  p.q = q;
  p.q_stride = q_stride;
  p.k = k;
  p.v = v;
  p.row_offsets = rows.row_offsets;
  p.spans = rows.spans;
  p.tile_offsets = schedule.tile_offsets;
  p.tiles = schedule.tiles;
  p.sanitize_v = schedule.sanitize_v;
  p.rows = rows.rows;
  p.num_keys = rows.num_keys;
  p.row_tiles = (rows.rows + kRows - 1) / kRows;
  if (int64_t{p.row_tiles} * splits > INT32_MAX) return cudaErrorInvalidValue;
  p.splits = splits;
  p.heads = heads;
  p.group = heads / kv_heads;
  p.kv_heads = kv_heads;
  p.scale_log2 = scale * kLog2e;
  p.q_vec = detail::aligned16(q) && q_stride % 8 == 0;
  p.out_vec = detail::aligned16(out) && out_stride % 8 == 0;
  p.kv_vec =
      detail::aligned16(k) && detail::aligned16(v);  // rows are head_dim (a multiple of 8) apart
  p.key_group = key_group;
  p.pool_heads = pool_heads;
  CombineParams c{};
  if (splits > 1) {  // the runs write the workspace (aligned); combine_kernel writes out and lse
    const size_t items = static_cast<size_t>(splits) * static_cast<size_t>(rows.rows) * heads;
    p.part_out = static_cast<bf16*>(split.workspace);
    p.part_lse = reinterpret_cast<float*>(static_cast<char*>(split.workspace) +
                                          (items * head_dim * 2 + 255) / 256 * 256);
    p.out_vec = true;
    c = CombineParams{out, out_stride, lse, p.part_out, p.part_lse, rows.rows, heads, splits};
  }
  // The one place head_dim becomes a compile-time constant.
  if (pool_heads != nullptr) {
    return head_dim == 64 ? launch_wide<64, true>(p, stream) : launch_wide<128, true>(p, stream);
  }
  if (kernel == PrefillKernel::kWgmmaWide && p.q_vec && p.kv_vec && p.num_keys > 0 &&
      detail::tensor_map_encoder() != nullptr) {
    return head_dim == 64 ? launch_wide<64, false>(p, stream) : launch_wide<128, false>(p, stream);
  }
  const bool wgmma = kernel != PrefillKernel::kMma;
  const bool one_k = kernel == PrefillKernel::kWgmmaOneK;
  cudaError_t err = cudaErrorInvalidValue;
  switch (head_dim) {
    case 64:
      err = wgmma ? launch_hd<64, true>(p, one_k, stream) : launch_hd<64, false>(p, one_k, stream);
      break;
    case 128:
      err =
          wgmma ? launch_hd<128, true>(p, one_k, stream) : launch_hd<128, false>(p, one_k, stream);
      break;
    default:
      break;
  }
  if (err != cudaSuccess || splits == 1) return err;
  return launch_combine(c, head_dim, stream);
}

}  // namespace

bool wgmma_available() {
#ifdef KEEP_KERNELS_SM90A
  static detail::DeviceMemo hopper;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  return hopper.get(device, [](int d) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d) != cudaSuccess) {
      return std::pair<int, bool>{0, false};
    }
    return std::pair<int, bool>{major == 9 && minor == 0 ? 1 : 0, true};
  }) != 0;
#else
  return false;
#endif
}

cudaError_t attention_prefill(__nv_bfloat16* out, int64_t out_stride, float* lse,
                              const __nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* k,
                              const __nv_bfloat16* v, const AttentionRows& rows,
                              const PrefillSchedule& schedule, int heads, int kv_heads,
                              int head_dim, float scale, cudaStream_t stream, PrefillKernel kernel,
                              const PrefillSplit& split) {
  return launch(out, out_stride, lse, q, q_stride, k, v, rows, schedule, heads, kv_heads, head_dim,
                scale, kernel, split, stream);
}

size_t attention_prefill_pool_scratch_bytes(int64_t rows, int heads) {
  if (rows <= 0 || heads <= 0) return 0;
  return static_cast<size_t>(rows) * static_cast<size_t>(heads) * kPoolCols * sizeof(float);
}

cudaError_t attention_prefill_pool(__nv_bfloat16* out, int64_t out_stride, float* lse,
                                   float* pooled, const __nv_bfloat16* q, int64_t q_stride,
                                   const __nv_bfloat16* k, const __nv_bfloat16* v,
                                   const AttentionRows& rows, const PrefillSchedule& schedule,
                                   const int32_t* key_group, int num_groups, int heads,
                                   int kv_heads, int head_dim, float scale, void* scratch,
                                   size_t scratch_bytes, cudaStream_t stream,
                                   PrefillKernel kernel) {
  // What the wide kernel needs; anything else is the caller's to run as two passes. Checked
  // before anything is launched.
  if ((kernel != PrefillKernel::kAuto && kernel != PrefillKernel::kWgmmaWide) ||
      num_groups > kPoolFusedMaxGroups || !wgmma_available() ||
      detail::tensor_map_encoder() == nullptr || !detail::aligned16(q) || q_stride % 8 != 0 ||
      !detail::aligned16(k) || !detail::aligned16(v) || rows.num_keys <= 0) {
    return cudaErrorNotSupported;
  }
  if (rows.rows < 0 || num_groups <= 0 || heads <= 0 || heads > 65535 ||
      (head_dim != 64 && head_dim != 128)) {
    return cudaErrorInvalidValue;
  }
  if (rows.rows == 0) return cudaSuccess;
  if (pooled == nullptr || key_group == nullptr || scratch == nullptr ||
      reinterpret_cast<uintptr_t>(scratch) % 16 != 0 ||
      scratch_bytes < attention_prefill_pool_scratch_bytes(rows.rows, heads)) {
    return cudaErrorInvalidValue;
  }
  auto* pool_heads = static_cast<float*>(scratch);
  cudaError_t err =
      launch(out, out_stride, lse, q, q_stride, k, v, rows, schedule, heads, kv_heads, head_dim,
             scale, PrefillKernel::kWgmmaWide, PrefillSplit{}, stream, key_group, pool_heads);
  if (err != cudaSuccess) return err;
  const int64_t n = static_cast<int64_t>(rows.rows) * num_groups;
  pool_sum_heads_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
      pooled, pool_heads, rows.rows, heads, num_groups);
  return cudaGetLastError();
}

}  // namespace keep::kernels
