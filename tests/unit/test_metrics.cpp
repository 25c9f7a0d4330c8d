// Tests of shared/metrics: exact text format 0.0.4, escaping, ordering, registration rules,
// concurrency and collect hooks. The HTTP server: test_metrics_http.cpp.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shared/metrics/exposition.h"
#include "shared/metrics/metrics.h"

using namespace keep::metrics;

namespace {

// Runs fn in a forked child; true when the child aborted (a KEEP_CHECK failure).
template <typename Fn>
bool aborts(Fn fn) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::signal(SIGABRT, SIG_DFL);  // doctest's crash handler would report the expected abort
    std::freopen("/dev/null", "w", stderr);
    fn();
    std::_Exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

}  // namespace

TEST_CASE("metric and label names are validated") {
  CHECK(is_valid_metric_name("keep_manager_writes_total"));
  CHECK(is_valid_metric_name("a:b_c9"));
  CHECK(is_valid_metric_name("_x"));
  CHECK(is_valid_metric_name(":x"));
  CHECK_FALSE(is_valid_metric_name(""));
  CHECK_FALSE(is_valid_metric_name("9abc"));
  CHECK_FALSE(is_valid_metric_name("a-b"));
  CHECK_FALSE(is_valid_metric_name("a b"));
  CHECK_FALSE(is_valid_metric_name("caf\xC3\xA9"));
  CHECK(is_valid_label_name("code"));
  CHECK(is_valid_label_name("_x1"));
  CHECK_FALSE(is_valid_label_name("__name"));
  CHECK_FALSE(is_valid_label_name("a:b"));
  CHECK_FALSE(is_valid_label_name("1a"));
  CHECK_FALSE(is_valid_label_name(""));
}

TEST_CASE("values are formatted so they round-trip, with Prometheus's special spellings") {
  CHECK(format_value(0) == "0");
  CHECK(format_value(3) == "3");
  CHECK(format_value(-3.5) == "-3.5");
  CHECK(format_value(0.1) == "0.1");
  CHECK(format_value(0.00025) == "0.00025");
  CHECK(format_value(1e-7) == "1e-07");
  CHECK(format_value(0.0001) == "0.0001");
  CHECK(format_value(0.00001) == "1e-05");
  CHECK(format_value(100000) == "100000");
  CHECK(format_value(1e6) == "1e+06");
  CHECK(format_value(123456789.0) == "1.23456789e+08");
  CHECK(format_value(-0.0) == "-0");
  CHECK(format_value(std::numeric_limits<double>::infinity()) == "+Inf");
  CHECK(format_value(-std::numeric_limits<double>::infinity()) == "-Inf");
  CHECK(format_value(std::numeric_limits<double>::quiet_NaN()) == "NaN");
  CHECK(format_value(std::numeric_limits<double>::max()) == "1.7976931348623157e+308");
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> exp_dist(-300, 300);
  for (int i = 0; i < 10000; ++i) {
    const double v = std::pow(10.0, exp_dist(rng)) * ((rng() & 1) ? 1 : -1);
    const std::string s = format_value(v);
    CHECK(std::strtod(s.c_str(), nullptr) == v);
  }
}

