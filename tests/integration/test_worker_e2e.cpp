// KEEP end to end with real processes (issue 28, point 6): keep-manager and keep-worker (CPU,
// SmolLM2 GGUF) talking over ZeroMQ, the KV in the manager's shared region, a planner asking the
// worker over its protocol. Also: bad requests, /metrics, a worker killed -9 in the middle of a
// KV job, a manager restarted under a live worker, SIGTERM.
#include <doctest/doctest.h>

#include <capnp/message.h>

#include <fstream>
#include <set>

#include "shared/client/manager_client.h"
#include "shared/client/protocols.h"
#include "shared/client/worker_client.h"
#include "shared/rpc/wire_codec.h"
#include "tests/integration/worker_process.h"

using namespace std::chrono_literals;
namespace kc = keep::client;
namespace it = keep::itest;
namespace wire = keep::wire;
using keep::Code;

namespace {

const char* const kMemories[] = {
    "The milk is in the fridge.",
    "The fridge is in the kitchen, next to the sink.",
    "The red mug is on the kitchen counter.",
    "Task done: put the apple in the fruit bowl.",
    "The towel hangs in the bathroom.",
    "The laptop is on the desk in the study.",
};

std::unique_ptr<kc::ManagerClient> manager_client(const std::string& endpoint) {
  kc::ClientOptions o;
  o.endpoint = endpoint;
  o.timeout = 20s;
  auto c = kc::ManagerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

std::unique_ptr<kc::WorkerClient> worker_client(const std::string& endpoint,
                                                std::chrono::milliseconds timeout = 120s) {
  kc::WorkerClientOptions o;
  o.endpoint = endpoint;
  o.timeout = timeout;
  auto c = kc::WorkerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

uint64_t counter(const kc::Stats& s, const std::string& name) {
  for (const auto& [n, v] : s.counters) {
    if (n == name) return v;
  }
  FAIL("no counter " << name);
  return 0;
}

// Memories of `agent` that have KV in the region now.
size_t with_kv(kc::ManagerClient& m, const std::string& agent) {
  auto page = m.list_memories(agent, 0, 1000);
  REQUIRE(page.is_ok());
  size_t n = 0;
  for (const auto& mem : page->memories) n += mem.has_kv ? 1 : 0;
  return n;
}

// Writes the memories, groups them and lets `steps` steps pass.
void remember(kc::ManagerClient& m, const std::string& agent, uint64_t steps) {
  for (const char* text : kMemories) {
    kc::WriteArgs a;
    a.agent = agent;
    a.text = text;
    REQUIRE(m.write(a).is_ok());
  }
  REQUIRE(m.retrieve(agent, "milk", 1).is_ok());  // embeds and groups them all
  REQUIRE(m.advance_step(agent, steps).is_ok());
}

// Waits until every memory of `agent` has KV (the worker did every job).
void wait_all_kv(kc::ManagerClient& m, const std::string& agent, size_t n,
                 std::chrono::seconds timeout = 90s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (with_kv(m, agent) < n) {
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < deadline,
                    "the worker did not produce every memory's KV in time");
    std::this_thread::sleep_for(100ms);
  }
}

kc::CompleteArgs ask(kc::PlanMethod method, std::optional<double> decay = std::nullopt) {
  kc::CompleteArgs a;
  a.agent = "robot";
  a.instruction = "Bring me a glass of milk.";
  a.history = {"walk to the kitchen"};
  a.k = 8;
  a.method = method;
  a.knobs.decay = decay;
  a.max_tokens = 8;
  return a;
}

std::string metrics_text(const std::string& address) {
  auto body = it::http_get(address, "/metrics");
  REQUIRE_MESSAGE(body.has_value(), "no /metrics at " << address);
  return *body;
}

}  // namespace

TEST_CASE("a planner gets completions from real keep-manager and keep-worker processes") {
  it::TempDir tmp("worker-e2e");
  const std::string shm = it::unique_name("wkv");
  it::ManagerProcess m(
      {(tmp.path() / "data").string(), shm, {"--static-after-steps", "2", "--shm-bytes", "64MiB"}});
  it::WorkerProcess w({tmp.str(), m.endpoint(), shm});
  auto mc = manager_client(m.endpoint());
  auto wc = worker_client(w.endpoint());

  auto ping = wc->ping();
  REQUIRE_MESSAGE(ping.is_ok(), ping.status().to_string());
  CHECK(ping->server_version.find("keep-worker") != std::string::npos);
  CHECK(ping->model.find("dtype=bf16") != std::string::npos);

  remember(*mc, "robot", 3);  // every group turns static: the worker computes their KV
  wait_all_kv(*mc, "robot", std::size(kMemories));

  // full and keep at d = 1 compute every token: the same tokens.
  auto full = wc->complete(ask(kc::PlanMethod::kFull));
  REQUIRE_MESSAGE(full.is_ok(), full.status().to_string());
  auto keep1 = wc->complete(ask(kc::PlanMethod::kKeep, 1.0));
  REQUIRE_MESSAGE(keep1.is_ok(), keep1.status().to_string());
  CHECK(full->tokens == keep1->tokens);
  CHECK_FALSE(full->text.empty());
  CHECK(full->stats.method == kc::PlanMethod::kFull);
  CHECK(full->stats.recompute_ratio == 1.0);
  CHECK(full->stats.bytes_loaded == 0);
  CHECK(full->stats.segments.size() == std::size(kMemories));
  CHECK(full->stats.ttft_seconds > 0);

  // The worker's default method is keep, d = 0.96: it reuses the entries.
  auto keep = wc->complete(ask(kc::PlanMethod::kDefault));
  REQUIRE_MESSAGE(keep.is_ok(), keep.status().to_string());
  CHECK(keep->stats.method == kc::PlanMethod::kKeep);
  CHECK(keep->stats.recompute_ratio < 1.0);
  CHECK(keep->stats.entries_hit == std::size(kMemories));
  CHECK(keep->stats.bytes_loaded > 0);
  CHECK_FALSE(keep->stats.check_layers.empty());
  CHECK(keep->stats.recomputed_per_layer.size() > keep->stats.check_layers.size());

  // Scoring: one log-prob per candidate, best the largest.
  kc::CompleteArgs s = ask(kc::PlanMethod::kKeep);
  s.candidates = {"open the fridge", "go to the bathroom", "turn on the laptop"};
  auto scored = wc->complete(s);
  REQUIRE_MESSAGE(scored.is_ok(), scored.status().to_string());
  REQUIRE(scored->scores.size() == 3);
  for (const auto& c : scored->scores) {
    CHECK(c.log_prob < 0);
    CHECK(c.tokens > 0);
  }
  for (const auto& c : scored->scores) CHECK(c.log_prob <= scored->scores[scored->best].log_prob);

  // Bad requests get a code and a message; the worker keeps serving.
  kc::CompleteArgs bad = ask(kc::PlanMethod::kKeep);
  bad.instruction.clear();
  CHECK(wc->complete(bad).status().code() == Code::kInvalidArgument);
  bad = ask(kc::PlanMethod::kKeep, 1.5);
  auto r = wc->complete(bad);
  CHECK(r.status().code() == Code::kInvalidArgument);
  CHECK(r.status().message().find("decay") != std::string::npos);
  bad = ask(kc::PlanMethod::kKeep);
  bad.k = 100000;
  CHECK(wc->complete(bad).status().code() == Code::kInvalidArgument);
  bad = ask(kc::PlanMethod::kKeep);
  bad.instruction = std::string("\xff\xfe", 2);
  CHECK(wc->complete(bad).status().code() == Code::kInvalidArgument);
  {
    auto garbage = wc->call_raw("definitely not a capnp message!!");  // 32 bytes
    REQUIRE(garbage.is_ok());
    auto d = wire::decode_message(wire::as_bytes(*garbage), {});
    REQUIRE(d.is_ok());
    auto resp = (*d)->root<kc::WorkerProtocol::Response>();
    REQUIRE(resp.which() == kc::WorkerProtocol::Response::ERROR);
    CHECK(wire::status_from_error(resp.getError()).code() == Code::kMalformed);
  }
  {
    capnp::MallocMessageBuilder msg;  // a manager request sent to the worker
    auto req = msg.initRoot<kc::ManagerProtocol::Request>();
    req.setProtocolVersion(kc::ManagerProtocol::kVersion + 41);
    req.setRequestId(77);
    req.initPing();
    auto answer = wc->call_raw(wire::encode(msg));
    REQUIRE(answer.is_ok());
    auto d = wire::decode_message(wire::as_bytes(*answer), {});
    REQUIRE(d.is_ok());
    auto resp = (*d)->root<kc::WorkerProtocol::Response>();
    REQUIRE(resp.which() == kc::WorkerProtocol::Response::ERROR);
    CHECK(wire::status_from_error(resp.getError()).code() == Code::kVersionMismatch);
  }
  CHECK(wc->ping().is_ok());

  // /metrics tells what happened.
  const std::string text = metrics_text(w.metrics());
  CHECK(it::metric_value(text, "keep_worker_requests_total{method=\"full\",code=\"ok\"}") == 1);
  CHECK(it::metric_value(text, "keep_worker_requests_total{method=\"keep\",code=\"ok\"}") >= 3);
  // Refused at arrival, not run.
  CHECK(it::metric_value(text,
                         "keep_worker_requests_total{method=\"keep\","
                         "code=\"invalid_argument\"}") == std::nullopt);
  CHECK(it::metric_value(text, "keep_worker_requests_refused_total{code=\"invalid_argument\"}") ==
        4);
  CHECK(it::metric_value(text, "keep_worker_ttft_seconds_count{method=\"keep\"}") >= 3);
  CHECK(it::metric_value(text, "keep_worker_entries_total{method=\"keep\",result=\"hit\"}") >=
        2 * std::size(kMemories));
  CHECK(it::metric_value(text, "keep_worker_kv_jobs_total{result=\"done\"}") >= 1);
  CHECK(it::metric_value(text, "keep_worker_kv_jobs_total{result=\"failed\"}") == 0);
  CHECK(it::metric_value(text, "keep_worker_region_attached") == 1);
  CHECK(it::metric_value(text, "keep_worker_kv_bytes_loaded_total{method=\"keep\"}") > 0);

  CHECK(w.terminate() == 0);
  CHECK(w.err().find("worker: stopped") != std::string::npos);
}

TEST_CASE("a worker killed -9 in the middle of a KV job leaves no entry; a restarted one does it") {
  it::TempDir tmp("worker-kill");
  const std::string shm = it::unique_name("wkill");
  it::ManagerProcess m(
      {(tmp.path() / "data").string(),
       shm,
       {"--static-after-steps", "2", "--shm-bytes", "64MiB", "--lease-ms", "1500"}});
  auto mc = manager_client(m.endpoint());
  remember(*mc, "robot", 3);  // the jobs wait for a worker
  REQUIRE(with_kv(*mc, "robot") == 0);

  // One layer per step: a job spans 30 engine steps, so it is caught in flight.
  std::optional<it::WorkerProcess> w;
  w.emplace(it::WorkerProcess::Options{tmp.str(), m.endpoint(), shm, {"--job-layers", "1"}});
  // Killed while an entry is reserved for it: the job's KV is being written. (Between fetching a
  // job and reserving its entry the manager waits --job-timeout, not the lease: not this case.)
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  for (;;) {
    auto text = it::http_get(m.metrics(), "/metrics");
    if (text && it::metric_value(*text, "keep_manager_kv_entries{state=\"reserved\"}") >= 1) break;
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < deadline, "no entry was ever reserved");
  }
  w->kill9();
  const size_t done_before = with_kv(*mc, "robot");
  CHECK(done_before < std::size(kMemories));

