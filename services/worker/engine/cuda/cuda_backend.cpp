#include "services/worker/engine/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>

#include "services/worker/kernels/attention_schedule.h"
#include "services/worker/kernels/bf16.h"
#include "services/worker/kernels/gemm_schedule.h"
#include "services/worker/kernels/kernels.h"
#include "shared/common/log.h"
#include "shared/model/hf_loader.h"
#include "shared/safetensors/safetensors_reader.h"

namespace keep::engine {

namespace {

using bf16 = __nv_bfloat16;

// A CUDA or cuBLAS failure inside a launcher is not recoverable (the context may be lost): abort
// with the call and the error, like any broken invariant.
#define KEEP_CUDA_CHECK(expr)                                                            \
  do {                                                                                   \
    const cudaError_t _keep_err = (expr);                                                \
    KEEP_CHECK_MSG(_keep_err == cudaSuccess,                                             \
                   (std::string(#expr) + ": " + cudaGetErrorString(_keep_err)).c_str()); \
  } while (0)
#define KEEP_BLAS_CHECK(expr)                                                                  \
  do {                                                                                         \
    const cublasStatus_t _keep_st = (expr);                                                    \
    KEEP_CHECK_MSG(_keep_st == CUBLAS_STATUS_SUCCESS,                                          \
                   (std::string(#expr) + ": " + kernels::blas_status_name(_keep_st)).c_str()); \
  } while (0)

Status cuda_status(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::ok();
  const Code code =
      err == cudaErrorMemoryAllocation ? Code::kResourceExhausted : Code::kUnavailable;
  return Status(code, "cuda backend: " + what + ": " + cudaGetErrorString(err));
}

constexpr size_t kAlign = 256;
constexpr size_t kBlasWorkspace = size_t{32} << 20;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

void free_pool_floats(float* p) { cudaFreeAsync(p, nullptr); }

// The device form of an AttentionLayout: one int32 block in stream-ordered memory holding every
// array the kernels read. The block is made at the plan's first use (upload(), from layer_forward
// after the QKV product's launch), not when the plan is: the host then builds the schedule and
// uploads while the GPU runs the first norm and product, which so start earlier
// (benchmarks/RESULTS.md run 20). A plan that a capture will use is uploaded before it, by
// prepare() (a capture cannot upload).
class CudaPlan final : public AttentionPlan {
 public:
  CudaPlan(AttentionLayout layout, cudaStream_t stream, bool prefill_kernel)
      : layout_(std::move(layout)), stream_(stream), tiled(prefill_kernel) {
    rows.rows = layout_.num_rows();
    rows.num_keys = layout_.num_keys;
  }
  ~CudaPlan() override {
    if (block_ != nullptr) cudaFreeAsync(block_, stream_);
  }
  const AttentionLayout& layout() const override { return layout_; }
  bool uploaded() const { return block_ != nullptr; }
  // Builds the block on the host and enqueues its upload on the stream, once; sets the pointers
  // below. (const: the device copy is a cache of the layout, made where it is first needed.)
  Status upload() const;

  AttentionLayout layout_;
  cudaStream_t stream_;
  mutable int32_t* block_ = nullptr;
  mutable const int32_t* slots = nullptr;      // (rows)
  mutable const int32_t* positions = nullptr;  // (rows)
  mutable const int32_t* key_group = nullptr;  // (num_keys) or null
  mutable kernels::AttentionRows rows;  // rows, num_keys from the start; arrays once uploaded
  mutable kernels::PrefillSchedule schedule;
  bool tiled = false;  // prefill kernel (else the decode kernel)
};

Status CudaPlan::upload() const {
  if (uploaded()) return Status::ok();
  const AttentionLayout& l = layout_;
  kernels::PrefillScheduleHost sched;
  if (tiled) {
    kernels::AttentionRows host_rows;
    host_rows.row_offsets = l.span_offsets.data();
    host_rows.spans = reinterpret_cast<const kernels::KeyRange*>(l.spans.data());
    host_rows.rows = rows.rows;
    host_rows.num_keys = l.num_keys;
    sched = kernels::build_prefill_schedule(host_rows);
  }
  static_assert(sizeof(KeySpan) == sizeof(kernels::KeyRange), "spans upload as is");
  // One block: slots, positions, row offsets, spans, key groups, schedule.
  std::vector<int32_t> block;
  auto append = [&](const int32_t* v, size_t n) {
    const size_t at = block.size();
    block.insert(block.end(), v, v + n);
    while (block.size() % 4 != 0) block.push_back(0);  // 16-byte aligned arrays
    return at;
  };
  const size_t a_slots = append(l.row_slot.data(), l.row_slot.size());
  const size_t a_pos = append(l.row_position.data(), l.row_position.size());
  const size_t a_offs = append(l.span_offsets.data(), l.span_offsets.size());
  const size_t a_spans =
      append(reinterpret_cast<const int32_t*>(l.spans.data()), l.spans.size() * 2);
  const size_t a_groups = append(l.key_group.data(), l.key_group.size());
  const size_t a_toffs = append(sched.tile_offsets.data(), sched.tile_offsets.size());
  const size_t a_tiles = append(sched.tiles.data(), sched.tiles.size());
  void* dev = nullptr;
  KEEP_RETURN_IF_ERROR(cuda_status(
      cudaMallocAsync(&dev, std::max<size_t>(block.size(), 1) * 4, stream_), "plan upload"));
  // The host vector is pageable: cudaMemcpyAsync has staged it before returning.
  const cudaError_t err =
      cudaMemcpyAsync(dev, block.data(), block.size() * 4, cudaMemcpyHostToDevice, stream_);
  if (err != cudaSuccess) {
    cudaFreeAsync(dev, stream_);
    return cuda_status(err, "plan upload");
  }
  block_ = static_cast<int32_t*>(dev);
  const int32_t* d = block_;
  slots = d + a_slots;
  positions = d + a_pos;
  key_group = l.key_group.empty() ? nullptr : d + a_groups;
  rows.row_offsets = d + a_offs;
  rows.spans = reinterpret_cast<const kernels::KeyRange*>(d + a_spans);
  schedule.tile_offsets = d + a_toffs;
  schedule.tiles = d + a_tiles;
  schedule.sanitize_v = sched.sanitize_v;
  return Status::ok();
}

}  // namespace

struct CudaBackend::Layer {
  const bf16* w_qkv = nullptr;       // (q + 2 kv, C)
  const float* b_q = nullptr;        // (q) or null
  const float* b_k = nullptr;        // (kv) or null
  const float* b_v = nullptr;        // (kv) or null
  const bf16* w_o = nullptr;         // (C, q)
  const float* b_o = nullptr;        // (C) or null
  const bf16* w_gate_up = nullptr;   // (2 I, C)
  const bf16* w_down = nullptr;      // (C, I)
  const float* attn_norm = nullptr;  // (C)
  const float* ffn_norm = nullptr;   // (C)
};

CudaBackend::CudaBackend(const ModelConfig& config, const CudaBackendOptions& options)
    : config_(config), options_(options) {}

CudaBackend::~CudaBackend() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (auto& e : graph_execs_) cudaGraphExecDestroy(e.second);
  drop_all_recordings();
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  blas_ = kernels::BlasHandle();
  cudaFree(workspace_);
  cudaFree(weight_arena_);
  cudaFree(kv_staging_);
  if (load_stream_ != nullptr) cudaStreamSynchronize(load_stream_);
  cudaFreeHost(runs_host_);
  cudaFree(runs_dev_);
  for (cudaEvent_t e : load_done_) cudaEventDestroy(e);
  if (fence_compute_ != nullptr) cudaEventDestroy(fence_compute_);
  if (fence_load_ != nullptr) cudaEventDestroy(fence_load_);
  if (load_stream_ != nullptr) cudaStreamDestroy(load_stream_);
  for (cudaEvent_t e : slice_done_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (copies_done_ != nullptr) cudaEventDestroy(copies_done_);
  if (pooled_ready_ != nullptr) cudaEventDestroy(pooled_ready_);
  if (pooled_copied_ != nullptr) cudaEventDestroy(pooled_copied_);
  cudaFreeHost(pooled_host_);
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (l2_set_aside_ > 0) {
    // The set-aside is the device's, not the stream's: persisting lines left behind would keep
    // shrinking the L2 of whatever runs next in this process (RESULTS.md run 13).
    cudaCtxResetPersistingL2Cache();
    cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0);
  }
}

static const char* logits_name(CudaBackendOptions::Logits l) {
  switch (l) {
    case CudaBackendOptions::Logits::kF32Rows:
      return "fp32 rows x bf16 lm_head";
    case CudaBackendOptions::Logits::kF32:
      return "fp32";
    case CudaBackendOptions::Logits::kBF16:
      return "bf16";
  }
  return "?";
}

std::string CudaBackend::name() const {
  std::string attention = "mma.sync";
  switch (options_.prefill_attention) {
    case kernels::PrefillKernel::kAuto:
      if (kernels::wgmma_available()) {
        attention = "wgmma (one K buffer from " +
                    std::to_string(kernels::kPrefillOneKMinBlocksPerSm) +
                    " blocks an SM), two-warpgroup from " +
                    std::to_string(kernels::kPrefillWideMinKeys) + " keys";
      }
      break;
    case kernels::PrefillKernel::kMma:
      break;
    case kernels::PrefillKernel::kWgmma:
      attention = "wgmma";
      break;
    case kernels::PrefillKernel::kWgmmaWide:
      attention = "wgmma two-warpgroup";
      break;
    case kernels::PrefillKernel::kWgmmaOneK:
      attention = "wgmma, one K buffer";
      break;
  }
  return "cuda bf16 (" + device_name_ + ", cuBLAS, " + std::to_string(weight_bytes_ >> 20) +
         " MiB of weights, logits " + logits_name(options_.logits) + ", prefill attention " +
         attention +
         (fused_swiglu_ ? ", gate/up+SwiGLU fused from " +
                              std::to_string(options_.fused_swiglu_rows) + " rows"
                        : "") +
         (own_few_ ? ", ours up to " +
                         std::to_string(std::min(options_.own_few_rows, kernels::kGemmTileRows)) +
                         " rows"
                   : "") +
         (options_.gemm_autotune_rows > 0
              ? std::string(options_.gemm_own_products && kernels::wgmma_available()
                                ? ", cuBLASLt algorithms or ours"
                                : ", cuBLASLt algorithms") +
                    " tuned from " + std::to_string(options_.gemm_autotune_rows) + " rows"
              : "") +
         ")";
}

// What the kernels support (prefill attention: head_dim 64 or 128).
static Status check_supported(const ModelConfig& c) {
  if (c.head_dim != 64 && c.head_dim != 128) {
    return Status(Code::kInvalidArgument, "cuda backend: head_dim " + std::to_string(c.head_dim) +
                                              " is not supported (64 or 128)");
  }
  return Status::ok();
}

Status CudaBackend::init_device() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    return Status(Code::kUnavailable,
                  std::string("cuda backend: no usable GPU (") + cudaGetErrorString(err) + ")");
  }
  if (options_.device < 0 || options_.device >= count) {
    return Status(
        Code::kInvalidArgument,
        "cuda backend: device " + std::to_string(options_.device) + " of " + std::to_string(count));
  }
  KEEP_RETURN_IF_ERROR(cuda_status(cudaSetDevice(options_.device), "cudaSetDevice"));
  cudaDeviceProp prop{};
  KEEP_RETURN_IF_ERROR(cuda_status(cudaGetDeviceProperties(&prop, options_.device), "properties"));
  device_name_ = prop.name;
  int persist = 0, window = 0;
  KEEP_RETURN_IF_ERROR(cuda_status(
      cudaDeviceGetAttribute(&persist, cudaDevAttrMaxPersistingL2CacheSize, options_.device),
      "attribute"));
  KEEP_RETURN_IF_ERROR(cuda_status(
      cudaDeviceGetAttribute(&window, cudaDevAttrMaxAccessPolicyWindowSize, options_.device),
      "attribute"));
  l2_persist_max_ = static_cast<size_t>(persist);
  l2_window_max_ = static_cast<size_t>(window);
  // Stream-ordered allocations (plans, small index uploads, engine buffers) come from the default
  // pool; keep what it has so a steady state never returns to the driver.
  cudaMemPool_t pool;
  KEEP_RETURN_IF_ERROR(cuda_status(cudaDeviceGetDefaultMemPool(&pool, options_.device), "mempool"));
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  KEEP_RETURN_IF_ERROR(cuda_status(
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold), "mempool"));
  // A blocking stream: work on the legacy default stream (the DeviceBuffer frees) orders with it.
  KEEP_RETURN_IF_ERROR(cuda_status(cudaStreamCreate(&stream_), "stream"));
  KEEP_RETURN_IF_ERROR(
      cuda_status(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "stream"));
  for (cudaEvent_t& e : slice_done_) {
    KEEP_RETURN_IF_ERROR(
        cuda_status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event"));
  }
  KEEP_RETURN_IF_ERROR(
      cuda_status(cudaEventCreateWithFlags(&copies_done_, cudaEventDisableTiming), "event"));
  // The loader (layer-balanced loading): the highest priority, so that its few blocks take SMs
  // as the layers' blocks retire instead of queueing behind a whole product.
  int lowest = 0, highest = 0;
  KEEP_RETURN_IF_ERROR(
      cuda_status(cudaDeviceGetStreamPriorityRange(&lowest, &highest), "stream priorities"));
  KEEP_RETURN_IF_ERROR(cuda_status(
      cudaStreamCreateWithPriority(&load_stream_, cudaStreamNonBlocking, highest), "stream"));
  load_done_.assign(static_cast<size_t>(std::max<int64_t>(config_.num_layers, 0)), nullptr);
  for (cudaEvent_t& e : load_done_) {
    KEEP_RETURN_IF_ERROR(
        cuda_status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event"));
  }
  for (cudaEvent_t* e : {&fence_compute_, &fence_load_, &pooled_ready_, &pooled_copied_}) {
    KEEP_RETURN_IF_ERROR(cuda_status(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "event"));
  }
  KEEP_RETURN_IF_ERROR(
      cuda_status(cudaHostAlloc(reinterpret_cast<void**>(&runs_host_),
                                kRunRing * sizeof(kernels::KvLoadRun), cudaHostAllocDefault),
                  "loader run table"));
  KEEP_RETURN_IF_ERROR(cuda_status(
      cudaMalloc(reinterpret_cast<void**>(&runs_dev_), kRunRing * sizeof(kernels::KvLoadRun)),
      "loader run table"));
  int sms = 0;
  KEEP_RETURN_IF_ERROR(cuda_status(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, options_.device), "attribute"));
  sm_count_ = std::max(sms, 1);
  return Status::ok();
}

// Lays out every weight in one allocation and points layers_ into it.
Status CudaBackend::allocate_weights() {
  const ModelConfig& c = config_;
  const size_t C = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), I = c.intermediate_size;
  const size_t L = c.num_layers, V = c.vocab_size;
  const bool bias = c.attention_bias, bo = c.o_proj_bias();
  size_t bytes = 0;
  auto take = [&](size_t b) {
    const size_t at = bytes;
    bytes += align_up(b);
    return at;
  };
  struct Offsets {
    size_t w_qkv, b_qkv, w_o, b_o, w_gu, w_down, attn_norm, ffn_norm;
  };
  std::vector<Offsets> offs(L);
  for (size_t l = 0; l < L; ++l) {
    offs[l].w_qkv = take((q + 2 * kv) * C * 2);
    offs[l].b_qkv = bias ? take((q + 2 * kv) * 4) : SIZE_MAX;
    offs[l].w_o = take(C * q * 2);
    offs[l].b_o = bo ? take(C * 4) : SIZE_MAX;
    offs[l].w_gu = take(2 * I * C * 2);
    offs[l].w_down = take(C * I * 2);
    offs[l].attn_norm = take(C * 4);
    offs[l].ffn_norm = take(C * 4);
  }
  const size_t embed = take(V * C * 2);
  const size_t lm_head = c.tie_word_embeddings ? embed : take(V * C * 2);
  const bool f32_copy = options_.logits == CudaBackendOptions::Logits::kF32;
  const size_t lm_head_f32 = f32_copy ? take(V * C * 4) : SIZE_MAX;
  const size_t final_norm = take(C * 4);
  const size_t inv_freq = take(c.head_dim / 2 * 4);
  KEEP_RETURN_IF_ERROR(
      cuda_status(cudaMalloc(&weight_arena_, bytes),
                  "allocating " + std::to_string(bytes >> 20) + " MiB of weights"));
  weight_bytes_ = bytes;
  auto* base = static_cast<char*>(weight_arena_);
  layers_.resize(L);
  for (size_t l = 0; l < L; ++l) {
    Layer& w = layers_[l];
    w.w_qkv = reinterpret_cast<const bf16*>(base + offs[l].w_qkv);
    if (bias) {
      w.b_q = reinterpret_cast<const float*>(base + offs[l].b_qkv);
      w.b_k = w.b_q + q;
      w.b_v = w.b_k + kv;
    }
    w.w_o = reinterpret_cast<const bf16*>(base + offs[l].w_o);
    if (bo) w.b_o = reinterpret_cast<const float*>(base + offs[l].b_o);
    w.w_gate_up = reinterpret_cast<const bf16*>(base + offs[l].w_gu);
    w.w_down = reinterpret_cast<const bf16*>(base + offs[l].w_down);
    w.attn_norm = reinterpret_cast<const float*>(base + offs[l].attn_norm);
    w.ffn_norm = reinterpret_cast<const float*>(base + offs[l].ffn_norm);
  }
  embed_ = base + embed;
  lm_head_ = base + lm_head;
  if (f32_copy) lm_head_f32_ = reinterpret_cast<const float*>(base + lm_head_f32);
  final_norm_ = reinterpret_cast<const float*>(base + final_norm);
  inv_freq_ = reinterpret_cast<const float*>(base + inv_freq);
  const std::vector<float> freqs = rope_inv_freq(c);
  KEEP_RETURN_IF_ERROR(cuda_status(cudaMemcpy(const_cast<float*>(inv_freq_), freqs.data(),
                                              freqs.size() * 4, cudaMemcpyHostToDevice),
                                   "inv_freq"));
  return Status::ok();
}

Result<std::unique_ptr<CudaBackend>> CudaBackend::prepare(const ModelConfig& config,
                                                          const CudaBackendOptions& options) {
  KEEP_RETURN_IF_ERROR(config.validate().with_context("cuda backend: config"));
  std::unique_ptr<CudaBackend> b(new CudaBackend(config, options));
  KEEP_RETURN_IF_ERROR(b->init_device());  // kUnavailable first: no GPU is not a model problem
  if (kernels::prefill_kernel_needs_wgmma(options.prefill_attention) &&
      !kernels::wgmma_available()) {
    return Status(Code::kUnavailable,
                  "cuda backend: wgmma attention asked for, but this build (CUDA architectures "
                  "without 90a) or this device (not compute 9.0) cannot run it");
  }
  KEEP_RETURN_IF_ERROR(check_supported(config));
  b->fused_swiglu_ = options.fused_swiglu_rows > 0 && kernels::wgmma_available() &&
                     kernels::gemm_swiglu_fits(config.intermediate_size, config.hidden_size);
  const int64_t qkv_w = config.q_dim() + 2 * config.kv_dim();
  b->own_few_ = options.own_few_rows > 0 && kernels::wgmma_available() &&
                kernels::gemm_swiglu_fits(config.intermediate_size, config.hidden_size) &&
                kernels::gemm_wgmma_fits(qkv_w, config.hidden_size) &&
                kernels::gemm_wgmma_fits(config.hidden_size, config.q_dim()) &&
                kernels::gemm_wgmma_fits(config.hidden_size, config.intermediate_size);
  KEEP_RETURN_IF_ERROR(b->allocate_weights());
  return b;
}

Result<std::unique_ptr<CudaBackend>> CudaBackend::create(const ModelWeights& weights,
                                                         const CudaBackendOptions& options) {
  KEEP_RETURN_IF_ERROR(weights.config.validate().with_context("cuda backend: config"));
  KEEP_RETURN_IF_ERROR(weights.validate().with_context("cuda backend: weights"));
  KEEP_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> b, prepare(weights.config, options));
  const ModelConfig& c = b->config_;

  // fp32 host tensors -> bf16 (or fp32) device, through one reusable host buffer.
  std::vector<kernels::Bf16> staging;
  auto put_bf16 = [&](const bf16* dst, const std::vector<const Tensor*>& parts) -> Status {
    size_t n = 0;
    for (const Tensor* t : parts) n += t->data.size();
    staging.resize(n);
    size_t at = 0;
    for (const Tensor* t : parts) {
      for (float v : t->data) staging[at++] = kernels::float_to_bf16(v);
    }
    return cuda_status(
        cudaMemcpy(const_cast<bf16*>(dst), staging.data(), n * 2, cudaMemcpyHostToDevice),
        "weight upload");
  };
  auto put_f32 = [&](const float* dst, const std::vector<const Tensor*>& parts) -> Status {
    size_t at = 0;
    for (const Tensor* t : parts) {
      KEEP_RETURN_IF_ERROR(cuda_status(cudaMemcpy(const_cast<float*>(dst) + at, t->ptr(),
                                                  t->data.size() * 4, cudaMemcpyHostToDevice),
                                       "weight upload"));
      at += t->data.size();
    }
    return Status::ok();
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = weights.layers[l];
    const Layer& d = b->layers_[l];
    KEEP_RETURN_IF_ERROR(put_bf16(d.w_qkv, {&w.wq, &w.wk, &w.wv}));
    if (d.b_q != nullptr) KEEP_RETURN_IF_ERROR(put_f32(d.b_q, {&w.bq, &w.bk, &w.bv}));
    KEEP_RETURN_IF_ERROR(put_bf16(d.w_o, {&w.wo}));
    if (d.b_o != nullptr) KEEP_RETURN_IF_ERROR(put_f32(d.b_o, {&w.bo}));
    KEEP_RETURN_IF_ERROR(put_bf16(d.w_gate_up, {&w.w_gate, &w.w_up}));
    KEEP_RETURN_IF_ERROR(put_bf16(d.w_down, {&w.w_down}));
    KEEP_RETURN_IF_ERROR(put_f32(d.attn_norm, {&w.attn_norm}));
    KEEP_RETURN_IF_ERROR(put_f32(d.ffn_norm, {&w.ffn_norm}));
  }
  KEEP_RETURN_IF_ERROR(put_bf16(static_cast<const bf16*>(b->embed_), {&weights.embed}));
  if (!c.tie_word_embeddings) {
    KEEP_RETURN_IF_ERROR(put_bf16(static_cast<const bf16*>(b->lm_head_), {&weights.lm_head}));
  }
  KEEP_RETURN_IF_ERROR(put_f32(b->final_norm_, {&weights.final_norm}));
  if (b->lm_head_f32_ != nullptr) {
    KEEP_RETURN_IF_ERROR(put_f32(b->lm_head_f32_, {&weights.output_weight()}));
  }
  return b;
}

Result<std::unique_ptr<CudaBackend>> CudaBackend::create_from_hf(
    const std::string& dir, const CudaBackendOptions& options) {
  KEEP_ASSIGN_OR_RETURN(ModelConfig config, load_hf_config(dir + "/config.json"));
  KEEP_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> b, prepare(config, options));
  const ModelConfig& c = b->config_;
  const size_t C = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), I = c.intermediate_size;
  using safetensors::DType;
  // F16/F32 elements widen to fp32 in chunks of this many, then round to bf16 as create()'s
  // float_to_bf16 does: identical device weights from a bounded buffer.
  constexpr size_t kChunk = size_t{8} << 20;
  std::vector<kernels::Bf16> staging;
  std::vector<float> wide;
  auto element = [](const safetensors::TensorView& v, size_t i) {
    if (v.dtype == DType::kF32) {
      float f;
      std::memcpy(&f, v.data + 4 * i, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, v.data + 2 * i, 2);
    return v.dtype == DType::kF16 ? safetensors::fp16_to_fp32(h) : safetensors::bf16_to_fp32(h);
  };
  auto to_bf16 = [&](const bf16* dst, const safetensors::TensorView& v) -> Status {
    const auto n = static_cast<size_t>(v.numel());
    if (v.dtype == DType::kBF16) {  // as stored: straight from the mapping
      return cuda_status(
          cudaMemcpy(const_cast<bf16*>(dst), v.data, v.bytes, cudaMemcpyHostToDevice),
          "weight upload");
    }
    staging.resize(std::min(n, kChunk));
    for (size_t at = 0; at < n; at += kChunk) {
      const size_t m = std::min(kChunk, n - at);
      for (size_t i = 0; i < m; ++i) staging[i] = kernels::float_to_bf16(element(v, at + i));
      KEEP_RETURN_IF_ERROR(cuda_status(
          cudaMemcpy(const_cast<bf16*>(dst) + at, staging.data(), m * 2, cudaMemcpyHostToDevice),
          "weight upload"));
    }
    return Status::ok();
  };
  auto to_f32 = [&](const float* dst, const safetensors::TensorView& v) -> Status {
    const auto n = static_cast<size_t>(v.numel());  // norms and biases: small
    wide.resize(n);
    for (size_t i = 0; i < n; ++i) wide[i] = element(v, i);
    return cuda_status(
        cudaMemcpy(const_cast<float*>(dst), wide.data(), n * 4, cudaMemcpyHostToDevice),
        "weight upload");
  };
  Status st = stream_hf_weights(dir, c, [&](const WeightPiece& p) -> Status {
    const HfWeight& w = *p.weight;
    const safetensors::TensorView& v = *p.view;
    if (w.layer < 0) {
      switch (w.role) {
        case WeightRole::kEmbed:
          return to_bf16(static_cast<const bf16*>(b->embed_), v);
        case WeightRole::kFinalNorm:
          return to_f32(b->final_norm_, v);
        default:
          return to_bf16(static_cast<const bf16*>(b->lm_head_), v);
      }
    }
    const Layer& d = b->layers_[static_cast<size_t>(w.layer)];
    switch (w.role) {
      case WeightRole::kAttnNorm:
        return to_f32(d.attn_norm, v);
      case WeightRole::kFfnNorm:
        return to_f32(d.ffn_norm, v);
      case WeightRole::kWq:
        return to_bf16(d.w_qkv, v);
      case WeightRole::kWk:
        return to_bf16(d.w_qkv + q * C, v);
      case WeightRole::kWv:
        return to_bf16(d.w_qkv + (q + kv) * C, v);
      case WeightRole::kBq:
        return to_f32(d.b_q, v);
      case WeightRole::kBk:
        return to_f32(d.b_q + q, v);
      case WeightRole::kBv:
        return to_f32(d.b_q + q + kv, v);
      case WeightRole::kWo:
        return to_bf16(d.w_o, v);
      case WeightRole::kBo:
        return to_f32(d.b_o, v);
      case WeightRole::kGate:
        return to_bf16(d.w_gate_up, v);
      case WeightRole::kUp:
        return to_bf16(d.w_gate_up + I * C, v);
      case WeightRole::kDown:
        return to_bf16(d.w_down, v);
      default:
        return Status(Code::kInternal, "cuda backend: a weight role without a place");
    }
  });
  KEEP_RETURN_IF_ERROR(st.with_context("cuda backend"));
  if (b->lm_head_f32_ != nullptr) {
    // Logits::kF32: the fp32 copy widened from the bf16 one on the device (exact for bf16
    // checkpoints; F32 ones keep their bf16 rounding here).
    KEEP_CUDA_CHECK(kernels::convert(const_cast<float*>(b->lm_head_f32_),
                                     static_cast<const bf16*>(b->lm_head_),
                                     static_cast<int64_t>(c.vocab_size * C), b->stream_));
    KEEP_CUDA_CHECK(cudaStreamSynchronize(b->stream_));
  }
  return b;
}

Result<std::unique_ptr<CudaBackend>> CudaBackend::create_random(const ModelConfig& config,
                                                                uint64_t seed,
                                                                const CudaBackendOptions& options) {
  KEEP_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> b, prepare(config, options));
  const ModelConfig& c = b->config_;
  const int64_t C = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), I = c.intermediate_size;
  uint64_t tensor = 0;
  cudaStream_t s = b->stream_;
  // A projection from `in` features: uniform(+-sqrt(3 / in)) keeps unit-RMS inputs at unit RMS.
  auto lin = [&](const bf16* p, int64_t n, int64_t in) {
    const float a = std::sqrt(3.0f / static_cast<float>(in));
    return kernels::fill_uniform(const_cast<bf16*>(p), n, seed + 7919 * ++tensor, -a, a, s);
  };
  auto f32 = [&](const float* p, int64_t n, float lo, float hi) {
    return kernels::fill_uniform(const_cast<float*>(p), n, seed + 7919 * ++tensor, lo, hi, s);
  };
  for (const Layer& d : b->layers_) {
    KEEP_RETURN_IF_ERROR(cuda_status(lin(d.w_qkv, (q + 2 * kv) * C, C), "random weights"));
    if (d.b_q != nullptr)
      KEEP_RETURN_IF_ERROR(cuda_status(f32(d.b_q, q + 2 * kv, -0.1f, 0.1f), "random"));
    KEEP_RETURN_IF_ERROR(cuda_status(lin(d.w_o, C * q, q), "random weights"));
    if (d.b_o != nullptr) KEEP_RETURN_IF_ERROR(cuda_status(f32(d.b_o, C, -0.1f, 0.1f), "random"));
    KEEP_RETURN_IF_ERROR(cuda_status(lin(d.w_gate_up, 2 * I * C, C), "random weights"));
    KEEP_RETURN_IF_ERROR(cuda_status(lin(d.w_down, C * I, I), "random weights"));
    KEEP_RETURN_IF_ERROR(cuda_status(f32(d.attn_norm, C, 0.8f, 1.2f), "random weights"));
    KEEP_RETURN_IF_ERROR(cuda_status(f32(d.ffn_norm, C, 0.8f, 1.2f), "random weights"));
  }
  KEEP_RETURN_IF_ERROR(
      cuda_status(kernels::fill_uniform(static_cast<bf16*>(const_cast<void*>(b->embed_)),
                                        c.vocab_size * C, seed + 7919 * ++tensor, -1.0f, 1.0f, s),
                  "random weights"));
  if (!c.tie_word_embeddings) {
    KEEP_RETURN_IF_ERROR(cuda_status(
        lin(static_cast<const bf16*>(b->lm_head_), c.vocab_size * C, C), "random weights"));
  }
  KEEP_RETURN_IF_ERROR(cuda_status(f32(b->final_norm_, C, 0.8f, 1.2f), "random weights"));
  if (b->lm_head_f32_ != nullptr) {  // the same values as the bf16 copy
    KEEP_RETURN_IF_ERROR(
        cuda_status(kernels::convert(const_cast<float*>(b->lm_head_f32_),
                                     static_cast<const bf16*>(b->lm_head_), c.vocab_size * C, s),
                    "random weights"));
  }
  KEEP_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(s), "random weights"));
  return b;
}

