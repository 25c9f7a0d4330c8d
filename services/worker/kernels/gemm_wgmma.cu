// Our own bf16 matrix products for Hopper (gemm.h gemm_wgmma, gemm_wgmma_accumulate,
// gemm_swiglu): one warp-specialized, persistent wgmma kernel fed by TMA, with three epilogues:
//   kStore       y = bf16(x W^T)                        (QKV)
//   kAccumulate  y (fp32) += x W^T                      (o_proj, down: into the residual stream)
//   kSwiglu      act = bf16(silu(x Wg^T) * (x Wu^T))    (gate/up: the product never goes to memory)
//
// The main loop:
//  - Tile: 128 token rows x BN product columns, k steps of 64; BN is 256 for kSwiglu and one of
//    128-256 (and 320 for kAccumulate) for the plain products (Width, pick_gemm_width). A stage
//    holds x's 128 x 64 box and two BN/2 x 64 weight boxes (48 KiB at BN = 256), as many stages as
//    fit (4 at 256), all 128-byte swizzled (wgmma.cuh's layout). The weight boxes are W rows n0..
//    and n0 + BN/2.. (kStore, kAccumulate: BN consecutive outputs) or the gate rows n0.. and the up
//    rows inter + n0.. (kSwiglu: 128 outputs).
//  - Clusters of 2 CTAs along the rows: both need the same weight tile, so each loads one of its
//    two boxes and multicasts it to both (half the weight traffic from L2). Products of at most
//    128 rows (one CTA's tile: a KEEP request's query-only layers, short prefills) run in
//    clusters of one CTA that loads both boxes itself: a pair's second CTA would only multiply
//    zeros there, which made those products compute-bound at half the GPU's rate where the weights'
//    bytes are the limit.
//  - Warpgroup 0 is the producer (one thread issues the loads); warpgroups 1 and 2 each run
//    m64nBNk16 over 64 rows of the tile, releasing a stage (in both CTAs) once its products are
//    done. A stage is refilled only when both CTAs' consumers released it.
//
// The schedule (gemm_schedule.h: whole tiles round robin, or lanes with a stream-K share and
// spare clusters). A stream-K tile's head finishes it: the clusters whose ranges hold the rest of
// its k steps (at most one piece each: the tile its range starts in) write their fp32 partial sums
// to scratch memory and raise a flag; the head's cluster waits for the flags, adds the partials in
// lane order (the result does not depend on timing) and runs the epilogue. A contributor raises
// its flag before it waits for anything, and every cluster of the grid is resident at once (the
// grid is at most the occupancy query's clusters), so the waits end. The flags are zero before a
// launch and zero after it (the finishing cluster clears them): scratch is zeroed once when
// allocated.
//
// fp32 accumulation (stream-K partials included), one rounding to bf16 at the end (kStore,
// kSwiglu); kAccumulate adds the fp32 sums to y in fp32. silu(g) = g * sigmoid(g) = h + h *
// tanh(h) with h = g / 2, on the hardware's approximate tanh (one MUFU operation; max relative
// error 2^-11, a quarter of bf16's rounding step; exactly 0 and g at the saturated ends): one MUFU
// operation instead of expf and a division in an epilogue that is a visible share of a tile's
// time (benchmarks/RESULTS.md run 10).
#include <algorithm>
#include <cstdint>
#include <iterator>

#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/gemm.h"
#include "services/worker/kernels/gemm_schedule.h"
#include "services/worker/kernels/kernels.h"
#include "services/worker/kernels/tma.cuh"
#include "services/worker/kernels/tma_map.h"
#include "services/worker/kernels/wgmma.cuh"

