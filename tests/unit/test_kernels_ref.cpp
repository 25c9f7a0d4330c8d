// The CPU references of the CUDA kernels (services/worker/kernels/reference.h) against naive
// double-precision loops on odd sizes, and RoPE against the CPU engine's RopeTable (the CUDA
// backend is checked against the CPU engine through these references).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "services/worker/engine/core/rope.h"
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
      // Naive double loop.
      auto naive = [&](const std::vector<float>& r0, const std::vector<float>& xs,
                       const std::vector<float>& ws, std::vector<double>& want_res,
                       std::vector<double>& want) {
        want_res.assign(nc, 0.0);
        want.assign(nc, 0.0);
        for (int64_t r = 0; r < rows; ++r) {
          double ss = 0;
          for (int64_t i = 0; i < cols; ++i) {
            const size_t k = static_cast<size_t>(r * cols + i);
            want_res[k] = static_cast<double>(r0[k]) + xs[k];
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
      naive(res0, x, w, want_res, want);
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
      ref::rmsnorm_residual(out_plain.data(), res.data(), nullptr, w.data(), rows, cols, eps);
      CHECK(out_plain == out);
    }
  }
}

TEST_CASE("load_kv_rope reference: the engine's RoPE of bf16 pre-RoPE K, one rounding; V as is") {
  std::mt19937 rng(5);
  const int64_t heads = 2;
  const int64_t head_dim = 64;
  std::vector<float> inv_freq(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(std::pow(1e6, -2.0 * i / static_cast<double>(head_dim)));
  }
  for (int64_t n : kSizes) {
    const size_t elems = static_cast<size_t>(n * heads * head_dim);
    std::vector<keep::kernels::Bf16> k(elems), v(elems), k_out(elems), v_out(elems);
    const auto kf = random_floats(rng, elems, -2, 2);
    const auto vf = random_floats(rng, elems, -2, 2);
    for (size_t i = 0; i < elems; ++i) {
      k[i] = keep::kernels::float_to_bf16(kf[i]);
      v[i] = keep::kernels::float_to_bf16(vf[i]);
    }
    std::vector<int32_t> pos(static_cast<size_t>(n));
    std::uniform_int_distribution<int32_t> d(0, 9000);
    for (auto& p : pos) p = d(rng);
    ref::load_kv_rope(k_out.data(), v_out.data(), k.data(), v.data(), pos.data(), inv_freq.data(),
                      n, heads, head_dim);
    // What the CPU engine loads (fp32 K rotated by its RopeTable), rounded once to bf16.
    std::vector<float> engine(elems);
    for (size_t i = 0; i < elems; ++i) engine[i] = keep::kernels::bf16_to_float(k[i]);
    keep::engine::RopeTable table(inv_freq, 4096);
    table.apply(engine.data(), pos.data(), n, heads);
    for (size_t i = 0; i < elems; ++i) {
      REQUIRE(k_out[i].bits == keep::kernels::float_to_bf16(engine[i]).bits);
      REQUIRE(v_out[i].bits == v[i].bits);
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
    }
  }
}

// ---- misc.cu references (reference_misc.cpp) ----

namespace {

std::vector<int32_t> random_positions(std::mt19937& rng, int64_t n) {
  std::uniform_int_distribution<int32_t> d(0, 40000);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (auto& p : pos) p = d(rng);
  pos[0] = 0;
  if (n > 2) pos[1] = 131071;
  if (n > 3) pos[2] = 1000003;
  return pos;
}

std::vector<float> rope_inv_freq(int64_t head_dim, double theta) {
  std::vector<float> inv(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < inv.size(); ++i) {
    inv[i] = static_cast<float>(
        std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim)));
  }
  return inv;
}

}  // namespace

