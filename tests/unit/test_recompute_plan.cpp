// KEEP's request planning as plain data: the recompute schedule, multi-hop importance on hand-made
// attention, and each method's layer-by-layer rows (services/worker/keep/).
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "services/worker/keep/importance.h"
#include "services/worker/keep/recompute_plan.h"
#include "services/worker/keep/recompute_schedule.h"

using namespace keep::worker;
using keep::Code;

namespace {

std::vector<int32_t> range(int32_t b, int32_t e) {
  std::vector<int32_t> v(static_cast<size_t>(e - b));
  std::iota(v.begin(), v.end(), b);
  return v;
}
std::vector<int32_t> concat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

}  // namespace

TEST_CASE("schedule: R_i = R_{i-1} d, floored; check layers where the count drops") {
  auto full = make_recompute_schedule(24, 10, 1.0);
  REQUIRE(full.is_ok());
  CHECK(full->segments == std::vector<int32_t>(24, 10));
  CHECK(full->check_layers().empty());
  CHECK(full->average_ratio() == 1.0);

  // 10, 9.6, 9.216, 8.847, 8.493
  auto s = make_recompute_schedule(5, 10, 0.96);
  REQUIRE(s.is_ok());
  CHECK(s->segments == std::vector<int32_t>{10, 9, 9, 8, 8});
  CHECK(s->check_layers() == std::vector<int32_t>{0, 2});
  CHECK(s->is_check(0));
  CHECK_FALSE(s->is_check(1));
  CHECK_FALSE(s->is_check(4));  // the last layer decides nothing
  CHECK(s->average_ratio() == doctest::Approx(44.0 / 50.0));

  auto halves = make_recompute_schedule(4, 8, 0.5);
  CHECK(halves->segments == std::vector<int32_t>{8, 4, 2, 1});
  CHECK(halves->check_layers() == std::vector<int32_t>{0, 1, 2});
  // 10 x 0.9 is 8.999999999999998 in binary: still 9 segments.
  CHECK(make_recompute_schedule(2, 10, 0.9)->segments == std::vector<int32_t>{10, 9});
  CHECK(make_recompute_schedule(3, 0, 0.5)->segments == std::vector<int32_t>{0, 0, 0});

  CHECK(make_recompute_schedule(0, 10, 0.9).status().code() == Code::kInvalidArgument);
  CHECK(make_recompute_schedule(4, 10, 1.5).status().code() == Code::kInvalidArgument);
  CHECK(make_recompute_schedule(4, 10, NAN).status().code() == Code::kInvalidArgument);
  CHECK(make_recompute_schedule(4, -1, 0.5).status().code() == Code::kInvalidArgument);
}

// Four segments, two heads. Row 0 is an early query row, row 1 the last one; rows 2..5 are one
// token of each segment. Segment 0 reads segment 3 heavily; the query never reads segment 3.
struct Attention {
  static constexpr int32_t G = 4;
  std::vector<float> pooled = {
      // seg0  seg1  seg2  seg3
      0.0f, 0.0f, 0.0f, 2.0f,  // row 0: query (early)
      0.6f, 0.5f, 0.4f, 0.0f,  // row 1: query (last)
      0.2f, 0.0f, 0.0f, 1.8f,  // row 2: segment 0
      0.0f, 2.0f, 0.0f, 0.0f,  // row 3: segment 1
      0.0f, 0.0f, 2.0f, 0.0f,  // row 4: segment 2
      0.0f, 0.0f, 0.0f, 2.0f,  // row 5: segment 3
  };
  std::vector<int32_t> row_segment = {-1, -1, 0, 1, 2, 3};
  std::vector<int32_t> query_rows = {0, 1};
  ImportanceInput input() const { return {G, 2, pooled, row_segment, query_rows}; }
};

