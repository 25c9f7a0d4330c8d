// KvAssembler: runs one planning prompt through the engine layer by layer as a RecomputePlan says,
// loading the KV of reused segments and computing the rest (ARCHITECTURE §4), and computes the KV
// of new entries (KV production). Functions over the engine's layer API, no CUDA here.
//
// It owns one working KvCache whose slots [0, P) hold the system prefix's KV for the assembler's
// life (computed once at creation: the exact prefix cache), so a prompt must begin with the prefix
// tokens. After prefill() every slot of the prompt holds K/V at every layer (computed or loaded),
// ready for decode steps and candidate scoring after it.
//
// Entries (SegmentKv::bytes) are read where they lie -- keep-worker passes the shared region's
// mapping itself, registered for the GPU -- and only during prefill(): the caller opens a seqlock
// read section per entry before the call and validates it after (every load has completed once
// prefill() returns); an entry that changed meanwhile is passed as not loadable in a second
// prefill (PlanService::complete).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "services/worker/engine/core/engine.h"
#include "services/worker/keep/kv_entry.h"
#include "services/worker/keep/recompute_plan.h"
#include "shared/common/status.h"

namespace keep::worker {

// The reusable KV of one segment: rows [first_row, first_row + tokens) of an entry's bytes.
struct SegmentKv {
  std::span<const std::byte> bytes;  // the whole entry (in the region), or empty: not loadable
  EntryGeometry geometry;
  int32_t first_row = 0;
  // The same bytes in device memory (a device KV tier), or empty: loads read them there instead;
  // host-side reads (CacheBlend's deviation check, fp32 entries) still use `bytes`.
  std::span<const std::byte> device;
};

struct PromptSegment {
  std::vector<int32_t> tokens;
  SegmentKv kv;
};

struct AssembleRequest {
  std::vector<PromptSegment> segments;  // after the system prefix, in prompt order
  std::vector<int32_t> query;           // after the last segment: instruction, history, template
  Method method = Method::kKeep;
  MethodKnobs knobs;
};

struct AssembleStats {
  int32_t prompt_tokens = 0;
  int32_t memory_tokens = 0;
  int32_t cached_prefix = 0;  // slots reused from the device (prefix / prefix cache)
  std::vector<int32_t> recomputed_per_layer;  // memory tokens computed at each layer
  double recompute_ratio = 1.0;
  uint64_t bytes_loaded = 0;  // entry bytes read into the working view
  int32_t segments_loadable = 0;
  std::vector<int32_t> check_layers;
  std::vector<int32_t> hops;  // keep: importance hops at each check layer
  // keep: the pooled attention's columns at each check layer (the segments computed there).
  std::vector<int32_t> pooled_columns;
  // keep with choose_early: rows whose MLP the check layers skipped (their segments deselected).
  int64_t mlp_rows_skipped = 0;
  // keep, per check layer (as check_layers): the host's wait for the pooled columns, then its
  // decision (importance, the next layer's plan), in microseconds. With choose_early the GPU
  // waits for what of these outlasts the layer's o_proj.
  std::vector<double> check_wait_us, check_decide_us;
};

struct Prefilled {
  std::vector<float> last_logits;  // (vocab) after the prompt's last token
  AssembleStats stats;
};

// How a request's loads run (layer-balanced loading, ARCHITECTURE §5; LoadSchedule).
struct LoadOptions {
  // Beside the layers on the backend's loader (Backend::queue_kv_bf16_runs); false: each layer's
  // loads on the compute stream right before it (the sequential baseline).
  bool queue = true;
  // Bytes of loads queued for layers beyond the next one: how far the loader runs ahead. Loads
  // land in the working cache itself (no staging); the budget bounds how long the loads of
  // segments a later check excludes wait behind those already queued (budget / link bandwidth).
  // On the H200 (14B, 40 segments) 0 and 32 MiB are within 3 % of each other, 1 GiB is slower:
  // prefetched layers take SMs from the compute (benchmarks/RESULTS.md).
  uint64_t prefetch_bytes = uint64_t{32} << 20;
  // The budget before a layer that recomputes memory rows (KEEP's and CacheBlend's early layers):
  // those layers are compute-bound, so loads run ahead of them hide behind their compute instead
  // of being left to the query-only layers, which are load-bound. On the H100 (14B, 40 segments) 1
  // GiB with gemm_leave_loader took keep ~0.15 from 47.4-48.1 to 45.8 ms, while the same budget on
  // every layer slowed full_reuse 19.8 -> 21.7 (benchmarks/RESULTS.md run 13). As this per-layer
  // rule: keep ~0.15 47.2-47.6 -> 45.4-45.5 ms, full_reuse unchanged, keep d = 0.96 ~2 % slower
  // (run 14).
  uint64_t prefetch_bytes_recomputing = uint64_t{1} << 30;
  // Ablation (issue 30): false rotates a loaded K to the positions it was produced at instead of
  // the prompt's -- what storing K after RoPE without correcting it gives. Loads then go one run
  // at a time on the compute stream (positions per run). Never for serving.
  bool position_correction = true;
};

// How KV entries are produced (KvAssembler::produce).
struct ProduceOptions {
  // Ablation (issue 30): false computes a segment's KV without the system prefix in front (its
  // first token then takes the attention-sink role). Never for serving.
  bool with_prefix = true;
};

class KvAssembler {
 public:
  // Prefills `prefix` (non-empty) into a working cache of `capacity` slots.
  static Result<std::unique_ptr<KvAssembler>> create(engine::Engine& engine,
                                                     std::vector<int32_t> prefix, int32_t capacity);

