// CudaBackend: the engine's layer computations on one NVIDIA GPU, bf16 weights and matrix-product
// operands with fp32 accumulation (cuBLAS), our own kernels for the rest (services/worker/kernels).
//
// Precision plan. Weights: bf16 (norm weights and biases fp32). The residual stream -- the
// engine's hidden buffers -- stays fp32 between layers and inside them: o_proj and down_proj add
// their products straight into it in fp32 (cuBLAS beta = 1, fp32 C), so neither a sublayer's output
// nor the residual is ever rounded to bf16; what feeds a matrix product is rounded to bf16 once.
// The KV view is bf16 (kv_type()): K is rotated in fp32 and rounded once, and the attention, decode
// and pooling kernels all read the same values. The pre-RoPE K and V handed out for the KV store
// are fp32. Logits: fp32 normed rows times the bf16 lm_head by default
// (CudaBackendOptions::logits).
//
// Memory. All weights live in one device allocation made at creation; the workspace (activations
// of one layer call, the decode-attention scratch, the cuBLAS workspace) is allocated by reserve()
// and only grows there. A request's plan uploads its index arrays (slots, positions, spans, the
// prefill tile schedule) once into stream-ordered pool memory, at its first use (after the first
// layer's QKV launch); the layer loop then only launches.
// One stream for all work, and a second one only for final_logits_to_host's copies. Every launcher
// is asynchronous except copy_to_host, final_logits_to_host, argmax, token_logprob and
// synchronize.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "services/worker/engine/core/backend.h"
#include "services/worker/kernels/gemm.h"
#include "services/worker/kernels/kernels.h"
#include "shared/model/model_weights.h"

