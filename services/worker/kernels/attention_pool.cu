// Importance pooling (kernels.h attention_pool): pooled[r, g] = Σ_h Σ_{t seen by r, group(t) = g}
// exp(s_t(r, h) - lse[r, h]).
//
// Kernel 1 zeroes pooled. Kernel 2 runs one block per (row, kv head, head pack, key split): the
// visible keys of the row (the concatenation of its spans) are cut into `splits` ranges of
// `key_chunk` ordinals. Each of the 4 warps takes every 4th batch of kKB keys of the range; lanes
// split head_dim (E = head_dim / 32 each, q in registers pre-scaled by scale * log2(e)) and read
// the K rows coalesced; the kKB x HP partial dot products are summed across lanes with a
// reduce-scatter (lane bits 4.. then pick the key). One lane per key adds Σ_h 2^(s2 - lse2) to
// the key's group: in a shared-memory array of num_groups sums when num_groups <= 8192 (added to
// pooled at the end, one atomicAdd per non-zero group), else straight to pooled with atomicAdd.
// Only the order of those float additions varies from run to run.
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
constexpr int kKB = 4;                 // keys per warp batch
constexpr int kGroupLanes = 32 / kKB;  // lanes holding the same key after the reduction
constexpr int kMaxSmemGroups = 8192;   // 32 KB of shared sums
constexpr int64_t kTargetBlocks = 2048;
constexpr int kMinSplitKeys = 256;

__device__ __forceinline__ float load_elem(const __nv_bfloat16* p) {
  return __bfloat162float(__ldg(p));
}

__global__ void zero_kernel(float* __restrict__ p, int64_t n) {  // p: (n)
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = 0.0f;
  }
}

template <int E, int HP>
__global__ void __launch_bounds__(kThreads)
    pool_kernel(float* __restrict__ pooled,           // (rows, num_groups), zeroed
                const __nv_bfloat16* __restrict__ q,  // (rows, q_stride)
                int64_t q_stride,
                const KV* __restrict__ k,                 // (num_keys, kv_heads, head_dim)
                const float* __restrict__ lse,            // (rows, heads)
                const int32_t* __restrict__ row_offsets,  // (rows + 1)
                const KeyRange* __restrict__ spans,       // (row_offsets[rows])
                const int32_t* __restrict__ key_group,    // (num_keys)
                int num_groups, int heads, int kv_heads, int packs, int key_chunk, int splits,
                float scale_log2, bool smem_groups, bool aligned) {
  constexpr int kD = 32 * E;
  extern __shared__ float group_s[];  // (num_groups) when smem_groups

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const detail::BlockCoords bc = detail::block_coords<HP>(splits, packs, heads, kv_heads);
  const int sp = bc.split;
  const int g = bc.g;
  const int64_t r = bc.r;
  const int h0 = bc.h0;
  const int nh = bc.nh;

  // sp < splits = ceil(num_keys / key_chunk), so range_start < num_keys: no int32 overflow.
  const int range_start = static_cast<int>(static_cast<int64_t>(sp) * key_chunk);
  const int range_end =
      static_cast<int>(min(static_cast<int64_t>(range_start) + key_chunk, int64_t{0x7fffffff}));
  const int sp_end = row_offsets[r + 1];
  detail::SpanCursor cur;
  // Same answer in every warp: a block whose range starts past the row's keys leaves as a whole.
  if (!detail::start_cursor(spans, row_offsets[r], sp_end, range_start, lane, cur)) return;

  if (smem_groups) {
    for (int i = static_cast<int>(threadIdx.x); i < num_groups; i += kThreads) group_s[i] = 0.0f;
    __syncthreads();
  }

  float qr[HP][E];
  float lse2[HP];
  detail::load_q<E, HP>(qr, q, r, q_stride, h0, nh, lane, scale_log2,
                        [&](int h) { lse2[h] = h < nh ? lse[r * heads + h0 + h] * kLog2e : 0.0f; });

  for (int64_t ob = range_start + static_cast<int64_t>(warp) * kKB; ob < range_end;
       ob += kWarps * kKB) {
    // Slots of the batch's keys: lane kk < kKB finds key kk's by walking the spans forward.
    const int slot = detail::batch_slot<kKB>(ob, range_end, sp_end, cur, spans, lane);
    const int nv = __popc(__ballot_sync(kFull, slot >= 0));  // existing keys: a prefix
    if (nv == 0) break;                                      // batches only shrink

    float kf[kKB][E];
#pragma unroll
    for (int kk = 0; kk < kKB; ++kk) {
      const int s = __shfl_sync(kFull, slot, kk);
      if (s >= 0) {
        const KV* kr = k + (static_cast<int64_t>(s) * kv_heads + g) * kD + lane * E;
        if (aligned) {
          detail::load_vec<E, detail::ReadOnlyLoad>(kr, kf[kk]);
        } else {  // k not 16-byte aligned: element loads
#pragma unroll
          for (int e = 0; e < E; ++e) kf[kk][e] = load_elem(kr + e);
        }
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) kf[kk][e] = 0.0f;
      }
    }
    float part[kKB][HP];
#pragma unroll
    for (int kk = 0; kk < kKB; ++kk) {
#pragma unroll
      for (int h = 0; h < HP; ++h) {
        float s = 0.0f;
        if (h < nh) {
#pragma unroll
          for (int e = 0; e < E; ++e) s = fmaf(qr[h][e], kf[kk][e], s);
        }
        part[kk][h] = s;
      }
    }
    // Summed across the lanes: part[0][h] is now the score of key kidx.
    const int kidx = detail::reduce_scatter_keys<kKB, HP>(part, nh, lane);
    const int my_slot = __shfl_sync(kFull, slot, kidx);
    if ((lane & (kGroupLanes - 1)) == 0 && kidx < nv) {
      const int grp = key_group[my_slot];
      if (grp >= 0 && grp < num_groups) {
        float sum = 0.0f;
#pragma unroll
        for (int h = 0; h < HP; ++h) {
          if (h < nh) sum += exp2f(part[0][h] - lse2[h]);
        }
        if (smem_groups) {
          atomicAdd(&group_s[grp], sum);
        } else {
          atomicAdd(&pooled[r * num_groups + grp], sum);
        }
      }
    }
  }

  if (smem_groups) {
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < num_groups; i += kThreads) {
      const float s = group_s[i];
      if (s != 0.0f) atomicAdd(&pooled[r * num_groups + i], s);
    }
  }
}

