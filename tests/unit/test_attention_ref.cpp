// The prefill tile schedule (services/worker/kernels/attention_schedule.h) against a brute force
// over every (row tile, key tile) pair, and the attention reference (ref::attention) against a
// naive computation over the materialised mask matrix, with GQA, strides and rows with no key.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "services/worker/kernels/attention_schedule.h"
#include "services/worker/kernels/bf16.h"
#include "services/worker/kernels/reference.h"
#include "tests/attention_test_layouts.h"

namespace {

using keep::kernels::Bf16;
namespace kk = keep::kernels;

using keep::kernels::testing::blocks;
using keep::kernels::testing::causal;
using keep::kernels::testing::Layout;
using keep::kernels::testing::random_spans;
using keep::kernels::testing::recompute;

// Expected schedule by brute force: every pair, touched and full straight from the mask matrix.
kk::PrefillScheduleHost brute_schedule(const Layout& l, int32_t row_tile, int32_t key_tile) {
  const auto m = l.mask();
  kk::PrefillScheduleHost s;
  s.tile_offsets.push_back(0);
  const int32_t key_tiles = (l.num_keys + key_tile - 1) / key_tile;
  for (int32_t r0 = 0; r0 < l.rows(); r0 += row_tile) {
    const int32_t r1 = std::min(l.rows(), r0 + row_tile);
    for (int32_t kt = 0; kt < key_tiles; ++kt) {
      bool any = false;
      bool all = (kt + 1) * key_tile <= l.num_keys;  // a partial last tile is never full
      for (int32_t r = r0; r < r1; ++r) {
        for (int32_t t = kt * key_tile; t < (kt + 1) * key_tile; ++t) {
          const bool seen = t < l.num_keys && m[r][t];
          any = any || seen;
          all = all && seen;
        }
      }
      if (any) s.tiles.push_back(kt * 2 + (all ? 1 : 0));
    }
    s.tile_offsets.push_back(static_cast<int32_t>(s.tiles.size()));
  }
  s.visited_pairs = static_cast<int64_t>(s.tiles.size());
  for (int32_t t = 0; t < l.num_keys && !s.sanitize_v; ++t) {
    bool seen = false;
    for (int32_t r = 0; r < l.rows() && !seen; ++r) seen = m[r][t];
    s.sanitize_v = !seen;
  }
  return s;
}

void check_schedule(const Layout& l, int32_t row_tile, int32_t key_tile) {
  INFO("rows " << l.rows() << " keys " << l.num_keys << " tiles " << row_tile << "x" << key_tile);
  const auto got = kk::build_prefill_schedule(l.view(), row_tile, key_tile);
  const auto want = brute_schedule(l, row_tile, key_tile);
  CHECK(got.tile_offsets == want.tile_offsets);
  CHECK(got.tiles == want.tiles);
  CHECK(got.visited_pairs == want.visited_pairs);
  CHECK(got.sanitize_v == want.sanitize_v);
}

// ---- naive attention over the mask matrix ----
void naive_attention(std::vector<double>& out, std::vector<double>& lse, const std::vector<Bf16>& q,
                     int64_t q_stride, const std::vector<Bf16>& k, const std::vector<Bf16>& v,
                     const Layout& l, int heads, int kv_heads, int hd, float scale) {
  const auto m = l.mask();
  const int rep = heads / kv_heads;
  out.assign(static_cast<size_t>(l.rows()) * heads * hd, 0.0);
  lse.assign(static_cast<size_t>(l.rows()) * heads, 0.0);
  std::vector<double> score(static_cast<size_t>(l.num_keys));
  for (int32_t r = 0; r < l.rows(); ++r) {
    for (int h = 0; h < heads; ++h) {
      const int g = h / rep;
      // All keys' scores (visible or not), then the visible maximum.
      double mx = -std::numeric_limits<double>::infinity();
      for (int32_t t = 0; t < l.num_keys; ++t) {
        double dot = 0.0;
        for (int d = hd - 1; d >= 0; --d) {  // other summation order than the reference
          dot += static_cast<double>(kk::bf16_to_float(q[r * q_stride + h * hd + d])) *
                 kk::bf16_to_float(k[(static_cast<size_t>(t) * kv_heads + g) * hd + d]);
        }
        score[t] = dot * scale;
        if (m[r][t]) mx = std::max(mx, score[t]);
      }
      double* o = &out[(static_cast<size_t>(r) * heads + h) * hd];
      double z = 0.0;
      for (int32_t t = 0; t < l.num_keys; ++t) {
        if (!m[r][t]) continue;
        const double w = std::exp(score[t] - mx);
        z += w;
        for (int d = 0; d < hd; ++d) {
          o[d] += w * kk::bf16_to_float(v[(static_cast<size_t>(t) * kv_heads + g) * hd + d]);
        }
      }
      if (z == 0.0) {  // no visible key
        lse[static_cast<size_t>(r) * heads + h] = -std::numeric_limits<double>::infinity();
        continue;
      }
      for (int d = 0; d < hd; ++d) o[d] /= z;
      lse[static_cast<size_t>(r) * heads + h] = mx + std::log(z);
    }
  }
}

void check_attention(std::mt19937& rng, const Layout& l, int heads, int kv_heads, int hd,
                     int64_t q_extra, int64_t out_extra, bool with_lse) {
  INFO("rows " << l.rows() << " keys " << l.num_keys << " heads " << heads << "/" << kv_heads
               << " hd " << hd);
  const int64_t q_stride = static_cast<int64_t>(heads) * hd + q_extra;
  const int64_t out_stride = static_cast<int64_t>(heads) * hd + out_extra;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::uniform_real_distribution<float> unit(-2.0f, 2.0f);
  std::vector<Bf16> q(static_cast<size_t>(l.rows()) * q_stride);
  for (auto& x : q) x = kk::float_to_bf16(unit(rng));
  std::vector<Bf16> k(static_cast<size_t>(l.num_keys) * kv_heads * hd), v(k.size());
  for (auto& x : k) x = kk::float_to_bf16(unit(rng));
  for (auto& x : v) x = kk::float_to_bf16(unit(rng));
  const Bf16 sentinel = kk::float_to_bf16(-77.0f);
  std::vector<Bf16> out(static_cast<size_t>(l.rows()) * out_stride, sentinel);
  std::vector<float> lse(static_cast<size_t>(l.rows()) * heads, 12345.0f);
  kk::ref::attention(out.data(), out_stride, with_lse ? lse.data() : nullptr, q.data(), q_stride,
                     k.data(), v.data(), l.view(), heads, kv_heads, hd, scale);
  std::vector<double> want, want_lse;
  naive_attention(want, want_lse, q, q_stride, k, v, l, heads, kv_heads, hd, scale);
  for (int32_t r = 0; r < l.rows(); ++r) {
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < hd; ++d) {
        const float got = kk::bf16_to_float(out[r * out_stride + h * hd + d]);
        const double w = want[(static_cast<size_t>(r) * heads + h) * hd + d];
        INFO("row " << r << " head " << h << " dim " << d << " got " << got << " want " << w);
        REQUIRE(std::fabs(got - w) <= 1e-6 + 8e-3 * std::fabs(w));  // one bf16 rounding
      }
      const float got_lse = lse[static_cast<size_t>(r) * heads + h];
      const double w_lse = want_lse[static_cast<size_t>(r) * heads + h];
      INFO("row " << r << " head " << h << " lse " << got_lse << " want " << w_lse);
      if (!with_lse) {
        REQUIRE(got_lse == 12345.0f);
      } else if (std::isinf(w_lse)) {
        REQUIRE((std::isinf(got_lse) && got_lse < 0));
      } else {
        REQUIRE(std::fabs(got_lse - w_lse) <= 1e-6 * std::max(1.0, std::fabs(w_lse)));
      }
    }
    for (int64_t i = static_cast<int64_t>(heads) * hd; i < out_stride; ++i) {
      REQUIRE(out[r * out_stride + i].bits == sentinel.bits);  // stride padding untouched
    }
  }
}

}  // namespace

