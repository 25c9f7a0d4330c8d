#include "shared/model/gguf_loader.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "shared/common/log.h"

namespace keep::engine {

namespace {

// An optional integer key: absent -> fallback; present with a wrong type -> error.
Status opt_int(const GgufFile& f, const std::string& key, int64_t fallback, int64_t* out) {
  if (f.find(key) == nullptr) {
    *out = fallback;
    return Status::ok();
  }
  KEEP_ASSIGN_OR_RETURN(*out, f.get_int(key));
  return Status::ok();
}
Status opt_float(const GgufFile& f, const std::string& key, double fallback, double* out) {
  if (f.find(key) == nullptr) {
    *out = fallback;
    return Status::ok();
  }
  KEEP_ASSIGN_OR_RETURN(*out, f.get_float(key));
  return Status::ok();
}

Status inconsistent(const GgufFile& f, const std::string& what) {
  return Status(Code::kCorrupt, f.path() + ": inconsistent model: " + what);
}

struct Job {
  std::string name;            // ggml tensor name
  std::vector<int64_t> shape;  // expected, row-major (HF orientation)
  Tensor* dst;
  int64_t unpermute_heads = 0;  // > 0: undo the llama.cpp Q/K permutation with this many heads
};

}  // namespace

void unpermute_rope_rows(float* w, int64_t n_head, int64_t head_dim, int64_t cols) {
  // GGUF row h*hd + 2*i + s holds HF row h*hd + s*hd/2 + i (convert_hf_to_gguf.py permute()).
  const int64_t half = head_dim / 2;
  std::vector<float> tmp(static_cast<size_t>(head_dim * cols));
  for (int64_t h = 0; h < n_head; ++h) {
    float* head = w + h * head_dim * cols;
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t s = 0; s < 2; ++s) {
        std::memcpy(&tmp[static_cast<size_t>((s * half + i) * cols)], head + (2 * i + s) * cols,
                    static_cast<size_t>(cols) * sizeof(float));
      }
    }
    std::memcpy(head, tmp.data(), tmp.size() * sizeof(float));
  }
}

