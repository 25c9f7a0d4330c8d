// Backend: where the engine's tensors live and its layer computations run (CPU now, CUDA next).
//
// The engine (engine.h) owns the layer-level API and validates every argument; a backend only
// executes. Its compute entry points are launchers in llm.c style: outputs first, then inputs, then
// sizes; no validation beyond KEEP_CHECKs, no allocation, no logging. Memory is allocated ahead of
// time: DeviceBuffers for tensors, reserve() for the backend's private workspace.
//
// Pointers marked "device" are in the backend's address space (host memory for the CPU backend,
// GPU memory for CUDA); small per-call index arrays (token ids, positions, rows) are host memory
// and the backend uploads them itself. Attention layouts are turned into an AttentionPlan once
// (plan()), then consumed by any number of layer calls: the host-side plan / device-side run split
// a CUDA backend needs (uploading the spans once per request, not once per layer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "services/worker/engine/core/attention_layout.h"
#include "shared/common/status.h"
#include "shared/model/model_config.h"

namespace keep::engine {

enum class DeviceKind : uint8_t { kCpu, kCuda };
const char* device_kind_name(DeviceKind kind);  // "cpu", "cuda"

// An owning array of floats in a backend's memory. Move-only; frees through the backend's deleter.
class DeviceBuffer {
 public:
  using Free = void (*)(float*);

  DeviceBuffer() = default;
  DeviceBuffer(float* data, size_t size, DeviceKind kind, Free free_fn)
      : data_(data), size_(size), kind_(kind), free_(free_fn) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = o.data_;
      size_ = o.size_;
      kind_ = o.kind_;
      free_ = o.free_;
      o.data_ = nullptr;
      o.size_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  float* data() const { return data_; }
  size_t size() const { return size_; }  // floats
  DeviceKind kind() const { return kind_; }
  bool empty() const { return data_ == nullptr; }

 private:
  void reset() {
    if (data_ != nullptr && free_ != nullptr) free_(data_);
    data_ = nullptr;
    size_ = 0;
  }
  float* data_ = nullptr;
  size_t size_ = 0;
  DeviceKind kind_ = DeviceKind::kCpu;
  Free free_ = nullptr;
};

// Element type of a backend's KV views: fp32 on the CPU, bf16 on CUDA (half the bytes every
// attention kernel streams, and the K values the attention, decode and pooling kernels all see are
// the same ones, so pooled probabilities sum to exactly what the LSE normalised).
enum class KvType : uint8_t { kF32, kBF16 };
inline size_t kv_type_size(KvType t) { return t == KvType::kF32 ? 4 : 2; }

// One layer's working keys and values (device). Slot t holds the K of the token at prompt slot t,
// ROTATED to that token's position, and its V. Loaded slots are filled with Backend::load_kv (from
// pre-RoPE K and V); computed slots are written by layer_forward.
struct KvView {
  void* k = nullptr;     // (capacity, kv_heads, head_dim) of `type`
  void* v = nullptr;     // (capacity, kv_heads, head_dim) of `type`
  int32_t capacity = 0;  // slots
  KvType type = KvType::kF32;

  // The fp32 arrays of an fp32 view (the CPU backend's); aborts on another type.
  float* k_f32() const;
  float* v_f32() const;
};

// What one layer call returns (device pointers; the optional ones may be null).
struct LayerOutputs {
  float* hidden = nullptr;  // (rows, hidden) the layer's output; may equal the input
  float* k_pre = nullptr;   // (rows, kv_heads, head_dim) the rows' new K before RoPE, or null
  float* v = nullptr;       // (rows, kv_heads, head_dim) the rows' new V, or null
  float* lse = nullptr;     // (rows, heads) log Σ_t exp(q·k_t / sqrt(hd)) over visible t, or null
  float* pooled = nullptr;  // (rows, num_groups) Σ_heads Σ_{t in g} p[row, head, t], or null
  // Rows whose `hidden` output is wanted: the last out_rows of the plan (-1: all). The other rows'
  // hidden values are left unspecified, and a backend may skip their attention output, o_proj and
  // MLP (the last layer of a prefill needs every row's K and V but one row's output). K/V, k_pre,
  // v, lse and pooled are still produced for every row.
  int32_t out_rows = -1;
  // With pooled: start copying it to the host as soon as it is computed, while the rest of the
  // layer runs; Backend::read_pooled then waits for that copy only (importance at a check layer is
  // decided on the host while the GPU finishes the layer).
  bool pooled_to_host = false;
  // The rows to keep, chosen inside the layer (KEEP's check layers: the importance read from
  // `pooled` decides which segments go on, and the others' MLP output would never be read). With
  // it the backend issues the attention and o_proj for every row, calls it -- it may wait for the
  // pooled copy --, and runs the MLP for the rows it returns (ascending, distinct, in [0, rows)
  // -- the engine checks them) only: their outputs go to `chosen_hidden`, packed in that order;
  // `hidden` is left unspecified. Needs out_rows = -1. An error from it is the layer's.
  const std::function<Result<std::vector<int32_t>>()>* choose_rows = nullptr;
  float* chosen_hidden = nullptr;  // (rows, C), not overlapping `hidden`
};

// A validated layout in the form the backend consumes (for CUDA: uploaded index arrays).
class AttentionPlan {
 public:
  virtual ~AttentionPlan() = default;
  virtual const AttentionLayout& layout() const = 0;
  int32_t num_rows() const { return layout().num_rows(); }
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual DeviceKind kind() const = 0;
  // "cpu fp32 (openblas 2 threads, 2 attention threads)"
  virtual std::string name() const = 0;
  virtual const ModelConfig& config() const = 0;
  virtual KvType kv_type() const { return KvType::kF32; }

