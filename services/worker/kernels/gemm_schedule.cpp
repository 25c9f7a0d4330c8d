// Host-side planning of our wgmma products' schedules (gemm_schedule.h).
#include "services/worker/kernels/gemm_schedule.h"

#include <algorithm>
#include <iterator>

namespace keep::kernels {
namespace {

// The modelled overheads, in k steps: a whole tile's pipeline fill and epilogue, a stream-K
// range's hand-over of partials. Lanes run kLaneRate slower; column steps of narrow tiles cost
// more (width_rate). Fitted to test_gemm's times of Qwen2.5-7B's and 14B's products at 1024-4096
// rows on the H200.
constexpr double kTileSteps = 4.0;
constexpr double kFixupSteps = 8.0;
constexpr double kLaneRate = 1.03;
constexpr double width_rate(int bn) { return bn == 160 ? 1.07 : bn == 128 ? 1.08 : 1.0; }

}  // namespace

bool gemm_width_fits(int bn, int64_t outs, bool accumulate) {
  return std::find(std::begin(kGemmWidths), std::end(kGemmWidths), bn) != std::end(kGemmWidths) &&
         (bn != 320 || accumulate) && outs > 0 && outs % bn == 0;
}

// kAuto takes lanes where they keep more of the clusters busy than whole tiles round robin (which
// leave the last wave part idle) and the round robin would idle more than 5 %.
GemmPlan plan_gemm(int64_t tiles_m, int64_t tiles_n, int64_t k_steps, int clusters, bool stream_k,
                   GemmSchedule schedule) {
  GemmPlan p;
  p.tiles_m = static_cast<int>(tiles_m);
  p.tiles_n = static_cast<int>(tiles_n);
  p.k_steps = static_cast<int>(k_steps);
  const int64_t tiles = tiles_m * tiles_n;
  p.clusters = static_cast<int>(std::min<int64_t>(tiles, clusters));  // round robin
  if (tiles == 0 || clusters <= 0) return p;
  const int64_t lanes = clusters / tiles_m;
  if (schedule == GemmSchedule::kDataParallel || !stream_k || lanes == 0) return p;
  // Spare clusters: the most of those left over that divide the row tiles, with as many of the
  // last columns as keep each no busier than a lane (whole tiles cost kTileSteps more).
  int64_t spare = clusters - lanes * tiles_m;
  while (spare > 0 && tiles_m % spare != 0) --spare;
  const int64_t spare_rows = spare > 0 ? tiles_m / spare : 0;
  int64_t spare_cols = spare > 0 ? tiles_n / (spare_rows * lanes + 1) : 0;
  const auto lane_steps = [&](int64_t cols) {
    return double(cols) / double(lanes) * (double(k_steps) + kTileSteps) +
           (cols % lanes != 0 ? kFixupSteps : 0.0);
  };
  while (spare_cols > 0 && double(spare_cols * spare_rows) * (double(k_steps) + kTileSteps) >
                               lane_steps(tiles_n - spare_cols)) {
    --spare_cols;
  }
  if (spare_cols == 0) spare = 0;
  const int64_t lane_cols = tiles_n - spare_cols;
  int64_t sk_cols = 0;
  if (lane_cols % lanes != 0) sk_cols = lane_cols < lanes ? lane_cols : lane_cols % lanes + lanes;
  if (sk_cols * k_steps < 4 * lanes) sk_cols = 0;  // ranges of a few k steps: not worth a fixup
  // Busy share of the clusters' time: round robin, and lanes (whole columns, or balanced).
  const double rr = double(tiles) / double((tiles + clusters - 1) / clusters * clusters);
  const double in_lanes =
      double(lanes * tiles_m + spare) / clusters *
      (sk_cols > 0 ? 1.0 : double(lane_cols) / double((lane_cols + lanes - 1) / lanes * lanes));
  if (schedule == GemmSchedule::kAuto && (rr >= 0.95 || in_lanes <= rr)) return p;
  p.lanes = static_cast<int>(lanes);
  p.sk_cols = static_cast<int>(sk_cols);
  p.spare_cols = static_cast<int>(spare_cols);
  p.spare_rows = static_cast<int>(spare > 0 ? spare_rows : 0);
  p.clusters = static_cast<int>(lanes * tiles_m + spare);
  return p;
}

// Whole tiles cost their k steps plus kTileSteps; a lane's stream-K range costs its share of the k
// steps plus kFixupSteps.
double gemm_modelled_cost(const GemmPlan& p, int bn) {
  if (p.clusters == 0) return 0.0;
  const double steps =
      p.lanes == 0 ? double((int64_t{p.tiles_m} * p.tiles_n + p.clusters - 1) / p.clusters) *
                         (double(p.k_steps) + kTileSteps)
                   : double(p.tiles_n - p.spare_cols) * double(p.k_steps) / p.lanes + kFixupSteps;
  return steps * bn * width_rate(bn) * (p.lanes == 0 ? 1.0 : kLaneRate);
}

int pick_gemm_width(int64_t rows, int64_t outs, int64_t k_steps, bool accumulate, int clusters,
                    bool have_scratch, GemmSchedule schedule, int cluster) {
  int best = 0;
  double best_cost = 0.0;
  for (const int bn : kGemmWidths) {
    if (!gemm_width_fits(bn, outs, accumulate)) continue;
    const GemmPlan p = plan_gemm(gemm_row_tiles(rows, cluster), outs / bn, k_steps, clusters,
                                 have_scratch && gemm_lanes_allowed(bn), schedule);
    const double c = gemm_modelled_cost(p, bn);
    if (best == 0 || c < 0.99 * best_cost) {
      best = bn;
      best_cost = c;
    }
  }
  return best;
}

}  // namespace keep::kernels
