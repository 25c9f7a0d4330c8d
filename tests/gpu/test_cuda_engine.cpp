// The engine on the CUDA backend (label gpu; runs on a GPU machine only).
//   1. SmolLM2-135M-Instruct (GGUF) against the fixture logits and greedy continuations that the
//      CPU backend reproduces to 3e-5 (tests/integration/test_engine_vs_hf.cpp): same top-1 on
//      every prompt, small KL over the whole vocabulary, identical greedy continuations on most;
//      in every logits mode and, on Hopper, with the mma.sync prefill attention as well as wgmma.
//   2. The layer API on random models (head_dim 64 and 128): every way of computing KV that the
//      recompute planner relies on agrees with a plain full prefill, within bf16 tolerances.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <vector>

#include <cuda_runtime.h>

#include "services/worker/engine/core/engine.h"
#include "services/worker/engine/core/replay_cache.h"
#include "services/worker/engine/cuda/cuda_backend.h"
#include "services/worker/kernels/kernels.h"
#include "shared/model/hf_loader.h"
#include "shared/model/model_weights.h"
#include "tests/engine_fixture.h"
#include "tests/hf_dir_writer.h"
#include "tests/unit/engine_test_model.h"
#include "tests/unit/replay_scenario.h"

using namespace keep::engine;
using keep::engine::testing::check_recorded_prefills;
using keep::engine::testing::make_tiny_model;
using keep::engine::testing::prefill_keeping_rows;
using keep::engine::testing::random_tokens;
using keep::engine::testing::RecordingHooks;
using keep::engine::testing::TinyShape;

