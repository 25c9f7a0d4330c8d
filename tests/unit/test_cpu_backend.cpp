// The CPU backend against a plain double-precision re-implementation of the Qwen2 / Llama forward
// pass written from the HF modeling code (no BLAS, no workspace, no layouts), on odd sizes.
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>

#include "services/worker/engine/core/engine.h"
#include "services/worker/engine/core/rope.h"
#include "services/worker/engine/cpu/cpu_backend.h"
#include "tests/unit/engine_test_model.h"

using namespace keep::engine;
using keep::engine::testing::make_tiny_model;
using keep::engine::testing::random_tokens;
using keep::engine::testing::TinyShape;

namespace {

using Mat = std::vector<double>;  // row-major

// y (n, out) = x (n, in) W^T (+ b)
Mat linear(const Mat& x, const Tensor& w, const Tensor& b, int64_t n) {
  const int64_t out = w.dim(0), in = w.dim(1);
  Mat y(n * out);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = b.empty() ? 0.0 : b.data[o];
      for (int64_t i = 0; i < in; ++i) s += x[r * in + i] * w.data[o * in + i];
      y[r * out + o] = s;
    }
  }
  return y;
}

Mat rms(const Mat& x, const Tensor& w, int64_t n, double eps) {
  const int64_t c = w.dim(0);
  Mat y(x.size());
  for (int64_t r = 0; r < n; ++r) {
    double ss = 0.0;
    for (int64_t i = 0; i < c; ++i) ss += x[r * c + i] * x[r * c + i];
    const double inv = 1.0 / std::sqrt(ss / c + eps);
    for (int64_t i = 0; i < c; ++i) y[r * c + i] = w.data[i] * x[r * c + i] * inv;
  }
  return y;
}

// HF apply_rotary_pos_emb on (n, heads, hd), positions = first + row.
void rope(Mat& x, int64_t n, int64_t heads, int64_t hd, const std::vector<float>& inv_freq,
          int64_t first) {
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      double* v = &x[(r * heads + h) * hd];
      for (int64_t i = 0; i < hd / 2; ++i) {
        const double a = static_cast<double>(static_cast<float>(r + first) * inv_freq[i]);
        const double x1 = v[i], x2 = v[i + hd / 2];
        v[i] = x1 * std::cos(a) - x2 * std::sin(a);
        v[i + hd / 2] = x2 * std::cos(a) + x1 * std::sin(a);
      }
    }
  }
}

// Logits (n, vocab) of a causal forward over `tokens` at positions first.., and per layer the
// log-sum-exp (n, heads).
Mat reference_forward(const ModelWeights& w, const std::vector<int32_t>& tokens, int64_t first,
                      std::vector<Mat>* lse_out) {
  const ModelConfig& c = w.config;
  const int64_t n = static_cast<int64_t>(tokens.size()), C = c.hidden_size, H = c.num_heads,
                KV = c.num_kv_heads, hd = c.head_dim;
  const auto inv_freq = rope_inv_freq(c);
  Mat h(n * C);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < C; ++i) h[r * C + i] = w.embed.data[tokens[r] * C + i];
  }
  for (const LayerWeights& lw : w.layers) {
    Mat x = rms(h, lw.attn_norm, n, c.rms_norm_eps);
    Mat q = linear(x, lw.wq, lw.bq, n), k = linear(x, lw.wk, lw.bk, n),
        v = linear(x, lw.wv, lw.bv, n);
    rope(q, n, H, hd, inv_freq, first);
    rope(k, n, KV, hd, inv_freq, first);
    Mat att(n * H * hd, 0.0), lse(n * H);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t hh = 0; hh < H; ++hh) {
        const int64_t kh = hh / (H / KV);
        std::vector<double> s(r + 1);
        double mx = -1e300;
        for (int64_t t = 0; t <= r; ++t) {
          double d = 0.0;
          for (int64_t i = 0; i < hd; ++i)
            d += q[(r * H + hh) * hd + i] * k[(t * KV + kh) * hd + i];
          s[t] = d / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[t]);
        }
        double z = 0.0;
        for (double& e : s) z += std::exp(e - mx);
        lse[r * H + hh] = mx + std::log(z);
        for (int64_t t = 0; t <= r; ++t) {
          const double p = std::exp(s[t] - mx) / z;
          for (int64_t i = 0; i < hd; ++i)
            att[(r * H + hh) * hd + i] += p * v[(t * KV + kh) * hd + i];
        }
      }
    }
    if (lse_out) lse_out->push_back(lse);
    Mat o = linear(att, lw.wo, lw.bo, n);
    for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];
    x = rms(h, lw.ffn_norm, n, c.rms_norm_eps);
    Mat g = linear(x, lw.w_gate, Tensor(), n), u = linear(x, lw.w_up, Tensor(), n);
    for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
    Mat d = linear(g, lw.w_down, Tensor(), n);
    for (size_t i = 0; i < h.size(); ++i) h[i] += d[i];
  }
  Mat x = rms(h, w.final_norm, n, c.rms_norm_eps);
  return linear(x, w.output_weight(), Tensor(), n);
}

}  // namespace

