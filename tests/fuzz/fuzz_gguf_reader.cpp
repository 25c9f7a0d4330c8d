// libFuzzer target: arbitrary bytes as a GGUF file (GgufFile::parse, what open() runs on the
// mapping), then what the worker derives from it: the typed metadata getters, the model config
// (gguf_model_config), the BPE tokenizer built from tokenizer.ggml.* (gguf_tokenizer, then one
// encode/decode) and dequantisation of the small tensors.
// Checks: every tensor lies inside the input, and find_tensor() finds it.
// Seeds: tests/fuzz/corpus/fuzz_gguf_reader/ (README.md there says how they were made).
#include <string>
#include <vector>

#include "shared/common/log.h"
#include "shared/model/gguf_loader.h"
#include "shared/model/gguf_reader.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  keep::log::set_level(keep::log::Level::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using keep::engine::GgufFile;
  auto parsed = GgufFile::parse(data, size, "fuzz.gguf");
  if (!parsed.is_ok()) return 0;
  const GgufFile& f = **parsed;
  for (const auto& t : f.tensors()) {
    KEEP_FUZZ_ASSERT(t.data >= data && t.bytes <= size &&
                     t.data - data <= static_cast<std::ptrdiff_t>(size - t.bytes));
    KEEP_FUZZ_ASSERT(f.find_tensor(t.name) == &t);
    if (t.numel() <= (1 << 16)) {
      std::vector<float> out(static_cast<size_t>(t.numel()));
      (void)f.tensor_to_fp32(t, out.data(), out.size());
    }
  }
  for (const auto& [key, value] : f.metadata()) {
    (void)f.get_int(key);
    (void)f.get_float(key);
    (void)f.get_string(key);
    (void)f.get_bool(key);
  }
  auto config = keep::engine::gguf_model_config(f);
  if (config.is_ok()) (void)config->to_string();
  auto tok = keep::engine::gguf_tokenizer(f);
  if (tok.is_ok()) {
    const std::vector<int32_t> ids = tok->encode("Hello, world! 123 <|im_start|>ünï\n", true);
    for (int32_t id : ids) KEEP_FUZZ_ASSERT(id >= 0 && id < tok->vocab_size());
    (void)tok->decode(ids);
  }
  return 0;
}
