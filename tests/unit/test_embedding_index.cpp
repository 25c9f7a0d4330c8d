// EmbeddingIndex: the int8 kernel against its portable reference, the quantisation bound, and the
// int8-scan top-k against a brute-force fp32 ranking written here (identical ids, order and scores)
// on random and adversarial data: near-ties, duplicates, zero vectors, d not a multiple of 32,
// ineligible rows, rows removed and moved.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>

#include <cblas.h>

#include "services/manager/store/embedding_index.h"

using namespace keep::manager;

namespace {

std::vector<float> random_unit(std::mt19937& rng, size_t dim) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> v(dim);
  double s = 0.0;
  for (float& x : v) {
    x = n(rng);
    s += static_cast<double>(x) * x;
  }
  for (float& x : v) x = static_cast<float>(x / std::sqrt(s));
  return v;
}

// The reference: every eligible row scored in double, rounded to float, sorted by (score desc,
// key asc). Written independently of the index's selection code.
struct Ref {
  uint64_t key;
  float score;
};
std::vector<Ref> brute_force(const std::vector<std::vector<float>>& vecs,
                             const std::vector<uint64_t>& keys, const std::vector<bool>& eligible,
                             const std::vector<float>& q, size_t k) {
  std::vector<Ref> all;
  for (size_t i = 0; i < vecs.size(); ++i) {
    if (!eligible[i]) continue;
    double acc[4] = {0, 0, 0, 0};
    size_t j = 0;
    for (; j + 4 <= q.size(); j += 4) {
      for (size_t l = 0; l < 4; ++l) acc[l] += double(vecs[i][j + l]) * double(q[j + l]);
    }
    for (; j < q.size(); ++j) acc[0] += double(vecs[i][j]) * double(q[j]);
    all.push_back(Ref{keys[i], static_cast<float>((acc[0] + acc[1]) + (acc[2] + acc[3]))});
  }
  std::sort(all.begin(), all.end(), [](const Ref& a, const Ref& b) {
    return a.score != b.score ? a.score > b.score : a.key < b.key;
  });
  if (all.size() > k) all.resize(k);
  return all;
}

// A mirror of the index's rows (vectors by row) to build the reference from.
struct Fixture {
  explicit Fixture(size_t d) : dim(d), index(static_cast<int>(d)) {}
  void add(uint64_t key, const std::vector<float>& v, bool eligible = true) {
    REQUIRE(index.append(key, v.data(), eligible) == vecs.size());
    vecs.push_back(v);
    keys.push_back(key);
    elig.push_back(eligible);
  }
  void remove(size_t row) {
    auto moved = index.swap_remove(row);
    if (row + 1 != vecs.size()) {
      REQUIRE(moved.has_value());
      CHECK(*moved == keys.back());
      vecs[row] = vecs.back();
      keys[row] = keys.back();
      elig[row] = elig.back();
    } else {
      CHECK_FALSE(moved.has_value());
    }
    vecs.pop_back();
    keys.pop_back();
    elig.pop_back();
  }
  // Checks top_k == brute force for `q`; returns the candidate count.
  size_t check(const std::vector<float>& q, size_t k) {
    std::vector<ScoredRow> got;
    TopKStats st;
    index.top_k(q.data(), k, &scratch, &got, &st);
    const std::vector<Ref> want = brute_force(vecs, keys, elig, q, k);
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      CHECK(index.key(got[i].row) == want[i].key);
      CHECK(got[i].score == want[i].score);  // bit-equal: the same exact score
    }
    CHECK(st.candidates >= got.size());
    CHECK(st.candidates <= st.eligible);
    return st.candidates;
  }
  size_t dim;
  EmbeddingIndex index;
  TopKScratch scratch;
  std::vector<std::vector<float>> vecs;
  std::vector<uint64_t> keys;
  std::vector<bool> elig;
};

}  // namespace

TEST_CASE("int8 row kernel equals the portable reference on odd sizes") {
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> u(-127, 127);
  MESSAGE("dot_i8_rows uses AVX2: " << dot_i8_rows_uses_avx2());
  for (size_t n : {1, 3, 4, 7, 19, 733}) {
    for (size_t stride : {32, 64, 384, 416}) {
      std::vector<int8_t> rows(n * stride), q(stride);
      for (auto& x : rows) x = static_cast<int8_t>(u(rng));
      for (auto& x : q) x = static_cast<int8_t>(u(rng));
      if (n == 7) std::fill(rows.begin(), rows.begin() + static_cast<long>(stride), int8_t{127});
      if (n == 7) std::fill(q.begin(), q.end(), int8_t{-127});  // extreme products, no saturation
      std::vector<int32_t> got(n, -1), want(n, -2);
      dot_i8_rows(got.data(), rows.data(), q.data(), n, stride);
      dot_i8_rows_portable(want.data(), rows.data(), q.data(), n, stride);
      CHECK(got == want);
      if (n == 7) CHECK(want[0] == -127 * 127 * static_cast<int32_t>(stride));
    }
  }
}

