// Loading a GGUF file (llama.cpp's format, v3) into ModelConfig + ModelWeights + tokenizer.
//
// Architectures: general.architecture "llama" (LlamaForCausalLM) and "qwen2" (Qwen2ForCausalLM).
// Metadata -> config: {arch}.embedding_length -> hidden_size, .block_count -> num_layers,
// .feed_forward_length -> intermediate_size, .attention.head_count / .head_count_kv,
// .attention.key_length (head_dim, default hidden/heads), .attention.layer_norm_rms_epsilon,
// .rope.freq_base, .context_length; vocab size from the token_embd shape (and .vocab_size, when
// present, must agree); tied when output.weight is absent; attention_bias when blk.0.attn_q.bias
// exists. RoPE scaling other than none (.rope.scaling.type, or llama3 factors stored as a
// rope_freqs tensor) is refused: load the HF directory for such models.
//
// Tensors (ggml names) -> HF orientation: ggml's ne = [in, out] is exactly row-major [out, in],
// so no transposition. For "llama", llama.cpp's convert_hf_to_gguf.py permuted the rows of
// attn_q / attn_k for interleaved RoPE (per head: rows (0, hd/2, 1, hd/2+1, ...)); we apply the
// inverse so wq/wk match HF's half-split layout. "qwen2" files are not permuted.
//
// Tokenizer: tokenizer.ggml.model "gpt2" (byte-level BPE) -> keep::tok::BpeTokenizer from
// tokens + merges + token_type (CONTROL -> special added token, USER_DEFINED -> non-special);
// tokenizer.ggml.pre names the pre-tokenizer; bos/eos ids; tokenizer.chat_template.
#pragma once

#include <string>

#include "shared/common/status.h"
#include "shared/model/gguf_reader.h"
#include "shared/model/model_weights.h"
#include "shared/tokenizer/bpe_tokenizer.h"

namespace keep::engine {

// The config from a parsed file's metadata and tensor shapes.
Result<ModelConfig> gguf_model_config(const GgufFile& file);

// The tokenizer embedded in a parsed file (kNotFound when it has none, kInvalidArgument for a
// tokenizer model other than "gpt2").
Result<tok::BpeTokenizer> gguf_tokenizer(const GgufFile& file);

// Undoes llama.cpp's Q/K row permutation in place: `w` is [n_head*hd, cols] row-major.
void unpermute_rope_rows(float* w, int64_t n_head, int64_t head_dim, int64_t cols);

// Opens, validates and loads a whole file. Errors name the file and the tensor.
Result<LoadedModel> load_gguf_model(const std::string& path, const LoadOptions& options = {});

}  // namespace keep::engine
