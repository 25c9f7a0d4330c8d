// The schedule of our wgmma products (gemm_wgmma.cu) over the GPU's clusters of 2 SMs: planned on
// the host (plan_gemm, pick_gemm_width), walked by the kernel (GemmPieces). No CUDA here, so that
// CPU tests (tests/unit/test_gemm_schedule.cpp) check the plans and that every cluster's pieces
// cover each tile's k steps exactly once.
//
// Cluster tiles are 256 token rows (two CTAs of 128) x BN product columns: tiles_m x tiles_n of
// them, each of k_steps steps of 64. At 1024 token rows there are few: Qwen2.5-7B's QKV 4 x 18 at
// BN = 256, o_proj and down 4 x 14, 14B's gate/up 4 x 108, on the H200's 66 clusters; dealt whole,
// round robin (rows fastest), the last wave leaves up to 45 % of the clusters idle. So where that
// idles more than 5 % (GemmSchedule::kAuto) the clusters work in lanes: cluster c < lanes * tiles_m
// stays on row tile c % tiles_m, lane c / tiles_m, and the lanes split the columns; a lane's
// clusters walk the same columns and k steps together, so each weight tile comes from memory about
// once and then from L2 (cutting single tiles instead puts the row tiles of one column at different
// k steps, so their weights are read from memory more than once). Of the lanes' columns, those that
// would not fill a wave of lanes (their count % lanes + lanes, or all when there are fewer than
// lanes) are cut by k steps into one equal, contiguous range per lane (stream-K, Osama et al.
// 2023); the rest are dealt whole round robin after that. A lane's range ends with the head (first
// k steps) of a column and may start inside another. The cluster that holds a tile's head finishes
// it: the others (at most one piece per cluster: the tile its range starts in) hand it their fp32
// partial sums (gemm_wgmma.cu).
//
// The clusters no lane takes (clusters % tiles_m: 2 of 66 at 1024 rows, 3 % of the GPU) are spare:
// where some of them divide the row tiles, each takes spare_rows = tiles_m / spare of the row
// tiles of the last spare_cols columns, whole tiles, column by column (the weight tile is read
// again for the next row tile while it is in L2), as many columns as keep it no busier than a lane.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KEEP_GEMM_HD __host__ __device__
#else
#define KEEP_GEMM_HD
#endif

namespace keep::kernels {

// kAuto: lanes with the stream-K share where round robin would leave more than 5 % of the
// clusters' time idle and lanes keep more busy (and scratch is given); kDataParallel: round robin;
// kStreamK: lanes wherever there is scratch and a lane (tests, benchmarks).
enum class GemmSchedule { kAuto, kDataParallel, kStreamK };

constexpr int kGemmTileRows = 128;  // token rows of a CTA's tile
constexpr int kGemmCluster = 2;     // CTAs of a cluster, along the rows
constexpr int kGemmStepK = 64;      // k of a step
// A partial tile in scratch holds up to this many 8-column accumulator blocks per consumer thread
// (a 256-wide tile's): wider tiles go round robin only.
constexpr int kGemmMaxPartialBlocks = 32;
// The tile widths of the plain products (320: gemm_wgmma_accumulate only; gemm_swiglu: 256).
constexpr int kGemmWidths[] = {320, 256, 224, 192, 160, 128};

// Cluster tiles of `rows` token rows, in clusters of `cluster` CTAs (gemm_wgmma.cu runs products
// of at most kGemmTileRows rows in clusters of one).
KEEP_GEMM_HD constexpr int64_t gemm_row_tiles(int64_t rows, int cluster = kGemmCluster) {
  return (rows + int64_t{kGemmTileRows} * cluster - 1) / (int64_t{kGemmTileRows} * cluster);
}
// Whether tiles of width bn can go in lanes with a stream-K share: their partial sums fit a slot.
KEEP_GEMM_HD constexpr bool gemm_lanes_allowed(int bn) { return bn / 8 <= kGemmMaxPartialBlocks; }
// Whether bn is one of kGemmWidths, allowed for the epilogue (320: accumulate only), and divides
// the product's `outs`.
bool gemm_width_fits(int bn, int64_t outs, bool accumulate);

struct GemmPlan {
  int tiles_m = 0, tiles_n = 0, k_steps = 0;  // cluster tiles, k steps a tile
  // lanes == 0: whole tiles dealt round robin to the clusters (rows fastest). lanes > 0: cluster c
  // < lanes * tiles_m in lane c / tiles_m on row tile c % tiles_m; of the first tiles_n -
  // spare_cols columns, the first sk_cols are cut into one k range per lane and the others dealt
  // round robin to the lanes. spare_rows > 0: cluster lanes * tiles_m + s (s < tiles_m /
  // spare_rows) takes row tiles s * spare_rows .. + spare_rows - 1 of the last spare_cols columns.
  int lanes = 0, sk_cols = 0, spare_cols = 0, spare_rows = 0;
  int clusters = 0;  // the grid, in clusters
};

// The schedule of tiles_m x tiles_n cluster tiles of k_steps each on `clusters` clusters (all
// resident at once); stream_k: scratch for the partial tiles is there and the width allows them.
GemmPlan plan_gemm(int64_t tiles_m, int64_t tiles_n, int64_t k_steps, int clusters, bool stream_k,
                   GemmSchedule schedule);

// The modelled time of a plan of bn-wide tiles, in product columns x k steps of its busiest
// cluster (pick_gemm_width compares widths by it).
double gemm_modelled_cost(const GemmPlan& plan, int bn);

// The width for a plain product (accumulate: gemm_wgmma_accumulate's) of `outs` columns, k_steps
// deep, at `rows` token rows on `clusters` clusters of `cluster` CTAs: the cheapest by
// gemm_modelled_cost, a narrower one only where it saves more than 1 %. 0 where no width divides
// outs.
int pick_gemm_width(int64_t rows, int64_t outs, int64_t k_steps, bool accumulate, int clusters,
                    bool have_scratch, GemmSchedule schedule, int cluster = kGemmCluster);

// The work of one cluster, in order (the kernel's producer and consumers walk the same pieces).
// Round robin: tiles cluster, cluster + clusters, ... with the rows fastest. In a lane: the lane's
// stream-K range, then its whole columns round robin, on the cluster's row tile. A spare cluster:
// its row tiles of each spare column in turn. Whole tiles are tile next_tile of `tiles`: row tile
// m + next_tile % per_m, column col0 + next_tile / per_m. One loop over next() in the kernel: a
// loop body inlined at two call sites made ptxas serialize the consumers' wgmma.
struct GemmPieces {
  int64_t i = 0, end = 0;  // the stream-K iterations left: [i, end)
  int k_steps, next_tile, tiles, step, m = 0, per_m = 1, col0 = 0;

