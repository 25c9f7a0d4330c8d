// Engine: the layer-level API of the LLM, over any Backend, plus the whole-model calls built on it.
//
// The paper's three interfaces map to:
//   load KV for a layer        load_kv(view, first_slot, positions, k_pre, v): a run of slots from
//                              pre-RoPE K (rotated to `positions` on the way) and V.
//   prefill a layer over KV    prefill_layer(layer, hidden, view, plan, extras): the rows of an
//                              AttentionLayout (attention_layout.h) through one block, returning
//                              their new pre-RoPE K and V, and per-row log-sum-exp.
//   importance from attention  extras.pooled: Σ_heads Σ_{t in segment g} p[row, head, t] per row
//                              and segment, plus extras.lse to recompute any single probability.
// A request runs: embed → plan(layout) → for each layer: load_kv(...) for loaded slots, then
// prefill_layer → logits(rows) → sample or score. Every argument is checked here (token ids, sizes,
// layout invariants) and reported as a Status with context; the backend only executes.
//
// Buffers passed as DeviceBuffer live in the backend's memory (engine.backend().allocate()).
// Not thread-safe: one Engine serves one request at a time (its backend owns one workspace).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "services/worker/engine/core/attention_layout.h"
#include "services/worker/engine/core/backend.h"
#include "services/worker/engine/core/replay_cache.h"
#include "services/worker/engine/core/sampling.h"
#include "shared/common/status.h"
#include "shared/model/model_config.h"

namespace keep::engine {

// Rotated K and V of every layer for up to `capacity` slots, in backend memory: the KV of one
// sequence (decode) or the working view of one request (recompute + load).
class KvCache {
 public:
  static Result<KvCache> create(Backend& backend, int32_t capacity);

  int32_t capacity() const { return capacity_; }
  int32_t num_layers() const { return static_cast<int32_t>(k_.size()); }
  // Slots [0, size) are filled (prefill / decode_step append after them).
  int32_t size() const { return size_; }
  void set_size(int32_t size) { size_ = size; }
  KvView layer(int32_t i) const { return KvView{k_[i].data(), v_[i].data(), capacity_, type_}; }
  KvType type() const { return type_; }
  // Unique among the caches of this process (the engine's recorded prefills are keyed by it).
  uint64_t id() const { return id_; }

 private:
  uint64_t id_ = 0;
  std::vector<DeviceBuffer> k_;  // per layer (capacity, kv_heads, head_dim)
  std::vector<DeviceBuffer> v_;
  int32_t capacity_ = 0;
  int32_t size_ = 0;
  KvType type_ = KvType::kF32;
};

// Optional outputs of prefill_layer (null = not wanted). Sizes are checked against the plan.
struct LayerExtras {
  DeviceBuffer* k_pre = nullptr;   // >= (rows, kv_heads, head_dim)
  DeviceBuffer* v = nullptr;       // >= (rows, kv_heads, head_dim)
  DeviceBuffer* lse = nullptr;     // >= (rows, heads)
  DeviceBuffer* pooled = nullptr;  // >= (rows, num_groups); needs layout.num_groups > 0
  // Only the last out_rows rows' hidden output is wanted (-1: all, 0: none -- K/V only); the other
  // rows of `hidden` are left unspecified and the backend may skip their MLP (LayerOutputs).
  int32_t out_rows = -1;
  // Copy `pooled` to the host early (LayerOutputs::pooled_to_host); read it with read_pooled().
  bool pooled_to_host = false;
  // Rows chosen after the attention (LayerOutputs::choose_rows): called inside the layer, it may
  // read_pooled(); the rows it returns are checked (kInvalidArgument) and only they run the MLP,
  // their outputs packed into `chosen_hidden` (>= (rows, hidden), not `hidden`) in that order.
  std::function<Result<std::vector<int32_t>>()> choose_rows;
  DeviceBuffer* chosen_hidden = nullptr;
};

struct GenerateOptions {
  int32_t max_tokens = 32;
  SamplingParams sampling;           // temperature 0 = greedy
  bool stop_at_eos = true;           // stop after emitting one of config.eos_token_ids
  std::vector<int32_t> stop_tokens;  // more tokens that end generation (emitted, then stop)
  // Whether emitting `token` ends generation (`eos`: the model's end-of-sequence ids).
  bool stops_at(int32_t token, std::span<const int32_t> eos) const;
};

struct CandidateScore {
  double log_prob = 0.0;  // Σ_i log p(candidate[i] | prompt, candidate[<i])
  int32_t tokens = 0;
};

class Engine {
 public:
  // `max_rows`: rows per layer call the workspace is first sized for (prefill chunk length).
  static Result<std::unique_ptr<Engine>> create(std::unique_ptr<Backend> backend,
                                                int32_t max_rows = 512);

  const ModelConfig& config() const { return backend_->config(); }
  Backend& backend() { return *backend_; }
  int32_t max_rows() const { return max_rows_; }