TEST_CASE("embedding_bf16_to_f32 reference widens table rows and zeroes out-of-range ids") {
  std::mt19937 rng(11);
  for (int64_t n : kSizes) {
    for (int64_t hidden : kSizes) {
      const int64_t vocab = 13;
      const auto table = to_bf16(random_floats(rng, static_cast<size_t>(vocab * hidden), -2, 2));
      std::vector<int32_t> ids(static_cast<size_t>(n));
      std::uniform_int_distribution<int32_t> d(-3, static_cast<int32_t>(vocab) + 2);
      for (auto& id : ids) id = d(rng);
      std::vector<float> out(static_cast<size_t>(n * hidden), -7.0f);
      ref::embedding_bf16_to_f32(out.data(), table.data(), ids.data(), n, hidden, vocab);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t i = 0; i < hidden; ++i) {
          const bool in = ids[t] >= 0 && ids[t] < vocab;
          // bf16 is the top half of an fp32: widening appends 16 zero bits.
          float want = 0.0f;
          if (in) {
            const uint32_t u = static_cast<uint32_t>(table[ids[t] * hidden + i].bits) << 16;
            std::memcpy(&want, &u, sizeof want);
          }
          REQUIRE(out[t * hidden + i] == want);
        }
      }
    }
  }
}

TEST_CASE("add_rmsnorm reference: fp32 residual add (+ bias), then HF RMSNorm to bf16, in double") {
  std::mt19937 rng(12);
  const float eps = 1e-6f;
  for (int64_t rows : kSizes) {
    for (int64_t cols : {int64_t{1}, int64_t{3}, int64_t{7}, int64_t{19}, int64_t{733},
                         int64_t{576}, int64_t{3584}}) {
      if (rows * cols > 733 * 733) continue;
      const size_t nc = static_cast<size_t>(rows * cols);
      const auto res0 = random_floats(rng, nc, -3, 3);
      const auto x = to_bf16(random_floats(rng, nc, -3, 3));
      const auto bias = random_floats(rng, static_cast<size_t>(cols), -0.5f, 0.5f);
      const auto w = random_floats(rng, static_cast<size_t>(cols), 0.5f, 1.5f);
      for (int mode = 0; mode < 4; ++mode) {  // 0 x+bias, 1 x, 2 norm only (no x), 3 add only
        const bool with_x = mode != 2;
        const bool with_bias = mode == 0 || mode == 3;
        const bool with_out = mode != 3;
        INFO("rows " << rows << " cols " << cols << " mode " << mode);
        // Naive: the residual in double from the same inputs, then the norm of it.
        std::vector<double> want_res(nc);
        std::vector<double> want(nc);
        for (int64_t r = 0; r < rows; ++r) {
          double ss = 0.0;
          for (int64_t i = 0; i < cols; ++i) {
            const size_t k = static_cast<size_t>(r * cols + i);
            double v = res0[k];
            if (with_x) v += static_cast<double>(bf16_to_float(x[k])) + (with_bias ? bias[i] : 0.0);
            want_res[k] = v;
            ss += v * v;
          }
          const double inv = 1.0 / std::sqrt(ss / static_cast<double>(cols) + eps);
          for (int64_t i = 0; i < cols; ++i) {
            const size_t k = static_cast<size_t>(r * cols + i);
            want[k] = w[i] * want_res[k] * inv;
          }
        }
        auto res = res0;
        std::vector<Bf16> out(nc, Bf16{0x7fc1});  // NaN sentinel
        ref::add_rmsnorm(with_out ? out.data() : nullptr, res.data(), with_x ? x.data() : nullptr,
                         with_bias ? bias.data() : nullptr, w.data(), rows, cols, eps);
        expect_close(res, want_res, 1e-6, 1e-6);
        if (with_out) {
          expect_close(from_bf16(out), want, 1e-3, 8e-3);  // one bf16 rounding
        } else {
          for (const Bf16& b : out) REQUIRE(b.bits == 0x7fc1);
        }
        if (!with_x) CHECK(res == res0);  // norm only: the residual is not written
      }
    }
  }
}

