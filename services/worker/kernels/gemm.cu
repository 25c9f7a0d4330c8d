// cuBLAS products y = x W^T (gemm.h).
#include "services/worker/kernels/gemm.h"

#include <algorithm>
#include <climits>
#include <vector>

#include "services/worker/kernels/kernels.h"

namespace keep::kernels {

BlasHandle::~BlasHandle() {
  if (h_ != nullptr) cublasDestroy(h_);
}

BlasHandle& BlasHandle::operator=(BlasHandle&& o) noexcept {
  if (this != &o) {
    if (h_ != nullptr) cublasDestroy(h_);
    h_ = o.h_;
    o.h_ = nullptr;
  }
  return *this;
}

cublasStatus_t BlasHandle::init(cudaStream_t stream, void* workspace, size_t bytes) {
  if (h_ != nullptr) {
    cublasDestroy(h_);
    h_ = nullptr;
  }
  cublasStatus_t s = cublasCreate(&h_);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  if ((s = cublasSetStream(h_, stream)) != CUBLAS_STATUS_SUCCESS) return s;
  if ((s = cublasSetWorkspace(h_, workspace, bytes)) != CUBLAS_STATUS_SUCCESS) return s;
  return cublasSetMathMode(h_, CUBLAS_DEFAULT_MATH);
}

const char* blas_status_name(cublasStatus_t s) { return cublasGetStatusName(s); }

namespace {

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

cublasStatus_t gemm(cublasHandle_t h, void* y, cudaDataType_t y_type, int64_t y_stride,
                    const void* x, int64_t x_stride, const void* w, cudaDataType_t xw_type,
                    int64_t rows, int64_t out, int64_t in, float beta = 0.0f) {
  if (h == nullptr || !fits_int(rows) || !fits_int(out) || !fits_int(in) || !fits_int(y_stride) ||
      !fits_int(x_stride) || y_stride < out || x_stride < in) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (rows == 0 || out == 0) return CUBLAS_STATUS_SUCCESS;
  if (y == nullptr || x == nullptr || w == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const float alpha = 1.0f;
  return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(rows),
                      static_cast<int>(in), &alpha, w, xw_type, static_cast<int>(in), x, xw_type,
                      static_cast<int>(x_stride), &beta, y, y_type, static_cast<int>(y_stride),
                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

}  // namespace

cublasStatus_t gemm_nt(cublasHandle_t h, __nv_bfloat16* y, int64_t y_stride, const __nv_bfloat16* x,
                       int64_t x_stride, const __nv_bfloat16* w, int64_t rows, int64_t out,
                       int64_t in) {
  return gemm(h, y, CUDA_R_16BF, y_stride, x, x_stride, w, CUDA_R_16BF, rows, out, in);
}

cublasStatus_t gemm_nt(cublasHandle_t h, float* y, int64_t y_stride, const __nv_bfloat16* x,
                       int64_t x_stride, const __nv_bfloat16* w, int64_t rows, int64_t out,
                       int64_t in) {
  return gemm(h, y, CUDA_R_32F, y_stride, x, x_stride, w, CUDA_R_16BF, rows, out, in);
}

cublasStatus_t gemm_nt_accumulate(cublasHandle_t h, float* y, int64_t y_stride,
                                  const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w,
                                  int64_t rows, int64_t out, int64_t in) {
  return gemm(h, y, CUDA_R_32F, y_stride, x, x_stride, w, CUDA_R_16BF, rows, out, in, 1.0f);
}

cublasStatus_t gemm_nt_f32(cublasHandle_t h, float* y, int64_t y_stride, const float* x,
                           int64_t x_stride, const float* w, int64_t rows, int64_t out,
                           int64_t in) {
  // The handle's math mode is CUBLAS_DEFAULT_MATH: COMPUTE_32F with fp32 operands is true fp32.
  return gemm(h, y, CUDA_R_32F, y_stride, x, x_stride, w, CUDA_R_32F, rows, out, in);
}

// ---- GemmTuner ----

namespace {

// The cuBLASLt form of gemm(): column-major D (out, rows) = W^T x^T, W stored (in, out) with
// leading dimension in, x (in, rows) with x_stride, D with y_stride (C = D). The layouts live in
// this object (cublasLtMatrixLayoutInit), not on the heap: run() builds them for every product.
struct LtLayouts {
  cublasLtMatrixLayoutOpaque_t a_store{}, b_store{}, c_store{};
  cublasLtMatrixLayout_t a = &a_store, b = &b_store, c = &c_store;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  LtLayouts(const GemmShape& s, int64_t rows) {
    status = cublasLtMatrixLayoutInit(a, CUDA_R_16BF, s.in, s.out, s.in);
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatrixLayoutInit(b, CUDA_R_16BF, s.in, rows, s.x_stride);
    }
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatrixLayoutInit(c, s.accumulate ? CUDA_R_32F : CUDA_R_16BF, s.out, rows,
                                        s.y_stride);
    }
  }
  LtLayouts(const LtLayouts&) = delete;
  LtLayouts& operator=(const LtLayouts&) = delete;
};

bool shape_ok(const GemmShape& s, int64_t rows) {
  return rows > 0 && fits_int(rows) && s.out > 0 && fits_int(s.out) && s.in > 0 && fits_int(s.in) &&
         fits_int(s.x_stride) && fits_int(s.y_stride) && s.x_stride >= s.in && s.y_stride >= s.out;
}

// Median of `reps` timed samples of f on `stream` (after one untimed run), in ms per run;
// negative if f fails. A sample is `batch` runs back to back between two events, so that the
// host's work before a launch (ours encodes three tensor maps) hides behind the GPU's, as in a
// layer, instead of being counted.
template <typename F>
float time_ms(cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop, int reps, int batch,
              F&& f) {
  if (f() != CUBLAS_STATUS_SUCCESS) return -1.0f;
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    if (cudaEventRecord(start, stream) != cudaSuccess) return -1.0f;
    for (int b = 0; b < batch; ++b) {
      if (f() != CUBLAS_STATUS_SUCCESS) return -1.0f;
    }
    if (cudaEventRecord(stop, stream) != cudaSuccess || cudaEventSynchronize(stop) != cudaSuccess) {
      return -1.0f;
    }
    float t = 0.0f;
    if (cudaEventElapsedTime(&t, start, stop) != cudaSuccess) return -1.0f;
    ms.push_back(t / static_cast<float>(batch));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

GemmTuner::~GemmTuner() { release(); }

void GemmTuner::release() {
  if (op_ != nullptr) cublasLtMatmulDescDestroy(op_);
  if (lt_ != nullptr) cublasLtDestroy(lt_);
  op_ = nullptr;
  lt_ = nullptr;
  n_entries_ = 0;
}

GemmTuner::GemmTuner(GemmTuner&& o) noexcept { *this = std::move(o); }

GemmTuner& GemmTuner::operator=(GemmTuner&& o) noexcept {
  if (this != &o) {
    release();
    lt_ = o.lt_;
    op_ = o.op_;
    stream_ = o.stream_;
    workspace_ = o.workspace_;
    workspace_bytes_ = o.workspace_bytes_;
    std::copy(o.entries_, o.entries_ + o.n_entries_, entries_);
    n_entries_ = o.n_entries_;
    scratch_ = o.scratch_;
    only_ours_ = o.only_ours_;
    only_split_k_ = o.only_split_k_;
    max_ctas_ = o.max_ctas_;
    o.lt_ = nullptr;
    o.op_ = nullptr;
    o.n_entries_ = 0;
  }
  return *this;
}

cublasStatus_t GemmTuner::init(cudaStream_t stream, void* workspace, size_t bytes) {
  release();
  stream_ = stream;
  workspace_ = workspace;
  workspace_bytes_ = bytes;
  cublasStatus_t s = cublasLtCreate(&lt_);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  if ((s = cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F)) !=
      CUBLAS_STATUS_SUCCESS) {
    return s;
  }
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  if ((s = cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta))) !=
      CUBLAS_STATUS_SUCCESS) {
    return s;
  }
  return cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
}

