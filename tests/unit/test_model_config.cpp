// ModelConfig: HF config.json parsing (Qwen2 / Llama, rope_scaling llama3, tied embeddings, eos
// lists), clear refusals, and RoPE inverse frequencies against transformers' values.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "shared/model/model_config.h"

using keep::Code;
using namespace keep::engine;

namespace {

const char* kLlamaBase = R"({
  "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
  "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
  "intermediate_size": 1536, "rms_norm_eps": 1e-05, "rope_theta": 100000,
  "max_position_embeddings": 8192, "tie_word_embeddings": true, "bos_token_id": 1,
  "eos_token_id": 2, "hidden_act": "silu"})";

std::string with(std::string base, const std::string& extra) {
  base.insert(base.rfind('}'), ", " + extra);
  return base;
}

}  // namespace

TEST_CASE("llama config (SmolLM2 shape) parses with defaults filled in") {
  auto c = parse_hf_config(kLlamaBase, "cfg.json");
  REQUIRE_MESSAGE(c.is_ok(), c.status().to_string());
  CHECK(c->arch == Arch::kLlama);
  CHECK(c->vocab_size == 49152);
  CHECK(c->hidden_size == 576);
  CHECK(c->num_layers == 30);
  CHECK(c->num_heads == 9);
  CHECK(c->num_kv_heads == 3);
  CHECK(c->head_dim == 64);  // hidden / heads
  CHECK(c->intermediate_size == 1536);
  CHECK(c->rms_norm_eps == doctest::Approx(1e-5));
  CHECK(c->rope_theta == 100000.0);
  CHECK(c->rope_scaling.type == RopeScalingType::kNone);
  CHECK(c->tie_word_embeddings);
  CHECK_FALSE(c->attention_bias);
  CHECK_FALSE(c->o_proj_bias());
  CHECK(c->bos_token_id == 1);
  CHECK(c->eos_token_ids == std::vector<int32_t>{2});
  CHECK(c->q_dim() == 576);
  CHECK(c->kv_dim() == 192);
  CHECK(c->to_string().find("llama vocab=49152") == 0);
}

TEST_CASE("llama attention_bias puts a bias on o_proj too; head_dim may be explicit") {
  auto c = parse_hf_config(with(kLlamaBase, R"("attention_bias": true, "head_dim": 128)"), "x");
  REQUIRE_MESSAGE(c.is_ok(), c.status().to_string());
  CHECK(c->attention_bias);
  CHECK(c->o_proj_bias());
  CHECK(c->head_dim == 128);
  CHECK(c->q_dim() == 9 * 128);
}

TEST_CASE("qwen2 config: q/k/v bias always, rope_parameters (transformers 5), eos list") {
  const char* qwen = R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064,
    "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "intermediate_size": 18944, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "max_position_embeddings": 32768, "tie_word_embeddings": false,
    "eos_token_id": [151645, 151643], "bos_token_id": null, "use_sliding_window": false})";
  auto c = parse_hf_config(qwen, "qwen.json");
  REQUIRE_MESSAGE(c.is_ok(), c.status().to_string());
  CHECK(c->arch == Arch::kQwen2);
  CHECK(c->attention_bias);
  CHECK_FALSE(c->o_proj_bias());
  CHECK(c->head_dim == 128);
  CHECK(c->rope_theta == 1000000.0);
  CHECK_FALSE(c->bos_token_id.has_value());
  CHECK(c->eos_token_ids == std::vector<int32_t>{151645, 151643});
  CHECK_FALSE(c->tie_word_embeddings);
}

TEST_CASE("the committed tiny-qwen2 fixture config loads from disk") {
  auto c = load_hf_config("tests/fixtures/engine/tiny-qwen2/config.json");
  REQUIRE_MESSAGE(c.is_ok(), c.status().to_string());
  CHECK(c->arch == Arch::kQwen2);
  CHECK(c->vocab_size == 512);
  CHECK(c->hidden_size == 64);
  CHECK(c->num_layers == 2);
  CHECK(c->num_heads == 4);
  CHECK(c->num_kv_heads == 2);
  CHECK(c->head_dim == 16);
  CHECK(c->intermediate_size == 128);
}