TEST_CASE("gemv references: bf16 products of strided rows, rounded once or added to fp32") {
  // x rows [1, 2, 0.5 | pad] and [-1, 0, 4 | pad]; W rows [1, 1, 1], [2, -1, 0.25] (all exact in
  // bf16), so y = x W^T = [[3.5, 0.125], [3, -1]].
  const float xv[] = {1, 2, 0.5f, 99, -1, 0, 4, 99};
  const float wv[] = {1, 1, 1, 2, -1, 0.25f};
  std::vector<Bf16> x, w;
  for (float v : xv) x.push_back(float_to_bf16(v));
  for (float v : wv) w.push_back(float_to_bf16(v));
  std::vector<Bf16> y(6, float_to_bf16(-7.0f));  // stride 3: the third column must stay
  keep::kernels::ref::gemv(y.data(), 3, x.data(), 4, w.data(), 2, 2, 3);
  const float want[] = {3.5f, 0.125f, -7.0f, 3.0f, -1.0f, -7.0f};
  for (int i = 0; i < 6; ++i) CHECK(bf16_to_float(y[i]) == want[i]);
  std::vector<float> acc = {10.0f, -1.0f, 5.0f, 0.5f};
  keep::kernels::ref::gemv_accumulate(acc.data(), 2, x.data(), 4, w.data(), 2, 2, 3);
  CHECK(acc[0] == 13.5f);
  CHECK(acc[1] == -0.875f);
  CHECK(acc[2] == 8.0f);
  CHECK(acc[3] == -0.5f);
  // fp32 x (not representable in bf16: 1 + 2^-10 stays exact), fp32 y overwritten.
  const float xf[] = {1.0f + 0.0009765625f, 2, 0.5f, 99};
  std::vector<float> yf(2, NAN);
  keep::kernels::ref::gemv(yf.data(), 2, xf, 4, w.data(), 1, 2, 3);
  CHECK(yf[0] == 3.5f + 0.0009765625f);
  CHECK(yf[1] == 0.125f + 2 * 0.0009765625f);
}

TEST_CASE("gather_rows reference copies the indexed rows") {
  std::mt19937 rng(13);
  for (int64_t n : kSizes) {
    for (int64_t cols : kSizes) {
      const int64_t src_rows = 23;
      const auto in = random_floats(rng, static_cast<size_t>(src_rows * cols), -5, 5);
      std::vector<int32_t> rows(static_cast<size_t>(n));
      std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(src_rows) - 1);
      for (auto& r : rows) r = d(rng);
      std::vector<float> out(static_cast<size_t>(n * cols));
      ref::gather_rows(out.data(), in.data(), rows.data(), n, cols);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t i = 0; i < cols; ++i) {
          REQUIRE(out[static_cast<size_t>(t * cols + i)] ==
                  in[static_cast<size_t>(rows[t] * cols + i)]);
        }
      }
    }
  }
}

TEST_CASE("swiglu_rows reference equals silu(gate) * up per [gate | up] row, in double") {
  std::mt19937 rng(14);
  for (int64_t rows : kSizes) {
    for (int64_t inter : {int64_t{1}, int64_t{3}, int64_t{7}, int64_t{19}, int64_t{733}}) {
      auto gu = random_floats(rng, static_cast<size_t>(rows * 2 * inter), -8, 8);
      if (inter >= 2) {
        gu[0] = -200.0f;
        gu[1] = 200.0f;
      }
      const auto gu16 = to_bf16(gu);
      std::vector<double> want(static_cast<size_t>(rows * inter));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < inter; ++i) {
          const double g = bf16_to_float(gu16[static_cast<size_t>(r * 2 * inter + i)]);
          const double u = bf16_to_float(gu16[static_cast<size_t>(r * 2 * inter + inter + i)]);
          want[static_cast<size_t>(r * inter + i)] = g / (1.0 + std::exp(-g)) * u;
        }
      }
      std::vector<Bf16> out(want.size());
      ref::swiglu_rows(out.data(), gu16.data(), rows, inter);
      expect_close(from_bf16(out), want, 1e-3, 8e-3);
    }
  }
}

TEST_CASE("gemm_swiglu reference equals silu(x Wg^T) * (x Wu^T) in double, strided rows") {
  std::mt19937 rng(15);
  for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{19}}) {
    for (int64_t inter : {int64_t{1}, int64_t{7}, int64_t{128}}) {
      for (int64_t in : {int64_t{1}, int64_t{64}, int64_t{733}}) {
        const int64_t xs = in + 3, as = inter + 5;  // strides past the used columns
        const auto x = to_bf16(random_floats(rng, static_cast<size_t>(rows * xs), -2, 2));
        const auto w = to_bf16(random_floats(rng, static_cast<size_t>(2 * inter * in), -1, 1));
        const Bf16 pad = float_to_bf16(-7.0f);
        std::vector<Bf16> act(static_cast<size_t>(rows * as), pad);
        ref::gemm_swiglu(act.data(), as, x.data(), xs, w.data(), rows, inter, in);
        std::vector<double> want(static_cast<size_t>(rows * inter));
        std::vector<float> got(want.size());
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < inter; ++j) {
            double g = 0.0, u = 0.0;
            for (int64_t i = 0; i < in; ++i) {
              const double xi = bf16_to_float(x[static_cast<size_t>(r * xs + i)]);
              g += xi * bf16_to_float(w[static_cast<size_t>(j * in + i)]);
              u += xi * bf16_to_float(w[static_cast<size_t>((inter + j) * in + i)]);
            }
            want[static_cast<size_t>(r * inter + j)] = g / (1.0 + std::exp(-g)) * u;
            got[static_cast<size_t>(r * inter + j)] =
                bf16_to_float(act[static_cast<size_t>(r * as + j)]);
          }
          for (int64_t j = inter; j < as; ++j) {
            REQUIRE(act[static_cast<size_t>(r * as + j)].bits == pad.bits);  // padding untouched
          }
        }
        expect_close(got, want, 1e-3, 8e-3);
      }
    }
  }
}

