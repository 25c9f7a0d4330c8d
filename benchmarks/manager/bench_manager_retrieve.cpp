// bench_manager_retrieve: retrieve latency (k = 8) of a real keep-manager holding M memories of
// one agent, with (a) a repeated query (its embedding is cached: the planner's instruction repeats
// every step) and (b) fresh queries (the encoder is in the path); and (c) what another client sees
// meanwhile: the latency of its pings while (b) runs, against its pings on an idle server (a
// retrieve that embeds runs on keep-manager's retrieve threads, so it should not hold them).
//
// Loading: the M memories are written with pipelined writes (window 256), then the benchmark
// waits until the background embedder drained (stats pending_embeddings == 0) and reports how long
// both took. retrieve embeds an agent's pending segments synchronously first, so measuring before
// the drain would time the encoder, not retrieval.
//
// --load snapshot is the fast path for large M: the agent's state (real token counts, hashed
// bag-of-words vectors instead of BERT ones; see preload_snapshot.h) is built in-process and
// written as a snapshot the manager recovers from at start-up. Fresh queries still go through the
// real encoder.
//
//   build/bin/bench_manager_retrieve [--memories 1000,10000] [--load writes|snapshot]
//       [--repeated 2000] [--fresh 200] [--k 8] [--fsync true] [--manager-bin PATH]
//       [--drain-timeout 600]
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "benchmarks/manager/bench_support.h"
#include "benchmarks/manager/preload_snapshot.h"
#include "shared/common/log.h"
#include "shared/common/options.h"

