#include "services/worker/keep/recompute_plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace keep::worker {
namespace {

Status invalid(const std::string& msg) {
  return Status(Code::kInvalidArgument, "recompute plan: " + msg);
}

}  // namespace

const char* method_name(Method m) {
  switch (m) {
    case Method::kFull:
      return "full";
    case Method::kPrefix:
      return "prefix";
    case Method::kFullReuse:
      return "full_reuse";
    case Method::kCacheBlend:
      return "cacheblend";
    case Method::kEpic:
      return "epic";
    case Method::kKeep:
      return "keep";
  }
  return "unknown";
}

std::optional<Method> parse_method(std::string_view name) {
  for (Method m : kAllMethods) {
    if (name == method_name(m)) return m;
  }
  return std::nullopt;
}

Status MethodKnobs::validate() const {
  if (!(keep_decay >= 0.0 && keep_decay <= 1.0)) return invalid("keep decay d must be in [0, 1]");
  if (importance.query_rows_used < 1) return invalid("q (query rows) must be >= 1");
  if (importance.max_hops < 0) return invalid("the hop cap must be >= 0");
  if (!(cacheblend_ratio >= 0.0 && cacheblend_ratio <= 1.0)) {
    return invalid("cacheblend ratio must be in [0, 1]");
  }
  if (cacheblend_check_layer < 0) return invalid("cacheblend check layer must be >= 0");
  if (epic_tokens < 0) return invalid("epic tokens must be >= 0");
  if (keep_anchor_tokens < 0) return invalid("keep anchor tokens must be >= 0");
  return Status::ok();
}

int32_t PromptShape::memory_tokens() const {
  int32_t n = 0;
  for (const auto& s : segments) n += s.tokens();
  return n;
}

Status PromptShape::validate() const {
  if (total < 0 || cached_prefix < 0 || cached_prefix > total) {
    return invalid("cached prefix " + std::to_string(cached_prefix) + " outside the prompt of " +
                   std::to_string(total));
  }
  int32_t at = cached_prefix;
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    if (s.begin < at || s.end <= s.begin || s.end > total) {
      return invalid("segment " + std::to_string(i) + " [" + std::to_string(s.begin) + ", " +
                     std::to_string(s.end) + ") is empty, overlaps, or lies outside [" +
                     std::to_string(at) + ", " + std::to_string(total) + ")");
    }
    at = s.end;
  }
  return Status::ok();
}

Result<RecomputePlan> RecomputePlan::create(Method method, const PromptShape& shape,
                                            int32_t num_layers, const MethodKnobs& knobs) {
  KEEP_RETURN_IF_ERROR(shape.validate());
  KEEP_RETURN_IF_ERROR(knobs.validate());
  if (num_layers < 1) return invalid("num_layers must be >= 1");
  RecomputePlan p;
  p.method_ = method;
  p.knobs_ = knobs;
  p.shape_ = shape;
  p.num_layers_ = num_layers;
  const int32_t segments = static_cast<int32_t>(shape.segments.size());
  p.token_on_.reserve(static_cast<size_t>(shape.memory_tokens()));
  for (const auto& s : shape.segments) {
    for (int32_t k = 0; k < s.tokens(); ++k) {
      bool on = true;
      if (method == Method::kFullReuse) on = !s.loadable;
      if (method == Method::kEpic) on = !s.loadable || k < knobs.epic_tokens;
      p.token_on_.push_back(on ? 1 : 0);
    }
  }
  if (method == Method::kKeep) {
    KEEP_ASSIGN_OR_RETURN(p.schedule_,
                          make_recompute_schedule(num_layers, segments, knobs.keep_decay));
    p.seg_selected_.resize(static_cast<size_t>(segments));
    std::iota(p.seg_selected_.begin(), p.seg_selected_.end(), 0);
  }
  p.build_rows();
  return p;
}

void RecomputePlan::build_rows() {
  rows_.clear();
  const int32_t first = method_ == Method::kFull ? 0 : shape_.cached_prefix;
  size_t tok = 0;
  int32_t slot = first;
  for (const auto& s : shape_.segments) {
    for (; slot < s.begin; ++slot) rows_.push_back(slot);
    for (; slot < s.end; ++slot, ++tok) {
      if (token_on_[tok]) rows_.push_back(slot);
    }
  }
  for (; slot < shape_.total; ++slot) rows_.push_back(slot);
}

std::vector<int32_t> RecomputePlan::loaded_memory_slots() const {
  std::vector<int32_t> out;
  size_t tok = 0;
  for (const auto& s : shape_.segments) {
    for (int32_t slot = s.begin; slot < s.end; ++slot, ++tok) {
      if (!token_on_[tok]) out.push_back(slot);
    }
  }
  return out;
}

