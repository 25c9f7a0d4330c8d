#include "shared/model/model_weights.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>

#include "shared/model/gguf_loader.h"
#include "shared/model/hf_loader.h"

namespace keep::engine {

Tensor::Tensor(std::vector<int64_t> s) : shape(std::move(s)) {
  data.assign(static_cast<size_t>(numel()), 0.0f);
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string Tensor::shape_string() const {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

namespace {

Status check_tensor(const Tensor& t, const std::string& name, const std::vector<int64_t>& want) {
  if (t.empty()) return Status(Code::kInvalidArgument, "model weights: " + name + " is missing");
  Tensor probe;
  probe.shape = want;
  if (t.shape != want || static_cast<int64_t>(t.data.size()) != probe.numel()) {
    return Status(Code::kInvalidArgument, "model weights: " + name + " has shape " +
                                              t.shape_string() + ", expected " +
                                              probe.shape_string());
  }
  return Status::ok();
}

Status check_optional(const Tensor& t, const std::string& name, bool expected,
                      const std::vector<int64_t>& want) {
  if (!expected) {
    if (!t.empty()) {
      return Status(Code::kInvalidArgument,
                    "model weights: " + name + " is present but the config has no such bias");
    }
    return Status::ok();
  }
  return check_tensor(t, name, want);
}

}  // namespace

Status ModelWeights::validate() const {
  KEEP_RETURN_IF_ERROR(config.validate());
  const ModelConfig& c = config;
  const int64_t C = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  KEEP_RETURN_IF_ERROR(check_tensor(embed, "embed", {c.vocab_size, C}));
  KEEP_RETURN_IF_ERROR(check_tensor(final_norm, "final_norm", {C}));
  if (c.tie_word_embeddings) {
    if (!lm_head.empty()) {
      return Status(Code::kInvalidArgument,
                    "model weights: lm_head must be empty when tie_word_embeddings is set");
    }
  } else {
    KEEP_RETURN_IF_ERROR(check_tensor(lm_head, "lm_head", {c.vocab_size, C}));
  }
  if (static_cast<int64_t>(layers.size()) != c.num_layers) {
    return Status(Code::kInvalidArgument, "model weights: " + std::to_string(layers.size()) +
                                              " layers, config says " +
                                              std::to_string(c.num_layers));
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerWeights& l = layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    KEEP_RETURN_IF_ERROR(check_tensor(l.attn_norm, p + "attn_norm", {C}));
    KEEP_RETURN_IF_ERROR(check_tensor(l.wq, p + "wq", {Q, C}));
    KEEP_RETURN_IF_ERROR(check_tensor(l.wk, p + "wk", {KV, C}));
    KEEP_RETURN_IF_ERROR(check_tensor(l.wv, p + "wv", {KV, C}));
    KEEP_RETURN_IF_ERROR(check_optional(l.bq, p + "bq", c.attention_bias, {Q}));
    KEEP_RETURN_IF_ERROR(check_optional(l.bk, p + "bk", c.attention_bias, {KV}));
    KEEP_RETURN_IF_ERROR(check_optional(l.bv, p + "bv", c.attention_bias, {KV}));
    KEEP_RETURN_IF_ERROR(check_tensor(l.wo, p + "wo", {C, Q}));
    KEEP_RETURN_IF_ERROR(check_optional(l.bo, p + "bo", c.o_proj_bias(), {C}));
    KEEP_RETURN_IF_ERROR(check_tensor(l.ffn_norm, p + "ffn_norm", {C}));
    KEEP_RETURN_IF_ERROR(check_tensor(l.w_gate, p + "w_gate", {I, C}));
    KEEP_RETURN_IF_ERROR(check_tensor(l.w_up, p + "w_up", {I, C}));
    KEEP_RETURN_IF_ERROR(check_tensor(l.w_down, p + "w_down", {C, I}));
  }
  return Status::ok();
}

size_t ModelWeights::bytes() const {
  size_t n = embed.data.size() + final_norm.data.size() + lm_head.data.size();
  for (const LayerWeights& l : layers) {
    for (const Tensor* t : {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.bq, &l.bk, &l.bv, &l.wo, &l.bo,
                            &l.ffn_norm, &l.w_gate, &l.w_up, &l.w_down}) {
      n += t->data.size();
    }
  }
  return n * sizeof(float);
}

Result<LoadedModel> load_model(const std::string& path, const LoadOptions& options) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status(Code::kIoError, path + ": cannot stat: " + std::strerror(errno));
  }
  if (S_ISDIR(st.st_mode)) return load_hf_model(path, options);
  // A file: GGUF by its magic.
  char magic[4] = {};
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status(Code::kIoError, path + ": cannot open: " + std::strerror(errno));
  const ssize_t got = ::read(fd, magic, sizeof(magic));
  ::close(fd);
  if (got == 4 && std::memcmp(magic, "GGUF", 4) == 0) return load_gguf_model(path, options);
  return Status(Code::kInvalidArgument,
                path + ": neither a model directory (config.json + safetensors) nor a GGUF file");
}

namespace detail {

Status run_parallel(size_t n, int threads, const std::function<Status(size_t)>& job) {
  size_t workers = threads > 0 ? static_cast<size_t>(threads)
                               : std::max(1u, std::thread::hardware_concurrency());
  workers = std::min(workers, n);
  std::vector<Status> results(n);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  auto worker = [&] {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= n || failed.load()) return;
      results[i] = job(i);
      if (!results[i].is_ok()) failed.store(true);
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < workers; ++t) pool.emplace_back(worker);
  if (workers > 0) worker();
  for (auto& th : pool) th.join();
  for (Status& s : results) {
    if (!s.is_ok()) return s;
  }
  return Status::ok();
}

}  // namespace detail

}  // namespace keep::engine