  // ---- memory ----
  // A zero-filled buffer of `floats` floats (kResourceExhausted when it cannot be had).
  virtual Result<DeviceBuffer> allocate(size_t floats) = 0;
  virtual void copy_to_device(float* dst, const float* src_host, size_t floats) = 0;
  virtual void copy_to_host(float* dst_host, const float* src, size_t floats) = 0;
  virtual void copy_on_device(float* dst, const float* src, size_t floats) = 0;
  // dst_host (floats) = the pooled output of the last layer_forward (device `pooled`); with
  // LayerOutputs::pooled_to_host it waits only for the early copy. The default: copy_to_host.
  virtual void read_pooled(float* dst_host, const float* pooled, size_t floats) {
    copy_to_host(dst_host, pooled, floats);
  }
  // dst (n, cols) = src[rows[i], :] (device memory; rows on the host, dst not overlapping src).
  // The default copies row by row; the CUDA backend gathers in one kernel.
  virtual void gather_rows(float* dst, const float* src, const int32_t* rows, int32_t n,
                           size_t cols);
  // Waits for all launched work (no-op on the CPU).
  virtual void synchronize() = 0;

  // ---- planning (before the run) ----
  // Sizes the workspace for calls of up to `max_rows` rows attending to up to `max_keys` keys.
  // Idempotent; only grows. Launching more rows than reserved is a bug (KEEP_CHECK).
  virtual Status reserve(int32_t max_rows, int32_t max_keys) = 0;
  int32_t reserved_rows() const { return reserved_rows_; }
  int32_t reserved_keys() const { return reserved_keys_; }
  // `layout` must have passed validate().
  virtual Result<std::unique_ptr<AttentionPlan>> plan(const AttentionLayout& layout) = 0;
  // Makes a plan's device form now rather than at its first use, so that a capture can use it
  // (begin_capture: no planning inside one). Default: nothing to make.
  virtual Status prepare(const AttentionPlan& plan) {
    (void)plan;
    return Status::ok();
  }

  // ---- launchers (outputs first) ----
  // hidden (n, C) = embed[tokens[i]]; tokens (host) already range-checked.
  virtual void embed(float* hidden, const int32_t* tokens, int32_t n) = 0;
  // One transformer block for the plan's rows. Writes each row's rotated K and V into kv at its
  // slot, attends per the plan, fills `out`. hidden_in (rows, C) (device); out.hidden may alias it.
  // An error (the plan's device arrays could not be made) leaves out.hidden and kv's computed
  // slots undefined.
  virtual Status layer_forward(const LayerOutputs& out, const float* hidden_in, int32_t layer,
                               const KvView& kv, const AttentionPlan& plan) = 0;
  // Fills view slots [first_slot, first_slot + n): K = RoPE(k_pre) at positions (host), V = v,
  // both converted to the view's type. k_pre, v: (n, kv_heads, head_dim) fp32, host memory (the
  // shared KV region, registered or not) or device memory.
  virtual void load_kv(const KvView& kv, int32_t first_slot, const float* k_pre, const float* v,
                       const int32_t* positions, int32_t n) = 0;
  // The same from bf16 rows (the shared region's entries: uint16 bits of bf16, (n, kv_heads,
  // head_dim) each), host or device memory. The default widens them to fp32 on the host and calls
  // load_kv; the CUDA backend rotates and stores them in one kernel, reading registered host
  // memory in place and staging pageable memory through one copy.
  virtual void load_kv_bf16(const KvView& kv, int32_t first_slot, const uint16_t* k_pre,
                            const uint16_t* v, const int32_t* positions, int32_t n);
  // Many runs of bf16 rows at once (a layer's loads of every reused segment, or several layers'):
  // run r fills slots [first_slot, first_slot + n) of its layer's view at positions equal to the
  // slots. The default calls load_kv_bf16 per run; the CUDA backend launches one kernel for all.
  struct KvRun {
    KvView kv;          // the layer's view
    int32_t layer = 0;  // which layer's (queue_kv_bf16_runs orders that layer after it)
    int32_t first_slot = 0;
    int32_t n = 0;
    const uint16_t* k_pre = nullptr;
    const uint16_t* v = nullptr;
  };
  virtual void load_kv_bf16_runs(std::span<const KvRun> runs);
  // Layer-balanced loading (ARCHITECTURE §5). queue_kv_bf16_runs runs the loads beside the layers
  // (the CUDA backend: on its loader stream, in the order queued); wait_queued(layer) orders the
  // next layer_forward after every load queued so far for `layer`; fence_queue() orders the loads
  // queued after it behind the work issued before it, and that work behind the loads queued
  // before it (a request's start). The defaults load at once and order nothing.
  virtual void queue_kv_bf16_runs(std::span<const KvRun> runs) { load_kv_bf16_runs(runs); }
  virtual void wait_queued(int32_t layer) { (void)layer; }
  virtual void fence_queue() {}
  // logits (n, vocab) = lm_head(final_norm(hidden[rows[i]])); hidden (device) has >= max(rows)+1
  // rows of C; rows (host).
  virtual void final_logits(float* logits, const float* hidden, const int32_t* rows, int32_t n) = 0;
  // logits_host (n, vocab) = the same logits on the host, `logits` (device, (n, vocab)) holding
  // them too. Waits. The default runs final_logits, then copy_to_host; the CUDA backend copies
  // each slice of the vocabulary while it computes the next.
  virtual void final_logits_to_host(float* logits_host, float* logits, const float* hidden,
                                    const int32_t* rows, int32_t n);
  // out_host (rows) = argmax of each row of logits (device, (rows, vocab)), lowest index on ties,
  // NaN never wins (engine::argmax's rule). Waits for the result. The default copies the rows to
  // the host; a GPU backend reduces on the device and copies back `rows` ints.
  virtual void argmax(int32_t* out_host, const float* logits, int32_t rows);
  // out_host (rows) = log softmax(logits[r])[tokens_host[r]] (tokens in range). Waits.
  virtual void token_logprob(float* out_host, const float* logits, const int32_t* tokens_host,
                             int32_t rows);