TEST_CASE("schedule: the decay for an average ratio comes nearest it, larger for a larger ratio") {
  for (const double ratio : {0.15, 0.3, 0.6}) {
    CAPTURE(ratio);
    const double d = decay_for_average_ratio(48, 40, ratio);
    const auto at = make_recompute_schedule(48, 40, d);
    REQUIRE(at.is_ok());
    // Nearer than the schedules a little either side of it (the ratio moves in steps).
    for (const double other : {d - 0.01, d + 0.01}) {
      const auto sch = make_recompute_schedule(48, 40, other);
      REQUIRE(sch.is_ok());
      CHECK(std::abs(at->average_ratio() - ratio) <= std::abs(sch->average_ratio() - ratio));
    }
    CHECK(std::abs(at->average_ratio() - ratio) < 0.02);
  }
  CHECK(decay_for_average_ratio(48, 40, 0.15) < decay_for_average_ratio(48, 40, 0.3));
}

TEST_CASE("importance hop 0: the last q query rows, per head and row") {
  Attention att;
  const std::vector<int32_t> all = {0, 1, 2, 3};
  ImportanceOptions o;
  o.max_hops = 0;
  o.query_rows_used = 1;  // row 1 only: 0.30, 0.25, 0.20, 0
  auto one = select_segments(att.input(), all, {}, 2, o);
  REQUIRE(one.is_ok());
  CHECK(one->selected == std::vector<int32_t>{0, 1});
  CHECK(one->score[0] == doctest::Approx(0.30));
  CHECK(one->score[3] == doctest::Approx(0.0));
  CHECK(one->hops == 0);
  CHECK_FALSE(one->converged);  // the cap ended it before a hop could confirm the set
  o.query_rows_used = 2;        // rows 0 and 1: 0.15, 0.125, 0.10, 0.5
  auto two = select_segments(att.input(), all, {}, 2, o);
  REQUIRE(two.is_ok());
  CHECK(two->selected == std::vector<int32_t>{0, 3});
  CHECK(two->score[3] == doctest::Approx(0.5));
}

TEST_CASE("importance hops: a segment the query ignores but a selected one reads is promoted") {
  Attention att;
  const std::vector<int32_t> all = {0, 1, 2, 3};
  ImportanceOptions o;
  o.query_rows_used = 1;
  auto sel = select_segments(att.input(), all, {}, 2, o);
  REQUIRE(sel.is_ok());
  // hop 0 {0, 1}; hop 1 s3 += (0.3/0.55) * 0.9 -> {0, 3}; hop 2 confirms {0, 3}.
  CHECK(sel->selected == std::vector<int32_t>{0, 3});
  CHECK(sel->hops == 2);
  CHECK(sel->converged);
  CHECK(sel->score[3] ==
        doctest::Approx(0.3 / 0.55 * 0.9 + (0.3 / (0.3 + 0.3 / 0.55 * 0.9)) * 0.9));
  CHECK(sel->score[1] == doctest::Approx(0.25));

  o.max_hops = 1;  // the cap stops it after one hop, set still changing
  auto capped = select_segments(att.input(), all, {}, 2, o);
  CHECK(capped->selected == std::vector<int32_t>{0, 3});
  CHECK(capped->hops == 1);
  CHECK_FALSE(capped->converged);
}

TEST_CASE("importance: only candidates, pinned always, keep >= candidates keeps all") {
  Attention att;
  ImportanceOptions o;
  o.query_rows_used = 1;
  // Only segments 1 and 3 were recomputed at this layer: the rest cannot come back.
  auto sub = select_segments(att.input(), std::vector<int32_t>{1, 3}, {}, 1, o);
  REQUIRE(sub.is_ok());
  CHECK(sub->selected == std::vector<int32_t>{1});
  CHECK(sub->score[0] == 0.0);
  // Pinned (no KV entry) stays and counts towards keep.
  auto pin =
      select_segments(att.input(), std::vector<int32_t>{0, 1, 2, 3}, std::vector<int32_t>{2}, 2, o);
  CHECK(pin->selected == std::vector<int32_t>{0, 2});
  auto over = select_segments(att.input(), std::vector<int32_t>{0, 1, 2, 3},
                              std::vector<int32_t>{1, 2}, 1, o);
  CHECK(over->selected == std::vector<int32_t>{1, 2});
  auto all = select_segments(att.input(), std::vector<int32_t>{0, 1, 2, 3}, {}, 9, o);
  CHECK(all->selected == std::vector<int32_t>{0, 1, 2, 3});
  CHECK(all->hops == 0);
  CHECK(all->converged);
  // Ties go to the earlier segment.
  std::vector<float> flat(6 * 4, 0.5f);
  ImportanceInput tie{4, 2, flat, att.row_segment, att.query_rows};
  o.max_hops = 0;
  CHECK(select_segments(tie, std::vector<int32_t>{0, 1, 2, 3}, {}, 2, o)->selected ==
        std::vector<int32_t>{0, 1});
  // Uniform attention makes the hops swap the set back and forth: the cap ends it.
  o.max_hops = 5;
  auto swaps = select_segments(tie, std::vector<int32_t>{0, 1, 2, 3}, {}, 2, o);
  CHECK(swaps->hops == 5);
  CHECK_FALSE(swaps->converged);
  CHECK(swaps->selected.size() == 2);
}

