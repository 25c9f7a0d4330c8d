// AttentionLayout: plain data that says, for one prefill_layer call, which rows are computed, where
// they sit in the prompt, and which keys each of them attends to.
//
// The KV view of a layer (backend.h KvView) is a table of key slots [0, num_keys): slot t holds the
// K (rotated to t's prompt position) and V of one prompt token. Some slots are loaded from the KV
// store before the call, the others are computed by the call itself: row r computes the token in
// slot row_slot[r] at RoPE position row_position[r], writes its K/V there, then attends to the key
// slots in its spans. Every row's K/V is written before any row attends, so rows of one call may
// see each other (causal prefill of a chunk).
//
// Modes the builders produce (all are just spans; a backend consumes any valid layout):
//   causal(n, past)          rows = slots [past, past+n), row at slot s sees [0, s]. A full prefill
//                            (past = 0), a prefill chunk or a decode step (n = 1) over a cache.
//   recompute(slots, total)  rows = a sorted subset of the prompt, each sees [0, s]: the subset is
//                            recomputed against the loaded KV of the other slots (CacheBlend/KEEP).
//   blocks(prefix, blocks)   independent blocks after a shared prefix: a row at slot s of block
//                            [b, e) sees [0, prefix) and [b, s]. Computes each segment's or group's
//                            KV as if it stood alone after the prefix, several in one call; also
//                            batched candidate scoring (each candidate a block after the prompt).
//
// Pooling: with key_group set (slot -> group id, -1 = none), the backend also returns, per row,
// Σ_heads Σ_{t in group g} p[row, head, t] so importance can be pooled per segment (§5), and always
// the per-row, per-head log-sum-exp of the scaled scores so any probability can be recomputed as
// p = exp(q·k / sqrt(hd) - lse).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shared/common/status.h"

namespace keep::engine {

// Key slots [begin, end).
struct KeySpan {
  int32_t begin = 0;
  int32_t end = 0;
};

struct AttentionLayout {
  int32_t num_keys = 0;               // slots [0, num_keys) of the view may be referenced
  std::vector<int32_t> row_slot;      // (rows) view slot the row's K/V is written to; unique
  std::vector<int32_t> row_position;  // (rows) RoPE position of the row's token
  std::vector<int32_t> span_offsets;  // (rows + 1) row r's spans: spans[offs[r] .. offs[r+1])
  std::vector<KeySpan> spans;         // ascending, disjoint, non-empty, within [0, num_keys)
  std::vector<int32_t> key_group;     // (num_keys) slot -> group in [0, num_groups), -1; or empty
  int32_t num_groups = 0;             // > 0 iff key_group is set

  int32_t num_rows() const { return static_cast<int32_t>(row_slot.size()); }
  // Keys row r attends to (sum of its span lengths).
  int64_t visible_keys(int32_t row) const;
  // The largest visible_keys over the rows (workspace sizing).
  int64_t max_visible_keys() const;

  // Checks every invariant above, plus: every row sees its own slot. kInvalidArgument naming the
  // row or span ("row 3: span [5, 2) is empty or reversed").
  Status validate() const;

  // Sets the pooling groups: `groups` has num_keys entries, each -1 or in [0, num_groups).
  void set_groups(std::vector<int32_t> groups, int32_t num_groups_);

  // One line for logs: "rows=12 keys=40 spans=24 groups=3".
  std::string summary() const;

  // ---- builders (positions default to the slot index: contiguous positions in prompt order) ----
  // Rows [past, past + n), each causal over everything before it. `position_offset` shifts RoPE
  // positions (position = slot + position_offset).
  static AttentionLayout causal(int32_t n, int32_t past = 0, int32_t position_offset = 0);
  // Rows = `slots` (strictly ascending, each < total), each causal over [0, slot].
  static AttentionLayout recompute(const std::vector<int32_t>& slots, int32_t total);
  // Rows = every slot of every block (and of the prefix when compute_prefix); block rows see the
  // prefix and their own block causally. Blocks must be ascending, disjoint and start >= prefix.
  static AttentionLayout blocks(int32_t prefix, const std::vector<KeySpan>& blocks,
                                bool compute_prefix = false);
};

}  // namespace keep::engine
