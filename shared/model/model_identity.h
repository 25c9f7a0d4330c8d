// ModelIdentity: what a model is without its weights -- its config, tokenizer and chat template --
// and the KV fingerprint derived from them. keep-manager reads the planner model this way (token
// counts per segment, the region's fingerprint); keep-worker derives the same fingerprint from the
// model it loads, so the two agree by construction rather than by matching flags.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "shared/common/status.h"
#include "shared/kvregion/model_fingerprint.h"
#include "shared/model/model_config.h"
#include "shared/tokenizer/bpe_tokenizer.h"

namespace keep::engine {

struct ModelIdentity {
  ModelConfig config;
  std::optional<tok::BpeTokenizer> tokenizer;  // when the model carries one
  std::string chat_template;                   // Jinja source; empty when none
  std::string name;    // GGUF general.name, else the directory's or file's name
  std::string format;  // "hf" or "gguf"
};

// A HF directory (config.json, tokenizer.json, tokenizer_config.json) or a GGUF file's metadata;
// reads no weights. Errors name the file.
Result<ModelIdentity> read_model_identity(const std::string& path);

// The region fingerprint of KV computed by this model: geometry and RoPE from the config, the
// tokenizer's content hash (BpeTokenizer::fingerprint(): the same for a tokenizer.json and the
// GGUF vocabulary of one tokenizer), the KV dtype and the name.
kv::ModelFingerprint kv_fingerprint(const ModelConfig& config, uint64_t tokenizer_fingerprint,
                                    kv::KvDType dtype, std::string_view name);

}  // namespace keep::engine
