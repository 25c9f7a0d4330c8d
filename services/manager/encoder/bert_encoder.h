// BertEncoder: sentence embeddings from a BERT-family sentence-transformers directory (the
// manager's default is all-MiniLM-L6-v2, 384-d), fp32 on the CPU, matrix products in OpenBLAS.
//
// What is read from the directory:
//   config.json                 BertModel shape (hidden, layers, heads, intermediate, eps, act)
//   model.safetensors           the weights (or sharded, via model.safetensors.index.json);
//                               F32/F16/BF16, converted to fp32 at load; names with or without
//                               the "bert." prefix
//   tokenizer.json | vocab.txt  WordPiece (see wordpiece_tokenizer.h)
//   modules.json                Transformer at "", then Pooling, then optionally Normalize;
//                               any other module (Dense, ...) is refused with a clear error
//   <pooling>/config.json       exactly one of mean / cls / max / mean_sqrt_len
//   sentence_bert_config.json   max_seq_length (truncation, [CLS] and [SEP] included),
//   do_lower_case
//
// Forward, per batch: embeddings (word + position + token type 0) -> LayerNorm -> N x [fused QKV
// projection, per-sequence per-head softmax(Q K^T / sqrt(d)) V, output projection, residual +
// LayerNorm, FFN with GELU, residual + LayerNorm] -> pooling over the sequence's tokens -> L2
// normalisation (when modules.json has Normalize).
//
// Batching is padding-free ("varlen" packing): the tokens of all sequences of a batch are stacked
// into one (total_tokens, hidden) matrix for every per-token product, and attention runs per
// sequence over that sequence's own tokens. This computes exactly what padding to the longest
// sequence with an attention mask computes (a masked key gets probability 0), without spending
// work on pad rows. A long input list is split into chunks of at most max_batch_tokens tokens.
//
// Threads: OpenBLAS's own setting (OPENBLAS_NUM_THREADS); never changed here.
// encode() is const and allocates its own scratch: several threads may call it at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "services/manager/encoder/wordpiece_tokenizer.h"
#include "shared/common/status.h"

namespace keep::manager {

struct BertConfig {
  int vocab_size = 0;
  int hidden = 0;  // H
  int layers = 0;
  int heads = 0;          // H / heads = head dim D
  int intermediate = 0;   // I
  int max_positions = 0;  // P
  int type_vocab_size = 0;
  float layer_norm_eps = 1e-12f;
  bool gelu_tanh = false;  // false: exact GELU (erf), "gelu"; true: "gelu_new" / tanh approximation
};

// Parses a BERT config.json text (`where` names the file in messages): model_type "bert", the
// shape fields as integers in range, hidden_act gelu / gelu_new, absolute positions.
// kMalformed when it is not JSON, kInvalidArgument for anything missing, mistyped or unsupported.
Result<BertConfig> parse_bert_config(std::string_view json_text, const std::string& where);

enum class PoolingMode { kMean, kCls, kMax, kMeanSqrtLen };

struct EncoderOptions {
  // Upper bound on the tokens of one forward pass (memory: about 12 KiB of scratch per token
  // for MiniLM, plus seq_len^2 floats for one attention matrix).
  size_t max_batch_tokens = 8192;
};

class BertEncoder {
 public:
  // Loads a sentence-transformers directory. kNotFound / kInvalidArgument / kMalformed with a
  // message naming the file and what is wrong (a missing directory, an unsupported architecture,
  // pooling mode or module, a tensor of the wrong shape ...).
  static Result<std::unique_ptr<BertEncoder>> load(const std::string& dir,
                                                   const EncoderOptions& options = {});
  ~BertEncoder();

  // Embeddings of `texts`, one vector of dim() floats each, in order (unit length when the model
  // normalises). Texts are truncated to max_seq_length() tokens. The empty string is valid: it
  // encodes as [CLS] [SEP], as sentence-transformers does.
  Result<std::vector<std::vector<float>>> encode(const std::vector<std::string>& texts) const;
  // The same from token ids ([CLS] ... [SEP] included). kInvalidArgument for an empty sequence,
  // one longer than the position table, or an id outside the vocabulary.
  Result<std::vector<std::vector<float>>> encode_ids(
      const std::vector<std::vector<int32_t>>& ids) const;

  int dim() const { return config_.hidden; }
  size_t max_seq_length() const { return max_seq_length_; }
  PoolingMode pooling() const { return pooling_; }
  bool normalizes() const { return normalize_; }
  const BertConfig& config() const { return config_; }
  const WordPieceTokenizer& tokenizer() const { return *tokenizer_; }

 private:
  struct Weights;
  BertEncoder();
  // One forward pass over a packed batch: `ids` holds the tokens of every sequence back to back,
  // `lens[b]` the length of sequence b. Writes one dim() vector per sequence into `out`.
  void forward(const std::vector<int32_t>& ids, const std::vector<int>& lens,
               std::vector<std::vector<float>>* out) const;

  BertConfig config_;
  PoolingMode pooling_ = PoolingMode::kMean;
  bool normalize_ = true;
  size_t max_seq_length_ = 0;
  EncoderOptions options_;
  std::unique_ptr<WordPieceTokenizer> tokenizer_;
  std::unique_ptr<Weights> w_;
};

}  // namespace keep::manager
