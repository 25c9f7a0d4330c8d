// ModelWeights: every weight of a Qwen2 / Llama model as dense fp32, in Hugging Face orientation.
//
// This is what the loaders produce (hf_loader.h for safetensors directories, gguf_loader.h for GGUF
// files, quantised types dequantised at load) and what the backends consume: the CPU backend reads
// it directly, the CUDA backend uploads from it. Orientation is HF nn.Linear: a projection from
// `in` to `out` features is a row-major [out, in] matrix, y = x W^T (+ b), i.e. gemm_nt.
//
// GGUF llama-architecture files store wq/wk with rows permuted for interleaved RoPE; the GGUF
// loader undoes that, so wq/wk here are always in HF's half-split ("rotate_half") layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "shared/common/status.h"
#include "shared/model/model_config.h"
#include "shared/tokenizer/bpe_tokenizer.h"

namespace keep::engine {

// A dense row-major fp32 tensor that owns its data. Empty (no shape, no data) means "absent".
struct Tensor {
  std::vector<float> data;
  std::vector<int64_t> shape;

  Tensor() = default;
  explicit Tensor(std::vector<int64_t> s);  // zero-filled

  bool empty() const { return data.empty(); }
  int64_t numel() const;  // product of shape (1 for a scalar shape {})
  int64_t dim(size_t i) const { return shape.at(i); }
  const float* ptr() const { return data.data(); }
  float* ptr() { return data.data(); }
  std::string shape_string() const;  // "[576, 576]"
};

// One transformer block. Shapes with H = num_heads, KV = num_kv_heads, hd = head_dim,
// C = hidden_size, I = intermediate_size.
struct LayerWeights {
  Tensor attn_norm;  // (C)             input_layernorm.weight
  Tensor wq;         // (H*hd, C)       self_attn.q_proj.weight
  Tensor wk;         // (KV*hd, C)      self_attn.k_proj.weight
  Tensor wv;         // (KV*hd, C)      self_attn.v_proj.weight
  Tensor bq;         // (H*hd)  or empty  self_attn.q_proj.bias  (config.attention_bias)
  Tensor bk;         // (KV*hd) or empty  self_attn.k_proj.bias
  Tensor bv;         // (KV*hd) or empty  self_attn.v_proj.bias
  Tensor wo;         // (C, H*hd)       self_attn.o_proj.weight
  Tensor bo;         // (C) or empty    self_attn.o_proj.bias   (config.o_proj_bias(): Llama only)
  Tensor ffn_norm;   // (C)             post_attention_layernorm.weight
  Tensor w_gate;     // (I, C)          mlp.gate_proj.weight
  Tensor w_up;       // (I, C)          mlp.up_proj.weight
  Tensor w_down;     // (C, I)          mlp.down_proj.weight
};

struct ModelWeights {
  ModelConfig config;
  Tensor embed;                      // (vocab, C)  model.embed_tokens.weight
  std::vector<LayerWeights> layers;  // config.num_layers of them
  Tensor final_norm;                 // (C)          model.norm.weight
  Tensor lm_head;                    // (vocab, C)   lm_head.weight; EMPTY when tied

  // The output projection: lm_head, or embed when the embeddings are tied.
  const Tensor& output_weight() const { return lm_head.empty() ? embed : lm_head; }

  // Checks every tensor's presence and shape against `config` (biases present iff the config says
  // so; lm_head empty iff tie_word_embeddings). kInvalidArgument naming the tensor
  // ("layers.3.wk has shape [..], expected [..]").
  Status validate() const;
  // Bytes of fp32 data held.
  size_t bytes() const;
};

// A model as the worker loads it: weights plus, when the source carries them, the tokenizer and the
// chat template (HF: tokenizer.json and tokenizer_config.json "chat_template"; GGUF: embedded).
struct LoadedModel {
  ModelWeights weights;
  std::optional<tok::BpeTokenizer> tokenizer;
  std::string chat_template;  // Jinja source, empty when none
  std::string source;         // the path loaded
  std::string format;         // "hf" or "gguf"
};

struct LoadOptions {
  bool load_tokenizer = true;  // false: skip tokenizer.json / the GGUF vocabulary
  int threads = 0;             // conversion threads; 0 = hardware concurrency
};

// Loads a HF directory (config.json + model.safetensors or a sharded index) or a .gguf file
// (decided by: a directory -> HF; otherwise the GGUF magic). Errors name the file and the tensor.
Result<LoadedModel> load_model(const std::string& path, const LoadOptions& options = {});

namespace detail {
// Runs job(0..n-1) on up to `threads` threads (0 = hardware concurrency); returns the first
// failure (by index) or ok. Used by the loaders to convert tensors in parallel.
Status run_parallel(size_t n, int threads, const std::function<Status(size_t)>& job);
}  // namespace detail

}  // namespace keep::engine
