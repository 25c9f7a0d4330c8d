// CpuBackend: the fp32 reference backend. Matrix products through OpenBLAS (its own threads,
// OPENBLAS_NUM_THREADS), attention and element-wise work on a ThreadPool of `attention_threads`
// (default: hardware concurrency) whose idle threads sleep rather than spin, so the two thread
// sets do not fight over the cores. It reads the weights in place from ModelWeights (HF
// orientation, y = x W^T), so loading costs no copy. It is what the CUDA backend is tested against
// and what the demo runs on a machine without a GPU.
#pragma once

#include <memory>
#include <vector>

#include "services/worker/engine/core/backend.h"
#include "services/worker/engine/core/rope.h"
#include "services/worker/engine/cpu/thread_pool.h"
#include "shared/model/model_weights.h"

namespace keep::engine {

struct CpuBackendOptions {
  int attention_threads = 0;  // threads for attention / element-wise loops; 0 = all cores
  int blas_threads = 0;       // > 0: openblas_set_num_threads at creation; 0 = leave as is
};

class CpuBackend final : public Backend {
 public:
  // Validates the weights against their config (kInvalidArgument naming the tensor).
  static Result<std::unique_ptr<CpuBackend>> create(std::shared_ptr<const ModelWeights> weights,
                                                    const CpuBackendOptions& options = {});

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string name() const override;
  const ModelConfig& config() const override { return weights_->config; }

  Result<DeviceBuffer> allocate(size_t floats) override;
  void copy_to_device(float* dst, const float* src_host, size_t floats) override;
  void copy_to_host(float* dst_host, const float* src, size_t floats) override;
  void copy_on_device(float* dst, const float* src, size_t floats) override;
  void synchronize() override {}

  Status reserve(int32_t max_rows, int32_t max_keys) override;
  Result<std::unique_ptr<AttentionPlan>> plan(const AttentionLayout& layout) override;

  void embed(float* hidden, const int32_t* tokens, int32_t n) override;
  Status layer_forward(const LayerOutputs& out, const float* hidden_in, int32_t layer,
                       const KvView& kv, const AttentionPlan& plan) override;
  void load_kv(const KvView& kv, int32_t first_slot, const float* k_pre, const float* v,
               const int32_t* positions, int32_t n) override;
  void final_logits(float* logits, const float* hidden, const int32_t* rows, int32_t n) override;

  const RopeTable& rope() const { return rope_; }

 private:
  CpuBackend(std::shared_ptr<const ModelWeights> weights, const CpuBackendOptions& options);

  // y (n, out) = x (n, in) · W^T (out, in) [+ b]; gemv when n == 1.
  void linear(float* y, const float* x, const float* w, const float* b, int32_t n, int32_t out,
              int32_t in) const;
  void attention(const LayerOutputs& out, const float* q, const KvView& kv,
                 const AttentionLayout& layout);
  void attention_tiled(const LayerOutputs& out, const float* q, const KvView& kv,
                       const AttentionLayout& layout);

  std::shared_ptr<const ModelWeights> weights_;
  RopeTable rope_;
  int threads_ = 1;
  std::unique_ptr<ThreadPool> pool_;

  // Workspace (reserve()).
  std::vector<float> xn_;           // (rows, C)
  std::vector<float> q_;            // (rows, H*hd)
  std::vector<float> k_;            // (rows, KV*hd)
  std::vector<float> v_;            // (rows, KV*hd)
  std::vector<float> att_;          // (rows, H*hd)
  std::vector<float> proj_;         // (rows, C)
  std::vector<float> gate_;         // (rows, I)
  std::vector<float> up_;           // (rows, I)
  std::vector<float> scores_;       // (threads, max_keys)
  std::vector<float> tile_scores_;  // (tile rows, max_keys) scores / probabilities of one tile
  std::vector<float> hrow_;         // (C) final norm of one row
};

}  // namespace keep::engine