namespace keep::kernels {
namespace {

using bf16 = __nv_bfloat16;

enum class Epilogue { kStore, kAccumulate, kSwiglu };

constexpr int kBM = kGemmTileRows;  // token rows per CTA tile
constexpr int kBK = kGemmStepK;     // k per stage: one 128-byte swizzled row of bf16
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kBoxBytes = kBM * kBK * 2;  // x's 128-row box of a stage
constexpr int kOutBytes = kBM * 128 * 2;  // 128 staged bf16 output columns
constexpr int kPanelBytes = kBM * 128;    // 64 output columns of the staging
constexpr int kSmemBudget = 227 * 1024;   // the H100/H200's opt-in limit per block
// A CTA's partial tile in scratch: per consumer warpgroup, up to kGemmMaxPartialBlocks
// accumulator blocks of float4 per thread (a 256-wide tile's; 320-wide tiles are dealt whole only).
constexpr int kMaxPartialBlocks = kGemmMaxPartialBlocks;
constexpr size_t kPartialBytes = size_t{kConsumers} * kMaxPartialBlocks * 128 * 16;

// The tile widths (product columns of a CTA tile; kSwiglu: 256 = 128 gate + 128 up columns, the
// only width it takes). Other widths than 256 let a product's columns divide into whole waves of
// the GPU's clusters: Qwen2.5-14B's o_proj and down (5120 outputs) are 20 tiles of 256 but 16 of
// 320 or 32 of 160, its QKV (7168) 28 of 256 but 32 of 224; at 1024 rows (4 cluster row tiles)
// that is 80 or 112 cluster tiles on 66 clusters (1.2 and 1.7 waves) against 64 (0.97) or 128
// (1.94).
template <Epilogue E, int BN>
struct Width {
  static_assert(BN % 32 == 0 && BN >= 128 && BN <= 320, "wgmma_ss's widths");
  static_assert(E != Epilogue::kSwiglu || BN == 256, "gemm_swiglu's tiles are 128 + 128 wide");
  static constexpr int kWeightRows = BN / 2;  // each CTA of the pair loads and multicasts a half
  static constexpr int kStageBytes = kBoxBytes + BN * kBK * 2;
  // The bf16 epilogues' staging (kAccumulate adds from registers and has none).
  static constexpr int kOut = E == Epilogue::kAccumulate ? 0 : kOutBytes;
  // As many stages as fit beside the staging and the barriers: with staging 4 for 192-256, 5 for
  // 160, 6 for 128, 3 for 320 (4 without).
  static constexpr int kStages = std::min(6, (kSmemBudget - kOut - 2048) / kStageBytes);
  static constexpr int kSmemBytes = kStages * kStageBytes + kOut + 2 * kStages * 8 + 1024;
  static_assert(kStageBytes % 1024 == 0 && (kBoxBytes + kWeightRows * kBK * 2) % 1024 == 0,
                "swizzled boxes start 1024-byte aligned");
  static_assert(kSmemBytes <= kSmemBudget, "shared memory");
};
// 320 (two m64n160k16 a k16 step, 160 accumulators a thread) is kAccumulate's only (kGemmWidths):
// kStore's staging epilogue made ptxas serialize its wgmma at that width.
// Registers: the consumers' 128 accumulators per thread need the producer's share.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536, "registers");

struct Maps {
  CUtensorMap x;       // (rows, in), box 64 x 128
  CUtensorMap w;       // (out or 2 * inter, in), box 64 x BN / 2
  CUtensorMap y;       // kStore, kSwiglu: y or act (rows, out or inter) bf16, box 64 x 128
  CUtensorMap y_tail;  // kStore with BN % 64 == 32: y in boxes of 32 x 128 (64-byte swizzle)
};

struct Args {
  float* y32;          // kAccumulate: (rows, y_stride) fp32
  int64_t y_stride;    // kAccumulate
  float4* partials;    // stream-K: (clusters, kCluster) partial tiles, or null
  unsigned* flags;     // stream-K: (clusters, kCluster), zero between launches
  int rows, outs, in;  // outs: product outputs (kSwiglu: inter)
  GemmPlan plan;       // the schedule (the grid is plan.clusters clusters)
};

// Product outputs per column tile (kSwiglu: 128 gate and 128 up columns make 128 outputs).
template <Epilogue E, int BN>
constexpr int kTileOuts = E == Epilogue::kSwiglu ? BN / 2 : BN;

__device__ __forceinline__ void flag_release(unsigned* flag) {
#ifdef KEEP_WGMMA_ASM
  __threadfence();
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(1u) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void flag_acquire(const unsigned* flag) {
#ifdef KEEP_WGMMA_ASM
  unsigned v = 0;
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  } while (v == 0);
#else
  __trap();
#endif
}

// tanh(x) on the SFU (tanh.approx.f32: max relative error 2^-10.987).
__device__ __forceinline__ float tanh_approx(float x) {
#ifdef KEEP_WGMMA_ASM
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return tanhf(x);
#endif
}

// p[0] += a, p[1] += b as one vector reduction in L2 (p 8-byte aligned).
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#ifdef KEEP_WGMMA_ASM
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  __trap();
#endif
}

// CL: CTAs of a cluster (2: along the rows, the weight boxes multicast; 1: rows <= kBM).
template <Epilogue E, int BN, int CL>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_wgmma_kernel(const __grid_constant__ Maps maps, const Args args) {
  namespace d = detail;
  using W = Width<E, BN>;
  constexpr int kStages = W::kStages;
  constexpr int kStageBytes = W::kStageBytes;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Swizzled boxes need 1024-byte alignment.
  unsigned char* smem = smem_raw + ((1024 - (d::smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* out_tile = smem + kStages * kStageBytes;
  auto* full = reinterpret_cast<uint64_t*>(out_tile + W::kOut);  // stage loaded
  uint64_t* empty = full + kStages;                              // stage free in both CTAs
  const int wg = static_cast<int>(threadIdx.x) / 128;
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const uint32_t rank = d::cluster_rank();
  const GemmPlan& plan = args.plan;
  constexpr int kCluster = CL;
  static_assert(CL == 1 || CL == 2, "clusters of one or two CTAs");
  const int cluster = static_cast<int>(blockIdx.x) / kCluster;
  const int k_steps = plan.k_steps;
  // Row tile tm's first row for this CTA, column tile tn's first output column.
  const auto row0 = [&](int tm) { return (tm * kCluster + static_cast<int>(rank)) * kBM; };
  const auto col0 = [&](int tn) { return tn * kTileOuts<E, BN>; };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      d::mbar_init(&full[s], 1);
      d::mbar_init(&empty[s], kConsumers * kCluster);
    }
    d::mbar_init_fence();
  }
  d::cluster_sync();  // the peer's barriers are ready before anything is multicast to them
  d::allow_next_grid();

  if (wg == 0) {
    d::setmaxnreg_dec<kProducerRegs>();
    if (tid == 0) {
      // This CTA's weight box of a tile: the tile's first or second BN / 2 rows of W (the gate's
      // or the up's 128 rows for kSwiglu).
      const auto w_row = [&](int n0) {
        return E == Epilogue::kSwiglu ? (rank == 0 ? 0 : args.outs) + n0
                                      : n0 + static_cast<int>(rank) * W::kWeightRows;
      };
      // (One CTA: both boxes, box b at the offset and rows the pair's CTA of rank b takes.)
      const auto load_w = [&](int s, int k, int n0) {
        if constexpr (CL == 2) {
          d::tma_load_2d_multicast(
              smem + s * kStageBytes + kBoxBytes + rank * (W::kWeightRows * kBK * 2), &maps.w,
              &full[s], k * kBK, w_row(n0), static_cast<uint16_t>((1u << kCluster) - 1));
        } else {
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int row =
                E == Epilogue::kSwiglu ? (b == 0 ? 0 : args.outs) + n0 : n0 + b * W::kWeightRows;
            d::tma_load_2d(smem + s * kStageBytes + kBoxBytes + b * (W::kWeightRows * kBK * 2),
                           &maps.w, &full[s], k * kBK, row);
          }
        }
      };
      // The weights are no kernel's output: the first kStages steps' boxes are requested before
      // the wait for the previous kernel, so that their latency overlaps its last blocks.
      int it = 0;  // k steps over all of this CTA's pieces; stage it % kStages
      {
        GemmPieces pieces(plan, cluster);
        for (int tm, tn, kb, ke; it < kStages && pieces.next(tm, tn, kb, ke);) {
          for (int k = kb; k < ke && it < kStages; ++k, ++it) {
            d::mbar_arrive_expect_tx(&full[it], kStageBytes);
            load_w(it, k, col0(tn));
          }
        }
      }
      const int early = it;
      d::wait_previous_grid();  // x is the previous kernel's output
      it = 0;
      GemmPieces pieces(plan, cluster);
      for (int tm, tn, kb, ke; pieces.next(tm, tn, kb, ke);) {
        const int m0 = row0(tm), n0 = col0(tn);
        for (int k = kb; k < ke; ++k, ++it) {
          const int s = it % kStages;
          if (it >= early) {
            if (it >= kStages) d::mbar_wait(&empty[s], ((it / kStages) - 1) & 1);
            d::mbar_arrive_expect_tx(&full[s], kStageBytes);
            load_w(s, k, n0);
          }
          d::tma_load_2d(smem + s * kStageBytes, &maps.x, &full[s], k * kBK, m0);
        }
      }
    } else {
      d::wait_previous_grid();
    }
    __syncwarp();
  } else {
    // y and the stream-K scratch: the previous kernels may still use them.
    d::wait_previous_grid();
    d::setmaxnreg_inc<kConsumerRegs>();
    const int c = wg - 1;  // this warpgroup's 64 rows of the tile
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const bool issuer = c == 0 && tid == 0;  // issues the epilogue's stores, raises flags
    // This warpgroup is done with stage s: one arrival on its barrier in every CTA of the
    // cluster (the producers of both fill it).
    const auto release = [&](int s) {
      if (tid != 0) return;
#pragma unroll
      for (int r = 0; r < kCluster; ++r) {
        d::mbar_arrive_cluster(&empty[s], static_cast<uint32_t>(r));
      }
    };
    // This CTA's partial-tile slot of cluster `cl`; this thread's float4 of block n: [n * 128].
    const auto partial = [&](int cl) {
      return args.partials +
             ((static_cast<size_t>(cl) * kCluster + rank) * kConsumers + c) * kMaxPartialBlocks *
                 128 +
             tid;
    };
    int it = 0;
    GemmPieces pieces(plan, cluster);
    for (int tm, tn, kb, ke; pieces.next(tm, tn, kb, ke);) {
      const int m0 = row0(tm), n0 = col0(tn);
      constexpr int kBlocks = BN / 8;  // 8-column accumulator blocks
      float acc[kBlocks][4];
#pragma unroll
      for (int n = 0; n < kBlocks; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
      // A piece has at least one k step: with a loop that may run zero times the zeroed
      // accumulators could reach the epilogue, and ptxas then serializes the wgmma.
      for (int k = kb;;) {
        const int s = it % kStages;
        d::mbar_wait(&full[s], (it / kStages) & 1);
        unsigned char* stage = smem + s * kStageBytes;
        // A: this warpgroup's 64 rows of x's box; B: the two weight boxes, one BN-row K-major
        // operand (8-row groups 1024 bytes apart throughout).
        const uint64_t da = d::wgmma_desc_sw128(stage + c * (64 * 128), 16, 1024);
        const uint64_t db = d::wgmma_desc_sw128(stage + kBoxBytes, 16, 1024);
        d::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          d::wgmma_ss<BN>(acc, d::wgmma_desc_add(da, kk * 32), d::wgmma_desc_add(db, kk * 32), 1);
        }
        d::wgmma_commit();
        d::wgmma_wait<1>();  // the previous step's products are done: free its stage
        if (k > kb) release((it - 1) % kStages);
        ++it;
        if (++k >= ke) break;
      }
      d::wgmma_wait<0>();
      d::wgmma_fence_operands(acc);
      release((it - 1) % kStages);  // the piece's last stage

      // (Pieces of tiles wider than a partial slot never start or end inside a tile.)
      constexpr bool kPartials = gemm_lanes_allowed(BN);
      if (kPartials && kb > 0) {
        // Not the tile's head: hand the partial sums to the cluster that finishes the tile.
        float4* p = partial(cluster);
#pragma unroll
        for (int n = 0; n < kBlocks; ++n) {
          __stcg(p + n * 128, make_float4(acc[n][0], acc[n][1], acc[n][2], acc[n][3]));
        }
        d::named_barrier(2, 128 * kConsumers);  // every consumer thread's stores are issued
        if (issuer) flag_release(&args.flags[cluster * kCluster + rank]);
        continue;
      }
      if (kPartials && ke < k_steps) {
        // The head of a tile cut into ranges: add the partials of the clusters that hold the
        // rest of its k steps, in lane order.
        const int64_t tile_end = int64_t{tn + 1} * k_steps;
        for (int l = cluster / plan.tiles_m + 1; GemmPieces::holds_part(plan, l, tile_end); ++l) {
          const int cl = tm + l * plan.tiles_m;  // the same row tile in lane l
          if (issuer) flag_acquire(&args.flags[cl * kCluster + rank]);
          d::named_barrier(2, 128 * kConsumers);
          const float4* p = partial(cl);
#pragma unroll
          for (int n = 0; n < kBlocks; ++n) {
            const float4 v = __ldcg(p + n * 128);
            acc[n][0] += v.x;
            acc[n][1] += v.y;
            acc[n][2] += v.z;
            acc[n][3] += v.w;
          }
          // Cleared for the next launch once every consumer thread has read the slot (the
          // barrier before the next slot's or the epilogue's, and the kernel's end, order it).
          if (issuer) args.flags[cl * kCluster + rank] = 0;
        }
      }

      // acc[n][e + 2h]: row 16 warp + g + 8h of this warpgroup's 64, product column 8n + 2t + e.
      if constexpr (E == Epilogue::kAccumulate) {
        // y += acc straight from registers, with reductions in L2 (red.add: each y element gets
        // exactly one, from this thread, so the sum is y + acc rounded once, as a load, add and
        // store would give, without waiting for the load). A warp's reductions of one block n
        // cover 8 rows x 32 contiguous bytes.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // A row past the end adds zeros to the last row instead: no branch around the
          // reductions (a branch there, or predicated reductions, made ptxas serialize the wgmma
          // of 320-wide tiles). x + -0 is x, -0 included, whatever the order.
          const int r = m0 + 64 * c + 16 * warp + g + 8 * h;
          const bool in_rows = r < args.rows;
          float* yr = args.y32 + static_cast<int64_t>(in_rows ? r : args.rows - 1) * args.y_stride +
                      n0 + 2 * t;
#pragma unroll
          for (int n = 0; n < kBlocks; ++n) {
            red_add2(yr + 8 * n, in_rows ? acc[n][2 * h] : -0.0f,
                     in_rows ? acc[n][2 * h + 1] : -0.0f);
          }
        }
      } else {
        // Staged in shared memory as bf16 (64-column swizzled panels of up to 128 columns), then
        // written by TMA stores, which drop rows past the end. kSwiglu: column j of the gate half
        // and column j of the up half sit in the same thread (blocks n and n + 16): one pass of
        // act = silu(gate) * up. kStore: passes of 128 columns (faster than bf16 pairs stored from
        // registers, 8 rows x 16 bytes per warp access); a width with 32 columns
        // over whole panels (160, 224) ends on a 32-column panel of 64-byte rows, stored through
        // y_tail (64-byte swizzle: chunk c of row r at c ^ ((r / 2) % 4), conflict-free too).
        constexpr int kPasses = E == Epilogue::kSwiglu ? 1 : (BN + 127) / 128;
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
          const int cols = E == Epilogue::kSwiglu || BN - 128 * pass >= 128 ? 128 : BN - 128 * pass;
          if (issuer) d::bulk_wait_read<0>();  // earlier stores have read the staging
          d::named_barrier(1, 128 * kConsumers);
#pragma unroll
          for (int n = 0; n < 16; ++n) {
            if (8 * n >= cols) break;
            const int col = 8 * n + 2 * t;  // staged column (and + 1)
            const int panel = col / 64, chunk = (col % 64) / 8;
            const bool tail = cols - 64 * panel == 32;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int r = 64 * c + 16 * warp + g + 8 * h;
              float a[2];
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                if constexpr (E == Epilogue::kSwiglu) {
                  const float gate = acc[n][2 * h + e], up = acc[n + 16][2 * h + e];
                  const float half = 0.5f * gate;
                  a[e] = fmaf(half, tanh_approx(half), half) * up;
                } else {
                  a[e] = acc[n + 16 * pass][2 * h + e];
                }
              }
              const int at = tail ? r * 64 + ((chunk % 4) ^ ((r / 2) % 4)) * 16
                                  : r * 128 + (chunk ^ (r % 8)) * 16;
              *reinterpret_cast<__nv_bfloat162*>(out_tile + panel * kPanelBytes + at +
                                                 (col % 8) * 2) = __floats2bfloat162_rn(a[0], a[1]);
            }
          }
          d::fence_proxy_async_shared();  // the staging is read by the TMA (async proxy)
          d::named_barrier(1, 128 * kConsumers);
          if (issuer) {
#pragma unroll
            for (int p = 0; p < 2; ++p) {
              if (64 * p >= cols) break;
              d::tma_store_2d(cols - 64 * p == 32 ? &maps.y_tail : &maps.y,
                              out_tile + p * kPanelBytes, n0 + 128 * pass + 64 * p, m0);
            }
            d::bulk_commit();
          }
        }
      }
    }
    if (issuer) d::bulk_wait<0>();
  }
  d::cluster_sync();  // no CTA leaves while its peer may still arrive on its barriers
}

