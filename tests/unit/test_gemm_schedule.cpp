// The schedules of our wgmma products (services/worker/kernels/gemm_schedule.h), on the CPU: every
// cluster's pieces, walked as the kernel walks them, must cover each tile's k steps exactly once,
// with one head per tile that knows exactly the clusters holding the rest (each of those as its
// first piece, so that it raises its flag before it waits for anything: no deadlock); and the plans
// and tile widths for the H200's 66 clusters at Qwen2.5-7B's and 14B's shapes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "services/worker/kernels/gemm_schedule.h"

namespace {

using keep::kernels::GemmPieces;
using keep::kernels::GemmPlan;
using keep::kernels::GemmSchedule;
using keep::kernels::plan_gemm;

// REQUIRE counted only when it fails: the walks below make ~10^8 checks.
#define EXPECT(cond) \
  do {               \
    if (!(cond)) {   \
      REQUIRE(cond); \
    }                \
  } while (false)

struct Piece {
  int cluster, tm, tn, kb, ke;
  bool first;  // the cluster's first piece
};

// Walks every cluster's pieces and checks the plan's invariants; returns the busiest cluster's k
// steps.
int64_t check_plan(const GemmPlan& p, int clusters, bool stream_k) {
  CAPTURE(p.tiles_m);
  CAPTURE(p.tiles_n);
  CAPTURE(p.k_steps);
  CAPTURE(p.lanes);
  CAPTURE(p.sk_cols);
  CAPTURE(p.spare_cols);
  CAPTURE(p.spare_rows);
  CAPTURE(p.clusters);
  EXPECT(p.clusters > 0);
  EXPECT(p.clusters <= clusters);
  if (!stream_k) EXPECT(p.lanes == 0);
  if (p.lanes > 0) {
    EXPECT(p.lanes * p.tiles_m <= p.clusters);
    if (p.spare_rows > 0) {
      EXPECT(p.tiles_m % p.spare_rows == 0);
      EXPECT(p.clusters == p.lanes * p.tiles_m + p.tiles_m / p.spare_rows);
      EXPECT(p.spare_cols > 0);
      EXPECT(p.spare_cols < p.tiles_n);
    } else {
      EXPECT(p.clusters == p.lanes * p.tiles_m);
      EXPECT(p.spare_cols == 0);
    }
  }
  std::map<std::pair<int, int>, std::vector<Piece>> by_tile;
  int64_t busiest = 0;
  // Modelled work (k steps plus 4 for each piece's pipeline fill and epilogue, as plan_gemm
  // counts whole tiles): of the busiest lane cluster and of the busiest spare one.
  int64_t lane_work = 0, spare_work = 0;
  for (int c = 0; c < p.clusters; ++c) {
    GemmPieces pieces(p, c);
    int64_t steps = 0, work = 0;
    bool first = true;
    int partials = 0;
    for (int tm, tn, kb, ke; pieces.next(tm, tn, kb, ke); first = false) {
      EXPECT(tm >= 0);
      EXPECT(tm < p.tiles_m);
      EXPECT(tn >= 0);
      EXPECT(tn < p.tiles_n);
      EXPECT(kb >= 0);
      EXPECT(kb < ke);
      EXPECT(ke <= p.k_steps);
      if (kb > 0) {
        ++partials;
        EXPECT(first);  // a contributor hands its partial over before it waits for anything
      }
      if (p.lanes > 0 && c < p.lanes * p.tiles_m) EXPECT(tm == c % p.tiles_m);
      by_tile[{tm, tn}].push_back({c, tm, tn, kb, ke, first});
      steps += ke - kb;
      work += ke - kb + 4;
    }
    EXPECT(partials <= 1);  // one partial slot a cluster
    busiest = std::max(busiest, steps);
    if (p.lanes > 0) {
      int64_t& w = c < p.lanes * p.tiles_m ? lane_work : spare_work;
      w = std::max(w, work);
    }
  }
  // A spare cluster is never the last to finish (beyond a stream-K fix-up's allowance).
  EXPECT(spare_work <= lane_work + 8);
  EXPECT(by_tile.size() == static_cast<size_t>(p.tiles_m) * p.tiles_n);
  for (auto& [tile, pieces] : by_tile) {
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece& a, const Piece& b) { return a.kb < b.kb; });
    EXPECT(pieces.front().kb == 0);
    for (size_t i = 1; i < pieces.size(); ++i) EXPECT(pieces[i].kb == pieces[i - 1].ke);
    EXPECT(pieces.back().ke == p.k_steps);
    // The head's contributors are exactly the clusters of the other pieces.
    const Piece& head = pieces.front();
    std::set<int> want, got;
    for (size_t i = 1; i < pieces.size(); ++i) want.insert(pieces[i].cluster);
    if (head.ke < p.k_steps) {  // as the kernel finds them
      const int64_t tile_end = int64_t{head.tn + 1} * p.k_steps;
      for (int l = head.cluster / p.tiles_m + 1; GemmPieces::holds_part(p, l, tile_end); ++l) {
        got.insert(head.tm + l * p.tiles_m);
      }
    }
    EXPECT(got == want);
  }
  return busiest;
}