// ---- memory ----

Result<DeviceBuffer> CudaBackend::allocate(size_t floats) {
  if (floats == 0) return DeviceBuffer();
  void* p = nullptr;
  cudaError_t err = cudaMallocAsync(&p, floats * sizeof(float), stream_);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status(Code::kResourceExhausted, "cuda backend: allocating " +
                                                std::to_string(floats * 4) +
                                                " bytes: " + cudaGetErrorString(err));
  }
  KEEP_CUDA_CHECK(cudaMemsetAsync(p, 0, floats * sizeof(float), stream_));
  // Freed on the legacy default stream, which orders after this (blocking) stream's work.
  return DeviceBuffer(static_cast<float*>(p), floats, DeviceKind::kCuda, &free_pool_floats);
}

void CudaBackend::copy_to_device(float* dst, const float* src_host, size_t floats) {
  KEEP_CUDA_CHECK(cudaMemcpyAsync(dst, src_host, floats * 4, cudaMemcpyDefault, stream_));
}

// The stages CudaBackend::profile reports (mark() records one after each).
namespace {
enum Stage : int {
  kNorm,
  kQkv,
  kQkvFinish,
  kAttention,
  kPool,
  kOProj,
  kChoose,  // rows chosen inside the layer: the stream's wait for the host's choice after o_proj
  kMlpNorm,
  kGateUp,
  kSwiglu,
  kDown,
  kLayerStages,  // the stages above are layer_forward's; those below run around the layers
  kEmbed = kLayerStages,
  kLogits,   // final_logits: gather, final norm, lm_head
  kCopyOut,  // copy_to_host (the logits of a prefill)
  kStages
};
constexpr const char* kStageNames[kStages] = {
    "norm",     "qkv",     "qkv_finish", "attention", "pool",  "o_proj", "choose",
    "mlp_norm", "gate_up", "swiglu",     "down",      "embed", "logits", "copy_out"};
}  // namespace

