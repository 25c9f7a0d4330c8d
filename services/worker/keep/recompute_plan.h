// RecomputePlan: for one planning request and one method, which prompt slots each layer computes
// and which it loads, layer by layer (ARCHITECTURE §4-§5). Plain data over slot indices: the
// request's layer loop asks rows() at each layer, loads the other memory slots, runs the layer,
// hands back what a check layer needs (pooled attention or K deviation) and calls next().
//
// The prompt's slots are of three kinds:
//   the cached prefix   [0, cached_prefix): KV already on the device (the system prefix, or for
//                       `prefix` the longest exact token prefix of an earlier prompt); never
//                       computed except by `full`;
//   memory segments     SegmentSlots, each loadable (a valid KV entry) or not (missing/stale:
//   always
//                       computed, never served);
//   everything else     the query, template glue: always computed.
//
// Methods (per request):
//   full        every slot at every layer (no reuse at all).
//   prefix      every slot after the cached prefix (vLLM's automatic prefix caching).
//   full_reuse  loadable segments loaded at every layer; only the rest computed.
//   cacheblend  every memory token at layers <= check layer (1); there, the top `ratio` of the
//   memory
//               tokens by Σ(K_new − K_cached)² go on, the rest are loaded from then on
//               (LMCache's defaults: 15 %).
//   epic        the first `epic_tokens` tokens of each loadable segment at every layer (EPIC's
//               LegoLink), the rest of it loaded.
//   keep        every segment at layer 0, then RecomputeSchedule's count per layer, chosen at check
//               layers by multi-hop importance (importance.h); with keep_anchor_tokens, those
//               leading tokens of every segment at every layer too (not seen by importance).
// The computed set only shrinks from layer to layer: a token not computed at layer i has no hidden
// state for layer i+1.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "services/worker/keep/importance.h"
#include "services/worker/keep/recompute_schedule.h"
#include "shared/common/status.h"

namespace keep::worker {

enum class Method : uint8_t { kFull, kPrefix, kFullReuse, kCacheBlend, kEpic, kKeep };
inline constexpr Method kAllMethods[] = {Method::kFull,       Method::kPrefix, Method::kFullReuse,
                                         Method::kCacheBlend, Method::kEpic,   Method::kKeep};
const char* method_name(Method m);  // "full", "prefix", "full_reuse", "cacheblend", "epic", "keep"
std::optional<Method> parse_method(std::string_view name);

struct MethodKnobs {
  double keep_decay = 0.96;        // d
  ImportanceOptions importance;    // q and the hop cap
  double cacheblend_ratio = 0.15;  // share of memory tokens recomputed after the check layer
  int32_t cacheblend_check_layer = 1;
  int32_t epic_tokens = 16;  // k: leading tokens of each segment recomputed
  // keep: the first tokens of every segment stay computed at every layer, selected or not (an
  // EPIC-style anchor: issue 30's test of whether a loaded segment's first token is what moves
  // the planner's choice). 0: the design's rule.
  int32_t keep_anchor_tokens = 0;
  Status validate() const;
};

struct SegmentSlots {
  int32_t begin = 0;  // slots [begin, end) of the prompt
  int32_t end = 0;
  bool loadable = false;  // a valid KV entry exists for it (else computed at every layer)
  int32_t tokens() const { return end - begin; }
};

struct PromptShape {
  int32_t total = 0;                   // slots in the prompt
  int32_t cached_prefix = 0;           // [0, cached_prefix) is on the device already
  std::vector<SegmentSlots> segments;  // prompt order, disjoint, all >= cached_prefix
  int32_t memory_tokens() const;
  Status validate() const;
};

class RecomputePlan {
 public:
  enum class Check { kNone, kImportance, kDeviation };

  static Result<RecomputePlan> create(Method method, const PromptShape& shape, int32_t num_layers,
                                      const MethodKnobs& knobs = {});

  Method method() const { return method_; }
  int32_t layer() const { return layer_; }
  bool done() const { return layer_ >= num_layers_; }
  // Slots computed at the current layer, ascending.
  const std::vector<int32_t>& rows() const { return rows_; }
  // Memory slots loaded at the current layer (memory slots not in rows()), ascending.
  std::vector<int32_t> loaded_memory_slots() const;
  // Segment (index into shape.segments) of each row, -1 for non-memory rows and for keep's anchor
  // rows of segments no longer selected (importance reads them as neither query nor segment).
  std::vector<int32_t> row_segments() const;
  // keep: the segments computed at the current layer, ascending -- a check layer's candidates,
  // the only columns of the pooled attention that importance reads. Empty for other methods.
  const std::vector<int32_t>& segments_computed() const { return seg_selected_; }
  // What the current layer must report through next().
  Check check() const;

  // Moves to the next layer. kImportance: `importance` describes this layer's rows (row_segment
  // as row_segments(), query_rows = the rows after the last segment). kDeviation: one value per
  // row of rows() (ignored for rows of unloadable segments and non-memory rows).
  Status next(const ImportanceInput* importance = nullptr, std::span<const float> deviation = {});

  // Memory tokens computed at each layer run so far; and their mean share of the memory tokens
  // (1 when the prompt has no memory).
  const std::vector<int32_t>& memory_rows_per_layer() const { return memory_rows_; }
  double recompute_ratio() const;
  // Importance hops run at each check layer so far (keep).
  const std::vector<int32_t>& hops() const { return hops_; }

 private:
  RecomputePlan() = default;
  void build_rows();  // rows_ from the current token selection

  Method method_ = Method::kFull;
  MethodKnobs knobs_;
  PromptShape shape_;
  int32_t num_layers_ = 0;
  int32_t layer_ = 0;
  RecomputeSchedule schedule_;         // keep
  std::vector<uint8_t> token_on_;      // (memory tokens, prompt order) computed at this layer
  std::vector<int32_t> seg_selected_;  // keep: segments computed at this layer, ascending
  std::vector<int32_t> rows_;
  std::vector<int32_t> memory_rows_;
  std::vector<int32_t> hops_;
};

}  // namespace keep::worker
