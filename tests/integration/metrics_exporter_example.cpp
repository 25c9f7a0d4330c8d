// keep_test_metrics_exporter: a TEST PROGRAM (not a product) for the metrics library's integration
// tests. It registers metrics of every type with labels, with hostile label values and help text,
// serves them with MetricsHttpServer, and increments a counter on a timer.
//
//   keep_test_metrics_exporter --render
//       print the rendered registry once and exit (for `promtool check metrics`)
//   keep_test_metrics_exporter [--host 127.0.0.1] [--port 0] [--port-file PATH] [--tick-ms 100]
//                              [--max-seconds 300]
//       serve until SIGTERM/SIGINT (or max-seconds); the bound port is written to PATH once ready.
//
// The values are deterministic (see tests/integration/prometheus/example_scrape_test.sh, which
// checks them through a real Prometheus): requests_total{path="/a",code="200"} = 3; the
// request_duration histogram of path "/a" holds 4 x 0.0002 s and 6 x 0.002 s, so its median by
// histogram_quantile is 0.001 + (0.0025 - 0.001) * 1/6 = 0.00125.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "shared/metrics/http_server.h"
#include "shared/metrics/metrics.h"

namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

void register_example_metrics(keep::metrics::Registry& reg) {
  using keep::metrics::exponential_buckets;
  auto& requests = reg.counter("keep_example_requests_total", "Requests served, by path and code.",
                               {"path", "code"});
  requests.labels({"/a", "200"}).inc(3);
  requests.labels({"/b", "500"}).inc();

  auto& temp =
      reg.gauge("keep_example_temperature_celsius", "A gauge that can go negative.", {"room"});
  temp.labels({"lab"}).set(-3.5);
  temp.labels({"server_room"}).set(21.25);

  reg.gauge("keep_example_unbounded", "A gauge holding +Inf.")
      .get()
      .set(std::numeric_limits<double>::infinity());

  auto& esc = reg.gauge("keep_example_label_escaping",
                        "Help with a backslash \\ and a\nnewline, and UTF-8: \xC3\xA9.", {"value"});
  esc.labels({"a\"b\\c\nd"}).set(1);
  esc.labels({"caf\xC3\xA9"}).set(2);
  esc.labels({"bad\xFFutf8"}).set(3);

  auto& duration = reg.histogram("keep_example_request_duration_seconds",
                                 "Request latency, default latency buckets.", {"path"});
  auto& a = duration.labels({"/a"});
  for (int i = 0; i < 4; ++i) a.observe(0.0002);
  for (int i = 0; i < 6; ++i) a.observe(0.002);
  duration.labels({"/b"}).observe(3.0);

  auto& payload = reg.histogram("keep_example_payload_bytes", "Payload sizes, custom buckets.", {},
                                exponential_buckets(64, 4, 6));
  payload.get().observe(100);
  payload.get().observe(5000);
  payload.get().observe(1e9);
}

}  // namespace

int main(int argc, char** argv) {
  keep::metrics::MetricsHttpServerOptions opts;
  std::string port_file;
  bool render_only = false;
  int tick_ms = 100;
  int max_seconds = 300;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--render") {
      render_only = true;
    } else if (arg == "--host" && has_value) {
      opts.host = argv[++i];
    } else if (arg == "--port" && has_value) {
      opts.port = static_cast<uint16_t>(std::atoi(argv[++i]));
    } else if (arg == "--port-file" && has_value) {
      port_file = argv[++i];
    } else if (arg == "--tick-ms" && has_value) {
      tick_ms = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--max-seconds" && has_value) {
      max_seconds = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--render] [--host H] [--port P] [--port-file PATH] [--tick-ms N] "
                   "[--max-seconds N]\n",
                   argv[0]);
      return 2;
    }
  }

  keep::metrics::Registry reg;
  register_example_metrics(reg);
  auto& ticks = reg.counter("keep_example_ticks_total", "Timer ticks since start.").get();
  auto& hook_runs = reg.gauge("keep_example_collect_hook_runs",
                              "Times the collect hook ran (set at scrape time).")
                        .get();
  reg.add_collect_hook([&hook_runs] { hook_runs.inc(); });

  if (render_only) {
    std::fputs(reg.render().c_str(), stdout);
    return 0;
  }

  auto server = keep::metrics::MetricsHttpServer::start(reg, opts);
  if (!server.is_ok()) {
    std::fprintf(stderr, "%s\n", server.status().to_string().c_str());
    return 1;
  }
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  if (!port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr || std::fprintf(f, "%u\n", (*server)->port()) < 0 || std::fclose(f) != 0 ||
        std::rename(tmp.c_str(), port_file.c_str()) != 0) {
      std::fprintf(stderr, "cannot write %s: %s\n", port_file.c_str(), std::strerror(errno));
      return 1;
    }
  }
  std::printf("listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(max_seconds);
  while (g_stop == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(tick_ms));
    ticks.inc();
  }
  (*server)->stop();
  std::printf("stopped after %llu scrapes\n",
              static_cast<unsigned long long>((*server)->scrapes()));
  return 0;
}