// A (rows, cols) bf16 matrix with row stride `ld` elements, read or written in boxes of 64 (or
// 32) columns x box_rows rows.
bool encode(CUtensorMap* map, const bf16* p, int64_t rows, int64_t cols, int64_t ld,
            uint32_t box_rows = 128, uint32_t box_cols = 64) {
  return detail::encode_bf16_map(map, p, rows, cols, ld, box_rows, box_cols);
}

// The kernel's launch configuration: `grid` CTAs in clusters of `cluster` along x.
// With `dependent`, a programmatic dependent launch (common.cuh) where kernels::dependent_launch().
struct Launch {
  cudaLaunchAttribute attr[2] = {};
  cudaLaunchConfig_t cfg{};
  Launch(unsigned grid, int cluster, int smem_bytes, cudaStream_t stream, bool dependent) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs =
        1 + (dependent ? detail::dependent_launch_attribute(attr[1], detail::dependent_launch_on())
                       : 0u);
  }
  Launch(const Launch&) = delete;  // cfg points at attr
  Launch& operator=(const Launch&) = delete;
};

// Per device, epilogue, width and cluster size: the kernel's shared-memory limit raised, and how
// many clusters fit at once (0: the kernel cannot run there; asked again on the next call).
template <Epilogue E, int BN, int CL = kGemmCluster>
int max_clusters(int device) {
  static detail::DeviceMemo memo;
  return memo.get(device, [](int d) {
    const std::pair<int, bool> none{0, false};
    if (cudaFuncSetAttribute(gemm_wgmma_kernel<E, BN, CL>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Width<E, BN>::kSmemBytes) != cudaSuccess) {
      return none;
    }
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d) != cudaSuccess) return none;
    const Launch launch(static_cast<unsigned>(sms - sms % CL), CL, Width<E, BN>::kSmemBytes,
                        nullptr, false);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, gemm_wgmma_kernel<E, BN, CL>, &launch.cfg) !=
            cudaSuccess ||
        clusters <= 0) {
      return none;
    }
    return std::pair<int, bool>{clusters, true};
  });
}