namespace {

// ref::qkv_finish against a naive double computation and ref::rope / the engine's RopeTable.
void check_qkv_finish(std::mt19937& rng, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                      bool biases, bool outs) {
  INFO("rows " << rows << " heads " << heads << "/" << kv_heads << " hd " << hd << " biases "
               << biases << " outs " << outs);
  const int64_t half = hd / 2;
  const int64_t qd = heads * hd;
  const int64_t kvd = kv_heads * hd;
  const int64_t stride = qd + 2 * kvd;
  const int64_t capacity = 2 * rows + 3;
  const auto inv_freq = rope_inv_freq(hd, 1000000.0);
  const auto pos = random_positions(rng, rows);
  std::vector<int32_t> slots(static_cast<size_t>(capacity));
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(static_cast<size_t>(rows));
  const auto qkv0 = to_bf16(random_floats(rng, static_cast<size_t>(rows * stride), -2, 2));
  const auto bq = random_floats(rng, static_cast<size_t>(qd), -0.5f, 0.5f);
  const auto bk = random_floats(rng, static_cast<size_t>(kvd), -0.5f, 0.5f);
  const auto bv = random_floats(rng, static_cast<size_t>(kvd), -0.5f, 0.5f);

  auto qkv = qkv0;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> k_pre(static_cast<size_t>(rows * kvd), nan);
  std::vector<float> v_out(static_cast<size_t>(rows * kvd), nan);
  std::vector<Bf16> kv_k(static_cast<size_t>(capacity * kvd), float_to_bf16(nan));
  std::vector<Bf16> kv_v(kv_k.size(), float_to_bf16(nan));
  ref::qkv_finish(qkv.data(), outs ? k_pre.data() : nullptr, outs ? v_out.data() : nullptr,
                  kv_k.data(), kv_v.data(), biases ? bq.data() : nullptr,
                  biases ? bk.data() : nullptr, biases ? bv.data() : nullptr, pos.data(),
                  slots.data(), inv_freq.data(), rows, heads, kv_heads, hd);

  // Naive double: the biased inputs, rotated by the fp32 angle.
  auto in = [&](int64_t r, int64_t col) {
    return static_cast<double>(bf16_to_float(qkv0[static_cast<size_t>(r * stride + col)]));
  };
  std::vector<double> want_q(static_cast<size_t>(rows * qd));
  std::vector<double> want_k(static_cast<size_t>(rows * kvd));
  std::vector<double> want_v(static_cast<size_t>(rows * kvd));
  std::vector<float> exact_kpre(static_cast<size_t>(rows * kvd));  // fp32 biased K and V
  std::vector<float> exact_v(static_cast<size_t>(rows * kvd));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<float>(pos[r]) * inv_freq[i];
      const double c = std::cos(angle);
      const double s = std::sin(angle);
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const bool is_q = h < heads;
        const int64_t col = h * hd + i;  // Q then K are contiguous in a row
        const float* b = is_q ? bq.data() + h * hd : bk.data() + (h - heads) * hd;
        const double x1 = in(r, col) + (biases ? b[i] : 0.0);
        const double x2 = in(r, col + half) + (biases ? b[i + half] : 0.0);
        double* dst = is_q ? &want_q[r * qd + h * hd] : &want_k[r * kvd + (h - heads) * hd];
        dst[i] = x1 * c - x2 * s;
        dst[i + half] = x2 * c + x1 * s;
      }
    }
    for (int64_t e = 0; e < kvd; ++e) {
      exact_kpre[r * kvd + e] = bf16_to_float(qkv0[r * stride + qd + e]) + (biases ? bk[e] : 0.0f);
      exact_v[r * kvd + e] =
          bf16_to_float(qkv0[r * stride + qd + kvd + e]) + (biases ? bv[e] : 0.0f);
      want_v[r * kvd + e] = in(r, qd + kvd + e) + (biases ? bv[e] : 0.0);
    }
  }
  // Q rotated in place (bf16), K and V of the fused row untouched.
  std::vector<float> got_q(static_cast<size_t>(rows * qd));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < qd; ++e) got_q[r * qd + e] = bf16_to_float(qkv[r * stride + e]);
    for (int64_t e = qd; e < stride; ++e)
      REQUIRE(qkv[r * stride + e].bits == qkv0[r * stride + e].bits);
  }
  expect_close(got_q, want_q, 2e-2, 1e-2);
  // k_pre and v_out: the biased values in fp32, exactly.
  if (outs) {
    CHECK(k_pre == exact_kpre);
    CHECK(v_out == exact_v);
    expect_close(v_out, want_v, 1e-6, 1e-6);
  } else {
    for (float v : k_pre) REQUIRE(std::isnan(v));
    for (float v : v_out) REQUIRE(std::isnan(v));
  }
  // The view: rotated K / V at slots[r], NaN elsewhere.
  std::vector<float> got_k(static_cast<size_t>(rows * kvd));
  std::vector<float> got_v(static_cast<size_t>(rows * kvd));
  std::vector<bool> written(static_cast<size_t>(capacity), false);
  for (int64_t r = 0; r < rows; ++r) {
    written[slots[r]] = true;
    for (int64_t e = 0; e < kvd; ++e) {
      got_k[r * kvd + e] = bf16_to_float(kv_k[slots[r] * kvd + e]);
      got_v[r * kvd + e] = bf16_to_float(kv_v[slots[r] * kvd + e]);
    }
  }
  for (int64_t s = 0; s < capacity; ++s) {
    if (written[s]) continue;
    for (int64_t e = 0; e < kvd; ++e) {
      REQUIRE(std::isnan(bf16_to_float(kv_k[s * kvd + e])));
      REQUIRE(std::isnan(bf16_to_float(kv_v[s * kvd + e])));
    }
  }
  expect_close(got_k, want_k, 2e-2, 1e-2);
  expect_close(got_v, want_v, 1e-2, 4e-3);

  // The rotated K is exactly ref::rope of the pre-RoPE K (then one rounding to bf16), and that is
  // the CPU engine's RopeTable (table for positions < 4096, on the fly beyond).
  auto rotated = exact_kpre;
  ref::rope(rotated.data(), pos.data(), inv_freq.data(), rows, kv_heads, hd, kvd);
  auto engine = exact_kpre;
  keep::engine::RopeTable table(inv_freq, 4096);
  table.apply(engine.data(), pos.data(), rows, kv_heads);
  CHECK(engine == rotated);
  for (size_t i = 0; i < rotated.size(); ++i) {
    const Bf16 want = float_to_bf16(rotated[i]);
    const Bf16 got = kv_k[static_cast<size_t>(slots[i / static_cast<size_t>(kvd)]) * kvd +
                          i % static_cast<size_t>(kvd)];
    REQUIRE(std::memcmp(&got, &want, sizeof(Bf16)) == 0);
    // V in the view is the biased fp32 V rounded once to bf16.
    const Bf16 want_v_kv = float_to_bf16(exact_v[i]);
    const Bf16 got_v_kv = kv_v[static_cast<size_t>(slots[i / static_cast<size_t>(kvd)]) * kvd +
                               i % static_cast<size_t>(kvd)];
    REQUIRE(std::memcmp(&got_v_kv, &want_v_kv, sizeof(Bf16)) == 0);
  }
}

}  // namespace

