// KvAssembler on the CPU backend and a small random model: each method's layer loop against a
// full prefill of the same tokens (ARCHITECTURE §4-§5; issue 28, point 4).
//   keep with d = 1 and cacheblend at 100 %  ->  full's logits
//   full_reuse over entries computed in the same context at the same positions  ->  full's logits
//   KV loaded at other positions equals KV computed there (pre-RoPE K rotated on load)
//   a missing entry is computed, never served; `prefix` reuses the exact prefix of the last prompt
#include "services/worker/keep/kv_assembler.h"

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <numeric>
#include <utility>

#include "services/worker/engine/cpu/cpu_backend.h"
#include "tests/unit/engine_test_model.h"

using namespace keep::worker;
namespace eng = keep::engine;
namespace kv = keep::kv;
using eng::testing::max_abs_diff;

// fp32 on the CPU: the same prompt through other row batchings sums in another order (BLAS picks
// its kernels by the matrix's rows), so "exact" means within a few ulps of logits of size ~10.
constexpr float kLogitTol = 5e-5f;

namespace {

struct Fixture {
  std::unique_ptr<eng::Engine> engine;
  std::unique_ptr<KvAssembler> assembler;
  std::vector<int32_t> prefix;
  std::vector<std::vector<int32_t>> segments;
  std::vector<int32_t> query;

  explicit Fixture(int64_t layers = 4) {
    eng::testing::TinyShape shape;
    shape.layers = layers;
    auto backend = eng::CpuBackend::create(eng::testing::make_tiny_model(shape, 7));
    REQUIRE(backend.is_ok());
    auto e = eng::Engine::create(std::move(backend).value(), 32);
    REQUIRE(e.is_ok());
    engine = std::move(e).value();
    prefix = eng::testing::random_tokens(5, shape.vocab, 1);
    for (int i = 0; i < 4; ++i) {
      segments.push_back(eng::testing::random_tokens(3 + i, shape.vocab, 10 + i));
    }
    query = eng::testing::random_tokens(6, shape.vocab, 99);
    auto a = KvAssembler::create(*engine, prefix, 96);
    REQUIRE(a.is_ok());
    assembler = std::move(a).value();
  }

  kv::ModelFingerprint fingerprint(kv::KvDType dtype) const {
    kv::ModelFingerprint fp;
    fp.num_layers = static_cast<uint32_t>(engine->config().num_layers);
    fp.num_kv_heads = static_cast<uint32_t>(engine->config().num_kv_heads);
    fp.head_dim = static_cast<uint32_t>(engine->config().head_dim);
    fp.dtype = dtype;
    return fp;
  }

  // One entry for `tokens` computed as [prefix][tokens] (a dynamic segment, or a group's members
  // one after another).
  std::vector<std::byte> produce(const std::vector<int32_t>& tokens, kv::KvDType dtype,
                                 EntryGeometry* g) {
    *g = *EntryGeometry::of(fingerprint(dtype), static_cast<int32_t>(tokens.size()));
    std::vector<std::byte> bytes(g->bytes());
    REQUIRE(assembler->produce(tokens, KvAssembler::entry_writer(bytes, *g)).is_ok());
    return bytes;
  }

  std::vector<int32_t> prompt(const std::vector<int32_t>& order) const {
    std::vector<int32_t> t = prefix;
    for (int32_t i : order) t.insert(t.end(), segments[i].begin(), segments[i].end());
    t.insert(t.end(), query.begin(), query.end());
    return t;
  }

