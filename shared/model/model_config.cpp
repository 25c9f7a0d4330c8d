#include "shared/model/model_config.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "shared/common/json_limits.h"

namespace keep::engine {

namespace {

using nlohmann::json;

std::string prefix(std::string_view where) { return std::string(where) + ": "; }

// Reads an integer field. Absent -> `fallback` (nullopt fallback means required).
Status read_int(const json& j, const char* key, std::optional<int64_t> fallback,
                std::string_view where, int64_t* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (!fallback) {
      return Status(Code::kInvalidArgument, prefix(where) + "missing \"" + key + "\"");
    }
    *out = *fallback;
    return Status::ok();
  }
  if (!it->is_number_integer()) {
    return Status(Code::kMalformed, prefix(where) + "\"" + key + "\" must be an integer");
  }
  if (it->is_number_unsigned() &&
      it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Status(Code::kInvalidArgument, prefix(where) + "\"" + key + "\" is too large");
  }
  *out = it->get<int64_t>();
  return Status::ok();
}

Status read_float(const json& j, const char* key, double fallback, std::string_view where,
                  double* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    *out = fallback;
    return Status::ok();
  }
  if (!it->is_number()) {
    return Status(Code::kMalformed, prefix(where) + "\"" + key + "\" must be a number");
  }
  *out = it->get<double>();
  return Status::ok();
}

Status read_bool(const json& j, const char* key, bool fallback, std::string_view where, bool* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    *out = fallback;
    return Status::ok();
  }
  if (!it->is_boolean()) {
    return Status(Code::kMalformed, prefix(where) + "\"" + key + "\" must be a boolean");
  }
  *out = it->get<bool>();
  return Status::ok();
}

Status read_token_id(const json& v, const char* key, std::string_view where, int32_t* out) {
  if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
      v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
    return Status(Code::kMalformed,
                  prefix(where) + "\"" + key + "\" must be a non-negative integer token id");
  }
  *out = static_cast<int32_t>(v.get<int64_t>());
  return Status::ok();
}

Status parse_rope_scaling(const json& rs, std::string_view where, const char* key, ModelConfig* c) {
  if (rs.is_null()) return Status::ok();
  if (!rs.is_object()) {
    return Status(Code::kMalformed, prefix(where) + "\"" + key + "\" must be an object or null");
  }
  std::string type;
  for (const char* k : {"rope_type", "type"}) {
    auto it = rs.find(k);
    if (it != rs.end() && !it->is_null()) {
      if (!it->is_string()) {
        return Status(Code::kMalformed,
                      prefix(where) + "\"" + key + "." + k + "\" must be a string");
      }
      type = it->get<std::string>();
      break;
    }
  }
  // transformers >= 5 puts rope_theta inside rope_parameters.
  if (rs.contains("rope_theta")) {
    KEEP_RETURN_IF_ERROR(read_float(rs, "rope_theta", c->rope_theta, where, &c->rope_theta));
  }
  if (type.empty() || type == "default") return Status::ok();
  if (type != "llama3") {
    return Status(Code::kInvalidArgument, prefix(where) + "unsupported " + key + " type \"" + type +
                                              "\" (supported: default, llama3)");
  }
  RopeScaling s;
  s.type = RopeScalingType::kLlama3;
  KEEP_RETURN_IF_ERROR(read_float(rs, "factor", 0.0, where, &s.factor));
  KEEP_RETURN_IF_ERROR(read_float(rs, "low_freq_factor", 1.0, where, &s.low_freq_factor));
  KEEP_RETURN_IF_ERROR(read_float(rs, "high_freq_factor", 4.0, where, &s.high_freq_factor));
  KEEP_RETURN_IF_ERROR(read_int(rs, "original_max_position_embeddings", std::nullopt, where,
                                &s.original_max_position_embeddings));
  c->rope_scaling = s;
  return Status::ok();
}

}  // namespace

const char* arch_name(Arch arch) {
  switch (arch) {
    case Arch::kQwen2:
      return "qwen2";
    case Arch::kLlama:
      return "llama";
  }
  return "unknown";
}

