// The layer-level API (engine.h) on small random models: every way of computing KV that the
// recompute planner relies on must agree with a plain full prefill.
#include <doctest/doctest.h>

#include <numeric>

#include "services/worker/engine/core/engine.h"
#include "services/worker/engine/cpu/cpu_backend.h"
#include "tests/unit/engine_test_model.h"

using namespace keep::engine;
using keep::Code;
using keep::engine::testing::make_tiny_model;
using keep::engine::testing::max_abs_diff;
using keep::engine::testing::prefill_keeping_rows;
using keep::engine::testing::random_tokens;
using keep::engine::testing::TinyShape;

namespace {

constexpr float kTol = 2e-4f;  // fp32, different summation order only

std::unique_ptr<Engine> make_engine(const TinyShape& shape, uint32_t seed, int32_t max_rows = 64) {
  auto backend = CpuBackend::create(make_tiny_model(shape, seed), {2, 0});
  REQUIRE(backend.is_ok());
  auto engine = Engine::create(std::move(backend).value(), max_rows);
  REQUIRE(engine.is_ok());
  return std::move(engine).value();
}

// Per-layer outputs of one run through all layers, copied to host.
struct Run {
  std::vector<std::vector<float>> k_pre, v, lse, pooled;  // per layer, (rows, ...)
  std::vector<float> hidden;                              // (rows, C) after the last layer
  std::vector<std::vector<float>> view_k;                 // per layer, the rotated K of the view
};

// Runs `tokens` (one per layout row) through every layer. Before layer l, `load` fills the view.
template <typename LoadFn>
Run run_layers(Engine& e, KvCache& cache, const std::vector<int32_t>& tokens,
               const AttentionLayout& layout, LoadFn load) {
  const ModelConfig& c = e.config();
  const auto rows = static_cast<int32_t>(tokens.size());
  REQUIRE(rows == layout.num_rows());
  auto hidden = e.allocate_hidden(rows);
  REQUIRE(hidden.is_ok());
  REQUIRE(e.embed(*hidden, tokens).is_ok());
  auto plan = e.plan(layout);
  REQUIRE_MESSAGE(plan.is_ok(), plan.status().to_string());
  auto& be = e.backend();
  auto k_pre = be.allocate(rows * c.kv_dim());
  auto v = be.allocate(rows * c.kv_dim());
  auto lse = be.allocate(rows * c.num_heads);
  auto pooled = be.allocate(rows * std::max(layout.num_groups, 1));
  Run run;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    load(l, cache.layer(l));
    LayerExtras ex{&*k_pre, &*v, &*lse, layout.num_groups > 0 ? &*pooled : nullptr};
    auto st = e.prefill_layer(l, *hidden, cache.layer(l), **plan, ex);
    REQUIRE_MESSAGE(st.is_ok(), st.to_string());
    run.k_pre.emplace_back(k_pre->data(), k_pre->data() + rows * c.kv_dim());
    run.v.emplace_back(v->data(), v->data() + rows * c.kv_dim());
    run.lse.emplace_back(lse->data(), lse->data() + rows * c.num_heads);
    if (layout.num_groups > 0) {
      run.pooled.emplace_back(pooled->data(), pooled->data() + rows * layout.num_groups);
    }
    KvView view = cache.layer(l);
    run.view_k.emplace_back(view.k_f32(),
                            view.k_f32() + static_cast<size_t>(layout.num_keys) * c.kv_dim());
  }
  run.hidden.assign(hidden->data(), hidden->data() + rows * c.hidden_size);
  return run;
}

Run full_prefill(Engine& e, const std::vector<int32_t>& tokens, const AttentionLayout& layout) {
  auto cache = KvCache::create(e.backend(), layout.num_keys);
  REQUIRE(cache.is_ok());
  return run_layers(e, *cache, tokens, layout, [](int32_t, const KvView&) {});
}

std::vector<int32_t> iota_positions(int32_t first, int32_t n) {
  std::vector<int32_t> p(n);
  std::iota(p.begin(), p.end(), first);
  return p;
}

const TinyShape kShapes[] = {
    TinyShape{},  // Qwen2 with q/k/v bias, GQA 6/2
    TinyShape{Arch::kLlama, 101, 40, 2, 5, 5, 8, 56, true, false, false},  // MHA, tied, no bias
    TinyShape{Arch::kLlama, 64, 32, 2, 4, 1, 8, 40, false, true, true},    // MQA, o bias, llama3
};

}  // namespace

