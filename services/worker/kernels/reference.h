// CPU references of the CUDA kernels in this folder (kernels.h). Each computes exactly what its
// kernel computes (fp32 arithmetic on values read from T storage, one rounding to T on store), so a
// kernel is checked against its reference on random inputs (tests/gpu/test_kernels.cu), and each
// reference against the CPU engine's semantics (tests/unit/test_kernels_ref.cpp). T is float or
// Bf16. These build without CUDA.
#pragma once

#include <cstdint>

#include "services/worker/kernels/bf16.h"

namespace keep::kernels::ref {

// out (n, hidden) = table[ids[t], :] per token; rows of ids outside [0, vocab) become zeros.
template <typename T>
void embedding(T* out, const T* table, const int32_t* ids, int64_t n, int64_t hidden,
               int64_t vocab);

// Fused residual add + RMSNorm, HF's LlamaRMSNorm in fp32, row by row:
//   residual[r] = T(residual[r] + x[r])            (skipped when x is null)
//   out[r][i]   = T(weight[i] * (residual[r][i] * 1 / sqrt(mean(residual[r]^2) + eps)))
// residual, x, out: (rows, cols); weight: (cols). out may equal x.
template <typename T>
void rmsnorm_residual(T* out, T* residual, const T* x, const T* weight, int64_t rows, int64_t cols,
                      float eps);

// RoPE in place, HF half-split ("rotate_half") layout, as services/worker/engine/rope.h: for row r,
// head h and i < head_dim/2, angle = float(positions[r]) * inv_freq[i] (fp32 product),
//   x[i]        = x[i] * cos - x[i + half] * sin
//   x[i + half] = x[i + half] * cos + x[i] * sin
// x: (n, row_stride) with the heads packed at the start of each row: (n, heads, head_dim) when
// row_stride == heads * head_dim; inv_freq: (head_dim / 2); positions: (n).
template <typename T>
void rope(T* x, const int32_t* positions, const float* inv_freq, int64_t n, int64_t heads,
          int64_t head_dim, int64_t row_stride);

// SwiGLU: out[i] = T(silu(gate[i]) * up[i]), silu(g) = g / (1 + exp(-g)). All (n). out may equal
// gate or up.
template <typename T>
void swiglu(T* out, const T* gate, const T* up, int64_t n);

}  // namespace keep::kernels::ref