TEST_CASE("every plan covers each tile's k steps once, with its partials handed to the head") {
  int plans = 0, with_spare = 0, with_sk = 0;
  for (const int clusters : {1, 3, 8, 57, 64, 66}) {
    for (int64_t tiles_m = 1; tiles_m <= 17; ++tiles_m) {
      for (const int64_t tiles_n : {1, 2, 5, 17, 33, 34, 66, 108, 148}) {
        for (const int64_t k_steps : {1, 2, 4, 7, 56, 80}) {
          for (const bool stream_k : {false, true}) {
            for (const auto sched :
                 {GemmSchedule::kAuto, GemmSchedule::kDataParallel, GemmSchedule::kStreamK}) {
              const GemmPlan p = plan_gemm(tiles_m, tiles_n, k_steps, clusters, stream_k, sched);
              if (sched == GemmSchedule::kDataParallel) CHECK(p.lanes == 0);
              check_plan(p, clusters, stream_k && sched != GemmSchedule::kDataParallel);
              ++plans;
              with_spare += p.spare_rows > 0;
              with_sk += p.sk_cols > 0;
            }
          }
        }
      }
    }
  }
  // The grid above reaches every kind of plan.
  CHECK(with_spare > 100);
  CHECK(with_sk > 100);
  MESSAGE(plans << " plans, " << with_spare << " with spare clusters, " << with_sk
                << " with a stream-K share");
}

TEST_CASE("spare clusters take the last columns of the row tiles the lanes leave them") {
  // Qwen2.5-14B's gate/up at 1024 rows on the H200: 4 row tiles x 108 columns of 80 k steps.
  // 16 lanes take 64 clusters; the other 2 take 2 row tiles each of the last 3 columns.
  const GemmPlan p = plan_gemm(4, 108, 80, 66, true, GemmSchedule::kAuto);
  CHECK(p.lanes == 16);
  CHECK(p.spare_rows == 2);
  CHECK(p.spare_cols == 3);
  CHECK(p.sk_cols == 105 % 16 + 16);
  CHECK(p.clusters == 66);
  // The busiest cluster: 105 columns over 16 lanes (6.56 columns of 80 steps, 525 steps) against
  // 108 / 16 (540) without the spare clusters.
  CHECK(check_plan(p, 66, true) == 525);
  GemmPieces spare(p, 65);  // the second spare cluster: row tiles 2 and 3, columns 105-107
  std::vector<std::pair<int, int>> walk;
  for (int tm, tn, kb, ke; spare.next(tm, tn, kb, ke);) {
    CHECK(kb == 0);
    CHECK(ke == 80);
    walk.emplace_back(tm, tn);
  }
  CHECK(walk == std::vector<std::pair<int, int>>{
                    {2, 105}, {3, 105}, {2, 106}, {3, 106}, {2, 107}, {3, 107}});
  // 5 row tiles (1280 rows): 13 lanes, one spare cluster for all five.
  const GemmPlan five = plan_gemm(5, 108, 80, 66, true, GemmSchedule::kAuto);
  CHECK(five.lanes == 13);
  CHECK(five.spare_rows == 5);
  CHECK(five.spare_cols == 1);
  // No spare clusters where none are left (3 row tiles: 22 lanes) or where round robin fills the
  // waves (kAuto: Qwen2.5-7B's gate/up at 1024 rows, 4 x 148 tiles, 8.97 waves).
  CHECK(plan_gemm(3, 108, 80, 66, true, GemmSchedule::kAuto).spare_rows == 0);
  const GemmPlan rr = plan_gemm(4, 148, 56, 66, true, GemmSchedule::kAuto);
  CHECK(rr.lanes == 0);
  CHECK(rr.clusters == 66);
  // Without scratch: round robin.
  CHECK(plan_gemm(4, 108, 80, 66, false, GemmSchedule::kAuto).lanes == 0);
}

