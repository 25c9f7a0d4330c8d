// Matrix products of the CUDA backend: cuBLAS's y = x W^T with bf16 operands and fp32
// accumulation, W in Hugging Face nn.Linear orientation (out, in) row-major.
//
// cuBLAS is column-major; a row-major (rows, out) y is the column-major (out, rows) matrix y^T =
// W x^T, so every product here is cublasGemmEx(op(A) = T, op(B) = N, m = out, n = rows, k = in)
// with A = W (lda = in), B = x (ldb = x_stride), C = y (ldc = y_stride).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "services/worker/kernels/gemm_schedule.h"

namespace keep::kernels {

// An owned cuBLAS handle bound to one stream and one caller-owned workspace, so that no product
// allocates (and a CUDA graph can capture them). Move-only.
class BlasHandle {
 public:
  BlasHandle() = default;
  ~BlasHandle();
  BlasHandle(BlasHandle&& o) noexcept : h_(o.h_) { o.h_ = nullptr; }
  BlasHandle& operator=(BlasHandle&& o) noexcept;
  BlasHandle(const BlasHandle&) = delete;
  BlasHandle& operator=(const BlasHandle&) = delete;

  // Creates the handle; `workspace` (device, `bytes` >= 32 MiB recommended on Hopper) must outlive
  // it. Tensor-op math with fp32 accumulation.
  cublasStatus_t init(cudaStream_t stream, void* workspace, size_t bytes);
  cublasHandle_t get() const { return h_; }
  // cuBLAS picks and sizes its kernels for `sms` SMs (0: the device's): a stream beside the
  // products holding the others (the loader) then delays none of their CTAs.
  cublasStatus_t set_sm_count_target(int sms) { return cublasSetSmCountTarget(h_, sms); }

 private:
  cublasHandle_t h_ = nullptr;
};

const char* blas_status_name(cublasStatus_t s);

// y (rows, y_stride) bf16 = x (rows, x_stride) bf16 · W^T, W (out, in) bf16; first `out` columns
// of each y row written, `in` columns of each x row read. beta = 0.
cublasStatus_t gemm_nt(cublasHandle_t h, __nv_bfloat16* y, int64_t y_stride, const __nv_bfloat16* x,
                       int64_t x_stride, const __nv_bfloat16* w, int64_t rows, int64_t out,
                       int64_t in);
// The same with an fp32 y (logits).
cublasStatus_t gemm_nt(cublasHandle_t h, float* y, int64_t y_stride, const __nv_bfloat16* x,
                       int64_t x_stride, const __nv_bfloat16* w, int64_t rows, int64_t out,
                       int64_t in);

// y (rows, y_stride) fp32 += x (rows, x_stride) bf16 · W^T, W (out, in) bf16, accumulated in fp32
// (beta = 1): a projection added straight into the fp32 residual stream, with no bf16 rounding of
// the projection's output and no separate add kernel.
cublasStatus_t gemm_nt_accumulate(cublasHandle_t h, float* y, int64_t y_stride,
                                  const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                                  int64_t rows, int64_t out, int64_t in);

// y (rows, y_stride) fp32 = x (rows, x_stride) fp32 · W^T, W (out, in) fp32: plain fp32 products
// (no TF32), for the logits when they are kept in full precision.
cublasStatus_t gemm_nt_f32(cublasHandle_t h, float* y, int64_t y_stride, const float* x,
                           int64_t x_stride, const float* w, int64_t rows, int64_t out, int64_t in);

// Scratch for the stream-K share of our own products (gemm_wgmma, gemm_wgmma_accumulate,
// gemm_swiglu, below): device memory of gemm_wgmma_scratch_bytes() bytes, 16-byte aligned and
// zeroed once (cudaMemset) before its first use; every launch leaves it zeroed again. One stream at
// a time may use it. {} = none.
struct GemmScratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};
// How much scratch the current device's products need (0 where they cannot run).
size_t gemm_wgmma_scratch_bytes();
size_t gemm_wgmma_scratch_bytes(int clusters);

// ---- per-shape algorithms (cuBLASLt, timed) ----