void CudaBackend::copy_to_host(float* dst_host, const float* src, size_t floats) {
  mark(-1);
  KEEP_CUDA_CHECK(cudaMemcpyAsync(dst_host, src, floats * 4, cudaMemcpyDefault, stream_));
  mark(kCopyOut);
  KEEP_CUDA_CHECK(cudaStreamSynchronize(stream_));
}
void CudaBackend::read_pooled(float* dst_host, const float* pooled, size_t floats) {
  if (pooled_src_ != pooled || floats > pooled_floats_) {  // no early copy of it: the layer's end
    copy_to_host(dst_host, pooled, floats);
    return;
  }
  KEEP_CUDA_CHECK(cudaEventSynchronize(pooled_copied_));
  std::memcpy(dst_host, pooled_host_, floats * 4);
  pooled_src_ = nullptr;
}
void CudaBackend::copy_on_device(float* dst, const float* src, size_t floats) {
  KEEP_CUDA_CHECK(cudaMemcpyAsync(dst, src, floats * 4, cudaMemcpyDeviceToDevice, stream_));
}
void CudaBackend::gather_rows(float* dst, const float* src, const int32_t* rows, int32_t n,
                              size_t cols) {
  if (n <= 0) return;
  int32_t* idx = upload_ints(rows, static_cast<size_t>(n));
  KEEP_CUDA_CHECK(kernels::gather_rows(dst, src, idx, n, static_cast<int64_t>(cols), stream_));
  release_ints(idx);
}
void CudaBackend::synchronize() {
  KEEP_CUDA_CHECK(cudaStreamSynchronize(load_stream_));
  KEEP_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

int32_t* CudaBackend::upload_ints(const int32_t* host, size_t n) {
  void* p = nullptr;
  KEEP_CUDA_CHECK(cudaMallocAsync(&p, std::max<size_t>(n, 1) * 4, stream_));
  if (n > 0) KEEP_CUDA_CHECK(cudaMemcpyAsync(p, host, n * 4, cudaMemcpyHostToDevice, stream_));
  return static_cast<int32_t*>(p);
}
void CudaBackend::release_ints(int32_t* dev) { KEEP_CUDA_CHECK(cudaFreeAsync(dev, stream_)); }

Status CudaBackend::reserve(int32_t max_rows, int32_t max_keys) {
  if (max_rows <= 0 || max_keys <= 0) {
    return Status(Code::kInvalidArgument, "cuda backend: reserve needs positive sizes");
  }
  const int32_t rows = std::max({max_rows, reserved_rows_, 16});
  const int32_t keys = std::max(max_keys, reserved_keys_);
  if (rows == reserved_rows_ && keys == reserved_keys_ && workspace_ != nullptr) {
    return Status::ok();
  }
  const ModelConfig& c = config_;
  const size_t R = rows, C = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), I = c.intermediate_size,
               H = c.num_heads;
  const size_t dec = kernels::attention_decode_workspace_floats(
      std::min(rows, options_.decode_rows), static_cast<int>(H), static_cast<int>(c.head_dim),
      keys);
  size_t bytes = 0;
  auto take = [&](size_t b) {
    const size_t at = bytes;
    bytes += align_up(b);
    return at;
  };
  const size_t o_xn = take(R * C * 2), o_qkv = take(R * (q + 2 * kv) * 2), o_att = take(R * q * 2),
               o_proj = take(R * C * 2), o_gu = take(R * 2 * I * 2), o_act = take(R * I * 2),
               o_lse = take(R * H * 4), o_rows = take(R * C * 4), o_normed = take(R * C * 4),
               o_dec = take(dec * 4), o_blas = take(kBlasWorkspace), o_sc = take(R * 4),
               o_scf = take(R * 4);
  const size_t pool_bytes =
      options_.pool_tensor_cores && (c.head_dim == 64 || c.head_dim == 128)
          ? std::max(kernels::attention_pool_tiled_scratch_bytes(R, keys, static_cast<int>(H),
                                                                 static_cast<int>(c.num_kv_heads),
                                                                 static_cast<int>(c.head_dim)),
                     options_.pool_fused
                         ? kernels::attention_prefill_pool_scratch_bytes(R, static_cast<int>(H))
                         : size_t{0})
          : 0;
  const size_t o_pool = take(pool_bytes);
  const size_t split_bytes =
      options_.prefill_split && (c.head_dim == 64 || c.head_dim == 128)
          ? kernels::prefill_split_max_bytes(static_cast<int>(c.head_dim), sm_count_)
          : 0;
  const size_t o_split = take(split_bytes);
  // Our products' stream-K scratch (partial tiles and flags), where they run.
  const size_t scratch_bytes = kernels::wgmma_available() ? kernels::gemm_wgmma_scratch_bytes() : 0;
  const size_t o_gemm = take(scratch_bytes);
  synchronize();
  drop_all_recordings();  // they point into the workspace and at the old cuBLAS handle's
  blas_ = kernels::BlasHandle();
  cudaFree(workspace_);
  workspace_ = nullptr;
  KEEP_RETURN_IF_ERROR(cuda_status(cudaMalloc(&workspace_, bytes),
                                   "workspace of " + std::to_string(bytes >> 20) + " MiB for " +
                                       std::to_string(rows) + " rows"));
  workspace_bytes_ = bytes;
  auto* base = static_cast<char*>(workspace_);
  xn_ = base + o_xn;
  qkv_ = base + o_qkv;
  att_ = base + o_att;
  proj_ = base + o_proj;
  gate_up_ = base + o_gu;
  act_ = base + o_act;
  lse_ = reinterpret_cast<float*>(base + o_lse);
  rows_f32_ = reinterpret_cast<float*>(base + o_rows);
  normed_f32_ = reinterpret_cast<float*>(base + o_normed);
  decode_ws_ = reinterpret_cast<float*>(base + o_dec);
  decode_ws_floats_ = dec;
  pool_scratch_ = pool_bytes > 0 ? base + o_pool : nullptr;
  pool_scratch_bytes_ = pool_bytes;
  prefill_split_ =
      kernels::PrefillSplit{split_bytes > 0 ? base + o_split : nullptr, split_bytes, 0};
  blas_ws_ = base + o_blas;
  scalars_ = reinterpret_cast<int32_t*>(base + o_sc);
  scalars_f_ = reinterpret_cast<float*>(base + o_scf);
  gemm_scratch_ = kernels::GemmScratch{scratch_bytes > 0 ? base + o_gemm : nullptr, scratch_bytes};
  if (scratch_bytes > 0) {
    KEEP_CUDA_CHECK(cudaMemsetAsync(gemm_scratch_.ptr, 0, scratch_bytes, stream_));
  }
  cublasStatus_t st = blas_.init(stream_, blas_ws_, kBlasWorkspace);
  if (st == CUBLAS_STATUS_SUCCESS) st = tuner_.init(stream_, blas_ws_, kBlasWorkspace);
  if (st == CUBLAS_STATUS_SUCCESS && options_.blas_leave_loader) {
    st = blas_.set_sm_count_target(loader_free_ctas());
    if (st == CUBLAS_STATUS_SUCCESS) st = tuner_.set_sm_count_target(loader_free_ctas());
  }
  if (options_.gemm_own_products) {
    tuner_.use_own_products(gemm_scratch_, options_.gemm_own_only,
                            caps_for_loader() ? loader_free_ctas() : 0);
  }
  if (st != CUBLAS_STATUS_SUCCESS) {
    return Status(Code::kUnavailable,
                  std::string("cuda backend: cublas: ") + kernels::blas_status_name(st));
  }
  if (options_.l2_persist_residual && l2_persist_max_ > 0) {
    const size_t want = std::min(l2_persist_max_, R * C * 4);
    KEEP_RETURN_IF_ERROR(cuda_status(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, want),
                                     "persisting L2 set-aside"));
    l2_set_aside_ = want;
    l2_window_ = nullptr;  // the next window's hit ratio follows the new set-aside
  }
  KEEP_RETURN_IF_ERROR(tune_products(rows));
  reserved_rows_ = rows;
  reserved_keys_ = keys;
  return Status::ok();
}