// The stream-K share's scratch for `ctas` CTAs: a partial tile each, then a flag each.
size_t scratch_bytes_for(int ctas) {
  return static_cast<size_t>(ctas) * (kPartialBytes + sizeof(unsigned));
}

// How many CTAs' partial tiles and flags `scratch` holds.
size_t scratch_ctas(const GemmScratch& scratch) {
  return scratch.ptr == nullptr ? 0 : scratch.bytes / (kPartialBytes + sizeof(unsigned));
}

// Whether `scratch` holds the stream-K share's partial tiles and flags for `ctas` CTAs.
bool scratch_fits(const GemmScratch& scratch, int ctas) {
  return scratch_ctas(scratch) >= static_cast<size_t>(ctas);
}

// CTAs a cluster for `rows` rows: one where a CTA's tile holds them all.
constexpr int cluster_for(int64_t rows) { return rows <= kBM ? 1 : kGemmCluster; }

template <Epilogue E, int BN, int CL>
cudaError_t launch(const Maps& maps, Args args, int device, const GemmScratch& scratch,
                   GemmSchedule schedule, cudaStream_t stream, int max_ctas) {
  int clusters = max_clusters<E, BN, CL>(device);
  if (clusters <= 0) return cudaErrorNotSupported;
  if (max_ctas > 0) clusters = std::max(1, std::min(clusters, max_ctas / CL));
  // Partial tiles hold up to kMaxPartialBlocks accumulator blocks: wider tiles go round robin.
  // The flags sit after the partial tiles of as many CTAs as the scratch holds, wherever this
  // launch's grid ends: a smaller grid (max_ctas) must not read a larger one's partials as flags.
  const bool have_scratch = gemm_lanes_allowed(BN) && scratch_fits(scratch, clusters * CL);
  args.partials = have_scratch ? static_cast<float4*>(scratch.ptr) : nullptr;
  args.flags = have_scratch ? reinterpret_cast<unsigned*>(static_cast<unsigned char*>(scratch.ptr) +
                                                          scratch_ctas(scratch) * kPartialBytes)
                            : nullptr;
  args.plan = plan_gemm(gemm_row_tiles(args.rows, CL), args.outs / kTileOuts<E, BN>, args.in / kBK,
                        clusters, have_scratch, schedule);
  const Launch launch(static_cast<unsigned>(args.plan.clusters * CL), CL, Width<E, BN>::kSmemBytes,
                      stream, true);
  return cudaLaunchKernelEx(&launch.cfg, gemm_wgmma_kernel<E, BN, CL>, maps, args);
}

