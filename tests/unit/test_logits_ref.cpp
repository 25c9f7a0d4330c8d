// The CPU references of the logits kernels (reference_logits.cpp) against independent
// computations: argmax against a naive version of engine::argmax's rule, token_logprob against a
// double-precision log-softmax, and sample against the properties of its rule (top_k = 1 and a
// tiny top_p are greedy, the kept set is the top of the (logit desc, index asc) order, draws follow
// the softmax of the kept tokens, u = 0 gives the lowest-index kept token, monotone in u).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
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

int32_t sample_one(const std::vector<float>& l, float u, float temperature, float top_p,
                   int32_t top_k) {
  int32_t out = -1;
  ref::sample(&out, l.data(), &u, 1, static_cast<int64_t>(l.size()), temperature, top_p, top_k);
  return out;
}

// The kept set by the rule, in double: softmax of l / T, the shortest prefix of the (logit desc,
// index asc) order reaching top_p of the mass, cut to top_k. `margin` is how far the cumulative
// mass one token before the cut, and at the cut, lie from the target (relative to the total).
struct Kept {
  std::vector<int32_t> tokens;  // in order
  std::vector<double> prob;     // normalised over the kept tokens, by token id (0 elsewhere)
  double margin = 0.0;
};

Kept kept_set(const std::vector<float>& l, float temperature, float top_p, int32_t top_k) {
  const size_t n = l.size();
  double mx = -std::numeric_limits<double>::infinity();
  for (float v : l) {
    if (!std::isnan(v)) mx = std::max(mx, static_cast<double>(v));
  }
  std::vector<double> p(n, 0.0);
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isnan(l[i])) p[i] = std::exp((l[i] - mx) / temperature);
    total += p[i];
  }
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const bool na = std::isnan(l[a]), nb = std::isnan(l[b]);
    if (na || nb) return !na && nb;
    return l[a] > l[b];
  });
  Kept k;
  double cum = 0.0;
  size_t keep = 0;
  const double target = top_p >= 1.0f ? total : top_p * total;
  while (keep < n) {
    const double before = cum;
    cum += p[order[keep++]];
    if (cum >= target * (1.0 - 1e-12)) {
      k.margin = std::min(std::fabs(target - before), std::fabs(cum - target)) / total;
      break;
    }
  }
  if (top_p >= 1.0f) k.margin = 1.0;  // everything with mass is kept
  if (top_k > 0 && static_cast<size_t>(top_k) < keep) {
    keep = static_cast<size_t>(top_k);
    k.margin = 1.0;
  }
  k.tokens.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep));
  k.prob.assign(n, 0.0);
  double kept = 0.0;
  for (int32_t t : k.tokens) kept += p[t];
  for (int32_t t : k.tokens) k.prob[t] = p[t] / kept;
  return k;
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

TEST_CASE("ref::sample with top_k = 1 or a tiny top_p is argmax") {
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  for (size_t n : {1, 2, 3, 7, 19, 733, 5000}) {
    for (int rep = 0; rep < 6; ++rep) {
      auto l = normal_logits(rng, n, 3.0f);
      if (rep >= 3) {
        for (auto& x : l) x = std::round(x);  // ties, including at the max
        l[0] = kNan;
      }
      int32_t greedy = -1;
      ref::argmax(&greedy, l.data(), 1, static_cast<int64_t>(n));
      for (float t : {0.5f, 1.0f, 2.0f}) {
        for (int d = 0; d < 4; ++d) {
          const float u = d == 0 ? 0.0f : ud(rng);
          CHECK(sample_one(l, u, t, 1.0f, 1) == greedy);
          CHECK(sample_one(l, u, t, 1e-7f, 0) == greedy);
          CHECK(sample_one(l, u, t, 1e-7f, 40) == greedy);
        }
      }
    }
  }
  const std::vector<float> nan_row(5, kNan);
  CHECK(sample_one(nan_row, 0.5f, 1.0f, 0.9f, 0) == 0);
  const std::vector<float> minf_row = {kNan, -kInf, -kInf, -kInf};
  CHECK(sample_one(minf_row, 0.0f, 1.0f, 1.0f, 0) == 1);  // all -inf: uniform over them
  CHECK(sample_one(minf_row, 0.99f, 1.0f, 1.0f, 0) == 3);
  CHECK(sample_one(minf_row, 0.99f, 1.0f, 1.0f, 2) == 2);
}

