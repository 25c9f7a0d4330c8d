// Host-side planning for the prefill attention kernel (no CUDA): which kernel runs
// (PrefillKernel, resolve_prefill_kernel) and the tile schedule of layout.h's PrefillSchedule,
// built once per plan and uploaded by the CUDA backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "services/worker/kernels/layout.h"

namespace keep::kernels {

// Which prefill kernel runs. kMma: one warpgroup per 64 rows on mma.sync; kWgmma: the same on
// wgmma (two K and two V buffers, two blocks an SM at head_dim 128); kWgmmaOneK: kWgmma's kernel
// with one K buffer, three blocks an SM, for head_dim 128, bf16 K/V and Q, O, K, V 16-byte aligned
// (kWgmma's otherwise); kWgmmaWide: two warpgroups per 128 rows, 128 keys a step, warp-specialized
// with TMA loads, where K/V are bf16 and Q, K, V 16-byte aligned (kWgmma's kernel otherwise).
// kAuto: on Hopper kWgmmaWide for head_dim 128 from kPrefillWideMinKeys keys on (where it measured
// faster); below that, at head_dim 128, kWgmmaOneK where the launch has
// kPrefillOneKMinBlocksPerSm blocks (row tiles x heads) an SM or more (enough to fill the third
// slot), else kWgmma; elsewhere kMma. A wgmma kernel where wgmma is
// not available: cudaErrorNotSupported. Same results up to fp32 summation order.
enum class PrefillKernel { kAuto, kMma, kWgmma, kWgmmaWide, kWgmmaOneK };
// Short names for flags and logs: "auto", "mma", "wgmma", "wide", "wgmma1k"; parse_prefill_kernel
// takes them back (false for anything else).
inline const char* prefill_kernel_name(PrefillKernel k) {
  switch (k) {
    case PrefillKernel::kMma:
      return "mma";
    case PrefillKernel::kWgmma:
      return "wgmma";
    case PrefillKernel::kWgmmaWide:
      return "wide";
    case PrefillKernel::kWgmmaOneK:
      return "wgmma1k";
    case PrefillKernel::kAuto:
      break;
  }
  return "auto";
}
// Whether the choice is one of the wgmma kernels (an sm_90a build on a compute 9.0 device only).
constexpr bool prefill_kernel_needs_wgmma(PrefillKernel k) {
  return k != PrefillKernel::kAuto && k != PrefillKernel::kMma;
}
inline bool parse_prefill_kernel(const char* name, PrefillKernel* out) {
  for (PrefillKernel k : {PrefillKernel::kAuto, PrefillKernel::kMma, PrefillKernel::kWgmma,
                          PrefillKernel::kWgmmaWide, PrefillKernel::kWgmmaOneK}) {
    if (std::strcmp(name, prefill_kernel_name(k)) == 0) {
      *out = k;
      return true;
    }
  }
  return false;
}
constexpr int32_t kPrefillWideMinKeys = 4096;  // kAuto's kWgmmaWide threshold (head_dim 128)
// kAuto's kWgmmaOneK threshold: row tiles x heads per SM. With fewer the third block slot stays
// empty and one K buffer only shortens K's lead (benchmarks/RESULTS.md run 15).
constexpr int kPrefillOneKMinBlocksPerSm = 4;

// The kernel attention_prefill runs for `asked`: kAuto resolved as PrefillKernel's comment says,
// for `rows` rows of `heads` heads over `num_keys` keys at head_dim on a device of `sms` SMs where
// wgmma runs or not; any other choice as asked.
PrefillKernel resolve_prefill_kernel(PrefillKernel asked, int32_t rows, int32_t num_keys, int heads,
                                     int head_dim, int sms, bool wgmma);

// Split-key prefill (kernels.h PrefillSplit): a launch of too few blocks (64-row tiles x heads)
// to fill the GPU cuts each row tile's scheduled key tiles into `splits` equal runs, one block
// each, and a second kernel combines the runs' normalised outputs by their lse. The query-only
// layers of a KEEP request (~128 rows over ~4k keys, 40 heads: 80 blocks on 132 SMs) are the
// case. Splits aim at kPrefillSplitBlocksPerSm blocks an SM (the two-K-buffer wgmma kernel's
// residency at head_dim 128), give each run kPrefillSplitMinTiles key tiles or more, and stop at
// kPrefillSplitMax.
constexpr int kPrefillSplitBlocksPerSm = 2;
constexpr int kPrefillSplitMinTiles = 4;
constexpr int kPrefillSplitMax = 16;
// The splits of such a launch: floor(target blocks / blocks), 1 where that is below 2 (the split
// launch would take as many waves as the plain one) or the keys are too few.
int prefill_key_splits(int32_t rows, int32_t num_keys, int heads, int sms);
// Workspace bytes of `splits` runs over `rows` rows (bf16 outputs and fp32 lse of every run),
// and the most prefill_key_splits' choice needs at head_dim on `sms` SMs, whatever the rows and
// heads (its blocks, splits x row tiles x heads, stay within the target): what a caller reserves.
size_t prefill_split_bytes(int32_t rows, int heads, int head_dim, int splits);
size_t prefill_split_max_bytes(int head_dim, int sms);

struct PrefillScheduleHost {
  std::vector<int32_t> tile_offsets;  // (row_tiles + 1)
  std::vector<int32_t> tiles;         // key_tile * 2 + full
  int64_t visited_pairs = 0;          // Σ over row tiles of visited key tiles (work estimate)
  bool sanitize_v = false;            // a key below num_keys no row sees (PrefillSchedule)
};

// rows: host arrays (row_offsets, spans) of an AttentionRows. row_tile / key_tile default to the
// kernel's tile sizes.
PrefillScheduleHost build_prefill_schedule(const AttentionRows& rows,
                                           int32_t row_tile = kPrefillRowTile,
                                           int32_t key_tile = kPrefillKeyTile);

}  // namespace keep::kernels