TEST_CASE("importance over pooled columns for some segments only selects as over all of them") {
  // A check layer pools a column only for the segments computed there (column_segment): the same
  // scores, hops and selection as from every segment's column.
  Attention att;
  const std::vector<int32_t> cols = {1, 2, 3};
  std::vector<float> narrow;
  for (size_t r = 0; r < att.row_segment.size(); ++r) {
    for (int32_t c : cols) narrow.push_back(att.pooled[r * Attention::G + c]);
  }
  auto in = att.input();
  in.pooled = narrow;
  in.column_segment = cols;
  std::vector<int32_t> rows_1_2_3 = {-1, -1, -1, 1, 2, 3};  // segment 0 not computed here
  in.row_segment = rows_1_2_3;
  auto wide_in = att.input();
  wide_in.row_segment = rows_1_2_3;
  for (const int32_t keep : {1, 2}) {
    CAPTURE(keep);
    auto a = select_segments(in, cols, {}, keep);
    auto b = select_segments(wide_in, cols, {}, keep);
    REQUIRE_MESSAGE(a.is_ok(), a.status().to_string());
    REQUIRE(b.is_ok());
    CHECK(a->selected == b->selected);
    CHECK(a->score == b->score);
    CHECK(a->hops == b->hops);
  }
  // A candidate without a column, columns out of order or range, or a size mismatch: refused.
  auto st = select_segments(in, std::vector<int32_t>{0, 1}, {}, 1).status();
  CHECK(st.code() == Code::kInvalidArgument);
  CHECK(st.message().find("segment 0 has no pooled column") != std::string::npos);
  std::vector<int32_t> unordered = {2, 1, 3}, outside = {1, 2, 4};
  auto bad = in;
  bad.column_segment = unordered;
  CHECK(select_segments(bad, cols, {}, 1).status().code() == Code::kInvalidArgument);
  bad.column_segment = outside;
  CHECK(select_segments(bad, cols, {}, 1).status().code() == Code::kInvalidArgument);
  bad = in;
  bad.pooled = att.pooled;  // G columns a row, not 3
  CHECK(select_segments(bad, cols, {}, 1).status().code() == Code::kInvalidArgument);
}

TEST_CASE("importance: a segment's rows, one or several, adjacent or apart, give the same means") {
  // a[i][j] is a mean over i's rows, summed run by run of adjacent rows: each segment row twice
  // (adjacent), then the copies placed apart, give the scores of one row each.
  Attention att;
  const std::vector<int32_t> all = {0, 1, 2, 3};
  std::vector<float> twice, apart;
  std::vector<int32_t> seg_twice, seg_apart;
  for (size_t r = 0; r < att.row_segment.size(); ++r) {  // adjacent copies
    const int n = att.row_segment[r] < 0 ? 1 : 2;
    for (int k = 0; k < n; ++k) {
      twice.insert(twice.end(), att.pooled.begin() + r * Attention::G,
                   att.pooled.begin() + (r + 1) * Attention::G);
      seg_twice.push_back(att.row_segment[r]);
    }
  }
  for (int pass = 0; pass < 2; ++pass) {  // the segment rows, then the same again after them
    for (size_t r = 2; r < att.row_segment.size(); ++r) {
      apart.insert(apart.end(), att.pooled.begin() + r * Attention::G,
                   att.pooled.begin() + (r + 1) * Attention::G);
      seg_apart.push_back(att.row_segment[r]);
    }
  }
  apart.insert(apart.end(), att.pooled.begin(), att.pooled.begin() + 2 * Attention::G);
  seg_apart.insert(seg_apart.end(), {-1, -1});
  const std::vector<int32_t> q_twice = {0, 1};
  const std::vector<int32_t> q_apart = {static_cast<int32_t>(seg_apart.size()) - 2,
                                        static_cast<int32_t>(seg_apart.size()) - 1};
  ImportanceOptions o;
  o.query_rows_used = 1;
  const auto one = select_segments(att.input(), all, {}, 2, o);
  const auto a = select_segments({Attention::G, 2, twice, seg_twice, q_twice}, all, {}, 2, o);
  const auto b = select_segments({Attention::G, 2, apart, seg_apart, q_apart}, all, {}, 2, o);
  REQUIRE(one.is_ok());
  REQUIRE(a.is_ok());
  REQUIRE(b.is_ok());
  for (const auto* x : {&*a, &*b}) {
    CHECK(x->selected == one->selected);
    CHECK(x->hops == one->hops);
    for (size_t g = 0; g < all.size(); ++g) CHECK(x->score[g] == doctest::Approx(one->score[g]));
  }
}