TEST_CASE("one causal prefill equals chunked prefill equals token-by-token decode") {
  for (const TinyShape& shape : kShapes) {
    auto e = make_engine(shape, 11);
    auto chunked = make_engine(shape, 11, /*max_rows=*/3);
    const auto tokens = random_tokens(17, shape.vocab, 5);
    auto c1 = KvCache::create(e->backend(), 32);
    auto c2 = KvCache::create(chunked->backend(), 32);
    auto c3 = KvCache::create(e->backend(), 32);
    auto full = e->prefill(*c1, tokens);
    auto chunk = chunked->prefill(*c2, tokens);
    REQUIRE(full.is_ok());
    REQUIRE(chunk.is_ok());
    CHECK(max_abs_diff(full->data(), chunk->data(), full->size()) < kTol);
    std::vector<float> step;
    for (int32_t t : tokens) {
      auto r = e->decode_step(*c3, t);
      REQUIRE(r.is_ok());
      step = std::move(r).value();
    }
    CHECK(c3->size() == 17);
    CHECK(max_abs_diff(full->data(), step.data(), full->size()) < kTol);
    CHECK(argmax(*full) == argmax(step));
  }
}

TEST_CASE("recomputing tokens against loaded KV equals a plain full prefill") {
  for (const TinyShape& shape : kShapes) {
    auto e = make_engine(shape, 21);
    const ModelConfig& c = e->config();
    const int32_t n = 23;
    const auto tokens = random_tokens(n, shape.vocab, 9);
    const Run full = full_prefill(*e, tokens, AttentionLayout::causal(n));
    const int64_t kvd = c.kv_dim();

    // Subsets: all tokens (recompute-all), a scattered subset plus the query tail, and the last
    // token only (full reuse).
    std::vector<std::vector<int32_t>> subsets = {
        iota_positions(0, n), {0, 3, 4, 10, 18, 20, 21, 22}, {n - 1}};
    for (const auto& subset : subsets) {
      CAPTURE(subset.size());
      std::vector<int32_t> sub_tokens;
      for (int32_t s : subset) sub_tokens.push_back(tokens[s]);
      auto cache = KvCache::create(e->backend(), n);
      REQUIRE(cache.is_ok());
      const Run part = run_layers(
          *e, *cache, sub_tokens, AttentionLayout::recompute(subset, n),
          [&](int32_t l, const KvView& view) {
            // Load every slot not recomputed, from the full run's pre-RoPE K and V.
            for (int32_t s = 0; s < n; ++s) {
              if (std::find(subset.begin(), subset.end(), s) != subset.end()) continue;
              const int32_t pos = s;
              REQUIRE(e->load_kv(view, s, std::span<const int32_t>(&pos, 1),
                                 full.k_pre[l].data() + s * kvd, full.v[l].data() + s * kvd)
                          .is_ok());
            }
          });
      for (size_t i = 0; i < subset.size(); ++i) {
        const int32_t s = subset[i];
        CHECK(max_abs_diff(part.hidden.data() + i * c.hidden_size,
                           full.hidden.data() + s * c.hidden_size, c.hidden_size) < kTol);
        for (int32_t l = 0; l < c.num_layers; ++l) {
          CHECK(max_abs_diff(part.k_pre[l].data() + i * kvd, full.k_pre[l].data() + s * kvd, kvd) <
                kTol);
          CHECK(max_abs_diff(part.lse[l].data() + i * c.num_heads,
                             full.lse[l].data() + s * c.num_heads, c.num_heads) < kTol);
        }
      }
      // The rotated K in the view equals the full prefill's everywhere (loaded or computed).
      for (int32_t l = 0; l < c.num_layers; ++l) {
        CHECK(max_abs_diff(part.view_k[l].data(), full.view_k[l].data(), n * kvd) < kTol);
      }
      // And the logits of the last token agree.
      if (subset.back() == n - 1) {
        auto hidden_full = e->allocate_hidden(n);
        std::copy(full.hidden.begin(), full.hidden.end(), hidden_full->data());
        auto hidden_part = e->allocate_hidden(static_cast<int32_t>(subset.size()));
        std::copy(part.hidden.begin(), part.hidden.end(), hidden_part->data());
        const int32_t rf = n - 1, rp = static_cast<int32_t>(subset.size()) - 1;
        auto lf = e->logits(*hidden_full, std::span<const int32_t>(&rf, 1));
        auto lp = e->logits(*hidden_part, std::span<const int32_t>(&rp, 1));
        REQUIRE(lf.is_ok());
        REQUIRE(lp.is_ok());
        CHECK(max_abs_diff(lf->data(), lp->data(), lf->size()) < kTol);
      }
    }
  }
}