Status CudaBackend::tune_products(int32_t rows) {
  const int64_t first = options_.gemm_autotune_rows;
  if (first <= 0 || rows < first || layers_.empty()) return Status::ok();
  const ModelConfig& c = config_;
  const int64_t C = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), I = c.intermediate_size;
  const int64_t qkv_w = q + 2 * kv;
  auto* xn = static_cast<bf16*>(xn_);
  auto* att = static_cast<bf16*>(att_);
  auto* act = static_cast<bf16*>(act_);
  // Representative operands (the workspace is fresh: zeros would time differently from data).
  KEEP_CUDA_CHECK(kernels::fill_uniform(xn, rows * C, 11, -1.0f, 1.0f, stream_));
  KEEP_CUDA_CHECK(kernels::fill_uniform(att, rows * q, 12, -1.0f, 1.0f, stream_));
  KEEP_CUDA_CHECK(kernels::fill_uniform(act, rows * I, 13, -1.0f, 1.0f, stream_));
  KEEP_CUDA_CHECK(kernels::fill_uniform(rows_f32_, rows * C, 14, -1.0f, 1.0f, stream_));
  const Layer& w = layers_[0];
  struct Job {
    kernels::GemmShape shape;
    void* y;
    const bf16* x;
    const bf16* w;
    const char* name;
  };
  // As layer_forward issues them (shapes, strides, the fp32 residual for accumulated products).
  const Job jobs[] = {
      {{qkv_w, C, C, qkv_w, false}, qkv_, xn, w.w_qkv, "qkv"},
      w.b_o == nullptr ? Job{{C, q, q, C, true}, rows_f32_, att, w.w_o, "o_proj"}
                       : Job{{C, q, q, C, false}, proj_, att, w.w_o, "o_proj"},
      {{2 * I, C, C, 2 * I, false}, gate_up_, xn, w.w_gate_up, "gate_up"},
      {{C, I, I, C, true}, rows_f32_, act, w.w_down, "down"},
  };
  std::string kept;
  int tried = 0;
  for (int64_t r = first;; r = std::min<int64_t>(2 * r, rows)) {
    for (const Job& j : jobs) {
      if (j.w == w.w_gate_up && fused_swiglu_ && r >= options_.fused_swiglu_rows) continue;
      kernels::GemmTuner::TuneResult res;
      const cublasStatus_t st =
          tuner_.tune(blas_.get(), j.shape, r, j.y, j.x, j.w,
                      options_.gemm_own_only ? -1.0 : options_.gemm_autotune_margin, &res);
      if (st != CUBLAS_STATUS_SUCCESS) {
        return Status(Code::kUnavailable, std::string("cuda backend: gemm autotune (") + j.name +
                                              "): " + kernels::blas_status_name(st));
      }
      ++tried;
      if (res.chosen >= 0) {
        char line[96];
        std::snprintf(line, sizeof(line), " %s@%lld %.3f->%.3f ms", j.name,
                      static_cast<long long>(r), res.default_ms, res.best_ms);
        kept += line;
        kept += " (" + tuner_.describe(j.shape, r) + ")";
      }
    }
    if (r == rows) break;
  }
  KEEP_LOG_INFO("engine", "gemm autotune: %zu of %d products take a cuBLASLt algorithm or ours%s",
                tuner_.tuned(), tried, kept.c_str());
  return Status::ok();
}

