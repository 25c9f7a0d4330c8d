// CPU references of the CUDA kernels in this folder (kernels.h). Each computes exactly what its
// kernel computes (fp32 arithmetic on values read from T storage, one rounding to T on store), so a
// kernel is checked against its reference on random inputs (tests/gpu/test_kernels.cu), and each
// reference against the CPU engine's semantics (tests/unit/test_kernels_ref.cpp). T is float or
// Bf16. These build without CUDA.
#pragma once

#include <cstdint>

#include "services/worker/kernels/bf16.h"
#include "services/worker/kernels/layout.h"

namespace keep::kernels::ref {

// Fused residual add + RMSNorm, HF's LlamaRMSNorm in fp32, row by row:
//   residual[r] = residual[r] + x[r]            (skipped when x is null)
//   out[r][i]   = weight[i] * (residual[r][i] * 1 / sqrt(mean(residual[r]^2) + eps))
// residual, x, out: (rows, cols); weight: (cols). out may equal x.
void rmsnorm_residual(float* out, float* residual, const float* x, const float* weight,
                      int64_t rows, int64_t cols, float eps);

// RoPE in place, HF half-split ("rotate_half") layout, as services/worker/engine/core/rope.h: for
// row r, head h and i < head_dim/2, angle = float(positions[r]) * inv_freq[i] (fp32 product),
//   x[i]        = x[i] * cos - x[i + half] * sin
//   x[i + half] = x[i + half] * cos + x[i] * sin
// x: (n, row_stride) with the heads packed at the start of each row: (n, heads, head_dim) when
// row_stride == heads * head_dim; inv_freq: (head_dim / 2); positions: (n).
void rope(float* x, const int32_t* positions, const float* inv_freq, int64_t n, int64_t heads,
          int64_t head_dim, int64_t row_stride);
// The loader's pass (kernels::load_kv_rope): k_out = Bf16(rope(float(k_pre))) row by row at
// positions, v_out = v; (n, heads, head_dim) each.
void load_kv_rope(Bf16* k_out, Bf16* v_out, const Bf16* k_pre, const Bf16* v,
                  const int32_t* positions, const float* inv_freq, int64_t n, int64_t heads,
                  int64_t head_dim);

// ---- misc.cu (reference_misc.cpp) ----
// out fp32 = table bf16 rows (zero rows for ids outside [0, vocab)).
void embedding_bf16_to_f32(float* out, const Bf16* table, const int32_t* ids, int64_t n,
                           int64_t hidden, int64_t vocab);
// residual fp32 += x (+ bias) (when x is set), then out = Bf16(weight * residual * inv_rms) unless
// out is null. inv_rms = 1 / sqrt(mean(residual^2) + eps), fp32 arithmetic with a double sum.
void add_rmsnorm(Bf16* out, float* residual, const Bf16* x, const float* bias, const float* weight,
                 int64_t rows, int64_t cols, float eps);
void gather_rows(float* out, const float* in, const int32_t* rows, int64_t n, int64_t cols);
// out (rows, inter) = Bf16(silu(gate) * up), gate_up (rows, 2 * inter) = [gate | up].
void swiglu_rows(Bf16* out, const Bf16* gate_up, int64_t rows, int64_t inter);
// kernels.h qkv_finish.
void qkv_finish(Bf16* qkv, float* k_pre, float* v_out, Bf16* kv_k, Bf16* kv_v, const float* bq,
                const float* bk, const float* bv, const int32_t* positions, const int32_t* slots,
                const float* inv_freq, int64_t rows, int64_t heads, int64_t kv_heads,
                int64_t head_dim);
// gemm.h gemm_swiglu: act[r, j] = Bf16(silu(g) * u) with g = Σ_i x[r, i] w[j, i] and u = Σ_i
// x[r, i] w[inter + j, i] summed in double and rounded to fp32 (no bf16 rounding between), silu(g)
// = g / (1 + exp(-g)) in fp32. x (rows, x_stride), w (2 * inter, in), act (rows, act_stride).
void gemm_swiglu(Bf16* act, int64_t act_stride, const Bf16* x, int64_t x_stride, const Bf16* w,
                 int64_t rows, int64_t inter, int64_t in);
// kernels.h gemv / gemv_accumulate: y[r, o] (+)= Σ_i x[r, i] w[o, i], in double; stored as Bf16
// (accumulate = false) or added to the float y (accumulate = true).
void gemv(Bf16* y, int64_t y_stride, const Bf16* x, int64_t x_stride, const Bf16* w, int64_t rows,
          int64_t out, int64_t in);
void gemv_accumulate(float* y, int64_t y_stride, const Bf16* x, int64_t x_stride, const Bf16* w,
                     int64_t rows, int64_t out, int64_t in);
// The fp32-x, fp32-y form: y[r, o] = Σ_i x[r, i] w[o, i] in double, stored as float.
void gemv(float* y, int64_t y_stride, const float* x, int64_t x_stride, const Bf16* w, int64_t rows,
          int64_t out, int64_t in);

// Counter-based uniform values in [lo, hi): value i depends only on (seed, i).
template <typename T>
void fill_uniform(T* out, int64_t n, uint64_t seed, float lo, float hi);

// ---- attention (reference_attention.cpp) ----
// kernels.h attention semantics in double accumulation: out (rows, out_stride) stored as Bf16,
// lse (rows, heads) or null.
void attention(Bf16* out, int64_t out_stride, float* lse, const Bf16* q, int64_t q_stride,
               const Bf16* k, const Bf16* v, const AttentionRows& rows, int heads, int kv_heads,
               int head_dim, float scale);
// kernels.h attention_pool, in double.
void attention_pool(float* pooled, const Bf16* q, int64_t q_stride, const Bf16* k, const float* lse,
                    const AttentionRows& rows, const int32_t* key_group, int num_groups, int heads,
                    int kv_heads, int head_dim, float scale);

// ---- logits (reference_logits.cpp) ----
void argmax(int32_t* out, const float* logits, int64_t rows, int64_t vocab);
void token_logprob(float* out, const float* logits, const int32_t* tokens, int64_t rows,
                   int64_t vocab);

}  // namespace keep::kernels::ref