TEST_CASE("KV per independent block equals each block computed alone, and re-rotates exactly") {
  for (const TinyShape& shape : kShapes) {
    auto e = make_engine(shape, 31);
    const ModelConfig& c = e->config();
    const int64_t kvd = c.kv_dim();
    const int32_t prefix = 4, l1 = 6, l2 = 9;
    const auto tokens = random_tokens(prefix + l1 + l2, shape.vocab, 13);

    // Prefix + two blocks in one call.
    const AttentionLayout blocks = AttentionLayout::blocks(
        prefix, {{prefix, prefix + l1}, {prefix + l1, prefix + l1 + l2}}, /*compute_prefix=*/true);
    REQUIRE(blocks.validate().is_ok());
    const Run both = full_prefill(*e, tokens, blocks);

    // Block 2 alone after the prefix, at the same positions (prefix 0..3, block 10..18).
    std::vector<int32_t> alone_tokens(tokens.begin(), tokens.begin() + prefix);
    alone_tokens.insert(alone_tokens.end(), tokens.begin() + prefix + l1, tokens.end());
    AttentionLayout alone = AttentionLayout::causal(prefix + l2);
    for (int32_t i = prefix; i < prefix + l2; ++i) alone.row_position[i] = i + l1;
    const Run ref = full_prefill(*e, alone_tokens, alone);
    for (int32_t l = 0; l < c.num_layers; ++l) {
      for (int32_t i = 0; i < l2; ++i) {
        CHECK(max_abs_diff(both.k_pre[l].data() + (prefix + l1 + i) * kvd,
                           ref.k_pre[l].data() + (prefix + i) * kvd, kvd) < kTol);
        CHECK(max_abs_diff(both.v[l].data() + (prefix + l1 + i) * kvd,
                           ref.v[l].data() + (prefix + i) * kvd, kvd) < kTol);
      }
    }

    // A block with no prefix at positions 0.. and at 100..: pre-RoPE K and V are the same (RoPE is
    // relative), and rotating the first run's pre-RoPE K to 100.. gives the second run's view K.
    const std::vector<int32_t> seg(tokens.begin() + prefix, tokens.begin() + prefix + l1);
    const Run at0 = full_prefill(*e, seg, AttentionLayout::causal(l1));
    const Run at100 = full_prefill(*e, seg, AttentionLayout::causal(l1, 0, 100));
    const auto pos100 = iota_positions(100, l1);
    auto view = KvCache::create(e->backend(), l1);
    REQUIRE(view.is_ok());
    for (int32_t l = 0; l < c.num_layers; ++l) {
      CHECK(max_abs_diff(at0.k_pre[l].data(), at100.k_pre[l].data(), l1 * kvd) < kTol);
      CHECK(max_abs_diff(at0.v[l].data(), at100.v[l].data(), l1 * kvd) < kTol);
      REQUIRE(e->load_kv(view->layer(l), 0, pos100, at0.k_pre[l].data(), at0.v[l].data()).is_ok());
      CHECK(max_abs_diff(view->layer(l).k_f32(), at100.view_k[l].data(), l1 * kvd) < kTol);
    }
  }
}

