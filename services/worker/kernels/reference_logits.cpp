// CPU references of the logits kernels (logits.cu): argmax, token_logprob, sample.
//
// sample's exact rule. The GPU kernel (logits.cu) reproduces it bit for bit: every quantity that
// decides which token is drawn is computed with the same IEEE operations on both sides (the
// exponential is our own fma polynomial, not the libm/CUDA expf, and the masses are integers), so
// tests compare the two for equality. For row r with logits l (vocab), temperature T, inv_t =
// 1.0f / T (rounded once, fp32):
//   mx    = the largest non-NaN logit (-inf when there is none);
//   y_i   = (l_i - mx) * inv_t (fp32);
//   p_i   = 0 for NaN l_i; 1 for l_i == mx; 0 for y_i < -28; else exp_neg(y_i) (below);
//   w_i   = floor(p_i * 2^40) as uint64: the token's mass in fixed point (tokens with p < 2^-40
//           have no mass), W = Σ w_i (exact; vocab < 2^24 so it fits in 64 bits).
//   W == 0 (an all-NaN row): token 0.
//   target = W when top_p >= 1, else min(W, max(1, ceil(double(top_p) * double(W)))).
//   Order the tokens by (logit desc, index asc) (NaN last, -0 == +0): the same order as
//   (p desc, index asc) except where two different logits round to the same p. Keep the shortest
//   prefix whose mass reaches target (at least one token), cut to top_k tokens when
//   0 < top_k < vocab. kept_mass = Σ w over the kept tokens.
//   t = floor(clamp(double(u), 0, 1 - 2^-24) * double(kept_mass)) (uint64); walk the kept tokens in
//   index order and return the first whose running mass exceeds t (the last kept one if none
//   does, which cannot happen for kept_mass > 0).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "services/worker/kernels/reference.h"

namespace keep::kernels::ref {
namespace {

constexpr float kMassScale = 0x1p40f;  // w = floor(p * 2^40)

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Order-preserving key of a logit: a < b (as floats) iff key(a) < key(b); -0 and +0 share a key
// and NaN gets 0, below -inf. Same function as logits.cu's order_key.
uint32_t order_key(float v) {
  if (std::isnan(v)) return 0u;
  uint32_t b = float_to_bits(v);
  if (b == 0x80000000u) b = 0u;
  return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}

// exp(y) for y in [-28, 0]: Cephes expf's range reduction and polynomial, written with explicit
// fmas so that the device (logits.cu's exp_neg, the same code) gives the same bits.
float exp_neg(float y) {
  const float k = std::rint(y * 1.44269504088896341f);  // in [-41, 0]
  float r = std::fma(k, -0.693359375f, y);
  r = std::fma(k, 2.12194440e-4f, r);
  float q = 1.9875691500e-4f;
  q = std::fma(q, r, 1.3981999507e-3f);
  q = std::fma(q, r, 8.3334519073e-3f);
  q = std::fma(q, r, 4.1665795894e-2f);
  q = std::fma(q, r, 1.6666665459e-1f);
  q = std::fma(q, r, 5.0000001201e-1f);
  q = std::fma(q, r, 1.0f);
  const float e = std::fma(q, r, 1.0f);  // 1 + r + r^2 P(r)
  const float scale = bits_to_float(static_cast<uint32_t>(127 + static_cast<int>(k)) << 23);
  return e * scale;
}

uint64_t token_mass(float l, float mx, float inv_t) {
  if (std::isnan(l)) return 0;
  if (l == mx) return static_cast<uint64_t>(kMassScale);
  const float y = (l - mx) * inv_t;
  if (!(y >= -28.0f)) return 0;
  return static_cast<uint64_t>(exp_neg(y) * kMassScale);
}

}  // namespace

void argmax(int32_t* out, const float* logits, int64_t rows, int64_t vocab) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * vocab;
    int64_t best = -1;
    for (int64_t i = 0; i < vocab; ++i) {
      if (std::isnan(row[i])) continue;
      if (best < 0 || row[i] > row[best]) best = i;
    }
    out[r] = static_cast<int32_t>(best < 0 ? 0 : best);
  }
}

void token_logprob(float* out, const float* logits, const int32_t* tokens, int64_t rows,
                   int64_t vocab) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * vocab;
    const int32_t tok = tokens[r];
    bool any_nan = false;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < vocab; ++i) {
      if (std::isnan(row[i])) {
        any_nan = true;
      } else {
        mx = std::max(mx, row[i]);
      }
    }
    if (tok < 0 || tok >= vocab || any_nan) {
      out[r] = nan;
      continue;
    }
    double lse = mx;  // an infinite max is the log-sum-exp itself
    if (std::isfinite(mx)) {
      double s = 0.0;
      for (int64_t i = 0; i < vocab; ++i) s += std::exp(static_cast<double>(row[i]) - mx);
      lse = mx + std::log(s);
    }
    out[r] = static_cast<float>(static_cast<double>(row[tok]) - lse);
  }
}

void sample(int32_t* out, const float* logits, const float* uniforms, int64_t rows, int64_t vocab,
            float temperature, float top_p, int32_t top_k) {
  const float inv_t = 1.0f / temperature;
  const int64_t k = (top_k > 0 && top_k < vocab) ? top_k : 0;
  std::vector<uint64_t> w(static_cast<size_t>(vocab));
  std::vector<uint32_t> key(static_cast<size_t>(vocab));
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * vocab;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < vocab; ++i) {
      if (!std::isnan(row[i]) && row[i] > mx) mx = row[i];
    }
    uint64_t total = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      w[i] = token_mass(row[i], mx, inv_t);
      key[i] = order_key(row[i]);
      total += w[i];
    }
    if (total == 0) {
      out[r] = 0;
      continue;
    }
    uint64_t target = total;
    if (top_p < 1.0f) {
      const double c = std::ceil(static_cast<double>(top_p) * static_cast<double>(total));
      target = std::min(total, std::max<uint64_t>(1, static_cast<uint64_t>(c)));
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return key[a] > key[b]; });
    int64_t kept = 0;
    uint64_t mass = 0;
    while (kept < vocab) {
      mass += w[order[kept]];
      ++kept;
      if (mass >= target) break;
    }
    if (k > 0) kept = std::min(kept, k);
    std::vector<int32_t> keep(order.begin(), order.begin() + kept);
    std::sort(keep.begin(), keep.end());
    uint64_t kept_mass = 0;
    for (int32_t i : keep) kept_mass += w[i];
    double u = uniforms[r];
    if (!(u > 0.0)) u = 0.0;
    u = std::min(u, static_cast<double>(0x1.fffffep-1f));
    const auto t = static_cast<uint64_t>(u * static_cast<double>(kept_mass));
    int32_t pick = keep.back();
    uint64_t run = 0;
    for (int32_t i : keep) {
      run += w[i];
      if (run > t) {
        pick = i;
        break;
      }
    }
    out[r] = pick;
  }
}

}  // namespace keep::kernels::ref