Result<std::unique_ptr<AttentionPlan>> CudaBackend::plan(const AttentionLayout& layout) {
  auto p = std::make_unique<CudaPlan>(layout, stream_, layout.num_rows() > options_.decode_rows);
  return std::unique_ptr<AttentionPlan>(std::move(p));
}

Status CudaBackend::prepare(const AttentionPlan& plan) {
  KEEP_CHECK(!capturing_);
  return static_cast<const CudaPlan&>(plan).upload();
}

// ---- launchers ----

void CudaBackend::embed(float* hidden, const int32_t* tokens, int32_t n) {
  mark(-1);
  const auto* table = static_cast<const bf16*>(embed_);
  const int64_t C = config_.hidden_size, V = config_.vocab_size;
  // A request's first GPU work, in as few API calls as possible (on a host idle before the request
  // each takes tens of us): up to kEmbedParamIds ids travel in the kernel's parameters, one launch
  // and no copy; more go through stream-ordered memory.
  if (n <= kernels::kEmbedParamIds) {
    KEEP_CUDA_CHECK(kernels::embedding_host_ids(hidden, table, tokens, n, C, V, stream_));
  } else {
    int32_t* ids = upload_ints(tokens, static_cast<size_t>(n));
    KEEP_CUDA_CHECK(kernels::embedding(hidden, table, ids, n, C, V, stream_));
    release_ints(ids);
  }
  mark(kEmbed);
}