  // The reference: a plain causal prefill of the same tokens in a cache of its own.
  std::vector<float> full_logits(const std::vector<int32_t>& tokens) {
    auto cache = eng::KvCache::create(engine->backend(), 96);
    REQUIRE(cache.is_ok());
    auto logits = engine->prefill(*cache, tokens);
    REQUIRE(logits.is_ok());
    return *logits;
  }
};

// Entries of every segment as dynamic ones: each computed alone after the prefix.
struct Entries {
  std::vector<std::vector<std::byte>> bytes;
  std::vector<EntryGeometry> geometry;
};
Entries dynamic_entries(Fixture& f, kv::KvDType dtype) {
  Entries e;
  for (const auto& s : f.segments) {
    EntryGeometry g;
    e.bytes.push_back(f.produce(s, dtype, &g));
    e.geometry.push_back(g);
  }
  return e;
}

// One static group holding every segment in prompt order, [prefix][s0 s1 s2 s3], in f32: the
// prompt's own KV at its own positions.
struct ExactGroup {
  std::vector<std::byte> bytes;
  EntryGeometry geometry;
  std::vector<int32_t> offset;  // each segment's first row
  int32_t tokens = 0;
};
ExactGroup exact_group(Fixture& f) {
  ExactGroup e;
  std::vector<int32_t> all;
  for (const auto& s : f.segments) {
    e.offset.push_back(static_cast<int32_t>(all.size()));
    all.insert(all.end(), s.begin(), s.end());
  }
  e.bytes = f.produce(all, kv::KvDType::kF32, &e.geometry);
  e.tokens = static_cast<int32_t>(all.size());
  return e;
}

AssembleRequest request(const Fixture& f, const Entries* entries, Method m,
                        const std::vector<int32_t>& order = {0, 1, 2, 3}) {
  AssembleRequest r;
  for (int32_t i : order) {
    PromptSegment s;
    s.tokens = f.segments[i];
    if (entries != nullptr) s.kv = SegmentKv{entries->bytes[i], entries->geometry[i], 0};
    r.segments.push_back(std::move(s));
  }
  r.query = f.query;
  r.method = m;
  return r;
}

// Two prefills of r, toggle(true) before the first and toggle(false) before the second (left
// off): both succeed and make the same checks, hops and recomputed rows.
std::pair<Prefilled, Prefilled> same_selections(Fixture& f, const AssembleRequest& r,
                                                const std::function<void(bool)>& toggle) {
  toggle(true);
  auto on = f.assembler->prefill(r);
  toggle(false);
  auto off = f.assembler->prefill(r);
  REQUIRE_MESSAGE(on.is_ok(), on.status().to_string());
  REQUIRE_MESSAGE(off.is_ok(), off.status().to_string());
  REQUIRE(!on->stats.check_layers.empty());
  CHECK(on->stats.check_layers == off->stats.check_layers);
  CHECK(on->stats.hops == off->stats.hops);
  CHECK(on->stats.recomputed_per_layer == off->stats.recomputed_per_layer);
  return {std::move(on).value(), std::move(off).value()};
}

}  // namespace

TEST_CASE("full, keep at d = 1 and cacheblend at 100 % give the full prefill's logits") {
  Fixture f;
  Entries e = dynamic_entries(f, kv::KvDType::kBF16);
  const auto want = f.full_logits(f.prompt({0, 1, 2, 3}));

  auto full = f.assembler->prefill(request(f, &e, Method::kFull));
  REQUIRE_MESSAGE(full.is_ok(), full.status().to_string());
  CHECK(max_abs_diff(full->last_logits.data(), want.data(), want.size()) <= kLogitTol);
  CHECK(full->stats.recompute_ratio == 1.0);
  CHECK(full->stats.bytes_loaded == 0);
  CHECK(full->stats.cached_prefix == 0);

  auto r = request(f, &e, Method::kKeep);
  r.knobs.keep_decay = 1.0;
  auto keep1 = f.assembler->prefill(r);
  REQUIRE(keep1.is_ok());
  CHECK(max_abs_diff(keep1->last_logits.data(), want.data(), want.size()) <= kLogitTol);
  CHECK(keep1->stats.check_layers.empty());
  CHECK(keep1->stats.bytes_loaded == 0);
  CHECK(keep1->stats.cached_prefix == 5);

  r = request(f, &e, Method::kCacheBlend);
  r.knobs.cacheblend_ratio = 1.0;
  auto blend = f.assembler->prefill(r);
  REQUIRE(blend.is_ok());
  CHECK(max_abs_diff(blend->last_logits.data(), want.data(), want.size()) <= kLogitTol);
  CHECK(blend->stats.check_layers == std::vector<int32_t>{1});
  CHECK(blend->stats.recompute_ratio == 1.0);
}

