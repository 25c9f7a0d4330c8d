// benchmarks/model_shapes.json through the engine's config.json parser (benchmarks/model_shapes.h):
// every shape parses and validates, with the figures of the models' published config.json files.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
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
  struct Want {
    const char* name;
    Arch arch;
    bool attention_bias;
    int64_t vocab, hidden, layers, heads, kv_heads, head_dim, inter;
    double eps, theta;
    int64_t max_positions;
    bool tied;
  };
  const Want wants[] = {
      {"qwen2.5-0.5b", Arch::kQwen2, true, 151936, 896, 24, 14, 2, 64, 4864, 1e-6, 1e6, 32768,
       true},
      {"qwen2.5-7b", Arch::kQwen2, true, 152064, 3584, 28, 28, 4, 128, 18944, 1e-6, 1e6, 32768,
       false},
      {"qwen2.5-14b", Arch::kQwen2, true, 152064, 5120, 48, 40, 8, 128, 13824, 1e-5, 1e6, 32768,
       false},
      {"qwen2.5-32b", Arch::kQwen2, true, 152064, 5120, 64, 40, 8, 128, 27648, 1e-5, 1e6, 32768,
       false},
      {"smollm2-135m", Arch::kLlama, false, 49152, 576, 30, 9, 3, 64, 1536, 1e-5, 1e5, 8192, true},
  };
  for (const Want& w : wants) {
    CAPTURE(w.name);
    const ModelConfig c = shape(w.name);
    CHECK(c.arch == w.arch);
    CHECK(c.attention_bias == w.attention_bias);
    CHECK(c.vocab_size == w.vocab);
    CHECK(c.hidden_size == w.hidden);
    CHECK(c.num_layers == w.layers);
    CHECK(c.num_heads == w.heads);
    CHECK(c.num_kv_heads == w.kv_heads);
    CHECK(c.head_dim == w.head_dim);
    CHECK(c.intermediate_size == w.inter);
    CHECK(c.rms_norm_eps == doctest::Approx(w.eps));
    CHECK(c.rope_theta == doctest::Approx(w.theta));
    CHECK(c.max_position_embeddings == w.max_positions);
    CHECK(c.tie_word_embeddings == w.tied);
  }
}

TEST_CASE("an unknown shape is kNotFound") {
  const auto c = keep::bench::model_shape("qwen2.5-1000b");
  REQUIRE_FALSE(c.is_ok());
  CHECK(c.status().code() == keep::Code::kNotFound);
}