Status CudaBackend::layer_forward(const LayerOutputs& out, const float* hidden_in, int32_t layer,
                                  const KvView& kv, const AttentionPlan& plan_base) {
  const auto& plan = static_cast<const CudaPlan&>(plan_base);  // uploaded below, before its use
  const ModelConfig& c = config_;
  const Layer& w = layers_[static_cast<size_t>(layer)];
  const int64_t rows = plan.rows.rows;
  KEEP_CHECK(rows <= reserved_rows_ && plan.rows.num_keys <= reserved_keys_);
  KEEP_CHECK(kv.type == KvType::kBF16);
  auto* view_k = static_cast<bf16*>(kv.k);
  auto* view_v = static_cast<bf16*>(kv.v);
  const int64_t C = c.hidden_size, q = c.q_dim(), kvd = c.kv_dim(), I = c.intermediate_size;
  const int64_t qkv_w = q + 2 * kvd;
  const int heads = static_cast<int>(c.num_heads), kv_heads = static_cast<int>(c.num_kv_heads);
  const int hd = static_cast<int>(c.head_dim);
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto* xn = static_cast<bf16*>(xn_);
  auto* qkv = static_cast<bf16*>(qkv_);
  auto* att = static_cast<bf16*>(att_);
  auto* proj = static_cast<bf16*>(proj_);
  auto* gu = static_cast<bf16*>(gate_up_);
  auto* act = static_cast<bf16*>(act_);
  cublasHandle_t h = blas_.get();
  mark(-1);
  // y (m, ys) = x W^T, or y += x W^T into fp32: our few-row kernel or cuBLAS.
  const bool gemv_dims = C % 8 == 0 && q % 8 == 0 && I % 8 == 0;
  auto few_rows = [&](int64_t m) { return gemv_dims && m <= options_.gemv_rows; };
  const int few_ctas = loader_free_ctas();
  // Our large products leave the loader its SMs only while it has work.
  const bool leave_loader = caps_for_loader() && loads_in_flight();
  // The product reserve() tuned for this shape and about these rows (a cuBLASLt algorithm or our
  // gemm_wgmma), where it kept one.
  auto tuned = [&](void* y, int64_t ys, const bf16* x, int64_t xs, const bf16* wt, int64_t m,
                   int64_t n, int64_t k, bool acc) {
    if (tuner_.tuned() == 0) return false;
    const cublasStatus_t st =
        tuner_.run({n, k, xs, ys, acc}, m, y, x, wt, leave_loader ? few_ctas : 0);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) return false;
    KEEP_BLAS_CHECK(st);
    return true;
  };
  // Few rows (more than gemv's): our products in one-CTA clusters (own_few_rows).
  const auto own_few = [&](int64_t m) {
    return own_few_ && !few_rows(m) && m <= std::min(options_.own_few_rows, kernels::kGemmTileRows);
  };
  auto product = [&](bf16* y, int64_t ys, const bf16* x, int64_t xs, const bf16* wt, int64_t m,
                     int64_t n, int64_t k) {
    if (few_rows(m)) {
      KEEP_CUDA_CHECK(kernels::gemv(y, ys, x, xs, wt, m, n, k, stream_));
    } else if (own_few(m) && kernels::gemm_wgmma_fits(n, k)) {
      KEEP_CUDA_CHECK(kernels::gemm_wgmma(y, ys, x, xs, wt, m, n, k, gemm_scratch_, stream_,
                                          kernels::GemmSchedule::kAuto, 0, few_ctas));
    } else if (!tuned(y, ys, x, xs, wt, m, n, k, false)) {
      KEEP_BLAS_CHECK(kernels::gemm_nt(h, y, ys, x, xs, wt, m, n, k));
    }
  };
  auto accumulate = [&](float* y, int64_t ys, const bf16* x, int64_t xs, const bf16* wt, int64_t m,
                        int64_t n, int64_t k) {
    if (few_rows(m)) {
      KEEP_CUDA_CHECK(kernels::gemv_accumulate(y, ys, x, xs, wt, m, n, k, stream_));
    } else if (own_few(m) && kernels::gemm_wgmma_fits(n, k)) {
      KEEP_CUDA_CHECK(kernels::gemm_wgmma_accumulate(y, ys, x, xs, wt, m, n, k, gemm_scratch_,
                                                     stream_, kernels::GemmSchedule::kAuto, 0,
                                                     few_ctas));
    } else if (!tuned(y, ys, x, xs, wt, m, n, k, true)) {
      KEEP_BLAS_CHECK(kernels::gemm_nt_accumulate(h, y, ys, x, xs, wt, m, n, k));
    }
  };

  // Rows [skip, rows) produce hidden output (out.out_rows); the others only K/V (and lse/pooled).
  int64_t keep = out.out_rows < 0 ? rows : std::min<int64_t>(out.out_rows, rows);
  const int64_t skip = rows - keep;
  float* res = out.hidden;
  if (options_.l2_persist_residual) persist_in_l2(res, static_cast<size_t>(rows * C) * 4);
  if (res != hidden_in) {
    KEEP_CUDA_CHECK(
        cudaMemcpyAsync(res, hidden_in, rows * C * 4, cudaMemcpyDeviceToDevice, stream_));
  }
  // A decode step's norms run inside the following product (gemv_rmsnorm): one launch less each.
  auto norm_fused = [&](int64_t m) {
    return few_rows(m) && static_cast<size_t>(m * C * 2) <= kernels::kGemvNormMaxSmem;
  };
  const bool pool = out.pooled != nullptr && !plan.layout().key_group.empty();
  float* lse = out.lse != nullptr ? out.lse : (pool ? lse_ : nullptr);
  // Attention for every row when lse/pooled are wanted; else for the kept rows only, which the
  // split-key kernel serves as a suffix of the plan's rows when they are few.
  const bool tail_only = skip > 0 && lse == nullptr && keep <= options_.decode_rows;
  // Rows whose Q is needed: all where attention runs over every row, else the kept ones (none for
  // K/V only). A prefill's last layer keeps one row: its QKV product then covers the K and V
  // columns for every row and the Q columns for that row alone (7B at 1024 rows: 26 of the
  // layer's 34 GFLOP of QKV skipped). The other rows' Q columns are left as they were; qkv_finish
  // rotates them, nothing reads them.
  const int64_t q_from = lse == nullptr && (keep == 0 || tail_only) ? skip : 0;

  // Attention half.
  if (norm_fused(rows)) {
    mark(kNorm);  // (empty: fused into the QKV product)
    KEEP_CUDA_CHECK(kernels::gemv_rmsnorm(qkv, qkv_w, res, C, w.attn_norm, eps, w.w_qkv, rows,
                                          qkv_w, C, stream_));
  } else {
    KEEP_CUDA_CHECK(
        kernels::add_rmsnorm(xn, res, nullptr, nullptr, w.attn_norm, rows, C, eps, stream_));
    mark(kNorm);
    if (q_from == 0) {
      product(qkv, qkv_w, xn, C, w.w_qkv, rows, qkv_w, C);
    } else {
      product(qkv + q, qkv_w, xn, C, w.w_qkv + q * C, rows, 2 * kvd, C);  // K, V: every row
      if (keep > 0) product(qkv + q_from * qkv_w, qkv_w, xn + q_from * C, C, w.w_qkv, keep, q, C);
    }
  }
  mark(kQkv);
  if (!plan.uploaded()) {
    // Not inside a capture: a plan a capture uses is prepared before it (Backend::prepare).
    if (capturing_) {
      return Status(Code::kInternal,
                    "cuda backend: a plan used in a captured layer loop before prepare()");
    }
    KEEP_RETURN_IF_ERROR(plan.upload());
  }
  KEEP_CUDA_CHECK(kernels::qkv_finish(qkv, out.k_pre, out.v, view_k, view_v, w.b_q, w.b_k, w.b_v,
                                      plan.positions, plan.slots, inv_freq_, rows, heads, kv_heads,
                                      hd, stream_));
  mark(kQkvFinish);
  if (keep == 0 && lse == nullptr) return Status::ok();  // K/V only
  // The kept rows' attention output.
  const bf16* att_kept = att;
  bool pooled = false;  // by the attention pass itself (pool_fused)
  if (tail_only) {
    kernels::AttentionRows tail = plan.rows;
    tail.row_offsets += skip;
    tail.rows = static_cast<int32_t>(keep);
    KEEP_CUDA_CHECK(kernels::attention_decode(att, q, nullptr, qkv + skip * qkv_w, qkv_w, view_k,
                                              view_v, tail, heads, kv_heads, hd, scale, decode_ws_,
                                              decode_ws_floats_, stream_));
  } else {
    if (plan.tiled) {
      cudaError_t err = cudaErrorNotSupported;
      if (pool && options_.pool_fused && pool_scratch_ != nullptr) {
        // At a check layer the wide kernel pools in the attention pass where it can; its time
        // then counts as the attention's.
        err = kernels::attention_prefill_pool(
            att, q, lse, out.pooled, qkv, qkv_w, view_k, view_v, plan.rows, plan.schedule,
            plan.key_group, plan.layout().num_groups, heads, kv_heads, hd, scale, pool_scratch_,
            pool_scratch_bytes_, stream_, options_.prefill_attention);
        pooled = err != cudaErrorNotSupported;
      }
      if (!pooled) {
        err = kernels::attention_prefill(att, q, lse, qkv, qkv_w, view_k, view_v, plan.rows,
                                         plan.schedule, heads, kv_heads, hd, scale, stream_,
                                         options_.prefill_attention, prefill_split_);
      }
      KEEP_CUDA_CHECK(err);
    } else {
      KEEP_CUDA_CHECK(kernels::attention_decode(att, q, lse, qkv, qkv_w, view_k, view_v, plan.rows,
                                                heads, kv_heads, hd, scale, decode_ws_,
                                                decode_ws_floats_, stream_));
    }
    att_kept = att + skip * q;
  }
  mark(kAttention);
  if (pool) {
    if (pooled) {
      // (by the attention pass above)
    } else if (plan.tiled && pool_scratch_ != nullptr) {
      KEEP_CUDA_CHECK(kernels::attention_pool_tiled(
          out.pooled, qkv, qkv_w, view_k, plan.rows, plan.schedule, plan.key_group,
          plan.layout().num_groups, heads, kv_heads, hd, scale, pool_scratch_, pool_scratch_bytes_,
          stream_, options_.prefill_attention, prefill_split_));
    } else {
      KEEP_CUDA_CHECK(kernels::attention_pool(out.pooled, qkv, qkv_w, view_k, lse, plan.rows,
                                              plan.key_group, plan.layout().num_groups, heads,
                                              kv_heads, hd, scale, stream_));
    }
    mark(kPool);
    if (out.pooled_to_host && !capturing_) {
      const size_t floats =
          static_cast<size_t>(rows) * static_cast<size_t>(plan.layout().num_groups);
      if (pooled_host_floats_ < floats) {  // grows to the largest check; not per request
        KEEP_CUDA_CHECK(cudaStreamSynchronize(copy_stream_));
        cudaFreeHost(pooled_host_);
        pooled_host_ = nullptr;
        pooled_host_floats_ = 0;
        KEEP_RETURN_IF_ERROR(cuda_status(cudaHostAlloc(reinterpret_cast<void**>(&pooled_host_),
                                                       floats * 4, cudaHostAllocDefault),
                                         "pooled staging"));
        pooled_host_floats_ = floats;
      }
      KEEP_CUDA_CHECK(cudaEventRecord(pooled_ready_, stream_));
      KEEP_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, pooled_ready_, 0));
      KEEP_CUDA_CHECK(cudaMemcpyAsync(pooled_host_, out.pooled, floats * 4, cudaMemcpyDeviceToHost,
                                      copy_stream_));
      KEEP_CUDA_CHECK(cudaEventRecord(pooled_copied_, copy_stream_));
      pooled_src_ = out.pooled;
      pooled_floats_ = floats;
    }
  }
  if (keep == 0) return Status::ok();
  float* res_kept = res + skip * C;
  // residual += o_proj: accumulated by the product itself in fp32 (no bf16 rounding of the
  // projection, no add kernel); with an o_proj bias through the add kernel instead.
  // Rows chosen inside the layer (out.choose_rows): the o_proj below runs for every row (skip is
  // 0), the host's wait for the pooled copy and its choice overlapping it; then the MLP for the
  // chosen rows only, normalised after the choice.
  const bool choose = out.choose_rows != nullptr;
  if (choose && capturing_) {
    return Status(Code::kInternal, "cuda backend: rows chosen inside a captured layer");
  }
  bool mlp_fused = w.b_o == nullptr && norm_fused(keep) && !choose;
  if (w.b_o == nullptr) {
    accumulate(res_kept, C, att_kept, q, w.w_o, keep, C, q);
    mark(kOProj);
    if (!mlp_fused && !choose) {
      KEEP_CUDA_CHECK(
          kernels::add_rmsnorm(xn, res_kept, nullptr, nullptr, w.ffn_norm, keep, C, eps, stream_));
    }
  } else {  // (with rows chosen, its xn is not used: the chosen rows are normalised again)
    product(proj, C, att_kept, q, w.w_o, keep, C, q);
    mark(kOProj);
    KEEP_CUDA_CHECK(
        kernels::add_rmsnorm(xn, res_kept, proj, w.b_o, w.ffn_norm, keep, C, eps, stream_));
  }
  if (choose) {
    KEEP_ASSIGN_OR_RETURN(const std::vector<int32_t> chosen, (*out.choose_rows)());
    mark(kChoose);
    keep = static_cast<int64_t>(chosen.size());
    if (keep == 0) return Status::ok();
    gather_rows(out.chosen_hidden, res_kept, chosen.data(), static_cast<int32_t>(keep),
                static_cast<size_t>(C));
    res_kept = out.chosen_hidden;
    mlp_fused = norm_fused(keep);
    if (!mlp_fused) {
      KEEP_CUDA_CHECK(
          kernels::add_rmsnorm(xn, res_kept, nullptr, nullptr, w.ffn_norm, keep, C, eps, stream_));
    }
  }
  mark(kMlpNorm);
  // MLP half: gate/up (the norm fused in for a decode step), SwiGLU (fused into the product for
  // many rows), residual += down.
  const bool swiglu_fused =
      !mlp_fused && ((fused_swiglu_ && keep >= options_.fused_swiglu_rows) || own_few(keep));
  if (mlp_fused) {
    KEEP_CUDA_CHECK(kernels::gemv_rmsnorm(gu, 2 * I, res_kept, C, w.ffn_norm, eps, w.w_gate_up,
                                          keep, 2 * I, C, stream_));
  } else if (swiglu_fused) {
    KEEP_CUDA_CHECK(kernels::gemm_swiglu(act, I, xn, C, w.w_gate_up, keep, I, C, stream_,
                                         gemm_scratch_, kernels::GemmSchedule::kAuto,
                                         own_few(keep) || leave_loader ? few_ctas : 0));
  } else {
    product(gu, 2 * I, xn, C, w.w_gate_up, keep, 2 * I, C);
  }
  mark(kGateUp);
  if (!swiglu_fused) KEEP_CUDA_CHECK(kernels::swiglu_rows(act, gu, keep, I, stream_));
  mark(kSwiglu);
  accumulate(res_kept, C, act, I, w.w_down, keep, C, I);
  mark(kDown);
  return Status::ok();
}

// The stream's L2 access policy: `bytes` from p persisting, as much of it as the set-aside holds
// (the rest normal). Set again only when the window moves or changes size, and not inside a
// capture (a later call outside one sets it).
void CudaBackend::persist_in_l2(const void* p, size_t bytes) {
  if (l2_set_aside_ == 0 || l2_window_max_ == 0 || capturing_) return;
  bytes = std::min(bytes, l2_window_max_);
  if (p == l2_window_ && bytes == l2_window_bytes_) return;
  cudaStreamAttrValue v{};
  v.accessPolicyWindow.base_ptr = const_cast<void*>(p);
  v.accessPolicyWindow.num_bytes = bytes;
  v.accessPolicyWindow.hitRatio =
      std::min(1.0f, static_cast<float>(l2_set_aside_) / static_cast<float>(bytes));
  v.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
  v.accessPolicyWindow.missProp = cudaAccessPropertyNormal;
  KEEP_CUDA_CHECK(cudaStreamSetAttribute(stream_, cudaStreamAttributeAccessPolicyWindow, &v));
  l2_window_ = p;
  l2_window_bytes_ = bytes;
}

// ---- graphs ----

void CudaBackend::begin_capture() {
  KEEP_CHECK(!capturing_);
  if (!options_.graphs || profiling_) return;
  KEEP_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  capturing_ = true;
}