TEST_CASE("full_reuse over KV computed in the same context at the same positions is exact") {
  Fixture f;
  const ExactGroup group = exact_group(f);
  AssembleRequest r = request(f, nullptr, Method::kFullReuse);
  for (size_t i = 0; i < r.segments.size(); ++i) {
    r.segments[i].kv = SegmentKv{group.bytes, group.geometry, group.offset[i]};
  }
  auto reuse = f.assembler->prefill(r);
  REQUIRE_MESSAGE(reuse.is_ok(), reuse.status().to_string());
  const auto want = f.full_logits(f.prompt({0, 1, 2, 3}));
  CHECK(max_abs_diff(reuse->last_logits.data(), want.data(), want.size()) <= kLogitTol);
  CHECK(reuse->stats.recompute_ratio == 0.0);
  CHECK(reuse->stats.segments_loadable == 4);
  const uint64_t memory = static_cast<uint64_t>(group.tokens);
  CHECK(reuse->stats.bytes_loaded == memory * f.fingerprint(kv::KvDType::kF32).bytes_per_token());
}

TEST_CASE(
    "every method over exact entries gives the full prefill's logits, whatever it recomputes") {
  // Entries computed in the prompt's own context at its positions (one group, [prefix][s0..s3])
  // are what a full prefill computes: mixing loaded and recomputed rows at any share -- keep's
  // shrinking selection, cacheblend's chosen tokens, epic's first tokens -- must then reproduce
  // full. A slot at a wrong position, a row gathered out of order or a layer loaded from the
  // wrong place shows here.
  Fixture f(8);
  const ExactGroup group = exact_group(f);
  const auto want = f.full_logits(f.prompt({0, 1, 2, 3}));
  for (const Method m : {Method::kKeep, Method::kCacheBlend, Method::kEpic}) {
    for (const double share : {0.3, 0.7, 0.9}) {
      AssembleRequest r = request(f, nullptr, m);
      for (size_t i = 0; i < r.segments.size(); ++i) {
        r.segments[i].kv = SegmentKv{group.bytes, group.geometry, group.offset[i]};
      }
      r.knobs.keep_decay = share;
      r.knobs.cacheblend_ratio = share;
      r.knobs.epic_tokens = share < 0.5 ? 1 : 2;
      auto p = f.assembler->prefill(r);
      REQUIRE_MESSAGE(p.is_ok(), p.status().to_string());
      CHECK(p->stats.recompute_ratio > 0.0);
      CHECK(p->stats.recompute_ratio < 1.0);
      CHECK_MESSAGE(max_abs_diff(p->last_logits.data(), want.data(), want.size()) <= kLogitTol,
                    method_name(m) << " at " << share);
    }
  }
}