TEST_CASE("pooled attention per segment: rows sum to the head count and match the full prefill") {
  auto e = make_engine(TinyShape{}, 41);
  const ModelConfig& c = e->config();
  // 15 rows run the per-row attention, 150 the tiled sgemm path (several tiles).
  for (int32_t n : {15, 150}) {
    CAPTURE(n);
    const auto tokens = random_tokens(n, 97, 3);
    // Segments of 5 tokens; the last two (query) tokens ungrouped (-1).
    const int32_t mem = n - 2, ng = (mem + 4) / 5;
    std::vector<int32_t> groups(n, -1);
    for (int32_t t = 0; t < mem; ++t) groups[t] = t / 5;
    AttentionLayout full_layout = AttentionLayout::causal(n);
    AttentionLayout grouped = full_layout;
    grouped.set_groups(groups, ng);
    const Run plain = full_prefill(*e, tokens, full_layout);
    const Run pooled = full_prefill(*e, tokens, grouped);
    CHECK(max_abs_diff(plain.hidden.data(), pooled.hidden.data(), plain.hidden.size()) == 0.0f);
    for (int32_t l = 0; l < c.num_layers; ++l) {
      for (int32_t r = 0; r < mem; ++r) {
        // Row r sees only grouped keys: its pooled mass over the groups is exactly num_heads.
        float s = 0.0f;
        for (int32_t g = 0; g < ng; ++g) s += pooled.pooled[l][r * ng + g];
        CHECK(s == doctest::Approx(static_cast<float>(c.num_heads)).epsilon(1e-5));
        // Causality: no mass on later segments.
        for (int32_t g = r / 5 + 1; g < ng; ++g) CHECK(pooled.pooled[l][r * ng + g] == 0.0f);
      }
      // Query rows see themselves too, so less than num_heads lands in groups.
      float q = 0.0f;
      for (int32_t g = 0; g < ng; ++g) q += pooled.pooled[l][(n - 1) * ng + g];
      CHECK(q < c.num_heads);
      CHECK(q > 0.0f);
    }
  }
}

TEST_CASE("tiled attention (many rows) equals per-row attention (small chunks)") {
  for (const TinyShape& shape : kShapes) {
    auto e = make_engine(shape, 81, 256);
    auto small = make_engine(shape, 81, 7);
    const auto tokens = random_tokens(203, shape.vocab, 29);
    auto c1 = KvCache::create(e->backend(), 210);
    auto c2 = KvCache::create(small->backend(), 210);
    auto a = e->prefill(*c1, tokens);
    auto b = small->prefill(*c2, tokens);
    REQUIRE(a.is_ok());
    REQUIRE(b.is_ok());
    CHECK(max_abs_diff(a->data(), b->data(), a->size()) < kTol);
    for (int32_t l = 0; l < shape.layers; ++l) {
      CHECK(max_abs_diff(c1->layer(l).v_f32(), c2->layer(l).v_f32(), 203 * e->config().kv_dim()) <
            kTol);
    }
  }
}

TEST_CASE("batched candidate scoring equals scoring each candidate by a full prefill") {
  for (const TinyShape& shape : kShapes) {
    auto e = make_engine(shape, 51);
    const auto prompt = random_tokens(12, shape.vocab, 17);
    const std::vector<std::vector<int32_t>> cands = {random_tokens(5, shape.vocab, 1),
                                                     random_tokens(1, shape.vocab, 2),
                                                     {},
                                                     random_tokens(8, shape.vocab, 3)};
    auto scores = e->score_candidates(prompt, cands);
    REQUIRE_MESSAGE(scores.is_ok(), scores.status().to_string());
    REQUIRE(scores->size() == cands.size());
    for (size_t ci = 0; ci < cands.size(); ++ci) {
      double ref = 0.0;
      if (!cands[ci].empty()) {
        std::vector<int32_t> seq = prompt;
        auto cache = KvCache::create(e->backend(), 32);
        auto lg = e->prefill(*cache, prompt);
        REQUIRE(lg.is_ok());
        for (int32_t t : cands[ci]) {
          ref += log_prob(*lg, t);
          lg = e->decode_step(*cache, t);
          REQUIRE(lg.is_ok());
        }
      }
      CHECK(scores->at(ci).tokens == static_cast<int32_t>(cands[ci].size()));
      CHECK(scores->at(ci).log_prob == doctest::Approx(ref).epsilon(1e-4));
    }
  }
}

