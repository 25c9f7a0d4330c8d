// HF directory loading: the committed tiny-qwen2 fixture (bf16 safetensors, q/k/v bias, untied
// lm_head, tokenizer.json, chat template), a sharded copy with F32/F16/BF16 tensors that must load
// to the same fp32 values, and broken directories refused with the file and tensor named.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shared/model/hf_loader.h"
#include "shared/model/model_weights.h"
#include "shared/safetensors/safetensors_reader.h"

using keep::Code;
using namespace keep::engine;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

constexpr const char* kTiny = "tests/fixtures/engine/tiny-qwen2";

struct RawTensor {
  std::string dtype;  // "F32", "F16", "BF16"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

void write_safetensors(const std::string& path, const std::map<std::string, RawTensor>& ts) {
  json header = json::object();
  uint64_t off = 0;
  for (const auto& [name, t] : ts) {
    header[name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  const std::string h = header.dump();
  const uint64_t n = h.size();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& [name, t] : ts) {
    out.write(reinterpret_cast<const char*>(t.bytes.data()),
              static_cast<std::streamsize>(t.bytes.size()));
  }
}

// fp32 -> fp16 bits for values that are exactly representable as normal halves (checked).
uint16_t exact_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  const uint16_t h =
      static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((u >> 13) & 0x3FFu));
  REQUIRE(exp > 0);
  REQUIRE(exp < 31);
  REQUIRE(keep::safetensors::fp16_to_fp32(h) == f);
  return h;
}

RawTensor as_dtype(const keep::safetensors::TensorView& v, const std::string& dtype) {
  RawTensor r{dtype, v.shape, {}};
  auto f = keep::safetensors::to_fp32(v);
  REQUIRE(f.is_ok());
  if (dtype == "BF16") {
    r.bytes.assign(v.data, v.data + v.bytes);
  } else if (dtype == "F32") {
    r.bytes.resize(f->size() * 4);
    std::memcpy(r.bytes.data(), f->data(), r.bytes.size());
  } else {
    for (float x : *f) {
      const uint16_t h = exact_half(x);
      r.bytes.push_back(static_cast<uint8_t>(h & 0xFF));
      r.bytes.push_back(static_cast<uint8_t>(h >> 8));
    }
  }
  return r;
}

class TempDir {
 public:
  explicit TempDir(const std::string& stem)
      : path_("/tmp/keep_test_hf_" + std::to_string(::getpid()) + "_" + stem) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

const ModelWeights& tiny() {
  static ModelWeights* w = [] {
    auto r = load_hf_weights(kTiny);
    REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
    return new ModelWeights(std::move(r).value());
  }();
  return *w;
}

void check_error(const keep::Status& st, std::initializer_list<std::string> needles) {
  REQUIRE_FALSE(st.is_ok());
  for (const std::string& n : needles) {
    CHECK_MESSAGE(st.message().find(n) != std::string::npos, st.to_string() << " lacks " << n);
  }
}

// check_error with the caller's line in the failure report.
#define CHECK_ERROR(st, ...)              \
  do {                                    \
    INFO("checked at line " << __LINE__); \
    check_error((st), __VA_ARGS__);       \
  } while (0)

// Copies the fixture into `dir` with the tensors of model.safetensors rewritten by `edit`.
void copy_fixture(const std::string& dir,
                  const std::function<void(std::map<std::string, RawTensor>&)>& edit) {
  for (const char* f : {"config.json", "tokenizer.json", "tokenizer_config.json"}) {
    fs::copy_file(std::string(kTiny) + "/" + f, dir + "/" + f);
  }
  auto src = keep::safetensors::SafetensorsFile::open(std::string(kTiny) + "/model.safetensors");
  REQUIRE(src.is_ok());
  std::map<std::string, RawTensor> ts;
  for (const std::string& name : (*src)->names())
    ts[name] = as_dtype(*(*src)->tensor(name), "BF16");
  edit(ts);
  write_safetensors(dir + "/model.safetensors", ts);
}

}  // namespace