namespace {

using keep::Code;
using keep::Status;
using keep::bench::Clock;

constexpr const char* kAgent = "bench-retrieve";
constexpr const char* kRepeatedQuery =
    "Put the dirty coffee mug from the kitchen counter into the dishwasher.";

uint64_t counter(const keep::client::Stats& s, const std::string& name) {
  for (const auto& [n, v] : s.counters) {
    if (n == name) return v;
  }
  return 0;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Writes `m` memories to kAgent with a window of outstanding writes.
Status load(const std::string& endpoint, uint64_t m) {
  auto ctx = keep::bench::make_zmq_context(1);
  KEEP_ASSIGN_OR_RETURN(auto pw, keep::bench::PipelinedWriter::connect(ctx.get(), endpoint));
  keep::bench::TextGenerator gen(12345);
  constexpr uint64_t kWindow = 256;
  uint64_t sent = 0, acked = 0, outstanding = 0;
  while (acked < m) {
    while (sent < m && outstanding < kWindow) {
      keep::client::SegmentKind kind;
      std::string text = gen.next(&kind);
      KEEP_RETURN_IF_ERROR(pw->send_write(kAgent, text, kind).status());
      ++sent;
      ++outstanding;
    }
    uint64_t rid = 0;
    Status call;
    Status st = pw->receive(std::chrono::seconds(30), &rid, &call);
    if (!st.is_ok()) return st.with_context("loading memories");
    if (!call.is_ok()) return call.with_context("write " + std::to_string(rid));
    ++acked;
    --outstanding;
  }
  return Status::ok();
}

struct Measured {
  keep::bench::LatencySummary lat;
  size_t segments = 0;  // returned by the last call
};

// A second client's pings, back to back, until `done` (or `count` of them when count > 0).
keep::Result<keep::bench::LatencySummary> pings(const std::string& endpoint,
                                                const std::atomic<bool>& done, uint64_t count) {
  keep::client::ClientOptions co;
  co.endpoint = endpoint;
  co.timeout = std::chrono::seconds(60);
  KEEP_ASSIGN_OR_RETURN(auto c, keep::client::ManagerClient::connect(co));
  std::vector<double> us;
  while (count > 0 ? us.size() < count : !done.load()) {
    auto t0 = Clock::now();
    auto r = c->ping();
    if (!r.is_ok()) return r.status().with_context("ping");
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  if (us.empty()) return Status(Code::kInternal, "no ping finished");
  return keep::bench::summarize(std::move(us));
}

keep::Result<Measured> measure(keep::client::ManagerClient& c, uint64_t iterations, uint32_t k,
                               bool fresh, keep::bench::TextGenerator* gen) {
  std::vector<double> us;
  us.reserve(iterations);
  Measured m;
  for (uint64_t i = 0; i < iterations; ++i) {
    const std::string q = fresh ? gen->query() : std::string(kRepeatedQuery);
    auto t0 = Clock::now();
    auto r = c.retrieve(kAgent, q, k);
    auto t1 = Clock::now();
    if (!r.is_ok()) return r.status().with_context("retrieve");
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    m.segments = r->size();
  }
  m.lat = keep::bench::summarize(std::move(us));
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  keep::Options o("bench_manager_retrieve",
                  "retrieve latency (k = 8) of a real keep-manager holding M memories");
  o.add("memories", "1000,10000", "comma-separated memory counts (a fresh manager each)");
  o.add("repeated", "2000", "retrieves with the repeated (cached) query");
  o.add("fresh", "200", "retrieves with fresh queries (encoder in the path)");
  o.add("k", "8", "top-k");
  o.add("load", "writes",
        "writes: real writes + wait for the background embedder; snapshot: preload a snapshot");
  o.add("drain-timeout", "600", "seconds to wait for the background embedder to drain");
  keep::bench::add_manager_options(&o);
  o.add("smoke", "false", "100 memories, a few retrieves; exit 1 unless retrieve returned k");
  o.add("burst-retrieve", "false",
        "--load writes: one retrieve (fresh query) right after the writes, before the background "
        "embedder drained: it embeds the agent's backlog first");
  Status st = o.parse(argc, argv);
  if (!st.is_ok()) {
    std::fprintf(stderr, "bench_manager_retrieve: %s\n", st.message().c_str());
    return 2;
  }
  if (o.help_requested()) {
    std::fputs(o.help_text().c_str(), stdout);
    return 0;
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "bench_manager_retrieve: %s\n", s.to_string().c_str());
    return 2;
  };
  auto sizes = keep::bench::parse_list(o.str("memories"), "memories");
  auto repeated = o.uint64("repeated");
  auto fresh = o.uint64("fresh");
  auto k = o.uint64("k");
  auto drain_timeout = o.number("drain-timeout");
  auto mo_or = keep::bench::manager_options_from(o);
  auto smoke = o.boolean("smoke");
  auto burst = o.boolean("burst-retrieve");
  for (const Status& s : {sizes.status(), repeated.status(), fresh.status(), k.status(),
                          mo_or.status(), drain_timeout.status(), smoke.status(), burst.status()}) {
    if (!s.is_ok()) return fail(s);
  }
  const std::string load_mode = o.str("load");
  if (load_mode != "writes" && load_mode != "snapshot") {
    return fail(Status(Code::kInvalidArgument, "--load: expected writes or snapshot"));
  }
  if (*k == 0 || *k > 1024) return fail(Status(Code::kInvalidArgument, "--k: must be 1..1024"));
  std::vector<uint64_t> memories = *sizes;
  uint64_t n_repeated = *repeated, n_fresh = *fresh;
  if (*smoke) {
    memories = {100};
    n_repeated = 20;
    n_fresh = 5;
  }
  keep::log::set_level(keep::log::Level::kWarn);
  keep::bench::ManagerProcessOptions mo = std::move(mo_or).value();

  std::printf(
      "# bench_manager_retrieve: manager %s, fsync %s, load %s, k %llu, %llu repeated + "
      "%llu fresh queries per size\n",
      mo.binary.c_str(), mo.fsync ? "on" : "off", load_mode.c_str(),
      static_cast<unsigned long long>(*k), static_cast<unsigned long long>(n_repeated),
      static_cast<unsigned long long>(n_fresh));
  std::printf("%-9s %7s %8s %9s | %-8s %8s %8s %8s %8s %8s | %5s\n", "memories", "load_s",
              "embed_s", "embed/s", "query", "p50_us", "p90_us", "p99_us", "max_us", "mean_us",
              "segs");
  int rc = 0;
  for (uint64_t m : memories) {
    keep::bench::PreloadInfo pre;
    if (load_mode == "snapshot") {
      mo.prepare = [&](const std::string& dir) -> Status {
        keep::bench::PreloadOptions po;
        po.agent = kAgent;
        po.memories = m;
        po.tokenizer_path = o.str("models-dir") + "/qwen2.5-tokenizer/tokenizer.json";
        KEEP_ASSIGN_OR_RETURN(pre, keep::bench::preload_snapshot(dir, po));
        return Status::ok();
      };
    }
    auto t_start = Clock::now();
    auto mgr = keep::bench::ManagerProcess::start(mo);
    if (!mgr.is_ok()) return fail(mgr.status());
    keep::client::ClientOptions co;
    co.endpoint = (*mgr)->endpoint();
    co.timeout = std::chrono::seconds(60);
    auto c = keep::client::ManagerClient::connect(co);
    if (!c.is_ok()) return fail(c.status());

    std::printf("# keep-manager pid %d\n", static_cast<int>((*mgr)->pid()));
    std::fflush(stdout);
    if (load_mode == "snapshot") {
      std::printf(
          "# %llu memories preloaded: store build %.1f s, snapshot %.1f MB in %.1f s, %llu "
          "groups; manager start-up (recovery) %.1f s\n",
          static_cast<unsigned long long>(m), pre.build_s, 1e-6 * static_cast<double>(pre.bytes),
          pre.snapshot_s, static_cast<unsigned long long>(pre.groups),
          seconds_since(t_start) - pre.build_s - pre.snapshot_s);
      std::fflush(stdout);
    }
    auto t0 = Clock::now();
    if (load_mode == "writes") {
      Status ls = load((*mgr)->endpoint(), m);
      if (!ls.is_ok()) return fail(ls);
    }
    const double load_s = seconds_since(t0);
    if (*burst && load_mode == "writes") {
      auto s0 = (*c)->stats();
      if (!s0.is_ok()) return fail(s0.status());
      auto tb = Clock::now();
      auto r = (*c)->retrieve(kAgent, "Where did I leave the red umbrella after the walk?",
                              static_cast<uint32_t>(*k));
      if (!r.is_ok()) return fail(r.status().with_context("burst retrieve"));
      std::printf(
          "# retrieve right after the writes: %.1f ms (%llu embeddings pending just "
          "before it), %zu segments\n",
          1e3 * seconds_since(tb),
          static_cast<unsigned long long>(counter(*s0, "pending_embeddings")), r->size());
      std::fflush(stdout);
    }

    // Wait for the background embedder.
    auto t1 = Clock::now();
    auto last_print = t1;
    bool drained = false;
    for (;;) {
      auto s = (*c)->stats();
      if (!s.is_ok()) return fail(s.status());
      uint64_t pending = counter(*s, "pending_embeddings");
      if (pending == 0 && s->memories >= m) {
        drained = true;
        break;
      }
      if (seconds_since(t1) > *drain_timeout) break;
      if (seconds_since(last_print) > 10) {
        std::fprintf(stderr, "  ... %llu memories, %llu embeddings pending after %.0f s\n",
                     static_cast<unsigned long long>(s->memories),
                     static_cast<unsigned long long>(pending), seconds_since(t1));
        last_print = Clock::now();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const double embed_s = seconds_since(t0);  // from the first write to the last embedding
    if (!drained) {
      std::printf("%-9llu %7.2f %8s (embedder did not drain within %.0f s: skipped)\n",
                  static_cast<unsigned long long>(m), load_s, "-", *drain_timeout);
      rc = 1;
      continue;
    }
    // Warm-up (fills the query cache, pages in the matrix).
    keep::bench::TextGenerator gen(777);
    auto warm = measure(**c, 20, static_cast<uint32_t>(*k), false, &gen);
    if (!warm.is_ok()) return fail(warm.status());
    auto a = measure(**c, n_repeated, static_cast<uint32_t>(*k), false, &gen);
    if (!a.is_ok()) return fail(a.status());
    const std::atomic<bool> never{false};
    auto idle = pings((*mgr)->endpoint(), never, 200);
    if (!idle.is_ok()) return fail(idle.status());
    std::atomic<bool> fresh_done{false};
    keep::Result<keep::bench::LatencySummary> during = Status(Code::kInternal, "not run");
    std::thread bystander([&] { during = pings((*mgr)->endpoint(), fresh_done, 0); });
    auto b = measure(**c, n_fresh, static_cast<uint32_t>(*k), true, &gen);
    fresh_done = true;
    bystander.join();
    if (!b.is_ok()) return fail(b.status());
    if (!during.is_ok()) return fail(during.status());
    auto stats = (*c)->stats();
    const double rate = static_cast<double>(m) / embed_s;
    for (int row = 0; row < 2; ++row) {
      const Measured& r = row == 0 ? *a : *b;
      if (row == 0) {
        if (load_mode == "writes") {
          std::printf("%-9llu %7.2f %8.1f %9.0f | ", static_cast<unsigned long long>(m), load_s,
                      embed_s, rate);
        } else {
          std::printf("%-9llu %7s %8s %9s | ", static_cast<unsigned long long>(m), "snap", "-",
                      "-");
        }
      } else {
        std::printf("%-9s %7s %8s %9s | ", "", "", "", "");
      }
      std::printf("%-8s %8.0f %8.0f %8.0f %8.0f %8.0f | %5zu\n", row == 0 ? "repeated" : "fresh",
                  r.lat.p50_us, r.lat.p90_us, r.lat.p99_us, r.lat.max_us, r.lat.mean_us,
                  r.segments);
    }
    for (int row = 0; row < 2; ++row) {
      const keep::bench::LatencySummary& l = row == 0 ? *idle : *during;
      std::printf("%-9s %7s %8s %9s | %-8s %8.0f %8.0f %8.0f %8.0f %8.0f | %5zu pings\n", "", "",
                  "", "", row == 0 ? "ping" : "ping+", l.p50_us, l.p90_us, l.p99_us, l.max_us,
                  l.mean_us, l.n);
    }
    if (stats.is_ok()) {
      std::printf(
          "          server: query_cache_hits %llu, misses %llu, groups static %llu "
          "dynamic %llu\n",
          static_cast<unsigned long long>(counter(*stats, "query_cache_hits")),
          static_cast<unsigned long long>(counter(*stats, "query_cache_misses")),
          static_cast<unsigned long long>(stats->groups_static),
          static_cast<unsigned long long>(stats->groups_dynamic));
    }
    std::fflush(stdout);
    if (*smoke && (a->segments != std::min<uint64_t>(*k, m) || b->segments == 0)) rc = 1;
  }
  return rc;
}