TEST_CASE("importance refuses inconsistent input") {
  Attention att;
  const std::vector<int32_t> all = {0, 1, 2, 3};
  auto in = att.input();
  std::vector<float> short_pooled(att.pooled.begin(), att.pooled.end() - 1);
  in.pooled = short_pooled;
  CHECK(select_segments(in, all, {}, 2).status().code() == Code::kInvalidArgument);
  std::vector<int32_t> no_rows_for_3 = {-1, -1, 0, 1, 2, 2};
  in = att.input();
  in.row_segment = no_rows_for_3;
  auto st = select_segments(in, all, {}, 2).status();
  CHECK(st.code() == Code::kInvalidArgument);
  CHECK(st.message().find("segment 3 has no rows") != std::string::npos);
  CHECK(select_segments(att.input(), std::vector<int32_t>{0, 1}, std::vector<int32_t>{2}, 1)
            .status()
            .code() == Code::kInvalidArgument);
  CHECK(select_segments(att.input(), std::vector<int32_t>{1, 0}, {}, 1).status().code() ==
        Code::kInvalidArgument);
  CHECK(select_segments(att.input(), all, {}, -1).status().code() == Code::kInvalidArgument);
}

// Prompt of 20 slots: cached prefix [0, 3); segments [3, 7) loadable, [7, 10) without KV,
// [10, 15) loadable; the query [15, 20).
PromptShape shape() {
  PromptShape s;
  s.total = 20;
  s.cached_prefix = 3;
  s.segments = {{3, 7, true}, {7, 10, false}, {10, 15, true}};
  return s;
}

TEST_CASE("methods: full, prefix, full_reuse and epic keep one row set at every layer") {
  const auto q = range(15, 20);
  struct Want {
    Method m;
    std::vector<int32_t> rows;
    double ratio;
  };
  MethodKnobs knobs;
  knobs.epic_tokens = 2;
  const Want wants[] = {
      {Method::kFull, range(0, 20), 1.0},
      {Method::kPrefix, range(3, 20), 1.0},
      {Method::kFullReuse, concat({range(7, 10), q}), 3.0 / 12.0},
      {Method::kEpic, concat({{3, 4}, range(7, 10), {10, 11}, q}), 7.0 / 12.0},
  };
  for (const auto& w : wants) {
    INFO(method_name(w.m));
    auto p = RecomputePlan::create(w.m, shape(), 3, knobs);
    REQUIRE(p.is_ok());
    while (!p->done()) {
      CHECK(p->check() == RecomputePlan::Check::kNone);
      CHECK(p->rows() == w.rows);
      REQUIRE(p->next().is_ok());
    }
    CHECK(p->recompute_ratio() == doctest::Approx(w.ratio));
    CHECK(p->memory_rows_per_layer().size() == 3);
  }
  auto reuse = RecomputePlan::create(Method::kFullReuse, shape(), 2);
  CHECK(reuse->loaded_memory_slots() == concat({range(3, 7), range(10, 15)}));
  CHECK(reuse->row_segments() == std::vector<int32_t>{1, 1, 1, -1, -1, -1, -1, -1});
  CHECK(RecomputePlan::create(Method::kFull, shape(), 2)->loaded_memory_slots().empty());
}

