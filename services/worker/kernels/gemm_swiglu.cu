// The MLP's gate/up product with the SwiGLU in its epilogue (gemm.h gemm_swiglu), for Hopper:
// act = silu(x Wg^T) * (x Wu^T) without the (rows, 2 * inter) product going through memory.
//
// A warp-specialized, persistent wgmma kernel fed by TMA:
//  - Tile: 128 token rows x 128 outputs, i.e. a 128 x 256 product (128 gate + 128 up columns),
//    k steps of 64. A stage holds x's 128 x 64 box and the two 128 x 64 weight boxes (gate rows
//    n0.., up rows inter + n0..): 48 KiB, 4 stages, all 128-byte swizzled (wgmma.cuh's layout).
//  - Clusters of 2 CTAs along the rows: both need the same weight tile, so each loads one of its
//    two boxes and multicasts it to both (half the weight traffic from L2).
//  - Warpgroup 0 is the producer (one thread issues the loads); warpgroups 1 and 2 each run
//    m64n256k16 over 64 rows of the tile, releasing a stage (in both CTAs) once its products are
//    done. A stage is refilled only when both CTAs' consumers released it.
//  - Epilogue: column j of the gate half and column j of the up half sit in the same thread
//    (accumulator blocks n and n + 16), so act = silu(gate) * up is formed in registers, staged
//    in shared memory as bf16 (two 64-column swizzled panels) and written by TMA stores, which
//    drop rows past the end.
//  - Clusters walk the cluster tiles (256 rows x 128 outputs) with the rows fastest, so the CTAs
//    reading one weight tile run at about the same time.
// fp32 accumulation, one rounding to bf16. silu(g) = g / (1 + exp(-g)) with the hardware's
// approximate exp2 and reciprocal (__expf, __fdividef: relative errors ~1e-6, far below bf16's
// 4e-3; 0 where exp(-g) overflows, as the exact form): with expf and an IEEE division, as
// swiglu.cu, the epilogue took ~5100 of a tile's ~63000 cycles (7B shape, one k step ~1040), with
// these ~2 multi-function-unit operations per output the kernel runs 5-6 % faster.
#include <algorithm>
#include <cstdint>
#include <mutex>

#include "services/worker/kernels/common.cuh"
#include "services/worker/kernels/gemm.h"
#include "services/worker/kernels/kernels.h"
#include "services/worker/kernels/tma.cuh"
#include "services/worker/kernels/tma_map.h"
#include "services/worker/kernels/wgmma.cuh"

