// The two text services the memory store is given: a sentence embedder and a token counter.
//
// The real implementations are the BERT encoder (services/manager/encoder) and the model's BPE
// tokenizer (shared/tokenizer); unit tests use small fixed implementations. The store never owns
// them; they must outlive it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"

namespace keep::manager {

// Turns texts into fixed-size vectors. The store L2-normalises what it receives, so the embedder
// need not (a zero vector is kept as zero: cosine 0 with everything). embed() may be called from
// several threads at once (keep-manager's background embedder and its retrieve threads), without
// the store's lock.
class Embedder {
 public:
  virtual ~Embedder() = default;
  // Length of every vector embed() returns (384 for all-MiniLM-L6-v2).
  virtual int dim() const = 0;
  // One vector of dim() floats per text, in order. An error fails the whole batch.
  virtual Result<std::vector<std::vector<float>>> embed(const std::vector<std::string>& texts) = 0;
};

// Counts the tokens a text takes in the LLM's prompt (the model's tokenizer, no special tokens).
// Must be deterministic; it is called on the write path, so it should be cheap.
class TokenCounter {
 public:
  virtual ~TokenCounter() = default;
  virtual uint32_t count_tokens(std::string_view text) const = 0;
};

}  // namespace keep::manager
