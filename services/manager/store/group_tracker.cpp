#include "services/manager/store/group_tracker.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <utility>

namespace keep::manager {

GroupTracker::GroupTracker(int dim, float tau, uint32_t token_budget, uint64_t static_after_steps,
                           EmbeddingLookup embedding, TokenLookup tokens)
    : dim_(dim),
      tau_(tau),
      budget_(token_budget),
      static_after_(static_after_steps),
      embedding_(std::move(embedding)),
      tokens_(std::move(tokens)),
      acc_(static_cast<size_t>(dim)) {
  KEEP_CHECK(dim_ > 0);
  KEEP_CHECK(static_after_ >= 1);
}

Group& GroupTracker::get(uint64_t group_id) {
  auto it = groups_.find(group_id);
  KEEP_CHECK_MSG(it != groups_.end(), "unknown group id");
  return it->second;
}

const Group* GroupTracker::find(uint64_t group_id) const {
  auto it = groups_.find(group_id);
  return it == groups_.end() ? nullptr : &it->second;
}

uint64_t GroupTracker::find_group(const float* embedding, uint32_t tokens, uint64_t exclude) const {
  const size_t rows = centroid_ids_.size();
  if (rows == 0) return 0;
  scratch_.resize(rows);
  cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(rows), dim_, 1.0f, centroids_.data(),
              dim_, embedding, 1, 0.0f, scratch_.data(), 1);
  uint64_t best = 0;
  float best_score = 0.0f;
  for (size_t r = 0; r < rows; ++r) {
    const uint64_t gid = centroid_ids_[r];
    if (gid == exclude) continue;
    const float score = scratch_[r];
    if (!(score >= tau_)) continue;
    const Group& g = groups_.at(gid);
    if (g.centroid_empty) continue;
    if (static_cast<uint64_t>(g.tokens) + tokens > budget_) continue;
    if (best == 0 || score > best_score || (score == best_score && gid < best)) {
      best = gid;
      best_score = score;
    }
  }
  return best;
}

Group& GroupTracker::create_group(uint64_t id, uint64_t step) {
  KEEP_CHECK(id != 0 && groups_.count(id) == 0);
  Group& g = groups_[id];
  g.id = id;
  g.version = 0;
  g.last_change_step = step;
  g.state = GroupState::kDynamic;
  centroid_row_[id] = centroid_ids_.size();
  centroid_ids_.push_back(id);
  centroids_.resize(centroids_.size() + static_cast<size_t>(dim_), 0.0f);
  return g;
}

void GroupTracker::mark_changed(Group& g, uint64_t step) {
  g.version += 1;
  g.last_change_step = step;
  g.state = GroupState::kDynamic;
}

bool GroupTracker::add_member(uint64_t group_id, uint64_t segment_id, uint64_t step) {
  Group& g = get(group_id);
  const bool was_static = g.state == GroupState::kStatic;
  auto it = std::lower_bound(g.members.begin(), g.members.end(), segment_id);
  KEEP_CHECK(it == g.members.end() || *it != segment_id);
  g.members.insert(it, segment_id);
  mark_changed(g, step);
  recompute(g);
  return was_static;
}

bool GroupTracker::remove_member(uint64_t group_id, uint64_t segment_id, uint64_t step) {
  Group& g = get(group_id);
  const bool was_static = g.state == GroupState::kStatic;
  auto it = std::lower_bound(g.members.begin(), g.members.end(), segment_id);
  KEEP_CHECK(it != g.members.end() && *it == segment_id);
  g.members.erase(it);
  mark_changed(g, step);
  recompute(g);
  return was_static;
}

bool GroupTracker::touch(uint64_t group_id, uint64_t step) {
  Group& g = get(group_id);
  const bool was_static = g.state == GroupState::kStatic;
  mark_changed(g, step);
  recompute(g);
  return was_static;
}

void GroupTracker::refresh_centroid(uint64_t group_id) { recompute(get(group_id)); }

