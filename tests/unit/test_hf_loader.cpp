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
#include "tests/hf_dir_writer.h"

using keep::Code;
using namespace keep::engine;
using nlohmann::json;
namespace fs = std::filesystem;
using keep::testing::as_dtype;
using keep::testing::RawTensor;
using keep::testing::TempDir;
using keep::testing::write_safetensors;

namespace {

constexpr const char* kTiny = "tests/fixtures/engine/tiny-qwen2";

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

namespace {

// The process's peak resident set (VmHWM, KiB), after `reset` lowers it to the current one
// (/proc/self/clear_refs 5); -1 where the kernel offers neither.
long peak_rss_kib(bool reset) {
  if (reset) {
    std::ofstream c("/proc/self/clear_refs");
    c << "5";
    if (!c) return -1;
  }
  std::ifstream st("/proc/self/status");
  std::string line;
  while (std::getline(st, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

}  // namespace

TEST_CASE("stream_hf_weights hands every weight over once, as stored, shard by shard") {
  TempDir dir("stream");
  // Mixed dtypes: norms F32, layer 1 F16, the rest BF16.
  keep::testing::write_random_hf_dir(
      dir.path(), keep::testing::qwen2_config(64, 128, 3, 4, 2, 256), 3,
      [](const std::string& name) -> std::string {
        if (name.find("norm") != std::string::npos) return "F32";
        if (name.find("layers.1.") != std::string::npos) return "F16";
        return "";
      },
      7);
  auto cfg = load_hf_config(dir.path() + "/config.json");
  REQUIRE(cfg.is_ok());
  auto fp32 = load_hf_weights(dir.path());
  REQUIRE_MESSAGE(fp32.is_ok(), fp32.status().to_string());
  const auto table = hf_weight_table(*cfg);
  std::map<std::string, int> seen;
  size_t last_shard = 0;
  const uint8_t* last_data = nullptr;
  ModelWeights& w = *fp32;
  auto field = [&](const HfWeight& hw) -> const Tensor& {
    if (hw.layer < 0) {
      return hw.role == WeightRole::kEmbed       ? w.embed
             : hw.role == WeightRole::kFinalNorm ? w.final_norm
                                                 : w.lm_head;
    }
    const LayerWeights& l = w.layers[static_cast<size_t>(hw.layer)];
    switch (hw.role) {
      case WeightRole::kWq:
        return l.wq;
      case WeightRole::kBk:
        return l.bk;
      case WeightRole::kAttnNorm:
        return l.attn_norm;
      case WeightRole::kUp:
        return l.w_up;
      case WeightRole::kDown:
        return l.w_down;
      default:
        return l.wv;  // checked only for the roles above
    }
  };
  keep::Status st = stream_hf_weights(dir.path(), *cfg, [&](const WeightPiece& p) {
    ++seen[p.weight->name];
    CHECK(p.shard >= last_shard);  // shard by shard
    if (p.shard == last_shard && last_data != nullptr) CHECK(p.view->data > last_data);
    last_shard = p.shard;
    last_data = p.view->data;
    const bool norm = p.weight->name.find("norm") != std::string::npos;
    const bool layer1 = p.weight->name.find("layers.1.") != std::string::npos;
    CHECK(p.view->dtype == (norm     ? keep::safetensors::DType::kF32
                            : layer1 ? keep::safetensors::DType::kF16
                                     : keep::safetensors::DType::kBF16));
    CHECK(p.view->shape == p.weight->shape);
    const WeightRole r = p.weight->role;
    if (p.weight->layer < 0 || r == WeightRole::kWq || r == WeightRole::kBk ||
        r == WeightRole::kAttnNorm || r == WeightRole::kUp || r == WeightRole::kDown ||
        r == WeightRole::kWv) {
      auto f = keep::safetensors::to_fp32(*p.view);
      REQUIRE(f.is_ok());
      CHECK_MESSAGE(*f == field(*p.weight).data, p.weight->name);
    }
    return keep::Status::ok();
  });
  REQUIRE_MESSAGE(st.is_ok(), st.to_string());
  CHECK(last_shard == 2);
  REQUIRE(seen.size() == table.size());
  for (const auto& hw : table) CHECK_MESSAGE(seen[hw.name] == 1, hw.name);

  // A sink's error stops the stream, naming the weight; a missing weight is refused before any.
  int calls = 0;
  st = stream_hf_weights(dir.path(), *cfg, [&](const WeightPiece&) {
    return ++calls == 5 ? keep::Status(Code::kInternal, "device full") : keep::Status::ok();
  });
  CHECK_ERROR(st, {"device full", dir.path()});
  CHECK(calls == 5);
  ModelConfig more = *cfg;
  more.num_layers = 4;
  calls = 0;
  st = stream_hf_weights(dir.path(), more, [&](const WeightPiece&) {
    ++calls;
    return keep::Status::ok();
  });
  CHECK_ERROR(st, {"model.layers.3.", "missing"});
  CHECK(calls == 0);
}

TEST_CASE("streaming a sharded checkpoint keeps about one shard resident; fp32 loading does not") {
  TempDir dir("stream_rss");
  // ~80 MiB of bf16 in 8 shards of ~10 MiB.
  keep::testing::write_random_hf_dir(
      dir.path(), keep::testing::qwen2_config(512, 2048, 8, 8, 4, 8192), 8, nullptr, 3);
  auto cfg = load_hf_config(dir.path() + "/config.json");
  REQUIRE(cfg.is_ok());
  uint64_t largest = 0, total = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    if (e.path().extension() != ".safetensors") continue;
    largest = std::max<uint64_t>(largest, e.file_size());
    total += e.file_size();
  }
  const long base = peak_rss_kib(true);
  if (base < 0) {
    MESSAGE("no VmHWM reset on this kernel: the resident-memory bound is not checked");
    return;
  }
  double sum = 0;  // every byte read, as an upload would
  keep::Status st = stream_hf_weights(dir.path(), *cfg, [&](const WeightPiece& p) {
    for (size_t i = 0; i < p.view->bytes; i += 64) sum += p.view->data[i];
    return keep::Status::ok();
  });
  REQUIRE(st.is_ok());
  CHECK(sum > 0);
  const long streamed_kib = peak_rss_kib(false) - base;
  // The fp32 loader holds the whole model twice over: the measurement can see it.
  const long base2 = peak_rss_kib(true);
  {
    auto w = load_hf_weights(dir.path(), 2);
    REQUIRE(w.is_ok());
  }
  const long loaded_kib = peak_rss_kib(false) - base2;
  MESSAGE("peak RSS growth: streamed " << streamed_kib << " KiB, fp32 load " << loaded_kib
                                       << " KiB; largest shard " << largest / 1024 << " KiB of "
                                       << total / 1024);
  CHECK(static_cast<uint64_t>(loaded_kib) * 1024 > 2 * total);
  CHECK(static_cast<uint64_t>(streamed_kib) * 1024 < 2 * largest + (8u << 20));
}
