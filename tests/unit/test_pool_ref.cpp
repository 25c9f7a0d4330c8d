// ref::attention_pool (services/worker/kernels/reference_pool.cpp) against an independent naive
// computation: per (row, head), an explicit softmax in double over the keys of a visibility mask,
// then the probabilities bucketed by group and summed over heads. Also the properties the engine
// relies on: a row's pooled values sum to `heads` when every key is in a group, keys of group -1
// are left out, rows without keys pool to zero, and the output is overwritten.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "services/worker/kernels/bf16.h"
#include "services/worker/kernels/layout.h"
#include "services/worker/kernels/reference.h"

namespace {

using keep::kernels::AttentionRows;
using keep::kernels::Bf16;
using keep::kernels::KeyRange;
namespace ref = keep::kernels::ref;

struct Layout {
  std::vector<int32_t> offsets;
  std::vector<KeyRange> spans;
  int32_t num_keys = 0;
  AttentionRows rows() const {
    AttentionRows r;
    r.row_offsets = offsets.data();
    r.spans = spans.data();
    r.rows = static_cast<int32_t>(offsets.size()) - 1;
    r.num_keys = num_keys;
    return r;
  }
};

// Random runs of visible keys separated by random gaps; row `empty_row` sees nothing.
Layout random_layout(std::mt19937& rng, int rows, int num_keys, int empty_row) {
  Layout l;
  l.num_keys = num_keys;
  l.offsets.push_back(0);
  std::uniform_int_distribution<int> run(1, std::max(1, num_keys / 3));
  std::uniform_int_distribution<int> gap(0, std::max(1, num_keys / 4));
  for (int r = 0; r < rows; ++r) {
    if (r != empty_row) {
      int t = gap(rng) % std::max(1, num_keys / 2);
      while (t < num_keys) {
        const int e = std::min(num_keys, t + run(rng));
        l.spans.push_back({t, e});
        t = e + 1 + gap(rng);  // disjoint and not adjacent
      }
    }
    l.offsets.push_back(static_cast<int32_t>(l.spans.size()));
  }
  return l;
}

struct Case {
  int rows;
  int num_keys;
  int heads;
  int kv_heads;
  int head_dim;
  int num_groups;
  bool with_none;  // some keys in group -1
};

// Naive: mask -> scores -> softmax (double) -> bucket. Also returns lse (double) per (row, head).
std::vector<double> naive_pool(const std::vector<Bf16>& q, int64_t q_stride,
                               const std::vector<Bf16>& k, const Layout& lay,
                               const std::vector<int32_t>& key_group, const Case& c,
                               std::vector<double>* lse_out) {
  const int rows = c.rows;
  std::vector<double> pooled(static_cast<size_t>(rows) * c.num_groups, 0.0);
  lse_out->assign(static_cast<size_t>(rows) * c.heads, -std::numeric_limits<double>::infinity());
  for (int r = 0; r < rows; ++r) {
    std::vector<char> seen(static_cast<size_t>(c.num_keys), 0);
    for (int s = lay.offsets[r]; s < lay.offsets[r + 1]; ++s) {
      for (int t = lay.spans[s].begin; t < lay.spans[s].end; ++t) seen[t] = 1;
    }
    for (int h = 0; h < c.heads; ++h) {
      const int g = h * c.kv_heads / c.heads;  // = h / (heads / kv_heads)
      std::vector<double> score;
      std::vector<int> keys;
      for (int t = 0; t < c.num_keys; ++t) {
        if (!seen[t]) continue;
        double dot = 0.0;
        for (int d = c.head_dim - 1; d >= 0; --d) {  // reverse order: a different summation
          const double qv = keep::kernels::bf16_to_float(q[r * q_stride + h * c.head_dim + d]);
          const double kv = keep::kernels::bf16_to_float(
              k[(static_cast<size_t>(t) * c.kv_heads + g) * c.head_dim + d]);
          dot += qv * kv;
        }
        score.push_back(dot * (1.0 / std::sqrt(static_cast<double>(c.head_dim))));
        keys.push_back(t);
      }
      if (keys.empty()) continue;
      const double mx = *std::max_element(score.begin(), score.end());
      double denom = 0.0;
      for (double s : score) denom += std::exp(s - mx);
      (*lse_out)[static_cast<size_t>(r) * c.heads + h] = mx + std::log(denom);
      for (size_t i = 0; i < keys.size(); ++i) {
        const int grp = key_group[keys[i]];
        if (grp >= 0)
          pooled[static_cast<size_t>(r) * c.num_groups + grp] += std::exp(score[i] - mx) / denom;
      }
    }
  }
  return pooled;
}

void run_case(std::mt19937& rng, const Case& c) {
  CAPTURE(c.rows);
  CAPTURE(c.num_keys);
  CAPTURE(c.heads);
  CAPTURE(c.kv_heads);
  CAPTURE(c.head_dim);
  CAPTURE(c.num_groups);
  CAPTURE(c.with_none);
  const int64_t q_stride = static_cast<int64_t>(c.heads) * c.head_dim + 3;
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<Bf16> q(static_cast<size_t>(c.rows * q_stride));
  for (auto& x : q) x = keep::kernels::float_to_bf16(u(rng));
  std::vector<Bf16> k(static_cast<size_t>(c.num_keys) * c.kv_heads * c.head_dim);
  for (auto& x : k) x = keep::kernels::float_to_bf16(u(rng));
  const Layout lay = random_layout(rng, c.rows, c.num_keys, c.rows > 2 ? 1 : -1);
  std::uniform_int_distribution<int> grp(c.with_none ? -1 : 0, c.num_groups - 1);
  std::vector<int32_t> key_group(static_cast<size_t>(c.num_keys));
  for (auto& g : key_group) g = grp(rng);
  if (c.with_none && c.num_keys > 0) key_group[0] = -1;

  std::vector<double> lse_d;
  const std::vector<double> want = naive_pool(q, q_stride, k, lay, key_group, c, &lse_d);
  std::vector<float> lse(lse_d.size());
  for (size_t i = 0; i < lse.size(); ++i) lse[i] = static_cast<float>(lse_d[i]);

  std::vector<float> got(want.size(), std::numeric_limits<float>::quiet_NaN());
  ref::attention_pool(got.data(), q.data(), q_stride, k.data(), lse.data(), lay.rows(),
                      key_group.data(), c.num_groups, c.heads, c.kv_heads, c.head_dim,
                      static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim))));
  // The reference normalises with the fp32-rounded lse: relative error ~ |lse| * 2^-24.
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("pooled element " << i << " got " << got[i] << " want " << want[i]);
    REQUIRE_FALSE(std::isnan(got[i]));
    REQUIRE(std::fabs(got[i] - want[i]) <= 1e-9 + 1e-5 * std::fabs(want[i]));
  }
  for (int r = 0; r < c.rows; ++r) {
    double sum = 0.0;
    for (int g = 0; g < c.num_groups; ++g) sum += got[static_cast<size_t>(r) * c.num_groups + g];
    const bool has_keys = lay.offsets[r + 1] > lay.offsets[r];
    INFO("row " << r << " pooled sum " << sum);
    if (!has_keys) {
      CHECK(sum == 0.0);
    } else if (!c.with_none) {
      CHECK(std::fabs(sum - c.heads) <= 1e-5 * c.heads);
    } else {
      CHECK(sum <= c.heads * (1.0 + 1e-5));
    }
  }
}

}  // namespace