  // ---- batching launches ----
  // The launches between begin_capture() and end_capture(true) may be recorded instead of run, and
  // run as one unit at end_capture (the CUDA backend captures them into a CUDA graph: one launch
  // for a whole layer loop). In between only layer_forward and load_kv from device memory may be
  // called: no copies to or from the host, no allocation, no planning. end_capture(false) drops
  // what was recorded (an error stopped the sequence). Default: launches run as called.
  virtual void begin_capture() {}
  virtual void end_capture(bool run) { (void)run; }
  // Recordings for replay, for a sequence that will recur with the same arguments (a prefill chunk
  // of a recurring shape into the same buffers: replay_cache.h): end_capture_for_replay() runs the
  // recorded sequence as end_capture(true) does and keeps it, returning a handle (> 0) for
  // replay(); 0 when nothing was recorded (no capture was open: the launches already ran). A
  // recording holds the pointers, sizes and plan it was made with, so the caller replays it only
  // where those are unchanged, the plan still alive. replay_state(): kReplayable, or kNotNow while
  // the backend would not capture (graphs off, profiling) or runs another dependent-launch setting
  // than the recording was made under (it stays), or kGone for a handle dropped or unknown
  // (reserve() moving the workspace drops them all). replay() runs a kReplayable one again
  // (anything else: a bug). drop_recording() releases one; the backend's destruction, all.
  enum class ReplayState : uint8_t { kReplayable, kNotNow, kGone };
  virtual uint64_t end_capture_for_replay() {
    end_capture(true);
    return 0;
  }
  virtual ReplayState replay_state(uint64_t handle) const {
    (void)handle;
    return ReplayState::kGone;
  }
  virtual void replay(uint64_t handle) { (void)handle; }
  virtual void drop_recording(uint64_t handle) { (void)handle; }
  // Inside a capture: the recorded sequence may be cut here into parts that run one after
  // another, so that the GPU starts on the first while the host still submits the next (a
  // graph's launch costs host time per node). No effect outside a capture.
  virtual void capture_split() {}

  // begin_capture() on construction; finish() runs the sequence; leaving scope without finish()
  // (an early error return) drops it.
  class Capture {
   public:
    explicit Capture(Backend& b) : b_(b) { b_.begin_capture(); }
    ~Capture() {
      if (open_) b_.end_capture(false);
    }
    void finish() {
      open_ = false;
      b_.end_capture(true);
    }
    // finish(), keeping the sequence for replay: Backend::end_capture_for_replay's handle (0: none
    // recorded).
    uint64_t finish_for_replay() {
      open_ = false;
      return b_.end_capture_for_replay();
    }
    Capture(const Capture&) = delete;
    Capture& operator=(const Capture&) = delete;

   private:
    Backend& b_;
    bool open_ = true;
  };

 protected:
  int32_t reserved_rows_ = 0;
  int32_t reserved_keys_ = 0;
};

}  // namespace keep::engine