// Which bf16 product a tuned algorithm is for: y (rows, y_stride) bf16 = x W^T, or fp32 y += x W^T.
struct GemmShape {
  int64_t out = 0, in = 0, x_stride = 0, y_stride = 0;
  bool accumulate = false;
  bool operator==(const GemmShape& o) const {
    return out == o.out && in == o.in && x_stride == o.x_stride && y_stride == o.y_stride &&
           accumulate == o.accumulate;
  }
};

// cuBLAS's default pick (cublasGemmEx's heuristic) is not always its fastest algorithm for our
// shapes (test_gemm's survey finds faster cuBLASLt algorithms at large row counts); nor is cuBLAS
// always faster than our own product (gemm_wgmma), nor slower. tune() times cuBLASLt's heuristic
// candidates (for few rows also split-k forms of them) and, once use_own_products() gave it
// scratch, gemm_wgmma (where the shape fits) against gemm_nt's default on real operands and keeps
// the fastest where it wins by kTuneMargin; run() then uses it for products of about that many
// rows. Not thread-safe (one per stream, like the backend that owns it). Move-only.
class GemmTuner {
 public:
  static constexpr double kTuneMargin = 0.03;     // an algorithm must be 3 % faster to be kept
  static constexpr int kHeuristicCandidates = 8;  // asked of cuBLASLt's heuristic
  // Up to kSplitKRows rows each heuristic candidate is also timed with its k dimension split
  // kSplitKWays ways (where cuBLASLt takes it): there the weights' read bounds the product, and
  // one row tile's columns may not cover the SMs.
  static constexpr int64_t kSplitKRows = 512;
  static constexpr int kSplitKWays[] = {2, 4};
  static constexpr int kMaxCandidates =
      kHeuristicCandidates * (1 + static_cast<int>(sizeof(kSplitKWays) / sizeof(int)));

  GemmTuner() = default;
  ~GemmTuner();
  GemmTuner(GemmTuner&& o) noexcept;
  GemmTuner& operator=(GemmTuner&& o) noexcept;
  GemmTuner(const GemmTuner&) = delete;
  GemmTuner& operator=(const GemmTuner&) = delete;

  // A cuBLASLt handle on `stream` with `workspace` (bytes; device memory that outlives this).
  cublasStatus_t init(cudaStream_t stream, void* workspace, size_t bytes);
  // Times the candidates for `rows` rows of `shape` on these operands (y is overwritten; x and w
  // should hold representative, non-zero values) and remembers the winner if it beats `blas`'s
  // default (gemm_nt / gemm_nt_accumulate) by `margin` (a negative margin keeps the fastest
  // candidate even when slower: tests use it to exercise run()). Synchronizes the stream. Times in
  // ms and the kept candidate's index (-1: the default stays) to `result` if not null.
  struct TuneResult {
    int chosen = -1;  // the cuBLASLt candidate kept, or kOurs
    float default_ms = 0.0f, best_ms = 0.0f;
    int split_forms = 0;  // split-k forms cuBLASLt accepted for this shape and rows
  };
  static constexpr int kOurs = kMaxCandidates;  // TuneResult::chosen: gemm_wgmma was kept
  // Lets tune() time gemm_wgmma / gemm_wgmma_accumulate as one more candidate, with this stream-K
  // scratch (which must outlive the tuner; see GemmScratch); `only`: no cuBLASLt candidates
  // (tests); `max_ctas`: their persistent grid's cap (0: every SM), timed with it; run() uses it
  // unless its call gives another.
  void use_own_products(const GemmScratch& scratch, bool only = false, int max_ctas = 0) {
    scratch_ = scratch;
    only_ours_ = only;
    max_ctas_ = max_ctas;
  }
  // Tests: tune() times the split-k forms alone (no heuristic pick as given, not ours), so that
  // run() is checked on one.
  void only_split_k(bool on) { only_split_k_ = on; }
  // The cuBLASLt candidates picked and sized for `sms` SMs (0: the device's), as
  // BlasHandle::set_sm_count_target. After init(), before tune().
  cublasStatus_t set_sm_count_target(int sms);
  cublasStatus_t tune(cublasHandle_t blas, const GemmShape& shape, int64_t rows, void* y,
                      const __nv_bfloat16* x, const __nv_bfloat16* w, double margin = kTuneMargin,
                      TuneResult* result = nullptr);
  // The product with the algorithm tuned for `shape` at the smallest tuned row count >= rows,
  // provided rows is more than half of it. CUBLAS_STATUS_NOT_SUPPORTED when there is none (or
  // cuBLASLt refuses it for these rows): the caller runs gemm_nt / gemm_nt_accumulate instead.
  // `own_max_ctas`: our product's grid cap for this call (0: every SM; kTunedCap: the one it
  // was timed with) -- the backend lifts it while no load runs beside the product.
  static constexpr int kTunedCap = -1;
  cublasStatus_t run(const GemmShape& shape, int64_t rows, void* y, const __nv_bfloat16* x,
                     const __nv_bfloat16* w, int own_max_ctas = kTunedCap) const;
  size_t tuned() const { return n_entries_; }  // shapes x row counts with a kept algorithm
  // What run() uses for `shape` at exactly `rows` tuned rows: "ours", or the cuBLASLt
  // algorithm's configuration as cublasLt.h's values ("algo 66 tile 165 stages 35 split-k 1
  // reduction 0 swizzle 0 cluster 3": tile 165 is CUBLASLT_MATMUL_TILE_112x128, cluster 3
  // CUBLASLT_CLUSTER_SHAPE_2x1x1), or "" when none was kept.
  std::string describe(const GemmShape& shape, int64_t rows) const;
  void clear() { n_entries_ = 0; }