template <int E, int HP>
void launch_pool(float* pooled, const __nv_bfloat16* q, int64_t q_stride, const KV* k,
                 const float* lse, const AttentionRows& rows, const int32_t* key_group,
                 int num_groups, int heads, int kv_heads, int key_chunk, int splits,
                 float scale_log2, bool aligned, cudaStream_t stream) {
  const int packs = (heads / kv_heads + HP - 1) / HP;
  const int64_t blocks = static_cast<int64_t>(rows.rows) * kv_heads * packs * splits;
  const bool smem_groups = num_groups <= kMaxSmemGroups;
  const size_t smem = smem_groups ? static_cast<size_t>(num_groups) * sizeof(float) : 0;
  pool_kernel<E, HP><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
      pooled, q, q_stride, k, lse, rows.row_offsets, rows.spans, key_group, num_groups, heads,
      kv_heads, packs, key_chunk, splits, scale_log2, smem_groups, aligned);
}

// HP (q heads per block): 8 when head_dim <= 128 and the GQA group has more than 4 heads, else 4.
template <int E>
void dispatch_hp(float* pooled, const __nv_bfloat16* q, int64_t q_stride, const KV* k,
                 const float* lse, const AttentionRows& rows, const int32_t* key_group,
                 int num_groups, int heads, int kv_heads, int key_chunk, int splits,
                 float scale_log2, bool aligned, cudaStream_t stream) {
  if constexpr (E <= 4) {
    if (heads / kv_heads > 4) {
      launch_pool<E, 8>(pooled, q, q_stride, k, lse, rows, key_group, num_groups, heads, kv_heads,
                        key_chunk, splits, scale_log2, aligned, stream);
      return;
    }
  }
  launch_pool<E, 4>(pooled, q, q_stride, k, lse, rows, key_group, num_groups, heads, kv_heads,
                    key_chunk, splits, scale_log2, aligned, stream);
}