namespace {

std::vector<float> to_host(Backend& b, const float* p, size_t n) {
  std::vector<float> h(n);
  b.copy_to_host(h.data(), p, n);
  return h;
}

// The first n elements of a bf16 view array, as floats.
std::vector<float> view_to_host(Backend& b, const void* p, size_t n) {
  b.synchronize();
  std::vector<uint16_t> raw(n);
  REQUIRE(cudaMemcpy(raw.data(), p, n * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
  std::vector<float> h(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
    std::memcpy(&h[i], &bits, 4);
  }
  return h;
}

// ||a - b|| / ||b||, NaN-propagating.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b, size_t off = 0,
                size_t n = SIZE_MAX) {
  n = std::min(n, b.size() - off);
  double num = 0.0, den = 0.0;
  for (size_t i = off; i < off + n; ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

std::unique_ptr<Engine> cuda_engine(const ModelWeights& w, int32_t max_rows,
                                    const CudaBackendOptions& options = {}) {
  auto backend = CudaBackend::create(w, options);
  REQUIRE_MESSAGE(backend.is_ok(), backend.status().to_string());
  auto engine = Engine::create(std::move(backend).value(), max_rows);
  REQUIRE(engine.is_ok());
  return std::move(engine).value();
}

// ---- 1. SmolLM2 ----

TEST_CASE("SmolLM2-135M-Instruct on CUDA: same top-1 as the CPU backend, small KL, same greedy") {
  const std::string gguf = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(gguf)) {
    MESSAGE("skipped: " << gguf << " missing");
    return;
  }
  const keep::testing::EngineFixture fx = keep::testing::load_engine_fixture("smollm2");
  const auto& ref = fx.ref;
  const int64_t vocab = fx.vocab;
  const auto& prompts = fx.prompts();

  LoadOptions lo;
  lo.load_tokenizer = false;
  auto loaded = load_model(gguf, lo);
  REQUIRE_MESSAGE(loaded.is_ok(), loaded.status().to_string());
  using Logits = CudaBackendOptions::Logits;
  using keep::kernels::PrefillKernel;
  // Every logits mode with the default attention; and, where the default is wgmma, the default
  // logits with the mma.sync attention and with the two-warpgroup kernel (which the default picks
  // only for views of 4096 keys or more), so every form of the prefill kernel runs end to end,
  // and with gemm_swiglu for every prefill (the prompts are shorter than its default threshold);
  // and one where every cuBLAS product of 16 rows or more takes a tuned cuBLASLt algorithm (margin
  // -1: kept even where cuBLAS's default pick is faster), so GemmTuner's path runs end to end.
  struct Config {
    Logits logits;
    PrefillKernel attention;
    int32_t fused_swiglu_rows = CudaBackendOptions{}.fused_swiglu_rows;
    int32_t gemm_autotune_rows = CudaBackendOptions{}.gemm_autotune_rows;
    double gemm_autotune_margin = CudaBackendOptions{}.gemm_autotune_margin;
  };
  std::vector<Config> configs = {{Logits::kF32Rows, PrefillKernel::kAuto},
                                 {Logits::kF32, PrefillKernel::kAuto},
                                 {Logits::kBF16, PrefillKernel::kAuto}};
  if (keep::kernels::wgmma_available()) {
    configs.push_back({Logits::kF32Rows, PrefillKernel::kMma});
    configs.push_back({Logits::kF32Rows, PrefillKernel::kWgmmaWide});
    configs.push_back({Logits::kF32Rows, PrefillKernel::kAuto, 1});
  }
  configs.push_back(
      {Logits::kF32Rows, PrefillKernel::kAuto, CudaBackendOptions{}.fused_swiglu_rows, 16, -1.0});
  for (const Config& config : configs) {
    CudaBackendOptions opt;
    const bool is_default = config.logits == opt.logits;
    opt.logits = config.logits;
    opt.prefill_attention = config.attention;
    opt.fused_swiglu_rows = config.fused_swiglu_rows;
    opt.gemm_autotune_rows = config.gemm_autotune_rows;
    opt.gemm_autotune_margin = config.gemm_autotune_margin;
    auto e = cuda_engine(loaded->weights, 256, opt);
    MESSAGE("backend: " << e->backend().name());

    double worst_kl = 0.0, worst_top_diff = 0.0;
    int same_greedy = 0, top1 = 0;
    for (size_t p = 0; p < prompts.size(); ++p) {
      CAPTURE(p);
      const auto& pr = prompts[p];
      const auto ids = pr["ids"].get<std::vector<int32_t>>();
      auto cache = KvCache::create(e->backend(), static_cast<int32_t>(ids.size()) + 40);
      REQUIRE(cache.is_ok());
      auto logits = e->prefill(*cache, ids);
      REQUIRE_MESSAGE(logits.is_ok(), logits.status().to_string());
      const auto top_ids = pr["top_ids"].get<std::vector<int32_t>>();
      const auto top_logits = pr["top_logits"].get<std::vector<double>>();
      const int32_t got_top = argmax(*logits);
      // bf16 weights put the logits within ~0.12 of fp32 (max |diff| of the top 10, reported
      // below); the nearest reference top-2 margin is 0.055, and the top-1 still holds on every
      // prompt since the residual stream takes each sublayer's product unrounded (fp32 accumulate).
      const double margin = top_logits[0] - top_logits[1];
      if (is_default) {  // the other modes are reported, not held to it
        CHECK_MESSAGE(got_top == top_ids[0], "prompt " << p << ": top-1 " << got_top << " vs "
                                                       << top_ids[0] << " (reference margin "
                                                       << margin << ")");
      }
      top1 += got_top == top_ids[0];
      for (size_t i = 0; i < 10; ++i) {
        worst_top_diff = std::max(worst_top_diff, std::fabs((*logits)[top_ids[i]] - top_logits[i]));
      }
      // KL(reference || cuda) over the whole vocabulary, in double.
      double mr = -INFINITY, mc = -INFINITY;
      for (int64_t v = 0; v < vocab; ++v) {
        mr = std::max(mr, double(fx.logit(p, v)));
        mc = std::max(mc, double((*logits)[v]));
      }
      double zr = 0.0, zc = 0.0;
      for (int64_t v = 0; v < vocab; ++v) {
        zr += std::exp(fx.logit(p, v) - mr);
        zc += std::exp((*logits)[v] - mc);
      }
      double kl = 0.0;
      for (int64_t v = 0; v < vocab; ++v) {
        const double lr = fx.logit(p, v) - mr - std::log(zr);
        const double lc = (*logits)[v] - mc - std::log(zc);
        kl += std::exp(lr) * (lr - lc);
      }
      worst_kl = std::max(worst_kl, kl);
      CHECK(kl < 5e-3);

      GenerateOptions g;
      g.max_tokens = ref["steps"].get<int32_t>();
      g.stop_at_eos = false;
      auto gen = e->generate(ids, g);
      REQUIRE(gen.is_ok());
      same_greedy += *gen == pr["greedy"].get<std::vector<int32_t>>();
    }
    MESSAGE("SmolLM2 CUDA (" << e->backend().name() << ") vs CPU/HF fixture: top-1 " << top1 << "/"
                             << prompts.size() << ", max KL " << worst_kl
                             << ", max |top-10 logit diff| " << worst_top_diff
                             << ", identical greedy " << same_greedy << "/" << prompts.size());
    CHECK(2 * same_greedy > static_cast<int>(prompts.size()));
  }
}

// ---- 2. the layer API ----

const TinyShape kShapes[] = {
    // Qwen2 with q/k/v bias, GQA 4/2, hd 64
    TinyShape{Arch::kQwen2, 300, 256, 3, 4, 2, 64, 384, false, true, false},
    // Llama, MQA 2/1, hd 128, tied, o bias, llama3 rope
    TinyShape{Arch::kLlama, 211, 256, 2, 2, 1, 128, 320, true, true, true},
};

struct Full {
  std::vector<std::vector<float>> k_pre, v, lse, view_k;  // per layer
  std::vector<float> hidden;                              // (rows, C) after the last layer
};

// Runs the plan's rows through every layer, with `load(l, view)` before layer l.
template <typename LoadFn>
Full run_layers(Engine& e, KvCache& cache, const std::vector<int32_t>& tokens,
                const AttentionLayout& layout, LoadFn load,
                std::vector<std::vector<float>>* pooled = nullptr) {
  const ModelConfig& c = e.config();
  auto& be = e.backend();
  const auto rows = static_cast<int32_t>(tokens.size());
  auto hidden = e.allocate_hidden(rows);
  REQUIRE(hidden.is_ok());
  REQUIRE(e.embed(*hidden, tokens).is_ok());
  auto plan = e.plan(layout);
  REQUIRE_MESSAGE(plan.is_ok(), plan.status().to_string());
  auto k_pre = be.allocate(rows * c.kv_dim());
  auto v = be.allocate(rows * c.kv_dim());
  auto lse = be.allocate(rows * c.num_heads);
  auto pool = be.allocate(rows * std::max(layout.num_groups, 1));
  Full f;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    load(l, cache.layer(l));
    LayerExtras ex{&*k_pre, &*v, &*lse, layout.num_groups > 0 ? &*pool : nullptr};
    auto st = e.prefill_layer(l, *hidden, cache.layer(l), **plan, ex);
    REQUIRE_MESSAGE(st.is_ok(), st.to_string());
    f.k_pre.push_back(to_host(be, k_pre->data(), rows * c.kv_dim()));
    f.v.push_back(to_host(be, v->data(), rows * c.kv_dim()));
    f.lse.push_back(to_host(be, lse->data(), rows * c.num_heads));
    f.view_k.push_back(view_to_host(be, cache.layer(l).k, size_t(layout.num_keys) * c.kv_dim()));
    if (pooled != nullptr) pooled->push_back(to_host(be, pool->data(), rows * layout.num_groups));
  }
  f.hidden = to_host(be, hidden->data(), rows * c.hidden_size);
  return f;
}

TEST_CASE("CUDA layer API: chunked and token-by-token prefill equal one causal prefill") {
  for (const TinyShape& s : kShapes) {
    auto w = make_tiny_model(s, 11);
    auto e = cuda_engine(*w, 256);
    const auto tokens = random_tokens(150, s.vocab, 3);
    auto c1 = KvCache::create(e->backend(), 160);
    auto one = e->prefill(*c1, tokens);  // 150 rows: the tiled kernel
    REQUIRE(one.is_ok());
    for (const int32_t chunk : {7, 1}) {  // few rows: the split-key kernel
      CAPTURE(chunk);
      auto c2 = KvCache::create(e->backend(), 160);
      std::vector<float> last;
      for (size_t a = 0; a < tokens.size(); a += chunk) {
        const size_t n = std::min<size_t>(chunk, tokens.size() - a);
        auto r = e->prefill(*c2, std::span<const int32_t>(tokens).subspan(a, n));
        REQUIRE(r.is_ok());
        last = *r;
      }
      CHECK(rel_diff(last, *one) < 4e-2);  // bf16 activations through other product shapes
      CHECK(argmax(last) == argmax(*one));
      const ModelConfig& c = e->config();
      for (int32_t l = 0; l < c.num_layers; ++l) {
        const size_t n = tokens.size() * c.kv_dim();
        CHECK(rel_diff(view_to_host(e->backend(), c2->layer(l).k, n),
                       view_to_host(e->backend(), c1->layer(l).k, n)) < 4e-2);
      }
    }
  }
}

// The persisting L2 window over the residual (CudaBackendOptions::l2_persist_residual) is a cache
// policy only: with and without it, a prefill's logits, generation and cached K are bit-identical,
// also when an engine's layer calls move to another hidden buffer (the window follows it).
TEST_CASE("CUDA l2_persist_residual: bit-identical results with and without the window") {
  const TinyShape& s = kShapes[0];  // no o_proj bias: o_proj and down accumulate into the residual
  auto w = make_tiny_model(s, 17);
  const auto tokens = random_tokens(150, s.vocab, 5);
  GenerateOptions g;
  g.max_tokens = 6;
  g.stop_at_eos = false;
  std::vector<std::vector<float>> logits, k0, moved;
  std::vector<std::vector<int32_t>> gen;
  for (const bool persist : {true, false}) {
    CAPTURE(persist);
    CudaBackendOptions o;
    o.l2_persist_residual = persist;
    auto e = cuda_engine(*w, 256, o);
    auto cache = KvCache::create(e->backend(), 160);
    auto lg = e->prefill(*cache, tokens);
    REQUIRE(lg.is_ok());
    logits.push_back(*lg);
    k0.push_back(
        view_to_host(e->backend(), cache->layer(0).k, tokens.size() * e->config().kv_dim()));
    auto out = e->generate(tokens, g);
    REQUIRE(out.is_ok());
    gen.push_back(*out);
    // Layer calls on a buffer of the caller's: the first layer's output rows.
    auto hidden = e->allocate_hidden(40);
    REQUIRE(hidden.is_ok());
    REQUIRE(e->embed(*hidden, std::span<const int32_t>(tokens).first(40)).is_ok());
    auto plan = e->plan(AttentionLayout::causal(40, 0));
    REQUIRE(plan.is_ok());
    auto c2 = KvCache::create(e->backend(), 40);
    REQUIRE(e->prefill_layer(0, *hidden, c2->layer(0), **plan, LayerExtras{}).is_ok());
    moved.push_back(to_host(e->backend(), hidden->data(), hidden->size()));
  }
  CHECK(logits[0] == logits[1]);
  CHECK(k0[0] == k0[1]);
  CHECK(gen[0] == gen[1]);
  CHECK(moved[0] == moved[1]);
}

TEST_CASE("CUDA own_few_rows: few-row products on our kernels agree with cuBLAS's") {
  // kShapes[0] fits our products (QKV 512, o_proj 256, down 256 x 384, gate/up 2 x 384), so
  // calls of 3-128 rows run them in one-CTA clusters (gate/up with the SwiGLU fused); own_few_rows
  // 0 puts the same calls on cuBLAS. Prefill chunks of 100 (the tiled attention), 37 and 5 rows.
  // The first engine also leaves all but one SM to the loader (loader_blocks = SMs - 1): our
  // few-row products on a one-CTA grid, cuBLAS's sized for one SM (blas_leave_loader), the same
  // results. (gemm_leave_loader caps only while loads run: none here; test_gemm checks the capped
  // grids of the tuner's picks and gemm_swiglu.)
  const TinyShape& s = kShapes[0];
  auto w = make_tiny_model(s, 23);
  const auto tokens = random_tokens(142, s.vocab, 9);
  std::vector<std::vector<float>> logits, k_last;
  for (const int32_t own : {128, 0}) {
    CAPTURE(own);
    CudaBackendOptions o;
    o.own_few_rows = own;
    if (own > 0) {
      int sms = 0;
      REQUIRE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess);
      o.gemm_leave_loader = o.blas_leave_loader = true;
      o.loader_blocks = std::max(sms - 1, 1);
    }
    auto e = cuda_engine(*w, 256, o);
    CHECK((e->backend().name().find("ours up to 128 rows") != std::string::npos) == (own > 0));
    auto cache = KvCache::create(e->backend(), 160);
    std::vector<float> last;
    size_t at = 0;
    for (const size_t chunk : {100, 37, 5}) {
      auto lg = e->prefill(*cache, std::span<const int32_t>(tokens).subspan(at, chunk));
      REQUIRE(lg.is_ok());
      last = *lg;
      at += chunk;
    }
    logits.push_back(last);
    k_last.push_back(view_to_host(e->backend(), cache->layer(s.layers - 1).k,
                                  tokens.size() * e->config().kv_dim()));
  }
  // bf16 products summed in another order (and the fused SwiGLU's unrounded gate and up sums).
  CHECK(rel_diff(logits[0], logits[1]) < 2e-2);
  CHECK(rel_diff(k_last[0], k_last[1]) < 2e-2);
  const auto top = [](const std::vector<float>& v) {
    return std::max_element(v.begin(), v.end()) - v.begin();
  };
  CHECK(top(logits[0]) == top(logits[1]));
}

TEST_CASE("CUDA layer API: recomputing a subset against loaded KV equals the full prefill") {
  for (const TinyShape& s : kShapes) {
    auto w = make_tiny_model(s, 12);
    auto e = cuda_engine(*w, 256);
    const ModelConfig& c = e->config();
    const int32_t n = 90;
    const auto tokens = random_tokens(n, s.vocab, 4);
    auto full_cache = KvCache::create(e->backend(), n);
    const Full full = run_layers(*e, *full_cache, tokens, AttentionLayout::causal(n),
                                 [](int32_t, const KvView&) {});
    for (const bool all : {true, false}) {
      CAPTURE(all);
      std::vector<int32_t> slots;
      for (int32_t t = 0; t < n; ++t) {
        if (all || t % 3 == 0 || t > 80) slots.push_back(t);
      }
      std::vector<int32_t> sub_tokens;
      for (int32_t t : slots) sub_tokens.push_back(tokens[t]);
      auto cache = KvCache::create(e->backend(), n);
      const int64_t kvd = c.kv_dim();
      const Full part = run_layers(
          *e, *cache, sub_tokens, AttentionLayout::recompute(slots, n),
          [&](int32_t l, const KvView& view) {
            // Load every slot that is not recomputed from the full run's pre-RoPE K and V
            // (host memory, as from the shared KV region).
            for (int32_t t = 0; t < n; ++t) {
              if (std::binary_search(slots.begin(), slots.end(), t)) continue;
              const int32_t pos = t;
              REQUIRE(e->load_kv(view, t, std::span<const int32_t>(&pos, 1),
                                 full.k_pre[l].data() + t * kvd, full.v[l].data() + t * kvd)
                          .is_ok());
            }
          });
      for (size_t i = 0; i < slots.size(); ++i) {
        const size_t C = c.hidden_size;
        std::vector<float> a(part.hidden.begin() + i * C, part.hidden.begin() + (i + 1) * C);
        std::vector<float> b(full.hidden.begin() + slots[i] * C,
                             full.hidden.begin() + (slots[i] + 1) * C);
        CHECK(rel_diff(a, b) < 3e-2);
      }
      // The loaded K (rotated by load_kv from pre-RoPE K) equals the K the full run rotated.
      const int32_t last = c.num_layers - 1;
      CHECK(rel_diff(part.view_k[last], full.view_k[last]) < 1e-2);
    }
  }
}

TEST_CASE("CUDA layer API: independent blocks equal each block alone; pooled mass sums to heads") {
  for (const TinyShape& s : kShapes) {
    auto w = make_tiny_model(s, 13);
    auto e = cuda_engine(*w, 256);
    const ModelConfig& c = e->config();
    const int32_t prefix = 20, l1 = 25, l2 = 30;
    const auto tokens = random_tokens(prefix + l1 + l2, s.vocab, 5);
    // Both blocks after the prefix in one call vs block 1 alone after the prefix.
    AttentionLayout both = AttentionLayout::blocks(
        prefix, {{prefix, prefix + l1}, {prefix + l1, prefix + l1 + l2}}, true);
    std::vector<int32_t> groups(static_cast<size_t>(both.num_keys));
    for (int32_t t = 0; t < both.num_keys; ++t)
      groups[t] = t < prefix ? 0 : (t < prefix + l1 ? 1 : 2);
    both.set_groups(groups, 3);
    auto cb = KvCache::create(e->backend(), both.num_keys);
    std::vector<std::vector<float>> pooled;
    const Full fb = run_layers(
        *e, *cb, tokens, both, [](int32_t, const KvView&) {}, &pooled);
    auto ca = KvCache::create(e->backend(), prefix + l1);
    const std::vector<int32_t> t1(tokens.begin(), tokens.begin() + prefix + l1);
    const Full fa = run_layers(*e, *ca, t1, AttentionLayout::causal(prefix + l1),
                               [](int32_t, const KvView&) {});
    const int64_t kvd = c.kv_dim();
    for (int32_t l = 0; l < c.num_layers; ++l) {
      CHECK(rel_diff(fb.k_pre[l], fa.k_pre[l], 0, size_t(prefix + l1) * kvd) < 2e-2);
      CHECK(rel_diff(fb.v[l], fa.v[l], 0, size_t(prefix + l1) * kvd) < 2e-2);
      // Pooled attention: every row's mass over the groups sums to the head count (within the
      // tensor-core pooling's bf16 rounding per head and group); a block-2 row puts nothing on
      // block 1, a prefix row nothing outside the prefix.
      for (int32_t r = 0; r < both.num_rows(); ++r) {
        const float* pr = pooled[l].data() + r * 3;
        CHECK(std::fabs(pr[0] + pr[1] + pr[2] - float(c.num_heads)) < 1e-2f * c.num_heads);
        if (r >= prefix + l1) CHECK(pr[1] == 0.0f);
        if (r < prefix) CHECK(pr[1] + pr[2] == 0.0f);
      }
      for (float x : fb.lse[l]) CHECK(std::isfinite(x));
    }
  }
}

TEST_CASE("CUDA create_from_hf: a sharded checkpoint as stored gives create()'s weights") {
  // Norms F32, layer 1 F16, the rest BF16, over three shards: the streamed upload must put the
  // same bf16 / fp32 values where create(load_hf_weights) puts them -- identical logits.
  keep::testing::TempDir dir("cuda_stream");
  keep::testing::write_random_hf_dir(
      dir.path(), keep::testing::qwen2_config(256, 512, 2, 4, 2, 512), 3,
      [](const std::string& name) -> std::string {
        if (name.find("norm") != std::string::npos) return "F32";
        if (name.find("layers.1.") != std::string::npos) return "F16";
        return "";
      },
      11);
  auto fp32 = load_hf_weights(dir.path());
  REQUIRE_MESSAGE(fp32.is_ok(), fp32.status().to_string());
  auto a = CudaBackend::create(*fp32);
  auto b = CudaBackend::create_from_hf(dir.path());
  REQUIRE_MESSAGE(a.is_ok(), a.status().to_string());
  REQUIRE_MESSAGE(b.is_ok(), b.status().to_string());
  auto ea = Engine::create(std::move(a).value(), 64);
  auto eb = Engine::create(std::move(b).value(), 64);
  REQUIRE(ea.is_ok());
  REQUIRE(eb.is_ok());
  const auto tokens = random_tokens(40, 512, 3);
  auto ca = KvCache::create((*ea)->backend(), 64);
  auto cb = KvCache::create((*eb)->backend(), 64);
  auto la = (*ea)->prefill(*ca, tokens);
  auto lb = (*eb)->prefill(*cb, tokens);
  REQUIRE(la.is_ok());
  REQUIRE(lb.is_ok());
  CHECK(*la == *lb);
  // A missing shard is refused naming it, before the device holds anything.
  std::filesystem::remove(dir.path() + "/model-00002-of-00003.safetensors");
  auto broken = CudaBackend::create_from_hf(dir.path());
  REQUIRE_FALSE(broken.is_ok());
  CHECK(broken.status().message().find("model-00002-of-00003") != std::string::npos);
}

TEST_CASE("CUDA out_rows: kept rows' output and all K/V equal the full layer call") {
  for (const TinyShape& s : kShapes) {
    auto w = make_tiny_model(s, 15);
    auto e = cuda_engine(*w, 256);
    const ModelConfig& c = e->config();
    const int32_t n = 40;  // tiled attention; few kept rows take the split-key kernel
    const auto tokens = random_tokens(n, s.vocab, 5);
    auto full_cache = KvCache::create(e->backend(), n);
    const Full full = run_layers(*e, *full_cache, tokens, AttentionLayout::causal(n),
                                 [](int32_t, const KvView&) {});
    const size_t C = static_cast<size_t>(c.hidden_size), kvn = size_t(n) * c.kv_dim();
    for (const int32_t keep : {0, 1, 3, 8, 9, n}) {
      CAPTURE(keep);
      auto cache = KvCache::create(e->backend(), n);
      REQUIRE(cache.is_ok());
      auto hidden = prefill_keeping_rows(*e, *cache, tokens, keep);
      REQUIRE_MESSAGE(hidden.is_ok(), hidden.status().to_string());
      const auto got = to_host(e->backend(), hidden->data(), size_t(n) * C);
      const size_t first = size_t(n - keep) * C;
      if (keep > 0) CHECK(rel_diff(got, full.hidden, first, keep * C) < 2e-2);
      for (int32_t l = 0; l < c.num_layers; ++l) {  // the same launches: bit-identical K
        CHECK(view_to_host(e->backend(), cache->layer(l).k, kvn) ==
              view_to_host(e->backend(), full_cache->layer(l).k, kvn));
      }
    }
  }
}

TEST_CASE("CUDA graphs: replayed prefill chunks give bit-identical results; profile adds up") {
  const TinyShape& s = kShapes[0];
  auto w = make_tiny_model(s, 16);
  auto backend = CudaBackend::create(*w);
  REQUIRE(backend.is_ok());
  CudaBackend& cuda = **backend;
  CHECK(CudaBackendOptions{}.graphs);  // on by default
  auto engine = Engine::create(std::move(backend).value(), 64);
  REQUIRE(engine.is_ok());
  Engine& e = **engine;
  // Chunks of 64, 64 and 22 rows: the first two are recorded on their second run (the second
  // after 64 cached tokens), the last runs launch by launch.
  const auto prompt = random_tokens(150, s.vocab, 8);
  GenerateOptions g;
  g.max_tokens = 10;
  g.stop_at_eos = false;
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<int32_t>> gen;
  for (const bool graphs : {true, false, true}) {
    cuda.set_graphs(graphs);
    auto cache = KvCache::create(e.backend(), 160);
    const uint64_t replays = cuda.replays();
    for (int run = 0; run < 3; ++run) {  // seen, recorded, replayed
      cache->set_size(0);
      auto lg = e.prefill(*cache, prompt);
      REQUIRE(lg.is_ok());
      logits.push_back(*lg);
    }
    CHECK(cuda.replays() - replays == (graphs ? 2u : 0u));
    auto out = e.generate(prompt, g);
    REQUIRE(out.is_ok());
    gen.push_back(*out);
  }
  for (const auto& l : logits) CHECK(l == logits[3]);
  CHECK(gen[0] == gen[1]);
  CHECK(gen[2] == gen[1]);

  // A plan uploads its arrays at its first use, which a capture cannot hold: a captured layer loop
  // refuses a plan not prepared (Backend::prepare), and takes it once prepared; outside a capture
  // it works either way.
  {
    cuda.set_graphs(true);
    auto cache = KvCache::create(e.backend(), 16);
    auto hidden = e.allocate_hidden(8);
    REQUIRE(hidden.is_ok());
    REQUIRE(e.embed(*hidden, std::span<const int32_t>(prompt).first(8)).is_ok());
    auto plan = e.plan(AttentionLayout::causal(8, 0));
    REQUIRE(plan.is_ok());
    {
      Backend::Capture capture(e.backend());
      const keep::Status st = e.prefill_layer(0, *hidden, cache->layer(0), **plan, LayerExtras{});
      CHECK(st.code() == keep::Code::kInternal);
    }
    auto ref = e.allocate_hidden(8);
    REQUIRE(ref.is_ok());
    e.backend().copy_on_device(ref->data(), hidden->data(), 8 * e.config().hidden_size);
    REQUIRE(e.backend().prepare(**plan).is_ok());
    {
      Backend::Capture capture(e.backend());
      CHECK(e.prefill_layer(0, *hidden, cache->layer(0), **plan, LayerExtras{}).is_ok());
      capture.finish();
    }
    // The same layer launch by launch on the same input: the same output, bit for bit.
    CHECK(e.prefill_layer(0, *ref, cache->layer(0), **plan, LayerExtras{}).is_ok());
    const size_t n = 8 * static_cast<size_t>(e.config().hidden_size);
    CHECK(to_host(e.backend(), hidden->data(), n) == to_host(e.backend(), ref->data(), n));
  }

  // Profiling: every stage of every layer call is timed once per call, and the prefill's embedding,
  // logits and logits copy once each.
  cuda.set_profiling(true);
  auto cache = KvCache::create(e.backend(), 64);
  REQUIRE(e.prefill(*cache, std::span<const int32_t>(prompt).first(40)).is_ok());
  const auto st = cuda.profile();
  cuda.set_profiling(false);
  const int64_t L = e.config().num_layers;
  double total = 0.0;
  for (const StageTime& t : st) {
    CAPTURE(t.stage);
    total += t.ms;
    // No segment groups: no pooling and no rows chosen; every other stage of the layers once per
    // layer (the last layer keeps one row, whose MLP still runs); 40 tokens are one chunk, one
    // logits row.
    const std::string name = t.stage;
    const bool around = name == "embed" || name == "logits" || name == "copy_out";
    CHECK(t.calls == (name == "pool" || name == "choose" ? 0 : around ? 1 : L));
    CHECK(t.ms >= 0.0);
  }
  CHECK(total > 0.0);
}

// The engine's recorded prefills on CUDA graphs (tests/unit/replay_scenario.h): a workspace moved
// by reserve() drops the recordings; another dependent-launch setting, graphs off or profiling make
// the backend refuse a replay.
TEST_CASE("CUDA graphs: a recurring prefill replays its recording with new tokens") {
  TinyShape s = kShapes[1];
  s.layers = ReplayCache::kSplitLayer + 2;  // the first layer, then the recording's two parts
  auto w = make_tiny_model(s, 17);
  auto backend = CudaBackend::create(*w);
  REQUIRE(backend.is_ok());
  CudaBackend& cuda = **backend;
  auto engine = Engine::create(std::move(backend).value(), 128);
  REQUIRE(engine.is_ok());
  Engine& e = **engine;
  RecordingHooks h;
  h.set_recording = [&](bool on) { cuda.set_graphs(on); };
  h.recordings = [&] { return cuda.recordings(); };
  h.replays = [&] { return cuda.replays(); };
  h.drop_all = [&] { REQUIRE(cuda.reserve(e.max_rows() * 2, 4 * e.max_rows()).is_ok()); };
  h.view_to_host = [&](const void* view, size_t n) { return view_to_host(e.backend(), view, n); };
  h.not_now = {
      {[] { keep::kernels::set_dependent_launch(false); },
       [] { keep::kernels::set_dependent_launch(true); }},
      {[&] { cuda.set_graphs(false); }, [&] { cuda.set_graphs(true); }},
      {[&] { cuda.set_profiling(true); }, [&] { cuda.set_profiling(false); }},
  };
  check_recorded_prefills(e, h);
}

TEST_CASE("CUDA: batched candidate scoring equals scoring each candidate by a full prefill") {
  const TinyShape& s = kShapes[0];
  auto w = make_tiny_model(s, 14);
  auto e = cuda_engine(*w, 256);
  const auto prompt = random_tokens(40, s.vocab, 6);
  const std::vector<std::vector<int32_t>> cands = {
      random_tokens(5, s.vocab, 7), {}, random_tokens(1, s.vocab, 8), random_tokens(9, s.vocab, 9)};
  auto scores = e->score_candidates(prompt, cands);
  REQUIRE(scores.is_ok());
  for (size_t ci = 0; ci < cands.size(); ++ci) {
    double want = 0.0;
    std::vector<int32_t> seq = prompt;
    for (int32_t t : cands[ci]) {
      auto cache = KvCache::create(e->backend(), static_cast<int32_t>(seq.size()));
      auto lg = e->prefill(*cache, seq);
      REQUIRE(lg.is_ok());
      want += log_prob(*lg, t);
      seq.push_back(t);
    }
    CHECK((*scores)[ci].tokens == static_cast<int32_t>(cands[ci].size()));
    CHECK(std::fabs((*scores)[ci].log_prob - want) < 5e-2 + 1e-2 * std::fabs(want));
  }
  // Greedy generation is deterministic.
  GenerateOptions g;
  g.max_tokens = 12;
  g.stop_at_eos = false;
  auto a = e->generate(prompt, g);
  auto b = e->generate(prompt, g);
  REQUIRE(a.is_ok());
  REQUIRE(b.is_ok());
  CHECK(*a == *b);
}

}  // namespace
