// CUDA kernels of the worker's CUDA backend: launchers. Storage is bf16 or fp32, arithmetic fp32.
// Each launcher takes outputs first, then inputs, sizes, and the stream last; it allocates nothing,
// never synchronises and never logs. It returns cudaErrorInvalidValue for bad sizes or null
// pointers (nothing launched), cudaSuccess with nothing launched for empty work, else the launch's
// error (cudaGetLastError). All pointers are device pointers. The CPU reference of each kernel is
// in reference.h, with the exact semantics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "services/worker/kernels/attention_schedule.h"  // PrefillKernel
#include "services/worker/kernels/layout.h"

namespace keep::kernels {

// Programmatic dependent launch (sm_90) for the layer kernels that take it: add_rmsnorm,
// qkv_finish, attention_prefill and our wgmma products (gemm.h). Such a kernel may start while
// the previous kernel of its stream finishes, and waits inside for that kernel's results, so its
// launch and set-up overlap the other's last blocks. Process-wide; on by default. Off serves A/B
// timing (bench_prefill --pdl off); results are the same either way.
void set_dependent_launch(bool on);
bool dependent_launch();

// residual (rows, cols) += x (rows, cols) (skipped when x is null); then out (rows, cols) =
// rmsnorm(residual) * weight (cols), eps inside the square root, all fp32. One block per row. out
// may equal x; out must not overlap residual.
cudaError_t rmsnorm_residual(float* out, float* residual, const float* x, const float* weight,
                             int64_t rows, int64_t cols, float eps, cudaStream_t stream);

// RoPE in place, HF half-split layout (services/worker/engine/core/rope.h): x (n, row_stride)
// holding (heads, head_dim) at the start of each row, row r rotated to positions[r] (n, int32) with
// inv_freq (head_dim / 2, fp32). head_dim must be even, row_stride >= heads * head_dim. Serves Q,
// K, and pre-RoPE K loaded from the cache alike.
cudaError_t rope(float* x, const int32_t* positions, const float* inv_freq, int64_t n,
                 int64_t heads, int64_t head_dim, int64_t row_stride, cudaStream_t stream);

// The loader's pass over cached rows (n, heads, head_dim), bf16: k_out = bf16(rope(float(k_pre),
// positions)) (the rotation of rope(), fp32, one rounding), v_out = v. k_pre and v may be device
// memory or host memory mapped for the device (the registered KV region: read in place). The
// outputs must not overlap the inputs; head_dim even.
cudaError_t load_kv_rope(__nv_bfloat16* k_out, __nv_bfloat16* v_out, const __nv_bfloat16* k_pre,
                         const __nv_bfloat16* v, const int32_t* positions, const float* inv_freq,
                         int64_t n, int64_t heads, int64_t head_dim, cudaStream_t stream);

// One run of cached rows for load_kv_runs: `count` bf16 rows (heads, head_dim) at k_pre / v
// (device or mapped host memory) into slots [slot, slot + count) of the layer view k_view / v_view
// ((capacity, heads, head_dim) bf16), at positions = slots. v null: K only (V already in place);
// k_pre may then be the view's own slots (k_pre == k_view + slot rows: rotated in place, each
// element read and written by one thread).
struct KvLoadRun {
  const __nv_bfloat16* k_pre;
  const __nv_bfloat16* v;
  __nv_bfloat16* k_view;
  __nv_bfloat16* v_view;
  int32_t slot;
  int32_t count;
};
// load_kv_rope over `n_runs` runs (the table in device memory; runs may go to different layers'
// views) in one launch of at most `max_blocks` blocks: the loader's kernel, which runs beside the
// layers on a few SMs. The runs' rows are one index space strided over the grid (a run of any
// length keeps every thread busy). With `vec` every source and view is 16-byte aligned and
// head_dim a multiple of 16: each thread moves 8 elements of each half with 16-byte accesses.
cudaError_t load_kv_runs(const KvLoadRun* runs, int32_t n_runs, const float* inv_freq,
                         int64_t heads, int64_t head_dim, int32_t max_blocks, bool vec,
                         cudaStream_t stream);

// ---- element-wise and normalisation kernels of the bf16 transformer block (misc.cu) ----
// The CUDA backend keeps the residual stream (engine hidden) in fp32 and feeds the matrix products
// bf16; these kernels sit at those boundaries.

// out (n, hidden) fp32 = table (vocab, hidden) bf16 [ids[t], :]; ids outside [0, vocab) give zero
// rows.
cudaError_t embedding(float* out, const __nv_bfloat16* table, const int32_t* ids, int64_t n,
                      int64_t hidden, int64_t vocab, cudaStream_t stream);
// The same with the ids on the host, carried in the kernel's parameters (no copy before the
// launch: a request's first GPU work is one API call): n <= kEmbedParamIds, else
// cudaErrorInvalidValue (copy the ids and use the form above).
constexpr int64_t kEmbedParamIds = 4096;  // 16 KB of parameters (the limit is 32 KB)
cudaError_t embedding_host_ids(float* out, const __nv_bfloat16* table, const int32_t* host_ids,
                               int64_t n, int64_t hidden, int64_t vocab, cudaStream_t stream);

// residual (rows, cols) fp32 += float(x) + bias, x (rows, cols) bf16, bias (cols) fp32 or null, in
// fp32 with no rounding (skipped when x is null); then, unless out is null,
// out (rows, cols) bf16 = bf16(weight[i] * (residual[i] * 1 / sqrt(mean(residual^2) + eps))).
// out may equal x. Both out and x null: nothing to do (cudaSuccess).
cudaError_t add_rmsnorm(__nv_bfloat16* out, float* residual, const __nv_bfloat16* x,
                        const float* bias, const float* weight, int64_t rows, int64_t cols,
                        float eps, cudaStream_t stream);

// out (n, cols) fp32 = in[rows[i], :] (in: (>= max(rows)+1, cols) fp32); rows (n) device int32.
cudaError_t gather_rows(float* out, const float* in, const int32_t* rows, int64_t n, int64_t cols,
                        cudaStream_t stream);

// out (rows, inter) bf16 = bf16(silu(gate) * up), gate_up (rows, 2 * inter) bf16 holding
// [gate | up] per row (the fused gate/up projection's output).
cudaError_t swiglu_rows(__nv_bfloat16* out, const __nv_bfloat16* gate_up, int64_t rows,
                        int64_t inter, cudaStream_t stream);

// After the fused QKV projection: qkv (rows, (heads + 2 * kv_heads) * head_dim) bf16 holds [q | k |
// v] per row, without bias. For each row r (position positions[r], view slot slots[r]):
//   q (in place, bf16)     = bf16(rope(float(q) + bq, positions[r]))
//   k_pre[r] (fp32)        = float(k) + bk                (skipped when k_pre is null)
//   v_out[r] (fp32)        = float(v) + bv                (skipped when v_out is null)
//   kv_k[slots[r]] (bf16)  = bf16(rope(float(k) + bk, positions[r]))   (fp32 RoPE, as ref::rope)
//   kv_v[slots[r]] (bf16)  = bf16(float(v) + bv)
// bq/bk/bv (fp32) may be null (no bias). kv_k / kv_v: (capacity, kv_heads, head_dim). positions,
// slots: (rows) device int32. inv_freq: (head_dim / 2) fp32.
cudaError_t qkv_finish(__nv_bfloat16* qkv, float* k_pre, float* v_out, __nv_bfloat16* kv_k,
                       __nv_bfloat16* kv_v, const float* bq, const float* bk, const float* bv,
                       const int32_t* positions, const int32_t* slots, const float* inv_freq,
                       int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       cudaStream_t stream);

// out (n) = values uniform in [lo, hi) from a counter-based hash of (seed, index): the same bits on
// every device and in ref::fill_uniform, never all zeros. For random model weights.
cudaError_t fill_uniform(__nv_bfloat16* out, int64_t n, uint64_t seed, float lo, float hi,
                         cudaStream_t stream);
cudaError_t fill_uniform(float* out, int64_t n, uint64_t seed, float lo, float hi,
                         cudaStream_t stream);

// ---- few-row products (gemv.cu) ----
// y (rows, y_stride) = x (rows, x_stride) bf16 · W^T, W (out, in) bf16 row-major, fp32
// accumulation, for 1 <= rows <= kGemvMaxRows (decode steps): gemv writes bf16(y); gemv_accumulate
// adds into an fp32 y (y += x W^T). Needs in % 8 == 0, x_stride % 8 == 0 and x, W 16-byte aligned,
// else cudaErrorInvalidValue (the caller falls back to cuBLAS). Reference: ref::gemv.
constexpr int64_t kGemvMaxRows = 8;
cudaError_t gemv(__nv_bfloat16* y, int64_t y_stride, const __nv_bfloat16* x, int64_t x_stride,
                 const __nv_bfloat16* w, int64_t rows, int64_t out, int64_t in,
                 cudaStream_t stream);
cudaError_t gemv_accumulate(float* y, int64_t y_stride, const __nv_bfloat16* x, int64_t x_stride,
                            const __nv_bfloat16* w, int64_t rows, int64_t out, int64_t in,
                            cudaStream_t stream);
// y (rows, y_stride) bf16 = x W^T with x = add_rmsnorm's normalisation of fp32 residual rows
// (x[r, i] = bf16(norm_weight[i] * (residual[r, i] * 1 / sqrt(mean(residual[r]^2) + eps)))): the
// norm before a decode step's QKV or gate/up product, fused into it. Each block normalises the
// rows into shared memory (rows * in * 2 bytes, at most kGemvNormMaxSmem); needs in % 8 == 0,
// residual_stride % 4 == 0 and residual, norm_weight, W 16-byte aligned, else
// cudaErrorInvalidValue. Reference: ref::add_rmsnorm then ref::gemv.
constexpr size_t kGemvNormMaxSmem = 48 * 1024;
cudaError_t gemv_rmsnorm(__nv_bfloat16* y, int64_t y_stride, const float* residual,
                         int64_t residual_stride, const float* norm_weight, float eps,
                         const __nv_bfloat16* w, int64_t rows, int64_t out, int64_t in,
                         cudaStream_t stream);
// fp32 x and y, bf16 W (the logits: fp32 normed rows times bf16 lm_head, nothing rounded but W).
cudaError_t gemv(float* y, int64_t y_stride, const float* x, int64_t x_stride,
                 const __nv_bfloat16* w, int64_t rows, int64_t out, int64_t in,
                 cudaStream_t stream);

// Storage conversion, out (n) = in (n), rounding to nearest even for bf16.
cudaError_t convert(__nv_bfloat16* out, const float* in, int64_t n, cudaStream_t stream);
cudaError_t convert(float* out, const __nv_bfloat16* in, int64_t n, cudaStream_t stream);

// ---- attention (attention_prefill.cu, attention_decode.cu, attention_pool.cu) ----
// Shared semantics (ref::attention): for row r, head h (kv head g = h / (heads / kv_heads)) and the
// keys t the row sees (AttentionRows),
//   s_t = (q[r, h, :] · k[t, g, :]) * scale          (fp32 from the stored values)
//   lse[r, h] = log Σ_t exp(s_t)                      (natural log; -inf when no key)
//   out[r, h, :] = Σ_t exp(s_t - lse) v[t, g, :]      (0 when no key)
// q: (rows, q_stride) bf16, heads * head_dim used at the start of each row (rotated Q, e.g. inside
// the fused qkv buffer); k, v: (num_keys, kv_heads, head_dim) bf16 (the KV view); out: (rows,
// out_stride) bf16; lse (rows, heads) fp32 or null. heads % kv_heads == 0.

// Whether the current device runs our wgmma code: this library was built for sm_90a
// (KEEP_KERNELS_SM90A, CMAKE_CUDA_ARCHITECTURES naming 90a) and the device is compute 9.0.
bool wgmma_available();

// Split-key runs of attention_prefill (attention_schedule.h, prefill_key_splits): a device
// workspace (256-byte aligned, prefill_split_bytes for the splits used; a caller reserves
// prefill_split_max_bytes) and the splits: 0 = chosen by prefill_key_splits (and, for kAuto, the
// wgmma kernel, or mma.sync, instead of the wide one when it splits); 1 = never; n > 1 = n runs
// with any kernel but kWgmmaWide (tests, benchmarks). No workspace: never split.
struct PrefillSplit {
  void* workspace = nullptr;
  size_t bytes = 0;
  int splits = 0;
};

// Tiled flash-style kernel (tensor cores), for any number of rows; schedule from
// build_prefill_schedule over the same rows. head_dim 64 or 128 (else cudaErrorInvalidValue);
// a split asked for without room in its workspace, or with kWgmmaWide: cudaErrorInvalidValue.
cudaError_t attention_prefill(__nv_bfloat16* out, int64_t out_stride, float* lse,
                              const __nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* k,
                              const __nv_bfloat16* v, const AttentionRows& rows,
                              const PrefillSchedule& schedule, int heads, int kv_heads,
                              int head_dim, float scale, cudaStream_t stream,
                              PrefillKernel kernel = PrefillKernel::kAuto,
                              const PrefillSplit& split = {});

// attention_prefill and the pooling of attention_pool_tiled in one pass (the wide kernel,
// PrefillKernel::kWgmmaWide, unsplit): out and lse as attention_prefill's with that kernel, and
// pooled (rows, num_groups) fp32 as attention_pool's, from the kernel's bf16 P (relative error
// ~2^-8 per key) but summed in fp32 from there (attention_pool_tiled also rounds each head's sums
// to bf16). Where that kernel cannot run -- no wgmma or tensor-map encoder, num_groups above
// kPoolFusedMaxGroups, Q, K or V not 16-byte aligned, no keys, `kernel` neither kAuto nor
// kWgmmaWide -- cudaErrorNotSupported before anything is launched: the caller then runs
// attention_prefill and attention_pool_tiled. scratch: device memory of
// attention_prefill_pool_scratch_bytes() bytes, 16-byte aligned (attention_pool_tiled's scratch
// for the same rows is as large at head_dim 128).
constexpr int kPoolFusedMaxGroups = 64;
size_t attention_prefill_pool_scratch_bytes(int64_t rows, int heads);
cudaError_t attention_prefill_pool(__nv_bfloat16* out, int64_t out_stride, float* lse,
                                   float* pooled, const __nv_bfloat16* q, int64_t q_stride,
                                   const __nv_bfloat16* k, const __nv_bfloat16* v,
                                   const AttentionRows& rows, const PrefillSchedule& schedule,
                                   const int32_t* key_group, int num_groups, int heads,
                                   int kv_heads, int head_dim, float scale, void* scratch,
                                   size_t scratch_bytes, cudaStream_t stream,
                                   PrefillKernel kernel = PrefillKernel::kAuto);

// Split-key kernel for few rows (decode steps, short candidate batches): the keys of each row are
// cut into chunks processed by separate blocks, then combined. Correct for any rows, fast for few.
// workspace: device fp32 scratch of attention_decode_workspace_floats(rows, heads, head_dim,
// num_keys) floats. head_dim a multiple of 32, at most 256.
size_t attention_decode_workspace_floats(int64_t rows, int heads, int head_dim, int64_t num_keys);
cudaError_t attention_decode(__nv_bfloat16* out, int64_t out_stride, float* lse,
                             const __nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, const AttentionRows& rows, int heads,
                             int kv_heads, int head_dim, float scale, float* workspace,
                             size_t workspace_floats, cudaStream_t stream);

// Importance pooling (ARCHITECTURE §5): pooled (rows, num_groups) fp32, overwritten,
//   pooled[r, g] = Σ_h Σ_{t seen by r, key_group[t] == g} exp(s_t(r, h) - lse[r, h])
// with s_t as above and lse from the attention call over the same rows. key_group (num_keys)
// device int32; a key whose group is outside [0, num_groups) (-1: in no group) is skipped. head_dim
// a multiple of 32, at most 256.
cudaError_t attention_pool(float* pooled, const __nv_bfloat16* q, int64_t q_stride,
                           const __nv_bfloat16* k, const float* lse, const AttentionRows& rows,
                           const int32_t* key_group, int num_groups, int heads, int kv_heads,
                           int head_dim, float scale, cudaStream_t stream);

// The same pooled values on tensor cores: attention_prefill run again over the same rows and
// schedule with V replaced by the one-hot code of each key's group (v[t, :, e] = 1 where
// key_group[t] == base + e), so that its output for head h, column e is Σ_{t in group base + e}
// exp(s_t - lse) — the pooling — then summed over heads in fp32. One such pass per head_dim groups.
// The probabilities go through the kernel's bf16 P and its bf16 output (relative error ~2^-8 per
// head and group, where attention_pool is fp32 throughout); head_dim 64 or 128. scratch: device
// memory of attention_pool_tiled_scratch_bytes() bytes (16-byte aligned); split as for
// attention_prefill (its workspace may be the attention call's: the two run one after the other).
size_t attention_pool_tiled_scratch_bytes(int64_t rows, int64_t num_keys, int heads, int kv_heads,
                                          int head_dim);
cudaError_t attention_pool_tiled(float* pooled, const __nv_bfloat16* q, int64_t q_stride,
                                 const __nv_bfloat16* k, const AttentionRows& rows,
                                 const PrefillSchedule& schedule, const int32_t* key_group,
                                 int num_groups, int heads, int kv_heads, int head_dim, float scale,
                                 void* scratch, size_t scratch_bytes, cudaStream_t stream,
                                 PrefillKernel kernel = PrefillKernel::kAuto,
                                 const PrefillSplit& split = {});

// ---- logits (logits.cu): greedy and scoring over fp32 logits (rows, vocab) ----
// out (rows) = index of the largest logit of each row, lowest index on ties, NaN never wins (an
// all-NaN row gives 0) — engine::argmax's rule.
cudaError_t argmax(int32_t* out, const float* logits, int64_t rows, int64_t vocab,
                   cudaStream_t stream);

// out (rows) = logits[r, tokens[r]] - log Σ_i exp(logits[r, i]) (fp32 result, accumulated with a
// running max in fp32). tokens (rows) device int32, each in [0, vocab): a token outside gives NaN,
// as does a row holding a NaN logit; an infinite max m gives logits[r, tokens[r]] - m.
cudaError_t token_logprob(float* out, const float* logits, const int32_t* tokens, int64_t rows,
                          int64_t vocab, cudaStream_t stream);

}  // namespace keep::kernels