Result<ModelConfig> gguf_model_config(const GgufFile& f) {
  KEEP_ASSIGN_OR_RETURN(std::string arch, f.get_string("general.architecture"));
  ModelConfig c;
  if (arch == "llama") {
    c.arch = Arch::kLlama;
  } else if (arch == "qwen2") {
    c.arch = Arch::kQwen2;
  } else {
    return Status(Code::kInvalidArgument, f.path() + ": unsupported general.architecture \"" +
                                              arch + "\" (supported: llama, qwen2)");
  }
  const std::string a = arch + ".";
  KEEP_ASSIGN_OR_RETURN(c.hidden_size, f.get_int(a + "embedding_length"));
  KEEP_ASSIGN_OR_RETURN(c.num_layers, f.get_int(a + "block_count"));
  KEEP_ASSIGN_OR_RETURN(c.intermediate_size, f.get_int(a + "feed_forward_length"));
  KEEP_ASSIGN_OR_RETURN(c.num_heads, f.get_int(a + "attention.head_count"));
  if (c.num_heads <= 0) return inconsistent(f, a + "attention.head_count must be positive");
  KEEP_RETURN_IF_ERROR(opt_int(f, a + "attention.head_count_kv", c.num_heads, &c.num_kv_heads));
  KEEP_RETURN_IF_ERROR(
      opt_int(f, a + "attention.key_length", c.hidden_size / c.num_heads, &c.head_dim));
  int64_t v_len = 0;
  KEEP_RETURN_IF_ERROR(opt_int(f, a + "attention.value_length", c.head_dim, &v_len));
  if (v_len != c.head_dim) return inconsistent(f, "attention.value_length != key_length");
  int64_t rope_dims = 0;
  KEEP_RETURN_IF_ERROR(opt_int(f, a + "rope.dimension_count", c.head_dim, &rope_dims));
  if (rope_dims != c.head_dim) {
    return Status(Code::kInvalidArgument, f.path() + ": partial RoPE (rope.dimension_count " +
                                              std::to_string(rope_dims) + " < head_dim " +
                                              std::to_string(c.head_dim) + ") is not supported");
  }
  KEEP_RETURN_IF_ERROR(opt_float(f, a + "attention.layer_norm_rms_epsilon", 1e-6, &c.rms_norm_eps));
  KEEP_RETURN_IF_ERROR(opt_float(f, a + "rope.freq_base", 10000.0, &c.rope_theta));
  KEEP_RETURN_IF_ERROR(opt_int(f, a + "context_length", 0, &c.max_position_embeddings));

  if (f.find(a + "rope.scaling.type") != nullptr) {
    KEEP_ASSIGN_OR_RETURN(std::string type, f.get_string(a + "rope.scaling.type"));
    if (type != "none") {
      return Status(Code::kInvalidArgument,
                    f.path() + ": unsupported " + a + "rope.scaling.type \"" + type + "\"");
    }
  }
  if (f.find_tensor("rope_freqs.weight") != nullptr) {
    // llama.cpp stores llama3 scaling as precomputed per-frequency factors; the HF parameters
    // (low/high freq factor) cannot be recovered from them exactly.
    return Status(Code::kInvalidArgument,
                  f.path() +
                      ": tensor \"rope_freqs.weight\" (llama3 RoPE scaling as GGUF factors) "
                      "is not supported; load the HF directory instead");
  }

  const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
  if (embd == nullptr) {
    return Status(Code::kNotFound, f.path() + ": tensor \"token_embd.weight\" is missing");
  }
  if (embd->ne.size() != 2) {
    return inconsistent(f, "tensor \"token_embd.weight\" has shape " + embd->shape_string() +
                               ", expected [vocab, " + std::to_string(c.hidden_size) + "]");
  }
  c.vocab_size = embd->ne[1];
  if (f.find(a + "vocab_size") != nullptr) {
    KEEP_ASSIGN_OR_RETURN(int64_t vs, f.get_int(a + "vocab_size"));
    if (vs != c.vocab_size) {
      return inconsistent(f, a + "vocab_size " + std::to_string(vs) +
                                 " != rows of token_embd.weight " + std::to_string(c.vocab_size));
    }
  }
  c.tie_word_embeddings = f.find_tensor("output.weight") == nullptr;
  c.attention_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  if (c.arch == Arch::kQwen2 && !c.attention_bias) {
    return Status(Code::kNotFound, f.path() +
                                       ": tensor \"blk.0.attn_q.bias\" is missing (qwen2 "
                                       "has q/k/v biases)");
  }
  if (f.find("tokenizer.ggml.bos_token_id") != nullptr) {
    KEEP_ASSIGN_OR_RETURN(int64_t bos, f.get_int("tokenizer.ggml.bos_token_id"));
    if (bos < 0 || bos >= c.vocab_size) return inconsistent(f, "bos_token_id out of range");
    c.bos_token_id = static_cast<int32_t>(bos);
  }
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"}) {
    if (f.find(key) == nullptr) continue;
    KEEP_ASSIGN_OR_RETURN(int64_t id, f.get_int(key));
    if (id < 0 || id >= c.vocab_size) return inconsistent(f, std::string(key) + " out of range");
    if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end()) {
      c.eos_token_ids.push_back(static_cast<int32_t>(id));
    }
  }
  Status st = c.validate();
  if (!st.is_ok()) return st.with_context(f.path());
  return c;
}