 private:
  struct Entry {
    GemmShape shape;
    int64_t rows = 0;
    cublasLtMatmulAlgo_t algo{};
    bool ours = false;                  // gemm_wgmma instead of algo
    mutable int64_t checked_rows = -1;  // other rows cuBLASLt last accepted the algorithm for
  };
  static constexpr int kMaxEntries = 64;
  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatmulDesc_t op_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  Entry entries_[kMaxEntries];
  size_t n_entries_ = 0;
  GemmScratch scratch_;
  bool only_ours_ = false;
  bool only_split_k_ = false;
  int max_ctas_ = 0;
  // Our product for `shape`, its cudaError_t as run()'s status.
  cublasStatus_t run_ours(const GemmShape& shape, int64_t rows, void* y, const __nv_bfloat16* x,
                          const __nv_bfloat16* w, int max_ctas) const;
  void release();
};

// ---- our own products (gemm_wgmma.cu): warp-specialized wgmma + TMA, Hopper only ----
//
// Cluster tiles of 256 rows x BN columns (128 x BN per CTA; products of at most 128 rows: clusters
// of one CTA, 128-row tiles, on every SM), BN one of 256, 224, 192, 160, 128
// (and 320 for gemm_wgmma_accumulate): the width that splits the product's columns into the
// fewest, fullest waves of the GPU's clusters (gemm_wgmma_tile_cols). Tiles are dealt whole round
// robin, or in lanes (one cluster per row tile, the lane's clusters on the same columns at once)
// with the columns that do not fill a wave cut into equal k ranges (stream-K) and the clusters no
// lane takes on the last few columns: gemm_schedule.h (GemmSchedule). The stream-K share needs
// scratch memory (partial tiles and flags); without it (or too little) the products run round
// robin.

// The shapes gemm_wgmma and gemm_wgmma_accumulate take: `out` a multiple of 128, 160, 192 or 224
// and in % 64 == 0 (Qwen2.5 1.5B-72B's QKV, o_proj and down products; not SmolLM2's 576).
bool gemm_wgmma_fits(int64_t out, int64_t in);

// How many clusters of 2 SMs our products run on at once on the current device (66 on the H200;
// 0 where they cannot run): the `clusters` gemm_wgmma_tile_cols needs for the launches' pick.
int gemm_wgmma_clusters();

