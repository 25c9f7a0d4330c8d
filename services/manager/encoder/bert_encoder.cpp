#include "services/manager/encoder/bert_encoder.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "shared/blas/gemm.h"
#include "shared/common/json_limits.h"
#include "shared/common/log.h"
#include "shared/safetensors/safetensors_reader.h"

namespace keep::manager {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

Result<std::string> read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(Code::kNotFound, "cannot open '" + path.string() + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Result<json> read_json(const fs::path& path) {
  KEEP_ASSIGN_OR_RETURN(std::string text, read_text(path));
  if (json_nesting_exceeds(text)) {
    return Status(Code::kMalformed, "'" + path.string() + "' nests deeper than " +
                                        std::to_string(kMaxJsonDepth) + " levels");
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status(Code::kMalformed, "'" + path.string() + "' is not JSON");
  if (!j.is_object() && !j.is_array()) {
    return Status(Code::kMalformed, "'" + path.string() + "' is not a JSON object or array");
  }
  return j;
}

// ---- CPU kernels (plain loops; the products go to OpenBLAS)
// ---------------------------------------

// x (N, C) = LayerNorm(x) * gamma (C) + beta (C), over each row.
void layer_norm(float* x, const float* gamma, const float* beta, int N, int C, float eps) {
  for (int n = 0; n < N; ++n) {
    float* row = x + static_cast<size_t>(n) * C;
    float mean = 0.0f;
    for (int c = 0; c < C; ++c) mean += row[c];
    mean /= static_cast<float>(C);
    float var = 0.0f;
    for (int c = 0; c < C; ++c) var += (row[c] - mean) * (row[c] - mean);
    var /= static_cast<float>(C);
    const float rstd = 1.0f / std::sqrt(var + eps);
    for (int c = 0; c < C; ++c) row[c] = (row[c] - mean) * rstd * gamma[c] + beta[c];
  }
}

// x (N, C) += bias (C) on every row.
void add_bias(float* x, const float* bias, int N, int C) {
  for (int n = 0; n < N; ++n) {
    float* row = x + static_cast<size_t>(n) * C;
    for (int c = 0; c < C; ++c) row[c] += bias[c];
  }
}

// out (N, C) = out + bias (C) + residual (N, C).
void add_bias_residual(float* out, const float* bias, const float* residual, int N, int C) {
  for (int n = 0; n < N; ++n) {
    float* row = out + static_cast<size_t>(n) * C;
    const float* res = residual + static_cast<size_t>(n) * C;
    for (int c = 0; c < C; ++c) row[c] += bias[c] + res[c];
  }
}

// x (count) = gelu(x + bias) with bias (C) broadcast over rows of C.
void bias_gelu(float* x, const float* bias, int N, int C, bool tanh_approx) {
  constexpr float kInvSqrt2 = 0.70710678118654752f;
  constexpr float kSqrt2OverPi = 0.79788456080286536f;
  for (int n = 0; n < N; ++n) {
    float* row = x + static_cast<size_t>(n) * C;
    for (int c = 0; c < C; ++c) {
      const float v = row[c] + bias[c];
      row[c] = tanh_approx
                   ? 0.5f * v * (1.0f + std::tanh(kSqrt2OverPi * (v + 0.044715f * v * v * v)))
                   : 0.5f * v * (1.0f + std::erf(v * kInvSqrt2));
    }
  }
}

// Row-wise softmax of s (L, L).
void softmax_rows(float* s, int L) {
  for (int i = 0; i < L; ++i) {
    float* row = s + static_cast<size_t>(i) * L;
    float mx = row[0];
    for (int j = 1; j < L; ++j) mx = std::max(mx, row[j]);
    float sum = 0.0f;
    for (int j = 0; j < L; ++j) {
      row[j] = std::exp(row[j] - mx);
      sum += row[j];
    }
    const float inv = 1.0f / sum;
    for (int j = 0; j < L; ++j) row[j] *= inv;
  }
}

}  // namespace

// ---- weights
// --------------------------------------------------------------------------------------

struct BertEncoder::Weights {
  struct Layer {
    std::vector<float> w_qkv;         // (3H, H): rows of Wq, then Wk, then Wv (Linear: (out, in))
    std::vector<float> b_qkv;         // (3H)
    std::vector<float> w_o;           // (H, H)
    std::vector<float> b_o;           // (H)
    std::vector<float> ln1_g, ln1_b;  // (H) after attention
    std::vector<float> w_in;          // (I, H)
    std::vector<float> b_in;          // (I)
    std::vector<float> w_out;         // (H, I)
    std::vector<float> b_out;         // (H)
    std::vector<float> ln2_g, ln2_b;  // (H) after the FFN
  };
  std::vector<float> word_emb;            // (V, H)
  std::vector<float> pos_emb;             // (P, H)
  std::vector<float> type_emb;            // (T, H); only row 0 is used (single sentences)
  std::vector<float> emb_ln_g, emb_ln_b;  // (H)
  std::vector<Layer> layers;
};

namespace {

// Loads tensors by their HF BertModel names, trying the bare name and the "bert." prefix (a
// checkpoint saved from BertForXxx), and the old "gamma"/"beta" LayerNorm spelling.
class WeightLoader {
 public:
  explicit WeightLoader(const safetensors::SafetensorsModel& model) : model_(model) {}

  // Appends tensor `name` of shape `shape`, converted to fp32, to *out.
  Status load(const std::string& name, const std::vector<int64_t>& shape, std::vector<float>* out) {
    std::string found;
    for (const std::string& cand : candidates(name)) {
      if (model_.contains(cand)) {
        found = cand;
        break;
      }
    }
    if (found.empty()) {
      return Status(Code::kNotFound, "weights lack tensor '" + name + "' (also tried 'bert." +
                                         name + "' and gamma/beta for LayerNorm)");
    }
    KEEP_ASSIGN_OR_RETURN(safetensors::TensorView v, model_.tensor(found, shape));
    const size_t at = out->size();
    out->resize(at + static_cast<size_t>(v.numel()));
    return safetensors::to_fp32(v, out->data() + at, static_cast<size_t>(v.numel()));
  }

 private:
  static std::vector<std::string> candidates(const std::string& name) {
    std::vector<std::string> c = {name, "bert." + name};
    auto swap_suffix = [&](const std::string& from, const std::string& to) {
      if (name.find("LayerNorm") != std::string::npos && name.size() > from.size() &&
          name.compare(name.size() - from.size(), from.size(), from) == 0) {
        const std::string alt = name.substr(0, name.size() - from.size()) + to;
        c.push_back(alt);
        c.push_back("bert." + alt);
      }
    };
    swap_suffix(".weight", ".gamma");
    swap_suffix(".bias", ".beta");
    return c;
  }
  const safetensors::SafetensorsModel& model_;
};

}  // namespace

// ---- loading
// --------------------------------------------------------------------------------------

Result<BertConfig> parse_bert_config(std::string_view json_text, const std::string& where) {
  if (json_nesting_exceeds(json_text)) {
    return Status(Code::kMalformed,
                  "'" + where + "' nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  }
  const json cfg = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (cfg.is_discarded()) return Status(Code::kMalformed, "'" + where + "' is not JSON");
  auto bad = [&](const std::string& what) {
    return Status(Code::kInvalidArgument, "config.json: " + what);
  };
  if (!cfg.is_object()) return bad("not an object");
  // A field of the wrong JSON type throws from value()/get() (caught below); a float or
  // out-of-range number must not reach the int conversion (undefined for doubles out of range).
  auto get_int = [&](const char* key, std::optional<int> fallback, int* out) -> Status {
    const auto it = cfg.find(key);
    if (it == cfg.end() && fallback) {
      *out = *fallback;
      return Status::ok();
    }
    const std::optional<int64_t> v = it == cfg.end() ? std::nullopt : json_int64(*it);
    if (!v || *v < INT32_MIN || *v > INT32_MAX) {
      return bad(std::string("missing or mistyped field '") + key + "'");
    }
    *out = static_cast<int>(*v);
    return Status::ok();
  };
  BertConfig c;
  try {
    const std::string type = cfg.value("model_type", "");
    if (type != "bert") {
      return bad("model_type '" + type + "' is not supported (only 'bert')");
    }
    KEEP_RETURN_IF_ERROR(get_int("vocab_size", std::nullopt, &c.vocab_size));
    KEEP_RETURN_IF_ERROR(get_int("hidden_size", std::nullopt, &c.hidden));
    KEEP_RETURN_IF_ERROR(get_int("num_hidden_layers", std::nullopt, &c.layers));
    KEEP_RETURN_IF_ERROR(get_int("num_attention_heads", std::nullopt, &c.heads));
    KEEP_RETURN_IF_ERROR(get_int("intermediate_size", std::nullopt, &c.intermediate));
    KEEP_RETURN_IF_ERROR(get_int("max_position_embeddings", std::nullopt, &c.max_positions));
    KEEP_RETURN_IF_ERROR(get_int("type_vocab_size", 2, &c.type_vocab_size));
    const double eps = cfg.value("layer_norm_eps", 1e-12);
    if (!(eps > 0.0 && eps < 1.0))
      return bad("layer_norm_eps " + std::to_string(eps) + " out of (0, 1)");
    c.layer_norm_eps = static_cast<float>(eps);
    const std::string act = cfg.value("hidden_act", "gelu");
    if (act == "gelu") {
      c.gelu_tanh = false;
    } else if (act == "gelu_new" || act == "gelu_pytorch_tanh") {
      c.gelu_tanh = true;
    } else {
      return bad("hidden_act '" + act + "' is not supported (gelu, gelu_new)");
    }
    const std::string pos = cfg.value("position_embedding_type", "absolute");
    if (pos != "absolute") {
      return bad("position_embedding_type '" + pos + "' is not supported (absolute)");
    }
  } catch (const json::exception& e) {
    return bad(std::string("mistyped field: ") + e.what());
  }
  if (c.vocab_size <= 0 || c.hidden <= 0 || c.layers <= 0 || c.heads <= 0 || c.intermediate <= 0 ||
      c.max_positions < 2 || c.type_vocab_size <= 0 || c.hidden % c.heads != 0 ||
      c.hidden > 65536 || c.intermediate > 262144 || c.layers > 256 || c.max_positions > 65536 ||
      !(c.layer_norm_eps > 0.0f)) {
    return bad("inconsistent shape (hidden " + std::to_string(c.hidden) + ", heads " +
               std::to_string(c.heads) + ", layers " + std::to_string(c.layers) + ")");
  }
  return c;
}

BertEncoder::BertEncoder() = default;
BertEncoder::~BertEncoder() = default;

Result<std::unique_ptr<BertEncoder>> BertEncoder::load(const std::string& dir,
                                                       const EncoderOptions& options) {
  const fs::path root(dir);
  std::error_code ec;
  auto fail = [&](const Status& s) { return s.with_context("loading encoder '" + dir + "'"); };
  if (!fs::is_directory(root, ec)) {
    return fail(Status(Code::kNotFound,
                       "not a directory (models are fetched by "
                       "deploy/fetch-models.sh)"));
  }
  auto enc = std::unique_ptr<BertEncoder>(new BertEncoder());
  enc->options_ = options;
  if (enc->options_.max_batch_tokens == 0) enc->options_.max_batch_tokens = 1;
  const BertConfig& c = enc->config_;

  // config.json: the BertModel shape.
  {
    auto text = read_text(root / "config.json");
    if (!text.is_ok()) return fail(text.status());
    auto config = parse_bert_config(*text, (root / "config.json").string());
    if (!config.is_ok()) return fail(config.status());
    enc->config_ = *config;
  }

  // modules.json: Transformer, Pooling, optional Normalize; nothing else.
  fs::path pooling_dir;
  {
    auto j = read_json(root / "modules.json");
    if (!j.is_ok()) {
      return fail(j.status().with_context("not a sentence-transformers directory"));
    }
    if (!j->is_array()) return fail(Status(Code::kMalformed, "modules.json is not an array"));
    bool transformer = false, pooling = false;
    enc->normalize_ = false;
    for (const json& m : *j) {
      const std::string type = m.is_object() ? m.value("type", "") : "";
      const std::string path = m.is_object() ? m.value("path", "") : "";
      auto ends_with = [&](const std::string& suffix) {
        return type.size() >= suffix.size() &&
               type.compare(type.size() - suffix.size(), suffix.size(), suffix) == 0;
      };
      if (ends_with("models.Transformer")) {
        if (!path.empty()) {
          return fail(Status(Code::kInvalidArgument,
                             "modules.json: Transformer at '" + path + "' (only '' supported)"));
        }
        transformer = true;
      } else if (ends_with("models.Pooling")) {
        if (path.empty() || path.find("..") != std::string::npos) {
          return fail(Status(Code::kInvalidArgument, "modules.json: bad Pooling path"));
        }
        pooling_dir = root / path;
        pooling = true;
      } else if (ends_with("models.Normalize")) {
        enc->normalize_ = true;
      } else {
        return fail(Status(Code::kInvalidArgument, "modules.json: module type '" + type +
                                                       "' is not supported (Transformer, "
                                                       "Pooling, Normalize)"));
      }
    }
    if (!transformer || !pooling) {
      return fail(
          Status(Code::kInvalidArgument, "modules.json: needs a Transformer and a Pooling module"));
    }
  }

  // <pooling>/config.json: exactly one supported mode.
  {
    auto j = read_json(pooling_dir / "config.json");
    if (!j.is_ok()) return fail(j.status());
    const json& p = *j;
    if (!p.is_object()) return fail(Status(Code::kMalformed, "pooling config is not an object"));
    for (const char* unsupported : {"pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"}) {
      if (p.value(unsupported, false)) {
        return fail(Status(Code::kInvalidArgument,
                           std::string("pooling: ") + unsupported + " is not supported"));
      }
    }
    struct Mode {
      const char* key;
      PoolingMode mode;
    };
    const Mode modes[] = {{"pooling_mode_mean_tokens", PoolingMode::kMean},
                          {"pooling_mode_cls_token", PoolingMode::kCls},
                          {"pooling_mode_max_tokens", PoolingMode::kMax},
                          {"pooling_mode_mean_sqrt_len_tokens", PoolingMode::kMeanSqrtLen}};
    int on = 0;
    for (const Mode& m : modes) {
      const json v = p.value(m.key, json(false));
      if (v.is_boolean() && v.get<bool>()) {
        enc->pooling_ = m.mode;
        ++on;
      }
    }
    if (on != 1) {
      return fail(Status(Code::kInvalidArgument,
                         "pooling: exactly one of mean/cls/max/mean_sqrt_len must be on (" +
                             std::to_string(on) + " are; concatenated modes are not supported)"));
    }
    const int dim = p.value("word_embedding_dimension", c.hidden);
    if (dim != c.hidden) {
      return fail(Status(Code::kInvalidArgument, "pooling: word_embedding_dimension " +
                                                     std::to_string(dim) + " != hidden_size " +
                                                     std::to_string(c.hidden)));
    }
  }

  // Tokenizer, then sentence_bert_config.json (max_seq_length, do_lower_case).
  {
    auto tok = WordPieceTokenizer::from_dir(dir);
    if (!tok.is_ok()) return fail(tok.status());
    enc->tokenizer_ = std::move(tok).value();
    if (enc->tokenizer_->vocab_size() > static_cast<size_t>(c.vocab_size)) {
      return fail(Status(Code::kInvalidArgument, "tokenizer has " +
                                                     std::to_string(enc->tokenizer_->vocab_size()) +
                                                     " tokens, more than config vocab_size " +
                                                     std::to_string(c.vocab_size)));
    }
    enc->max_seq_length_ = static_cast<size_t>(std::min(c.max_positions, 512));
    if (fs::exists(root / "sentence_bert_config.json", ec)) {
      auto j = read_json(root / "sentence_bert_config.json");
      if (!j.is_ok()) return fail(j.status());
      if (j->is_object()) {
        const json msl = j->value("max_seq_length", json());
        if (msl.is_number_unsigned()) enc->max_seq_length_ = msl.get<size_t>();
        if (j->value("do_lower_case", false)) enc->tokenizer_->set_lowercase(true);
      }
    }
    if (enc->max_seq_length_ < 2 || enc->max_seq_length_ > static_cast<size_t>(c.max_positions)) {
      return fail(Status(Code::kInvalidArgument, "max_seq_length " +
                                                     std::to_string(enc->max_seq_length_) +
                                                     " outside [2, max_position_embeddings " +
                                                     std::to_string(c.max_positions) + "]"));
    }
  }

  // Weights.
  {
    auto model = safetensors::SafetensorsModel::open_dir(dir);
    if (!model.is_ok()) return fail(model.status());
    WeightLoader ld(**model);
    auto w = std::make_unique<Weights>();
    const int64_t H = c.hidden, I = c.intermediate;
    Status st;
    auto load = [&](const std::string& name, std::vector<int64_t> shape, std::vector<float>* out) {
      if (st.is_ok()) st = ld.load(name, shape, out);
    };
    load("embeddings.word_embeddings.weight", {c.vocab_size, H}, &w->word_emb);
    load("embeddings.position_embeddings.weight", {c.max_positions, H}, &w->pos_emb);
    load("embeddings.token_type_embeddings.weight", {c.type_vocab_size, H}, &w->type_emb);
    load("embeddings.LayerNorm.weight", {H}, &w->emb_ln_g);
    load("embeddings.LayerNorm.bias", {H}, &w->emb_ln_b);
    w->layers.resize(static_cast<size_t>(c.layers));
    for (int l = 0; l < c.layers; ++l) {
      Weights::Layer& L = w->layers[static_cast<size_t>(l)];
      const std::string p = "encoder.layer." + std::to_string(l) + ".";
      for (const char* qkv : {"query", "key", "value"}) {  // stacked into (3H, H) and (3H)
        load(p + "attention.self." + qkv + ".weight", {H, H}, &L.w_qkv);
        load(p + "attention.self." + qkv + ".bias", {H}, &L.b_qkv);
      }
      load(p + "attention.output.dense.weight", {H, H}, &L.w_o);
      load(p + "attention.output.dense.bias", {H}, &L.b_o);
      load(p + "attention.output.LayerNorm.weight", {H}, &L.ln1_g);
      load(p + "attention.output.LayerNorm.bias", {H}, &L.ln1_b);
      load(p + "intermediate.dense.weight", {I, H}, &L.w_in);
      load(p + "intermediate.dense.bias", {I}, &L.b_in);
      load(p + "output.dense.weight", {H, I}, &L.w_out);
      load(p + "output.dense.bias", {H}, &L.b_out);
      load(p + "output.LayerNorm.weight", {H}, &L.ln2_g);
      load(p + "output.LayerNorm.bias", {H}, &L.ln2_b);
    }
    if (!st.is_ok()) return fail(st);
    enc->w_ = std::move(w);
  }

  KEEP_LOG_INFO("encoder",
                "loaded %s: BERT %d layers, hidden %d, %d heads, pooling %d, normalize %d, "
                "max_seq_length %zu, OpenBLAS threads %d",
                dir.c_str(), c.layers, c.hidden, c.heads, static_cast<int>(enc->pooling_),
                enc->normalize_ ? 1 : 0, enc->max_seq_length_, blas::num_threads());
  return enc;
}

// ---- inference
// ------------------------------------------------------------------------------------

Result<std::vector<std::vector<float>>> BertEncoder::encode(
    const std::vector<std::string>& texts) const {
  std::vector<std::vector<int32_t>> ids;
  ids.reserve(texts.size());
  for (const std::string& t : texts) ids.push_back(tokenizer_->encode(t, max_seq_length_));
  return encode_ids(ids);
}

Result<std::vector<std::vector<float>>> BertEncoder::encode_ids(
    const std::vector<std::vector<int32_t>>& ids) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto& s = ids[i];
    if (s.empty() || s.size() > static_cast<size_t>(config_.max_positions)) {
      return Status(Code::kInvalidArgument,
                    "sequence " + std::to_string(i) + " has " + std::to_string(s.size()) +
                        " tokens (1.." + std::to_string(config_.max_positions) + " allowed)");
    }
    for (int32_t id : s) {
      if (id < 0 || id >= config_.vocab_size) {
        return Status(Code::kInvalidArgument, "sequence " + std::to_string(i) + ": token id " +
                                                  std::to_string(id) + " outside the vocabulary");
      }
    }
  }
  std::vector<std::vector<float>> out(ids.size());
  // Chunks of consecutive sequences with at most max_batch_tokens tokens (at least one each).
  size_t begin = 0;
  std::vector<int32_t> packed;
  std::vector<int> lens;
  while (begin < ids.size()) {
    packed.clear();
    lens.clear();
    size_t end = begin;
    while (end < ids.size() &&
           (end == begin || packed.size() + ids[end].size() <= options_.max_batch_tokens)) {
      packed.insert(packed.end(), ids[end].begin(), ids[end].end());
      lens.push_back(static_cast<int>(ids[end].size()));
      ++end;
    }
    std::vector<std::vector<float>> chunk;
    forward(packed, lens, &chunk);
    for (size_t i = begin; i < end; ++i) out[i] = std::move(chunk[i - begin]);
    begin = end;
  }
  return out;
}

void BertEncoder::forward(const std::vector<int32_t>& ids, const std::vector<int>& lens,
                          std::vector<std::vector<float>>* out) const {
  const int N = static_cast<int>(ids.size());  // tokens of all sequences, packed
  const int H = config_.hidden;
  const int H3 = 3 * H;
  const int I = config_.intermediate;
  const int NH = config_.heads;
  const int D = H / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int max_len = *std::max_element(lens.begin(), lens.end());
  const auto sz = [](int a, int b) { return static_cast<size_t>(a) * static_cast<size_t>(b); };

  std::vector<float> x(sz(N, H));                // (N, H) the residual stream
  std::vector<float> qkv(sz(N, H3));             // (N, 3H) Q | K | V, head h at columns h*D of each
  std::vector<float> ctx(sz(N, H));              // (N, H) attention output, heads concatenated
  std::vector<float> tmp(sz(N, H));              // (N, H) projection output before the residual
  std::vector<float> ffn(sz(N, I));              // (N, I)
  std::vector<float> att(sz(max_len, max_len));  // (L, L) one head of one sequence

  // Embeddings: word + position (within the sequence) + token type 0, then LayerNorm.
  const Weights& w = *w_;
  {
    int t = 0;
    for (int len : lens) {
      for (int p = 0; p < len; ++p, ++t) {
        const float* we = w.word_emb.data() + sz(ids[static_cast<size_t>(t)], H);
        const float* pe = w.pos_emb.data() + sz(p, H);
        const float* te = w.type_emb.data();
        float* row = x.data() + sz(t, H);
        for (int c = 0; c < H; ++c) row[c] = we[c] + pe[c] + te[c];
      }
    }
  }
  layer_norm(x.data(), w.emb_ln_g.data(), w.emb_ln_b.data(), N, H, config_.layer_norm_eps);

  for (const Weights::Layer& L : w.layers) {
    // qkv (N, 3H) = x (N, H) · Wqkv (3H, H)^T + b
    blas::gemm_nt(qkv.data(), x.data(), L.w_qkv.data(), N, H3, H);
    add_bias(qkv.data(), L.b_qkv.data(), N, H3);

    // Attention, per sequence and head, over that sequence's tokens only.
    int off = 0;
    for (int len : lens) {
      for (int h = 0; h < NH; ++h) {
        const float* q = qkv.data() + sz(off, H3) + sz(h, D);  // (len, D) [ld 3H]
        const float* k = q + H;                                // (len, D) [ld 3H]
        const float* v = q + 2 * H;                            // (len, D) [ld 3H]
        // att (len, len) = scale * q · k^T
        blas::gemm_nt_strided(att.data(), len, q, H3, k, H3, len, len, D, scale);
        softmax_rows(att.data(), len);
        // ctx[off:off+len, h*D:(h+1)*D] (len, D) [ld H] = att (len, len) · v (len, D)
        blas::gemm_nn_strided(ctx.data() + sz(off, H) + sz(h, D), H, att.data(), len, v, H3, len, D,
                              len);
      }
      off += len;
    }
    // x = LayerNorm(x + ctx · Wo^T + bo)
    blas::gemm_nt(tmp.data(), ctx.data(), L.w_o.data(), N, H, H);  // (N, H)
    add_bias_residual(tmp.data(), L.b_o.data(), x.data(), N, H);
    layer_norm(tmp.data(), L.ln1_g.data(), L.ln1_b.data(), N, H, config_.layer_norm_eps);
    x.swap(tmp);

    // x = LayerNorm(x + gelu(x · Win^T + bin) · Wout^T + bout)
    blas::gemm_nt(ffn.data(), x.data(), L.w_in.data(), N, I, H);  // (N, I)
    bias_gelu(ffn.data(), L.b_in.data(), N, I, config_.gelu_tanh);
    blas::gemm_nt(tmp.data(), ffn.data(), L.w_out.data(), N, H, I);  // (N, H)
    add_bias_residual(tmp.data(), L.b_out.data(), x.data(), N, H);
    layer_norm(tmp.data(), L.ln2_g.data(), L.ln2_b.data(), N, H, config_.layer_norm_eps);
    x.swap(tmp);
  }

  // Pooling over each sequence's tokens (every token is real: nothing to mask), then L2.
  out->assign(lens.size(), std::vector<float>(static_cast<size_t>(H), 0.0f));
  int off = 0;
  for (size_t b = 0; b < lens.size(); ++b) {
    const int len = lens[b];
    std::vector<float>& e = (*out)[b];        // (H)
    const float* xs = x.data() + sz(off, H);  // (len, H)
    switch (pooling_) {
      case PoolingMode::kCls:
        std::copy(xs, xs + H, e.begin());
        break;
      case PoolingMode::kMax:
        std::copy(xs, xs + H, e.begin());
        for (int t = 1; t < len; ++t) {
          for (int c = 0; c < H; ++c) e[c] = std::max(e[c], xs[sz(t, H) + c]);
        }
        break;
      case PoolingMode::kMean:
      case PoolingMode::kMeanSqrtLen: {
        for (int t = 0; t < len; ++t) {
          for (int c = 0; c < H; ++c) e[c] += xs[sz(t, H) + c];
        }
        const float div = pooling_ == PoolingMode::kMean ? static_cast<float>(len)
                                                         : std::sqrt(static_cast<float>(len));
        for (float& f : e) f /= div;
        break;
      }
    }
    if (normalize_) {  // torch.nn.functional.normalize: x / max(||x||, 1e-12)
      double norm = 0.0;
      for (float f : e) norm += static_cast<double>(f) * f;
      const float inv = 1.0f / std::max(static_cast<float>(std::sqrt(norm)), 1e-12f);
      for (float& f : e) f *= inv;
    }
    off += len;
  }
}

}  // namespace keep::manager