namespace keep::engine {

struct CudaBackendOptions {
  int device = 0;
  // Rows up to which attention uses the split-key decode kernel instead of the tiled one: the
  // crossover on the H200 lies between 8 and 16 rows (benchmarks/RESULTS.md).
  int32_t decode_rows = 8;
  // How the logits are made (final norm + lm_head); they are fp32 in every mode.
  enum class Logits : uint8_t {
    // fp32 normed rows times the bf16 lm_head on our gemv, fp32 accumulation: only the weights are
    // rounded; reads vocab x hidden x 2 bytes per step. Rows in groups of kernels::kGemvMaxRows.
    kF32Rows,
    // fp32 normed rows times an fp32 copy of lm_head (cuBLAS, no TF32): nothing rounded; the copy
    // costs vocab x hidden x 4 bytes more memory and twice kF32Rows's reads per step.
    kF32,
    // bf16 normed rows times the bf16 lm_head (cuBLAS), like the blocks' products.
    kBF16,
  };
  Logits logits = Logits::kF32Rows;
  // Rows up to which the block's products run on our few-row kernel (kernels::gemv) instead of
  // cuBLAS; 0 = always cuBLAS. Needs every product's `in` to be a multiple of 8 (else cuBLAS).
  // gemv beats cuBLAS on the H200 at 1 and 2 rows and loses from 4 (benchmarks/RESULTS.md).
  int32_t gemv_rows = 2;
  // Products of more rows than gemv_rows and at most this many (at most 128: one CTA tile's) run
  // on our wgmma kernels in one-CTA clusters -- QKV on gemm_wgmma, o_proj and down accumulated on
  // gemm_wgmma_accumulate, gate/up with the SwiGLU fused on gemm_swiglu -- where wgmma_available()
  // and the shapes fit, their grid leaving loader_blocks SMs to the loader; else (0) cuBLAS. Off
  // by default: on every SM they kept the loader waiting and made a 14B KEEP request slower
  // (benchmarks/RESULTS.md, bench_keep --own-few-rows).
  int32_t own_few_rows = 0;
  // Our persistent products of many rows too (the tuner's gemm_wgmma picks, gemm_swiglu from
  // fused_swiglu_rows) leave loader_blocks SMs to the loader, as own_few_rows's do, in a layer
  // enqueued while a queued load has not ended (a request without loads, `full`, keeps every
  // SM); false: their grid takes every SM, and a load queued beside them waits for the product
  // to end. A/B in bench_keep --gemm-leave-loader (benchmarks/RESULTS.md, run 14).
  bool gemm_leave_loader = true;
  // cuBLAS's products (gemm_nt and the tuner's cuBLASLt picks) chosen and sized for the SMs the
  // loader leaves (cublasSetSmCountTarget); false: for every SM. A/B in bench_keep
  // --blas-leave-loader.
  bool blas_leave_loader = false;
  // CUDA graphs for recurring prefill chunks (Engine::prefill, replay_cache.h: a chunk of 64 rows
  // or more whose key -- cache, size before it, length -- comes again is recorded on its second run
  // and replayed from its third: its first layer kernel by kernel, the others as two graph
  // launches, instead of ~10 launches a layer): less host time per prefill (benchmarks/RESULTS.md
  // run 23). Everything else runs kernel by kernel either way: capturing a layer loop on every
  // call costs more than it saves (run 3).
  bool graphs = true;
  // The tiled prefill attention kernel (kernels.h PrefillKernel): kAuto = wgmma on Hopper (an
  // sm_90a build; one K buffer and three blocks an SM for launches of kPrefillOneKMinBlocksPerSm
  // blocks an SM or more, the two-warpgroup kernel from kPrefillWideMinKeys keys on), mma.sync
  // elsewhere; kMma, kWgmma, kWgmmaOneK or kWgmmaWide to compare them (a wgmma kernel where it
  // cannot run: the backend's creation fails with kUnavailable).
  kernels::PrefillKernel prefill_attention = kernels::PrefillKernel::kAuto;
  // Steps of at least this many rows run the MLP's gate/up product with the SwiGLU fused into it
  // (kernels::gemm_swiglu: our wgmma kernel, where wgmma_available() and the model's intermediate
  // size is a multiple of 128 and hidden of 64); fewer rows, and other devices, take cuBLAS and
  // swiglu_rows. 0 = never. On the H200 the fused kernel wins from 512 rows on; fewer rows fill its
  // 256-row tiles too unevenly for it to win reliably (benchmarks/RESULTS.md run 8).
  int32_t fused_swiglu_rows = 512;
  // cuBLAS products (QKV, o_proj, down; gate/up where gemm_swiglu does not run) of about this many
  // rows or more take cuBLASLt algorithms chosen by timing at reserve() (kernels::GemmTuner), at
  // this many rows, twice, four times ... up to the reserved rows; an algorithm is kept where it
  // beats cuBLAS's default pick by gemm_autotune_margin (that pick is not always cuBLAS's fastest
  // for our shapes). 0 = never. Tuning runs cuBLAS's default, up to 8 cuBLASLt candidates and
  // (with gemm_own_products) ours 16 times each per product and row count (5 samples of 3 launches
  // back to back, after one), on every reserve() that grows the rows: reserve the largest step at
  // start-up.
  int32_t gemm_autotune_rows = 1024;
  double gemm_autotune_margin = kernels::GemmTuner::kTuneMargin;
  // The tuning also times our own product (kernels::gemm_wgmma: wgmma + TMA, with a stream-K share
  // where whole tiles leave part of the GPU idle) for QKV, o_proj and down where the shape fits
  // (outputs a multiple of 256: Qwen2.5 1.5B and up) and keeps it where it wins the same way.
  bool gemm_own_products = true;
  // With gemm_own_products: our product for every tuned product it fits, however it times (no
  // cuBLASLt candidates, no margin): A/B timing of our kernel in the model (bench_prefill
  // --own-gemm only).
  bool gemm_own_only = false;
  // Keep a layer call's residual rows (fp32, rows x hidden x 4 bytes: read and written by o_proj's
  // and down's accumulation and read by both norms) in a persisting share of the L2 cache while
  // the weights stream past (cudaAccessPolicyWindow on the stream; reserve() sets aside up to
  // cudaDevAttrMaxPersistingL2CacheSize). Off by default: it keeps the residual out of DRAM, but
  // the L2 it sets aside costs the products more than that saves beyond 1024 rows
  // (benchmarks/RESULTS.md runs 13 and 22). Where the device has no persisting L2 nothing changes;
  // inside a graph capture the window is not set (a later call outside one sets it). The set-aside
  // is the process's (one backend with the option at a time); the backend's destructor resets it.
  bool l2_persist_residual = false;
  // Importance pooling at check layers (Backend::layer_forward's pooled) on tensor cores
  // (kernels::attention_pool_tiled: the prefill attention kernel again with one-hot group values)
  // where the plan is tiled and head_dim 64 or 128; else, or when false, kernels::attention_pool
  // (CUDA cores, fp32). On the H200 the fp32 form took 6.5 ms a check layer at 4k rows x 4k keys
  // (14B), most of a KEEP request (benchmarks/RESULTS.md, KEEP's TTFT).
  bool pool_tensor_cores = true;
  // With pool_tensor_cores: the pooling inside the layer's attention pass where the wide kernel
  // can take it (kernels::attention_prefill_pool: at most kPoolFusedMaxGroups groups, Hopper),
  // instead of a pass of its own after it. Else, or when false, the two passes (A/B in bench_keep
  // --pool fused|tensor). H100, 14B/40: keep ~0.15 45.5 -> 43.5 ms, keep d=0.96 130 -> 122
  // (benchmarks/RESULTS.md run 16).
  bool pool_fused = true;
  // Split-key prefill attention (kernels::PrefillSplit, attention_schedule.h prefill_key_splits)
  // for calls of too few row tiles to fill the GPU, such as a KEEP request's query-only layers:
  // a workspace of prefill_split_max_bytes (~4 MiB at head_dim 128 on 132 SMs) at reserve().
  // false: never split (A/B in bench_keep --prefill-split off).
  bool prefill_split = true;
  // Blocks of the loader's kernel (queue_kv_bf16_runs, on its own stream beside the layers): few
  // enough to leave the layers most SMs, enough to keep the link busy: on the H200 12-64 blocks
  // read 14B entries at 46 GB/s alone (0.85 of one cudaMemcpyAsync), and 16 beside the layers
  // gave full_reuse 19.2 ms where 32 gave 21.3 and 132 27.1 (benchmarks/RESULTS.md).
  int32_t loader_blocks = 16;
  // The loader's bytes moved by the copy engines instead: each layer's runs go from the region
  // (or device memory) straight into the view's slots in one cudaMemcpyBatchAsync, then the
  // loader's kernel rotates their K in place (V is final as copied), so the link's transfer holds
  // no SM and our products are never capped for it (gemm_leave_loader). Off: slower in a request
  // (H100, 14B/40: keep ~0.15 45.2-45.5 -> 54.4-55.1 ms, full_reuse 18.9-19.0 -> 21.1-21.3),
  // since a layer's rotation can start only after its copies and then waits for SMs between the
  // products, where the kernel moves and rotates in one pass (benchmarks/RESULTS.md run 15).
  // A/B in bench_keep --loader-dma.
  bool loader_dma = false;
};

// Where the GPU time goes (CudaBackend::profile): one entry per stage of layer_forward, then
// "embed", "logits" (final_logits) and "copy_out" (copy_to_host), which run around the layers.
// With gemv_rmsnorm (decode steps) the norms run inside the next product: "norm" and "mlp_norm"
// are then ~0 and "qkv" / "gate_up" include them; with gemm_swiglu "swiglu" is ~0 and "gate_up"
// includes it.
struct StageTime {
  const char* stage;  // "norm", "qkv", "qkv_finish", "attention", "pool", "o_proj", "choose", ...
  double ms = 0.0;    // summed over calls
  int64_t calls = 0;
  bool layer = true;  // a stage of layer_forward (false: embed, logits, copy_out)
};

class CudaBackend final : public Backend {
 public:
  // Uploads `weights` (converted to bf16) to the device. kUnavailable without a usable GPU.
  static Result<std::unique_ptr<CudaBackend>> create(const ModelWeights& weights,
                                                     const CudaBackendOptions& options = {});
  // A Hugging Face directory's weights as stored (config.json + safetensors, sharded or not):
  // each tensor goes from its shard's mapping to the device, BF16 directly, F16/F32 through a
  // bounded bf16 staging buffer (norms and biases to fp32), one shard resident at a time
  // (stream_hf_weights): no fp32 copy of the model on the host. The same device weights as
  // create(load_hf_weights(dir)).
  static Result<std::unique_ptr<CudaBackend>> create_from_hf(
      const std::string& dir, const CudaBackendOptions& options = {});
  // Random weights of `config`'s shapes made on the device (uniform, never zero): for timing
  // models whose weights are not at hand. Values are scaled so activations stay finite.
  static Result<std::unique_ptr<CudaBackend>> create_random(const ModelConfig& config,
                                                            uint64_t seed,
                                                            const CudaBackendOptions& options = {});
  ~CudaBackend() override;

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override;
  const ModelConfig& config() const override { return config_; }
  KvType kv_type() const override { return KvType::kBF16; }

