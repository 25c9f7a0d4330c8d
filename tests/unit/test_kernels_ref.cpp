// The CPU references of the CUDA kernels (services/worker/kernels/reference.h) against naive
// double-precision loops on odd sizes, and RoPE against the CPU engine's RopeTable (the CUDA
// backend is checked against the CPU engine through these references).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "services/worker/engine/rope.h"
#include "services/worker/kernels/bf16.h"
#include "services/worker/kernels/reference.h"

namespace {

using keep::kernels::Bf16;
using keep::kernels::bf16_to_float;
using keep::kernels::float_to_bf16;
namespace ref = keep::kernels::ref;

constexpr int64_t kSizes[] = {1, 3, 7, 19, 733};

std::vector<float> random_floats(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<Bf16> to_bf16(const std::vector<float>& v) {
  std::vector<Bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
  return out;
}

std::vector<float> from_bf16(const std::vector<Bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(v[i]);
  return out;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double atol,
                  double rtol) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("element " << i << " got " << got[i] << " want " << want[i]);
    REQUIRE_FALSE(std::isnan(got[i]));
    REQUIRE(std::fabs(got[i] - want[i]) <= atol + rtol * std::fabs(want[i]));
  }
}

}  // namespace

TEST_CASE("bf16 conversion rounds to nearest even and keeps NaN and infinities") {
  CHECK(float_to_bf16(1.0f).bits == 0x3f80);
  CHECK(bf16_to_float(float_to_bf16(1.0f)) == 1.0f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  CHECK(float_to_bf16(1.0f + 0x1p-8f).bits == 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  CHECK(float_to_bf16(1.0f + 3 * 0x1p-8f).bits == 0x3f82);
  CHECK(float_to_bf16(1.0f + 0x1p-8f + 0x1p-12f).bits == 0x3f81);  // above halfway: up
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity()))));
  CHECK(float_to_bf16(-2.5f).bits == 0xc020);
}

TEST_CASE("embedding reference gathers rows and zeroes out-of-range ids") {
  std::mt19937 rng(1);
  for (int64_t n : kSizes) {
    for (int64_t hidden : kSizes) {
      const int64_t vocab = 11;
      const auto table = random_floats(rng, static_cast<size_t>(vocab * hidden), -1, 1);
      std::vector<int32_t> ids(n);
      std::uniform_int_distribution<int32_t> d(-2, static_cast<int32_t>(vocab) + 1);
      for (auto& id : ids) id = d(rng);
      std::vector<float> out(static_cast<size_t>(n * hidden), -7.0f);
      ref::embedding(out.data(), table.data(), ids.data(), n, hidden, vocab);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t i = 0; i < hidden; ++i) {
          const bool in = ids[t] >= 0 && ids[t] < vocab;
          REQUIRE(out[t * hidden + i] == (in ? table[ids[t] * hidden + i] : 0.0f));
        }
      }
      auto out16 = std::vector<Bf16>(out.size());
      const auto table16 = to_bf16(table);
      ref::embedding(out16.data(), table16.data(), ids.data(), n, hidden, vocab);
      for (int64_t t = 0; t < n; ++t) {
        const bool in = ids[t] >= 0 && ids[t] < vocab;
        for (int64_t i = 0; i < hidden; ++i) {
          REQUIRE(out16[t * hidden + i].bits == (in ? table16[ids[t] * hidden + i].bits : 0));
        }
      }
    }
  }
}

TEST_CASE("rmsnorm_residual reference equals residual add then HF RMSNorm in double") {
  std::mt19937 rng(2);
  const float eps = 1e-5f;
  for (int64_t rows : kSizes) {
    for (int64_t cols :
         {int64_t{1}, int64_t{3}, int64_t{7}, int64_t{19}, int64_t{733}, int64_t{576}}) {
      const size_t nc = static_cast<size_t>(rows * cols);
      const auto res0 = random_floats(rng, nc, -3, 3);
      const auto x = random_floats(rng, nc, -3, 3);
      const auto w = random_floats(rng, static_cast<size_t>(cols), 0.5f, 1.5f);
      // Naive double loop; `round` rounds the residual to bf16 first (the storage's semantics).
      auto naive = [&](const std::vector<float>& r0, const std::vector<float>& xs,
                       const std::vector<float>& ws, bool round, std::vector<double>& want_res,
                       std::vector<double>& want) {
        want_res.assign(nc, 0.0);
        want.assign(nc, 0.0);
        for (int64_t r = 0; r < rows; ++r) {
          double ss = 0;
          for (int64_t i = 0; i < cols; ++i) {
            const size_t k = static_cast<size_t>(r * cols + i);
            want_res[k] = static_cast<double>(r0[k]) + xs[k];
            if (round) want_res[k] = bf16_to_float(float_to_bf16(static_cast<float>(want_res[k])));
            ss += want_res[k] * want_res[k];
          }
          const double inv = 1.0 / std::sqrt(ss / static_cast<double>(cols) + eps);
          for (int64_t i = 0; i < cols; ++i) {
            const size_t k = static_cast<size_t>(r * cols + i);
            want[k] = ws[i] * want_res[k] * inv;
          }
        }
      };
      std::vector<double> want_res, want;
      naive(res0, x, w, false, want_res, want);
      // fp32.
      auto res = res0;
      std::vector<float> out(nc);
      ref::rmsnorm_residual(out.data(), res.data(), x.data(), w.data(), rows, cols, eps);
      expect_close(res, want_res, 1e-6, 1e-6);
      expect_close(out, want, 1e-5, 1e-5);
      // out may equal x.
      auto res_b = res0;
      auto x_inplace = x;
      ref::rmsnorm_residual(x_inplace.data(), res_b.data(), x_inplace.data(), w.data(), rows, cols,
                            eps);
      CHECK(x_inplace == out);
      // Without x: a plain RMSNorm of the residual.
      std::vector<float> out_plain(nc);
      ref::rmsnorm_residual<float>(out_plain.data(), res.data(), nullptr, w.data(), rows, cols,
                                   eps);
      CHECK(out_plain == out);
      // bf16: within one bf16 rounding of the double result on the same (rounded) inputs.
      auto res16 = to_bf16(res0);
      const auto x16 = to_bf16(x);
      const auto w16 = to_bf16(w);
      std::vector<Bf16> out16(nc);
      ref::rmsnorm_residual(out16.data(), res16.data(), x16.data(), w16.data(), rows, cols, eps);
      std::vector<double> want_res16, want16;
      naive(from_bf16(to_bf16(res0)), from_bf16(x16), from_bf16(w16), true, want_res16, want16);
      expect_close(from_bf16(res16), want_res16, 0.0, 0.0);  // the add is rounded exactly once
      expect_close(from_bf16(out16), want16, 1e-3, 8e-3);
    }
  }
}