  // The dead worker's reservation runs out; its half-written entry is never visible.
  const auto expire = std::chrono::steady_clock::now() + 30s;
  for (;;) {
    auto st = mc->stats();
    REQUIRE(st.is_ok());
    if (counter(*st, "jobs_in_flight") == 0) break;
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < expire, "the lease never ran out");
    std::this_thread::sleep_for(100ms);
  }
  CHECK(with_kv(*mc, "robot") == done_before);

  // A new worker does the job again; its entries are exact (keep at d = 1 equals full).
  w.emplace(it::WorkerProcess::Options{tmp.str(), m.endpoint(), shm, {}});
  wait_all_kv(*mc, "robot", std::size(kMemories));
  auto wc = worker_client(w->endpoint());
  auto full = wc->complete(ask(kc::PlanMethod::kFull));
  auto keep1 = wc->complete(ask(kc::PlanMethod::kKeep, 1.0));
  auto reuse = wc->complete(ask(kc::PlanMethod::kFullReuse));
  REQUIRE((full.is_ok() && keep1.is_ok() && reuse.is_ok()));
  CHECK(full->tokens == keep1->tokens);
  CHECK(reuse->stats.entries_hit == std::size(kMemories));
  CHECK(reuse->stats.entries_stale == 0);
}

TEST_CASE("a restarted keep-manager is reconnected to; at most the request in flight fails") {
  it::TempDir tmp("worker-mrestart");
  const std::string shm = it::unique_name("wmr");
  // An ipc endpoint: the restarted manager is found at the same address.
  const std::string endpoint = "ipc://" + (tmp.path() / "manager.sock").string();
  const it::ManagerProcess::Options mo{
      (tmp.path() / "data").string(),
      shm,
      {"--static-after-steps", "2", "--shm-bytes", "64MiB", "--endpoint", endpoint}};
  std::optional<it::ManagerProcess> m;
  m.emplace(mo);
  REQUIRE(m->endpoint() == endpoint);
  it::WorkerProcess w({tmp.str(), endpoint, shm, {"--manager-timeout-ms", "2000"}});
  auto mc = manager_client(endpoint);
  remember(*mc, "robot", 3);
  wait_all_kv(*mc, "robot", std::size(kMemories));
  auto wc = worker_client(w.endpoint(), 60s);
  auto before = wc->complete(ask(kc::PlanMethod::kKeep));
  REQUIRE_MESSAGE(before.is_ok(), before.status().to_string());
  CHECK(before->stats.entries_hit == std::size(kMemories));

  m->kill9();
  m.reset();  // unlinks the dead region's name; the next manager makes a new region
  m.emplace(mo);

  // Planner requests go on; the worker finds the new region and the KV is produced again.
  int failed = 0;
  bool reused = false;
  const auto deadline = std::chrono::steady_clock::now() + 90s;
  while (!reused && std::chrono::steady_clock::now() < deadline) {
    auto r = wc->complete(ask(kc::PlanMethod::kKeep));
    if (!r.is_ok()) {
      ++failed;
      MESSAGE("request failed across the restart: " << r.status().to_string());
    } else {
      CHECK(r->stats.segments.size() == std::size(kMemories));  // the memories came back
      reused = r->stats.entries_hit == std::size(kMemories);
    }
    std::this_thread::sleep_for(200ms);
  }
  CHECK(failed <= 1);
  CHECK(reused);
  CHECK(w.err().find("was replaced or removed") != std::string::npos);
}

