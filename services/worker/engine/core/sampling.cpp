#include "services/worker/engine/core/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "shared/common/status.h"

namespace keep::engine {

int32_t argmax(std::span<const float> logits) {
  int32_t best = -1;
  float best_v = 0.0f;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float v = logits[i];
    if (std::isnan(v)) continue;
    if (best < 0 || v > best_v) {
      best = static_cast<int32_t>(i);
      best_v = v;
    }
  }
  if (best < 0 && !logits.empty()) best = 0;  // all NaN
  return best;
}

double log_sum_exp(std::span<const float> logits) {
  double mx = -INFINITY;
  for (float v : logits) mx = std::max(mx, static_cast<double>(v));
  if (!std::isfinite(mx)) return mx;
  double s = 0.0;
  for (float v : logits) s += std::exp(static_cast<double>(v) - mx);
  return mx + std::log(s);
}

double log_prob(std::span<const float> logits, int32_t token) {
  KEEP_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size());
  return static_cast<double>(logits[token]) - log_sum_exp(logits);
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

int32_t Sampler::sample(std::span<const float> logits) {
  KEEP_CHECK(!logits.empty());
  order_.clear();
  if (params_.temperature <= 0.0f) {
    order_.push_back(argmax(logits));
    return order_[0];
  }
  const size_t n = logits.size();
  float mx = -INFINITY;
  for (float v : logits) {
    if (!std::isnan(v)) mx = std::max(mx, v);
  }
  probs_.resize(n);
  double total = 0.0;
  const float inv_t = 1.0f / params_.temperature;
  for (size_t i = 0; i < n; ++i) {
    const float v = logits[i];
    probs_[i] = std::isnan(v) ? 0.0f : std::exp((v - mx) * inv_t);
    total += probs_[i];
  }
  const double top_p = std::clamp(static_cast<double>(params_.top_p), 0.0, 1.0);
  const size_t top_k = params_.top_k > 0 ? std::min<size_t>(params_.top_k, n) : n;
  auto more_likely = [&](int32_t a, int32_t b) {
    return probs_[a] > probs_[b] || (probs_[a] == probs_[b] && a < b);
  };
  // Sort only as many of the most likely tokens as the nucleus needs: 64, 256, 1024, ..., all.
  std::vector<int32_t>& idx = order_;
  size_t k = std::min<size_t>(64, top_k);
  size_t keep = 0;
  double kept_mass = 0.0;
  for (;;) {
    idx.resize(n);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + static_cast<ptrdiff_t>(k), idx.end(), more_likely);
    keep = 0;
    kept_mass = 0.0;
    while (keep < k) {
      kept_mass += probs_[idx[keep]];
      ++keep;
      if (kept_mass >= top_p * total) break;
    }
    if (kept_mass >= top_p * total || k >= top_k) break;
    k = std::min(k * 4, top_k);
  }
  idx.resize(keep);
  std::uniform_real_distribution<double> uni(0.0, kept_mass);
  const double u = uni(rng_);
  double acc = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    acc += probs_[idx[i]];
    if (u < acc) return idx[i];
  }
  return idx[keep - 1];
}

}  // namespace keep::engine