TEST_CASE("greedy generation is deterministic and sampling is reproducible by seed") {
  auto e = make_engine(TinyShape{}, 61);
  const auto prompt = random_tokens(9, 97, 23);
  GenerateOptions g;
  g.max_tokens = 12;
  g.stop_at_eos = false;
  auto a = e->generate(prompt, g);
  REQUIRE(a.is_ok());
  CHECK(a->size() == 12);
  // Greedy continuation equals argmax of a fresh prefill over prompt + prefix, step by step.
  std::vector<int32_t> seq = prompt;
  for (size_t i = 0; i < 3; ++i) {
    auto cache = KvCache::create(e->backend(), 64);
    auto lg = e->prefill(*cache, seq);
    REQUIRE(lg.is_ok());
    CHECK(argmax(*lg) == a->at(i));
    seq.push_back(a->at(i));
  }
  g.sampling.temperature = 0.9f;
  g.sampling.top_p = 0.9f;
  g.sampling.seed = 7;
  auto s1 = e->generate(prompt, g);
  auto s2 = e->generate(prompt, g);
  REQUIRE(s1.is_ok());
  REQUIRE(s2.is_ok());
  CHECK(*s1 == *s2);
  // Stopping: a stop token ends generation right after it is emitted.
  GenerateOptions st;
  st.max_tokens = 12;
  st.stop_at_eos = false;
  st.stop_tokens = {a->at(2)};
  auto s3 = e->generate(prompt, st);
  REQUIRE(s3.is_ok());
  CHECK(s3->size() <= 3);
  CHECK(s3->back() == a->at(2));
}

TEST_CASE("out_rows: the kept rows' output and every row's K/V equal a full layer call") {
  for (const TinyShape& shape : kShapes) {
    auto e = make_engine(shape, 81);
    const ModelConfig& c = e->config();
    const int32_t n = 19;
    const auto tokens = random_tokens(n, shape.vocab, 4);
    const Run full = full_prefill(*e, tokens, AttentionLayout::causal(n));
    const size_t C = static_cast<size_t>(c.hidden_size);
    for (const int32_t keep : {0, 1, 3, n}) {
      CAPTURE(keep);
      auto cache = KvCache::create(e->backend(), n);
      REQUIRE(cache.is_ok());
      auto hidden = prefill_keeping_rows(*e, *cache, tokens, keep);
      REQUIRE_MESSAGE(hidden.is_ok(), hidden.status().to_string());
      const size_t first = static_cast<size_t>(n - keep) * C;
      CHECK(max_abs_diff(hidden->data() + first, full.hidden.data() + first, keep * C) < kTol);
      for (int32_t l = 0; l < c.num_layers; ++l) {
        CHECK(max_abs_diff(cache->layer(l).k_f32(), full.view_k[l].data(),
                           static_cast<size_t>(n) * c.kv_dim()) < kTol);
      }
    }
  }
}

TEST_CASE("choose_rows: the chosen rows' output, packed, and every row's K/V equal a full call") {
  // KEEP's check layers choose the rows that go on inside the layer (LayerExtras::choose_rows):
  // the MLP runs for them only and their outputs come packed in chosen_hidden.
  for (const TinyShape& shape : kShapes) {
    auto e = make_engine(shape, 83);
    const ModelConfig& c = e->config();
    const int32_t n = 19;
    const size_t C = static_cast<size_t>(c.hidden_size);
    const auto tokens = random_tokens(n, shape.vocab, 5);
    const AttentionLayout layout = AttentionLayout::causal(n);
    auto plan = e->plan(layout);
    REQUIRE(plan.is_ok());
    // The reference: layer 0 for every row.
    auto ref_cache = KvCache::create(e->backend(), n);
    auto ref = e->allocate_hidden(n);
    REQUIRE(e->embed(*ref, tokens).is_ok());
    REQUIRE(e->prefill_layer(0, *ref, ref_cache->layer(0), **plan).is_ok());
    for (const std::vector<int32_t>& want :
         {std::vector<int32_t>{0, 5, 18}, std::vector<int32_t>{}, iota_positions(0, n)}) {
      CAPTURE(want.size());
      auto cache = KvCache::create(e->backend(), n);
      auto hidden = e->allocate_hidden(n);
      auto packed = e->allocate_hidden(n);
      REQUIRE(e->embed(*hidden, tokens).is_ok());
      int calls = 0;
      LayerExtras ex;
      ex.choose_rows = [&]() -> keep::Result<std::vector<int32_t>> {
        ++calls;
        return want;
      };
      ex.chosen_hidden = &*packed;
      const keep::Status st = e->prefill_layer(0, *hidden, cache->layer(0), **plan, ex);
      REQUIRE_MESSAGE(st.is_ok(), st.to_string());
      CHECK(calls == 1);
      for (size_t k = 0; k < want.size(); ++k) {
        CHECK(max_abs_diff(packed->data() + k * C, ref->data() + want[k] * C, C) < kTol);
      }
      CHECK(max_abs_diff(cache->layer(0).k_f32(), ref_cache->layer(0).k_f32(),
                         static_cast<size_t>(n) * c.kv_dim()) < kTol);
      CHECK(max_abs_diff(cache->layer(0).v_f32(), ref_cache->layer(0).v_f32(),
                         static_cast<size_t>(n) * c.kv_dim()) < kTol);
    }
  }
}