TEST_CASE("CPU backend logits and log-sum-exp equal a double-precision reference") {
  const TinyShape shapes[] = {
      TinyShape{},
      TinyShape{Arch::kLlama, 101, 40, 2, 5, 5, 8, 56, true, false, false},
      TinyShape{Arch::kLlama, 64, 32, 2, 4, 1, 8, 40, false, true, true},
      TinyShape{Arch::kQwen2, 33, 24, 1, 3, 1, 8, 19, true, true, false},
  };
  for (const TinyShape& shape : shapes) {
    for (int32_t n : {1, 3, 7, 19}) {
      for (int32_t first : {0, 5}) {
        CAPTURE(n);
        CAPTURE(first);
        auto weights = make_tiny_model(shape, 100 + n);
        auto backend = CpuBackend::create(weights, {2, 0});
        REQUIRE(backend.is_ok());
        auto engine = Engine::create(std::move(backend).value(), 8);
        REQUIRE(engine.is_ok());
        Engine& e = **engine;
        const auto tokens = random_tokens(n, shape.vocab, 7 + n);
        std::vector<Mat> ref_lse;
        const Mat ref = reference_forward(*weights, tokens, first, &ref_lse);

        auto hidden = e.allocate_hidden(n);
        auto cache = KvCache::create(e.backend(), n);
        auto lse = e.backend().allocate(n * shape.heads);
        REQUIRE(e.embed(*hidden, tokens).is_ok());
        auto plan = e.plan(AttentionLayout::causal(n, 0, first));
        REQUIRE(plan.is_ok());
        for (int32_t l = 0; l < shape.layers; ++l) {
          LayerExtras ex;
          ex.lse = &*lse;
          REQUIRE(e.prefill_layer(l, *hidden, cache->layer(l), **plan, ex).is_ok());
          for (int64_t i = 0; i < n * shape.heads; ++i) {
            REQUIRE(std::isfinite(lse->data()[i]));
            CHECK(lse->data()[i] == doctest::Approx(ref_lse[l][i]).epsilon(1e-4).scale(1.0));
          }
        }
        std::vector<int32_t> rows(n);
        std::iota(rows.begin(), rows.end(), 0);
        auto logits = e.logits(*hidden, rows);
        REQUIRE(logits.is_ok());
        double worst = 0.0;
        for (size_t i = 0; i < ref.size(); ++i) {
          REQUIRE(std::isfinite((*logits)[i]));
          worst = std::max(worst, std::fabs((*logits)[i] - ref[i]));
        }
        CHECK(worst < 2e-4);
      }
    }
  }
}

TEST_CASE("RoPE table: half-split rotation, positions past the table, relative invariance") {
  std::vector<float> inv = {1.0f, 0.1f, 0.01f};
  RopeTable t(inv, 16);
  CHECK(t.head_dim() == 6);
  std::vector<float> x = {1, 2, 3, 4, 5, 6, -1, 0.5f, 2, 3, -2, 1};  // 2 heads
  for (int32_t pos : {0, 3, 15, 16, 1000}) {
    std::vector<float> y = x;
    t.apply(y.data(), &pos, 1, 2);
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 3; ++i) {
        const double a = static_cast<float>(pos) * inv[i];
        const double x1 = x[h * 6 + i], x2 = x[h * 6 + i + 3];
        CHECK(y[h * 6 + i] == doctest::Approx(x1 * std::cos(a) - x2 * std::sin(a)).epsilon(1e-6));
        CHECK(y[h * 6 + i + 3] ==
              doctest::Approx(x2 * std::cos(a) + x1 * std::sin(a)).epsilon(1e-6));
      }
    }
  }
  // q at position p+d against k at position p: the score depends on d only.
  std::vector<float> q = {0.3f, -1, 2, 0.5f, 1, -0.7f}, k = {1, 0.2f, -0.4f, 2, -1, 0.3f};
  auto score = [&](int32_t pq, int32_t pk) {
    std::vector<float> a = q, b = k;
    t.apply(a.data(), &pq, 1, 1);
    t.apply(b.data(), &pk, 1, 1);
    double s = 0;
    for (int i = 0; i < 6; ++i) s += a[i] * b[i];
    return s;
  };
  CHECK(score(7, 2) == doctest::Approx(score(12, 7)).epsilon(1e-5));
  CHECK(score(7, 2) == doctest::Approx(score(105, 100)).epsilon(1e-4));
}

TEST_CASE("workspace: reserve grows, refuses nonsense, and allocations are zeroed") {
  auto backend = CpuBackend::create(make_tiny_model(TinyShape{}, 1), {1, 0});
  REQUIRE(backend.is_ok());
  Backend& b = **backend;
  CHECK(b.reserve(0, 5).code() == keep::Code::kInvalidArgument);
  REQUIRE(b.reserve(4, 9).is_ok());
  REQUIRE(b.reserve(2, 20).is_ok());
  CHECK(b.reserved_rows() == 4);
  CHECK(b.reserved_keys() == 20);
  auto buf = b.allocate(37);
  REQUIRE(buf.is_ok());
  CHECK(buf->size() == 37);
  for (size_t i = 0; i < 37; ++i) CHECK(buf->data()[i] == 0.0f);
  CHECK(b.name().find("cpu fp32") == 0);
  ModelWeights broken = *make_tiny_model(TinyShape{}, 1);
  broken.layers[1].wk = Tensor({3, 3});
  auto bad = CpuBackend::create(std::make_shared<ModelWeights>(std::move(broken)));
  CHECK(bad.status().code() == keep::Code::kInvalidArgument);
}