TEST_CASE("KV loaded at another position equals KV computed there: K is rotated on load") {
  Fixture f;
  Entries e = dynamic_entries(f, kv::KvDType::kF32);  // each computed right after the prefix
  // Segment 3 sits last in the prompt, 12 slots later than where its entry was computed. At
  // layer 0 a token's K before RoPE and its V depend on the token alone, so the loaded slots must
  // equal the computed ones exactly where the rotation is right.
  auto reuse = f.assembler->prefill(request(f, &e, Method::kFullReuse));
  REQUIRE(reuse.is_ok());
  const eng::KvView view = f.assembler->cache().layer(0);
  const int64_t kvd = f.engine->config().kv_dim();
  const int32_t begin = 5 + 3 + 4 + 5;  // prefix + segments 0..2
  std::vector<float> k_loaded(view.k_f32() + begin * kvd, view.k_f32() + (begin + 6) * kvd);
  std::vector<float> v_loaded(view.v_f32() + begin * kvd, view.v_f32() + (begin + 6) * kvd);
  REQUIRE(f.assembler->prefill(request(f, &e, Method::kFull)).is_ok());
  const eng::KvView computed = f.assembler->cache().layer(0);
  CHECK(max_abs_diff(k_loaded.data(), computed.k_f32() + begin * kvd, k_loaded.size()) <= 1e-5f);
  CHECK(max_abs_diff(v_loaded.data(), computed.v_f32() + begin * kvd, v_loaded.size()) <= 1e-6f);
  // ... and the K as stored (position of the entry) does differ: the rotation did something.
  std::vector<float> k_raw(static_cast<size_t>(6 * kvd)), v_raw(k_raw.size());
  REQUIRE(read_entry_layer(e.bytes[3], e.geometry[3], 0, 0, 6, k_raw.data(), v_raw.data()).is_ok());
  CHECK(max_abs_diff(k_loaded.data(), k_raw.data(), k_raw.size()) > 1e-3f);
}

TEST_CASE("ablations: K not rotated to the prompt; entries computed without the prefix") {
  Fixture f;
  Entries e = dynamic_entries(f, kv::KvDType::kBF16);  // each computed right after the prefix
  const eng::KvView view = f.assembler->cache().layer(0);
  const int64_t kvd = f.engine->config().kv_dim();
  auto layer0_k = [&](int32_t begin, int32_t n) {
    return std::vector<float>(view.k_f32() + begin * kvd, view.k_f32() + (begin + n) * kvd);
  };
  auto corrected = f.assembler->prefill(request(f, &e, Method::kFullReuse));
  REQUIRE(corrected.is_ok());
  const int32_t s0 = 5, s3 = 5 + 3 + 4 + 5;  // segment 0 sits where it was computed, 3 does not
  const auto k0 = layer0_k(s0, 3), k3 = layer0_k(s3, 6);
  LoadOptions off;
  off.position_correction = false;
  f.assembler->set_load_options(off);
  auto uncorrected = f.assembler->prefill(request(f, &e, Method::kFullReuse));
  f.assembler->set_load_options({});
  REQUIRE(uncorrected.is_ok());
  CHECK(max_abs_diff(layer0_k(s0, 3).data(), k0.data(), k0.size()) <= 1e-6f);
  CHECK(max_abs_diff(layer0_k(s3, 6).data(), k3.data(), k3.size()) > 1e-3f);
  CHECK(corrected->last_logits != uncorrected->last_logits);

  // Without the prefix in front: layer 0 (a token's own K and V) is the same, later layers not.
  EntryGeometry g;
  const auto with = f.produce(f.segments[2], kv::KvDType::kF32, &g);
  ProduceOptions alone;
  alone.with_prefix = false;
  f.assembler->set_produce_options(alone);
  const auto without = f.produce(f.segments[2], kv::KvDType::kF32, &g);
  f.assembler->set_produce_options({});
  const size_t n = static_cast<size_t>(g.tokens * kvd);
  std::vector<float> ka(n), va(n), kb(n), vb(n);
  for (int32_t layer : {0, 2}) {
    REQUIRE(read_entry_layer(with, g, layer, 0, g.tokens, ka.data(), va.data()).is_ok());
    REQUIRE(read_entry_layer(without, g, layer, 0, g.tokens, kb.data(), vb.data()).is_ok());
    if (layer == 0) {
      CHECK(max_abs_diff(ka.data(), kb.data(), n) <= 1e-6f);
      CHECK(max_abs_diff(va.data(), vb.data(), n) <= 1e-6f);
    } else {
      CHECK(max_abs_diff(ka.data(), kb.data(), n) > 1e-4f);
    }
  }
}

