// The model shapes the benchmarks time on random weights (values don't change speed):
// bench_prefill (CUDA) and bench_engine's --random-smollm2 (CPU). Figures from each model's
// config.json on the Hugging Face hub.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "services/worker/engine/model_config.h"

namespace keep::bench {

inline std::optional<engine::ModelConfig> model_shape(const std::string& name) {
  engine::ModelConfig c;
  c.arch = engine::Arch::kQwen2;
  c.attention_bias = true;
  c.rope_theta = 1000000.0;
  c.rms_norm_eps = 1e-6;
  c.max_position_embeddings = 32768;
  c.vocab_size = 152064;
  if (name == "qwen2.5-7b") {
    c.hidden_size = 3584, c.num_layers = 28, c.num_heads = 28, c.num_kv_heads = 4;
    c.intermediate_size = 18944;
  } else if (name == "qwen2.5-14b") {
    c.hidden_size = 5120, c.num_layers = 48, c.num_heads = 40, c.num_kv_heads = 8;
    c.intermediate_size = 13824;
    c.rms_norm_eps = 1e-5;
  } else if (name == "qwen2.5-32b") {
    c.hidden_size = 5120, c.num_layers = 64, c.num_heads = 40, c.num_kv_heads = 8;
    c.intermediate_size = 27648;
    c.rms_norm_eps = 1e-5;
  } else if (name == "qwen2.5-0.5b") {
    c.vocab_size = 151936;
    c.hidden_size = 896, c.num_layers = 24, c.num_heads = 14, c.num_kv_heads = 2;
    c.intermediate_size = 4864;
    c.tie_word_embeddings = true;
  } else if (name == "smollm2-135m") {
    c.arch = engine::Arch::kLlama;
    c.attention_bias = false;
    c.vocab_size = 49152;
    c.hidden_size = 576, c.num_layers = 30, c.num_heads = 9, c.num_kv_heads = 3;
    c.intermediate_size = 1536;
    c.rope_theta = 100000.0;
    c.rms_norm_eps = 1e-5;
    c.tie_word_embeddings = true;
    c.max_position_embeddings = 8192;
  } else {
    return std::nullopt;
  }
  c.head_dim = c.hidden_size / c.num_heads;
  return c;
}

inline std::vector<std::string> model_shape_names() {
  return {"qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "smollm2-135m"};
}

}  // namespace keep::bench
