// Attention layouts for the tests of the attention kernels and their references
// (tests/unit/test_attention_ref.cpp, tests/gpu/test_attention*.cu): the host form of an
// AttentionRows and builders of the layouts they run on. Plain C++ (no CUDA, no doctest).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "services/worker/kernels/layout.h"

namespace keep::kernels::testing {

// Host form of an AttentionRows: row r sees spans[offsets[r] .. offsets[r + 1]).
struct Layout {
  int32_t num_keys = 0;
  std::vector<int32_t> offsets{0};
  std::vector<KeyRange> spans;
  int32_t rows() const { return static_cast<int32_t>(offsets.size()) - 1; }
  void add_row(const std::vector<KeyRange>& row) {
    spans.insert(spans.end(), row.begin(), row.end());
    offsets.push_back(static_cast<int32_t>(spans.size()));
  }
  // An AttentionRows over this layout's host memory.
  AttentionRows view() const {
    return AttentionRows{offsets.data(), spans.data(), rows(), num_keys};
  }
  bool row_empty(int32_t r) const { return offsets[r + 1] == offsets[r]; }
  // (row, key) pairs seen.
  int64_t visible() const {
    int64_t n = 0;
    for (const auto& s : spans) n += s.end - s.begin;
    return n;
  }
  // mask[r][t]: row r sees key t.
  std::vector<std::vector<bool>> mask() const {
    std::vector<std::vector<bool>> m(static_cast<size_t>(rows()),
                                     std::vector<bool>(static_cast<size_t>(num_keys), false));
    for (int32_t r = 0; r < rows(); ++r) {
      for (int32_t s = offsets[r]; s < offsets[r + 1]; ++s) {
        for (int32_t t = spans[s].begin; t < spans[s].end; ++t) m[r][t] = true;
      }
    }
    return m;
  }
};

// Keys some row sees.
inline std::vector<bool> seen_keys(const Layout& l) {
  std::vector<bool> seen(static_cast<size_t>(l.num_keys), false);
  for (const auto& s : l.spans) {
    for (int32_t t = s.begin; t < s.end; ++t) seen[t] = true;
  }
  return seen;
}

// A causal chunk of n rows after `past` keys: row r sees [0, past + r].
inline Layout causal(int32_t n, int32_t past) {
  Layout l;
  l.num_keys = past + n;
  for (int32_t r = 0; r < n; ++r) l.add_row({{0, past + r + 1}});
  return l;
}

// A random sorted subset of the slots of [0, total) (about `fraction` of them), each seeing
// [0, s]; with `with_last`, the last slot is always one of them (so there is at least one row).
inline Layout recompute(std::mt19937& rng, int32_t total, double fraction, bool with_last) {
  std::bernoulli_distribution pick(fraction);
  Layout l;
  l.num_keys = total;
  for (int32_t s = 0; s < total; ++s) {
    if (pick(rng) || (with_last && s == total - 1)) l.add_row({{0, s + 1}});
  }
  return l;
}

// Rows = every slot of each block [b, e); a row at slot s sees [0, prefix) and [b, s] (adjacent
// spans when b == prefix). Slots between blocks are seen by nobody.
inline Layout blocks(int32_t prefix, const std::vector<KeyRange>& bl) {
  Layout l;
  l.num_keys = bl.empty() ? prefix : bl.back().end;
  for (const auto& b : bl) {
    for (int32_t s = b.begin; s < b.end; ++s) {
      if (prefix > 0) {
        l.add_row({{0, prefix}, {b.begin, s + 1}});
      } else {
        l.add_row({{b.begin, s + 1}});
      }
    }
  }
  return l;
}

// Rows with 0 .. max_spans random spans (some rows none); with `adjacent`, consecutive spans often
// touch (a run split in several spans).
inline Layout random_spans(std::mt19937& rng, int32_t rows, int32_t num_keys, int max_spans,
                           bool adjacent) {
  Layout l;
  l.num_keys = num_keys;
  std::uniform_int_distribution<int> count(0, max_spans);
  std::uniform_int_distribution<int32_t> key(0, num_keys);
  std::bernoulli_distribution coin(0.5);
  for (int32_t r = 0; r < rows; ++r) {
    const int c = count(rng);
    std::vector<int32_t> cuts;
    for (int i = 0; i < 2 * c; ++i) cuts.push_back(key(rng));
    std::sort(cuts.begin(), cuts.end());
    std::vector<KeyRange> row;
    for (int i = 0; i + 1 < 2 * c; i += 2) {
      int32_t b = cuts[i];
      if (adjacent && !row.empty() && coin(rng)) b = row.back().end;
      if (b < cuts[i + 1]) row.push_back({b, cuts[i + 1]});
    }
    l.add_row(row);
  }
  return l;
}

}  // namespace keep::kernels::testing