cublasStatus_t GemmTuner::set_sm_count_target(int sms) {
  if (op_ == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  const int32_t n = sms;
  return cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &n, sizeof(n));
}

cublasStatus_t GemmTuner::tune(cublasHandle_t blas, const GemmShape& shape, int64_t rows, void* y,
                               const __nv_bfloat16* x, const __nv_bfloat16* w, double margin,
                               TuneResult* result) {
  TuneResult unused;
  TuneResult& r = result != nullptr ? *result : unused;
  r = TuneResult{};
  if (lt_ == nullptr || blas == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!shape_ok(shape, rows) || y == nullptr || x == nullptr || w == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const LtLayouts l(shape, rows);
  if (l.status != CUBLAS_STATUS_SUCCESS) return l.status;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t s = cublasLtMatmulPreferenceCreate(&pref);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes_, sizeof(workspace_bytes_));
  cublasLtMatmulHeuristicResult_t heur[kHeuristicCandidates];
  int found = 0;
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulAlgoGetHeuristic(lt_, op_, l.a, l.b, l.c, l.c, pref, kHeuristicCandidates,
                                       heur, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  cublasLtMatmulAlgo_t cand[kMaxCandidates];
  int n_cand = 0;
  for (int i = 0; i < found; ++i) {
    if (heur[i].state == CUBLAS_STATUS_SUCCESS) cand[n_cand++] = heur[i].algo;
  }
  // Split-k forms (partial sums reduced in fp32 in the workspace), where cuBLASLt accepts the
  // configuration for this shape within the workspace.
  const int n_heur = n_cand;
  for (int i = 0; i < n_heur && rows <= kSplitKRows; ++i) {
    for (const int ways : kSplitKWays) {
      cublasLtMatmulAlgo_t a = cand[i];
      const uint32_t splits = static_cast<uint32_t>(ways);
      const uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                               sizeof(splits)) == CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                               sizeof(scheme)) == CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulAlgoCheck(lt_, op_, l.a, l.b, l.c, l.c, &a, &check) ==
              CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= workspace_bytes_) {
        cand[n_cand++] = a;
      }
    }
  }
  r.split_forms = n_cand - n_heur;

  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    if (start != nullptr) cudaEventDestroy(start);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  constexpr int kReps = 5, kBatch = 3;
  const float base = time_ms(stream_, start, stop, kReps, kBatch, [&] {
    return shape.accumulate ? gemm_nt_accumulate(blas, static_cast<float*>(y), shape.y_stride, x,
                                                 shape.x_stride, w, rows, shape.out, shape.in)
                            : gemm_nt(blas, static_cast<__nv_bfloat16*>(y), shape.y_stride, x,
                                      shape.x_stride, w, rows, shape.out, shape.in);
  });
  const float alpha = 1.0f, beta = shape.accumulate ? 1.0f : 0.0f;
  float best = -1.0f;
  int best_i = -1;
  if (scratch_.ptr != nullptr && !only_split_k_ && gemm_wgmma_fits(shape.out, shape.in) &&
      wgmma_available()) {
    best = time_ms(stream_, start, stop, kReps, kBatch,
                   [&] { return run_ours(shape, rows, y, x, w, max_ctas_); });
    if (best > 0.0f) best_i = kOurs;
  }
  for (int i = only_split_k_ ? n_heur : 0; i < n_cand && !only_ours_; ++i) {
    const float t = time_ms(stream_, start, stop, kReps, kBatch, [&] {
      return cublasLtMatmul(lt_, op_, &alpha, w, l.a, x, l.b, &beta, y, l.c, y, l.c, &cand[i],
                            workspace_, workspace_bytes_, stream_);
    });
    if (t > 0.0f && (best < 0.0f || t < best)) {
      best = t;
      best_i = i;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  r.default_ms = base;
  r.best_ms = best;
  if (base <= 0.0f) return CUBLAS_STATUS_EXECUTION_FAILED;
  // Replace an earlier choice for the same shape and rows, or add one.
  size_t at = n_entries_;
  for (size_t i = 0; i < n_entries_; ++i) {
    if (entries_[i].shape == shape && entries_[i].rows == rows) at = i;
  }
  const bool keep = best_i >= 0 && best < base * (1.0 - margin);
  if (!keep) {
    if (at < n_entries_) entries_[at] = entries_[--n_entries_];  // forget a stale choice
    return CUBLAS_STATUS_SUCCESS;
  }
  if (at == n_entries_) {
    if (n_entries_ == kMaxEntries) return CUBLAS_STATUS_SUCCESS;  // full: the default stays
    ++n_entries_;
  }
  entries_[at] = best_i == kOurs ? Entry{shape, rows, {}, true} : Entry{shape, rows, cand[best_i]};
  r.chosen = best_i;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t GemmTuner::run(const GemmShape& shape, int64_t rows, void* y, const __nv_bfloat16* x,
                              const __nv_bfloat16* w, int own_max_ctas) const {
  const Entry* e = nullptr;
  for (size_t i = 0; i < n_entries_; ++i) {
    const Entry& c = entries_[i];
    if (c.shape == shape && c.rows >= rows && 2 * rows > c.rows &&
        (e == nullptr || c.rows < e->rows)) {
      e = &c;
    }
  }
  if (e == nullptr || lt_ == nullptr || !shape_ok(shape, rows)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (y == nullptr || x == nullptr || w == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (e->ours) {
    return run_ours(shape, rows, y, x, w, own_max_ctas == kTunedCap ? max_ctas_ : own_max_ctas);
  }
  const LtLayouts l(shape, rows);
  if (l.status != CUBLAS_STATUS_SUCCESS) return l.status;
  if (rows != e->rows && rows != e->checked_rows) {
    // The algorithm was chosen for other rows: ask whether it takes these (once per row count).
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(lt_, op_, l.a, l.b, l.c, l.c, &e->algo, &check) !=
            CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > workspace_bytes_) {
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    e->checked_rows = rows;
  }
  const float alpha = 1.0f, beta = shape.accumulate ? 1.0f : 0.0f;
  return cublasLtMatmul(lt_, op_, &alpha, w, l.a, x, l.b, &beta, y, l.c, y, l.c, &e->algo,
                        workspace_, workspace_bytes_, stream_);
}

std::string GemmTuner::describe(const GemmShape& shape, int64_t rows) const {
  for (size_t i = 0; i < n_entries_; ++i) {
    const Entry& e = entries_[i];
    if (!(e.shape == shape) || e.rows != rows) continue;
    if (e.ours) return "ours";
    // One attribute as a number (-1 where cuBLASLt refuses); `v` gives the field's width.
    const auto get = [&](cublasLtMatmulAlgoConfigAttributes_t a, auto v) {
      size_t written = 0;
      return cublasLtMatmulAlgoConfigGetAttribute(&e.algo, a, &v, sizeof(v), &written) ==
                     CUBLAS_STATUS_SUCCESS
                 ? std::to_string(v)
                 : std::string("-1");
    };
    // 32-bit fields, but the cluster shape's 16 bits (cublasLt.h).
    return "algo " + get(CUBLASLT_ALGO_CONFIG_ID, uint32_t{0}) + " tile " +
           get(CUBLASLT_ALGO_CONFIG_TILE_ID, uint32_t{0}) + " stages " +
           get(CUBLASLT_ALGO_CONFIG_STAGES_ID, uint32_t{0}) + " split-k " +
           get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, uint32_t{0}) + " reduction " +
           get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, uint32_t{0}) + " swizzle " +
           get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, uint32_t{0}) + " cluster " +
           get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, uint16_t{0});
  }
  return "";
}

cublasStatus_t GemmTuner::run_ours(const GemmShape& shape, int64_t rows, void* y,
                                   const __nv_bfloat16* x, const __nv_bfloat16* w,
                                   int max_ctas) const {
  const cudaError_t err =
      shape.accumulate
          ? gemm_wgmma_accumulate(static_cast<float*>(y), shape.y_stride, x, shape.x_stride, w,
                                  rows, shape.out, shape.in, scratch_, stream_, GemmSchedule::kAuto,
                                  0, max_ctas)
          : gemm_wgmma(static_cast<__nv_bfloat16*>(y), shape.y_stride, x, shape.x_stride, w, rows,
                       shape.out, shape.in, scratch_, stream_, GemmSchedule::kAuto, 0, max_ctas);
  return err == cudaSuccess             ? CUBLAS_STATUS_SUCCESS
         : err == cudaErrorInvalidValue ? CUBLAS_STATUS_INVALID_VALUE
         : err == cudaErrorNotSupported ? CUBLAS_STATUS_NOT_SUPPORTED
                                        : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // namespace keep::kernels