template <Epilogue E, int BN>
cudaError_t launch(const Maps& maps, const Args& args, int device, const GemmScratch& scratch,
                   GemmSchedule schedule, cudaStream_t stream, int max_ctas) {
  return cluster_for(args.rows) == 1
             ? launch<E, BN, 1>(maps, args, device, scratch, schedule, stream, max_ctas)
             : launch<E, BN, kGemmCluster>(maps, args, device, scratch, schedule, stream, max_ctas);
}

// One product: checks (cudaErrorInvalidValue), then the width, the maps and the launch. `outs` is
// the product's outputs (kSwiglu: inter; W then has 2 * inter rows); y is bf16 (kStore, kSwiglu:
// TMA stores, 16-byte aligned, stride a multiple of 8) or fp32 (kAccumulate: 8-byte pairs).
// tile_cols: the width (kStore, kAccumulate; 0: pick_gemm_width's).
template <Epilogue E>
cudaError_t run(void* y, int64_t y_stride, const bf16* x, int64_t x_stride, const bf16* w,
                int64_t rows, int64_t outs, int64_t in, const GemmScratch& scratch,
                cudaStream_t stream, GemmSchedule schedule, int tile_cols = 0, int max_ctas = 0) {
  constexpr bool kF32 = E == Epilogue::kAccumulate;
  constexpr bool kSwiglu = E == Epilogue::kSwiglu;
  const int64_t w_rows = kSwiglu ? 2 * outs : outs;
  if (rows < 0 || rows > INT32_MAX || outs <= 0 || in <= 0 || in % kBK != 0 || w_rows > INT32_MAX ||
      in > INT32_MAX || y_stride < outs || x_stride < in || x_stride % 8 != 0 ||
      y_stride % (kF32 ? 2 : 8) != 0) {
    return cudaErrorInvalidValue;
  }
  if (kSwiglu ? outs % 128 != 0 || (tile_cols != 0 && tile_cols != 256)
              : !gemm_wgmma_fits(outs, in) ||
                    (tile_cols != 0 && !gemm_width_fits(tile_cols, outs, kF32))) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (y == nullptr || x == nullptr || w == nullptr ||
      reinterpret_cast<uintptr_t>(y) % (kF32 ? 8 : 16) != 0 || !detail::aligned16(x) ||
      !detail::aligned16(w)) {
    return cudaErrorInvalidValue;
  }
  if (!wgmma_available() || detail::tensor_map_encoder() == nullptr) return cudaErrorNotSupported;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  int bn = 256;
  if (!kSwiglu && tile_cols == 0) {
    // Every width's kernel has the same occupancy (one CTA an SM): the widest's answer serves.
    const int cl = cluster_for(rows);
    int clusters =
        cl == 1 ? max_clusters<E, 256, 1>(device) : max_clusters<E, 256, kGemmCluster>(device);
    if (clusters <= 0) return cudaErrorNotSupported;
    if (max_ctas > 0) clusters = std::max(1, std::min(clusters, max_ctas / cl));
    bn = pick_gemm_width(rows, outs, in / kBK, kF32, clusters, scratch_fits(scratch, clusters * cl),
                         schedule, cl);
  } else if (!kSwiglu) {
    bn = tile_cols;
  }
  Maps maps;
  if (!encode(&maps.x, x, rows, in, x_stride) ||
      !encode(&maps.w, w, w_rows, in, in, static_cast<uint32_t>(bn / 2))) {
    return cudaErrorInvalidValue;
  }
  Args args{};
  if constexpr (kF32) {
    maps.y = maps.y_tail = maps.x;  // unused: added from registers
    args.y32 = static_cast<float*>(y);
    args.y_stride = y_stride;
  } else if (!encode(&maps.y, static_cast<const bf16*>(y), rows, outs, y_stride) ||
             !encode(&maps.y_tail, static_cast<const bf16*>(y), rows, outs, y_stride, 128, 32)) {
    return cudaErrorInvalidValue;
  }
  args.rows = static_cast<int>(rows);
  args.outs = static_cast<int>(outs);
  args.in = static_cast<int>(in);
  if constexpr (kSwiglu) {
    return launch<E, 256>(maps, args, device, scratch, schedule, stream, max_ctas);
  } else {
    switch (bn) {
      case 128:
        return launch<E, 128>(maps, args, device, scratch, schedule, stream, max_ctas);
      case 160:
        return launch<E, 160>(maps, args, device, scratch, schedule, stream, max_ctas);
      case 192:
        return launch<E, 192>(maps, args, device, scratch, schedule, stream, max_ctas);
      case 224:
        return launch<E, 224>(maps, args, device, scratch, schedule, stream, max_ctas);
      case 320:
        if constexpr (kF32)
          return launch<E, 320>(maps, args, device, scratch, schedule, stream, max_ctas);
        return cudaErrorInvalidValue;
      default:
        return launch<E, 256>(maps, args, device, scratch, schedule, stream, max_ctas);
    }
  }
}

}  // namespace

