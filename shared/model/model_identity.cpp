#include "shared/model/model_identity.h"

#include <sys/stat.h>

#include <filesystem>

#include "shared/model/gguf_loader.h"
#include "shared/model/gguf_reader.h"
#include "shared/model/hf_loader.h"

namespace keep::engine {

namespace fs = std::filesystem;

Result<ModelIdentity> read_model_identity(const std::string& path) {
  std::error_code ec;
  ModelIdentity id;
  if (fs::is_directory(path, ec)) {
    id.format = "hf";
    KEEP_ASSIGN_OR_RETURN(id.config, load_hf_config(path + "/config.json"));
    KEEP_RETURN_IF_ERROR(read_hf_tokenizer(path, &id.tokenizer, &id.chat_template));
    id.name = fs::path(path).lexically_normal().filename().string();
    if (id.name.empty()) id.name = fs::path(path).lexically_normal().parent_path().filename();
    return id;
  }
  id.format = "gguf";
  KEEP_ASSIGN_OR_RETURN(auto file, GgufFile::open(path));
  KEEP_ASSIGN_OR_RETURN(id.config, gguf_model_config(*file));
  auto tok = gguf_tokenizer(*file);
  if (tok.is_ok()) {
    id.tokenizer.emplace(std::move(tok).value());
  } else if (tok.status().code() != Code::kNotFound) {
    return tok.status().with_context(path);
  }
  if (file->metadata().count("tokenizer.chat_template") > 0) {
    KEEP_ASSIGN_OR_RETURN(id.chat_template, file->get_string("tokenizer.chat_template"));
  }
  auto name = file->get_string("general.name");
  id.name = name.is_ok() ? *name : fs::path(path).stem().string();
  return id;
}

kv::ModelFingerprint kv_fingerprint(const ModelConfig& c, uint64_t tokenizer_fingerprint,
                                    kv::KvDType dtype, std::string_view name) {
  kv::ModelFingerprint fp;
  fp.num_layers = static_cast<uint32_t>(c.num_layers);
  fp.num_kv_heads = static_cast<uint32_t>(c.num_kv_heads);
  fp.head_dim = static_cast<uint32_t>(c.head_dim);
  fp.dtype = dtype;
  fp.rope_theta = c.rope_theta;
  if (c.rope_scaling.type == RopeScalingType::kLlama3) {
    fp.rope_scaling = kv::RopeScaling::kLlama3;
    fp.rope_scaling_factor = c.rope_scaling.factor;
    fp.rope_low_freq_factor = c.rope_scaling.low_freq_factor;
    fp.rope_high_freq_factor = c.rope_scaling.high_freq_factor;
    fp.rope_original_max_positions =
        static_cast<uint32_t>(c.rope_scaling.original_max_position_embeddings);
  }
  fp.tokenizer_hash = tokenizer_fingerprint;
  fp.set_model_name(name);
  return fp;
}

}  // namespace keep::engine
