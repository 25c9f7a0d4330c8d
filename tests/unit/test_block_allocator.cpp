#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "shared/kvregion/block_allocator.h"

using keep::Code;
using keep::kv::BlockAllocator;
using keep::kv::FitPolicy;

TEST_CASE("a fresh allocator is one free run") {
  BlockAllocator a(100);
  CHECK(a.free_blocks() == 100);
  CHECK(a.used_blocks() == 0);
  CHECK(a.largest_free_run() == 100);
  CHECK(a.free_runs() == 1);
  CHECK(a.check_invariants());
}

TEST_CASE("allocations are contiguous, disjoint and fill the arena exactly") {
  for (FitPolicy policy : {FitPolicy::kBestFit, FitPolicy::kFirstFit}) {
    BlockAllocator a(10, policy);
    auto x = a.allocate(3);
    auto y = a.allocate(7);
    REQUIRE(x.is_ok());
    REQUIRE(y.is_ok());
    CHECK(*x == 0);
    CHECK(*y == 3);
    CHECK(a.free_blocks() == 0);
    auto z = a.allocate(1);
    REQUIRE_FALSE(z.is_ok());
    CHECK(z.status().code() == Code::kResourceExhausted);
    CHECK(a.check_invariants());
  }
}

TEST_CASE("zero or oversized requests are invalid, not exhaustion") {
  BlockAllocator a(8);
  CHECK(a.allocate(0).status().code() == Code::kInvalidArgument);
  CHECK(a.allocate(9).status().code() == Code::kInvalidArgument);
  CHECK(a.free_blocks() == 8);
}

TEST_CASE("fragmentation: enough free blocks but no run long enough") {
  BlockAllocator a(12);
  std::vector<uint64_t> starts;
  for (int i = 0; i < 6; ++i) starts.push_back(*a.allocate(2));
  // Free every other run: 6 free blocks in three runs of 2.
  for (int i = 0; i < 6; i += 2) REQUIRE(a.free(starts[i], 2).is_ok());
  CHECK(a.free_blocks() == 6);
  CHECK(a.largest_free_run() == 2);
  CHECK(a.free_runs() == 3);
  auto r = a.allocate(3);
  REQUIRE_FALSE(r.is_ok());
  CHECK(r.status().code() == Code::kResourceExhausted);
  CHECK(r.status().message().find("6 of 12 blocks free") != std::string::npos);
  CHECK(r.status().message().find("largest free run 2") != std::string::npos);
  CHECK(a.check_invariants());
}

TEST_CASE("freeing coalesces with both neighbours") {
  BlockAllocator a(9);
  uint64_t x = *a.allocate(3);
  uint64_t y = *a.allocate(3);
  uint64_t z = *a.allocate(3);
  REQUIRE(a.free(x, 3).is_ok());
  REQUIRE(a.free(z, 3).is_ok());
  CHECK(a.free_runs() == 2);
  REQUIRE(a.free(y, 3).is_ok());  // bridges the two
  CHECK(a.free_runs() == 1);
  CHECK(a.largest_free_run() == 9);
  auto all = a.allocate(9);
  REQUIRE(all.is_ok());
  CHECK(*all == 0);
  CHECK(a.check_invariants());
}

TEST_CASE("double free and out-of-range free are refused without changing anything") {
  BlockAllocator a(10);
  uint64_t x = *a.allocate(4);
  REQUIRE(a.free(x, 4).is_ok());
  CHECK(a.free(x, 4).code() == Code::kInvalidArgument);
  CHECK(a.free(x + 1, 1).code() == Code::kInvalidArgument);
  CHECK(a.free(8, 5).code() == Code::kInvalidArgument);
  CHECK(a.free(0, 0).code() == Code::kInvalidArgument);
  CHECK(a.free_blocks() == 10);
  CHECK(a.check_invariants());
  // A partial overlap with the previous free run is caught too.
  BlockAllocator b(10);
  uint64_t p = *b.allocate(5);
  uint64_t q = *b.allocate(5);
  REQUIRE(b.free(p, 5).is_ok());
  CHECK(b.free(4, 3).code() == Code::kInvalidArgument);
  CHECK(b.free(q, 5).is_ok());
  CHECK(b.check_invariants());
}

TEST_CASE("best fit picks the smallest run that fits; first fit the lowest") {
  auto setup = [](BlockAllocator& a) {
    // Runs: [0,5) used-then-freed (5), [5,6) used, [6,8) freed (2), [8,9) used, rest free (11).
    uint64_t r0 = *a.allocate(5);
    (void)*a.allocate(1);
    uint64_t r2 = *a.allocate(2);
    (void)*a.allocate(1);
    REQUIRE(a.free(r0, 5).is_ok());
    REQUIRE(a.free(r2, 2).is_ok());
  };
  BlockAllocator best(20, FitPolicy::kBestFit);
  setup(best);
  CHECK(*best.allocate(2) == 6);
  BlockAllocator first(20, FitPolicy::kFirstFit);
  setup(first);
  CHECK(*first.allocate(2) == 0);
}

TEST_CASE("mark_used rebuilds the state of a known layout") {
  BlockAllocator a(16);
  REQUIRE(a.mark_used(2, 3).is_ok());
  REQUIRE(a.mark_used(10, 6).is_ok());
  CHECK(a.free_blocks() == 7);
  CHECK(a.free_runs() == 2);
  CHECK(a.mark_used(4, 2).code() == Code::kInvalidArgument);   // overlaps used
  CHECK(a.mark_used(15, 2).code() == Code::kInvalidArgument);  // out of bounds
  CHECK(*a.allocate(5) == 5);
  CHECK(a.check_invariants());
}

TEST_CASE("random allocate/free keeps the invariants and never overlaps") {
  for (FitPolicy policy : {FitPolicy::kBestFit, FitPolicy::kFirstFit}) {
    constexpr uint64_t kBlocks = 733;
    BlockAllocator a(kBlocks, policy);
    std::mt19937_64 rng(policy == FitPolicy::kBestFit ? 7 : 19);
    std::vector<std::pair<uint64_t, uint64_t>> live;
    std::vector<int> owner(kBlocks, 0);
    int exhausted = 0;
    for (int step = 0; step < 20000; ++step) {
      if (live.empty() || rng() % 100 < 55) {
        const uint64_t n = 1 + rng() % 19;
        auto r = a.allocate(n);
        if (!r.is_ok()) {
          CHECK(r.status().code() == Code::kResourceExhausted);
          CHECK(a.largest_free_run() < n);
          ++exhausted;
          continue;
        }
        for (uint64_t b = *r; b < *r + n; ++b) {
          REQUIRE(owner[b] == 0);
          owner[b] = 1;
        }
        live.emplace_back(*r, n);
      } else {
        const size_t i = rng() % live.size();
        auto [s, n] = live[i];
        REQUIRE(a.free(s, n).is_ok());
        for (uint64_t b = s; b < s + n; ++b) owner[b] = 0;
        live[i] = live.back();
        live.pop_back();
      }
      if (step % 997 == 0) REQUIRE(a.check_invariants());
    }
    uint64_t used = 0;
    for (auto& [s, n] : live) used += n;
    CHECK(a.used_blocks() == used);
    CHECK(exhausted > 0);  // the workload does fill the arena at times
    for (auto& [s, n] : live) REQUIRE(a.free(s, n).is_ok());
    CHECK(a.free_runs() == 1);
    CHECK(a.free_blocks() == kBlocks);
    CHECK(a.check_invariants());
  }
}