TEST_CASE("rope reference rotates half-split pairs and equals the CPU engine's RopeTable") {
  std::mt19937 rng(3);
  for (int64_t n : kSizes) {
    for (int64_t head_dim : {int64_t{2}, int64_t{6}, int64_t{14}, int64_t{64}}) {
      const int64_t heads = 3;
      const int64_t half = head_dim / 2;
      std::vector<float> inv_freq(static_cast<size_t>(half));
      for (int64_t i = 0; i < half; ++i) {
        inv_freq[i] =
            static_cast<float>(std::pow(10000.0, -2.0 * i / static_cast<double>(head_dim)));
      }
      std::vector<int32_t> pos(static_cast<size_t>(n));
      std::uniform_int_distribution<int32_t> d(0, 9000);
      for (auto& p : pos) p = d(rng);
      const auto x = random_floats(rng, static_cast<size_t>(n * heads * head_dim), -2, 2);

      auto got = x;
      ref::rope(got.data(), pos.data(), inv_freq.data(), n, heads, head_dim, heads * head_dim);

      // The CPU engine's RoPE (table for positions < 4096, on the fly beyond): bit-identical.
      auto engine = x;
      keep::engine::RopeTable table(inv_freq, 4096);
      table.apply(engine.data(), pos.data(), n, heads);
      CHECK(got == engine);

      // Naive double loop.
      std::vector<double> want(x.size());
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t i = 0; i < half; ++i) {
            const size_t a = static_cast<size_t>((r * heads + h) * head_dim + i);
            const double angle = static_cast<float>(pos[r]) * inv_freq[i];
            want[a] = x[a] * std::cos(angle) - x[a + half] * std::sin(angle);
            want[a + half] = x[a + half] * std::cos(angle) + x[a] * std::sin(angle);
          }
        }
      }
      expect_close(got, want, 1e-5, 1e-5);

      // Strided rows (Q inside a wider fused row): the tail of each row is untouched.
      const int64_t stride = heads * head_dim + 5;
      auto wide = random_floats(rng, static_cast<size_t>(n * stride), -2, 2);
      auto wide_before = wide;
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t k = 0; k < heads * head_dim; ++k)
          wide[r * stride + k] = x[r * heads * head_dim + k];
      }
      ref::rope(wide.data(), pos.data(), inv_freq.data(), n, heads, head_dim, stride);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t k = 0; k < stride; ++k) {
          const float w =
              k < heads * head_dim ? got[r * heads * head_dim + k] : wide_before[r * stride + k];
          REQUIRE(wide[r * stride + k] == w);
        }
      }

      // bf16 storage: within bf16 rounding of the double result.
      auto x16 = to_bf16(x);
      std::vector<double> want16(x.size());
      ref::rope(x16.data(), pos.data(), inv_freq.data(), n, heads, head_dim, heads * head_dim);
      expect_close(from_bf16(x16), want, 3e-2, 2e-2);
    }
  }
}

TEST_CASE("swiglu reference equals silu(gate) * up in double, saturating without NaN") {
  std::mt19937 rng(4);
  for (int64_t n : kSizes) {
    auto gate = random_floats(rng, static_cast<size_t>(n), -8, 8);
    const auto up = random_floats(rng, static_cast<size_t>(n), -3, 3);
    if (n >= 3) {
      gate[0] = -200.0f;
      gate[1] = 200.0f;
    }
    std::vector<double> want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      want[i] = gate[i] / (1.0 + std::exp(-static_cast<double>(gate[i]))) * up[i];
    }
    std::vector<float> out(static_cast<size_t>(n));
    ref::swiglu(out.data(), gate.data(), up.data(), n);
    expect_close(out, want, 1e-6, 1e-5);
    std::vector<Bf16> out16(static_cast<size_t>(n));
    const auto g16 = to_bf16(gate);
    const auto u16 = to_bf16(up);
    ref::swiglu(out16.data(), g16.data(), u16.data(), n);
    expect_close(from_bf16(out16), want, 5e-2, 3e-2);
    // out may alias gate.
    auto g_inplace = gate;
    ref::swiglu(g_inplace.data(), g_inplace.data(), up.data(), n);
    CHECK(g_inplace == out);
  }
}
