// Host-side planning for the prefill attention kernel (no CUDA): the tile schedule of layout.h's
// PrefillSchedule, built once per plan and uploaded by the CUDA backend.
#pragma once

#include <cstdint>
#include <vector>

#include "services/worker/kernels/layout.h"

namespace keep::kernels {

struct PrefillScheduleHost {
  std::vector<int32_t> tile_offsets;  // (row_tiles + 1)
  std::vector<int32_t> tiles;         // key_tile * 2 + full
  int64_t visited_pairs = 0;          // Σ over row tiles of visited key tiles (work estimate)
};

// rows: host arrays (row_offsets, spans) of an AttentionRows. row_tile / key_tile default to the
// kernel's tile sizes.
PrefillScheduleHost build_prefill_schedule(const AttentionRows& rows,
                                           int32_t row_tile = kPrefillRowTile,
                                           int32_t key_tile = kPrefillKeyTile);

}  // namespace keep::kernels