Result<tok::BpeTokenizer> gguf_tokenizer(const GgufFile& f) {
  if (f.find("tokenizer.ggml.model") == nullptr) {
    return Status(Code::kNotFound, f.path() + ": no embedded tokenizer (tokenizer.ggml.model)");
  }
  KEEP_ASSIGN_OR_RETURN(std::string model, f.get_string("tokenizer.ggml.model"));
  if (model != "gpt2") {
    return Status(Code::kInvalidArgument, f.path() + ": tokenizer.ggml.model \"" + model +
                                              "\" is not supported (only byte-level BPE, gpt2)");
  }
  auto str_array = [&](const char* key) -> Result<const std::vector<std::string>*> {
    const GgufValue* v = f.find(key);
    if (v == nullptr)
      return Status(Code::kNotFound, f.path() + ": missing metadata \"" + key + "\"");
    if (v->type != GgufValueType::kArray || v->elem_type != GgufValueType::kString) {
      return Status(Code::kInvalidArgument,
                    f.path() + ": metadata \"" + key + "\" must be an array of strings");
    }
    return &v->str_array;
  };
  KEEP_ASSIGN_OR_RETURN(const std::vector<std::string>* tokens, str_array("tokenizer.ggml.tokens"));
  KEEP_ASSIGN_OR_RETURN(const std::vector<std::string>* merge_strs,
                        str_array("tokenizer.ggml.merges"));
  std::vector<tok::AddedToken> added;
  if (const GgufValue* tt = f.find("tokenizer.ggml.token_type")) {
    if (tt->type != GgufValueType::kArray || tt->int_array.size() != tokens->size()) {
      return Status(Code::kCorrupt, f.path() +
                                        ": tokenizer.ggml.token_type must be an integer "
                                        "array with one entry per token");
    }
    for (size_t id = 0; id < tokens->size(); ++id) {
      const int64_t type = tt->int_array[id];
      if (type == 3 || type == 4) {  // CONTROL, USER_DEFINED
        tok::AddedToken a;
        a.id = static_cast<int32_t>(id);
        a.content = (*tokens)[id];
        a.special = type == 3;
        added.push_back(std::move(a));
      }
    }
  }
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(merge_strs->size());
  for (size_t i = 0; i < merge_strs->size(); ++i) {
    const std::string& m = (*merge_strs)[i];
    const size_t sp = m.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 >= m.size()) {
      return Status(Code::kCorrupt,
                    f.path() + ": tokenizer.ggml.merges[" + std::to_string(i) + "] is not \"a b\"");
    }
    merges.emplace_back(m.substr(0, sp), m.substr(sp + 1));
  }
  tok::BpeOptions opts;
  std::string pre = "gpt2";
  if (f.find("tokenizer.ggml.pre") != nullptr) {
    KEEP_ASSIGN_OR_RETURN(pre, f.get_string("tokenizer.ggml.pre"));
    if (pre == "default") pre = "gpt2";
  }
  opts.pre_tokenizer = pre;
  // GGUF does not record the normalizer; Qwen2's tokenizer.json uses NFC, the others none.
  opts.normalization = pre == "qwen2" ? tok::Normalization::kNfc : tok::Normalization::kNone;
  const auto n_tokens = static_cast<int64_t>(tokens->size());
  auto opt_id = [&](const char* key) -> Result<std::optional<int32_t>> {
    if (f.find(key) == nullptr) return std::optional<int32_t>();
    KEEP_ASSIGN_OR_RETURN(int64_t id, f.get_int(key));
    if (id < 0 || id >= n_tokens) {
      return Status(Code::kCorrupt, f.path() + ": " + key + " " + std::to_string(id) +
                                        " is outside the vocabulary");
    }
    return std::optional<int32_t>(static_cast<int32_t>(id));
  };
  KEEP_ASSIGN_OR_RETURN(opts.bos_id, opt_id("tokenizer.ggml.bos_token_id"));
  KEEP_ASSIGN_OR_RETURN(opts.eos_id, opt_id("tokenizer.ggml.eos_token_id"));
  KEEP_ASSIGN_OR_RETURN(opts.pad_id, opt_id("tokenizer.ggml.padding_token_id"));
  auto opt_bool = [&](const char* key) -> Result<bool> {
    if (f.find(key) == nullptr) return false;
    return f.get_bool(key);
  };
  KEEP_ASSIGN_OR_RETURN(bool add_bos, opt_bool("tokenizer.ggml.add_bos_token"));
  KEEP_ASSIGN_OR_RETURN(bool add_eos, opt_bool("tokenizer.ggml.add_eos_token"));
  if (add_bos && opts.bos_id) opts.prefix_ids.push_back(*opts.bos_id);
  if (add_eos && opts.eos_id) opts.suffix_ids.push_back(*opts.eos_id);
  auto t = tok::BpeTokenizer::from_vocab_and_merges(*tokens, merges, std::move(added), opts);
  if (!t.is_ok()) return t.status().with_context(f.path() + ": embedded tokenizer");
  return t;
}