TEST_CASE("a missing or stale entry is computed, never served") {
  Fixture f;
  Entries e = dynamic_entries(f, kv::KvDType::kBF16);
  const auto want = f.full_logits(f.prompt({0, 1, 2, 3}));
  // No entry at all: full_reuse computes everything and is exact.
  auto none = f.assembler->prefill(request(f, nullptr, Method::kFullReuse));
  REQUIRE(none.is_ok());
  CHECK(max_abs_diff(none->last_logits.data(), want.data(), want.size()) <= kLogitTol);
  CHECK(none->stats.segments_loadable == 0);
  CHECK(none->stats.bytes_loaded == 0);
  // One segment's entry missing (its validation failed): that segment is computed at every layer.
  auto r = request(f, &e, Method::kFullReuse);
  r.segments[2].kv = SegmentKv{};
  auto some = f.assembler->prefill(r);
  REQUIRE(some.is_ok());
  CHECK(some->stats.segments_loadable == 3);
  for (int32_t n : some->stats.recomputed_per_layer) CHECK(n == 5);
  // An entry that does not fit the segment is refused, not read past its end.
  r = request(f, &e, Method::kFullReuse);
  r.segments[0].kv.first_row = 1;
  CHECK(f.assembler->prefill(r).status().code() == keep::Code::kInvalidArgument);
}

TEST_CASE("keep below d = 1 checks, selects, loads, and reports what it did") {
  Fixture f(8);
  Entries e = dynamic_entries(f, kv::KvDType::kBF16);
  auto r = request(f, &e, Method::kKeep);
  r.knobs.keep_decay = 0.7;  // 4, 2.8, 1.96, 1.37, 0.96: 4, 2, 1, 1, 0 -> check layers 0, 1, 3
  auto keep = f.assembler->prefill(r);
  REQUIRE_MESSAGE(keep.is_ok(), keep.status().to_string());
  CHECK(keep->stats.check_layers == std::vector<int32_t>{0, 1, 3});
  CHECK(keep->stats.hops.size() == 3);
  CHECK(keep->stats.pooled_columns == std::vector<int32_t>{4, 2, 1});  // the segments computed
  // The host's time at each check: its wait for the pooled columns, its decision.
  REQUIRE(keep->stats.check_wait_us.size() == 3);
  REQUIRE(keep->stats.check_decide_us.size() == 3);
  for (size_t k = 0; k < 3; ++k) {
    CHECK(keep->stats.check_wait_us[k] >= 0.0);
    CHECK(keep->stats.check_decide_us[k] > 0.0);  // selection and the next plan take some time
  }
  CHECK(keep->stats.recomputed_per_layer.size() == 8);
  CHECK(keep->stats.recomputed_per_layer[0] == 18);
  CHECK(keep->stats.recomputed_per_layer[4] == 0);
  CHECK(keep->stats.recompute_ratio < 0.5);
  CHECK(keep->stats.bytes_loaded > 0);
  for (float x : keep->last_logits) REQUIRE(std::isfinite(x));
  // epic: the first 2 tokens of each segment at every layer.
  r = request(f, &e, Method::kEpic);
  r.knobs.epic_tokens = 2;
  auto epic = f.assembler->prefill(r);
  REQUIRE(epic.is_ok());
  for (int32_t n : epic->stats.recomputed_per_layer) CHECK(n == 8);
}

TEST_CASE("keep pools a column per segment computed at the layer: the same selections") {
  // Importance reads only the columns of the segments computed at a check layer; pooling the
  // others too (every segment a column) must give the same checks, hops, recomputed rows and so
  // the same logits, from wider pooled attention.
  Fixture f(8);
  Entries e = dynamic_entries(f, kv::KvDType::kBF16);
  for (double d : {0.7, 0.85}) {
    CAPTURE(d);
    auto r = request(f, &e, Method::kKeep);
    r.knobs.keep_decay = d;
    const auto [wide, narrow] =
        same_selections(f, r, [&](bool on) { f.assembler->set_pool_every_segment(on); });
    CHECK(narrow.last_logits == wide.last_logits);
    // Every segment is a candidate at layer 0; later checks pool fewer columns.
    REQUIRE(wide.stats.pooled_columns.size() == narrow.stats.pooled_columns.size());
    for (int32_t c : wide.stats.pooled_columns) CHECK(c == 4);
    CHECK(narrow.stats.pooled_columns.front() == 4);
    CHECK(narrow.stats.pooled_columns.back() < 4);
    for (size_t i = 1; i < narrow.stats.pooled_columns.size(); ++i) {
      CHECK(narrow.stats.pooled_columns[i] < narrow.stats.pooled_columns[i - 1]);
    }
  }
}