TEST_CASE("prefill schedule matches a brute force over every (row tile, key tile) pair") {
  std::mt19937 rng(7);
  const int32_t tile_sizes[][2] = {{64, 64}, {16, 8}, {3, 5}, {1, 1}, {7, 64}, {64, 7}};
  for (const auto& ts : tile_sizes) {
    for (int32_t n : {1, 3, 7, 19, 64, 65, 200}) {
      for (int32_t past : {0, 5, 64}) check_schedule(causal(n, past), ts[0], ts[1]);
    }
    check_schedule(recompute(rng, 300, 0.3, false), ts[0], ts[1]);
    check_schedule(recompute(rng, 500, 0.05, false), ts[0], ts[1]);
    check_schedule(blocks(64, {{64, 128}, {128, 300}, {300, 301}, {310, 400}}), ts[0], ts[1]);
    check_schedule(blocks(50, {{50, 120}, {120, 250}}), ts[0], ts[1]);
    check_schedule(blocks(0, {{0, 130}, {130, 131}, {131, 260}}), ts[0], ts[1]);
    for (int i = 0; i < 4; ++i) {
      check_schedule(random_spans(rng, 150, 400, 8, i % 2 == 0), ts[0], ts[1]);
      check_schedule(random_spans(rng, 40, 9, 3, true), ts[0], ts[1]);
      // Few spans over many keys: the key tiles between a row tile's events far outnumber them
      // (the sorted sweep; the cases above take the dense one).
      check_schedule(random_spans(rng, 12, 60000, 2, i % 2 == 0), ts[0], ts[1]);
    }
  }
  // V is cleaned only where a key is seen by no row (a slot maybe never written): not for causal
  // rows or a recompute that ends with the last slot (KEEP's layers), nor for a partial last key
  // tile (zero-filled past num_keys); between blocks, or after the last recomputed slot, it is.
  CHECK_FALSE(kk::build_prefill_schedule(causal(200, 37).view()).sanitize_v);
  CHECK_FALSE(kk::build_prefill_schedule(recompute(rng, 4236, 0.1, true).view()).sanitize_v);
  CHECK(kk::build_prefill_schedule(blocks(64, {{100, 228}, {300, 301}}).view()).sanitize_v);
  Layout tail;
  tail.num_keys = 100;
  tail.add_row({{0, 99}});
  CHECK(kk::build_prefill_schedule(tail.view()).sanitize_v);
  tail.add_row({{99, 100}});
  CHECK_FALSE(kk::build_prefill_schedule(tail.view()).sanitize_v);
  // A tile that every row covers with two adjacent spans is full.
  Layout split;
  split.num_keys = 128;
  for (int i = 0; i < 64; ++i) split.add_row({{0, 30}, {30, 64}, {64, 100}});
  auto s = kk::build_prefill_schedule(split.view());
  CHECK(s.tiles == std::vector<int32_t>{0 * 2 + 1, 1 * 2 + 0});
  // A partial last key tile is never full, even when every row sees all of it.
  Layout partial;
  partial.num_keys = 100;
  for (int i = 0; i < 10; ++i) partial.add_row({{0, 100}});
  s = kk::build_prefill_schedule(partial.view());
  CHECK(s.tiles == std::vector<int32_t>{1, 2});
  // A zero-key row in a row tile rules out full tiles; a tile of zero-key rows visits nothing.
  Layout zero;
  zero.num_keys = 64;
  zero.add_row({{0, 64}});
  zero.add_row({});
  for (int i = 0; i < 64; ++i) zero.add_row({});
  s = kk::build_prefill_schedule(zero.view());
  CHECK(s.tile_offsets == std::vector<int32_t>{0, 1, 1});
  CHECK(s.tiles == std::vector<int32_t>{0});
  // Empty inputs.
  CHECK(kk::build_prefill_schedule(Layout{}.view()).tile_offsets == std::vector<int32_t>{0});
  Layout nokeys;
  nokeys.add_row({});
  s = kk::build_prefill_schedule(nokeys.view());
  CHECK(s.tile_offsets == std::vector<int32_t>{0, 0});
  CHECK(s.visited_pairs == 0);
}

