// The engine's recorded prefills (replay_cache.h) on the CPU: a backend that records a capture's
// layer calls and replays them stands in for the CUDA backend's graphs, so that the engine's side
// (tests/unit/replay_scenario.h; tests/gpu/test_cuda_engine.cpp runs it on CUDA graphs) is checked
// without a GPU.
#include <doctest/doctest.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "services/worker/engine/core/engine.h"
#include "services/worker/engine/core/replay_cache.h"
#include "services/worker/engine/cpu/cpu_backend.h"
#include "tests/unit/engine_test_model.h"
#include "tests/unit/replay_scenario.h"

using namespace keep::engine;
using keep::Result;
using keep::Status;
using keep::engine::testing::check_recorded_prefills;
using keep::engine::testing::make_tiny_model;
using keep::engine::testing::RecordingHooks;
using keep::engine::testing::TinyShape;

namespace {

// The CPU backend, with captures: between begin_capture() and end_capture() layer calls are
// recorded, not run, and run at the end; end_capture_for_replay() keeps them for replay().
class RecordingBackend final : public Backend {
 public:
  explicit RecordingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  bool enabled = true;   // false: no capture (the CUDA backend with graphs off)
  bool not_now = false;  // replay_state() says kNotNow (another dependent-launch setting)
  uint64_t replays = 0;
  size_t recordings() const { return recordings_.size(); }
  void drop_all() { recordings_.clear(); }  // as CudaBackend::reserve() moving its workspace

  DeviceKind kind() const override { return inner_->kind(); }
  std::string name() const override { return "recording " + inner_->name(); }
  const ModelConfig& config() const override { return inner_->config(); }
  Result<DeviceBuffer> allocate(size_t floats) override { return inner_->allocate(floats); }
  void copy_to_device(float* dst, const float* src, size_t n) override {
    KEEP_CHECK(!capturing_);
    inner_->copy_to_device(dst, src, n);
  }
  void copy_to_host(float* dst, const float* src, size_t n) override {
    KEEP_CHECK(!capturing_);
    inner_->copy_to_host(dst, src, n);
  }
  void copy_on_device(float* dst, const float* src, size_t n) override {
    inner_->copy_on_device(dst, src, n);
  }
  void synchronize() override { inner_->synchronize(); }
  Status reserve(int32_t max_rows, int32_t max_keys) override {
    KEEP_RETURN_IF_ERROR(inner_->reserve(max_rows, max_keys));
    reserved_rows_ = inner_->reserved_rows();
    reserved_keys_ = inner_->reserved_keys();
    return Status::ok();
  }
  Result<std::unique_ptr<AttentionPlan>> plan(const AttentionLayout& layout) override {
    KEEP_CHECK(!capturing_);
    return inner_->plan(layout);
  }
  void embed(float* hidden, const int32_t* tokens, int32_t n) override {
    KEEP_CHECK(!capturing_);
    inner_->embed(hidden, tokens, n);
  }
  Status layer_forward(const LayerOutputs& out, const float* hidden_in, int32_t layer,
                       const KvView& kv, const AttentionPlan& plan) override {
    if (!capturing_) return inner_->layer_forward(out, hidden_in, layer, kv, plan);
    captured_.push_back(
        [=, this, &plan] { return inner_->layer_forward(out, hidden_in, layer, kv, plan); });
    return Status::ok();
  }
  void load_kv(const KvView& kv, int32_t first_slot, const float* k_pre, const float* v,
               const int32_t* positions, int32_t n) override {
    KEEP_CHECK(!capturing_);
    inner_->load_kv(kv, first_slot, k_pre, v, positions, n);
  }
  void final_logits(float* logits, const float* hidden, const int32_t* rows, int32_t n) override {
    KEEP_CHECK(!capturing_);
    inner_->final_logits(logits, hidden, rows, n);
  }

  void begin_capture() override {
    KEEP_CHECK(!capturing_);
    capturing_ = enabled;
  }
  void end_capture(bool run) override {
    if (!capturing_) return;
    capturing_ = false;
    if (run) run_all(captured_);
    captured_.clear();
  }
  uint64_t end_capture_for_replay() override {
    if (!capturing_) return 0;
    capturing_ = false;
    run_all(captured_);
    recordings_[++next_] = std::move(captured_);
    captured_.clear();
    return next_;
  }
  ReplayState replay_state(uint64_t handle) const override {
    if (recordings_.count(handle) == 0) return ReplayState::kGone;
    return enabled && !not_now ? ReplayState::kReplayable : ReplayState::kNotNow;
  }
  void replay(uint64_t handle) override {
    KEEP_CHECK(replay_state(handle) == ReplayState::kReplayable);
    run_all(recordings_.at(handle));
    ++replays;
  }
  void drop_recording(uint64_t handle) override { recordings_.erase(handle); }

 private:
  using Launches = std::vector<std::function<Status()>>;
  static void run_all(const Launches& launches) {
    for (const auto& launch : launches) KEEP_CHECK(launch().is_ok());
  }
  std::unique_ptr<Backend> inner_;
  bool capturing_ = false;
  Launches captured_;
  std::map<uint64_t, Launches> recordings_;
  uint64_t next_ = 0;
};

TEST_CASE("recorded prefills: seen, recorded, replayed with new tokens; keys; capacity") {
  TinyShape s;
  s.layers = ReplayCache::kSplitLayer + 2;  // the first layer, then the recording's two parts
  auto cpu = CpuBackend::create(make_tiny_model(s, 31), {2, 0});
  REQUIRE(cpu.is_ok());
  auto owned = std::make_unique<RecordingBackend>(std::move(cpu).value());
  RecordingBackend& rec = *owned;
  auto engine = Engine::create(std::move(owned), 128);
  REQUIRE(engine.is_ok());
  RecordingHooks h;
  h.set_recording = [&](bool on) { rec.enabled = on; };
  h.recordings = [&] { return rec.recordings(); };
  h.replays = [&] { return rec.replays; };
  h.drop_all = [&] { rec.drop_all(); };
  h.view_to_host = [](const void* view, size_t n) {
    const auto* p = static_cast<const float*>(view);
    return std::vector<float>(p, p + n);
  };
  h.not_now = {{[&] { rec.not_now = true; }, [&] { rec.not_now = false; }},
               {[&] { rec.enabled = false; }, [&] { rec.enabled = true; }}};
  check_recorded_prefills(**engine, h);
}

}  // namespace
