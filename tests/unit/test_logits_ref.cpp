// The CPU references of the logits kernels (reference_logits.cpp) against independent
// computations: argmax against a naive version of engine::argmax's rule, token_logprob against a
// double-precision log-softmax.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "services/worker/kernels/reference.h"

namespace {

namespace ref = keep::kernels::ref;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> normal_logits(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// engine::argmax's rule, written as a scan that keeps the first strict maximum.
int32_t naive_argmax(const std::vector<float>& l) {
  int32_t best = -1;
  for (size_t i = 0; i < l.size(); ++i) {
    if (std::isnan(l[i])) continue;
    if (best == -1 || l[i] > l[static_cast<size_t>(best)]) best = static_cast<int32_t>(i);
  }
  return best == -1 ? 0 : best;
}

}  // namespace

TEST_CASE("ref::argmax follows engine::argmax's rule: first maximum, NaN never wins") {
  std::mt19937 rng(11);
  for (size_t n : {1, 2, 3, 7, 19, 733, 5000}) {
    for (int rep = 0; rep < 8; ++rep) {
      auto l = normal_logits(rng, n, 3.0f);
      std::uniform_int_distribution<size_t> pos(0, n - 1);
      if (rep % 2 == 1) {  // ties, NaN and -inf
        for (size_t j = 0; j < 1 + n / 10; ++j) l[pos(rng)] = std::round(l[pos(rng)]);
        l[pos(rng)] = kNan;
        l[pos(rng)] = -kInf;
        const float mx = *std::max_element(
            l.begin(), l.end(), [](float a, float b) { return !(a >= b) && !std::isnan(b); });
        l[pos(rng)] = mx;
      }
      int32_t got = -1;
      ref::argmax(&got, l.data(), 1, static_cast<int64_t>(n));
      CHECK(got == naive_argmax(l));
    }
  }
  const std::vector<std::vector<float>> rows = {{1, 3, 3, 2},
                                                {kNan, -5, -7},
                                                {-kInf, -kInf},
                                                {kNan, kNan, kNan},
                                                {kNan, -kInf, 2, kInf, kInf}};
  const std::vector<int32_t> want = {1, 1, 0, 0, 3};
  for (size_t r = 0; r < rows.size(); ++r) {
    int32_t got = -1;
    ref::argmax(&got, rows[r].data(), 1, static_cast<int64_t>(rows[r].size()));
    CHECK(got == want[r]);
    CHECK(got == naive_argmax(rows[r]));
  }
  // Several rows at once.
  std::vector<float> flat = {0, 1, 2, 5, 4, 3, kNan, kNan, kNan};
  std::vector<int32_t> out(3, -1);
  ref::argmax(out.data(), flat.data(), 3, 3);
  CHECK(out == std::vector<int32_t>{2, 0, 0});
}

TEST_CASE("ref::token_logprob is a log-softmax; NaN for a bad token or a NaN row") {
  std::mt19937 rng(12);
  for (size_t n : {1, 3, 7, 19, 733, 49152}) {
    const int64_t rows = 3;
    auto l = normal_logits(rng, n * rows, n > 1000 ? 10.0f : 3.0f);
    std::vector<int32_t> tokens(rows);
    std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(n - 1));
    for (auto& t : tokens) t = tok(rng);
    std::vector<float> out(rows, 0.0f);
    ref::token_logprob(out.data(), l.data(), tokens.data(), rows, static_cast<int64_t>(n));
    for (int64_t r = 0; r < rows; ++r) {
      // log p_t = -log Σ_i exp(l_i - l_t), summed in long double.
      long double s = 0.0L;
      for (size_t i = 0; i < n; ++i) {
        s += std::exp(static_cast<long double>(l[r * n + i]) - l[r * n + tokens[r]]);
      }
      const double want = -static_cast<double>(std::log(s));
      INFO("n " << n << " row " << r);
      CHECK(out[r] == doctest::Approx(want).epsilon(1e-6).scale(1.0));
    }
  }
  // Probabilities sum to one.
  const auto l = normal_logits(rng, 101, 4.0f);
  std::vector<int32_t> tokens(101);
  std::iota(tokens.begin(), tokens.end(), 0);
  std::vector<float> rows(101 * 101);
  for (size_t r = 0; r < 101; ++r) std::copy(l.begin(), l.end(), rows.begin() + r * 101);
  std::vector<float> out(101);
  ref::token_logprob(out.data(), rows.data(), tokens.data(), 101, 101);
  double total = 0.0;
  for (float v : out) total += std::exp(static_cast<double>(v));
  CHECK(total == doctest::Approx(1.0).epsilon(1e-5));
  // Stable for large logits; bad tokens and NaN rows give NaN; an infinite max gives l - inf.
  const std::vector<float> big = {1000.0f, 1000.0f, 998.0f};
  const int32_t t2 = 2;
  float v = 0.0f;
  ref::token_logprob(&v, big.data(), &t2, 1, 3);
  CHECK(v == doctest::Approx(-2.0 - std::log(2.0 + std::exp(-2.0))).epsilon(1e-6));
  for (int32_t bad : {-1, 3}) {
    ref::token_logprob(&v, big.data(), &bad, 1, 3);
    CHECK(std::isnan(v));
  }
  const std::vector<float> with_nan = {1.0f, kNan, 2.0f};
  const int32_t t0 = 0;
  ref::token_logprob(&v, with_nan.data(), &t0, 1, 3);
  CHECK(std::isnan(v));
  const std::vector<float> with_inf = {1.0f, kInf, 2.0f};
  ref::token_logprob(&v, with_inf.data(), &t0, 1, 3);
  CHECK(v == -kInf);
  const std::vector<float> with_minf = {-kInf, 0.0f, 0.0f};
  ref::token_logprob(&v, with_minf.data(), &t0, 1, 3);
  CHECK(v == -kInf);
}
