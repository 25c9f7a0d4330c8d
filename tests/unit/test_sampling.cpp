// Greedy, temperature and nucleus sampling, and log-probabilities (sampling.h).
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <set>
#include <vector>

#include "services/worker/engine/core/sampling.h"

using namespace keep::engine;

TEST_CASE("argmax takes the first maximum and skips NaN") {
  CHECK(argmax(std::vector<float>{1, 3, 3, 2}) == 1);
  CHECK(argmax(std::vector<float>{NAN, -5, -7}) == 1);
  CHECK(argmax(std::vector<float>{-INFINITY, -INFINITY}) == 0);
  CHECK(argmax(std::vector<float>{}) == -1);
}

TEST_CASE("log_prob is a normalised log-softmax, stable for large logits") {
  const std::vector<float> l = {1000.0f, 1000.0f, 998.0f};
  const double z = 2.0 + std::exp(-2.0);
  CHECK(log_prob(l, 0) == doctest::Approx(-std::log(z)));
  CHECK(log_prob(l, 2) == doctest::Approx(-2.0 - std::log(z)));
  double total = 0.0;
  for (int32_t i = 0; i < 3; ++i) total += std::exp(log_prob(l, i));
  CHECK(total == doctest::Approx(1.0));
}

TEST_CASE("temperature 0 is greedy") {
  Sampler s({0.0f, 0.5f, 0, 1});
  CHECK(s.sample(std::vector<float>{0.1f, 2.0f, 1.9f}) == 1);
}

TEST_CASE("sampling follows the softmax at temperature 1 and is reproducible by seed") {
  const std::vector<float> l = {0.0f, std::log(2.0f), std::log(7.0f)};  // p = 0.1 0.2 0.7
  Sampler a({1.0f, 1.0f, 0, 42});
  Sampler b({1.0f, 1.0f, 0, 42});
  std::map<int32_t, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const int32_t t = a.sample(l);
    CHECK(t == b.sample(l));
    ++counts[t];
  }
  CHECK(counts[0] / double(n) == doctest::Approx(0.1).epsilon(0.1));
  CHECK(counts[1] / double(n) == doctest::Approx(0.2).epsilon(0.08));
  CHECK(counts[2] / double(n) == doctest::Approx(0.7).epsilon(0.03));
}

TEST_CASE("top-p keeps the smallest most-likely set reaching the mass; top-k caps it") {
  const std::vector<float> l = {std::log(0.05f), std::log(0.5f), std::log(0.3f), std::log(0.15f)};
  Sampler s({1.0f, 0.75f, 0, 3});
  std::set<int32_t> seen;
  for (int i = 0; i < 2000; ++i) seen.insert(s.sample(l));
  CHECK(seen == std::set<int32_t>{1, 2});
  CHECK(s.last_candidates() == std::vector<int32_t>{1, 2});
  Sampler k({1.0f, 1.0f, 1, 3});
  for (int i = 0; i < 50; ++i) CHECK(k.sample(l) == 1);
  // A large vocabulary with a flat tail: the nucleus grows past the first 64 sorted entries.
  std::vector<float> big(5000, 0.0f);
  Sampler wide({1.0f, 0.5f, 0, 9});
  wide.sample(big);
  CHECK(wide.last_candidates().size() == 2500);
  // Low temperature sharpens towards the argmax.
  Sampler cold({0.05f, 1.0f, 0, 5});
  for (int i = 0; i < 50; ++i) CHECK(cold.sample(l) == 1);
}