TEST_CASE("tiny-qwen2 fixture loads: config, shapes, biases, untied lm_head") {
  const ModelWeights& w = tiny();
  const ModelConfig& c = w.config;
  CHECK(c.arch == Arch::kQwen2);
  CHECK(c.vocab_size == 512);
  CHECK(c.attention_bias);
  CHECK_FALSE(c.tie_word_embeddings);
  REQUIRE(w.validate().is_ok());
  CHECK(w.embed.shape == std::vector<int64_t>{512, 64});
  CHECK(w.lm_head.shape == std::vector<int64_t>{512, 64});
  CHECK(&w.output_weight() == &w.lm_head);
  REQUIRE(w.layers.size() == 2);
  const LayerWeights& l = w.layers[1];
  CHECK(l.wq.shape == std::vector<int64_t>{64, 64});
  CHECK(l.wk.shape == std::vector<int64_t>{32, 64});
  CHECK(l.bk.shape == std::vector<int64_t>{32});
  CHECK(l.bo.empty());
  CHECK(l.w_gate.shape == std::vector<int64_t>{128, 64});
  CHECK(l.w_down.shape == std::vector<int64_t>{64, 128});
  CHECK(w.bytes() > 500000);
  // Values are the bf16 file values, mapped to the right fields.
  auto model = keep::safetensors::SafetensorsModel::open_dir(kTiny);
  REQUIRE(model.is_ok());
  auto expect = [&](const char* name, const Tensor& t) {
    auto v = (*model)->tensor(name);
    REQUIRE(v.is_ok());
    auto f = keep::safetensors::to_fp32(*v);
    REQUIRE(f.is_ok());
    CHECK_MESSAGE(*f == t.data, name);
  };
  expect("model.layers.1.self_attn.k_proj.bias", l.bk);
  expect("model.layers.1.self_attn.o_proj.weight", l.wo);
  expect("model.layers.0.mlp.down_proj.weight", w.layers[0].w_down);
  expect("model.layers.0.post_attention_layernorm.weight", w.layers[0].ffn_norm);
  expect("lm_head.weight", w.lm_head);
  expect("model.norm.weight", w.final_norm);
  bool bias_nonzero = false;
  for (float x : l.bq.data) bias_nonzero |= x != 0.0f;
  CHECK(bias_nonzero);
}

TEST_CASE("tiny-qwen2 through load_model: tokenizer.json and chat template come along") {
  auto m = load_model(kTiny);
  REQUIRE_MESSAGE(m.is_ok(), m.status().to_string());
  CHECK(m->format == "hf");
  REQUIRE(m->tokenizer.has_value());
  CHECK(m->tokenizer->vocab_size() == 512);
  CHECK(m->tokenizer->token_to_id("<|im_start|>") == 510);
  // The same ids HF tokenizers gives (scripts/make_engine_fixtures.py prints them).
  CHECK(m->tokenizer->encode("<|im_start|>user\nHello there<|im_end|>") ==
        std::vector<int32_t>{510, 355, 261, 198, 39, 301, 385, 270, 485, 511});
  CHECK(m->chat_template.find("<|im_start|>") != std::string::npos);
  LoadOptions no_tok;
  no_tok.load_tokenizer = false;
  auto bare = load_model(kTiny, no_tok);
  REQUIRE(bare.is_ok());
  CHECK_FALSE(bare->tokenizer.has_value());
}