TEST_CASE("quantisation: codes in range, bound (1) holds, zero vectors") {
  std::mt19937 rng(2);
  for (size_t dim : {1, 5, 383, 384}) {
    const size_t stride = (dim + 31) / 32 * 32;
    std::vector<int8_t> qx(stride, 9), qy(stride, 9);
    for (int t = 0; t < 200; ++t) {
      auto x = random_unit(rng, dim), y = random_unit(rng, dim);
      const QuantisedNorms nx = quantise_i8(x.data(), dim, qx.data(), stride);
      const QuantisedNorms ny = quantise_i8(y.data(), dim, qy.data(), stride);
      int32_t dot = 0;
      double exact = 0.0;
      for (size_t j = 0; j < stride; ++j) {
        CHECK(qx[j] >= -127);
        if (j >= dim) CHECK(qx[j] == 0);
        dot += qx[j] * qy[j];
      }
      for (size_t j = 0; j < dim; ++j) exact += double(x[j]) * y[j];
      const double approx = double(nx.scale) * ny.scale * dot;
      const double bound = double(nx.err_norm) * ny.norm + double(nx.q_norm) * ny.err_norm;
      CHECK(std::fabs(exact - approx) <= bound);
      CHECK(nx.norm >= 1.0f - 1e-6f);
    }
  }
  std::vector<float> zero(383, 0.0f);
  std::vector<int8_t> q(384, 5);
  const QuantisedNorms n = quantise_i8(zero.data(), 383, q.data(), 384);
  CHECK(n.scale == 0.0f);
  CHECK(n.norm == 0.0f);
  CHECK(n.err_norm == 0.0f);
  CHECK(std::all_of(q.begin(), q.end(), [](int8_t v) { return v == 0; }));
}

TEST_CASE("top_k equals brute force on random unit vectors (d = 384 and 383)") {
  for (size_t dim : {384, 383}) {
    std::mt19937 rng(static_cast<uint32_t>(dim));
    Fixture f(dim);
    const size_t n = 3000;
    for (size_t i = 0; i < n; ++i) f.add(1000 + (i * 7919) % 100003, random_unit(rng, dim));
    size_t cand = 0, queries = 0;
    for (size_t k : {1, 8, 16, 100}) {
      for (int t = 0; t < 40; ++t) {
        cand += f.check(random_unit(rng, dim), k);
        ++queries;
      }
    }
    // Queries near an existing row (the realistic case: a few strong matches).
    for (int t = 0; t < 40; ++t) {
      auto q = f.vecs[static_cast<size_t>(t) * 31];
      std::normal_distribution<float> nz(0.0f, 0.02f);
      for (float& x : q) x += nz(rng);
      cand += f.check(q, 8);
      ++queries;
    }
    MESSAGE("d=" << dim << " n=" << n << ": mean candidates rescored per query "
                 << double(cand) / double(queries));
  }
}