namespace keep::kernels {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kBM = 128;  // token rows per CTA tile
constexpr int kBN = 128;  // outputs per tile (the product's 2 x 128 columns)
constexpr int kBK = 64;   // k per stage: one 128-byte swizzled row of bf16
constexpr int kStages = 4;
constexpr int kCluster = 2;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kBoxBytes = 128 * kBK * 2;  // one 128-row box: x's, the gate's or the up's
constexpr int kStageBytes = 3 * kBoxBytes;
constexpr int kOutBytes = kBM * kBN * 2;
constexpr int kPanelBytes = kBM * 128;  // 64 output columns of the staged tile
constexpr int kSmemBytes = kStages * kStageBytes + kOutBytes + 2 * kStages * 8 + 1024;
// Registers: the consumers' 128 accumulators per thread need the producer's share.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536, "registers");

struct Maps {
  CUtensorMap x;    // (rows, in), box 64 x 128
  CUtensorMap w;    // (2 * inter, in), box 64 x 128
  CUtensorMap act;  // (rows, inter), box 64 x 128
};

__global__ void __launch_bounds__(kThreads, 1)
    gemm_swiglu_kernel(const __grid_constant__ Maps maps, int rows, int inter, int in) {
  namespace d = detail;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Swizzled boxes need 1024-byte alignment.
  unsigned char* smem = smem_raw + ((1024 - (d::smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* out_tile = smem + kStages * kStageBytes;
  auto* full = reinterpret_cast<uint64_t*>(out_tile + kOutBytes);  // stage loaded
  uint64_t* empty = full + kStages;                                // stage free in both CTAs
  const int wg = static_cast<int>(threadIdx.x) / 128;
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const uint32_t rank = d::cluster_rank();
  const int tiles_m = (rows + kBM * kCluster - 1) / (kBM * kCluster);
  const int tiles = tiles_m * (inter / kBN);
  const int first = static_cast<int>(blockIdx.x) / kCluster;
  const int step = static_cast<int>(gridDim.x) / kCluster;
  const int k_steps = in / kBK;
  // Cluster tile `tile`'s first row for this CTA and first output column (producer and consumers
  // must agree).
  const auto row0 = [&](int tile) {
    return ((tile % tiles_m) * kCluster + static_cast<int>(rank)) * kBM;
  };
  const auto col0 = [&](int tile) { return (tile / tiles_m) * kBN; };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      d::mbar_init(&full[s], 1);
      d::mbar_init(&empty[s], kConsumers * kCluster);
    }
    d::mbar_init_fence();
  }
  d::cluster_sync();  // the peer's barriers are ready before anything is multicast to them

  if (wg == 0) {
    d::setmaxnreg_dec<kProducerRegs>();
    if (tid == 0) {
      int it = 0;  // k steps over all of this CTA's tiles; stage it % kStages
      for (int tile = first; tile < tiles; tile += step) {
        const int m0 = row0(tile), n0 = col0(tile);
        // This CTA's weight box: the gate rows (rank 0) or the up rows (rank 1).
        const int w_row = (rank == 0 ? 0 : inter) + n0;
        for (int k = 0; k < k_steps; ++k, ++it) {
          const int s = it % kStages;
          if (it >= kStages) d::mbar_wait(&empty[s], ((it / kStages) - 1) & 1);
          unsigned char* stage = smem + s * kStageBytes;
          d::mbar_arrive_expect_tx(&full[s], kStageBytes);
          d::tma_load_2d(stage, &maps.x, &full[s], k * kBK, m0);
          d::tma_load_2d_multicast(stage + (1 + rank) * kBoxBytes, &maps.w, &full[s], k * kBK,
                                   w_row, static_cast<uint16_t>((1u << kCluster) - 1));
        }
      }
    }
    __syncwarp();
  } else {
    d::setmaxnreg_inc<kConsumerRegs>();
    const int c = wg - 1;  // this warpgroup's 64 rows of the tile
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const bool issuer = c == 0 && tid == 0;  // issues the epilogue's stores
    // This warpgroup is done with stage s: one arrival on its barrier in every CTA of the
    // cluster (the producers of both fill it).
    const auto release = [&](int s) {
      if (tid != 0) return;
#pragma unroll
      for (int r = 0; r < kCluster; ++r) {
        d::mbar_arrive_cluster(&empty[s], static_cast<uint32_t>(r));
      }
    };
    int it = 0;
    for (int tile = first; tile < tiles; tile += step) {
      const int m0 = row0(tile), n0 = col0(tile);
      float acc[32][4];
#pragma unroll
      for (int n = 0; n < 32; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
      for (int k = 0; k < k_steps; ++k, ++it) {
        const int s = it % kStages;
        d::mbar_wait(&full[s], (it / kStages) & 1);
        unsigned char* stage = smem + s * kStageBytes;
        // A: this warpgroup's 64 rows of x's box; B: the gate box and the up box, one 256-row
        // K-major operand (8-row groups 1024 bytes apart throughout).
        const uint64_t da = d::wgmma_desc_sw128(stage + c * (64 * 128), 16, 1024);
        const uint64_t db = d::wgmma_desc_sw128(stage + kBoxBytes, 16, 1024);
        d::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          d::wgmma_m64n256k16_ss(acc, d::wgmma_desc_add(da, kk * 32),
                                 d::wgmma_desc_add(db, kk * 32), 1);
        }
        d::wgmma_commit();
        d::wgmma_wait<1>();  // the previous step's products are done: free its stage
        if (k > 0) release((it - 1) % kStages);
      }
      d::wgmma_wait<0>();
      d::wgmma_fence_operands(acc);
      release((it - 1) % kStages);  // the tile's last stage

      // acc[n][e + 2h]: row 16 warp + g + 8h of this warpgroup's 64, product column
      // 8n + 2t + e; blocks n < 16 are the gate's, n + 16 the up's of the same output column.
      if (issuer) d::bulk_wait_read<0>();  // the previous tile's stores have read the staging
      d::named_barrier(1, 128 * kConsumers);
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const int col = 8 * n + 2 * t;  // output column of the tile (and + 1)
        const int panel = col / 64, chunk = (col % 64) / 8;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 64 * c + 16 * warp + g + 8 * h;
          float a[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float gate = acc[n][2 * h + e], up = acc[n + 16][2 * h + e];
            a[e] = __fdividef(gate, 1.0f + __expf(-gate)) * up;
          }
          *reinterpret_cast<__nv_bfloat162*>(out_tile + panel * kPanelBytes + r * 128 +
                                             (chunk ^ (r % 8)) * 16 + (col % 8) * 2) =
              __floats2bfloat162_rn(a[0], a[1]);
        }
      }
      d::fence_proxy_async_shared();  // the staging is read by the TMA (async proxy)
      d::named_barrier(1, 128 * kConsumers);
      if (issuer) {
        d::tma_store_2d(&maps.act, out_tile, n0, m0);
        d::tma_store_2d(&maps.act, out_tile + kPanelBytes, n0 + 64, m0);
        d::bulk_commit();
      }
    }
    if (issuer) d::bulk_wait<0>();
  }
  d::cluster_sync();  // no CTA leaves while its peer may still arrive on its barriers
}

