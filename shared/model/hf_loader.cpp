#include "shared/model/hf_loader.h"

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

struct Job {
  std::string name;            // HF tensor name
  std::vector<int64_t> shape;  // expected
  Tensor* dst;
};

Status convert(const safetensors::SafetensorsModel& model, const std::string& dir, Job& job) {
  auto view = model.tensor(job.name, job.shape);
  if (!view.is_ok()) return view.status().with_context(dir);
  job.dst->shape = job.shape;
  job.dst->data.resize(static_cast<size_t>(job.dst->numel()));
  Status st = safetensors::to_fp32(*view, job.dst->data.data(), job.dst->data.size());
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

Result<ModelWeights> load_hf_weights(const std::string& dir, int threads) {
  KEEP_ASSIGN_OR_RETURN(ModelConfig config, load_hf_config(dir + "/config.json"));
  KEEP_ASSIGN_OR_RETURN(auto model, safetensors::SafetensorsModel::open_dir(dir));

  ModelWeights w;
  w.config = config;
  const ModelConfig& c = w.config;
  const int64_t C = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  std::vector<Job> jobs;
  jobs.push_back({"model.embed_tokens.weight", {c.vocab_size, C}, &w.embed});
  jobs.push_back({"model.norm.weight", {C}, &w.final_norm});
  if (!c.tie_word_embeddings) jobs.push_back({"lm_head.weight", {c.vocab_size, C}, &w.lm_head});
  w.layers.resize(static_cast<size_t>(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights& l = w.layers[static_cast<size_t>(i)];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    jobs.push_back({p + "input_layernorm.weight", {C}, &l.attn_norm});
    jobs.push_back({p + "self_attn.q_proj.weight", {Q, C}, &l.wq});
    jobs.push_back({p + "self_attn.k_proj.weight", {KV, C}, &l.wk});
    jobs.push_back({p + "self_attn.v_proj.weight", {KV, C}, &l.wv});
    jobs.push_back({p + "self_attn.o_proj.weight", {C, Q}, &l.wo});
    if (c.attention_bias) {
      jobs.push_back({p + "self_attn.q_proj.bias", {Q}, &l.bq});
      jobs.push_back({p + "self_attn.k_proj.bias", {KV}, &l.bk});
      jobs.push_back({p + "self_attn.v_proj.bias", {KV}, &l.bv});
    }
    if (c.o_proj_bias()) jobs.push_back({p + "self_attn.o_proj.bias", {C}, &l.bo});
    jobs.push_back({p + "post_attention_layernorm.weight", {C}, &l.ffn_norm});
    jobs.push_back({p + "mlp.gate_proj.weight", {I, C}, &l.w_gate});
    jobs.push_back({p + "mlp.up_proj.weight", {I, C}, &l.w_up});
    jobs.push_back({p + "mlp.down_proj.weight", {C, I}, &l.w_down});
  }
  // Fail fast, before any conversion, on missing tensors (the message lists the first).
  for (const Job& job : jobs) {
    if (!model->contains(job.name)) {
      return Status(Code::kNotFound, dir + ": tensor \"" + job.name + "\" is missing");
    }
  }
  KEEP_RETURN_IF_ERROR(detail::run_parallel(
      jobs.size(), threads, [&](size_t i) { return convert(*model, dir, jobs[i]); }));
  Status st = w.validate();
  if (!st.is_ok()) return st.with_context(dir);
  return w;
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