TEST_CASE("a sharded copy in F32 / F16 / BF16 loads to the same fp32 weights") {
  TempDir dir("sharded");
  for (const char* f : {"config.json"}) {
    fs::copy_file(std::string(kTiny) + "/" + f, dir.path() + "/" + f);
  }
  auto src = keep::safetensors::SafetensorsFile::open(std::string(kTiny) + "/model.safetensors");
  REQUIRE(src.is_ok());
  std::map<std::string, RawTensor> a, b;
  json weight_map = json::object();
  for (const std::string& name : (*src)->names()) {
    auto v = (*src)->tensor(name);
    REQUIRE(v.is_ok());
    if (name.find("layers.0.") != std::string::npos || name == "model.embed_tokens.weight") {
      a[name] = as_dtype(*v, "F32");
      weight_map[name] = "model-00001-of-00002.safetensors";
    } else {
      b[name] = as_dtype(*v, name.find("norm") != std::string::npos ? "F16" : "BF16");
      weight_map[name] = "model-00002-of-00002.safetensors";
    }
  }
  write_safetensors(dir.path() + "/model-00001-of-00002.safetensors", a);
  write_safetensors(dir.path() + "/model-00002-of-00002.safetensors", b);
  std::ofstream(dir.path() + "/model.safetensors.index.json")
      << json{{"metadata", json::object()}, {"weight_map", weight_map}}.dump();
  auto w = load_hf_weights(dir.path(), 2);
  REQUIRE_MESSAGE(w.is_ok(), w.status().to_string());
  CHECK(w->embed.data == tiny().embed.data);
  CHECK(w->lm_head.data == tiny().lm_head.data);
  CHECK(w->final_norm.data == tiny().final_norm.data);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(w->layers[i].wq.data == tiny().layers[i].wq.data);
    CHECK(w->layers[i].bv.data == tiny().layers[i].bv.data);
    CHECK(w->layers[i].attn_norm.data == tiny().layers[i].attn_norm.data);
    CHECK(w->layers[i].w_up.data == tiny().layers[i].w_up.data);
  }
}

TEST_CASE("broken directories are refused, naming the file and the tensor") {
  {
    TempDir dir("missing");
    copy_fixture(dir.path(), [](auto& ts) { ts.erase("model.layers.1.self_attn.v_proj.bias"); });
    CHECK_ERROR(load_hf_weights(dir.path()).status(),
                {dir.path(), "model.layers.1.self_attn.v_proj.bias", "missing"});
  }
  {
    TempDir dir("shape");
    copy_fixture(dir.path(), [](auto& ts) {
      RawTensor& t = ts["model.layers.0.mlp.up_proj.weight"];
      t.shape = {64, 128};  // transposed
    });
    CHECK_ERROR(load_hf_weights(dir.path()).status(),
                {"model.layers.0.mlp.up_proj.weight", "[64, 128]", "[128, 64]"});
  }
  {
    TempDir dir("dtype");
    copy_fixture(dir.path(), [](auto& ts) {
      RawTensor& t = ts["model.norm.weight"];
      t.dtype = "I16";
    });
    CHECK_ERROR(load_hf_weights(dir.path()).status(), {"model.norm.weight"});
  }
  {
    TempDir dir("truncated");
    copy_fixture(dir.path(), [](auto&) {});
    const std::string st = dir.path() + "/model.safetensors";
    fs::resize_file(st, fs::file_size(st) - 100);
    CHECK_ERROR(load_hf_weights(dir.path()).status(), {"model.safetensors"});
  }
  {
    TempDir dir("config");
    copy_fixture(dir.path(), [](auto&) {});
    std::ifstream in(dir.path() + "/config.json");
    json cfg = json::parse(in);
    cfg["num_key_value_heads"] = 3;
    std::ofstream(dir.path() + "/config.json") << cfg.dump();
    CHECK_ERROR(load_hf_weights(dir.path()).status(), {"config.json", "num_key_value_heads"});
  }
  {
    TempDir dir("tied");  // tied in the config: lm_head.weight is ignored, the embedding used
    copy_fixture(dir.path(), [](auto& ts) { ts.erase("lm_head.weight"); });
    std::ifstream in(dir.path() + "/config.json");
    json cfg = json::parse(in);
    cfg["tie_word_embeddings"] = true;
    std::ofstream(dir.path() + "/config.json") << cfg.dump();
    auto w = load_hf_weights(dir.path());
    REQUIRE_MESSAGE(w.is_ok(), w.status().to_string());
    CHECK(w->lm_head.empty());
    CHECK(&w->output_weight() == &w->embed);
  }
  {
    TempDir dir("noconfig");
    CHECK_ERROR(load_hf_weights(dir.path()).status(), {"config.json"});
    CHECK_ERROR(load_model(dir.path()).status(), {"config.json"});
  }
  {
    TempDir dir("notmodel");
    const std::string f = dir.path() + "/x.bin";
    std::ofstream(f) << "hello world";
    CHECK_ERROR(load_model(f).status(), {f, "neither"});
    CHECK_ERROR(load_model(dir.path() + "/absent").status(), {"absent"});
  }
}