Status ModelConfig::validate() const {
  auto bad = [](const std::string& what) {
    return Status(Code::kInvalidArgument, "invalid model config: " + what);
  };
  if (vocab_size <= 0) return bad("vocab_size must be positive");
  if (hidden_size <= 0) return bad("hidden_size must be positive");
  if (num_layers <= 0) return bad("num_hidden_layers must be positive");
  if (num_heads <= 0) return bad("num_attention_heads must be positive");
  if (num_kv_heads <= 0) return bad("num_key_value_heads must be positive");
  if (num_heads % num_kv_heads != 0) {
    return bad("num_attention_heads (" + std::to_string(num_heads) +
               ") is not a multiple of num_key_value_heads (" + std::to_string(num_kv_heads) + ")");
  }
  if (head_dim <= 0 || head_dim % 2 != 0) return bad("head_dim must be positive and even");
  if (intermediate_size <= 0) return bad("intermediate_size must be positive");
  if (!(rms_norm_eps > 0.0) || !std::isfinite(rms_norm_eps)) {
    return bad("rms_norm_eps must be positive");
  }
  if (!(rope_theta > 0.0) || !std::isfinite(rope_theta)) return bad("rope_theta must be positive");
  if (max_position_embeddings < 0) return bad("max_position_embeddings must not be negative");
  // Sizes whose products must stay far from overflow (the largest tensor is vocab x hidden).
  constexpr int64_t kMaxDim = int64_t{1} << 24;
  for (int64_t v : {vocab_size, hidden_size, num_layers, num_heads, head_dim, intermediate_size}) {
    if (v > kMaxDim) return bad("a dimension exceeds " + std::to_string(kMaxDim));
  }
  for (int32_t id : eos_token_ids) {
    if (id < 0) return bad("eos_token_id must not be negative");
  }
  if (rope_scaling.type == RopeScalingType::kLlama3) {
    const RopeScaling& s = rope_scaling;
    if (!(s.factor > 0.0)) return bad("rope_scaling.factor must be positive");
    if (!(s.low_freq_factor > 0.0)) return bad("rope_scaling.low_freq_factor must be positive");
    if (!(s.high_freq_factor > s.low_freq_factor)) {
      return bad("rope_scaling.high_freq_factor must exceed low_freq_factor");
    }
    if (s.original_max_position_embeddings <= 0) {
      return bad("rope_scaling.original_max_position_embeddings must be positive");
    }
  }
  return Status::ok();
}

std::string ModelConfig::to_string() const {
  std::ostringstream os;
  os << arch_name(arch) << " vocab=" << vocab_size << " hidden=" << hidden_size
     << " layers=" << num_layers << " heads=" << num_heads << "/" << num_kv_heads
     << " hd=" << head_dim << " inter=" << intermediate_size << " eps=" << rms_norm_eps
     << " theta=" << rope_theta;
  if (rope_scaling.type == RopeScalingType::kLlama3) {
    os << " rope=llama3(factor=" << rope_scaling.factor << ", low=" << rope_scaling.low_freq_factor
       << ", high=" << rope_scaling.high_freq_factor
       << ", orig=" << rope_scaling.original_max_position_embeddings << ")";
  }
  os << " bias=" << (attention_bias ? 1 : 0) << " tied=" << (tie_word_embeddings ? 1 : 0)
     << " max_pos=" << max_position_embeddings;
  return os.str();
}

std::vector<float> rope_inv_freq(const ModelConfig& config) {
  const int64_t half = config.head_dim / 2;
  std::vector<float> out(static_cast<size_t>(half));
  const RopeScaling& s = config.rope_scaling;
  for (int64_t i = 0; i < half; ++i) {
    double inv = 1.0 / std::pow(config.rope_theta,
                                static_cast<double>(2 * i) / static_cast<double>(config.head_dim));
    if (s.type == RopeScalingType::kLlama3) {
      const double old_len = static_cast<double>(s.original_max_position_embeddings);
      const double low_wavelen = old_len / s.low_freq_factor;
      const double high_wavelen = old_len / s.high_freq_factor;
      const double wavelen = 2.0 * M_PI / inv;
      double scaled = wavelen > low_wavelen ? inv / s.factor : inv;
      const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      if (medium) {
        const double smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        scaled = (1.0 - smooth) * scaled / s.factor + smooth * scaled;
      }
      inv = scaled;
    }
    out[static_cast<size_t>(i)] = static_cast<float>(inv);
  }
  return out;
}