TEST_CASE("llama3 rope scaling parses and inv_freq matches transformers") {
  const std::string cfg = with(kLlamaBase,
                               R"("head_dim": 128, "rope_theta": 500000.0, "rope_scaling": {
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192})");
  auto c = parse_hf_config(cfg, "l3.json");
  REQUIRE_MESSAGE(c.is_ok(), c.status().to_string());
  CHECK(c->rope_scaling.type == RopeScalingType::kLlama3);
  CHECK(c->rope_scaling.factor == 8.0);
  CHECK(c->rope_scaling.original_max_position_embeddings == 8192);
  const std::vector<float> inv = rope_inv_freq(*c);
  REQUIRE(inv.size() == 64);
  // transformers 5.24 ROPE_INIT_FUNCTIONS["llama3"] for this config (head_dim 128).
  const std::pair<int, double> want[] = {{0, 1.0},
                                         {1, 0.8146172165870667},
                                         {20, 0.016560440883040428},
                                         {30, 0.0013718936825171113},
                                         {40, 3.428102354519069e-05},
                                         {45, 1.2297638932068367e-05},
                                         {50, 4.411534519022098e-06},
                                         {63, 3.068925877869333e-07}};
  for (auto [i, v] : want) {
    CHECK_MESSAGE(std::fabs(inv[static_cast<size_t>(i)] - v) <= 2e-6 * v, "index " << i);
  }
  // Without scaling, the plain theta^(-2i/hd).
  ModelConfig plain = *c;
  plain.rope_scaling = {};
  const auto inv0 = rope_inv_freq(plain);
  CHECK(inv0[45] == doctest::Approx(std::pow(500000.0, -90.0 / 128.0)).epsilon(1e-6));
  CHECK(inv0[45] > inv[45] * 7.9);  // low frequencies are divided by the factor 8
}

TEST_CASE("bad configs are refused with the file and the field named") {
  struct Case {
    std::string json;
    Code code;
    const char* needle;
  };
  const Case cases[] = {
      {"{not json", Code::kMalformed, "not valid JSON"},
      // Error messages dump() JSON values, recursively: deep nesting is refused up front.
      {R"({"a": )" + std::string(100000, '[') + std::string(100000, ']') + "}", Code::kMalformed,
       "nested deeper than 64 levels"},
      {"[1, 2]", Code::kMalformed, "not a JSON object"},
      {R"({"architectures": ["GPT2LMHeadModel"], "vocab_size": 1})", Code::kInvalidArgument,
       "GPT2LMHeadModel"},
      {R"({"vocab_size": 1})", Code::kInvalidArgument, "architectures"},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})", Code::kInvalidArgument,
       "vocab_size"},
      {with(kLlamaBase, R"("num_key_value_heads": 4)"), Code::kInvalidArgument,
       "num_key_value_heads"},
      {with(kLlamaBase, R"("hidden_size": "576")"), Code::kMalformed, "hidden_size"},
      {with(kLlamaBase, R"("num_attention_heads": 0)"), Code::kInvalidArgument,
       "num_attention_heads"},
      {with(kLlamaBase, R"("rms_norm_eps": -1)"), Code::kInvalidArgument, "rms_norm_eps"},
      {with(kLlamaBase, R"("rope_scaling": {"rope_type": "yarn", "factor": 4.0})"),
       Code::kInvalidArgument, "yarn"},
      {with(kLlamaBase, R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0})"),
       Code::kInvalidArgument, "original_max_position_embeddings"},
      {with(kLlamaBase, R"("eos_token_id": [2, -5])"), Code::kMalformed, "eos_token_id"},
      {with(kLlamaBase, R"("tie_word_embeddings": 1)"), Code::kMalformed, "tie_word_embeddings"},
      {with(kLlamaBase, R"("hidden_act": "gelu")"), Code::kInvalidArgument, "hidden_act"},
      {with(kLlamaBase, R"("mlp_bias": true)"), Code::kInvalidArgument, "mlp_bias"},
      {with(kLlamaBase, R"("head_dim": 63)"), Code::kInvalidArgument, "head_dim"},
  };
  for (const Case& c : cases) {
    auto r = parse_hf_config(c.json, "dir/config.json");
    REQUIRE_FALSE_MESSAGE(r.is_ok(), c.json);
    CHECK_MESSAGE(r.status().code() == c.code, r.status().to_string());
    CHECK_MESSAGE(r.status().message().find("dir/config.json") != std::string::npos,
                  r.status().to_string());
    CHECK_MESSAGE(r.status().message().find(c.needle) != std::string::npos,
                  r.status().to_string() << " lacks " << c.needle);
  }
  auto missing = load_hf_config("/nonexistent/config.json");
  REQUIRE_FALSE(missing.is_ok());
  CHECK(missing.status().code() == Code::kIoError);
  CHECK(missing.status().message().find("/nonexistent/config.json") != std::string::npos);
}
