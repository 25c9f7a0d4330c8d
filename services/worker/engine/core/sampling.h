// Picking the next token from logits, and log-probabilities for candidate scoring. Host code.
//
// Greedy is argmax with the lowest index winning ties (torch.argmax's rule, so greedy continuations
// match HF token for token). Sampling: logits / temperature, softmax, then nucleus (top-p) and
// optional top-k truncation, then a draw from a seeded std::mt19937_64, so a seed reproduces a
// continuation exactly.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace keep::engine {

struct SamplingParams {
  float temperature = 0.0f;  // <= 0: greedy
  float top_p = 1.0f;        // keep the smallest set of most likely tokens with mass >= top_p
  int32_t top_k = 0;         // > 0: also keep at most the k most likely
  uint64_t seed = 0;
};

// Index of the largest logit (first on ties); -1 for an empty span. NaN logits never win.
int32_t argmax(std::span<const float> logits);

// log Σ exp(logits), in double.
double log_sum_exp(std::span<const float> logits);

// log p(token) = logits[token] - log_sum_exp(logits); token must be in range.
double log_prob(std::span<const float> logits, int32_t token);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  const SamplingParams& params() const { return params_; }
  // The next token. logits must be non-empty.
  int32_t sample(std::span<const float> logits);

  // The tokens the last sample() drew from (after top-p / top-k), most likely first; for tests.
  const std::vector<int32_t>& last_candidates() const { return order_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<float> probs_;    // (vocab) scratch
  std::vector<int32_t> order_;  // indices kept, sorted by probability
};

}  // namespace keep::engine