Result<LoadedModel> load_gguf_model(const std::string& path, const LoadOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  KEEP_ASSIGN_OR_RETURN(auto file, GgufFile::open(path));
  const GgufFile& f = *file;
  KEEP_ASSIGN_OR_RETURN(ModelConfig config, gguf_model_config(f));

  LoadedModel m;
  m.source = path;
  m.format = "gguf";
  ModelWeights& w = m.weights;
  w.config = config;
  const ModelConfig& c = w.config;
  const int64_t C = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  const bool permuted = c.arch == Arch::kLlama;
  std::vector<Job> jobs;
  jobs.push_back({"token_embd.weight", {c.vocab_size, C}, &w.embed});
  jobs.push_back({"output_norm.weight", {C}, &w.final_norm});
  if (!c.tie_word_embeddings) jobs.push_back({"output.weight", {c.vocab_size, C}, &w.lm_head});
  w.layers.resize(static_cast<size_t>(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights& l = w.layers[static_cast<size_t>(i)];
    const std::string p = "blk." + std::to_string(i) + ".";
    jobs.push_back({p + "attn_norm.weight", {C}, &l.attn_norm});
    jobs.push_back({p + "attn_q.weight", {Q, C}, &l.wq, permuted ? c.num_heads : 0});
    jobs.push_back({p + "attn_k.weight", {KV, C}, &l.wk, permuted ? c.num_kv_heads : 0});
    jobs.push_back({p + "attn_v.weight", {KV, C}, &l.wv});
    jobs.push_back({p + "attn_output.weight", {C, Q}, &l.wo});
    if (c.attention_bias) {
      jobs.push_back({p + "attn_q.bias", {Q}, &l.bq, permuted ? c.num_heads : 0});
      jobs.push_back({p + "attn_k.bias", {KV}, &l.bk, permuted ? c.num_kv_heads : 0});
      jobs.push_back({p + "attn_v.bias", {KV}, &l.bv});
    }
    if (c.o_proj_bias()) jobs.push_back({p + "attn_output.bias", {C}, &l.bo});
    jobs.push_back({p + "ffn_norm.weight", {C}, &l.ffn_norm});
    jobs.push_back({p + "ffn_gate.weight", {I, C}, &l.w_gate});
    jobs.push_back({p + "ffn_up.weight", {I, C}, &l.w_up});
    jobs.push_back({p + "ffn_down.weight", {C, I}, &l.w_down});
  }
  // Presence, shape and type before any conversion.
  std::vector<const GgufTensorInfo*> infos;
  for (const Job& job : jobs) {
    const GgufTensorInfo* t = f.find_tensor(job.name);
    if (t == nullptr) {
      return Status(Code::kNotFound, path + ": tensor \"" + job.name + "\" is missing");
    }
    if (t->shape() != job.shape) {
      Tensor want;
      want.shape = job.shape;
      return Status(Code::kCorrupt, path + ": tensor \"" + job.name + "\" has shape " +
                                        t->shape_string() + ", expected " + want.shape_string());
    }
    auto info = ggml_type_info(t->type);
    if (!info || !info->dequantizable) {
      return Status(Code::kInvalidArgument, path + ": tensor \"" + job.name + "\" has type " +
                                                ggml_type_name(t->type) +
                                                ", which cannot be dequantised");
    }
    infos.push_back(t);
  }
  Status conv = detail::run_parallel(jobs.size(), options.threads, [&](size_t i) {
    Job& job = jobs[i];
    job.dst->shape = job.shape;
    job.dst->data.resize(static_cast<size_t>(job.dst->numel()));
    KEEP_RETURN_IF_ERROR(f.tensor_to_fp32(*infos[i], job.dst->data.data(), job.dst->data.size()));
    if (job.unpermute_heads > 0) {
      const int64_t cols = job.shape.size() == 2 ? job.shape[1] : 1;
      unpermute_rope_rows(job.dst->data.data(), job.unpermute_heads, c.head_dim, cols);
    }
    return Status::ok();
  });
  if (!conv.is_ok()) return conv;
  Status st = w.validate();
  if (!st.is_ok()) return st.with_context(path);

  if (options.load_tokenizer && f.find("tokenizer.ggml.model") != nullptr) {
    KEEP_ASSIGN_OR_RETURN(tok::BpeTokenizer t, gguf_tokenizer(f));
    if (t.vocab_size() > c.vocab_size) {
      return inconsistent(f, "the tokenizer has " + std::to_string(t.vocab_size()) +
                                 " tokens but token_embd.weight only " +
                                 std::to_string(c.vocab_size) + " rows");
    }
    m.tokenizer.emplace(std::move(t));
  }
  if (f.find("tokenizer.chat_template") != nullptr) {
    KEEP_ASSIGN_OR_RETURN(m.chat_template, f.get_string("tokenizer.chat_template"));
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  KEEP_LOG_INFO("engine", "loaded %s (%s) in %.2f s, %.1f MiB fp32", path.c_str(),
                c.to_string().c_str(), secs, static_cast<double>(w.bytes()) / (1024.0 * 1024.0));
  return m;
}

}  // namespace keep::engine
