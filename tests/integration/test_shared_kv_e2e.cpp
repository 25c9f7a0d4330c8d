// The shared KV tier end to end (issue 31, points 3 and 5): three redis-server masters in cluster
// mode, and nodes of keep-manager + keep-worker (CPU, SmolLM2) with --kv-remote. Node A computes
// its agent's entries and publishes the shareable ones (static groups, example plans); node B,
// given the same memories, reads them from Redis instead of computing them, and plans exactly as
// A does. With Redis killed, node C computes everything itself (errors counted, no hits) and
// plans the same again; B keeps serving.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include "shared/client/manager_client.h"
#include "shared/client/worker_client.h"
#include "tests/integration/redis_cluster.h"
#include "tests/integration/worker_process.h"

using namespace std::chrono_literals;
namespace kc = keep::client;
namespace it = keep::itest;

namespace {

struct Memory {
  const char* text;
  kc::SegmentKind kind;
};

// Example plans common to every agent, and a few object states.
const Memory kMemories[] = {
    {"Example plan: to fetch a drink, walk to the kitchen, open the fridge, take the bottle, "
     "close the fridge, bring it to the person.",
     kc::SegmentKind::kExamplePlan},
    {"Example plan: to tidy the desk, pick up each item, put papers in the drawer, put the mug "
     "in the sink.",
     kc::SegmentKind::kExamplePlan},
    {"Example plan: to water the plants, fill the watering can at the sink, walk to each plant, "
     "pour until the soil is wet.",
     kc::SegmentKind::kExamplePlan},
    {"The milk is in the fridge.", kc::SegmentKind::kObjectState},
    {"The fridge is in the kitchen, next to the sink.", kc::SegmentKind::kObjectState},
    {"The red mug is on the kitchen counter.", kc::SegmentKind::kObjectState},
};

std::unique_ptr<kc::ManagerClient> manager_client(const std::string& endpoint) {
  kc::ClientOptions o;
  o.endpoint = endpoint;
  o.timeout = 20s;
  auto c = kc::ManagerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

std::unique_ptr<kc::WorkerClient> worker_client(const std::string& endpoint) {
  kc::WorkerClientOptions o;
  o.endpoint = endpoint;
  o.timeout = 120s;
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

// keep_worker_kv_shared_total{result="..."} from a worker's /metrics (0 when absent).
double shared_metric(const std::string& metrics_address, const std::string& result) {
  auto body = it::http_get(metrics_address, "/metrics");
  REQUIRE_MESSAGE(body.has_value(), "no /metrics at " << metrics_address);
  const std::string series = "keep_worker_kv_shared_total{result=\"" + result + "\"} ";
  std::stringstream ss(*body);
  for (std::string l; std::getline(ss, l);) {
    if (l.rfind(series, 0) == 0) return std::stod(l.substr(series.size()));
  }
  return 0;
}

// Writes the memories, groups them, lets the groups turn static and waits until the worker did
// every KV job (nothing queued or running, every memory with KV).
void remember_and_wait(kc::ManagerClient& m, const std::string& agent) {
  for (const Memory& mem : kMemories) {
    kc::WriteArgs a;
    a.agent = agent;
    a.text = mem.text;
    a.kind = mem.kind;
    REQUIRE(m.write(a).is_ok());
  }
  REQUIRE(m.retrieve(agent, "milk", 1).is_ok());  // embeds and groups them all
  REQUIRE(m.advance_step(agent, 3).is_ok());      // every group turns static
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  for (;;) {
    auto page = m.list_memories(agent, 0, 1000);
    REQUIRE(page.is_ok());
    size_t with_kv = 0;
    for (const auto& mem : page->memories) with_kv += mem.has_kv ? 1 : 0;
    auto s = m.stats();
    REQUIRE(s.is_ok());
    if (with_kv == std::size(kMemories) && counter(*s, "jobs_queued") == 0 &&
        counter(*s, "jobs_running") == 0 && counter(*s, "jobs_in_flight") == 0) {
      return;
    }
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < deadline,
                    "the worker did not produce every memory's KV in time");
    std::this_thread::sleep_for(100ms);
  }
}

// What a planner gets: generated tokens (full reuse: every entry as stored; keep) and the
// candidates' log-probs.
struct Plans {
  std::vector<int32_t> reuse_tokens, keep_tokens;
  std::vector<double> scores;
  uint32_t entries_hit = 0;
};

Plans plan(kc::WorkerClient& w) {
  kc::CompleteArgs a;
  a.agent = "robot";
  a.instruction = "Bring me a glass of milk.";
  a.history = {"walk to the kitchen"};
  a.k = 8;
  a.max_tokens = 8;
  Plans p;
  a.method = kc::PlanMethod::kFullReuse;
  auto reuse = w.complete(a);
  REQUIRE_MESSAGE(reuse.is_ok(), reuse.status().to_string());
  p.reuse_tokens = reuse->tokens;
  p.entries_hit = reuse->stats.entries_hit;
  a.method = kc::PlanMethod::kKeep;
  auto keep = w.complete(a);
  REQUIRE_MESSAGE(keep.is_ok(), keep.status().to_string());
  p.keep_tokens = keep->tokens;
  a.candidates = {"open the fridge", "fill the watering can", "pick up the mug"};
  auto scored = w.complete(a);
  REQUIRE_MESSAGE(scored.is_ok(), scored.status().to_string());
  for (const auto& c : scored->scores) p.scores.push_back(c.log_prob);
  return p;
}

// One node: keep-manager (its own region) and a keep-worker with the shared tier.
struct Node {
  std::string shm;
  std::unique_ptr<it::ManagerProcess> manager;
  std::unique_ptr<it::WorkerProcess> worker;
  Node(const it::TempDir& tmp, const std::string& name, const std::string& redis_url,
       std::vector<std::string> worker_flags = {})
      : shm(it::unique_name("skv-" + name)) {
    manager = std::make_unique<it::ManagerProcess>(it::ManagerProcess::Options{
        (tmp.path() / name).string(), shm, {"--static-after-steps", "2", "--shm-bytes", "64MiB"}});
    worker_flags.insert(worker_flags.begin(), {"--kv-remote", redis_url});
    worker = std::make_unique<it::WorkerProcess>(
        it::WorkerProcess::Options{tmp.str(), manager->endpoint(), shm, worker_flags});
  }
  double shared(const std::string& result) const {
    return shared_metric(worker->metrics(), result);
  }
  // The robot's memories written at this node's manager and their KV produced, then its plans
  // asked of this node's worker.
  Plans remember_and_plan() const {
    auto m = manager_client(manager->endpoint());
    remember_and_wait(*m, "robot");
    return plan(*worker_client(worker->endpoint()));
  }
};

}  // namespace

TEST_CASE("workers share static groups' and example plans' KV through Redis Cluster") {
  if (!it::have_redis()) {
    MESSAGE("skipped: no redis-server / redis-cli");
    return;
  }
  it::RedisClusterProcs redis;
  it::TempDir tmp("shared-kv");

  // Node A: nothing in Redis yet; it computes every entry and publishes the shareable ones.
  Node a(tmp, "a", redis.url());
  const Plans computed = a.remember_and_plan();
  CHECK(computed.entries_hit == std::size(kMemories));
  // A may hit entries it published itself: a static group of one example plan has the same
  // content as that plan's own KV.
  CHECK(a.shared("published") > 0);
  CHECK(a.shared("error") == 0);
  MESSAGE("node A: published " << a.shared("published") << ", missed " << a.shared("miss")
                               << ", hits " << a.shared("hit"));

  // Node B, the same memories: its shareable entries come from Redis, and it plans the same.
  Node b(tmp, "b", redis.url());
  const Plans shared = b.remember_and_plan();
  const double b_hits = b.shared("hit");
  MESSAGE("node B: hits " << b_hits << ", misses " << b.shared("miss") << ", published "
                          << b.shared("published"));
  CHECK(b_hits > 0);
  CHECK(b.shared("error") == 0);
  CHECK(b.shared("rejected") == 0);
  CHECK(shared.entries_hit == std::size(kMemories));
  CHECK(shared.reuse_tokens == computed.reuse_tokens);
  CHECK(shared.keep_tokens == computed.keep_tokens);
  CHECK(shared.scores == computed.scores);  // bit for bit: the same entry bytes

  // Redis killed: B goes on serving; node C computes everything itself, counts errors, plans
  // the same.
  redis.kill_all();
  const Plans after = plan(*worker_client(b.worker->endpoint()));
  CHECK(after.reuse_tokens == computed.reuse_tokens);
  CHECK(after.scores == computed.scores);
  Node c(tmp, "c", redis.url());
  const Plans alone = c.remember_and_plan();
  MESSAGE("node C (Redis down): errors " << c.shared("error") << ", hits " << c.shared("hit"));
  CHECK(c.shared("hit") == 0);
  CHECK(c.shared("error") > 0);
  CHECK(alone.entries_hit == std::size(kMemories));
  CHECK(alone.reuse_tokens == computed.reuse_tokens);
  CHECK(alone.keep_tokens == computed.keep_tokens);
  CHECK(alone.scores == computed.scores);
  CHECK(b.shared("hit") == b_hits);  // no more hits anywhere
  CHECK(b.worker->alive());
}

TEST_CASE(
    "a password-protected Redis Cluster: workers with its password share; a wrong one only "
    "loses the hits") {
  if (!it::have_redis()) {
    MESSAGE("skipped: no redis-server / redis-cli");
    return;
  }
  it::RedisClusterProcs redis("kv pass");
  it::TempDir tmp("shared-kv-auth");
  const auto password_file = [&](const std::string& name, const std::string& password) {
    const std::string path = (tmp.path() / name).string();
    std::ofstream(path) << password << "\n";
    return std::vector<std::string>{"--kv-remote-password-file", path};
  };
  Node a(tmp, "a", redis.url(), password_file("right-a", "kv pass"));
  const Plans computed = a.remember_and_plan();
  CHECK(a.shared("published") > 0);
  CHECK(a.shared("error") == 0);

  Node b(tmp, "b", redis.url(), password_file("right-b", "kv pass"));
  const Plans shared = b.remember_and_plan();
  MESSAGE("with the password: A published " << a.shared("published") << ", B hits "
                                            << b.shared("hit"));
  CHECK(b.shared("hit") > 0);
  CHECK(b.shared("error") == 0);
  CHECK(shared.scores == computed.scores);

  // A wrong password: every Redis call refused, the entries computed, the same plans.
  Node w(tmp, "w", redis.url(), password_file("wrong", "not it"));
  const Plans alone = w.remember_and_plan();
  MESSAGE("with a wrong password: errors " << w.shared("error") << ", hits " << w.shared("hit"));
  CHECK(w.shared("hit") == 0);
  CHECK(w.shared("error") > 0);
  CHECK(alone.entries_hit == std::size(kMemories));
  CHECK(alone.scores == computed.scores);
  CHECK(w.worker->err().find("WRONGPASS") != std::string::npos);  // said in its log
}