  Result<DeviceBuffer> allocate(size_t floats) override;
  void copy_to_device(float* dst, const float* src_host, size_t floats) override;
  void copy_to_host(float* dst_host, const float* src, size_t floats) override;
  void copy_on_device(float* dst, const float* src, size_t floats) override;
  void synchronize() override;

  Status reserve(int32_t max_rows, int32_t max_keys) override;
  Result<std::unique_ptr<AttentionPlan>> plan(const AttentionLayout& layout) override;
  Status prepare(const AttentionPlan& plan) override;

  void embed(float* hidden, const int32_t* tokens, int32_t n) override;
  Status layer_forward(const LayerOutputs& out, const float* hidden_in, int32_t layer,
                       const KvView& kv, const AttentionPlan& plan) override;
  void load_kv(const KvView& kv, int32_t first_slot, const float* k_pre, const float* v,
               const int32_t* positions, int32_t n) override;
  void load_kv_bf16(const KvView& kv, int32_t first_slot, const uint16_t* k_pre, const uint16_t* v,
                    const int32_t* positions, int32_t n) override;
  void load_kv_bf16_runs(std::span<const KvRun> runs) override;
  // On the loader stream (high priority, options.loader_blocks blocks a launch); an event per
  // layer. Runs from memory the GPU cannot read in place go the staged way on the compute stream.
  void queue_kv_bf16_runs(std::span<const KvRun> runs) override;
  void read_pooled(float* dst_host, const float* pooled, size_t floats) override;
  void wait_queued(int32_t layer) override;
  void fence_queue() override;
  // CudaBackendOptions::loader_blocks from the next queued load on (benchmarks).
  void set_loader_blocks(int32_t blocks);
  void gather_rows(float* dst, const float* src, const int32_t* rows, int32_t n,
                   size_t cols) override;
  void final_logits(float* logits, const float* hidden, const int32_t* rows, int32_t n) override;
  // kF32Rows with at most kGemvMaxRows rows (a prefill's last token): lm_head in kLogitSlices
  // slices of the vocabulary, each copied to the host on a second stream while the next is
  // computed, so only the last slice's copy follows the product. Otherwise final_logits, then
  // copy_to_host.
  void final_logits_to_host(float* logits_host, float* logits, const float* hidden,
                            const int32_t* rows, int32_t n) override;
  void argmax(int32_t* out_host, const float* logits, int32_t rows) override;
  void token_logprob(float* out_host, const float* logits, const int32_t* tokens_host,
                     int32_t rows) override;