size_t gemm_wgmma_scratch_bytes(int clusters) { return scratch_bytes_for(clusters * kGemmCluster); }

size_t gemm_wgmma_scratch_bytes() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  return gemm_wgmma_scratch_bytes(gemm_wgmma_clusters());
}

int gemm_wgmma_clusters() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  // Every epilogue's and width's kernel has the same occupancy (one CTA an SM): one answer serves.
  return std::max(max_clusters<Epilogue::kStore, 256>(device), 0);
}

bool gemm_wgmma_fits(int64_t out, int64_t in) {
  return out > 0 && in > 0 && in % kBK == 0 && out <= INT32_MAX && in <= INT32_MAX &&
         std::any_of(std::begin(kGemmWidths), std::end(kGemmWidths),
                     [&](int bn) { return gemm_width_fits(bn, out, false); });
}

int gemm_wgmma_tile_cols(int64_t rows, int64_t out, int64_t in, bool accumulate, int clusters,
                         bool scratch, GemmSchedule schedule) {
  if (rows <= 0 || !gemm_wgmma_fits(out, in) || clusters <= 0) return 0;
  // `clusters` counts pairs of SMs: one-CTA clusters (few rows) are twice as many.
  const int cl = cluster_for(rows);
  return pick_gemm_width(rows, out, in / kBK, accumulate, clusters * kGemmCluster / cl, scratch,
                         schedule, cl);
}