void GroupTracker::recompute(Group& g) {
  uint64_t tokens = 0;
  std::fill(acc_.begin(), acc_.end(), 0.0);
  bool any = false;
  for (uint64_t sid : g.members) {
    tokens += tokens_(sid);
    const float* e = embedding_(sid);
    if (e == nullptr) continue;
    any = true;
    for (int d = 0; d < dim_; ++d) acc_[static_cast<size_t>(d)] += e[d];
  }
  g.tokens = static_cast<uint32_t>(std::min<uint64_t>(tokens, UINT32_MAX));
  double norm = 0.0;
  for (double v : acc_) norm += v * v;
  norm = std::sqrt(norm);
  g.centroid_empty = !any || norm == 0.0;
  float* row = centroids_.data() + centroid_row_.at(g.id) * static_cast<size_t>(dim_);
  for (int d = 0; d < dim_; ++d) {
    row[d] = g.centroid_empty ? 0.0f : static_cast<float>(acc_[static_cast<size_t>(d)] / norm);
  }
}

float GroupTracker::cosine_without(uint64_t group_id, uint64_t segment_id, const float* embedding,
                                   bool* has_other) const {
  const Group* g = find(group_id);
  KEEP_CHECK(g != nullptr);
  std::vector<double> acc(static_cast<size_t>(dim_), 0.0);
  bool any = false;
  for (uint64_t sid : g->members) {
    if (sid == segment_id) continue;
    const float* e = embedding_(sid);
    if (e == nullptr) continue;
    any = true;
    for (int d = 0; d < dim_; ++d) acc[static_cast<size_t>(d)] += e[d];
  }
  double norm = 0.0, dot = 0.0;
  for (int d = 0; d < dim_; ++d) {
    norm += acc[static_cast<size_t>(d)] * acc[static_cast<size_t>(d)];
    dot += acc[static_cast<size_t>(d)] * embedding[d];
  }
  *has_other = any && norm > 0.0;
  if (!*has_other) return 0.0f;
  return static_cast<float>(dot / std::sqrt(norm));
}

void GroupTracker::drop(uint64_t group_id) {
  auto it = groups_.find(group_id);
  KEEP_CHECK(it != groups_.end() && it->second.members.empty());
  groups_.erase(it);
  // Swap-remove the centroid row.
  const size_t row = centroid_row_.at(group_id);
  const size_t last = centroid_ids_.size() - 1;
  if (row != last) {
    std::copy_n(centroids_.data() + last * static_cast<size_t>(dim_), dim_,
                centroids_.data() + row * static_cast<size_t>(dim_));
    centroid_ids_[row] = centroid_ids_[last];
    centroid_row_[centroid_ids_[row]] = row;
  }
  centroid_ids_.pop_back();
  centroids_.resize(centroids_.size() - static_cast<size_t>(dim_));
  centroid_row_.erase(group_id);
}

std::vector<uint64_t> GroupTracker::advance(uint64_t step) {
  std::vector<uint64_t> turned;
  for (auto& [gid, g] : groups_) {
    if (g.state != GroupState::kDynamic) continue;
    if (step < g.last_change_step || step - g.last_change_step < static_after_) continue;
    bool all_embedded = true;
    for (uint64_t sid : g.members) {
      if (embedding_(sid) == nullptr) {
        all_embedded = false;
        break;
      }
    }
    if (!all_embedded || g.members.empty()) continue;
    g.state = GroupState::kStatic;
    turned.push_back(gid);
  }
  return turned;
}

Group& GroupTracker::restore_group(uint64_t id, GroupState state, uint64_t version,
                                   uint64_t last_change_step) {
  Group& g = create_group(id, last_change_step);
  g.state = state;
  g.version = version;
  return g;
}

void GroupTracker::restore_member(uint64_t group_id, uint64_t segment_id) {
  Group& g = get(group_id);
  // Snapshot segments arrive in ascending id, so push_back keeps members sorted.
  KEEP_CHECK(g.members.empty() || g.members.back() < segment_id);
  g.members.push_back(segment_id);
}

void GroupTracker::finish_restore() {
  for (auto& [gid, g] : groups_) recompute(g);
}

}  // namespace keep::manager