TEST_CASE("deploy/worker.conf is read by keep-worker; a worker starts before its manager") {
  it::TempDir tmp("worker-conf");
  // The container's addresses and paths are overridden by the flags after it; every other
  // setting of the file is taken as it is. No manager runs: the worker serves without reuse.
  it::WorkerProcess w(
      {tmp.str(),
       "tcp://127.0.0.1:1",
       it::unique_name("noregion"),
       {"--config", std::string(KEEP_SOURCE_DIR) + "/deploy/worker.conf", "--endpoint",
        "tcp://127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--model", it::model_path(),
        "--device", "cpu", "--manager", "tcp://127.0.0.1:1", "--manager-timeout-ms", "300",
        "--manager-retry-ms", "0"}});
  auto wc = worker_client(w.endpoint(), 10s);
  CHECK(wc->ping().is_ok());
  const std::string text = metrics_text(w.metrics());
  CHECK(it::metric_value(text, "keep_worker_region_attached") == 0);
  // Without a manager a completion fails with the manager's code, and the worker goes on.
  auto r = wc->complete(ask(kc::PlanMethod::kKeep));
  CHECK(r.status().code() == Code::kTimeout);
  CHECK(wc->ping().is_ok());
  CHECK(w.terminate() == 0);
}

namespace {

// keep-worker started with `c.args` (after --device cpu) exits non-zero with one line on stderr
// that names `c.needle`.
struct Refusal {
  std::vector<std::string> args;
  std::string needle;
};
void expect_refused_in_one_line(const std::vector<Refusal>& cases) {
  for (const auto& c : cases) {
    std::vector<std::string> argv = {it::bin_path("keep-worker"),
                                     "--endpoint",
                                     "tcp://127.0.0.1:0",
                                     "--metrics-listen",
                                     "off",
                                     "--model",
                                     it::model_path(),
                                     "--manager",
                                     "tcp://127.0.0.1:1",
                                     "--log-level",
                                     "warn",
                                     "--device",
                                     "cpu"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const auto r = it::run_command(argv);
    INFO(c.needle << ": " << r.err);
    CHECK(r.exit_code != 0);
    CHECK(it::lines_of(r.err).size() == 1);
    CHECK(r.err.find(c.needle) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("keep-worker refuses a device tier it cannot have, in one line naming the flag") {
  // A tier's size without its name, a tier with the CPU backend, a budget below one slot.
  expect_refused_in_one_line({
      {{"--device-tier-bytes", "64MiB"}, "--device-tier-bytes"},
      {{"--device-tier", "t"}, "--device-tier"},
      {{"--device-tier", "t", "--device-tier-bytes", "1MiB", "--device-tier-slot-bytes", "2MiB"},
       "--device-tier-bytes"},
  });
}

TEST_CASE("keep-worker refuses a shared KV tier's bad settings, in one line naming the flag") {
  it::TempDir tmp("kv-remote-flags");
  const std::string empty = (tmp.path() / "empty").string();
  { std::ofstream(empty) << "\n"; }
  expect_refused_in_one_line({
      {{"--kv-remote", "redis://nohost"}, "--kv-remote"},
      {{"--kv-remote-timeout-ms", "0"}, "--kv-remote-timeout-ms"},
      {{"--kv-remote-password-file", (tmp.path() / "absent").string()},
       "--kv-remote-password-file"},
      {{"--kv-remote-password-file", empty}, "--kv-remote-password-file"},
      {{"--kv-remote-user", "keep"}, "--kv-remote-user"},
  });
}