  const std::vector<int32_t>& prefix() const { return prefix_; }
  void set_load_options(const LoadOptions& options) { load_options_ = options; }
  void set_produce_options(const ProduceOptions& options) { produce_options_ = options; }
  const LoadOptions& load_options() const { return load_options_; }
  const ProduceOptions& produce_options() const { return produce_options_; }
  // keep: a pooled column for every segment of the prompt instead of only for those computed at
  // the layer (importance reads no other): the same selections from a wider pooling. For tests.
  void set_pool_every_segment(bool on) { pool_every_segment_ = on; }
  // keep: at a check layer, decide the next layer's segments inside the layer, after its attention
  // (LayerExtras::choose_rows), and run the MLP only for the rows that go on -- a deselected
  // segment's MLP output is never read. Off: the whole layer runs, and the host decides while
  // its MLP does. The selections, and so the outputs, are the same either way. On by default:
  // keep ~0.15 at 14B 43.0 -> 41.4-41.9 ms at 40 segments, 80.0 -> 75.6 at 80 (H100,
  // benchmarks/RESULTS.md run 18); on the CPU it is only less work.
  void set_choose_early(bool on) { choose_early_ = on; }
  bool choose_early() const { return choose_early_; }
  int32_t capacity() const { return cache_.capacity(); }
  // The working cache: after prefill(), size() = the prompt's tokens; decode steps append.
  engine::KvCache& cache() { return cache_; }

  Result<Prefilled> prefill(const AssembleRequest& request);
  // After prefill(): up to options.max_tokens new tokens (decode steps appended to the cache), as
  // Engine::generate picks them (greedy or seeded sampling; EOS and stop tokens end it).
  Result<std::vector<int32_t>> generate(const Prefilled& prefilled,
                                        const engine::GenerateOptions& options);
  // After prefill(): Σ log-probs of each candidate continuation (Engine::score_after).
  Result<std::vector<engine::CandidateScore>> score(
      const Prefilled& prefilled, const std::vector<std::vector<int32_t>>& candidates);

  // KV production: runs [prefix][tokens] causally and hands each layer's pre-RoPE K and V of the
  // tokens (fp32, (tokens, kv_heads, head_dim), host memory) to `sink`, layer by layer. A static
  // group passes its members' tokens one after another; a dynamic segment its own.
  using LayerSink = std::function<Status(int32_t layer, const float* k_pre, const float* v)>;
  Status produce(std::span<const int32_t> tokens, const LayerSink& sink);
  // The sink that writes every layer's rows into an entry (all of its g.tokens rows); `entry`
  // must outlive the production.
  static LayerSink entry_writer(std::span<std::byte> entry, const EntryGeometry& g);
  // The same in steps, so that a planner request waits for at most one step of a background job:
  // begin_produce() embeds and plans; produce_layers() runs up to `layers` more layers and
  // returns true once the last has gone to `sink`. A prefill() in between abandons it.
  Status begin_produce(std::span<const int32_t> tokens);
  Result<bool> produce_layers(int32_t layers, const LayerSink& sink);

 private:
  KvAssembler(engine::Engine& engine, engine::KvCache cache, std::vector<int32_t> prefix)
      : engine_(engine), cache_(std::move(cache)), prefix_(std::move(prefix)) {}
  Status ensure_buffers();

  engine::Engine& engine_;
  engine::KvCache cache_;
  std::vector<int32_t> prefix_;
  LoadOptions load_options_;
  ProduceOptions produce_options_;
  bool pool_every_segment_ = false;
  bool choose_early_ = true;
  std::vector<float> pooled_host_;  // a check layer's pooled attention, read on the host
  // Tokens whose KV in the cache equals a full prefill's, for `prefix` (vLLM-style) reuse.
  std::vector<int32_t> exact_;
  engine::DeviceBuffer hidden_[2];  // (capacity, C): ping-pong as the computed rows shrink
  engine::DeviceBuffer k_pre_, v_;  // (capacity, kv_dim)
  engine::DeviceBuffer pooled_;     // (capacity, pooled columns)
  size_t pooled_columns_ = 0;
  struct Production {
    int32_t tokens = 0;
    int32_t next_layer = 0;
    std::unique_ptr<engine::AttentionPlan> plan;
  };
  std::optional<Production> production_;
};

}  // namespace keep::worker
