// GroupTracker: placement by cosine and token budget, versions, and the state machine.
#include <doctest/doctest.h>

#include <cmath>
#include <map>

#include "services/manager/store/group_tracker.h"

using namespace keep;
using namespace keep::manager;

namespace {

struct Fixture {
  std::map<uint64_t, std::vector<float>> emb;
  std::map<uint64_t, uint32_t> tok;
  GroupTracker tracker;

  explicit Fixture(float tau = 0.9f, uint32_t budget = 10, uint64_t t = 3)
      : tracker(
            3, tau, budget, t,
            [this](uint64_t id) -> const float* {
              auto it = emb.find(id);
              return it == emb.end() ? nullptr : it->second.data();
            },
            [this](uint64_t id) { return tok.count(id) ? tok.at(id) : 0u; }) {}

  void set(uint64_t id, std::vector<float> v, uint32_t tokens) {
    double n = 0;
    for (float x : v) n += x * x;
    for (float& x : v) x = static_cast<float>(x / std::sqrt(n));
    emb[id] = v;
    tok[id] = tokens;
  }
  // Places like the store does; returns the group id.
  uint64_t place(uint64_t id, uint64_t step, uint64_t* next_gid) {
    uint64_t g = tracker.find_group(emb.at(id).data(), tok.at(id));
    if (g == 0) {
      g = (*next_gid)++;
      tracker.create_group(g, step);
    }
    tracker.add_member(g, id, step);
    return g;
  }
};

}  // namespace

TEST_CASE("a first segment opens a dynamic group at version 1") {
  Fixture f;
  uint64_t next = 1;
  f.set(1, {1, 0, 0}, 2);
  CHECK(f.place(1, 0, &next) == 1);
  const Group* g = f.tracker.find(1);
  REQUIRE(g != nullptr);
  CHECK(g->state == GroupState::kDynamic);
  CHECK(g->version == 1);
  CHECK(g->tokens == 2);
  CHECK(g->members == std::vector<uint64_t>{1});
}

TEST_CASE("join above tau and under budget, else a new group") {
  Fixture f(0.9f, 5);
  uint64_t next = 1;
  f.set(1, {1, 0, 0}, 2);
  f.set(2, {1, 0.1f, 0}, 2);   // cos ~0.995: joins
  f.set(3, {0, 1, 0}, 1);      // cos 0: new group
  f.set(4, {1, 0.05f, 0}, 2);  // close to group 1 but 2+2+2 > 5: new group
  f.set(5, {0.3f, 1, 0}, 1);   // cos to group 3 ~0.958: joins group 3
  CHECK(f.place(1, 0, &next) == 1);
  CHECK(f.place(2, 0, &next) == 1);
  CHECK(f.place(3, 0, &next) == 2);
  CHECK(f.place(4, 0, &next) == 3);
  CHECK(f.place(5, 0, &next) == 2);
  CHECK(f.tracker.find(1)->members == std::vector<uint64_t>{1, 2});
  CHECK(f.tracker.find(1)->tokens == 4);
  CHECK(f.tracker.find(1)->version == 2);
}

TEST_CASE("the nearest eligible group wins") {
  Fixture f(0.5f, 100);
  uint64_t next = 1;
  f.set(1, {1, 0, 0}, 1);
  f.set(2, {0, 1, 0}, 1);
  CHECK(f.place(1, 0, &next) == 1);
  CHECK(f.place(2, 0, &next) == 2);  // cos 0 < 0.5
  f.set(3, {0.6f, 0.8f, 0}, 1);      // cos 0.6 to g1, 0.8 to g2
  CHECK(f.tracker.find_group(f.emb.at(3).data(), 1) == 2);
  CHECK(f.tracker.find_group(f.emb.at(3).data(), 1, /*exclude=*/2) == 1);
}

TEST_CASE("static after t unchanged steps; any change makes it dynamic") {
  Fixture f(0.9f, 10, 3);
  uint64_t next = 1;
  f.set(1, {1, 0, 0}, 1);
  f.place(1, 5, &next);  // changed at step 5
  CHECK(f.tracker.advance(7).empty());
  CHECK(f.tracker.advance(8) == std::vector<uint64_t>{1});
  CHECK(f.tracker.find(1)->state == GroupState::kStatic);
  CHECK(f.tracker.advance(9).empty());  // only once
  CHECK(f.tracker.touch(1, 9));         // was static
  CHECK(f.tracker.find(1)->state == GroupState::kDynamic);
  CHECK(f.tracker.find(1)->version == 2);
  CHECK_FALSE(f.tracker.touch(1, 10));  // already dynamic
  CHECK(f.tracker.advance(12).empty());
  CHECK(f.tracker.advance(13) == std::vector<uint64_t>{1});
}

TEST_CASE("a group with an un-embedded member stays dynamic") {
  Fixture f(0.9f, 10, 1);
  uint64_t next = 1;
  f.set(1, {1, 0, 0}, 1);
  f.set(2, {1, 0, 0}, 1);
  f.place(1, 0, &next);
  f.place(2, 0, &next);
  f.emb.erase(2);  // member 2 is awaiting a new embedding
  f.tracker.touch(1, 0);
  CHECK(f.tracker.advance(5).empty());
  f.set(2, {1, 0, 0}, 1);
  CHECK(f.tracker.advance(6) == std::vector<uint64_t>{1});
}

TEST_CASE("cosine without a member, removal and drop") {
  Fixture f(0.9f, 10);
  uint64_t next = 1;
  f.set(1, {1, 0, 0}, 1);
  f.set(2, {1, 0.1f, 0}, 1);
  f.place(1, 0, &next);
  f.place(2, 0, &next);
  bool other = false;
  const float moved[3] = {0, 1, 0};
  CHECK(f.tracker.cosine_without(1, 2, moved, &other) == doctest::Approx(0.0f));
  CHECK(other);
  f.tracker.remove_member(1, 2, 1);
  CHECK(f.tracker.cosine_without(1, 1, moved, &other) == 0.0f);
  CHECK_FALSE(other);  // a sole member
  f.tracker.remove_member(1, 1, 1);
  f.tracker.drop(1);
  CHECK(f.tracker.find(1) == nullptr);
  CHECK(f.tracker.find_group(f.emb.at(1).data(), 1) == 0);
}
