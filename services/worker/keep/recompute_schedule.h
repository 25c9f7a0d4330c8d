// RecomputeSchedule: how many memory segments KEEP recomputes at each layer (ARCHITECTURE §5).
//
//   R_0 = every segment;  R_i = R_{i-1} · d;  layer i recomputes ⌊R_i⌋ segments.
//
// A segment not recomputed at layer i has no hidden state at layer i+1, so the recomputed set only
// shrinks; layer i is a *check layer* when ⌊R_{i+1}⌋ < ⌊R_i⌋: its attention decides which of its
// segments go on. d = 1 recomputes everything everywhere (full prefill); d = 0 keeps only layer 0.
// Plain data: built on the host, consumed by the request's layer loop.
#pragma once

#include <cstdint>
#include <vector>

#include "shared/common/status.h"

namespace keep::worker {

struct RecomputeSchedule {
  std::vector<int32_t> segments;  // (layers) segments recomputed at layer i; non-increasing

  int32_t num_layers() const { return static_cast<int32_t>(segments.size()); }
  // Layer `layer` is a check layer: segments[layer + 1] < segments[layer].
  bool is_check(int32_t layer) const;
  std::vector<int32_t> check_layers() const;
  // Mean over layers of segments[i] / segments[0] (1 with no segments): the recompute ratio the
  // schedule aims at when segments are of equal length.
  double average_ratio() const;
};

// kInvalidArgument unless layers >= 1, segments >= 0 and 0 <= decay <= 1.
Result<RecomputeSchedule> make_recompute_schedule(int32_t layers, int32_t segments, double decay);

// The decay whose schedule's average_ratio() comes nearest `ratio` for `segments` over `layers`
// (bisected: the ratio is monotone in d, stepwise). The benchmarks' keep ~R starts from it.
double decay_for_average_ratio(int32_t layers, int32_t segments, double ratio);

}  // namespace keep::worker
