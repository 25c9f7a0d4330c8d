// Small random Qwen2 / Llama models built in memory, for the engine's unit tests (no files needed),
// and runs over them that several backends' tests share.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "services/worker/engine/core/engine.h"
#include "shared/common/status.h"
#include "shared/model/model_weights.h"

namespace keep::engine::testing {

struct TinyShape {
  Arch arch = Arch::kQwen2;
  int64_t vocab = 97;
  int64_t hidden = 48;
  int64_t layers = 3;
  int64_t heads = 6;
  int64_t kv_heads = 2;
  int64_t head_dim = 8;
  int64_t inter = 72;
  bool tied = false;
  bool attention_bias = true;  // Llama: q/k/v/o bias; Qwen2 always q/k/v
  bool llama3_rope = false;
};

inline void fill(Tensor& t, std::mt19937& rng, float scale, float offset = 0.0f) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& x : t.data) x = offset + scale * nd(rng);
}

inline std::shared_ptr<ModelWeights> make_tiny_model(const TinyShape& s, uint32_t seed) {
  auto w = std::make_shared<ModelWeights>();
  ModelConfig& c = w->config;
  c.arch = s.arch;
  c.vocab_size = s.vocab;
  c.hidden_size = s.hidden;
  c.num_layers = s.layers;
  c.num_heads = s.heads;
  c.num_kv_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.intermediate_size = s.inter;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.attention_bias = s.arch == Arch::kQwen2 ? true : s.attention_bias;
  c.tie_word_embeddings = s.tied;
  c.max_position_embeddings = 4096;
  c.eos_token_ids = {2};
  if (s.llama3_rope) {
    c.rope_scaling.type = RopeScalingType::kLlama3;
    c.rope_scaling.factor = 8.0;
    c.rope_scaling.low_freq_factor = 1.0;
    c.rope_scaling.high_freq_factor = 4.0;
    c.rope_scaling.original_max_position_embeddings = 64;
  }
  std::mt19937 rng(seed);
  const int64_t C = s.hidden, Q = c.q_dim(), KV = c.kv_dim(), I = s.inter;
  const float wscale = 1.0f / std::sqrt(static_cast<float>(C));
  w->embed = Tensor({s.vocab, C});
  fill(w->embed, rng, 1.0f);
  w->final_norm = Tensor({C});
  fill(w->final_norm, rng, 0.1f, 1.0f);
  if (!s.tied) {
    w->lm_head = Tensor({s.vocab, C});
    fill(w->lm_head, rng, wscale);
  }
  for (int64_t l = 0; l < s.layers; ++l) {
    LayerWeights lw;
    lw.attn_norm = Tensor({C});
    fill(lw.attn_norm, rng, 0.1f, 1.0f);
    lw.ffn_norm = Tensor({C});
    fill(lw.ffn_norm, rng, 0.1f, 1.0f);
    lw.wq = Tensor({Q, C});
    lw.wk = Tensor({KV, C});
    lw.wv = Tensor({KV, C});
    lw.wo = Tensor({C, Q});
    // Larger Q/K scale so attention is far from uniform (a wrong mask shows).
    fill(lw.wq, rng, 3.0f * wscale);
    fill(lw.wk, rng, 3.0f * wscale);
    fill(lw.wv, rng, wscale);
    fill(lw.wo, rng, wscale);
    if (c.attention_bias) {
      lw.bq = Tensor({Q});
      lw.bk = Tensor({KV});
      lw.bv = Tensor({KV});
      fill(lw.bq, rng, 0.2f);
      fill(lw.bk, rng, 0.2f);
      fill(lw.bv, rng, 0.2f);
    }
    if (c.o_proj_bias()) {
      lw.bo = Tensor({C});
      fill(lw.bo, rng, 0.2f);
    }
    lw.w_gate = Tensor({I, C});
    lw.w_up = Tensor({I, C});
    lw.w_down = Tensor({C, I});
    fill(lw.w_gate, rng, wscale);
    fill(lw.w_up, rng, wscale);
    fill(lw.w_down, rng, 1.0f / std::sqrt(static_cast<float>(I)));
    w->layers.push_back(std::move(lw));
  }
  return w;
}

inline std::vector<int32_t> random_tokens(size_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(rng);
  return t;
}

inline float max_abs_diff(const float* a, const float* b, size_t n) {
  float m = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float d = std::fabs(a[i] - b[i]);
    if (!(d <= m)) m = d;  // NaN propagates as a failure
  }
  return m;
}

// Every layer of a causal prefill of `tokens` into `cache`, with LayerExtras::out_rows = keep at
// the last layer (as Engine::prefill does): the hidden rows after the last layer.
inline Result<DeviceBuffer> prefill_keeping_rows(Engine& e, KvCache& cache,
                                                 std::span<const int32_t> tokens, int32_t keep) {
  const auto n = static_cast<int32_t>(tokens.size());
  KEEP_ASSIGN_OR_RETURN(DeviceBuffer hidden, e.allocate_hidden(n));
  KEEP_RETURN_IF_ERROR(e.embed(hidden, tokens));
  KEEP_ASSIGN_OR_RETURN(auto plan, e.plan(AttentionLayout::causal(n)));
  const int32_t layers = e.config().num_layers;
  for (int32_t l = 0; l < layers; ++l) {
    LayerExtras ex;
    if (l + 1 == layers) ex.out_rows = keep;
    KEEP_RETURN_IF_ERROR(e.prefill_layer(l, hidden, cache.layer(l), *plan, ex));
  }
  return hidden;
}

}  // namespace keep::engine::testing