TEST_CASE("cacheblend: all memory up to its check layer, then the top share by K deviation") {
  MethodKnobs knobs;
  knobs.cacheblend_ratio = 0.25;  // of the 9 loadable memory tokens: ceil(2.25) = 3
  auto p = RecomputePlan::create(Method::kCacheBlend, shape(), 4, knobs);
  REQUIRE(p.is_ok());
  const auto all = range(3, 20);
  CHECK(p->rows() == all);
  CHECK(p->check() == RecomputePlan::Check::kNone);
  REQUIRE(p->next().is_ok());
  CHECK(p->rows() == all);
  CHECK(p->check() == RecomputePlan::Check::kDeviation);
  CHECK(p->next().code() == Code::kInvalidArgument);  // the deviation is needed
  std::vector<float> dev(all.size(), 0.0f);
  dev[4 - 3] = 5.0f;   // slot 4
  dev[12 - 3] = 7.0f;  // slot 12
  dev[8 - 3] = 99.0f;  // slot 8: no KV entry, computed anyway; not a candidate
  dev[14 - 3] = NAN;   // slot 14: unknown deviation, recomputed
  REQUIRE(p->next({}, dev).is_ok());
  CHECK(p->rows() == concat({{4}, range(7, 10), {12, 14}, range(15, 20)}));
  CHECK(p->loaded_memory_slots() == std::vector<int32_t>{3, 5, 6, 10, 11, 13});
  REQUIRE(p->next().is_ok());
  REQUIRE(p->next().is_ok());
  CHECK(p->done());
  CHECK(p->recompute_ratio() == doctest::Approx((12 + 12 + 6 + 6) / 48.0));

  knobs.cacheblend_ratio = 1.0;  // everything stays: the full prefill's rows after the prefix
  auto everything = RecomputePlan::create(Method::kCacheBlend, shape(), 3, knobs);
  REQUIRE(everything->next().is_ok());
  REQUIRE(everything->next({}, std::vector<float>(all.size(), 0.0f)).is_ok());
  CHECK(everything->rows() == all);
}

TEST_CASE("keep: d = 1 never checks; otherwise importance picks the next layer's segments") {
  auto same = RecomputePlan::create(Method::kKeep, shape(), 5);
  MethodKnobs one;
  one.keep_decay = 1.0;
  auto full = RecomputePlan::create(Method::kKeep, shape(), 5, one);
  REQUIRE(full.is_ok());
  while (!full->done()) {
    CHECK(full->check() == RecomputePlan::Check::kNone);
    CHECK(full->rows() == range(3, 20));
    REQUIRE(full->next().is_ok());
  }
  CHECK(full->recompute_ratio() == 1.0);

  // 3 segments, d = 0.7: 3, 2, 1 -> check layers 0 and 1. Segment 1 has no KV: pinned.
  MethodKnobs knobs;
  knobs.keep_decay = 0.7;
  knobs.importance.query_rows_used = 5;
  auto p = RecomputePlan::create(Method::kKeep, shape(), 3, knobs);
  REQUIRE(p.is_ok());
  CHECK(p->rows() == range(3, 20));
  CHECK(p->check() == RecomputePlan::Check::kImportance);
  CHECK(p->next().code() == Code::kInvalidArgument);  // importance is needed
  // The query reads segment 2 more than segment 0.
  const auto segs = p->row_segments();
  std::vector<float> pooled(segs.size() * 3, 0.0f);
  std::vector<int32_t> query_rows;
  for (size_t r = 0; r < segs.size(); ++r) {
    if (segs[r] < 0) {
      query_rows.push_back(static_cast<int32_t>(r));
      pooled[r * 3 + 0] = 0.2f;
      pooled[r * 3 + 2] = 0.6f;
    } else {
      pooled[r * 3 + segs[r]] = 2.0f;
    }
  }
  ImportanceInput in{3, 2, pooled, segs, query_rows};
  REQUIRE(p->next(&in).is_ok());
  CHECK(p->rows() == concat({range(7, 15), range(15, 20)}));  // segments 1 (pinned) and 2
  CHECK(p->loaded_memory_slots() == range(3, 7));
  CHECK(p->check() == RecomputePlan::Check::kImportance);
  const auto segs1 = p->row_segments();
  std::vector<float> pooled1(segs1.size() * 3, 0.1f);
  std::vector<int32_t> q1;
  for (size_t r = 0; r < segs1.size(); ++r) {
    if (segs1[r] < 0) q1.push_back(static_cast<int32_t>(r));
  }
  ImportanceInput in1{3, 2, pooled1, segs1, q1};
  REQUIRE(p->next(&in1).is_ok());
  CHECK(p->rows() == concat({range(7, 10), range(15, 20)}));  // the pinned one is all that is left
  REQUIRE(p->next().is_ok());
  CHECK(p->done());
  CHECK(p->memory_rows_per_layer() == std::vector<int32_t>{12, 8, 3});
  CHECK(p->recompute_ratio() == doctest::Approx(23.0 / 36.0));
  CHECK(p->hops().size() == 2);
  CHECK(p->next().code() == Code::kInvalidArgument);  // past the last layer
  CHECK(same.is_ok());
}

