// libFuzzer target: arbitrary bytes as a model's config.json, through both parsers of one: the
// worker's Hugging Face LLM config (parse_hf_config, then validate(), to_string() and the RoPE
// table) and the manager's BERT encoder config (parse_bert_config).
// Seeds: tests/fuzz/corpus/fuzz_model_config/ (README.md there says how they were made).
#include "services/manager/encoder/bert_encoder.h"
#include "shared/common/log.h"
#include "shared/model/model_config.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  keep::log::set_level(keep::log::Level::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = keep::fuzz::as_text(data, size);
  auto config = keep::engine::parse_hf_config(text, "config.json");
  if (config.is_ok()) {
    (void)config->to_string();
    // The engine builds the RoPE table only for a config that validates (huge head_dims are
    // valid but would only slow the fuzzer down).
    if (config->validate().is_ok() && config->head_dim <= 4096) {
      KEEP_FUZZ_ASSERT(keep::engine::rope_inv_freq(*config).size() ==
                       static_cast<size_t>(config->head_dim / 2));
    }
  }
  auto bert = keep::manager::parse_bert_config(text, "config.json");
  if (bert.is_ok()) KEEP_FUZZ_ASSERT(bert->hidden % bert->heads == 0);
  return 0;
}