TEST_CASE("qkv_finish reference: bias, RoPE on Q in place, K/V to the view, pre-RoPE K / V out") {
  std::mt19937 rng(15);
  struct Shape {
    int64_t heads, kv_heads, hd;
  };
  for (int64_t rows : kSizes) {
    for (const Shape& s : {Shape{9, 3, 64}, Shape{28, 4, 128}, Shape{3, 1, 6}, Shape{2, 2, 14}}) {
      if (rows == 733 && s.heads == 28) continue;  // keep the test quick
      for (int variant = 0; variant < 3; ++variant) {
        const bool biases = variant != 1;
        const bool outs = variant != 2;
        check_qkv_finish(rng, rows, s.heads, s.kv_heads, s.hd, biases, outs);
      }
    }
  }
}

TEST_CASE("fill_uniform reference: splitmix64 stream, in [lo, hi), seed-dependent, not constant") {
  // An independent splitmix64 (Steele et al.'s sequential form): state starts at the seed's
  // scrambled value and advances by the golden gamma per value; the fill's value i is output i.
  struct SplitMix {
    uint64_t state;
    uint64_t next() {
      state += 0x9e3779b97f4a7c15ull;
      uint64_t z = state;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      return z ^ (z >> 31);
    }
  };
  for (uint64_t seed : {uint64_t{0}, uint64_t{1}, uint64_t{42}, ~uint64_t{0}}) {
    for (const std::pair<float, float>& range : {std::pair{-1.0f, 1.0f}, std::pair{0.0f, 1.0f},
                                                 std::pair{-0.02f, 0.02f}, std::pair{2.0f, 3.0f}}) {
      const float lo = range.first;
      const float hi = range.second;
      INFO("seed " << seed << " [" << lo << ", " << hi << ")");
      const int64_t n = 20000;
      std::vector<float> f(static_cast<size_t>(n));
      std::vector<Bf16> b(static_cast<size_t>(n));
      ref::fill_uniform<float>(f.data(), n, seed, lo, hi);
      ref::fill_uniform<Bf16>(b.data(), n, seed, lo, hi);
      // mix64(seed) is splitmix64's output for state == seed; start the stream there.
      SplitMix ref_seed{seed - 0x9e3779b97f4a7c15ull};
      SplitMix stream{ref_seed.next()};
      double sum = 0.0;
      std::vector<float> distinct;
      for (int64_t i = 0; i < n; ++i) {
        const double u = static_cast<double>(stream.next() >> 40) / 16777216.0;
        const double want = lo + (static_cast<double>(hi) - lo) * u;
        REQUIRE(f[i] >= lo);
        REQUIRE(f[i] < hi);
        REQUIRE(std::fabs(f[i] - want) <= 1e-6 * std::max(std::fabs(lo), std::fabs(hi)));
        const float fb = bf16_to_float(b[i]);
        REQUIRE(fb >= lo);
        REQUIRE(fb < hi);
        // One bf16 rounding, or one bf16 step down from hi: at most one bf16 ulp.
        REQUIRE(std::fabs(fb - want) <= std::fabs(want) * 0x1p-7 + 1e-7 * std::fabs(hi - lo));
        sum += f[i];
        if (distinct.size() < 2 && (distinct.empty() || distinct[0] != f[i]))
          distinct.push_back(f[i]);
      }
      CHECK(distinct.size() == 2);  // not constant
      CHECK(std::fabs(sum / n - 0.5 * (static_cast<double>(lo) + hi)) < 0.02 * (hi - lo));
      // Counter-based: a shorter fill is a prefix; the same seed gives the same bits.
      std::vector<float> prefix(19);
      ref::fill_uniform<float>(prefix.data(), 19, seed, lo, hi);
      CHECK(std::equal(prefix.begin(), prefix.end(), f.begin()));
      // Another seed gives other values.
      std::vector<float> other(static_cast<size_t>(n));
      ref::fill_uniform<float>(other.data(), n, seed + 1, lo, hi);
      int64_t same = 0;
      for (int64_t i = 0; i < n; ++i) same += other[i] == f[i];
      CHECK(same < n / 100);
    }
  }
  // Ranges one step wide: rounding up to hi is moved back below it.
  std::vector<Bf16> b(4099);
  ref::fill_uniform<Bf16>(b.data(), 4099, 5, 1.0f, 1.0078125f);
  for (const Bf16& v : b) REQUIRE(bf16_to_float(v) == 1.0f);
  std::vector<float> f(4099);
  ref::fill_uniform<float>(f.data(), 4099, 5, 1.0f, std::nextafter(1.0f, 2.0f));
  for (float v : f) REQUIRE(v == 1.0f);
  std::vector<float> neg(4099);
  ref::fill_uniform<float>(neg.data(), 4099, 5, -1.0f, std::nextafter(-1.0f, 0.0f));
  for (float v : neg) REQUIRE(v == -1.0f);
}
