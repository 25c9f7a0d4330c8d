// Single-precision matrix products over OpenBLAS (cblas_sgemm), row-major, with the shapes spelled
// out at every call. Outputs first, then inputs, then sizes (llm.c launcher order).
//
// The thread count is OpenBLAS's own (OPENBLAS_NUM_THREADS / openblas_set_num_threads); these
// wrappers never change it. Sizes are int because cblas takes int; callers keep them < 2^31.
#pragma once

namespace keep::blas {

// C (M,N) = alpha * A (M,K) · B (K,N) + beta * C
void gemm_nn(float* C, const float* A, const float* B, int M, int N, int K, float alpha = 1.0f,
             float beta = 0.0f);

// C (M,N) = alpha * A (M,K) · B (N,K)^T + beta * C      (B is a PyTorch Linear weight (out, in))
void gemm_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha = 1.0f,
             float beta = 0.0f);

// C (M,N) = alpha * A (K,M)^T · B (K,N) + beta * C
void gemm_tn(float* C, const float* A, const float* B, int M, int N, int K, float alpha = 1.0f,
             float beta = 0.0f);

// Strided variants for sub-matrices (one attention head inside a packed QKV row, ...):
// ld* is the distance in floats between consecutive rows of that operand as stored.
// C (M,N) [ldc] = alpha * A (M,K) [lda] · B (K,N) [ldb] + beta * C
void gemm_nn_strided(float* C, int ldc, const float* A, int lda, const float* B, int ldb, int M,
                     int N, int K, float alpha = 1.0f, float beta = 0.0f);
// C (M,N) [ldc] = alpha * A (M,K) [lda] · B (N,K)^T [ldb] + beta * C
void gemm_nt_strided(float* C, int ldc, const float* A, int lda, const float* B, int ldb, int M,
                     int N, int K, float alpha = 1.0f, float beta = 0.0f);

// The number of threads OpenBLAS will use (for logs and benchmark reports).
int num_threads();

}  // namespace keep::blas