std::vector<int32_t> RecomputePlan::row_segments() const {
  std::vector<int32_t> out(rows_.size(), -1);
  size_t seg = 0;
  for (size_t r = 0; r < rows_.size(); ++r) {
    while (seg < shape_.segments.size() && shape_.segments[seg].end <= rows_[r]) ++seg;
    if (seg < shape_.segments.size() && shape_.segments[seg].begin <= rows_[r]) {
      const auto s = static_cast<int32_t>(seg);
      const bool anchor_only = method_ == Method::kKeep && knobs_.keep_anchor_tokens > 0 &&
                               !std::binary_search(seg_selected_.begin(), seg_selected_.end(), s);
      if (!anchor_only) out[r] = s;
    }
  }
  return out;
}

RecomputePlan::Check RecomputePlan::check() const {
  if (done()) return Check::kNone;
  if (method_ == Method::kKeep && schedule_.is_check(layer_)) return Check::kImportance;
  if (method_ == Method::kCacheBlend && layer_ == knobs_.cacheblend_check_layer &&
      layer_ + 1 < num_layers_) {
    return Check::kDeviation;
  }
  return Check::kNone;
}

Status RecomputePlan::next(const ImportanceInput* importance, std::span<const float> deviation) {
  if (done()) return invalid("every layer has run");
  const std::string at = "layer " + std::to_string(layer_);
  int32_t memory_rows = 0;
  for (uint8_t on : token_on_) memory_rows += on;
  const Check c = check();

  if (c == Check::kImportance) {
    if (importance == nullptr) return invalid(at + " is a check layer: importance is needed");
    if (importance->row_segment.size() != rows_.size()) {
      return invalid(at + ": importance has " + std::to_string(importance->row_segment.size()) +
                     " rows, the layer computed " + std::to_string(rows_.size()));
    }
    std::vector<int32_t> pinned;
    for (int32_t s : seg_selected_) {
      if (!shape_.segments[s].loadable) pinned.push_back(s);
    }
    KEEP_ASSIGN_OR_RETURN(Selection sel,
                          select_segments(*importance, seg_selected_, pinned,
                                          schedule_.segments[layer_ + 1], knobs_.importance));
    hops_.push_back(sel.hops);
    seg_selected_ = std::move(sel.selected);
    size_t tok = 0;
    for (size_t s = 0; s < shape_.segments.size(); ++s) {
      const bool on =
          std::binary_search(seg_selected_.begin(), seg_selected_.end(), static_cast<int32_t>(s));
      for (int32_t k = 0; k < shape_.segments[s].tokens(); ++k) {
        token_on_[tok++] = on || k < knobs_.keep_anchor_tokens ? 1 : 0;
      }
    }
  } else if (c == Check::kDeviation) {
    if (deviation.size() != rows_.size()) {
      return invalid(at + " is CacheBlend's check layer: one deviation per row is needed (" +
                     std::to_string(rows_.size()) + "), got " + std::to_string(deviation.size()));
    }
    // Candidates: the loadable memory tokens (the others stay computed), by deviation.
    struct Cand {
      float dev;
      size_t tok;
    };
    std::vector<Cand> cands;
    std::vector<int32_t> segs = row_segments();
    std::vector<size_t> tok_of_slot_base(shape_.segments.size());
    size_t base = 0;
    for (size_t s = 0; s < shape_.segments.size(); ++s) {
      tok_of_slot_base[s] = base;
      base += static_cast<size_t>(shape_.segments[s].tokens());
    }
    for (size_t r = 0; r < rows_.size(); ++r) {
      if (segs[r] < 0 || !shape_.segments[segs[r]].loadable) continue;
      const auto& sg = shape_.segments[segs[r]];
      // A NaN deviation says nothing is known of the cached K: recompute that token.
      const float dev = std::isnan(deviation[r]) ? INFINITY : deviation[r];
      cands.push_back({dev, tok_of_slot_base[segs[r]] + (rows_[r] - sg.begin)});
    }
    const size_t keep_n = static_cast<size_t>(
        std::ceil(knobs_.cacheblend_ratio * static_cast<double>(cands.size()) - 1e-9));
    std::stable_sort(cands.begin(), cands.end(),
                     [](const Cand& x, const Cand& y) { return x.dev > y.dev; });
    for (size_t i = 0; i < cands.size(); ++i) token_on_[cands[i].tok] = i < keep_n ? 1 : 0;
  }

  memory_rows_.push_back(memory_rows);
  ++layer_;
  if (!done()) build_rows();
  return Status::ok();
}

double RecomputePlan::recompute_ratio() const {
  const int32_t m = shape_.memory_tokens();
  if (m == 0 || memory_rows_.empty()) return 1.0;
  double sum = 0;
  for (int32_t r : memory_rows_) sum += r;
  return sum / (static_cast<double>(m) * static_cast<double>(memory_rows_.size()));
}

}  // namespace keep::worker