TEST_CASE("choose_rows: rows out of order or range, its own error, and misuse are refused") {
  auto e = make_engine(TinyShape{}, 73);
  const int32_t n = 6;
  auto plan = e->plan(AttentionLayout::causal(n));
  REQUIRE(plan.is_ok());
  auto cache = KvCache::create(e->backend(), n);
  auto hidden = e->allocate_hidden(n);
  auto packed = e->allocate_hidden(n);
  auto small = e->allocate_hidden(2);
  REQUIRE(e->embed(*hidden, random_tokens(n, 97, 6)).is_ok());
  auto run = [&](std::vector<int32_t> rows) {
    LayerExtras ex;
    ex.choose_rows = [rows]() -> keep::Result<std::vector<int32_t>> { return rows; };
    ex.chosen_hidden = &*packed;
    return e->prefill_layer(0, *hidden, cache->layer(0), **plan, ex);
  };
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{2, 1}, std::vector<int32_t>{1, 1},
                                          std::vector<int32_t>{-1}, std::vector<int32_t>{6}}) {
    const keep::Status st = run(bad);
    CHECK(st.code() == Code::kInvalidArgument);
    CHECK(st.message().find("choose_rows gave row") != std::string::npos);
  }
  CHECK(run({0, 5}).is_ok());
  LayerExtras ex;
  ex.choose_rows = []() -> keep::Result<std::vector<int32_t>> {
    return keep::Status(Code::kInternal, "importance failed");
  };
  ex.chosen_hidden = &*packed;
  const keep::Status own = e->prefill_layer(0, *hidden, cache->layer(0), **plan, ex);
  CHECK(own.code() == Code::kInternal);
  CHECK(own.message() == "importance failed");
  ex.chosen_hidden = nullptr;  // nowhere to pack
  CHECK(e->prefill_layer(0, *hidden, cache->layer(0), **plan, ex).code() == Code::kInvalidArgument);
  ex.chosen_hidden = &*hidden;  // packed over its own input
  CHECK(e->prefill_layer(0, *hidden, cache->layer(0), **plan, ex).code() == Code::kInvalidArgument);
  ex.chosen_hidden = &*small;  // too few rows
  CHECK(e->prefill_layer(0, *hidden, cache->layer(0), **plan, ex).code() == Code::kInvalidArgument);
  ex.chosen_hidden = &*packed;
  ex.out_rows = 1;  // one or the other
  CHECK(e->prefill_layer(0, *hidden, cache->layer(0), **plan, ex).code() == Code::kInvalidArgument);
  ex = {};
  ex.chosen_hidden = &*packed;  // without a chooser
  CHECK(e->prefill_layer(0, *hidden, cache->layer(0), **plan, ex).code() == Code::kInvalidArgument);
}

