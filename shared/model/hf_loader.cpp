#include "shared/model/hf_loader.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "shared/common/log.h"
#include "shared/safetensors/safetensors_reader.h"

namespace keep::engine {

namespace {

namespace fs = std::filesystem;

Tensor* slot(ModelWeights& w, const HfWeight& hw) {
  if (hw.layer < 0) {
    switch (hw.role) {
      case WeightRole::kEmbed:
        return &w.embed;
      case WeightRole::kFinalNorm:
        return &w.final_norm;
      default:
        return &w.lm_head;
    }
  }
  LayerWeights& l = w.layers[static_cast<size_t>(hw.layer)];
  switch (hw.role) {
    case WeightRole::kAttnNorm:
      return &l.attn_norm;
    case WeightRole::kWq:
      return &l.wq;
    case WeightRole::kWk:
      return &l.wk;
    case WeightRole::kWv:
      return &l.wv;
    case WeightRole::kBq:
      return &l.bq;
    case WeightRole::kBk:
      return &l.bk;
    case WeightRole::kBv:
      return &l.bv;
    case WeightRole::kWo:
      return &l.wo;
    case WeightRole::kBo:
      return &l.bo;
    case WeightRole::kFfnNorm:
      return &l.ffn_norm;
    case WeightRole::kGate:
      return &l.w_gate;
    case WeightRole::kUp:
      return &l.w_up;
    default:
      return &l.w_down;
  }
}

Status convert(const safetensors::SafetensorsModel& model, const std::string& dir,
               const HfWeight& hw, Tensor* dst) {
  auto view = model.tensor(hw.name, hw.shape);
  if (!view.is_ok()) return view.status().with_context(dir);
  dst->shape = hw.shape;
  dst->data.resize(static_cast<size_t>(dst->numel()));
  Status st = safetensors::to_fp32(*view, dst->data.data(), dst->data.size());
  if (!st.is_ok()) return st.with_context(dir);
  return Status::ok();
}

Result<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(Code::kIoError, path + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

// tokenizer_config.json "chat_template": a string, or a list of {name, template} (we take
// "default", else the first); or a chat_template.jinja file next to it.
Result<std::string> read_hf_chat_template(const std::string& dir) {
  const std::string jinja = dir + "/chat_template.jinja";
  if (fs::exists(jinja)) return read_text(jinja);
  const std::string path = dir + "/tokenizer_config.json";
  if (!fs::exists(path)) return std::string();
  KEEP_ASSIGN_OR_RETURN(std::string text, read_text(path));
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return Status(Code::kMalformed, path + ": not a JSON object");
  }
  auto it = j.find("chat_template");
  if (it == j.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    std::string first;
    for (const auto& e : *it) {
      if (!e.is_object() || !e.contains("template") || !e["template"].is_string()) continue;
      if (first.empty()) first = e["template"].get<std::string>();
      if (e.value("name", "") == "default") return e["template"].get<std::string>();
    }
    return first;
  }
  return Status(Code::kMalformed, path + ": \"chat_template\" must be a string or a list");
}

Status read_hf_tokenizer(const std::string& dir, std::optional<tok::BpeTokenizer>* tokenizer,
                         std::string* chat_template) {
  const std::string tj = dir + "/tokenizer.json";
  if (fs::exists(tj)) {
    auto tok = tok::BpeTokenizer::from_json_file(tj);
    if (!tok.is_ok()) return tok.status().with_context("loading tokenizer of " + dir);
    tokenizer->emplace(std::move(tok).value());
  }
  KEEP_ASSIGN_OR_RETURN(*chat_template, read_hf_chat_template(dir));
  return Status::ok();
}

std::vector<HfWeight> hf_weight_table(const ModelConfig& c) {
  const int64_t C = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  std::vector<HfWeight> t;
  t.push_back({"model.embed_tokens.weight", {c.vocab_size, C}, WeightRole::kEmbed, -1});
  t.push_back({"model.norm.weight", {C}, WeightRole::kFinalNorm, -1});
  if (!c.tie_word_embeddings) {
    t.push_back({"lm_head.weight", {c.vocab_size, C}, WeightRole::kLmHead, -1});
  }
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const auto l = static_cast<int32_t>(i);
    t.push_back({p + "input_layernorm.weight", {C}, WeightRole::kAttnNorm, l});
    t.push_back({p + "self_attn.q_proj.weight", {Q, C}, WeightRole::kWq, l});
    t.push_back({p + "self_attn.k_proj.weight", {KV, C}, WeightRole::kWk, l});
    t.push_back({p + "self_attn.v_proj.weight", {KV, C}, WeightRole::kWv, l});
    t.push_back({p + "self_attn.o_proj.weight", {C, Q}, WeightRole::kWo, l});
    if (c.attention_bias) {
      t.push_back({p + "self_attn.q_proj.bias", {Q}, WeightRole::kBq, l});
      t.push_back({p + "self_attn.k_proj.bias", {KV}, WeightRole::kBk, l});
      t.push_back({p + "self_attn.v_proj.bias", {KV}, WeightRole::kBv, l});
    }
    if (c.o_proj_bias()) t.push_back({p + "self_attn.o_proj.bias", {C}, WeightRole::kBo, l});
    t.push_back({p + "post_attention_layernorm.weight", {C}, WeightRole::kFfnNorm, l});
    t.push_back({p + "mlp.gate_proj.weight", {I, C}, WeightRole::kGate, l});
    t.push_back({p + "mlp.up_proj.weight", {I, C}, WeightRole::kUp, l});
    t.push_back({p + "mlp.down_proj.weight", {C, I}, WeightRole::kDown, l});
  }
  return t;
}

Result<ModelWeights> load_hf_weights(const std::string& dir, int threads) {
  KEEP_ASSIGN_OR_RETURN(ModelConfig config, load_hf_config(dir + "/config.json"));
  KEEP_ASSIGN_OR_RETURN(auto model, safetensors::SafetensorsModel::open_dir(dir));

  ModelWeights w;
  w.config = config;
  w.layers.resize(static_cast<size_t>(config.num_layers));
  const std::vector<HfWeight> table = hf_weight_table(config);
  // Fail fast, before any conversion, on missing tensors (the message lists the first).
  for (const HfWeight& hw : table) {
    if (!model->contains(hw.name)) {
      return Status(Code::kNotFound, dir + ": tensor \"" + hw.name + "\" is missing");
    }
  }
  KEEP_RETURN_IF_ERROR(detail::run_parallel(table.size(), threads, [&](size_t i) {
    return convert(*model, dir, table[i], slot(w, table[i]));
  }));
  Status st = w.validate();
  if (!st.is_ok()) return st.with_context(dir);
  return w;
}

Status stream_hf_weights(const std::string& dir, const ModelConfig& config,
                         const std::function<Status(const WeightPiece&)>& sink) {
  KEEP_ASSIGN_OR_RETURN(auto model, safetensors::SafetensorsModel::open_dir(dir));
  const std::vector<HfWeight> table = hf_weight_table(config);
  // Everything present, shaped and of a float dtype before the sink sees the first weight.
  std::vector<std::vector<const HfWeight*>> by_shard(model->shard_count());
  std::vector<safetensors::TensorView> views(table.size());
  for (size_t i = 0; i < table.size(); ++i) {
    const HfWeight& hw = table[i];
    if (!model->contains(hw.name)) {
      return Status(Code::kNotFound, dir + ": tensor \"" + hw.name + "\" is missing");
    }
    auto v = model->tensor(hw.name, hw.shape);
    if (!v.is_ok()) return v.status().with_context(dir);
    using safetensors::DType;
    if (v->dtype != DType::kF32 && v->dtype != DType::kF16 && v->dtype != DType::kBF16) {
      return Status(Code::kInvalidArgument, dir + ": tensor \"" + hw.name + "\" is " +
                                                safetensors::dtype_name(v->dtype) +
                                                ", not F32, F16 or BF16");
    }
    views[i] = *v;
    by_shard[model->shard_of(hw.name)].push_back(&hw);
  }
  for (size_t s = 0; s < by_shard.size(); ++s) {
    // In file order: the mapping is read front to back.
    std::sort(by_shard[s].begin(), by_shard[s].end(), [&](const HfWeight* a, const HfWeight* b) {
      return views[static_cast<size_t>(a - table.data())].data <
             views[static_cast<size_t>(b - table.data())].data;
    });
    for (const HfWeight* hw : by_shard[s]) {
      const WeightPiece piece{hw, &views[static_cast<size_t>(hw - table.data())], s};
      Status st = sink(piece);
      if (!st.is_ok()) return st.with_context(dir + ": " + hw->name);
    }
    model->shard(s).release_pages();
  }
  return Status::ok();
}

Result<LoadedModel> load_hf_model(const std::string& dir, const LoadOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadedModel m;
  m.source = dir;
  m.format = "hf";
  KEEP_ASSIGN_OR_RETURN(m.weights, load_hf_weights(dir, options.threads));
  if (options.load_tokenizer) {
    KEEP_RETURN_IF_ERROR(read_hf_tokenizer(dir, &m.tokenizer, &m.chat_template));
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  KEEP_LOG_INFO("engine", "loaded %s (%s) in %.2f s, %.1f MiB fp32", dir.c_str(),
                m.weights.config.to_string().c_str(), secs,
                static_cast<double>(m.weights.bytes()) / (1024.0 * 1024.0));
  return m;
}

}  // namespace keep::engine
