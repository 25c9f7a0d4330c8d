// bench_manager_writes: acknowledged writes per second and write latency of a real keep-manager
// process, for N concurrent agents (one thread, one agent namespace and one ZeroMQ connection
// each), writing varied household memories. A write is acknowledged after the WAL fdatasync of
// its batch (group commit; --fsync true by default).
//
// Modes:
//   blocking   one request at a time per agent through keep::client::ManagerClient (the honest
//              baseline: what an agent using the C++ client gets);
//   pipelined  each agent keeps up to --window writes outstanding on its own DEALER socket,
//              answers matched by requestId (latency = send -> its acknowledgement).
//
//   build/bin/bench_manager_writes [--agents 1,4,16,64] [--modes blocking,pipelined]
//       [--window 16] [--seconds 5] [--warmup 1] [--fsync true] [--manager-bin PATH]
//
// Each (mode, N) runs against a fresh keep-manager with an empty data dir under --data-parent.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "benchmarks/manager/bench_support.h"
#include "shared/common/options.h"

namespace {

using keep::Code;
using keep::Status;
using keep::bench::Clock;

struct Config {
  std::vector<uint64_t> agents;
  std::vector<std::string> modes;
  uint64_t window = 16;
  double seconds = 5;
  double warmup = 1;
  uint64_t count = 0;  // per agent; 0 = run for --seconds
  keep::bench::ManagerProcessOptions manager;
  std::string perf_dir;
  bool smoke = false;
};

struct AgentResult {
  std::vector<double> latencies_us;  // acknowledged inside the measurement window
  uint64_t acked_in_window = 0;
  uint64_t acked_total = 0;
  uint64_t errors = 0;
  std::string first_error;
};

struct RunResult {
  std::string mode;
  uint64_t agents = 0;
  double window_s = 0;
  double writes_per_s = 0;
  keep::bench::LatencySummary lat;
  uint64_t errors = 0;
  std::string first_error;
  double server_cpu = 0;  // cores used by keep-manager in the window
  double client_cpu = 0;  // cores used by this process in the window
  double mean_batch = 0;
  double fsyncs_per_s = 0;
  double mean_fsync_us = 0;
  std::vector<keep::bench::ThreadCpu> threads;  // manager threads' CPU seconds in the window
};

// The measurement window: [start + warmup, end). Agents stop at `stop`.
struct Window {
  Clock::time_point begin;
  Clock::time_point end;
};

void record(AgentResult* r, Clock::time_point sent, Clock::time_point acked, const Window& w) {
  ++r->acked_total;
  if (acked >= w.begin && acked < w.end) {
    ++r->acked_in_window;
    r->latencies_us.push_back(std::chrono::duration<double, std::micro>(acked - sent).count());
  }
}

void note_error(AgentResult* r, const Status& st) {
  if (r->errors++ == 0) r->first_error = st.to_string();
}

void run_blocking_agent(const std::string& endpoint, uint64_t index, const Config& cfg,
                        const Window& w, std::atomic<bool>* stop, AgentResult* out) {
  keep::client::ClientOptions co;
  co.endpoint = endpoint;
  co.timeout = std::chrono::seconds(30);
  auto c = keep::client::ManagerClient::connect(co);
  if (!c.is_ok()) {
    note_error(out, c.status());
    return;
  }
  keep::bench::TextGenerator gen(index + 1);
  keep::client::WriteArgs args;
  args.agent = "bench-agent-" + std::to_string(index);
  for (uint64_t i = 0; !stop->load(std::memory_order_relaxed); ++i) {
    if (cfg.count > 0 && i >= cfg.count) break;
    args.text = gen.next(&args.kind);
    auto t0 = Clock::now();
    auto r = (*c)->write(args);
    auto t1 = Clock::now();
    if (!r.is_ok()) {
      note_error(out, r.status());
      continue;
    }
    record(out, t0, t1, w);
  }
}

void run_pipelined_agent(void* ctx, const std::string& endpoint, uint64_t index, const Config& cfg,
                         const Window& w, std::atomic<bool>* stop, AgentResult* out) {
  auto pw = keep::bench::PipelinedWriter::connect(ctx, endpoint);
  if (!pw.is_ok()) {
    note_error(out, pw.status());
    return;
  }
  keep::bench::TextGenerator gen(index + 1);
  const std::string agent = "bench-agent-" + std::to_string(index);
  std::unordered_map<uint64_t, Clock::time_point> outstanding;
  uint64_t sent = 0;
  auto drain_deadline = Clock::time_point::max();
  for (;;) {
    const bool stopping =
        stop->load(std::memory_order_relaxed) || (cfg.count > 0 && sent >= cfg.count);
    if (stopping) {
      if (outstanding.empty()) break;
      if (drain_deadline == Clock::time_point::max()) {
        drain_deadline = Clock::now() + std::chrono::seconds(30);
      } else if (Clock::now() > drain_deadline) {
        note_error(out, Status(Code::kTimeout, std::to_string(outstanding.size()) +
                                                   " writes unanswered after 30 s"));
        break;
      }
    }
    while (!stopping && outstanding.size() < cfg.window) {
      keep::client::SegmentKind kind;
      std::string text = gen.next(&kind);
      auto t0 = Clock::now();
      auto id = (*pw)->send_write(agent, text, kind);
      if (!id.is_ok()) {
        note_error(out, id.status());
        return;
      }
      outstanding.emplace(*id, t0);
      ++sent;
    }
    // Take every answer that is ready (at least one, or time out).
    uint64_t rid = 0;
    Status call;
    Status st = (*pw)->receive(std::chrono::milliseconds(100), &rid, &call);
    while (st.is_ok()) {
      auto t1 = Clock::now();
      auto it = outstanding.find(rid);
      if (it != outstanding.end()) {
        if (call.is_ok()) {
          record(out, it->second, t1, w);
        } else {
          note_error(out, call);
        }
        outstanding.erase(it);
      }
      st = (*pw)->receive(std::chrono::milliseconds(0), &rid, &call);
    }
    if (st.code() != Code::kTimeout) note_error(out, st);
  }
}

keep::Result<RunResult> run_one(const Config& cfg, const std::string& mode, uint64_t agents) {
  KEEP_ASSIGN_OR_RETURN(auto mgr, keep::bench::ManagerProcess::start(cfg.manager));
  std::shared_ptr<void> ctx = keep::bench::make_zmq_context(1);
  std::vector<AgentResult> results(agents);
  std::atomic<bool> stop{false};
  Window w;
  const auto start = Clock::now() + std::chrono::milliseconds(200);  // threads set up first
  w.begin = start +
            std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.warmup));
  w.end = cfg.count > 0 ? Clock::time_point::max()
                        : w.begin + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(cfg.seconds));
  std::vector<std::thread> threads;
  threads.reserve(agents);
  for (uint64_t i = 0; i < agents; ++i) {
    threads.emplace_back([&, i] {
      std::this_thread::sleep_until(start);
      if (mode == "blocking") {
        run_blocking_agent(mgr->endpoint(), i, cfg, w, &stop, &results[i]);
      } else {
        run_pipelined_agent(ctx.get(), mgr->endpoint(), i, cfg, w, &stop, &results[i]);
      }
    });
  }

  std::this_thread::sleep_until(w.begin);
  auto scrape0 = mgr->scrape_metrics();
  const double srv0 = mgr->cpu_seconds(), cli0 = keep::bench::self_cpu_seconds();
  const auto thr0 = mgr->thread_cpu();
  const auto t_begin = Clock::now();
  pid_t perf_pid = -1;
  if (!cfg.perf_dir.empty() && cfg.count == 0) {
    std::string out = cfg.perf_dir + "/perf-" + mode + "-" + std::to_string(agents) + ".data";
    std::string pid = std::to_string(mgr->pid());
    std::string secs = std::to_string(static_cast<int>(cfg.seconds));
    perf_pid = ::fork();
    if (perf_pid == 0) {
      ::execlp("perf", "perf", "record", "-q", "-F", "499", "-g", "-p", pid.c_str(), "-o",
               out.c_str(), "--", "sleep", secs.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  double window_s = 0;
  RunResult rr;
  if (cfg.count == 0) {
    std::this_thread::sleep_until(w.end);
    const double srv1 = mgr->cpu_seconds(), cli1 = keep::bench::self_cpu_seconds();
    const auto thr1 = mgr->thread_cpu();
    auto scrape1 = mgr->scrape_metrics();
    window_s = std::chrono::duration<double>(Clock::now() - t_begin).count();
    stop.store(true);
    for (auto& t : threads) t.join();
    rr.server_cpu = (srv1 - srv0) / window_s;
    rr.client_cpu = (cli1 - cli0) / window_s;
    for (const auto& t1 : thr1) {
      for (const auto& t0 : thr0) {
        if (t0.tid == t1.tid) {
          rr.threads.push_back(
              {t1.tid, t1.name, t1.seconds - t0.seconds, t1.wait_seconds - t0.wait_seconds});
        }
      }
    }
    if (scrape0.is_ok() && scrape1.is_ok()) {
      const std::string &a = *scrape0, &b = *scrape1;
      double batches = keep::bench::metric_sum(b, "keep_manager_batch_size_count") -
                       keep::bench::metric_sum(a, "keep_manager_batch_size_count");
      double reqs = keep::bench::metric_sum(b, "keep_manager_batch_size_sum") -
                    keep::bench::metric_sum(a, "keep_manager_batch_size_sum");
      double fs = keep::bench::metric_sum(b, "keep_manager_wal_fsync_seconds_count") -
                  keep::bench::metric_sum(a, "keep_manager_wal_fsync_seconds_count");
      double fs_sum = keep::bench::metric_sum(b, "keep_manager_wal_fsync_seconds_sum") -
                      keep::bench::metric_sum(a, "keep_manager_wal_fsync_seconds_sum");
      rr.mean_batch = batches > 0 ? reqs / batches : 0;
      rr.fsyncs_per_s = fs / window_s;
      rr.mean_fsync_us = fs > 0 ? 1e6 * fs_sum / fs : 0;
    }
  } else {
    for (auto& t : threads) t.join();
    window_s = std::chrono::duration<double>(Clock::now() - t_begin).count();
  }
  if (perf_pid > 0) {
    int ws = 0;
    ::waitpid(perf_pid, &ws, 0);
  }

  rr.mode = mode;
  rr.agents = agents;
  rr.window_s = window_s;
  std::vector<double> all;
  uint64_t acked = 0;
  for (auto& r : results) {
    acked += r.acked_in_window;
    all.insert(all.end(), r.latencies_us.begin(), r.latencies_us.end());
    rr.errors += r.errors;
    if (rr.first_error.empty()) rr.first_error = r.first_error;
  }
  rr.writes_per_s = static_cast<double>(acked) / window_s;
  rr.lat = keep::bench::summarize(std::move(all));
  return rr;
}

void print_header() {
  std::printf("%-10s %6s %6s %11s %9s %9s %9s %9s %7s %8s %8s %9s %9s %6s\n", "mode", "agents",
              "window", "writes/s", "p50_us", "p90_us", "p99_us", "max_us", "batch", "fsync/s",
              "fsync_us", "srv_cores", "cli_cores", "errors");
}

void print_row(const RunResult& r, uint64_t window) {
  std::string w = r.mode == "blocking" ? "1" : std::to_string(window);
  std::printf(
      "%-10s %6llu %6s %11.0f %9.0f %9.0f %9.0f %9.0f %7.1f %8.0f %8.0f %9.2f %9.2f %6llu\n",
      r.mode.c_str(), static_cast<unsigned long long>(r.agents), w.c_str(), r.writes_per_s,
      r.lat.p50_us, r.lat.p90_us, r.lat.p99_us, r.lat.max_us, r.mean_batch, r.fsyncs_per_s,
      r.mean_fsync_us, r.server_cpu, r.client_cpu, static_cast<unsigned long long>(r.errors));
  if (!r.first_error.empty()) std::printf("    first error: %s\n", r.first_error.c_str());
  if (!r.threads.empty()) {
    std::printf("    manager threads in the window (name/tid: CPU s, run-queue wait s):");
    for (const auto& t : r.threads) {
      if (t.seconds >= 0.01) {
        std::printf(" %s/%d: %.2f, %.2f;", t.name.c_str(), t.tid, t.seconds, t.wait_seconds);
      }
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  keep::Options o("bench_manager_writes",
                  "acknowledged writes/s and latency of a real keep-manager, N concurrent agents");
  o.add("agents", "1,4,16,64", "comma-separated agent counts (one thread + connection each)");
  o.add("modes", "blocking,pipelined", "blocking (ManagerClient) and/or pipelined (DEALER window)");
  o.add("window", "16", "pipelined mode: outstanding writes per agent");
  o.add("seconds", "5", "measurement window per run");
  o.add("warmup", "1", "seconds before the window (not measured)");
  o.add("count", "0", "writes per agent instead of a timed window (0: timed)");
  keep::bench::add_manager_options(&o);
  o.add("perf-dir", "", "if set: `perf record -g` the manager during each window into this dir");
  o.add("smoke", "false", "1 agent per mode, 1 s; exit 1 unless writes were acknowledged");
  Status st = o.parse(argc, argv);
  if (!st.is_ok()) {
    std::fprintf(stderr, "bench_manager_writes: %s\n", st.message().c_str());
    return 2;
  }
  if (o.help_requested()) {
    std::fputs(o.help_text().c_str(), stdout);
    return 0;
  }
  Config cfg;
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "bench_manager_writes: %s\n", s.to_string().c_str());
    return 2;
  };
  auto agents = keep::bench::parse_list(o.str("agents"), "agents");
  if (!agents.is_ok()) return fail(agents.status());
  cfg.agents = *agents;
  {
    std::stringstream ss(o.str("modes"));
    for (std::string m; std::getline(ss, m, ',');) {
      if (m != "blocking" && m != "pipelined") {
        return fail(Status(Code::kInvalidArgument, "--modes: unknown mode '" + m + "'"));
      }
      cfg.modes.push_back(m);
    }
  }
  auto window = o.uint64("window");
  auto seconds = o.number("seconds");
  auto warmup = o.number("warmup");
  auto count = o.uint64("count");
  auto manager = keep::bench::manager_options_from(o);
  auto smoke = o.boolean("smoke");
  for (const Status& s : {window.status(), seconds.status(), warmup.status(), count.status(),
                          manager.status(), smoke.status()}) {
    if (!s.is_ok()) return fail(s);
  }
  cfg.window = std::max<uint64_t>(1, *window);
  cfg.seconds = *seconds;
  cfg.warmup = *warmup;
  cfg.count = *count;
  cfg.smoke = *smoke;
  if (cfg.smoke) {
    cfg.agents = {1};
    cfg.seconds = 1;
    cfg.warmup = 0.2;
    cfg.count = 0;
  }
  cfg.manager = std::move(manager).value();
  cfg.perf_dir = o.str("perf-dir");

  std::printf(
      "# bench_manager_writes: manager %s, fsync %s, %s per run (warm-up %.1f s), "
      "pipelined window %llu\n",
      cfg.manager.binary.c_str(), cfg.manager.fsync ? "on" : "off",
      cfg.count > 0 ? (std::to_string(cfg.count) + " writes/agent").c_str()
                    : (std::to_string(cfg.seconds) + " s").c_str(),
      cfg.warmup, static_cast<unsigned long long>(cfg.window));
  print_header();
  int rc = 0;
  for (const auto& mode : cfg.modes) {
    for (uint64_t n : cfg.agents) {
      auto r = run_one(cfg, mode, n);
      if (!r.is_ok()) {
        std::fprintf(stderr, "bench_manager_writes: %s x%llu: %s\n", mode.c_str(),
                     static_cast<unsigned long long>(n), r.status().to_string().c_str());
        return 1;
      }
      print_row(*r, cfg.window);
      if (cfg.smoke && (r->lat.n == 0 || r->errors > 0)) rc = 1;
    }
  }
  return rc;
}