bool gemm_swiglu_fits(int64_t inter, int64_t in) {
  return inter > 0 && in > 0 && inter % kTileOuts<Epilogue::kSwiglu, 256> == 0 && in % kBK == 0 &&
         2 * inter <= INT32_MAX && in <= INT32_MAX;
}

cudaError_t gemm_wgmma(__nv_bfloat16* y, int64_t y_stride, const __nv_bfloat16* x, int64_t x_stride,
                       const __nv_bfloat16* w, int64_t rows, int64_t out, int64_t in,
                       const GemmScratch& scratch, cudaStream_t stream, GemmSchedule schedule,
                       int tile_cols, int max_ctas) {
  return run<Epilogue::kStore>(y, y_stride, x, x_stride, w, rows, out, in, scratch, stream,
                               schedule, tile_cols, max_ctas);
}

cudaError_t gemm_wgmma_accumulate(float* y, int64_t y_stride, const __nv_bfloat16* x,
                                  int64_t x_stride, const __nv_bfloat16* w, int64_t rows,
                                  int64_t out, int64_t in, const GemmScratch& scratch,
                                  cudaStream_t stream, GemmSchedule schedule, int tile_cols,
                                  int max_ctas) {
  return run<Epilogue::kAccumulate>(y, y_stride, x, x_stride, w, rows, out, in, scratch, stream,
                                    schedule, tile_cols, max_ctas);
}

cudaError_t gemm_swiglu(__nv_bfloat16* act, int64_t act_stride, const __nv_bfloat16* x,
                        int64_t x_stride, const __nv_bfloat16* w_gate_up, int64_t rows,
                        int64_t inter, int64_t in, cudaStream_t stream, const GemmScratch& scratch,
                        GemmSchedule schedule, int max_ctas) {
  return run<Epilogue::kSwiglu>(act, act_stride, x, x_stride, w_gate_up, rows, inter, in, scratch,
                                stream, schedule, 0, max_ctas);
}

}  // namespace keep::kernels