cudaError_t launch(float* pooled, const __nv_bfloat16* q, int64_t q_stride, const KV* k,
                   const float* lse, const AttentionRows& rows, const int32_t* key_group,
                   int num_groups, int heads, int kv_heads, int head_dim, float scale,
                   cudaStream_t stream) {
  if (rows.rows < 0 || rows.num_keys < 0 || num_groups < 0 || heads <= 0 || kv_heads <= 0 ||
      heads % kv_heads != 0 || head_dim < 32 || head_dim > 256 || head_dim % 32 != 0) {
    return cudaErrorInvalidValue;
  }
  if (rows.rows == 0 || num_groups == 0) return cudaSuccess;
  const int64_t width = static_cast<int64_t>(heads) * head_dim;
  if (pooled == nullptr || q == nullptr || lse == nullptr || rows.row_offsets == nullptr ||
      q_stride < width) {
    return cudaErrorInvalidValue;
  }
  const int64_t total = static_cast<int64_t>(rows.rows) * num_groups;
  const int zero_blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096));
  if (rows.num_keys == 0) {  // nobody sees a key: all zeros
    zero_kernel<<<zero_blocks, 256, 0, stream>>>(pooled, total);
    return cudaGetLastError();
  }
  if (k == nullptr || key_group == nullptr || rows.spans == nullptr) return cudaErrorInvalidValue;
  const bool aligned = reinterpret_cast<uintptr_t>(k) % 16 == 0;  // for the vector loads

  // Key splits: enough blocks to fill the GPU when rows are few, at least 256 keys per split.
  const int group = heads / kv_heads;
  const int64_t base = static_cast<int64_t>(rows.rows) * kv_heads * ((group + 3) / 4);
  const int64_t n = rows.num_keys;
  int64_t splits = std::max<int64_t>(1, (kTargetBlocks + base - 1) / base);
  splits = std::min<int64_t>(splits, (n + kMinSplitKeys - 1) / kMinSplitKeys);
  int64_t key_chunk = (n + splits - 1) / splits;
  key_chunk = (key_chunk + 63) / 64 * 64;
  splits = (n + key_chunk - 1) / key_chunk;
  if (base * splits > 0x7fffffff) return cudaErrorInvalidValue;  // beyond a 1-D grid

  zero_kernel<<<zero_blocks, 256, 0, stream>>>(pooled, total);
  const float scale_log2 = scale * kLog2e;
  const int kc = static_cast<int>(key_chunk);
  const int ns = static_cast<int>(splits);
  switch (head_dim / 32) {
#define KEEP_POOL_CASE(E_)                                                                         \
  case E_:                                                                                         \
    dispatch_hp<E_>(pooled, q, q_stride, k, lse, rows, key_group, num_groups, heads, kv_heads, kc, \
                    ns, scale_log2, aligned, stream);                                              \
    break;
    KEEP_POOL_CASE(1)
    KEEP_POOL_CASE(2)
    KEEP_POOL_CASE(3)
    KEEP_POOL_CASE(4)
    KEEP_POOL_CASE(5)
    KEEP_POOL_CASE(6)
    KEEP_POOL_CASE(7)
    KEEP_POOL_CASE(8)
#undef KEEP_POOL_CASE
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// ---- the tensor-core form (attention_pool_tiled) ----

// v (num_keys, kv_heads, head_dim) = the one-hot code of key t's group in [base, base + head_dim).
__global__ void onehot_kernel(__nv_bfloat16* __restrict__ v, const int32_t* __restrict__ key_group,
                              int64_t num_keys, int kv_heads, int head_dim, int base) {
  const int64_t per_key = static_cast<int64_t>(kv_heads) * head_dim;
  const int64_t n = num_keys * per_key;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_key;
    const int e = static_cast<int>(i % head_dim);
    v[i] = __float2bfloat16(key_group[t] - base == e ? 1.0f : 0.0f);
  }
}

