#include "services/worker/engine/core/attention_layout.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace keep::engine {

namespace {

Status invalid(const std::string& msg) { return Status(Code::kInvalidArgument, msg); }

std::string span_str(const KeySpan& s) {
  return "[" + std::to_string(s.begin) + ", " + std::to_string(s.end) + ")";
}

}  // namespace

int64_t AttentionLayout::visible_keys(int32_t row) const {
  int64_t n = 0;
  for (int32_t i = span_offsets[row]; i < span_offsets[row + 1]; ++i) {
    n += spans[i].end - spans[i].begin;
  }
  return n;
}

int64_t AttentionLayout::max_visible_keys() const {
  int64_t best = 0;
  for (int32_t r = 0; r < num_rows(); ++r) best = std::max(best, visible_keys(r));
  return best;
}

Status AttentionLayout::validate() const {
  const size_t rows = row_slot.size();
  if (num_keys < 0) return invalid("num_keys is negative");
  if (rows == 0) return invalid("the layout has no rows");
  if (row_position.size() != rows) {
    return invalid("row_position has " + std::to_string(row_position.size()) +
                   " entries, expected " + std::to_string(rows));
  }
  if (span_offsets.size() != rows + 1) {
    return invalid("span_offsets has " + std::to_string(span_offsets.size()) +
                   " entries, expected " + std::to_string(rows + 1));
  }
  if (span_offsets[0] != 0 || span_offsets[rows] != static_cast<int64_t>(spans.size())) {
    return invalid("span_offsets must start at 0 and end at spans.size()");
  }
  // A repeated slot: in the usual layouts slots ascend and none can repeat; otherwise a sorted copy
  // finds the first row (in row order) whose slot an earlier row holds. This runs on every prefill
  // before the first kernel, so nothing here allocates per row (an error message is built only
  // for the row that fails).
  size_t first_repeat = rows;
  const bool ascending =
      std::adjacent_find(row_slot.begin(), row_slot.end(),
                         [](int32_t a, int32_t b) { return a >= b; }) == row_slot.end();
  if (!ascending) {
    std::vector<std::pair<int32_t, int32_t>> by_slot(rows);  // (slot, row)
    for (size_t r = 0; r < rows; ++r) by_slot[r] = {row_slot[r], static_cast<int32_t>(r)};
    std::sort(by_slot.begin(), by_slot.end());
    for (size_t i = 1; i < rows; ++i) {
      if (by_slot[i].first == by_slot[i - 1].first) {
        first_repeat = std::min(first_repeat, static_cast<size_t>(by_slot[i].second));
      }
    }
  }
  const auto where = [](size_t r) { return "row " + std::to_string(r) + ": "; };
  for (size_t r = 0; r < rows; ++r) {
    const int32_t slot = row_slot[r];
    if (slot < 0 || slot >= num_keys) {
      return invalid(where(r) + "slot " + std::to_string(slot) + " outside [0, " +
                     std::to_string(num_keys) + ")");
    }
    if (r == first_repeat) return invalid(where(r) + "slot " + std::to_string(slot) + " repeated");
    if (row_position[r] < 0) return invalid(where(r) + "negative position");
    const int32_t a = span_offsets[r], b = span_offsets[r + 1];
    if (a > b) return invalid(where(r) + "span_offsets decrease");
    if (a == b) return invalid(where(r) + "no keys");
    bool sees_self = false;
    int32_t prev_end = -1;
    for (int32_t i = a; i < b; ++i) {
      const KeySpan& s = spans[i];
      if (s.begin >= s.end) {
        return invalid(where(r) + "span " + span_str(s) + " is empty or reversed");
      }
      if (s.begin < 0 || s.end > num_keys) {
        return invalid(where(r) + "span " + span_str(s) + " outside [0, " +
                       std::to_string(num_keys) + ")");
      }
      if (s.begin < prev_end) return invalid(where(r) + "spans overlap or are not ascending");
      prev_end = s.end;
      if (slot >= s.begin && slot < s.end) sees_self = true;
    }
    if (!sees_self) {
      return invalid(where(r) + "does not see its own slot " + std::to_string(slot));
    }
  }
  if (num_groups < 0) return invalid("num_groups is negative");
  if (num_groups > 0) {
    if (key_group.size() != static_cast<size_t>(num_keys)) {
      return invalid("key_group has " + std::to_string(key_group.size()) + " entries, expected " +
                     std::to_string(num_keys));
    }
    for (size_t t = 0; t < key_group.size(); ++t) {
      if (key_group[t] < -1 || key_group[t] >= num_groups) {
        return invalid("key_group[" + std::to_string(t) + "] = " + std::to_string(key_group[t]) +
                       " outside [-1, " + std::to_string(num_groups) + ")");
      }
    }
  } else if (!key_group.empty()) {
    return invalid("key_group is set but num_groups is 0");
  }
  return Status::ok();
}

void AttentionLayout::set_groups(std::vector<int32_t> groups, int32_t num_groups_) {
  key_group = std::move(groups);
  num_groups = num_groups_;
}

std::string AttentionLayout::summary() const {
  return "rows=" + std::to_string(row_slot.size()) + " keys=" + std::to_string(num_keys) +
         " spans=" + std::to_string(spans.size()) + " groups=" + std::to_string(num_groups);
}

AttentionLayout AttentionLayout::causal(int32_t n, int32_t past, int32_t position_offset) {
  AttentionLayout l;
  l.num_keys = past + std::max(n, 0);
  const auto rows = static_cast<size_t>(std::max(n, 0));
  l.row_slot.reserve(rows);
  l.row_position.reserve(rows);
  l.spans.reserve(rows);
  l.span_offsets.reserve(rows + 1);
  l.span_offsets.push_back(0);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t slot = past + i;
    l.row_slot.push_back(slot);
    l.row_position.push_back(slot + position_offset);
    l.spans.push_back({0, slot + 1});
    l.span_offsets.push_back(static_cast<int32_t>(l.spans.size()));
  }
  return l;
}

AttentionLayout AttentionLayout::recompute(const std::vector<int32_t>& slots, int32_t total) {
  AttentionLayout l;
  l.num_keys = total;
  l.span_offsets.push_back(0);
  for (int32_t slot : slots) {
    l.row_slot.push_back(slot);
    l.row_position.push_back(slot);
    l.spans.push_back({0, slot + 1});
    l.span_offsets.push_back(static_cast<int32_t>(l.spans.size()));
  }
  return l;
}

AttentionLayout AttentionLayout::blocks(int32_t prefix, const std::vector<KeySpan>& blocks,
                                        bool compute_prefix) {
  AttentionLayout l;
  l.num_keys = prefix;
  l.span_offsets.push_back(0);
  if (compute_prefix) {
    for (int32_t s = 0; s < prefix; ++s) {
      l.row_slot.push_back(s);
      l.row_position.push_back(s);
      l.spans.push_back({0, s + 1});
      l.span_offsets.push_back(static_cast<int32_t>(l.spans.size()));
    }
  }
  for (const KeySpan& b : blocks) {
    l.num_keys = std::max(l.num_keys, b.end);
    for (int32_t s = b.begin; s < b.end; ++s) {
      l.row_slot.push_back(s);
      l.row_position.push_back(s);
      if (prefix > 0) l.spans.push_back({0, prefix});
      l.spans.push_back({b.begin, s + 1});
      l.span_offsets.push_back(static_cast<int32_t>(l.spans.size()));
    }
  }
  return l;
}

}  // namespace keep::engine
