// LoadSchedule (services/worker/keep/load_schedule.h): the order of a request's queued loads.
#include <doctest/doctest.h>

#include <map>
#include <set>
#include <utility>
#include <vector>

#include "services/worker/keep/load_schedule.h"

using keep::worker::LoadSchedule;

namespace {

using Items = std::vector<std::pair<int32_t, int32_t>>;  // (layer, cohort)

Items items(const std::vector<LoadSchedule::Item>& v) {
  Items out;
  for (const auto& i : v) out.emplace_back(i.layer, i.cohort);
  return out;
}

}  // namespace

TEST_CASE("LoadSchedule: the layer itself, then the next, then later layers within the budget") {
  LoadSchedule s(6, 250);  // 100 bytes a layer: two layers fit past the next one
  CHECK(s.add_cohort(0, 100) == 0);
  CHECK(items(s.before_layer(0)) == Items{{0, 0}, {1, 0}, {2, 0}, {3, 0}});
  CHECK(s.ahead_of(1) == 200);
  // Before layer 1 the budget counts the layers after 2: layer 3 (queued) and 4 -> 200 <= 250.
  CHECK(items(s.before_layer(1)) == Items{{4, 0}});
  CHECK(items(s.before_layer(2)) == Items{{5, 0}});
  CHECK(s.before_layer(3).empty());
  CHECK(s.before_layer(5).empty());
}

TEST_CASE("LoadSchedule: a cohort created by a check goes first, before anything ahead") {
  LoadSchedule s(8, 1000);
  s.add_cohort(0, 10);  // full_reuse-like: everything from layer 0
  const auto first = items(s.before_layer(0));
  CHECK(first.size() == 8);  // 70 bytes of later layers fit the budget
  s.before_layer(1);
  s.before_layer(2);
  // A check at layer 2 excludes more slots from layer 3 on: layer 3's and 4's come now, the
  // old cohort having nothing left to queue.
  const int32_t c = s.add_cohort(3, 300);
  CHECK(c == 1);
  const auto now = items(s.before_layer(3));
  REQUIRE(now.size() >= 2);
  CHECK(now[0] == std::make_pair(3, 1));
  CHECK(now[1] == std::make_pair(4, 1));
  // Within 1000 bytes past layer 4: layers 5, 6 and 7 at 300 each would make 900.
  CHECK(now == Items{{3, 1}, {4, 1}, {5, 1}, {6, 1}, {7, 1}});
}

TEST_CASE("LoadSchedule: with no budget only the layer and the next are queued") {
  LoadSchedule s(4, 0);
  s.add_cohort(0, 5);
  s.add_cohort(0, 7);
  CHECK(items(s.before_layer(0)) == Items{{0, 0}, {0, 1}, {1, 0}, {1, 1}});
  CHECK(items(s.before_layer(1)) == Items{{2, 0}, {2, 1}});
  CHECK(items(s.before_layer(2)) == Items{{3, 0}, {3, 1}});
  CHECK(s.before_layer(3).empty());
}

TEST_CASE("LoadSchedule: every cohort's layers are queued exactly once, in order, before use") {
  for (uint64_t budget : {uint64_t{0}, uint64_t{64}, uint64_t{1000}, uint64_t{1} << 40}) {
    const int32_t layers = 12;
    LoadSchedule s(layers, budget);
    std::map<int32_t, int32_t> start;  // cohort -> first layer
    std::set<std::pair<int32_t, int32_t>> seen;
    std::map<int32_t, int32_t> last;  // cohort -> last layer queued
    for (int32_t l = 0; l < layers; ++l) {
      if (l % 3 == 0) start[s.add_cohort(l, 16 + l)] = l;  // a new cohort every third layer
      for (const auto& it : s.before_layer(l)) {
        CHECK(it.layer >= start[it.cohort]);
        CHECK(seen.insert({it.layer, it.cohort}).second);  // once
        const auto prev = last.find(it.cohort);
        CHECK(it.layer == (prev == last.end() ? start[it.cohort] : prev->second + 1));  // in order
        last[it.cohort] = it.layer;
      }
      // What layer l needs has been queued by now.
      for (const auto& [c, first] : start) {
        if (first <= l) CHECK(seen.count({l, c}) == 1);
      }
    }
    for (const auto& [c, first] : start) CHECK(last[c] == layers - 1);
  }
}

TEST_CASE("LoadSchedule: layers outside the model queue nothing") {
  LoadSchedule s(3, 100);
  s.add_cohort(0, 1);
  CHECK(s.before_layer(-1).empty());
  CHECK(s.before_layer(3).empty());
}

TEST_CASE("LoadSchedule: a call's own budget replaces the constructor's for that call") {
  LoadSchedule s(8, 0);  // no run-ahead by default
  s.add_cohort(1, 100);
  // A compute-heavy layer may let the loader run ahead: 300 bytes past layer 2 -> layers 3-5.
  CHECK(items(s.before_layer(1, 300)) == Items{{1, 0}, {2, 0}, {3, 0}, {4, 0}, {5, 0}});
  // Back to the default budget: only what layer 3 needs next (layer 3 is queued, 4 and 5 too).
  CHECK(items(s.before_layer(2)).empty());
  CHECK(items(s.before_layer(5)) == Items{{6, 0}});
  CHECK(items(s.before_layer(6)) == Items{{7, 0}});
}
