// cuBLAS products y = x W^T (gemm.h).
#include "services/worker/kernels/gemm.h"

#include <climits>

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

}  // namespace keep::kernels
