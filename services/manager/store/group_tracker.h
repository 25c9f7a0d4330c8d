// GroupTracker: the semantic groups of ONE agent — online clustering and the static/dynamic
// state machine. It knows segment ids, token counts and embeddings (through a lookup the owner
// provides), nothing about texts, KV or the WAL; MemoryStore reacts to what it reports.
//
// Rules (docs/memory-model.md):
//  - centroid = L2-normalised sum of the members' embeddings, summed in ascending member id
//    (members without an embedding are skipped; a centroid of no embedding is "empty");
//  - place: among groups with a non-empty centroid, cosine(centroid, e) >= tau and
//    tokens + t <= budget, the highest cosine wins (ties: lower group id); none -> a new group;
//  - every membership or content change: version + 1, last_change_step = step, DYNAMIC;
//  - advance(step): a DYNAMIC group with step >= last_change_step + t whose members all have
//    embeddings turns STATIC.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "services/manager/store/memory_store.h"

namespace keep::manager {

struct Group {
  uint64_t id = 0;
  GroupState state = GroupState::kDynamic;
  uint64_t version = 0;
  uint64_t last_change_step = 0;
  uint32_t tokens = 0;
  std::vector<uint64_t> members;  // ascending
  bool centroid_empty = true;
};

class GroupTracker {
 public:
  // The embedding (dim floats, normalised) of a segment, or nullptr when it has none.
  using EmbeddingLookup = std::function<const float*(uint64_t segment_id)>;
  // Token count of a member (used when recomputing totals).
  using TokenLookup = std::function<uint32_t(uint64_t segment_id)>;

  GroupTracker(int dim, float tau, uint32_t token_budget, uint64_t static_after_steps,
               EmbeddingLookup embedding, TokenLookup tokens);

  // The group a new embedding would join, 0 when it would open a new group. `exclude` is never
  // chosen.
  uint64_t find_group(const float* embedding, uint32_t tokens, uint64_t exclude = 0) const;

  // Opens an empty dynamic group with the given id (ids come from the owner so that replay gives
  // the same ids) at `step`.
  Group& create_group(uint64_t id, uint64_t step);

  // Membership/content changes. Each marks the group changed at `step` and returns whether it
  // was STATIC before (a static->dynamic transition).
  bool add_member(uint64_t group_id, uint64_t segment_id, uint64_t step);
  bool remove_member(uint64_t group_id, uint64_t segment_id, uint64_t step);
  bool touch(uint64_t group_id, uint64_t step);  // a member's text/kind/tokens changed
  // A member's embedding changed without a membership change: recompute the centroid only.
  void refresh_centroid(uint64_t group_id);

  // Cosine of `embedding` to the centroid of the group without `segment_id`; nullopt-like: returns
  // false in *has_other when no other member has an embedding.
  float cosine_without(uint64_t group_id, uint64_t segment_id, const float* embedding,
                       bool* has_other) const;

  // Drops an empty group.
  void drop(uint64_t group_id);

  // Groups that turn STATIC at `step`, ascending id (their state is updated).
  std::vector<uint64_t> advance(uint64_t step);

  const Group* find(uint64_t group_id) const;
  const std::map<uint64_t, Group>& groups() const { return groups_; }
  uint32_t token_budget() const { return budget_; }

  // Restores a group from a snapshot (members are added afterwards with restore_member, then
  // finish_restore recomputes tokens and centroids).
  Group& restore_group(uint64_t id, GroupState state, uint64_t version, uint64_t last_change_step);
  void restore_member(uint64_t group_id, uint64_t segment_id);
  void finish_restore();

 private:
  Group& get(uint64_t group_id);
  void mark_changed(Group& g, uint64_t step);
  void recompute(Group& g);  // tokens and centroid

  int dim_;
  float tau_;
  uint32_t budget_;
  uint64_t static_after_;
  EmbeddingLookup embedding_;
  TokenLookup tokens_;
  std::map<uint64_t, Group> groups_;
  // Centroids, one contiguous row per group (row order = centroid_ids_), for one sgemv per
  // placement.
  std::vector<float> centroids_;  // (rows, dim)
  std::vector<uint64_t> centroid_ids_;
  std::map<uint64_t, size_t> centroid_row_;
  mutable std::vector<float> scratch_;
  std::vector<double> acc_;
};

}  // namespace keep::manager