TEST_CASE("top_k equals brute force on adversarial data") {
  const size_t dim = 383;
  std::mt19937 rng(7);
  Fixture f(dim);
  const auto base = random_unit(rng, dim);
  uint64_t key = 500;
  // Exact duplicates (ties broken by key), inserted with descending keys.
  for (int i = 0; i < 50; ++i) f.add(key--, base);
  // Near-ties: base perturbed in one component by a few ulps.
  for (int i = 0; i < 200; ++i) {
    auto v = base;
    const size_t j = static_cast<size_t>(i) % dim;
    for (int u = 0; u < i % 5; ++u) v[j] = std::nextafter(v[j], 1.0f);
    f.add(10'000 + static_cast<uint64_t>(i), v);
  }
  // Zero vectors, one-hot vectors, negated copies, and unnormalised vectors.
  for (int i = 0; i < 30; ++i) f.add(20'000 + static_cast<uint64_t>(i), std::vector<float>(dim));
  for (size_t j = 0; j < 60; ++j) {
    std::vector<float> v(dim, 0.0f);
    v[j * 5] = j % 2 == 0 ? 1.0f : -1.0f;
    f.add(30'000 + j, v);
  }
  for (int i = 0; i < 40; ++i) {
    auto v = base;
    for (float& x : v) x = -x;
    f.add(40'000 + static_cast<uint64_t>(i), v);
  }
  for (int i = 0; i < 400; ++i) {
    auto v = random_unit(rng, dim);
    const float scale = i % 3 == 0 ? 1e-3f : (i % 3 == 1 ? 7.5f : 1.0f);
    for (float& x : v) x *= scale;
    f.add(50'000 + static_cast<uint64_t>(i), v, /*eligible=*/i % 10 != 0);
  }
  // Ineligible copies of the base: they would win every tie but must never be returned.
  for (int i = 0; i < 10; ++i) f.add(1 + static_cast<uint64_t>(i), base, false);

  std::vector<std::vector<float>> queries = {base, std::vector<float>(dim, 0.0f)};
  for (size_t j = 0; j < 4; ++j) {
    std::vector<float> v(dim, 0.0f);
    v[j * 5] = 1.0f;
    queries.push_back(v);
  }
  for (int t = 0; t < 30; ++t) queries.push_back(random_unit(rng, dim));
  for (int t = 0; t < 10; ++t) {
    auto q = base;
    q[static_cast<size_t>(t)] += 1e-4f;
    queries.push_back(q);
  }
  for (size_t k : {1, 7, 49, 50, 51, 260, 2000}) {
    for (const auto& q : queries) f.check(q, k);
  }
  // Remove rows (moving the last into their place) and check again.
  for (int i = 0; i < 120; ++i) f.remove((static_cast<size_t>(i) * 37) % f.vecs.size());
  for (size_t k : {1, 8, 64}) {
    for (const auto& q : queries) f.check(q, k);
  }
  // Everything removed.
  while (!f.vecs.empty()) f.remove(0);
  std::vector<ScoredRow> out{ScoredRow{}};
  f.index.top_k(base.data(), 5, &f.scratch, &out);
  CHECK(out.empty());
}

TEST_CASE("k = 0, no rows, fewer eligible rows than k") {
  Fixture f(3);
  std::vector<ScoredRow> out;
  const std::vector<float> q = {1.0f, 0.0f, 0.0f};
  f.index.top_k(q.data(), 4, &f.scratch, &out);
  CHECK(out.empty());
  f.add(9, {0.0f, 1.0f, 0.0f});
  f.add(3, {1.0f, 0.0f, 0.0f});
  f.add(5, {1.0f, 0.0f, 0.0f}, false);
  f.index.top_k(q.data(), 0, &f.scratch, &out);
  CHECK(out.empty());
  f.index.top_k(q.data(), 4, &f.scratch, &out);
  REQUIRE(out.size() == 2);
  CHECK(f.index.key(out[0].row) == 3);
  CHECK(out[0].score == 1.0f);
  CHECK(f.index.key(out[1].row) == 9);
  CHECK(out[1].score == 0.0f);
  CHECK(f.index.score(2, q.data()) == 1.0f);  // ineligible rows are still scored on request
}

TEST_CASE("scan cost at 10k x 384 (informative, no timing assertion)") {
  const size_t dim = 384, n = 10000;
  std::mt19937 rng(10);
  EmbeddingIndex index(static_cast<int>(dim));
  // Clustered rows, like real memories: 200 topics.
  std::vector<std::vector<float>> centres;
  for (int c = 0; c < 200; ++c) centres.push_back(random_unit(rng, dim));
  std::normal_distribution<float> nz(0.0f, 0.6f / std::sqrt(static_cast<float>(dim)));
  std::vector<float> matrix;  // (n, dim) the same rows for the sgemv baseline
  for (size_t i = 0; i < n; ++i) {
    auto v = centres[i % 200];
    double s = 0.0;
    for (float& x : v) {
      x += nz(rng);
      s += double(x) * x;
    }
    for (float& x : v) x = static_cast<float>(x / std::sqrt(s));
    index.append(i + 1, v.data(), i % 500 != 0);
    matrix.insert(matrix.end(), v.begin(), v.end());
  }
  const int queries = 50;
  std::vector<std::vector<float>> qs;
  for (int t = 0; t < queries; ++t) {
    qs.push_back(centres[static_cast<size_t>(t) * 3]);
    qs.back()[0] += 0.05f;
  }
  using Clock = std::chrono::steady_clock;
  const auto us_per_query = [&](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::micro>(b - a).count() / queries;
  };
  // Each method runs its queries back to back (a repeated query keeps its data warm in cache).
  TopKScratch scratch;
  std::vector<std::vector<ScoredRow>> got(queries), want(queries);
  size_t cand = 0;
  const auto t0 = Clock::now();
  for (int t = 0; t < queries; ++t) {
    TopKStats st;
    index.top_k(qs[static_cast<size_t>(t)].data(), 16, &scratch, &got[static_cast<size_t>(t)], &st);
    cand += st.candidates;
  }
  const auto t1 = Clock::now();
  std::vector<float> scores(n);
  for (int t = 0; t < queries; ++t) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(n), static_cast<int>(dim), 1.0f,
                matrix.data(), static_cast<int>(dim), qs[static_cast<size_t>(t)].data(), 1, 0.0f,
                scores.data(), 1);
  }
  const auto t2 = Clock::now();
  for (int t = 0; t < queries; ++t) {
    index.top_k_exhaustive(qs[static_cast<size_t>(t)].data(), 16, &want[static_cast<size_t>(t)]);
  }
  const auto t3 = Clock::now();
  for (int t = 0; t < queries; ++t) {
    const auto& g = got[static_cast<size_t>(t)];
    const auto& w = want[static_cast<size_t>(t)];
    REQUIRE(g.size() == w.size());
    for (size_t i = 0; i < g.size(); ++i) {
      CHECK(g[i].row == w[i].row);
      CHECK(g[i].score == w[i].score);
    }
  }
  MESSAGE("10k x 384, k=16, one thread, per query: int8 scan + exact rescore "
          << us_per_query(t0, t1) << " us (mean candidates " << double(cand) / queries
          << "); fp32 cblas_sgemv scores alone " << us_per_query(t1, t2)
          << " us; exhaustive exact top-k " << us_per_query(t2, t3) << " us");
}