// The tile width (BN) gemm_wgmma (accumulate false) / gemm_wgmma_accumulate take for `rows` rows
// of an (out, in) product with tile_cols = 0, on `clusters` clusters of 2 SMs (66 on the H200),
// with or without stream-K scratch: the one whose schedule's busiest cluster has the least
// modelled work (columns x k steps, weighted by the width's measured rate; a narrower one only
// where that saves more than 1 %). 0 where the shape does not fit.
int gemm_wgmma_tile_cols(int64_t rows, int64_t out, int64_t in, bool accumulate, int clusters,
                         bool scratch, GemmSchedule schedule = GemmSchedule::kAuto);

// y (rows, y_stride) bf16 = x (rows, x_stride) bf16 · W^T, W (out, in) bf16, fp32 sums rounded
// once: gemm_nt's product. y_stride and x_stride multiples of 8 elements, y, x, W 16-byte aligned.
// tile_cols: the tile width (one of the five dividing `out`; 0: gemm_wgmma_tile_cols's pick).
// gemm_wgmma_accumulate also takes 320.
// max_ctas > 0: the persistent grid takes at most that many CTAs (SMs), leaving the others to a
// kernel running beside it (the KV loader: a grid on every SM would keep its blocks waiting).
// cudaErrorInvalidValue for other shapes (gemm_wgmma_fits), widths, strides or alignments;
// cudaErrorNotSupported where wgmma_available() is false. Asynchronous on `stream`, capturable in a
// CUDA graph (scratch included).
cudaError_t gemm_wgmma(__nv_bfloat16* y, int64_t y_stride, const __nv_bfloat16* x, int64_t x_stride,
                       const __nv_bfloat16* w, int64_t rows, int64_t out, int64_t in,
                       const GemmScratch& scratch, cudaStream_t stream,
                       GemmSchedule schedule = GemmSchedule::kAuto, int tile_cols = 0,
                       int max_ctas = 0);
// y (rows, y_stride) fp32 += x · W^T in fp32 (gemm_nt_accumulate's product): y 8-byte aligned,
// y_stride even; the rest as gemm_wgmma. Each y element is read and written once, by one thread:
// the same inputs give the same bits whatever the schedule's timing.
cudaError_t gemm_wgmma_accumulate(float* y, int64_t y_stride, const __nv_bfloat16* x,
                                  int64_t x_stride, const __nv_bfloat16* w, int64_t rows,
                                  int64_t out, int64_t in, const GemmScratch& scratch,
                                  cudaStream_t stream, GemmSchedule schedule = GemmSchedule::kAuto,
                                  int tile_cols = 0, int max_ctas = 0);

// The shapes gemm_swiglu takes: inter % 128 == 0 and in % 64 == 0 (Qwen2.5 0.5B-72B, SmolLM2).
bool gemm_swiglu_fits(int64_t inter, int64_t in);

// The MLP's gate/up product and SwiGLU in one kernel:
//   act[r, j] = bf16(silu(g) * u),  g = Σ_i x[r, i] W[j, i],  u = Σ_i x[r, i] W[inter + j, i]
// with W (2 * inter, in) bf16 = [W_gate; W_up] (the fused gate/up weight, gate rows first), fp32
// sums and silu(g) = h + h tanh(h), h = g / 2 (the hardware's approximate tanh, relative error
// below 2^-10.98, a quarter of bf16's step); the product never goes through memory and g, u are
// not rounded to bf16 (the cuBLAS path + swiglu_rows rounds them). act (rows, act_stride), x (rows,
// x_stride): strides multiples of 8 elements, all pointers 16-byte aligned. cudaErrorInvalidValue
// for other shapes (gemm_swiglu_fits), strides or alignments; cudaErrorNotSupported where
// wgmma_available() is false. Asynchronous on `stream`, capturable in a CUDA graph.
cudaError_t gemm_swiglu(__nv_bfloat16* act, int64_t act_stride, const __nv_bfloat16* x,
                        int64_t x_stride, const __nv_bfloat16* w_gate_up, int64_t rows,
                        int64_t inter, int64_t in, cudaStream_t stream,
                        const GemmScratch& scratch = {},
                        GemmSchedule schedule = GemmSchedule::kAuto, int max_ctas = 0);

}  // namespace keep::kernels
