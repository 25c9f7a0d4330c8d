// benchmarks/model_shapes.json through the engine's config.json parser (benchmarks/model_shapes.h):
// every shape parses and validates, with the figures of the models' published config.json files.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "benchmarks/model_shapes.h"

namespace {

using keep::engine::Arch;
using keep::engine::ModelConfig;

ModelConfig shape(const std::string& name) {
  auto c = keep::bench::model_shape(name);
  REQUIRE_MESSAGE(c.is_ok(), c.status().to_string());
  return *c;
}

}  // namespace

TEST_CASE("every benchmark model shape parses into a valid config") {
  const auto names = keep::bench::model_shape_names();
  for (const char* n :
       {"qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "smollm2-135m"}) {
    CHECK(std::find(names.begin(), names.end(), n) != names.end());
  }
  for (const auto& n : names) {
    CAPTURE(n);
    const ModelConfig c = shape(n);
    CHECK(c.validate().is_ok());
  }
}

TEST_CASE("the shapes carry their models' figures") {
  const ModelConfig q7 = shape("qwen2.5-7b");
  CHECK(q7.arch == Arch::kQwen2);
  CHECK(q7.attention_bias);
  CHECK(q7.vocab_size == 152064);
  CHECK(q7.hidden_size == 3584);
  CHECK(q7.num_layers == 28);
  CHECK(q7.num_heads == 28);
  CHECK(q7.num_kv_heads == 4);
  CHECK(q7.head_dim == 128);
  CHECK(q7.intermediate_size == 18944);
  CHECK(q7.rms_norm_eps == doctest::Approx(1e-6));
  CHECK(q7.rope_theta == doctest::Approx(1e6));
  CHECK(q7.max_position_embeddings == 32768);
  CHECK_FALSE(q7.tie_word_embeddings);

  const ModelConfig q14 = shape("qwen2.5-14b");
  CHECK(q14.hidden_size == 5120);
  CHECK(q14.num_layers == 48);
  CHECK(q14.num_heads == 40);
  CHECK(q14.num_kv_heads == 8);
  CHECK(q14.head_dim == 128);
  CHECK(q14.intermediate_size == 13824);
  CHECK(q14.rms_norm_eps == doctest::Approx(1e-5));

  const ModelConfig q32 = shape("qwen2.5-32b");
  CHECK(q32.num_layers == 64);
  CHECK(q32.intermediate_size == 27648);

  const ModelConfig q05 = shape("qwen2.5-0.5b");
  CHECK(q05.vocab_size == 151936);
  CHECK(q05.head_dim == 64);
  CHECK(q05.tie_word_embeddings);

  const ModelConfig s = shape("smollm2-135m");
  CHECK(s.arch == Arch::kLlama);
  CHECK_FALSE(s.attention_bias);
  CHECK(s.vocab_size == 49152);
  CHECK(s.hidden_size == 576);
  CHECK(s.num_layers == 30);
  CHECK(s.num_heads == 9);
  CHECK(s.num_kv_heads == 3);
  CHECK(s.head_dim == 64);
  CHECK(s.intermediate_size == 1536);
  CHECK(s.rope_theta == doctest::Approx(1e5));
  CHECK(s.rms_norm_eps == doctest::Approx(1e-5));
  CHECK(s.max_position_embeddings == 8192);
  CHECK(s.tie_word_embeddings);
}

TEST_CASE("an unknown shape is kNotFound") {
  const auto c = keep::bench::model_shape("qwen2.5-1000b");
  REQUIRE_FALSE(c.is_ok());
  CHECK(c.status().code() == keep::Code::kNotFound);
}
