#include "shared/blas/gemm.h"

#include <cblas.h>

namespace keep::blas {

void gemm_nn(float* C, const float* A, const float* B, int M, int N, int K, float alpha,
             float beta) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, alpha, A, K, B, N, beta, C, N);
}

void gemm_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha,
             float beta) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, alpha, A, K, B, K, beta, C, N);
}

void gemm_tn(float* C, const float* A, const float* B, int M, int N, int K, float alpha,
             float beta) {
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, M, N, K, alpha, A, M, B, N, beta, C, N);
}

void gemm_nn_strided(float* C, int ldc, const float* A, int lda, const float* B, int ldb, int M,
                     int N, int K, float alpha, float beta) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C,
              ldc);
}

void gemm_nt_strided(float* C, int ldc, const float* A, int lda, const float* B, int ldb, int M,
                     int N, int K, float alpha, float beta) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, alpha, A, lda, B, ldb, beta, C,
              ldc);
}

int num_threads() { return openblas_get_num_threads(); }

}  // namespace keep::blas
