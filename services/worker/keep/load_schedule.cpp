#include "services/worker/keep/load_schedule.h"

#include <algorithm>

namespace keep::worker {

int32_t LoadSchedule::add_cohort(int32_t first_layer, uint64_t bytes_per_layer) {
  cohorts_.push_back({std::clamp(first_layer, 0, layers_), bytes_per_layer});
  return static_cast<int32_t>(cohorts_.size()) - 1;
}

void LoadSchedule::take(int32_t layer, int32_t cohort, std::vector<Item>* out) {
  out->push_back({layer, cohort});
  queued_[static_cast<size_t>(layer)] += cohorts_[static_cast<size_t>(cohort)].bytes;
  cohorts_[static_cast<size_t>(cohort)].next = layer + 1;
}

uint64_t LoadSchedule::ahead_of(int32_t layer) const {
  uint64_t sum = 0;
  for (int32_t j = std::max(layer + 1, 0); j < layers_; ++j) sum += queued_[static_cast<size_t>(j)];
  return sum;
}

std::vector<LoadSchedule::Item> LoadSchedule::before_layer(int32_t layer, uint64_t budget) {
  std::vector<Item> out;
  if (layer < 0 || layer >= layers_) return out;
  const auto n = static_cast<int32_t>(cohorts_.size());
  // 1. Layer `layer` itself (and any layer a cohort skipped, which the caller's order rules out).
  for (int32_t c = 0; c < n; ++c) {
    while (cohorts_[static_cast<size_t>(c)].next <= layer) {
      take(cohorts_[static_cast<size_t>(c)].next, c, &out);
    }
  }
  // 2. The next layer, unconditionally.
  if (layer + 1 < layers_) {
    for (int32_t c = 0; c < n; ++c) {
      if (cohorts_[static_cast<size_t>(c)].next == layer + 1) take(layer + 1, c, &out);
    }
  }
  // 3. Later layers, nearest first, within the budget (counting the layers after layer + 1).
  uint64_t ahead = ahead_of(layer + 1);
  for (int32_t j = layer + 2; j < layers_; ++j) {
    for (int32_t c = 0; c < n; ++c) {
      Cohort& co = cohorts_[static_cast<size_t>(c)];
      if (co.next != j) continue;
      if (ahead + co.bytes > budget) return out;
      ahead += co.bytes;
      take(j, c, &out);
    }
  }
  return out;
}

}  // namespace keep::worker
