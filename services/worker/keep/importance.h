// Multi-hop segment importance (ARCHITECTURE §5, paper §3.2): at a check layer, which of the
// segments recomputed there go on to the next layer.
//
// Input is the layer's attention pooled per segment: P[r, j] = Σ_heads Σ_{t ∈ segment j} p[r, h, t]
// for every row r the layer computed (the query's tokens and the recomputed segments' tokens).
//
//   a[i][j] = Σ_{r ∈ rows of i} P[r, j] / (H · |rows of i|)      i's mean attention on j
//   hop 0:   s_j = Σ_{r ∈ last q query rows} P[r, j] / (H · q)    what the query reads
//   hop k:   s_i += Σ_{j ∈ S_{k-1}, j ≠ i} m̂_j · (a[j][i] + a[i][j])
//            (importance flows from each selected segment j to the segments it reads and to those
//            that read it; m̂ = s normalised to sum 1, so each hop adds at most the mass it spreads)
//   S_k = the `keep` best of the candidates by s (ties: the earlier segment).
// Hops repeat until S_k = S_{k-1} or max_hops; S only ever holds candidates (the set recomputed at
// this layer), so the selection is monotone across layers. Pinned segments (no usable KV entry:
// they cannot be loaded) are always selected and count towards `keep`.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "shared/common/status.h"

namespace keep::worker {

struct ImportanceInput {
  int32_t num_segments = 0;              // G: segments in the prompt
  int32_t num_heads = 0;                 // H: query heads summed into pooled
  std::span<const float> pooled;         // (rows, columns) row-major
  std::span<const int32_t> row_segment;  // (rows) segment of the row's token, or -1 (query, other)
  std::span<const int32_t> query_rows;   // rows of the query's tokens, in prompt order
  // The segment of each pooled column, ascending (as the backend pooled them: at a check layer
  // only the segments computed there); empty: G columns, column j = segment j. Every candidate
  // needs one -- importance reads no other.
  std::span<const int32_t> column_segment;
};

struct ImportanceOptions {
  int32_t query_rows_used = 32;  // q: the last q query rows score hop 0 (all when fewer)
  int32_t max_hops = 8;          // hops after hop 0 at most
};

struct Selection {
  std::vector<int32_t> selected;  // ascending segment ids
  std::vector<double> score;      // (G) final s per segment (0 for non-candidates)
  int32_t hops = 0;               // hops run after hop 0
  bool converged = true;          // false when max_hops ended it with S still changing
};

// `candidates`: ascending, the segments recomputed at this layer (each with rows in the input);
// `pinned` ⊆ candidates. Returns min(keep, |candidates|) segments, at least every pinned one.
// kInvalidArgument for inconsistent input (sizes, ids out of range, a candidate without rows).
Result<Selection> select_segments(const ImportanceInput& in, std::span<const int32_t> candidates,
                                  std::span<const int32_t> pinned, int32_t keep,
                                  const ImportanceOptions& options = {});

}  // namespace keep::worker