TEST_CASE("ref::sample draws the kept tokens of the rule with the kept softmax probabilities") {
  std::mt19937 rng(14);
  int checked = 0;
  for (size_t n : {3, 7, 19, 733}) {
    // u = (j + 0.5) / grid: the frequencies are the probabilities +- 1/grid.
    const int grid = n > 100 ? 2000 : 20000;
    for (int rep = 0; rep < (n > 100 ? 2 : 3); ++rep) {
      auto l = normal_logits(rng, n, rep == 2 ? 1.0f : 3.0f);
      if (rep == 1 && n > 3) {
        l[1] = kNan;
        l[2] = -kInf;
        l[n - 1] = *std::max_element(l.begin() + 3, l.end());  // a tie with the max
      }
      for (float t : {0.5f, 1.0f, 2.0f}) {
        for (float top_p : {1.0f, 0.9f, 0.5f}) {
          for (int32_t top_k : {0, 3, 40}) {
            const Kept k = kept_set(l, t, top_p, top_k);
            if (k.margin < 1e-5) continue;  // the cut is too close to call in double vs fixed point
            ++checked;
            INFO("n " << n << " rep " << rep << " T " << t << " top_p " << top_p << " top_k "
                      << top_k);
            std::vector<float> u(static_cast<size_t>(grid));
            for (int j = 0; j < grid; ++j) u[j] = static_cast<float>((j + 0.5) / grid);
            std::vector<float> rows(static_cast<size_t>(grid) * n);
            for (int j = 0; j < grid; ++j) std::copy(l.begin(), l.end(), rows.begin() + j * n);
            std::vector<int32_t> tok(static_cast<size_t>(grid), -1);
            ref::sample(tok.data(), rows.data(), u.data(), grid, static_cast<int64_t>(n), t, top_p,
                        top_k);
            const bool in_range = std::all_of(tok.begin(), tok.end(), [&](int32_t v) {
              return v >= 0 && static_cast<size_t>(v) < n;
            });
            REQUIRE(in_range);
            CHECK(std::is_sorted(tok.begin(), tok.end()));  // monotone in u
            std::vector<int> count(n, 0);
            for (int32_t v : tok) ++count[v];
            // Every draw is a kept token, with its probability.
            double worst = 0.0;
            for (size_t i = 0; i < n; ++i) {
              worst = std::max(worst, std::fabs(count[i] / static_cast<double>(grid) - k.prob[i]));
            }
            CHECK(worst <= 1.0 / grid + 1e-5);
            // u = 0: the lowest-index kept token with mass; the largest u below 1: the highest.
            // (Tokens with p < 2^-40 have no mass, and the last 2^-24 of the mass is never drawn,
            // so compare through the probabilities of the kept tokens before / after the draw.)
            const int32_t lo = sample_one(l, 0.0f, t, top_p, top_k);
            const int32_t hi = sample_one(l, 0x1.fffffep-1f, t, top_p, top_k);
            REQUIRE(lo >= 0);
            REQUIRE(hi >= 0);
            CHECK(k.prob[lo] > 0.0);
            CHECK(k.prob[hi] > 0.0);
            double before_lo = 0.0;
            double after_hi = 0.0;
            for (size_t i = 0; i < n; ++i) {
              if (static_cast<int32_t>(i) < lo) before_lo += k.prob[i];
              if (static_cast<int32_t>(i) > hi) after_hi += k.prob[i];
            }
            CHECK(before_lo <= 1e-11);
            CHECK(after_hi <= 1.2e-7);
          }
        }
      }
    }
  }
  CHECK(checked > 150);
}

TEST_CASE("ref::sample breaks ties between equal logits by index") {
  // Ten equal logits: top_k = 3 keeps tokens 0, 1 and 2, equally likely.
  const std::vector<float> flat(10, 0.25f);
  std::set<int32_t> seen;
  std::vector<int> count(10, 0);
  const int grid = 3000;
  for (int j = 0; j < grid; ++j) {
    const int32_t t = sample_one(flat, static_cast<float>((j + 0.5) / grid), 1.0f, 1.0f, 3);
    seen.insert(t);
    ++count[t];
  }
  CHECK(seen == std::set<int32_t>{0, 1, 2});
  CHECK(count[0] == 1000);
  CHECK(count[1] == 1000);
  // top_p = 0.35 of ten equal tokens: four tokens reach it (3 would be 0.3).
  seen.clear();
  for (int j = 0; j < grid; ++j) {
    seen.insert(sample_one(flat, static_cast<float>((j + 0.5) / grid), 1.0f, 0.35f, 0));
  }
  CHECK(seen == std::set<int32_t>{0, 1, 2, 3});
  // Two tied maxima, top_k = 1: the lower index.
  const std::vector<float> two = {0.0f, 5.0f, 1.0f, 5.0f};
  CHECK(sample_one(two, 0.99f, 1.0f, 1.0f, 1) == 1);
  CHECK(sample_one(two, 0.99f, 1.0f, 1.0f, 2) == 3);
  // Rows are independent: the same logits, several rows, each its own uniform.
  std::vector<float> rows;
  for (int r = 0; r < 3; ++r) rows.insert(rows.end(), flat.begin(), flat.end());
  const std::vector<float> u = {0.0f, 0.55f, 0.999f};
  std::vector<int32_t> out(3, -1);
  ref::sample(out.data(), rows.data(), u.data(), 3, 10, 1.0f, 1.0f, 0);
  CHECK(out == std::vector<int32_t>{0, 5, 9});
}
