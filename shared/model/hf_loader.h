// Loading a Hugging Face model directory into ModelWeights.
//
// The directory holds config.json (Qwen2ForCausalLM or LlamaForCausalLM, see model_config.h) and
// model.safetensors or model.safetensors.index.json with its shards (shared/safetensors). Tensors
// may be F32, F16 or BF16; each is converted to fp32 with its shape checked against the config.
// Tensor names are HF's ("model.layers.{i}.self_attn.q_proj.weight", ...); lm_head.weight is
// required unless tie_word_embeddings (when tied, a present lm_head.weight is ignored).
// Optional extras: tokenizer.json (the tokenizer), tokenizer_config.json ("chat_template").
#pragma once

#include <optional>
#include <string>

#include "shared/common/status.h"
#include "shared/model/model_weights.h"

namespace keep::engine {

// The weights only. Errors name the file and the tensor.
Result<ModelWeights> load_hf_weights(const std::string& dir, int threads = 0);

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