  // ---- layer-level API ----
  // A zero-filled (rows, hidden) buffer.
  Result<DeviceBuffer> allocate_hidden(int32_t rows);
  // hidden (n, C) = embeddings of `tokens` (each in [0, vocab)).
  Status embed(DeviceBuffer& hidden, std::span<const int32_t> tokens);
  // Validates `layout`, sizes the workspace for it, and returns the backend's plan.
  Result<std::unique_ptr<AttentionPlan>> plan(const AttentionLayout& layout);
  // Copies a run of `positions.size()` loaded tokens into slots [first_slot, ...) of one layer's
  // view: V as is, K rotated from pre-RoPE to `positions`. k_pre / v: (n, kv_heads, head_dim),
  // host memory (the KV region) or backend memory.
  Status load_kv(const KvView& kv, int32_t first_slot, std::span<const int32_t> positions,
                 const float* k_pre, const float* v);
  // load_kv from bf16 rows (uint16 bits), as the shared region stores them (Backend::load_kv_bf16).
  Status load_kv_bf16(const KvView& kv, int32_t first_slot, std::span<const int32_t> positions,
                      const uint16_t* k_pre, const uint16_t* v);
  // Runs of bf16 rows into their layers' views at once, each at positions equal to its slots
  // (Backend::load_kv_bf16_runs), ordered with the layer calls.
  Status load_kv_bf16_runs(std::span<const Backend::KvRun> runs);
  // The same beside the layer calls (Backend::queue_kv_bf16_runs): a layer that reads them must
  // follow wait_queued(its layer); fence_queue() at a request's start (Backend::fence_queue).
  Status queue_kv_bf16_runs(std::span<const Backend::KvRun> runs);
  void wait_queued(int32_t layer) { backend_->wait_queued(layer); }
  void fence_queue() { backend_->fence_queue(); }
  // One block for the plan's rows: hidden (rows, C) in place; new rotated K/V go into `kv` at the
  // rows' slots; `extras` receive pre-RoPE K, V, lse, pooled attention.
  Status prefill_layer(int32_t layer, DeviceBuffer& hidden, const KvView& kv,
                       const AttentionPlan& plan, const LayerExtras& extras = {});
  // The pooled output of the last prefill_layer into dst (floats), host memory.
  Status read_pooled(float* dst, const DeviceBuffer& pooled, size_t floats);
  // Final norm + lm_head for chosen rows of `hidden`: host (rows.size(), vocab).
  Result<std::vector<float>> logits(const DeviceBuffer& hidden, std::span<const int32_t> rows);

  // ---- whole-model calls ----
  // Appends `tokens` to the cache causally (positions = slots), in chunks of max_rows; returns the
  // logits of the last token (vocab). A long chunk that recurs (same cache, size before it, length)
  // is recorded on its second run where the backend records launches (the CUDA backend with graphs
  // on) and replayed from its third, its new tokens embedded first (replay_cache.h).
  Result<std::vector<float>> prefill(KvCache& cache, std::span<const int32_t> tokens);
  // One token at slot cache.size(); returns its logits.
  Result<std::vector<float>> decode_step(KvCache& cache, int32_t token);
  // Prefill + up to max_tokens new tokens (greedy or sampled). Returns the new tokens only.
  Result<std::vector<int32_t>> generate(std::span<const int32_t> prompt,
                                        const GenerateOptions& options);
  // Σ log-probs of each candidate continuation after `prompt` (non-empty). The prompt is
  // prefilled once; all candidates then run in one batched call, each an independent block after
  // the prompt at positions prompt.size() + i. Empty candidates score 0.
  Result<std::vector<CandidateScore>> score_candidates(
      std::span<const int32_t> prompt, const std::vector<std::vector<int32_t>>& candidates);
  // The same after a prompt already in `cache` (slots [0, cache.size())), whose last token gave
  // `last_logits` (vocab): the candidates' blocks go into the slots after it, which must fit in
  // the cache; cache.size() is left as it was.
  Result<std::vector<CandidateScore>> score_after(
      KvCache& cache, std::span<const float> last_logits,
      const std::vector<std::vector<int32_t>>& candidates);

 private:
  Status check_runs(std::span<const Backend::KvRun> runs) const;
  Status check_load(const KvView& kv, int32_t first_slot, int64_t n, const void* k_pre,
                    const void* v) const;
  explicit Engine(std::unique_ptr<Backend> backend) : backend_(std::move(backend)) {}
  Status ensure_rows(int32_t rows);
  // Runs `tokens` through every layer into the cache (chunks of max_rows); returns the row of the
  // last token in hidden_.
  Result<int32_t> run_prefill(KvCache& cache, std::span<const int32_t> tokens);
  // run_prefill, then the greedy next token, picked on the backend.
  Result<int32_t> prefill_greedy(KvCache& cache, std::span<const int32_t> tokens);

  std::unique_ptr<Backend> backend_;
  int32_t max_rows_ = 0;
  DeviceBuffer hidden_;       // (max_rows, C) for the whole-model calls
  DeviceBuffer logits_;       // (kLogitRows, vocab)
  ReplayCache replay_cache_;  // prefill chunks recorded for replay
  // Runs one causal chunk of `n` rows at the cache's size through every layer (embedding done).
  Status prefill_chunk(KvCache& cache, int32_t n, bool last_chunk);
};

}  // namespace keep::engine
