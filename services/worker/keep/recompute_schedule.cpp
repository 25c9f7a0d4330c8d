#include "services/worker/keep/recompute_schedule.h"

#include <cmath>
#include <string>

namespace keep::worker {

bool RecomputeSchedule::is_check(int32_t layer) const {
  return layer >= 0 && layer + 1 < num_layers() && segments[layer + 1] < segments[layer];
}

std::vector<int32_t> RecomputeSchedule::check_layers() const {
  std::vector<int32_t> out;
  for (int32_t i = 0; i + 1 < num_layers(); ++i) {
    if (is_check(i)) out.push_back(i);
  }
  return out;
}

double RecomputeSchedule::average_ratio() const {
  if (segments.empty() || segments[0] == 0) return 1.0;
  double sum = 0;
  for (int32_t s : segments) sum += static_cast<double>(s) / segments[0];
  return sum / static_cast<double>(segments.size());
}

Result<RecomputeSchedule> make_recompute_schedule(int32_t layers, int32_t segments, double decay) {
  if (layers < 1) return Status(Code::kInvalidArgument, "schedule: layers must be >= 1");
  if (segments < 0) return Status(Code::kInvalidArgument, "schedule: segments must be >= 0");
  if (!(decay >= 0.0 && decay <= 1.0)) {
    return Status(Code::kInvalidArgument,
                  "schedule: decay d must be in [0, 1], got " + std::to_string(decay));
  }
  RecomputeSchedule s;
  s.segments.resize(static_cast<size_t>(layers));
  double r = segments;
  for (int32_t i = 0; i < layers; ++i) {
    // A hair of tolerance: 10 · 0.9 must floor to 9, not to 8 through 8.999999999.
    s.segments[i] = static_cast<int32_t>(std::floor(r + 1e-9));
    r *= decay;
  }
  return s;
}

double decay_for_average_ratio(int32_t layers, int32_t segments, double ratio) {
  double lo = 0.0, hi = 1.0, best = 1.0, best_err = 2.0;
  for (int i = 0; i < 60; ++i) {
    const double d = 0.5 * (lo + hi);
    const auto sch = make_recompute_schedule(layers, segments, d);
    const double r = sch.is_ok() ? sch->average_ratio() : 1.0;
    if (std::abs(r - ratio) < best_err) {
      best_err = std::abs(r - ratio);
      best = d;
    }
    (r < ratio ? lo : hi) = d;
  }
  return best;
}

}  // namespace keep::worker