TEST_CASE("bad input is refused with a status, never a crash") {
  auto e = make_engine(TinyShape{}, 71);
  auto hidden = e->allocate_hidden(4);
  REQUIRE(hidden.is_ok());
  const std::vector<int32_t> bad_tokens = {1, 97};
  CHECK(e->embed(*hidden, bad_tokens).code() == Code::kInvalidArgument);
  const std::vector<int32_t> neg = {-1};
  CHECK(e->embed(*hidden, neg).code() == Code::kInvalidArgument);
  auto too_many = random_tokens(5, 97, 1);
  CHECK(e->embed(*hidden, too_many).code() == Code::kInvalidArgument);

  // Layouts that break invariants.
  AttentionLayout l = AttentionLayout::causal(3);
  l.spans[1] = {2, 2};
  CHECK(e->plan(l).status().code() == Code::kInvalidArgument);
  l = AttentionLayout::causal(3);
  l.spans[2] = {0, 2};  // row 2 does not see itself
  CHECK(e->plan(l).status().code() == Code::kInvalidArgument);
  l = AttentionLayout::causal(3);
  l.spans[2] = {0, 9};  // past num_keys
  CHECK(e->plan(l).status().code() == Code::kInvalidArgument);
  l = AttentionLayout::causal(3);
  l.row_slot[1] = 0;  // repeated slot
  CHECK(e->plan(l).status().code() == Code::kInvalidArgument);
  l = AttentionLayout::causal(3);
  l.set_groups({0, 1}, 2);  // wrong length
  CHECK(e->plan(l).status().code() == Code::kInvalidArgument);
  CHECK(e->plan(AttentionLayout::causal(0)).status().code() == Code::kInvalidArgument);
  l = AttentionLayout::recompute({3, 1}, 5);  // rows see their own slot, but order is free
  CHECK(l.validate().is_ok());
  // A repeated slot out of order: the row named is the first (in row order) that repeats one.
  l = AttentionLayout::recompute({4, 1, 3, 1, 4}, 5);
  keep::Status repeat = l.validate();
  CHECK(repeat.code() == Code::kInvalidArgument);
  CHECK(repeat.message().find("row 3: slot 1 repeated") != std::string::npos);
  // An earlier row's own error is reported before a later repeat.
  l = AttentionLayout::recompute({4, 1, 3, 1}, 5);
  l.row_position[2] = -1;
  CHECK(l.validate().message().find("row 2: negative position") != std::string::npos);
  l = AttentionLayout::causal(4);
  l.row_slot[3] = 2;  // ascending but repeated
  l.spans[3] = {0, 3};
  CHECK(l.validate().message().find("row 3: slot 2 repeated") != std::string::npos);

  auto cache = KvCache::create(e->backend(), 3);
  REQUIRE(cache.is_ok());
  auto plan = e->plan(AttentionLayout::causal(4));
  REQUIRE(plan.is_ok());
  REQUIRE(e->embed(*hidden, random_tokens(4, 97, 2)).is_ok());
  CHECK(e->prefill_layer(0, *hidden, cache->layer(0), **plan).code() == Code::kInvalidArgument);
  auto big = KvCache::create(e->backend(), 8);
  CHECK(e->prefill_layer(3, *hidden, big->layer(0), **plan).code() == Code::kInvalidArgument);
  CHECK(e->prefill_layer(-1, *hidden, big->layer(0), **plan).code() == Code::kInvalidArgument);
  auto small = e->allocate_hidden(2);
  CHECK(e->prefill_layer(0, *small, big->layer(0), **plan).code() == Code::kInvalidArgument);
  auto tiny_lse = e->backend().allocate(3);
  LayerExtras ex;
  ex.lse = &*tiny_lse;
  CHECK(e->prefill_layer(0, *hidden, big->layer(0), **plan, ex).code() == Code::kInvalidArgument);
  ex = {};
  ex.pooled = &*tiny_lse;  // no groups in the layout
  CHECK(e->prefill_layer(0, *hidden, big->layer(0), **plan, ex).code() == Code::kInvalidArgument);
  for (const int32_t out_rows : {-2, 5}) {  // the plan has 4 rows
    ex = {};
    ex.out_rows = out_rows;
    CHECK(e->prefill_layer(0, *hidden, big->layer(0), **plan, ex).code() == Code::kInvalidArgument);
  }

  std::vector<float> kv(2 * e->config().kv_dim());
  const std::vector<int32_t> pos = {0, 1};
  CHECK(e->load_kv(cache->layer(0), 2, pos, kv.data(), kv.data()).code() == Code::kInvalidArgument);
  CHECK(e->load_kv(cache->layer(0), 1, pos, kv.data(), kv.data()).is_ok());
  const int32_t r9 = 9;
  CHECK(e->logits(*hidden, std::span<const int32_t>(&r9, 1)).status().code() ==
        Code::kInvalidArgument);
  CHECK(e->prefill(*cache, random_tokens(4, 97, 3)).status().code() == Code::kInvalidArgument);
  CHECK(e->score_candidates({}, {{1}}).status().code() == Code::kInvalidArgument);
  CHECK(e->score_candidates(random_tokens(3, 97, 1), {{1, 500}}).status().code() ==
        Code::kInvalidArgument);
}
