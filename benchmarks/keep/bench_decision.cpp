// The host's decision at keep's check layers (issue 29), on the CPU: for each check layer of one
// request, what KvAssembler's decide() does once the pooled columns are on the host,
// RecomputePlan::next (multi-hop importance, the next layer's rows); each row's segment and the
// query's rows are made before that wait, untimed, as there. With rows chosen inside the layer
// the GPU waits for the decision after o_proj (bench_keep --profile's `choose` stage), so its time
// is on keep's path. Pooled values are random (what importance selects does not change the work
// much); the prompt is bench_keep's: a 32-token prefix, segments of 25/15/80 tokens in turn
// scaled to --memory-tokens at 40 segments, a 128-token query; keep at the d whose schedule
// averages --ratio.
//
//   build/bin/bench_decision [--segments 10,20,40,80] [--layers 48] [--heads 40] [--ratio 0.15]
//                            [--memory-tokens 4096] [--reps 20]
//
// One line per segment count: the decision summed over the request's checks (median of --reps
// requests), then the first checks' [layer, rows, columns, us] (medians).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/keep/bench_util.h"
#include "services/worker/keep/recompute_plan.h"
#include "services/worker/keep/recompute_schedule.h"

using namespace keep;
using namespace keep::worker;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kUsage =
    "usage: bench_decision [--segments N[,N...]] [--layers L] [--heads H] [--ratio R]\n"
    "                      [--memory-tokens M] [--reps N]\n";

int refuse(const std::string& why) {
  std::fprintf(stderr, "bench_decision: %s\n%s", why.c_str(), kUsage);
  return 2;
}

struct Check {
  int32_t layer = 0;
  size_t rows = 0, columns = 0;
  double us = 0;
};

// One request's checks, each decided as KvAssembler::prefill's decide() does.
Result<std::vector<Check>> run_request(const PromptShape& shape, int32_t layers, int32_t heads,
                                       const MethodKnobs& knobs, std::mt19937* rng) {
  KEEP_ASSIGN_OR_RETURN(RecomputePlan plan,
                        RecomputePlan::create(Method::kKeep, shape, layers, knobs));
  const int32_t memory_end = shape.segments.empty() ? 0 : shape.segments.back().end;
  std::uniform_real_distribution<float> p(0.0f, static_cast<float>(heads) / 8.0f);
  std::vector<float> pooled;
  std::vector<Check> checks;
  while (!plan.done()) {
    if (plan.check() != RecomputePlan::Check::kImportance) {
      KEEP_RETURN_IF_ERROR(plan.next());
      continue;
    }
    const std::vector<int32_t> rows = plan.rows();
    const std::vector<int32_t> columns = plan.segments_computed();
    pooled.resize(rows.size() * columns.size());
    for (float& v : pooled) v = p(*rng);
    Check c{plan.layer(), rows.size(), columns.size(), 0};
    // decide() makes these before it waits for the pooled columns: not timed, as there.
    const std::vector<int32_t> row_segment = plan.row_segments();
    std::vector<int32_t> query_rows;
    for (size_t r = 0; r < rows.size(); ++r) {
      if (rows[r] >= memory_end) query_rows.push_back(static_cast<int32_t>(r));
    }
    const auto t0 = Clock::now();
    ImportanceInput in{static_cast<int32_t>(shape.segments.size()),
                       heads,
                       pooled,
                       row_segment,
                       query_rows,
                       columns};
    KEEP_RETURN_IF_ERROR(plan.next(&in));
    c.us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    checks.push_back(c);
  }
  return checks;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int32_t> segment_counts = {10, 20, 40, 80};
  int32_t layers = 48, heads = 40, reps = 20;
  int64_t memory_tokens = 4096;
  double ratio = 0.15;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (i + 1 >= argc) return refuse(a + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    const bool count = *end == '\0' && n > 0 && n <= 100000;
    if (a == "--segments") {
      if (!bench::parse_list(v, &segment_counts)) return refuse("--segments: N[,N...] > 0");
    } else if (a == "--layers") {
      if (!count || n < 2) return refuse("--layers: L >= 2");
      layers = static_cast<int32_t>(n);
    } else if (a == "--heads") {
      if (!count) return refuse("--heads: H > 0");
      heads = static_cast<int32_t>(n);
    } else if (a == "--reps") {
      if (!count) return refuse("--reps: N > 0");
      reps = static_cast<int32_t>(n);
    } else if (a == "--memory-tokens") {
      if (!count) return refuse("--memory-tokens: M > 0");
      memory_tokens = n;
    } else if (a == "--ratio") {
      ratio = std::strtod(v.c_str(), &end);
      if (*end != '\0' || !(ratio > 0 && ratio <= 1)) return refuse("--ratio: R in (0, 1]");
    } else {
      return refuse("unknown argument '" + a + "'");
    }
  }

  const int32_t kinds[3] = {25, 15, 80};
  int64_t at40 = 0;
  for (int i = 0; i < 40; ++i) at40 += kinds[i % 3];
  const double scale = static_cast<double>(memory_tokens) / static_cast<double>(at40);
  std::printf("# keep's decision at its check layers (CPU), %d layers, %d heads, ratio ~%.2f\n",
              layers, heads, ratio);
  std::printf("%-8s %8s %6s %12s  %s\n", "segments", "mem_tok", "checks", "decision_us",
              "first checks [layer, rows, columns, us]");
  std::mt19937 rng(20261208);
  for (const int32_t n : segment_counts) {
    PromptShape shape;
    shape.cached_prefix = 32;
    int32_t slot = shape.cached_prefix;
    for (int32_t s = 0; s < n; ++s) {
      const int32_t len = std::max<int32_t>(1, static_cast<int32_t>(kinds[s % 3] * scale + 0.5));
      shape.segments.push_back({slot, slot + len, true});
      slot += len;
    }
    shape.total = slot + 128;
    MethodKnobs knobs;
    knobs.keep_decay = decay_for_average_ratio(layers, n, ratio);
    std::vector<double> totals;
    std::vector<std::vector<double>> per_check;
    std::vector<Check> last;
    for (int32_t r = 0; r < reps; ++r) {
      auto checks = run_request(shape, layers, heads, knobs, &rng);
      if (!checks.is_ok()) {
        std::fprintf(stderr, "bench_decision: %s\n", checks.status().to_string().c_str());
        return 1;
      }
      double total = 0;
      per_check.resize(std::max(per_check.size(), checks->size()));
      for (size_t k = 0; k < checks->size(); ++k) {
        total += (*checks)[k].us;
        per_check[k].push_back((*checks)[k].us);
      }
      totals.push_back(total);
      last = std::move(checks).value();
    }
    std::string first;
    for (size_t k = 0; k < std::min<size_t>(last.size(), 4); ++k) {
      char buf[80];
      std::snprintf(buf, sizeof buf, "%s[%d,%zu,%zu,%.0f]", k ? "," : "", last[k].layer,
                    last[k].rows, last[k].columns, bench::median(per_check[k]));
      first += buf;
    }
    std::printf("%-8d %8d %6zu %12.0f  %s\n", n, shape.memory_tokens(), last.size(),
                bench::median(totals), first.c_str());
  }
  return 0;
}