TEST_CASE("keep choosing rows inside the check layer: the same selections, less MLP") {
  // choose_early runs a check layer's MLP only for the rows that go on; the selections and the
  // rows that reach the logits are the same, so the logits are too.
  Fixture f(8);
  Entries e = dynamic_entries(f, kv::KvDType::kBF16);
  for (double d : {0.7, 0.85}) {
    CAPTURE(d);
    auto r = request(f, &e, Method::kKeep);
    r.knobs.keep_decay = d;
    const auto [early, late] =
        same_selections(f, r, [&](bool on) { f.assembler->set_choose_early(on); });
    CHECK(early.stats.pooled_columns == late.stats.pooled_columns);
    CHECK(late.stats.mlp_rows_skipped == 0);
    // Every memory row computed at a check layer and not at the next one skipped its MLP there.
    int64_t dropped = 0;
    const auto& per_layer = early.stats.recomputed_per_layer;
    for (int32_t l : early.stats.check_layers) {
      if (l + 1 < static_cast<int32_t>(per_layer.size()))
        dropped += per_layer[l] - per_layer[l + 1];
    }
    CHECK(dropped > 0);
    CHECK(early.stats.mlp_rows_skipped == dropped);
    REQUIRE(early.last_logits.size() == late.last_logits.size());
    float worst = 0.0f;
    for (size_t i = 0; i < early.last_logits.size(); ++i) {
      worst = std::max(worst, std::abs(early.last_logits[i] - late.last_logits[i]));
    }
    CHECK(worst < 1e-4f);  // fp32, the MLP products over fewer rows
    // Generation after it reads the same cache.
    const auto g_late = f.assembler->generate(late, {.max_tokens = 3});
    f.assembler->set_choose_early(true);
    auto again = f.assembler->prefill(r);
    REQUIRE(again.is_ok());
    const auto g_early = f.assembler->generate(*again, {.max_tokens = 3});
    f.assembler->set_choose_early(false);
    REQUIRE(g_late.is_ok());
    REQUIRE(g_early.is_ok());
    CHECK(*g_early == *g_late);
  }
}

TEST_CASE("the load order does not change what a request computes") {
  // Queued with prefetch of every later layer, with none, and on the compute path: the loads of
  // a segment excluded at a check reach every later layer, whenever they are issued.
  Fixture f(8);
  Entries e = dynamic_entries(f, kv::KvDType::kBF16);
  for (const Method m : {Method::kKeep, Method::kCacheBlend, Method::kFullReuse, Method::kEpic}) {
    auto r = request(f, &e, m);
    r.knobs.keep_decay = 0.7;
    r.knobs.epic_tokens = 2;
    std::vector<std::vector<float>> logits;
    std::vector<uint64_t> bytes;
    for (const LoadOptions& o : {LoadOptions{true, uint64_t{1} << 40}, LoadOptions{true, 0},
                                 LoadOptions{false, 0}, LoadOptions{true, 2048}}) {
      f.assembler->set_load_options(o);
      auto p = f.assembler->prefill(r);
      REQUIRE_MESSAGE(p.is_ok(), p.status().to_string());
      logits.push_back(p->last_logits);
      bytes.push_back(p->stats.bytes_loaded);
    }
    f.assembler->set_load_options({});
    for (size_t i = 1; i < logits.size(); ++i) {
      CHECK_MESSAGE(logits[0] == logits[i], method_name(m));
      CHECK(bytes[i] == bytes[0]);
    }
    CHECK(bytes[0] > 0);
  }
}

