// read_model_identity / kv_fingerprint: what keep-manager learns of the planner model without its
// weights, and the region fingerprint both services derive from it.
#include "shared/model/model_identity.h"

#include <doctest/doctest.h>

#include "shared/model/model_weights.h"

using namespace keep::engine;
namespace kv = keep::kv;

TEST_CASE("a GGUF file's identity: config, tokenizer and template without the weights") {
  const std::string path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  auto id = read_model_identity(path);
  REQUIRE_MESSAGE(id.is_ok(), id.status().to_string());
  CHECK(id->format == "gguf");
  CHECK(id->config.num_layers == 30);
  CHECK(id->config.num_kv_heads == 3);
  CHECK(id->config.head_dim == 64);
  REQUIRE(id->tokenizer.has_value());
  CHECK(id->chat_template.find("<|im_start|>") != std::string::npos);
  CHECK_FALSE(id->name.empty());

  // The worker loads the whole model; the fingerprint it derives is the manager's.
  auto loaded = load_model(path);
  REQUIRE(loaded.is_ok());
  REQUIRE(loaded->tokenizer.has_value());
  const auto a =
      kv_fingerprint(id->config, id->tokenizer->fingerprint(), kv::KvDType::kBF16, id->name);
  const auto b = kv_fingerprint(loaded->weights.config, loaded->tokenizer->fingerprint(),
                                kv::KvDType::kBF16, id->name);
  CHECK(a == b);
  CHECK(a.validate().is_ok());
  CHECK(a.bytes_per_token() == 2ull * 30 * 3 * 64 * 2);
  CHECK(a.rope_theta == id->config.rope_theta);
  CHECK(kv_fingerprint(id->config, id->tokenizer->fingerprint(), kv::KvDType::kF32, id->name) != a);
}

TEST_CASE("a HF directory's identity; bad paths are named") {
  auto id = read_model_identity("tests/fixtures/engine/tiny-qwen2");
  REQUIRE_MESSAGE(id.is_ok(), id.status().to_string());
  CHECK(id->format == "hf");
  CHECK(id->name == "tiny-qwen2");
  CHECK(id->config.arch == Arch::kQwen2);
  auto missing = read_model_identity("tests/fixtures/engine/no-such-model.gguf");
  REQUIRE_FALSE(missing.is_ok());
  CHECK(missing.status().message().find("no-such-model.gguf") != std::string::npos);
}