// A (rows, cols) bf16 matrix with row stride `ld` elements, read or written in 64 x 128 boxes.
bool encode(CUtensorMap* map, const bf16* p, int64_t rows, int64_t cols, int64_t ld) {
  return detail::encode_bf16_map(map, p, rows, cols, ld, 128);
}

// The kernel's launch configuration: `grid` CTAs in clusters of kCluster along x.
struct Launch {
  cudaLaunchAttribute attr{};
  cudaLaunchConfig_t cfg{};
  Launch(unsigned grid, cudaStream_t stream) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = kCluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = kSmemBytes;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  Launch(const Launch&) = delete;  // cfg points at attr
  Launch& operator=(const Launch&) = delete;
};

// Per device: the kernel's shared-memory limit raised, and how many clusters fit at once.
int max_clusters(int device) {
  static std::mutex mu;
  static int known[64] = {};
  if (device < 0 || device >= 64) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (known[device] != 0) return known[device];
  if (cudaFuncSetAttribute(gemm_swiglu_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kSmemBytes) != cudaSuccess) {
    return 0;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  const Launch launch(static_cast<unsigned>(sms - sms % kCluster), nullptr);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, gemm_swiglu_kernel, &launch.cfg) != cudaSuccess) {
    return 0;
  }
  known[device] = clusters;
  return clusters;
}

}  // namespace

bool gemm_swiglu_fits(int64_t inter, int64_t in) {
  return inter > 0 && in > 0 && inter % kBN == 0 && in % kBK == 0 && 2 * inter <= INT32_MAX &&
         in <= INT32_MAX;
}

cudaError_t gemm_swiglu(__nv_bfloat16* act, int64_t act_stride, const __nv_bfloat16* x,
                        int64_t x_stride, const __nv_bfloat16* w_gate_up, int64_t rows,
                        int64_t inter, int64_t in, cudaStream_t stream) {
  if (rows < 0 || !gemm_swiglu_fits(inter, in) || rows > INT32_MAX || act_stride < inter ||
      x_stride < in || act_stride % 8 != 0 || x_stride % 8 != 0) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (act == nullptr || x == nullptr || w_gate_up == nullptr || !detail::aligned16(act) ||
      !detail::aligned16(x) || !detail::aligned16(w_gate_up)) {
    return cudaErrorInvalidValue;
  }
  if (!wgmma_available() || detail::tensor_map_encoder() == nullptr) {
    return cudaErrorNotSupported;
  }
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const int clusters = max_clusters(device);
  if (clusters <= 0) return cudaErrorNotSupported;
  Maps maps;
  if (!encode(&maps.x, x, rows, in, x_stride) || !encode(&maps.w, w_gate_up, 2 * inter, in, in) ||
      !encode(&maps.act, act, rows, inter, act_stride)) {
    return cudaErrorInvalidValue;
  }
  const int64_t tiles = (rows + kBM * kCluster - 1) / (kBM * kCluster) * (inter / kBN);
  const Launch launch(static_cast<unsigned>(std::min<int64_t>(tiles, clusters) * kCluster), stream);
  return cudaLaunchKernelEx(&launch.cfg, gemm_swiglu_kernel, maps, static_cast<int>(rows),
                            static_cast<int>(inter), static_cast<int>(in));
}

}  // namespace keep::kernels
