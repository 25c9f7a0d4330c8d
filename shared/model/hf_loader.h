// Loading a Hugging Face model directory into ModelWeights.
//
// The directory holds config.json (Qwen2ForCausalLM or LlamaForCausalLM, see model_config.h) and
// model.safetensors or model.safetensors.index.json with its shards (shared/safetensors). Tensors
// may be F32, F16 or BF16; each is converted to fp32 with its shape checked against the config.
// Tensor names are HF's ("model.layers.{i}.self_attn.q_proj.weight", ...); lm_head.weight is
// required unless tie_word_embeddings (when tied, a present lm_head.weight is ignored).
// Optional extras: tokenizer.json (the tokenizer), tokenizer_config.json ("chat_template").
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shared/common/status.h"
#include "shared/model/model_weights.h"

namespace keep::safetensors {
struct TensorView;
}

namespace keep::engine {

// Where a checkpoint tensor goes in ModelWeights (LayerWeights' fields, or the model's).
enum class WeightRole : uint8_t {
  kEmbed,
  kFinalNorm,
  kLmHead,  // model-level (layer -1)
  kAttnNorm,
  kWq,
  kWk,
  kWv,
  kBq,
  kBk,
  kBv,
  kWo,
  kBo,
  kFfnNorm,
  kGate,
  kUp,
  kDown,
};
// One weight `config` needs from a HF checkpoint: its HF name and shape.
struct HfWeight {
  std::string name;
  std::vector<int64_t> shape;
  WeightRole role = WeightRole::kEmbed;
  int32_t layer = -1;
};
// Every weight of `config`, in ModelWeights order (lm_head only when untied, biases only when the
// config has them).
std::vector<HfWeight> hf_weight_table(const ModelConfig& config);

// The weights only. Errors name the file and the tensor.
Result<ModelWeights> load_hf_weights(const std::string& dir, int threads = 0);

// Weights as stored, for backends that convert on their device: every weight of `config`
// (hf_weight_table), checked present and shaped before the first is handed over, then passed to
// `sink` with its F32/F16/BF16 bytes in place in the mapping, shard by shard in file order. A
// shard's pages are released once its last weight has gone to the sink, so the process holds about
// one shard at a time (no fp32 copy of the model). The view is valid during the call only.
struct WeightPiece {
  const HfWeight* weight = nullptr;
  const safetensors::TensorView* view = nullptr;
  size_t shard = 0;  // which file, in the order they are streamed
};
Status stream_hf_weights(const std::string& dir, const ModelConfig& config,
                         const std::function<Status(const WeightPiece&)>& sink);

// The chat template of a HF directory: tokenizer_config.json "chat_template" (a string, or the
// "default" of a list), or chat_template.jinja; empty when neither exists.
Result<std::string> read_hf_chat_template(const std::string& dir);

// The tokenizer side of a HF directory, which needs neither config.json nor weights:
// tokenizer.json when present (else *tokenizer is left empty) and the chat template.
Status read_hf_tokenizer(const std::string& dir, std::optional<tok::BpeTokenizer>* tokenizer,
                         std::string* chat_template);

// Weights + tokenizer.json (when present and options.load_tokenizer) + chat template.
Result<LoadedModel> load_hf_model(const std::string& dir, const LoadOptions& options = {});

}  // namespace keep::engine