  KEEP_GEMM_HD GemmPieces(const GemmPlan& p, int cluster) : k_steps(p.k_steps) {
    if (p.lanes == 0) {
      next_tile = cluster;
      tiles = p.tiles_m * p.tiles_n;
      step = p.clusters;
      per_m = p.tiles_m;
      return;
    }
    const int lane_clusters = p.lanes * p.tiles_m;
    if (cluster >= lane_clusters) {  // spare: no stream-K range
      m = (cluster - lane_clusters) * p.spare_rows;
      per_m = p.spare_rows;
      col0 = p.tiles_n - p.spare_cols;
      next_tile = 0;
      tiles = p.spare_cols * p.spare_rows;
      step = 1;
      return;
    }
    m = cluster % p.tiles_m;
    const int lane = cluster / p.tiles_m;
    i = range_start(p, lane);
    end = range_start(p, lane + 1);
    next_tile = p.sk_cols + lane;
    tiles = p.tiles_n - p.spare_cols;
    step = p.lanes;
  }
  // Where lane l's range of the stream-K iterations starts (l == lanes: where the last ends).
  KEEP_GEMM_HD static int64_t range_start(const GemmPlan& p, int l) {
    return int64_t{p.sk_cols} * p.k_steps * l / p.lanes;
  }
  // The next piece: row tile tm, column tile tn, k steps [kb, ke). False when there is none.
  KEEP_GEMM_HD bool next(int& tm, int& tn, int& kb, int& ke) {
    if (i < end) {
      tm = m;
      tn = static_cast<int>(i / k_steps);
      kb = static_cast<int>(i % k_steps);
      const int64_t left = end - i;
      ke = left < k_steps - kb ? kb + static_cast<int>(left) : k_steps;
      i += ke - kb;
      return true;
    }
    if (next_tile >= tiles) return false;
    tm = m + next_tile % per_m;
    tn = col0 + next_tile / per_m;
    kb = 0;
    ke = k_steps;
    next_tile += step;
    return true;
  }
  // The head of tile (tm, tn), in lane cluster / tiles_m, adds the partials of lanes l =
  // cluster / tiles_m + 1, ... while holds_part(p, l, (tn + 1) * k_steps): the lanes after it whose
  // ranges start inside the tile, each lane's cluster of row tile tm (tm + l * tiles_m).
  KEEP_GEMM_HD static bool holds_part(const GemmPlan& p, int l, int64_t tile_end) {
    return l < p.lanes && range_start(p, l) < tile_end;
  }
};

}  // namespace keep::kernels