TEST_CASE("prefill schedule of a 32k-row causal prefill: lower triangle, diagonal masked") {
  const Layout l = causal(32768, 0);
  const auto t0 = std::chrono::steady_clock::now();
  const auto s = kk::build_prefill_schedule(l.view());
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("build_prefill_schedule, 32768 causal rows: " << ms << " ms");
  const int32_t tiles = 32768 / 64;
  REQUIRE(s.tile_offsets.size() == static_cast<size_t>(tiles) + 1);
  CHECK(s.visited_pairs == static_cast<int64_t>(tiles) * (tiles + 1) / 2);
  bool ok = true;
  for (int32_t rt = 0; rt < tiles; ++rt) {
    ok = ok && s.tile_offsets[rt + 1] - s.tile_offsets[rt] == rt + 1;
    for (int32_t kt = 0; kt <= rt && ok; ++kt) {
      ok = s.tiles[s.tile_offsets[rt] + kt] == kt * 2 + (kt < rt ? 1 : 0);
    }
  }
  CHECK(ok);
  // With a past not on a tile boundary, the diagonal spreads over two masked tiles.
  const auto p = kk::build_prefill_schedule(causal(4096, 37).view());
  // Row tile 0 sees [0, 38) .. [0, 101): key tiles 0 and 1, both masked. Row tile 1 sees
  // [0, 102) .. [0, 165): key tile 0 full, 1 and 2 masked.
  REQUIRE(p.tile_offsets.size() > 2);
  CHECK(p.tile_offsets[1] == 2);
  CHECK(p.tile_offsets[2] == 5);
  CHECK(std::vector<int32_t>(p.tiles.begin(), p.tiles.begin() + 5) ==
        std::vector<int32_t>{0, 2, 1, 2, 4});
}