TEST_CASE("the tile widths picked on the H200's 66 clusters") {
  // Whole waves of cluster tiles at 1024 rows for Qwen2.5-14B's o_proj/down (5120 = 16 x 320:
  // one wave), its QKV (7168 = 32 x 224: two) and 7B's o_proj (3584 = 16 x 224: one); 7B's QKV in
  // lanes of 192 (24 columns); 256 where nothing else saves 1 % (14B's QKV at 4096 rows: 16 x 28
  // tiles, 6.8 waves); 320 is accumulate-only.
  const struct {
    int64_t rows, out, in;
    bool acc;
    int want;
  } picks[] = {{1024, 5120, 5120, true, 320},  {1024, 5120, 13824, true, 320},
               {1024, 7168, 5120, false, 224}, {1024, 3584, 3584, true, 224},
               {1024, 4608, 3584, false, 192}, {4096, 7168, 5120, false, 256},
               {1024, 5120, 5120, false, 256}, {1, 512, 576, false, 128}};
  for (const auto& p : picks) {
    CAPTURE(p.rows);
    CAPTURE(p.out);
    CAPTURE(p.in);
    CHECK(keep::kernels::pick_gemm_width(p.rows, p.out, p.in / keep::kernels::kGemmStepK, p.acc, 66,
                                         true, GemmSchedule::kAuto) == p.want);
  }
  // At most 128 rows: one-CTA clusters, 132 of them, one row tile; 14B's gate/up-sized 27648 /
  // 256 = 108 columns of 80 k steps all cut among the 132 (no column fills a wave).
  CHECK(keep::kernels::gemm_row_tiles(128, 1) == 1);
  CHECK(keep::kernels::gemm_row_tiles(129, 1) == 2);
  CHECK(keep::kernels::gemm_row_tiles(129) == 1);
  const GemmPlan few =
      plan_gemm(keep::kernels::gemm_row_tiles(128, 1), 108, 80, 132, true, GemmSchedule::kAuto);
  CHECK(few.lanes == 132);
  CHECK(few.sk_cols == 108);
  CHECK(check_plan(few, 132, true) == (108 * 80 + 131) / 132);  // 66 k steps the busiest
  CHECK(keep::kernels::pick_gemm_width(128, 5120, 13824 / keep::kernels::kGemmStepK, true, 132,
                                       true, GemmSchedule::kAuto, 1) > 0);
  // Nothing divides 100 columns; 320 is not taken for a bf16 product.
  CHECK(keep::kernels::pick_gemm_width(1024, 100, 8, false, 66, true, GemmSchedule::kAuto) == 0);
  CHECK(!keep::kernels::gemm_width_fits(320, 640, false));
  CHECK(keep::kernels::gemm_width_fits(320, 640, true));
  CHECK(!keep::kernels::gemm_width_fits(96, 384, true));
}

}  // namespace