void CudaBackend::end_capture(bool run) {
  if (!capturing_) return;
  std::vector<cudaGraph_t> parts = end_capture_parts();
  if (!run) {
    for (cudaGraph_t g : parts) cudaGraphDestroy(g);
    return;
  }
  if (parts.size() > 1) {  // cut by capture_split(): each part instantiated for this run only
    for (cudaGraphExec_t exec : launch_parts(parts)) cudaGraphExecDestroy(exec);  // freed once done
    return;
  }
  cudaGraph_t graph = parts.front();
  size_t nodes = 0;
  KEEP_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  auto it = std::find_if(graph_execs_.begin(), graph_execs_.end(),
                         [&](const auto& e) { return e.first == nodes; });
  if (it != graph_execs_.end()) {
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(it->second, graph, &info) != cudaSuccess) {
      cudaGetLastError();  // another topology with as many nodes: instantiate afresh
      cudaGraphExecDestroy(it->second);
      graph_execs_.erase(it);
      it = graph_execs_.end();
    }
  }
  if (it == graph_execs_.end()) {
    cudaGraphExec_t exec = nullptr;
    KEEP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    graph_execs_.emplace_back(nodes, exec);
    it = graph_execs_.end() - 1;
  }
  KEEP_CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
  KEEP_CUDA_CHECK(cudaGraphDestroy(graph));
}

std::vector<cudaGraph_t> CudaBackend::end_capture_parts() {
  capturing_ = false;
  cudaGraph_t last = nullptr;
  KEEP_CUDA_CHECK(cudaStreamEndCapture(stream_, &last));
  std::vector<cudaGraph_t> parts = std::move(captured_parts_);
  captured_parts_.clear();
  parts.push_back(last);
  return parts;
}

std::vector<cudaGraphExec_t> CudaBackend::launch_parts(const std::vector<cudaGraph_t>& parts) {
  // Each part is launched as soon as it is instantiated, so the GPU starts on the first while the
  // next ones are instantiated.
  std::vector<cudaGraphExec_t> execs;
  for (cudaGraph_t g : parts) {
    cudaGraphExec_t exec = nullptr;
    KEEP_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    KEEP_CUDA_CHECK(cudaGraphDestroy(g));
    KEEP_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    execs.push_back(exec);
  }
  return execs;
}

uint64_t CudaBackend::end_capture_for_replay() {
  if (!capturing_) return 0;
  Recording r;
  r.handle = ++next_recording_;
  r.dependent_launch = kernels::dependent_launch();
  r.parts = launch_parts(end_capture_parts());
  recordings_.push_back(std::move(r));
  return recordings_.back().handle;
}

void CudaBackend::capture_split() {
  if (!capturing_) return;
  cudaGraph_t g = nullptr;
  KEEP_CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
  captured_parts_.push_back(g);
  KEEP_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
}

std::vector<CudaBackend::Recording>::const_iterator CudaBackend::find_recording(
    uint64_t handle) const {
  return std::find_if(recordings_.begin(), recordings_.end(),
                      [&](const Recording& r) { return r.handle == handle; });
}

Backend::ReplayState CudaBackend::replay_state(uint64_t handle) const {
  const auto r = find_recording(handle);
  if (r == recordings_.end()) return ReplayState::kGone;
  const bool now = options_.graphs && !profiling_ && !capturing_ &&
                   r->dependent_launch == kernels::dependent_launch();
  return now ? ReplayState::kReplayable : ReplayState::kNotNow;
}

void CudaBackend::replay(uint64_t handle) {
  KEEP_CHECK(replay_state(handle) == ReplayState::kReplayable);
  for (cudaGraphExec_t exec : find_recording(handle)->parts) {
    KEEP_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  }
  ++replays_;
}

void CudaBackend::drop_recording(uint64_t handle) {
  const auto r = find_recording(handle);
  if (r == recordings_.end()) return;
  for (cudaGraphExec_t exec : r->parts) cudaGraphExecDestroy(exec);
  recordings_.erase(r);
}

void CudaBackend::drop_all_recordings() {
  for (const Recording& r : recordings_) {
    for (cudaGraphExec_t exec : r.parts) cudaGraphExecDestroy(exec);
  }
  recordings_.clear();
}

// ---- profiling ----

void CudaBackend::mark(int stage) {
  if (!profiling_) return;
  const size_t i = marks_.size();
  if (i == events_.size()) {
    cudaEvent_t e = nullptr;
    KEEP_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  KEEP_CUDA_CHECK(cudaEventRecord(events_[i], stream_));
  marks_.push_back(stage);
}

void CudaBackend::set_profiling(bool on) {
  KEEP_CHECK(!capturing_);
  if (on && !profiling_) {
    marks_.clear();
    stage_times_.clear();
  }
  profiling_ = on;
}

std::vector<StageTime> CudaBackend::profile() {
  synchronize();
  if (stage_times_.empty()) {
    for (int i = 0; i < kStages; ++i) {
      stage_times_.push_back(StageTime{kStageNames[i], 0.0, 0, i < kLayerStages});
    }
  }
  for (size_t i = 1; i < marks_.size(); ++i) {
    if (marks_[i] < 0) continue;
    float ms = 0.0f;
    KEEP_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i - 1], events_[i]));
    stage_times_[static_cast<size_t>(marks_[i])].ms += ms;
    ++stage_times_[static_cast<size_t>(marks_[i])].calls;
  }
  marks_.clear();
  std::vector<StageTime> out = stage_times_;
  stage_times_.clear();
  return out;
}

void CudaBackend::load_kv(const KvView& kv, int32_t first_slot, const float* k_pre, const float* v,
                          const int32_t* positions, int32_t n) {
  KEEP_CHECK(kv.type == KvType::kBF16);
  const int64_t kvd = config_.kv_dim();
  const size_t elems = static_cast<size_t>(n) * static_cast<size_t>(kvd);
  auto* k_out = static_cast<bf16*>(kv.k) + static_cast<int64_t>(first_slot) * kvd;
  auto* v_out = static_cast<bf16*>(kv.v) + static_cast<int64_t>(first_slot) * kvd;
  // Stage fp32 K in stream-ordered memory, rotate it there in fp32, round once into the view.
  void* tmp = nullptr;
  KEEP_CUDA_CHECK(cudaMallocAsync(&tmp, elems * sizeof(float), stream_));
  auto* k32 = static_cast<float*>(tmp);
  KEEP_CUDA_CHECK(cudaMemcpyAsync(k32, k_pre, elems * 4, cudaMemcpyDefault, stream_));
  int32_t* pos = upload_ints(positions, static_cast<size_t>(n));
  KEEP_CUDA_CHECK(
      kernels::rope(k32, pos, inv_freq_, n, config_.num_kv_heads, config_.head_dim, kvd, stream_));
  KEEP_CUDA_CHECK(kernels::convert(k_out, k32, static_cast<int64_t>(elems), stream_));
  KEEP_CUDA_CHECK(cudaMemcpyAsync(k32, v, elems * 4, cudaMemcpyDefault, stream_));
  KEEP_CUDA_CHECK(kernels::convert(v_out, k32, static_cast<int64_t>(elems), stream_));
  release_ints(pos);
  KEEP_CUDA_CHECK(cudaFreeAsync(tmp, stream_));
}

namespace {
// Whether the device may read `p` in place: device memory, or host memory registered (mapped).
bool device_readable(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ||
         (a.type == cudaMemoryTypeHost && a.devicePointer != nullptr);
}
}  // namespace

bool CudaBackend::launch_runs(cudaStream_t stream, std::span<const KvRun> runs, int32_t blocks,
                              bool in_place) {
  bool vec = config_.head_dim % 16 == 0;
  for (const KvRun& r : runs) {
    if (!device_readable(r.k_pre) || !device_readable(r.v)) return false;
    for (const void* p : {static_cast<const void*>(r.k_pre), static_cast<const void*>(r.v),
                          static_cast<const void*>(r.kv.k), static_cast<const void*>(r.kv.v)}) {
      vec = vec && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    }
  }
  const size_t row_bytes = static_cast<size_t>(config_.kv_dim()) * sizeof(uint16_t);
  // The run's first slot in a plane of its view (r.kv.k or r.kv.v).
  auto slot = [&](const KvRun& r, void* plane) {
    return static_cast<bf16*>(plane) + static_cast<int64_t>(r.first_slot) * config_.kv_dim();
  };
  if (in_place && !runs.empty()) {  // the bytes as stored into the slots, by the copy engines
    dma_dsts_.clear();
    dma_srcs_.clear();
    dma_sizes_.clear();
    for (const KvRun& r : runs) {
      const size_t bytes = static_cast<size_t>(r.n) * row_bytes;
      dma_dsts_.insert(dma_dsts_.end(), {slot(r, r.kv.k), slot(r, r.kv.v)});
      dma_srcs_.insert(dma_srcs_.end(), {r.k_pre, r.v});
      dma_sizes_.insert(dma_sizes_.end(), {bytes, bytes});
    }
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx = 0;
    KEEP_CUDA_CHECK(cudaMemcpyBatchAsync(dma_dsts_.data(), dma_srcs_.data(), dma_sizes_.data(),
                                         dma_dsts_.size(), &attr, &attr_idx, 1, stream));
  }
  for (size_t at = 0; at < runs.size();) {
    if (runs_at_ == kRunRing) {  // full mid-request: every entry handed out may still be read
      KEEP_CUDA_CHECK(cudaStreamSynchronize(load_stream_));
      KEEP_CUDA_CHECK(cudaStreamSynchronize(stream_));
      runs_at_ = 0;
    }
    const size_t n = std::min(runs.size() - at, kRunRing - runs_at_);
    kernels::KvLoadRun* host = runs_host_ + runs_at_;
    for (size_t i = 0; i < n; ++i) {
      const KvRun& r = runs[at + i];
      host[i] = {in_place ? slot(r, r.kv.k) : reinterpret_cast<const bf16*>(r.k_pre),
                 in_place ? nullptr : reinterpret_cast<const bf16*>(r.v),
                 static_cast<bf16*>(r.kv.k),
                 static_cast<bf16*>(r.kv.v),
                 r.first_slot,
                 r.n};
    }
    kernels::KvLoadRun* dev = runs_dev_ + runs_at_;
    KEEP_CUDA_CHECK(
        cudaMemcpyAsync(dev, host, n * sizeof(kernels::KvLoadRun), cudaMemcpyHostToDevice, stream));
    KEEP_CUDA_CHECK(kernels::load_kv_runs(dev, static_cast<int32_t>(n), inv_freq_,
                                          config_.num_kv_heads, config_.head_dim, blocks, vec,
                                          stream));
    runs_at_ += n;
    at += n;
  }
  return true;
}

void CudaBackend::load_kv_bf16_runs(std::span<const KvRun> runs) {
  for (const KvRun& r : runs) KEEP_CHECK(r.kv.type == KvType::kBF16);
  // Nothing runs beside it: the whole GPU.
  if (!launch_runs(stream_, runs, 8 * sm_count_)) {
    Backend::load_kv_bf16_runs(runs);  // pageable sources: staged run by run
  }
}