TEST_CASE(
    "kAuto's prefill kernel: mma without wgmma, wide from 4096 keys, one K buffer from 4 "
    "blocks an SM") {
  using K = kk::PrefillKernel;
  const auto pick = [](int32_t rows, int32_t keys, int heads, int hd, int sms, bool wgmma) {
    return kk::resolve_prefill_kernel(K::kAuto, rows, keys, heads, hd, sms, wgmma);
  };
  // Qwen2.5-14B heads (40) at 1024 causal rows: 16 x 40 = 640 blocks, 4.8 an H200 SM.
  CHECK(pick(1024, 1024, 40, 128, 132, true) == K::kWgmmaOneK);
  // 7B heads (28): 448 blocks, 3.4 an SM: two K buffers.
  CHECK(pick(1024, 1024, 28, 128, 132, true) == K::kWgmma);
  CHECK(pick(2048, 2048, 28, 128, 132, true) == K::kWgmmaOneK);
  // The threshold itself: 4 x 132 = 528 blocks; 8 rows past a 64-row tile count a whole tile.
  CHECK(pick(33 * 64, 33 * 64, 16, 128, 132, true) == K::kWgmmaOneK);  // 528
  CHECK(pick(32 * 64 + 1, 32 * 64 + 1, 16, 128, 132, true) == K::kWgmmaOneK);
  CHECK(pick(32 * 64, 32 * 64, 16, 128, 132, true) == K::kWgmma);  // 512
  CHECK(pick(33 * 64, 33 * 64, 16, 128, 200, true) == K::kWgmma);  // more SMs, more blocks asked
  // From kPrefillWideMinKeys keys the two-warpgroup kernel, at head_dim 128 only.
  CHECK(pick(4096, 4096, 28, 128, 132, true) == K::kWgmmaWide);
  CHECK(pick(512, 4096, 28, 128, 132, true) == K::kWgmmaWide);
  CHECK(pick(4096, 4096, 28, 64, 132, true) == K::kWgmma);  // head_dim 64: two K buffers fit 3
  CHECK(pick(4096, 4095, 40, 128, 132, true) == K::kWgmmaOneK);
  // Without wgmma: mma.sync; an explicit choice as asked; no rows or heads: nothing to fill.
  CHECK(pick(1024, 1024, 40, 128, 132, false) == K::kMma);
  CHECK(kk::resolve_prefill_kernel(K::kWgmma, 1024, 1024, 40, 128, 132, true) == K::kWgmma);
  CHECK(kk::resolve_prefill_kernel(K::kMma, 1024, 1024, 40, 128, 132, true) == K::kMma);
  CHECK(pick(0, 0, 40, 128, 132, true) == K::kWgmma);
  CHECK(pick(-5, 10, 40, 128, 132, true) == K::kWgmma);
  // Names round-trip (bench_prefill --attention).
  for (K k : {K::kAuto, K::kMma, K::kWgmma, K::kWgmmaOneK, K::kWgmmaWide}) {
    K back = K::kAuto;
    CHECK(kk::parse_prefill_kernel(kk::prefill_kernel_name(k), &back));
    CHECK(back == k);
  }
  K unused = K::kMma;
  CHECK_FALSE(kk::parse_prefill_kernel("wgmma2k", &unused));
  // The choices that need wgmma (refused where it cannot run).
  CHECK_FALSE(kk::prefill_kernel_needs_wgmma(K::kAuto));
  CHECK_FALSE(kk::prefill_kernel_needs_wgmma(K::kMma));
  for (K k : {K::kWgmma, K::kWgmmaOneK, K::kWgmmaWide}) CHECK(kk::prefill_kernel_needs_wgmma(k));
}

