#include "services/worker/engine/core/replay_cache.h"

#include <algorithm>
#include <utility>

namespace keep::engine {

ReplayCache::Decision ReplayCache::find(const Backend& backend, const Key& key) {
  auto hit = std::find_if(recorded_.begin(), recorded_.end(),
                          [&](const Recorded& r) { return r.key == key; });
  const Backend::ReplayState state =
      hit != recorded_.end() ? backend.replay_state(hit->handle) : Backend::ReplayState::kGone;
  if (state == Backend::ReplayState::kReplayable) {
    std::rotate(hit, hit + 1, recorded_.end());  // most recently used last
    return Decision{Action::kReplay, recorded_.back().plan.get(), recorded_.back().handle};
  }
  if (state == Backend::ReplayState::kNotNow) return Decision{};
  if (hit != recorded_.end()) recorded_.erase(hit);  // dropped on the backend's side
  auto seen = std::find(seen_.begin(), seen_.end(), key);
  if (seen != seen_.end()) {
    seen_.erase(seen);
    return Decision{Action::kRecord};
  }
  if (seen_.size() == kSeenKeys) seen_.erase(seen_.begin());
  seen_.push_back(key);
  return Decision{};
}

void ReplayCache::add(Backend& backend, const Key& key, std::unique_ptr<AttentionPlan> plan,
                      uint64_t handle) {
  if (recorded_.size() == kCapacity) {
    backend.drop_recording(recorded_.front().handle);
    recorded_.erase(recorded_.begin());
  }
  recorded_.push_back(Recorded{key, std::move(plan), handle});
}

}  // namespace keep::engine