TEST_CASE("prefix reuses the exactly computed prefix of the last prompt") {
  Fixture f;
  auto first = f.assembler->prefill(request(f, nullptr, Method::kFull, {0, 1, 2, 3}));
  REQUIRE(first.is_ok());
  auto second = f.assembler->prefill(request(f, nullptr, Method::kPrefix, {0, 1, 3, 2}));
  REQUIRE_MESSAGE(second.is_ok(), second.status().to_string());
  CHECK(second->stats.cached_prefix == 5 + 3 + 4);
  CHECK(second->stats.recompute_ratio == doctest::Approx(11.0 / 18.0));
  const auto want = f.full_logits(f.prompt({0, 1, 3, 2}));
  CHECK(max_abs_diff(second->last_logits.data(), want.data(), want.size()) <= kLogitTol);
  // After a request that loaded KV, only the system prefix is exact any more.
  Entries e = dynamic_entries(f, kv::KvDType::kBF16);
  REQUIRE(f.assembler->prefill(request(f, &e, Method::kFullReuse)).is_ok());
  auto third = f.assembler->prefill(request(f, nullptr, Method::kPrefix, {0, 1, 2, 3}));
  REQUIRE(third.is_ok());
  CHECK(third->stats.cached_prefix == 5);
}

TEST_CASE("generation and candidate scoring after the assembled prompt match the engine's") {
  Fixture f;
  const auto tokens = f.prompt({0, 1, 2, 3});
  auto pre = f.assembler->prefill(request(f, nullptr, Method::kFull));
  REQUIRE(pre.is_ok());
  eng::GenerateOptions o;
  o.max_tokens = 6;
  o.stop_at_eos = false;
  auto got = f.assembler->generate(*pre, o);
  REQUIRE(got.is_ok());
  auto want = f.engine->generate(tokens, o);
  REQUIRE(want.is_ok());
  CHECK(*got == *want);

  pre = f.assembler->prefill(request(f, nullptr, Method::kFull));
  REQUIRE(pre.is_ok());
  const std::vector<std::vector<int32_t>> candidates = {{3, 4, 5}, {7}, {}, {11, 12}};
  auto scores = f.assembler->score(*pre, candidates);
  REQUIRE(scores.is_ok());
  auto ref = f.engine->score_candidates(tokens, candidates);
  REQUIRE(ref.is_ok());
  REQUIRE(scores->size() == ref->size());
  for (size_t i = 0; i < ref->size(); ++i) {
    CHECK((*scores)[i].log_prob == doctest::Approx((*ref)[i].log_prob).epsilon(1e-5));
    CHECK((*scores)[i].tokens == (*ref)[i].tokens);
  }
}

TEST_CASE("production in steps gives the same entry as in one go; a prefill abandons it") {
  Fixture f;
  EntryGeometry g;
  const auto whole = f.produce(f.segments[2], kv::KvDType::kF32, &g);
  std::vector<std::byte> stepped(g.bytes());
  const auto sink = KvAssembler::entry_writer(stepped, g);
  REQUIRE(f.assembler->begin_produce(f.segments[2]).is_ok());
  int steps = 0;
  for (bool done = false; !done; ++steps) {
    auto r = f.assembler->produce_layers(3, sink);
    REQUIRE(r.is_ok());
    done = *r;
  }
  CHECK(steps == 2);  // 4 layers, 3 at a time
  CHECK(stepped == whole);
  REQUIRE(f.assembler->begin_produce(f.segments[2]).is_ok());
  REQUIRE(f.assembler->prefill(request(f, nullptr, Method::kFull)).is_ok());
  CHECK(f.assembler->produce_layers(1, sink).status().code() == keep::Code::kInvalidArgument);
}