  void begin_capture() override;
  void end_capture(bool run) override;
  uint64_t end_capture_for_replay() override;
  ReplayState replay_state(uint64_t handle) const override;
  void replay(uint64_t handle) override;
  void drop_recording(uint64_t handle) override;
  void capture_split() override;
  size_t recordings() const { return recordings_.size(); }
  uint64_t replays() const { return replays_; }  // recordings run again since creation

  // Profiling: while on, layer_forward records a CUDA event after each stage (and captures are not
  // made into graphs, so every launch is timed on its own). profile() waits for the stream, returns
  // the per-stage GPU time accumulated since profiling was switched on, and starts over.
  void set_profiling(bool on);
  std::vector<StageTime> profile();
  void set_graphs(bool on) { options_.graphs = on; }

  cudaStream_t stream() const { return stream_; }
  size_t weight_bytes() const { return weight_bytes_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  struct Layer;  // device pointers of one block's weights
  CudaBackend(const ModelConfig& config, const CudaBackendOptions& options);
  // What both factories share: config checks, the device, the weight arena (not yet filled).
  static Result<std::unique_ptr<CudaBackend>> prepare(const ModelConfig& config,
                                                      const CudaBackendOptions& options);
  Status init_device();
  // GemmTuner choices for the reserved rows (gemm_autotune_rows), on layer 0's weights.
  Status tune_products(int32_t rows);
  Status allocate_weights();
  // final_logits' first half: rows_f32_ = hidden[rows], then their final norm into normed_f32_
  // (returns true: fp32 rows for the gemv or kF32) or into xn_ (bf16). rows: host.
  bool norm_logit_rows(const float* hidden, const int32_t* rows, int32_t n);
  // kF32Rows where the hidden size suits our gemv: fp32 normed rows times the bf16 lm_head there.
  bool logit_gemv() const;
  // Device copy of `n` host ints in stream-ordered memory, freed after the stream's current work.
  int32_t* upload_ints(const int32_t* host, size_t n);
  void release_ints(int32_t* dev);

  ModelConfig config_;
  CudaBackendOptions options_;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  // final_logits_to_host: the copies' stream and an event per slice of the vocabulary.
  static constexpr int kLogitSlices = 8;
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t slice_done_[kLogitSlices] = {};
  cudaEvent_t copies_done_ = nullptr;
  // The early copy of pooled (LayerOutputs::pooled_to_host): pinned staging, grown as needed, and
  // the events around the copy on copy_stream_.
  float* pooled_host_ = nullptr;
  size_t pooled_host_floats_ = 0;
  const float* pooled_src_ = nullptr;  // what the pending early copy reads; null: none pending
  size_t pooled_floats_ = 0;
  cudaEvent_t pooled_ready_ = nullptr;
  cudaEvent_t pooled_copied_ = nullptr;
  kernels::BlasHandle blas_;
  kernels::GemmTuner tuner_;   // on blas_'s workspace; tuned by reserve()
  bool fused_swiglu_ = false;  // gemm_swiglu runs here for this model (fused_swiglu_rows > 0)
  bool own_few_ = false;       // own_few_rows > 0 and our products fit this model

  // Weights: one allocation; pointers into it.
  void* weight_arena_ = nullptr;
  size_t weight_bytes_ = 0;
  std::vector<Layer> layers_;
  const void* embed_ = nullptr;         // (vocab, C) bf16
  const void* lm_head_ = nullptr;       // (vocab, C) bf16; == embed_ when tied
  const float* lm_head_f32_ = nullptr;  // (vocab, C) fp32 when options_.logits == kF32
  const float* final_norm_ = nullptr;   // (C)
  const float* inv_freq_ = nullptr;     // (hd / 2)
  // Staging for bf16 KV rows loaded from pageable host memory (load_kv_bf16); grows, never shrinks.
  void* kv_staging_ = nullptr;
  size_t kv_staging_bytes_ = 0;
  // Run tables of load_kv_bf16_runs / queue_kv_bf16_runs: a ring of pinned host entries, each
  // batch copied into the same place of a device ring on the stream that launches it. Reused from
  // the start at fence_queue() once past half (both streams synchronized first), or when full.
  static constexpr size_t kRunRing = 1 << 16;
  kernels::KvLoadRun* runs_host_ = nullptr;
  kernels::KvLoadRun* runs_dev_ = nullptr;
  size_t runs_at_ = 0;
  // The loader: its stream, one event per layer (the last load queued for it), the fence's two.
  cudaStream_t load_stream_ = nullptr;
  std::vector<cudaEvent_t> load_done_;
  int32_t last_queued_layer_ = -1;  // whose load_done_ the loader's stream records last
  cudaEvent_t fence_compute_ = nullptr;
  cudaEvent_t fence_load_ = nullptr;
  int32_t sm_count_ = 1;
  // The persistent grid of our products that leaves the loader's SMs free: on every SM they kept
  // the loader's blocks waiting (full_reuse 18.4 -> 25 ms at 14B on the H200).
  // Whether the last load queued on the loader's stream has not ended yet (host's view, at
  // enqueue time: the layers' stream may be behind it, so a layer may be capped needlessly,
  // never the other way).
  bool loads_in_flight() const;
  int loader_free_ctas() const {
    return std::max(sm_count_ - std::max(options_.loader_blocks, 0), 1);
  }
  // Whether our large products may be capped to leave the loader's kernel its SMs (with
  // loader_dma the loads hold no SM but for their brief rotation: never).
  bool caps_for_loader() const { return options_.gemm_leave_loader && !options_.loader_dma; }
  // Puts `runs` in the ring and launches the loader's kernel on `stream` with at most `blocks`
  // blocks; false (nothing launched) when a source is memory the GPU cannot read in place.
  // in_place (loader_dma): the runs' bytes are copied into the views' slots first, on `stream`,
  // and the kernel rotates their K there.
  bool launch_runs(cudaStream_t stream, std::span<const KvRun> runs, int32_t blocks,
                   bool in_place = false);
  // loader_dma's batch of copies, reused (no allocation per layer once grown).
  std::vector<void*> dma_dsts_;
  std::vector<const void*> dma_srcs_;
  std::vector<size_t> dma_sizes_;

  // Workspace (reserve()).
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  void* xn_ = nullptr;           // (rows, C) bf16: normed input of a product
  void* qkv_ = nullptr;          // (rows, q + 2 kv) bf16
  void* att_ = nullptr;          // (rows, q) bf16
  void* proj_ = nullptr;         // (rows, C) bf16: o_proj / down_proj output
  void* gate_up_ = nullptr;      // (rows, 2 I) bf16
  void* act_ = nullptr;          // (rows, I) bf16
  float* lse_ = nullptr;         // (rows, H) when the caller wants pooling without lse
  float* rows_f32_ = nullptr;    // (rows, C) gathered rows for final_logits
  float* normed_f32_ = nullptr;  // (rows, C) their final norm (fp32 rows modes)
  float* decode_ws_ = nullptr;
  size_t decode_ws_floats_ = 0;
  void* pool_scratch_ = nullptr;  // kernels::attention_pool_tiled's scratch
  size_t pool_scratch_bytes_ = 0;
  kernels::PrefillSplit prefill_split_;  // split-key runs' workspace (attention, pooling)
  void* blas_ws_ = nullptr;
  kernels::GemmScratch gemm_scratch_;  // in workspace_, zeroed when allocated
  int32_t* scalars_ = nullptr;         // (rows) device ints for argmax results
  float* scalars_f_ = nullptr;         // (rows) device floats for log-probs

  // CUDA graphs: instantiated layer loops, keyed by their node count (a decode step and a prefill
  // chunk differ; steps of one kind update the same executable in place).
  bool capturing_ = false;
  std::vector<std::pair<size_t, cudaGraphExec_t>> graph_execs_;
  // Recordings for replay (end_capture_for_replay): handle, executables, and the dependent-launch
  // setting they were recorded under. Dropped when reserve() moves the workspace.
  struct Recording {
    uint64_t handle = 0;
    std::vector<cudaGraphExec_t> parts;  // launched in order
    bool dependent_launch = true;
  };
  std::vector<cudaGraph_t> captured_parts_;  // the open capture's parts before capture_split()s
  std::vector<Recording> recordings_;
  uint64_t next_recording_ = 0;
  uint64_t replays_ = 0;
  // Ends the open capture: the parts capture_split() cut off, then the last, in order.
  std::vector<cudaGraph_t> end_capture_parts();
  // Instantiates and launches each part (destroying the graphs); returns the executables.
  std::vector<cudaGraphExec_t> launch_parts(const std::vector<cudaGraph_t>& parts);
  std::vector<Recording>::const_iterator find_recording(uint64_t handle) const;
  void drop_all_recordings();

  // l2_persist_residual: the device's limits (0: none), the set-aside reserve() asked for, and the
  // window the stream has now.
  void persist_in_l2(const void* p, size_t bytes);
  size_t l2_persist_max_ = 0;
  size_t l2_window_max_ = 0;
  size_t l2_set_aside_ = 0;
  const void* l2_window_ = nullptr;
  size_t l2_window_bytes_ = 0;

  // Profiling (set_profiling): events recorded in order, each with the stage it ends (-1: the
  // start of a layer call).
  void mark(int stage);
  bool profiling_ = false;
  std::vector<cudaEvent_t> events_;
  std::vector<int> marks_;
  std::vector<StageTime> stage_times_;
};

}  // namespace keep::engine
