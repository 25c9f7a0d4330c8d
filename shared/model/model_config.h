// ModelConfig: the hyper-parameters of a decoder-only Qwen2 / Llama model, as the engine needs
// them.
//
// Filled from a Hugging Face config.json (parse_hf_config / load_hf_config) or from GGUF metadata
// (gguf_loader.h). Field names follow HF; the comments give the config.json key.
//
// Architecture differences the forward pass must honour:
//   - Qwen2ForCausalLM: q/k/v projections always carry a bias (attention_bias is forced true),
//     o_proj never does.
//   - LlamaForCausalLM: "attention_bias" (default false) puts a bias on q, k, v AND o.
//   - Both: RMSNorm, SwiGLU MLP (down(silu(gate(x)) * up(x))), half-split RoPE ("rotate_half":
//     dims [0, hd/2) pair with [hd/2, hd)), optional tied embeddings.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"

namespace keep::engine {

enum class Arch : uint8_t { kQwen2, kLlama };
const char* arch_name(Arch arch);  // "qwen2", "llama"

enum class RopeScalingType : uint8_t { kNone, kLlama3 };

// config.json "rope_scaling" (also "rope_parameters" in newer transformers). Only "llama3" (and
// "default"/null = none) is accepted; other types (linear, dynamic, yarn, ...) are refused.
struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;                              // "factor"
  double low_freq_factor = 1.0;                     // "low_freq_factor"
  double high_freq_factor = 4.0;                    // "high_freq_factor"
  int64_t original_max_position_embeddings = 8192;  // "original_max_position_embeddings"
};

struct ModelConfig {
  Arch arch = Arch::kLlama;
  int64_t vocab_size = 0;               // "vocab_size"
  int64_t hidden_size = 0;              // "hidden_size"
  int64_t num_layers = 0;               // "num_hidden_layers"
  int64_t num_heads = 0;                // "num_attention_heads"
  int64_t num_kv_heads = 0;             // "num_key_value_heads" (default num_heads)
  int64_t head_dim = 0;                 // "head_dim" (default hidden_size / num_heads)
  int64_t intermediate_size = 0;        // "intermediate_size"
  double rms_norm_eps = 1e-6;           // "rms_norm_eps"
  double rope_theta = 10000.0;          // "rope_theta"
  RopeScaling rope_scaling;             // "rope_scaling"
  bool attention_bias = false;          // Qwen2: true (q/k/v). Llama: "attention_bias" (q/k/v/o)
  bool tie_word_embeddings = false;     // "tie_word_embeddings" (lm_head = embed)
  int64_t max_position_embeddings = 0;  // "max_position_embeddings"
  std::optional<int32_t> bos_token_id;  // "bos_token_id"
  std::vector<int32_t> eos_token_ids;   // "eos_token_id" (a number or a list)

  // True when o_proj has a bias too (Llama with attention_bias); Qwen2 never.
  bool o_proj_bias() const { return arch == Arch::kLlama && attention_bias; }
  int64_t q_dim() const { return num_heads * head_dim; }      // rows of wq
  int64_t kv_dim() const { return num_kv_heads * head_dim; }  // rows of wk / wv

  // Positive sizes, num_heads % num_kv_heads == 0, even head_dim, eps > 0, theta > 0, a
  // consistent llama3 scaling. kInvalidArgument naming the field.
  Status validate() const;
  // One line: "llama vocab=49152 hidden=576 layers=30 heads=9/3 hd=64 inter=1536 ...".
  std::string to_string() const;
};

// RoPE inverse frequencies, head_dim / 2 of them: inv_freq[i] = theta^(-2i/hd), then the llama3
// rescaling exactly as transformers' _compute_llama3_parameters does (computed in double, rounded
// to float once). Pair (i, i + hd/2) of a head rotates by angle pos * inv_freq[i].
std::vector<float> rope_inv_freq(const ModelConfig& config);

// Parses a config.json text. `where` (the file path) prefixes every error message.
// architectures[0] (or model_type) must be Qwen2ForCausalLM / LlamaForCausalLM (qwen2 / llama);
// "torch_dtype"/"dtype" is informational. kMalformed for bad JSON or wrong JSON types,
// kInvalidArgument for unsupported or inconsistent values.
Result<ModelConfig> parse_hf_config(std::string_view json_text, std::string_view where);
// Reads and parses a config.json file (kIoError when it cannot be read).
Result<ModelConfig> load_hf_config(const std::string& path);

}  // namespace keep::engine
