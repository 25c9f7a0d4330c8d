// Plain types shared by the attention kernels, their CPU references and the host-side planner
// (no CUDA): the device form of an engine AttentionLayout
// (services/worker/engine/core/attention_layout.h).
#pragma once

#include <cstdint>

namespace keep::kernels {

// Key slots [begin, end). Same layout as engine::KeySpan (two int32), so a layout's span array is
// uploaded as is.
struct KeyRange {
  int32_t begin;
  int32_t end;
};
static_assert(sizeof(KeyRange) == 8, "KeyRange must be two int32");

// Which keys each row of an attention call sees. Pointers are device memory for the kernels and
// host memory for the references.
//   row r sees the keys of spans[row_offsets[r] .. row_offsets[r + 1]): ascending, disjoint,
//   non-empty, inside [0, num_keys). A row with no span (or zero keys) produces out = 0 and
//   lse = -inf.
struct AttentionRows {
  const int32_t* row_offsets = nullptr;  // (rows + 1)
  const KeyRange* spans = nullptr;       // (row_offsets[rows]), 8-byte aligned
  int32_t rows = 0;
  int32_t num_keys = 0;
};

// The prefill kernel's tile schedule (attention_schedule.h builds it on the host, once per plan):
// row tile i (rows [i * kPrefillRowTile, ...)) visits key tiles tiles[tile_offsets[i] ..
// tile_offsets[i + 1]), each entry `key_tile * 2 + full`, ascending by key tile; full == 1 when
// every row of the row tile sees every key of the key tile (no masking needed), 0 otherwise. Key
// tiles no row of the tile touches are absent.
// sanitize_v: some key below num_keys is seen by no row -- a slot that may never have been
// written (between a blocks layout's blocks), so the kernel zeroes the non-finite values of V in
// tiles not marked full (a masked P = 0 times a NaN V is NaN). false: every key is seen by some
// row, hence written, and V is read as it is (causal rows, a KEEP layer's recomputed rows and
// query; cleaning V cost the wide kernel much of a masked step there).
struct PrefillSchedule {
  const int32_t* tile_offsets = nullptr;  // (row_tiles + 1)
  const int32_t* tiles = nullptr;         // (tile_offsets[row_tiles])
  bool sanitize_v = true;
};

constexpr int kPrefillRowTile = 64;  // rows of Q per block of the prefill kernel
constexpr int kPrefillKeyTile = 64;  // keys per step of the prefill kernel

}  // namespace keep::kernels