// pooled[r, base + e] = Σ_h out[r, h * head_dim + e] for e < count; one block per row.
__global__ void sum_heads_kernel(float* __restrict__ pooled, const __nv_bfloat16* __restrict__ out,
                                 int num_groups, int heads, int head_dim, int base, int count) {
  const int64_t r = blockIdx.x;
  const __nv_bfloat16* o = out + r * heads * head_dim;
  for (int e = static_cast<int>(threadIdx.x); e < count; e += static_cast<int>(blockDim.x)) {
    float s = 0.0f;
    for (int h = 0; h < heads; ++h) s += __bfloat162float(o[h * head_dim + e]);
    pooled[r * num_groups + base + e] = s;
  }
}

constexpr size_t kScratchAlign = 256;

size_t align_scratch(size_t b) { return (b + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

}  // namespace

size_t attention_pool_tiled_scratch_bytes(int64_t rows, int64_t num_keys, int heads, int kv_heads,
                                          int head_dim) {
  if (rows < 0 || num_keys < 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0) return 0;
  const size_t out = static_cast<size_t>(rows) * heads * head_dim * sizeof(__nv_bfloat16);
  const size_t v = static_cast<size_t>(num_keys) * kv_heads * head_dim * sizeof(__nv_bfloat16);
  return align_scratch(out) + align_scratch(v);
}

cudaError_t attention_pool_tiled(float* pooled, const __nv_bfloat16* q, int64_t q_stride,
                                 const __nv_bfloat16* k, const AttentionRows& rows,
                                 const PrefillSchedule& schedule, const int32_t* key_group,
                                 int num_groups, int heads, int kv_heads, int head_dim, float scale,
                                 void* scratch, size_t scratch_bytes, cudaStream_t stream,
                                 PrefillKernel kernel, const PrefillSplit& split) {
  if (rows.rows < 0 || rows.num_keys < 0 || num_groups < 0 || heads <= 0 || kv_heads <= 0 ||
      heads % kv_heads != 0 || (head_dim != 64 && head_dim != 128)) {
    return cudaErrorInvalidValue;
  }
  if (rows.rows == 0 || num_groups == 0) return cudaSuccess;
  const int64_t total = static_cast<int64_t>(rows.rows) * num_groups;
  const int zero_blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096));
  if (pooled == nullptr) return cudaErrorInvalidValue;
  if (rows.num_keys == 0) {  // nobody sees a key: all zeros
    zero_kernel<<<zero_blocks, 256, 0, stream>>>(pooled, total);
    return cudaGetLastError();
  }
  const size_t need =
      attention_pool_tiled_scratch_bytes(rows.rows, rows.num_keys, heads, kv_heads, head_dim);
  if (key_group == nullptr || scratch == nullptr || scratch_bytes < need ||
      reinterpret_cast<uintptr_t>(scratch) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t width = static_cast<int64_t>(heads) * head_dim;
  auto* out = static_cast<__nv_bfloat16*>(scratch);
  auto* onehot = reinterpret_cast<__nv_bfloat16*>(
      static_cast<char*>(scratch) +
      align_scratch(static_cast<size_t>(rows.rows) * width * sizeof(__nv_bfloat16)));
  const int64_t v_elems = rows.num_keys * kv_heads * static_cast<int64_t>(head_dim);
  const int v_blocks = static_cast<int>(std::min<int64_t>((v_elems + 255) / 256, 4096));
  for (int base = 0; base < num_groups; base += head_dim) {
    onehot_kernel<<<v_blocks, 256, 0, stream>>>(onehot, key_group, rows.num_keys, kv_heads,
                                                head_dim, base);
    cudaError_t err = attention_prefill(out, width, nullptr, q, q_stride, k, onehot, rows, schedule,
                                        heads, kv_heads, head_dim, scale, stream, kernel, split);
    if (err != cudaSuccess) return err;
    const int count = std::min(head_dim, num_groups - base);
    sum_heads_kernel<<<static_cast<unsigned>(rows.rows), 128, 0, stream>>>(
        pooled, out, num_groups, heads, head_dim, base, count);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t attention_pool(float* pooled, const __nv_bfloat16* q, int64_t q_stride,
                           const __nv_bfloat16* k, const float* lse, const AttentionRows& rows,
                           const int32_t* key_group, int num_groups, int heads, int kv_heads,
                           int head_dim, float scale, cudaStream_t stream) {
  return launch(pooled, q, q_stride, k, lse, rows, key_group, num_groups, heads, kv_heads, head_dim,
                scale, stream);
}

}  // namespace keep::kernels