TEST_CASE("label values and help are escaped; invalid UTF-8 is replaced") {
  std::string out;
  append_escaped_label_value(&out, "a\"b\\c\nd");
  CHECK(out == "a\\\"b\\\\c\\nd");
  out.clear();
  append_escaped_help(&out, "x\\y\nz\"");
  CHECK(out == "x\\\\y\\nz\"");  // a quote is not escaped in HELP
  out.clear();
  append_escaped_label_value(&out, "caf\xC3\xA9 \xF0\x9F\x98\x80");  // é and an emoji stay
  CHECK(out == "caf\xC3\xA9 \xF0\x9F\x98\x80");
  out.clear();
  append_escaped_label_value(&out,
                             "a\xFF"
                             "b\xC3");  // a stray byte and a truncated sequence
  CHECK(out ==
        "a\xEF\xBF\xBD"
        "b\xEF\xBF\xBD");
  out.clear();
  append_escaped_label_value(&out, "\xED\xA0\x80");  // a UTF-16 surrogate is not UTF-8
  CHECK(out == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  out.clear();
  append_escaped_label_value(&out, "\xC0\xAF");  // overlong '/'
  CHECK(out == "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST_CASE("counter family renders exactly") {
  Registry reg;
  auto& f = reg.counter("keep_test_requests_total", "Requests served.", {"path", "code"});
  f.labels({"/b", "500"}).inc(0.5);
  f.labels({"/a", "200"}).inc();
  f.labels({"/a", "200"}).inc(2);
  CHECK(f.labels({"/a", "200"}).value() == 3);
  CHECK(reg.render() ==
        "# HELP keep_test_requests_total Requests served.\n"
        "# TYPE keep_test_requests_total counter\n"
        "keep_test_requests_total{path=\"/a\",code=\"200\"} 3\n"
        "keep_test_requests_total{path=\"/b\",code=\"500\"} 0.5\n");
}

TEST_CASE("gauge family renders exactly, label-less families render 0 at once") {
  Registry reg;
  auto& g = reg.gauge("keep_test_memories", "Memories held.");
  CHECK(reg.render() ==
        "# HELP keep_test_memories Memories held.\n"
        "# TYPE keep_test_memories gauge\n"
        "keep_test_memories 0\n");
  g.get().set(10);
  g.get().inc(2.5);
  g.get().dec();
  g.get().dec(0.5);
  CHECK(g.get().value() == 11);
  g.get().set(-std::numeric_limits<double>::infinity());
  CHECK(reg.render() ==
        "# HELP keep_test_memories Memories held.\n"
        "# TYPE keep_test_memories gauge\n"
        "keep_test_memories -Inf\n");
}

TEST_CASE("histogram renders cumulative buckets with +Inf, _sum and _count") {
  Registry reg;
  auto& h = reg.histogram("keep_test_latency_seconds", "Latency.", {"op"}, {0.5, 1});
  auto& c = h.labels({"get"});
  c.observe(0.25);
  c.observe(0.5);  // on a bound: counts in le="0.5"
  c.observe(0.75);
  c.observe(8);
  c.observe(std::numeric_limits<double>::quiet_NaN());  // dropped
  CHECK(reg.render() ==
        "# HELP keep_test_latency_seconds Latency.\n"
        "# TYPE keep_test_latency_seconds histogram\n"
        "keep_test_latency_seconds_bucket{op=\"get\",le=\"0.5\"} 2\n"
        "keep_test_latency_seconds_bucket{op=\"get\",le=\"1\"} 3\n"
        "keep_test_latency_seconds_bucket{op=\"get\",le=\"+Inf\"} 4\n"
        "keep_test_latency_seconds_sum{op=\"get\"} 9.5\n"
        "keep_test_latency_seconds_count{op=\"get\"} 4\n");
}

TEST_CASE("histogram without labels, default and helper buckets") {
  CHECK(default_latency_buckets().front() == 0.0001);
  CHECK(default_latency_buckets().back() == 10);
  CHECK(exponential_buckets(1, 2, 4) == std::vector<double>{1, 2, 4, 8});
  CHECK(linear_buckets(0, 5, 3) == std::vector<double>{0, 5, 10});
  Registry reg;
  auto& h = reg.histogram("keep_test_d_seconds", "D.");
  h.get().observe(0.003);
  const std::string text = reg.render();
  CHECK(text.find("keep_test_d_seconds_bucket{le=\"0.0001\"} 0\n") != std::string::npos);
  CHECK(text.find("keep_test_d_seconds_bucket{le=\"0.0025\"} 0\n") != std::string::npos);
  CHECK(text.find("keep_test_d_seconds_bucket{le=\"0.005\"} 1\n") != std::string::npos);
  CHECK(text.find("keep_test_d_seconds_bucket{le=\"10\"} 1\n") != std::string::npos);
  CHECK(text.find("keep_test_d_seconds_bucket{le=\"+Inf\"} 1\n") != std::string::npos);
  CHECK(text.find("keep_test_d_seconds_sum 0.003\n") != std::string::npos);
  CHECK(text.find("keep_test_d_seconds_count 1\n") != std::string::npos);
  // A trailing +Inf bound is accepted and not doubled.
  auto& h2 = reg.histogram("keep_test_e", "E.", {}, {1, std::numeric_limits<double>::infinity()});
  CHECK(h2.bounds() == std::vector<double>{1});
}

TEST_CASE("escaping in rendered text; families sorted by name, children by label values") {
  Registry reg;
  reg.gauge("keep_z", "Z.").get().set(1);
  auto& g = reg.gauge("keep_a", "Help \\ with\nnewline.", {"v"});
  g.labels({"b"}).set(2);
  g.labels({"a\"q\\\n"}).set(1);
  reg.gauge("keep_m_empty", "No child yet: not rendered.", {"x"});
  CHECK(reg.render() ==
        "# HELP keep_a Help \\\\ with\\nnewline.\n"
        "# TYPE keep_a gauge\n"
        "keep_a{v=\"a\\\"q\\\\\\n\"} 1\n"
        "keep_a{v=\"b\"} 2\n"
        "# HELP keep_z Z.\n"
        "# TYPE keep_z gauge\n"
        "keep_z 1\n");
}

TEST_CASE("re-registration returns the same family; children references are stable") {
  Registry reg;
  auto& f1 = reg.counter("keep_x_total", "X.", {"k"});
  auto& f2 = reg.counter("keep_x_total", "X.", {"k"});
  CHECK(&f1 == &f2);
  Counter& first = f1.labels({"first"});
  for (int i = 0; i < 1000; ++i) f1.labels({std::to_string(i)}).inc();
  CHECK(&first == &f1.labels({"first"}));
  CHECK(&first == &f1.labels(std::vector<std::string>{"first"}));
  CHECK(f1.size() == 1001);
  auto& h1 = reg.histogram("keep_h", "H.", {}, {1, 2});
  CHECK(&h1 == &reg.histogram("keep_h", "H.", {}, {1, 2}));
}

TEST_CASE("programmer errors abort (KEEP_CHECK)") {
  CHECK(aborts([] { Registry().counter("keep-bad", "x"); }));
  CHECK(aborts([] { Registry().counter("keep_no_suffix", "x"); }));
  CHECK(aborts([] { Registry().gauge("keep_g", "x", {"__reserved"}); }));
  CHECK(aborts([] { Registry().gauge("keep_g", "x", {"a", "a"}); }));
  CHECK(aborts([] { Registry().histogram("keep_h", "x", {"le"}); }));
  CHECK(aborts([] { Registry().histogram("keep_h", "x", {}, {2, 1}); }));
  CHECK(aborts([] { Registry().histogram("keep_h", "x", {}, {1, 1}); }));
  CHECK(aborts([] { Registry().gauge("keep_g", "x", {"a"}).labels({"1", "2"}); }));
  CHECK(aborts([] { Registry().gauge("keep_g", "x", {"a"}).get(); }));
  CHECK(aborts([] { Registry().counter("keep_c_total", "x").get().inc(-1); }));
  CHECK(aborts([] {
    Registry reg;
    reg.gauge("keep_g", "x");
    reg.counter("keep_g_total", "x");  // fine: another name
    reg.counter("keep_g", "x");        // a gauge already has this name
  }));
  CHECK(aborts([] {
    Registry reg;
    reg.histogram("keep_h", "x");
    reg.gauge("keep_h_count", "x");  // collides with the histogram's _count series
  }));
  CHECK(aborts([] {
    Registry reg;
    reg.gauge("keep_g", "x", {"a"});
    reg.gauge("keep_g", "x", {"b"});
  }));
  CHECK_FALSE(aborts([] { Registry().counter("keep_ok_total", "x").get().inc(0); }));
}

TEST_CASE("collect hooks run at render time, before the families are rendered") {
  Registry reg;
  auto& g = reg.gauge("keep_arena_used_bytes", "Arena bytes in use.").get();
  int source = 0;
  reg.add_collect_hook([&] { g.set(source * 4096.0); });
  reg.add_collect_hook([] { throw std::runtime_error("a failing hook does not break render"); });
  source = 3;
  CHECK(reg.render().find("keep_arena_used_bytes 12288\n") != std::string::npos);
  source = 5;
  CHECK(reg.render().find("keep_arena_used_bytes 20480\n") != std::string::npos);
}

TEST_CASE("concurrent updates are exact") {
  Registry reg;
  auto& cf = reg.counter("keep_c_total", "C.", {"t"});
  Counter& shared = cf.labels({"shared"});
  Gauge& gauge = reg.gauge("keep_g", "G.").get();
  Histogram& hist = reg.histogram("keep_h_seconds", "H.", {}, {0.5, 1.5}).get();
  constexpr int kThreads = 8;
  constexpr int kIters = 100000;
  std::atomic<bool> go{false};
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      Counter& own = cf.labels({"t" + std::to_string(t)});
      for (int i = 0; i < kIters; ++i) {
        shared.inc();
        own.inc(0.5);
        gauge.inc(2);
        gauge.dec();
        hist.observe((i & 1) ? 1.0 : 0.25);
        if (i % 1000 == 0) cf.labels({"churn" + std::to_string(i % 7)}).inc();
      }
    });
  }
  std::thread renderer([&] {  // scrapes while the writers run
    while (!done.load()) {
      const std::string text = reg.render();
      CHECK(text.find("# TYPE keep_c_total counter") != std::string::npos);
    }
  });
  go.store(true);
  for (auto& th : threads) th.join();
  done.store(true);
  renderer.join();
  CHECK(shared.value() == double(kThreads) * kIters);
  for (int t = 0; t < kThreads; ++t)
    CHECK(cf.labels({"t" + std::to_string(t)}).value() == kIters / 2);
  CHECK(gauge.value() == double(kThreads) * kIters);
  const auto snap = hist.snapshot();
  CHECK(snap.count == uint64_t(kThreads) * kIters);
  CHECK(snap.cumulative[0] == uint64_t(kThreads) * kIters / 2);
  CHECK(snap.cumulative[1] == uint64_t(kThreads) * kIters);
  CHECK(snap.sum == double(kThreads) * kIters / 2 * 1.25);
}