void CudaBackend::queue_kv_bf16_runs(std::span<const KvRun> runs) {
  for (const KvRun& r : runs) KEEP_CHECK(r.kv.type == KvType::kBF16);
  // One launch per stretch of one layer's runs, its event right after: a layer waits for its own
  // loads only, not for the later layers queued with them.
  for (size_t at = 0; at < runs.size();) {
    size_t end = at + 1;
    while (end < runs.size() && runs[end].layer == runs[at].layer) ++end;
    const std::span<const KvRun> part = runs.subspan(at, end - at);
    if (capturing_ || !launch_runs(load_stream_, part, std::max(options_.loader_blocks, 1),
                                   options_.loader_dma)) {
      load_kv_bf16_runs(part);  // on the compute stream, ordered with the layers
    } else {
      KEEP_CUDA_CHECK(
          cudaEventRecord(load_done_[static_cast<size_t>(runs[at].layer)], load_stream_));
      last_queued_layer_ = runs[at].layer;
    }
    at = end;
  }
}

bool CudaBackend::loads_in_flight() const {
  // No query inside a capture (its loads run on the compute stream anyway).
  if (capturing_ || last_queued_layer_ < 0) return false;
  return cudaEventQuery(load_done_[static_cast<size_t>(last_queued_layer_)]) == cudaErrorNotReady;
}

void CudaBackend::set_loader_blocks(int32_t blocks) {
  options_.loader_blocks = std::max(blocks, 1);
}

void CudaBackend::wait_queued(int32_t layer) {
  if (capturing_ || layer < 0 || static_cast<size_t>(layer) >= load_done_.size()) return;
  KEEP_CUDA_CHECK(cudaStreamWaitEvent(stream_, load_done_[static_cast<size_t>(layer)], 0));
}

void CudaBackend::fence_queue() {
  if (capturing_) return;
  if (runs_at_ > kRunRing / 2) {  // between requests both streams are idle: a cheap wait
    KEEP_CUDA_CHECK(cudaStreamSynchronize(load_stream_));
    KEEP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    runs_at_ = 0;
  }
  KEEP_CUDA_CHECK(cudaEventRecord(fence_compute_, stream_));
  KEEP_CUDA_CHECK(cudaStreamWaitEvent(load_stream_, fence_compute_, 0));
  KEEP_CUDA_CHECK(cudaEventRecord(fence_load_, load_stream_));
  KEEP_CUDA_CHECK(cudaStreamWaitEvent(stream_, fence_load_, 0));
}

void CudaBackend::load_kv_bf16(const KvView& kv, int32_t first_slot, const uint16_t* k_pre,
                               const uint16_t* v, const int32_t* positions, int32_t n) {
  KEEP_CHECK(kv.type == KvType::kBF16);
  const int64_t kvd = config_.kv_dim();
  const size_t bytes = static_cast<size_t>(n) * static_cast<size_t>(kvd) * sizeof(uint16_t);
  const auto* k_src = reinterpret_cast<const bf16*>(k_pre);
  const auto* v_src = reinterpret_cast<const bf16*>(v);
  // The registered region (or device memory) is read in place; pageable memory goes through one
  // copy into the staging buffer, still bf16 (half of load_kv's fp32 bytes).
  if (!device_readable(k_pre) || !device_readable(v)) {
    if (kv_staging_bytes_ < 2 * bytes) {
      KEEP_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffer may still be read
      cudaFree(kv_staging_);
      kv_staging_ = nullptr;
      kv_staging_bytes_ = 0;
      KEEP_CUDA_CHECK(cudaMalloc(&kv_staging_, 2 * bytes));
      kv_staging_bytes_ = 2 * bytes;
    }
    auto* staged = static_cast<bf16*>(kv_staging_);
    KEEP_CUDA_CHECK(cudaMemcpyAsync(staged, k_pre, bytes, cudaMemcpyDefault, stream_));
    KEEP_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<std::byte*>(staged) + bytes, v, bytes,
                                    cudaMemcpyDefault, stream_));
    k_src = staged;
    v_src = reinterpret_cast<const bf16*>(reinterpret_cast<const std::byte*>(staged) + bytes);
  }
  auto* k_out = static_cast<bf16*>(kv.k) + static_cast<int64_t>(first_slot) * kvd;
  auto* v_out = static_cast<bf16*>(kv.v) + static_cast<int64_t>(first_slot) * kvd;
  int32_t* pos = upload_ints(positions, static_cast<size_t>(n));
  KEEP_CUDA_CHECK(kernels::load_kv_rope(k_out, v_out, k_src, v_src, pos, inv_freq_, n,
                                        config_.num_kv_heads, config_.head_dim, stream_));
  release_ints(pos);
}

bool CudaBackend::logit_gemv() const {
  return options_.logits == CudaBackendOptions::Logits::kF32Rows && config_.hidden_size % 8 == 0;
}

bool CudaBackend::norm_logit_rows(const float* hidden, const int32_t* rows, int32_t n) {
  const int64_t C = config_.hidden_size;
  int32_t* idx = upload_ints(rows, static_cast<size_t>(n));
  const float eps = static_cast<float>(config_.rms_norm_eps);
  KEEP_CUDA_CHECK(kernels::gather_rows(rows_f32_, hidden, idx, n, C, stream_));
  release_ints(idx);
  const bool rows_f32 = logit_gemv() || options_.logits == CudaBackendOptions::Logits::kF32;
  if (rows_f32) {
    KEEP_CUDA_CHECK(kernels::rmsnorm_residual(normed_f32_, rows_f32_, nullptr, final_norm_, n, C,
                                              eps, stream_));
  } else {
    KEEP_CUDA_CHECK(kernels::add_rmsnorm(static_cast<bf16*>(xn_), rows_f32_, nullptr, nullptr,
                                         final_norm_, n, C, eps, stream_));
  }
  return rows_f32;
}

void CudaBackend::final_logits(float* logits, const float* hidden, const int32_t* rows, int32_t n) {
  KEEP_CHECK(n <= reserved_rows_);
  mark(-1);
  const int64_t C = config_.hidden_size, V = config_.vocab_size;
  const bool rows_f32 = norm_logit_rows(hidden, rows, n);
  if (options_.logits == CudaBackendOptions::Logits::kF32) {
    KEEP_BLAS_CHECK(
        kernels::gemm_nt_f32(blas_.get(), logits, V, normed_f32_, C, lm_head_f32_, n, V, C));
  } else if (rows_f32) {  // kF32Rows: the few-row kernel, kGemvMaxRows rows per pass over lm_head
    for (int64_t a = 0; a < n; a += kernels::kGemvMaxRows) {
      const int64_t m = std::min<int64_t>(kernels::kGemvMaxRows, n - a);
      KEEP_CUDA_CHECK(kernels::gemv(logits + a * V, V, normed_f32_ + a * C, C,
                                    static_cast<const bf16*>(lm_head_), m, V, C, stream_));
    }
  } else {  // kBF16, or kF32Rows on a hidden size the gemv cannot take
    KEEP_BLAS_CHECK(kernels::gemm_nt(blas_.get(), logits, V, static_cast<bf16*>(xn_), C,
                                     static_cast<const bf16*>(lm_head_), n, V, C));
  }
  mark(kLogits);
}

void CudaBackend::final_logits_to_host(float* logits_host, float* logits, const float* hidden,
                                       const int32_t* rows, int32_t n) {
  const int64_t C = config_.hidden_size, V = config_.vocab_size;
  if (!logit_gemv() || n > kernels::kGemvMaxRows || V < kLogitSlices) {
    Backend::final_logits_to_host(logits_host, logits, hidden, rows, n);
    return;
  }
  KEEP_CHECK(n <= reserved_rows_);
  mark(-1);
  norm_logit_rows(hidden, rows, n);
  // Slice s: vocabulary rows [V s / k, V (s + 1) / k) of lm_head, then its event.
  const auto slice = [V](int s) { return V * s / kLogitSlices; };
  for (int s = 0; s < kLogitSlices; ++s) {
    const int64_t v0 = slice(s), width = slice(s + 1) - v0;
    KEEP_CUDA_CHECK(kernels::gemv(logits + v0, V, normed_f32_, C,
                                  static_cast<const bf16*>(lm_head_) + v0 * C, n, width, C,
                                  stream_));
    KEEP_CUDA_CHECK(cudaEventRecord(slice_done_[s], stream_));
  }
  mark(kLogits);
  // Each slice's copy waits for its product only; into pageable memory cudaMemcpy2DAsync returns
  // once the copy is done, while the stream goes on with the next slices.
  for (int s = 0; s < kLogitSlices; ++s) {
    const int64_t v0 = slice(s), width = slice(s + 1) - v0;
    KEEP_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, slice_done_[s], 0));
    KEEP_CUDA_CHECK(cudaMemcpy2DAsync(logits_host + v0, V * sizeof(float), logits + v0,
                                      V * sizeof(float), width * sizeof(float), n,
                                      cudaMemcpyDeviceToHost, copy_stream_));
  }
  KEEP_CUDA_CHECK(cudaEventRecord(copies_done_, copy_stream_));
  KEEP_CUDA_CHECK(cudaStreamWaitEvent(stream_, copies_done_, 0));  // later work, and the mark
  mark(kCopyOut);
  KEEP_CUDA_CHECK(cudaStreamSynchronize(copy_stream_));
}

void CudaBackend::argmax(int32_t* out_host, const float* logits, int32_t rows) {
  KEEP_CHECK(rows <= reserved_rows_);
  KEEP_CUDA_CHECK(kernels::argmax(scalars_, logits, rows, config_.vocab_size, stream_));
  KEEP_CUDA_CHECK(cudaMemcpyAsync(out_host, scalars_, static_cast<size_t>(rows) * 4,
                                  cudaMemcpyDeviceToHost, stream_));
  KEEP_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::token_logprob(float* out_host, const float* logits, const int32_t* tokens_host,
                                int32_t rows) {
  KEEP_CHECK(rows <= reserved_rows_);
  int32_t* tok = upload_ints(tokens_host, static_cast<size_t>(rows));
  KEEP_CUDA_CHECK(
      kernels::token_logprob(scalars_f_, logits, tok, rows, config_.vocab_size, stream_));
  KEEP_CUDA_CHECK(cudaMemcpyAsync(out_host, scalars_f_, static_cast<size_t>(rows) * 4,
                                  cudaMemcpyDeviceToHost, stream_));
  release_ints(tok);
  KEEP_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace keep::engine