Result<ModelConfig> parse_hf_config(std::string_view json_text, std::string_view where) {
  if (json_nesting_exceeds(json_text)) {
    return Status(Code::kMalformed, prefix(where) + "JSON nested deeper than " +
                                        std::to_string(kMaxJsonDepth) + " levels");
  }
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status(Code::kMalformed, prefix(where) + "not valid JSON");
  if (!j.is_object()) return Status(Code::kMalformed, prefix(where) + "not a JSON object");

  ModelConfig c;
  std::string arch_str;
  if (auto it = j.find("architectures"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || it->empty() || !(*it)[0].is_string()) {
      return Status(Code::kMalformed,
                    prefix(where) + "\"architectures\" must be a non-empty list of strings");
    }
    arch_str = (*it)[0].get<std::string>();
  } else if (auto mt = j.find("model_type"); mt != j.end() && mt->is_string()) {
    arch_str = mt->get<std::string>();
  } else {
    return Status(Code::kInvalidArgument,
                  prefix(where) + "missing \"architectures\" and \"model_type\"");
  }
  if (arch_str == "Qwen2ForCausalLM" || arch_str == "qwen2") {
    c.arch = Arch::kQwen2;
  } else if (arch_str == "LlamaForCausalLM" || arch_str == "llama") {
    c.arch = Arch::kLlama;
  } else {
    return Status(Code::kInvalidArgument, prefix(where) + "unsupported architecture \"" + arch_str +
                                              "\" (supported: Qwen2ForCausalLM, LlamaForCausalLM)");
  }

  KEEP_RETURN_IF_ERROR(read_int(j, "vocab_size", std::nullopt, where, &c.vocab_size));
  KEEP_RETURN_IF_ERROR(read_int(j, "hidden_size", std::nullopt, where, &c.hidden_size));
  KEEP_RETURN_IF_ERROR(read_int(j, "num_hidden_layers", std::nullopt, where, &c.num_layers));
  KEEP_RETURN_IF_ERROR(read_int(j, "num_attention_heads", std::nullopt, where, &c.num_heads));
  KEEP_RETURN_IF_ERROR(read_int(j, "num_key_value_heads", c.num_heads, where, &c.num_kv_heads));
  KEEP_RETURN_IF_ERROR(read_int(j, "intermediate_size", std::nullopt, where, &c.intermediate_size));
  if (c.num_heads <= 0) {
    return Status(Code::kInvalidArgument,
                  prefix(where) + "\"num_attention_heads\" must be positive");
  }
  KEEP_RETURN_IF_ERROR(read_int(j, "head_dim", c.hidden_size / c.num_heads, where, &c.head_dim));
  KEEP_RETURN_IF_ERROR(read_float(j, "rms_norm_eps", 1e-6, where, &c.rms_norm_eps));
  KEEP_RETURN_IF_ERROR(read_float(j, "rope_theta", 10000.0, where, &c.rope_theta));
  KEEP_RETURN_IF_ERROR(
      read_int(j, "max_position_embeddings", 0, where, &c.max_position_embeddings));
  KEEP_RETURN_IF_ERROR(read_bool(j, "tie_word_embeddings", false, where, &c.tie_word_embeddings));
  if (c.arch == Arch::kQwen2) {
    c.attention_bias = true;  // Qwen2Attention: q/k/v bias=True, o_proj bias=False
    bool sliding = false;
    KEEP_RETURN_IF_ERROR(read_bool(j, "use_sliding_window", false, where, &sliding));
    if (sliding) {
      return Status(Code::kInvalidArgument,
                    prefix(where) + "\"use_sliding_window\": true is not supported");
    }
  } else {
    KEEP_RETURN_IF_ERROR(read_bool(j, "attention_bias", false, where, &c.attention_bias));
    bool mlp_bias = false;
    KEEP_RETURN_IF_ERROR(read_bool(j, "mlp_bias", false, where, &mlp_bias));
    if (mlp_bias) {
      return Status(Code::kInvalidArgument, prefix(where) + "\"mlp_bias\": true is not supported");
    }
  }
  if (auto it = j.find("hidden_act"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || it->get<std::string>() != "silu") {
      return Status(Code::kInvalidArgument,
                    prefix(where) + "\"hidden_act\" must be \"silu\" (got " + it->dump() + ")");
    }
  }
  if (auto it = j.find("rope_scaling"); it != j.end()) {
    KEEP_RETURN_IF_ERROR(parse_rope_scaling(*it, where, "rope_scaling", &c));
  }
  if (auto it = j.find("rope_parameters");
      it != j.end() && c.rope_scaling.type == RopeScalingType::kNone) {
    KEEP_RETURN_IF_ERROR(parse_rope_scaling(*it, where, "rope_parameters", &c));
  }
  if (auto it = j.find("bos_token_id"); it != j.end() && !it->is_null()) {
    int32_t id = 0;
    KEEP_RETURN_IF_ERROR(read_token_id(*it, "bos_token_id", where, &id));
    c.bos_token_id = id;
  }
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    if (it->is_array()) {
      for (const json& v : *it) {
        int32_t id = 0;
        KEEP_RETURN_IF_ERROR(read_token_id(v, "eos_token_id", where, &id));
        c.eos_token_ids.push_back(id);
      }
    } else {
      int32_t id = 0;
      KEEP_RETURN_IF_ERROR(read_token_id(*it, "eos_token_id", where, &id));
      c.eos_token_ids.push_back(id);
    }
  }
  Status st = c.validate();
  if (!st.is_ok()) return st.with_context(where);
  return c;
}

Result<ModelConfig> load_hf_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(Code::kIoError, path + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status(Code::kIoError, path + ": read failed");
  return parse_hf_config(ss.str(), path);
}

}  // namespace keep::engine
