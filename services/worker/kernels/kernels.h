// CUDA kernels of the worker's CUDA backend: launchers. Storage is bf16 or fp32, arithmetic fp32.
// Each launcher takes outputs first, then inputs, sizes, and the stream last; it allocates nothing,
// never synchronises and never logs. It returns cudaErrorInvalidValue for bad sizes or null
// pointers (nothing launched), cudaSuccess with nothing launched for empty work, else the launch's
// error (cudaGetLastError). All pointers are device pointers. The CPU reference of each kernel is
// in reference.h, with the exact semantics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace keep::kernels {

// out (n, hidden) = table (vocab, hidden)[ids[t], :]; ids (n) outside [0, vocab) give zero rows.
cudaError_t embedding(float* out, const float* table, const int32_t* ids, int64_t n, int64_t hidden,
                      int64_t vocab, cudaStream_t stream);
cudaError_t embedding(__nv_bfloat16* out, const __nv_bfloat16* table, const int32_t* ids, int64_t n,
                      int64_t hidden, int64_t vocab, cudaStream_t stream);

// residual (rows, cols) += x (rows, cols) (skipped when x is null), rounded to storage; then
// out (rows, cols) = rmsnorm(residual) * weight (cols), eps inside the square root. One block per
// row. out may equal x; out must not overlap residual.
cudaError_t rmsnorm_residual(float* out, float* residual, const float* x, const float* weight,
                             int64_t rows, int64_t cols, float eps, cudaStream_t stream);
cudaError_t rmsnorm_residual(__nv_bfloat16* out, __nv_bfloat16* residual, const __nv_bfloat16* x,
                             const __nv_bfloat16* weight, int64_t rows, int64_t cols, float eps,
                             cudaStream_t stream);

// RoPE in place, HF half-split layout (services/worker/engine/rope.h): x (n, row_stride) holding
// (heads, head_dim) at the start of each row, row r rotated to positions[r] (n, int32) with
// inv_freq (head_dim / 2, fp32). head_dim must be even, row_stride >= heads * head_dim. Serves Q,
// K, and pre-RoPE K loaded from the cache alike.
cudaError_t rope(float* x, const int32_t* positions, const float* inv_freq, int64_t n,
                 int64_t heads, int64_t head_dim, int64_t row_stride, cudaStream_t stream);
cudaError_t rope(__nv_bfloat16* x, const int32_t* positions, const float* inv_freq, int64_t n,
                 int64_t heads, int64_t head_dim, int64_t row_stride, cudaStream_t stream);

// out (n) = silu(gate (n)) * up (n). out may equal gate or up.
cudaError_t swiglu(float* out, const float* gate, const float* up, int64_t n, cudaStream_t stream);
cudaError_t swiglu(__nv_bfloat16* out, const __nv_bfloat16* gate, const __nv_bfloat16* up,
                   int64_t n, cudaStream_t stream);

}  // namespace keep::kernels