TEST_CASE("split-key prefill: splits fill the SMs' block slots, and the workspace bound holds") {
  // A KEEP request's query-only layer at 14B: 128 rows over 4,236 keys, 40 heads: 80 blocks on
  // 132 SMs (264 slots): 3 runs of ~23 key tiles.
  CHECK(kk::prefill_key_splits(128, 4236, 40, 132) == 3);
  // 7B (28 heads): 56 blocks, 4 runs; one row tile of 40 heads: 6 runs.
  CHECK(kk::prefill_key_splits(128, 4236, 28, 132) == 4);
  CHECK(kk::prefill_key_splits(64, 4236, 40, 132) == 6);
  // Enough blocks already (5 row tiles x 40 = 200 of 264 slots: a split would take 2 waves).
  CHECK(kk::prefill_key_splits(300, 4236, 40, 132) == 1);
  CHECK(kk::prefill_key_splits(1000, 4236, 40, 132) == 1);
  // Few keys: each run gets 4 key tiles or more (9 tiles: 2 runs; 7 tiles: none).
  CHECK(kk::prefill_key_splits(64, 9 * 64, 8, 132) == 2);
  CHECK(kk::prefill_key_splits(64, 7 * 64, 8, 132) == 1);
  // The cap, and nothing to split.
  CHECK(kk::prefill_key_splits(1, 1 << 20, 1, 132) == kk::kPrefillSplitMax);
  CHECK(kk::prefill_key_splits(0, 4096, 40, 132) == 1);
  CHECK(kk::prefill_key_splits(64, 0, 40, 132) == 1);
  CHECK(kk::prefill_key_splits(64, 4096, 40, 0) == 1);
  // Workspace: bf16 outputs (256-byte aligned) then fp32 lse of every run; none unsplit.
  CHECK(kk::prefill_split_bytes(128, 40, 128, 3) == 3 * 128 * 40 * (128 * 2 + 4));
  CHECK(kk::prefill_split_bytes(3, 1, 64, 2) == 768 + 6 * 4);
  CHECK(kk::prefill_split_bytes(128, 40, 128, 1) == 0);
  // Whatever the rows and heads, the choice fits prefill_split_max_bytes.
  for (int sms : {1, 7, 78, 132}) {
    for (int heads : {1, 3, 8, 28, 40, 64}) {
      for (int32_t rows : {1, 17, 64, 65, 128, 200, 640, 4096}) {
        for (int hd : {64, 128}) {
          const int s = kk::prefill_key_splits(rows, 1 << 16, heads, sms);
          CHECK(kk::prefill_split_bytes(rows, heads, hd, s) <=
                kk::prefill_split_max_bytes(hd, sms));
        }
      }
    }
  }
}

TEST_CASE("attention reference matches a naive softmax over the mask matrix") {
  std::mt19937 rng(11);
  for (int32_t n : {1, 3, 7, 19}) {
    check_attention(rng, causal(n, 0), 2, 1, 8, 0, 0, true);
    check_attention(rng, causal(n, 5), 6, 2, 16, 3, 5, true);
  }
  check_attention(rng, causal(70, 11), 9, 3, 64, 2 * 3 * 64, 7, true);  // fused q row
  check_attention(rng, recompute(rng, 120, 0.2, false), 4, 4, 32, 0, 0, true);
  check_attention(rng, blocks(10, {{10, 30}, {40, 61}}), 6, 3, 8, 1, 1, false);
  check_attention(rng, random_spans(rng, 30, 80, 5, true), 8, 2, 12, 0, 4, true);
  Layout zero;  // rows with no key among others
  zero.num_keys = 12;
  zero.add_row({});
  zero.add_row({{2, 3}});
  zero.add_row({});
  zero.add_row({{0, 4}, {4, 5}, {9, 12}});
  check_attention(rng, zero, 4, 2, 8, 0, 3, true);
  check_attention(rng, zero, 4, 1, 8, 0, 3, true);
  Layout nokeys;  // no keys at all: out 0, lse -inf
  nokeys.add_row({});
  nokeys.add_row({});
  check_attention(rng, nokeys, 3, 1, 4, 0, 0, true);
}

TEST_CASE("attention reference: one visible key gives its value, lse its score") {
  Layout l;
  l.num_keys = 3;
  l.add_row({{1, 2}});
  const std::vector<Bf16> q = {kk::float_to_bf16(1.0f), kk::float_to_bf16(2.0f)};
  std::vector<Bf16> k, v;  // every value exact in bf16
  for (float x : {9.0f, 9.0f, 0.5f, -0.25f, 9.0f, 9.0f}) k.push_back(kk::float_to_bf16(x));
  for (float x : {7.0f, 7.0f, 3.0f, -1.5f, 7.0f, 7.0f}) v.push_back(kk::float_to_bf16(x));
  std::vector<Bf16> out(2);
  float lse = 0;
  kk::ref::attention(out.data(), 2, &lse, q.data(), 2, k.data(), v.data(), l.view(), 1, 1, 2, 0.5f);
  CHECK(kk::bf16_to_float(out[0]) == 3.0f);
  CHECK(kk::bf16_to_float(out[1]) == -1.5f);
  CHECK(lse == doctest::Approx((1.0 * 0.5 + 2.0 * -0.25) * 0.5));
}