TEST_CASE("ref::attention_pool matches an explicit softmax bucketed by group") {
  std::mt19937 rng(4242);
  const Case cases[] = {
      {1, 1, 1, 1, 32, 1, false},       {1, 7, 9, 3, 64, 1, false},
      {3, 19, 9, 3, 64, 5, true},       {7, 257, 28, 4, 128, 5, false},
      {19, 100, 40, 8, 128, 300, true}, {5, 733, 4, 4, 96, 300, false},
      {2, 300, 14, 2, 64, 10000, true},
  };
  for (const Case& c : cases) {
    run_case(rng, c);
  }
}

TEST_CASE("ref::attention_pool: sums to heads, skips group -1 and zeroes keyless rows") {
  // Two rows, 4 keys, 2 heads sharing one kv head, q = 0: uniform attention over the seen keys.
  const int heads = 2;
  const int hd = 32;
  std::vector<Bf16> q(static_cast<size_t>(2 * heads * hd), keep::kernels::float_to_bf16(0.0f));
  std::vector<Bf16> k(static_cast<size_t>(4 * hd), keep::kernels::float_to_bf16(0.5f));
  const std::vector<int32_t> offsets = {0, 2, 2};  // row 0: keys {0, 2, 3}; row 1: none
  const std::vector<KeyRange> spans = {{0, 1}, {2, 4}};
  AttentionRows rows;
  rows.row_offsets = offsets.data();
  rows.spans = spans.data();
  rows.rows = 2;
  rows.num_keys = 4;
  const float lse3 = static_cast<float>(std::log(3.0));  // s = 0 for every key
  const std::vector<float> lse = {lse3, lse3, -INFINITY, -INFINITY};
  const std::vector<int32_t> key_group = {1, 0, -1, 1};  // key 1 unseen, key 2 in no group
  std::vector<float> pooled(4, std::numeric_limits<float>::quiet_NaN());
  ref::attention_pool(pooled.data(), q.data(), heads * hd, k.data(), lse.data(), rows,
                      key_group.data(), 2, heads, 1, hd, 0.1f);
  // Row 0: keys 0 and 3 (group 1) each have p = 1/3 per head: 2 heads * 2/3.
  CHECK(pooled[0] == 0.0f);
  CHECK(pooled[1] == doctest::Approx(4.0 / 3.0).epsilon(1e-6));
  CHECK(pooled[2] == 0.0f);
  CHECK(pooled[3] == 0.0f);
}