TEST_CASE(
    "keep with anchor tokens: every segment's first tokens at every layer, unseen by importance") {
  // shape(): prefix [0, 3), segments [3, 7), [7, 10) (no KV: pinned), [10, 15), query [15, 20).
  MethodKnobs knobs;
  knobs.keep_decay = 0.7;  // 3, 2, 1 segments
  knobs.keep_anchor_tokens = 1;
  knobs.importance.query_rows_used = 5;
  auto p = RecomputePlan::create(Method::kKeep, shape(), 3, knobs);
  REQUIRE(p.is_ok());
  CHECK(p->rows() == range(3, 20));
  const auto pick = [&](int32_t favoured) {
    const auto segs = p->row_segments();
    std::vector<float> pooled(segs.size() * 3, 0.0f);
    std::vector<int32_t> query_rows;
    for (size_t r = 0; r < segs.size(); ++r) {
      if (p->rows()[r] >= 15) {
        query_rows.push_back(static_cast<int32_t>(r));
        pooled[r * 3 + favoured] = 0.6f;
      }
    }
    ImportanceInput in{3, 2, pooled, segs, query_rows};
    return p->next(&in);
  };
  REQUIRE(pick(2).is_ok());  // segments 1 (pinned) and 2 go on; 0 keeps its first token
  CHECK(p->rows() == concat({{3}, range(7, 15), range(15, 20)}));
  CHECK(p->loaded_memory_slots() == range(4, 7));
  // The anchor row of deselected segment 0 is no segment's row for importance.
  const auto segs1 = p->row_segments();
  CHECK(segs1[0] == -1);
  CHECK(segs1[1] == 1);
  REQUIRE(pick(2).is_ok());  // only the pinned segment 1 is left, plus 0's and 2's anchors
  CHECK(p->rows() == concat({{3}, range(7, 11), range(15, 20)}));
  REQUIRE(p->next().is_ok());
  CHECK(p->memory_rows_per_layer() == std::vector<int32_t>{12, 9, 5});
  CHECK(p->recompute_ratio() == doctest::Approx(26.0 / 36.0));
  MethodKnobs bad;
  bad.keep_anchor_tokens = -1;
  CHECK(RecomputePlan::create(Method::kKeep, shape(), 2, bad).status().code() ==
        Code::kInvalidArgument);
}

TEST_CASE("methods parse by name; bad shapes and knobs are refused") {
  for (Method m : kAllMethods) CHECK(parse_method(method_name(m)) == m);
  CHECK_FALSE(parse_method("blend").has_value());
  PromptShape bad = shape();
  bad.segments[1].begin = 5;  // overlaps segment 0
  CHECK(RecomputePlan::create(Method::kKeep, bad, 2).status().code() == Code::kInvalidArgument);
  bad = shape();
  bad.segments[0].begin = 1;  // inside the cached prefix
  CHECK(RecomputePlan::create(Method::kKeep, bad, 2).status().code() == Code::kInvalidArgument);
  MethodKnobs k;
  k.keep_decay = -0.1;
  CHECK(RecomputePlan::create(Method::kKeep, shape(), 2, k).status().code() ==
        Code::kInvalidArgument);
  CHECK(RecomputePlan::create(Method::kKeep, shape(), 0).status().code() == Code::kInvalidArgument);
}
