// keep-worker in cluster mode (issue 31, point 4: no request is silently served by a node that
// does not own the agent). A worker reads its node's KV region; the descriptors another node's
// manager hands out ({index, generation}) name other bytes at the same slots of this region. Two
// nodes of keep-manager + keep-worker (CPU, SmolLM2) on a real three-member etcd; agent X lives
// on a, Y on b, with memories of the same token lengths, so both regions hold their KV at the
// same slots and generations. A plan for X sent to b's worker is answered `moved`, naming a's
// worker (a's manager registered it: --advertise-worker); a client following it gets a's answer,
// never one computed from b's region. b's manager names no worker: a's worker answers `moved`
// for Y with nothing to follow. Skipped without Debian's etcd-server.
//
// The fault of issue 31, point 5, "kill -9 a node under writes": the same two nodes with their log
// in PostgreSQL (a primary and its synchronous standby, three etcd members); writers write through
// ManagerClients while each agent's planner asks completions through a WorkerClient configured
// with either node's worker; node a's manager and worker are killed -9 mid-run. a's agents move to
// b, every acknowledged memory is there exactly once, each of a's agents is planned for again
// within kAnswerAgainBound of the kill -- the planners that follow without a failed call: the
// client sends a plan the dead worker did not answer again, within the call -- and b's worker
// never answered for one of a's agents before it owned the agent's shard. Skipped without
// etcd-server or postgresql.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "shared/client/manager_client.h"
#include "shared/client/moved.h"
#include "shared/client/worker_client.h"
#include "shared/cluster/etcd_directory.h"
#include "shared/cluster/placement.h"
#include "tests/integration/manager/cluster_pg_helpers.h"
#include "tests/integration/worker_process.h"

using namespace std::chrono_literals;
namespace kc = keep::client;
namespace it = keep::itest;
using keep::Code;

namespace {

constexpr uint32_t kShards = 4;

std::unique_ptr<kc::WorkerClient> worker_client(const std::string& endpoint, bool follow,
                                                std::shared_ptr<kc::OwnerDirectory> dir = {},
                                                std::chrono::milliseconds timeout = 60s) {
  kc::WorkerClientOptions o;
  o.endpoint = endpoint;
  o.timeout = timeout;
  o.follow_moved = follow;
  o.directory = std::move(dir);
  auto c = kc::WorkerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

// An agent of `node`'s shards, not `other_than`.
std::string agent_of(keep::cluster::Placement& view, const std::string& node) {
  for (int i = 0; i < 200; ++i) {
    const std::string name = "robot-" + std::to_string(i);
    auto o = view.owner(keep::cluster::shard_of(name, kShards));
    REQUIRE(o.is_ok());
    REQUIRE(o->has_value());
    if ((*o)->node == node) return name;
  }
  FAIL("no agent of node " << node);
  return {};
}

// The agent's memories' KV slots ({index, generation}) once every memory has its KV (the
// node's worker computes them).
std::set<std::pair<uint32_t, uint64_t>> kv_slots(kc::ManagerClient& m, const std::string& agent,
                                                 size_t memories) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  for (;;) {
    auto page = m.list_memories(agent, 0, 1000);
    REQUIRE(page.is_ok());
    size_t with_kv = 0;
    for (const auto& mem : page->memories) with_kv += mem.has_kv ? 1 : 0;
    if (with_kv == memories) break;
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < deadline, "no KV for " << agent);
    std::this_thread::sleep_for(50ms);
  }
  auto r = m.retrieve(agent, "box", 16);
  REQUIRE(r.is_ok());
  std::set<std::pair<uint32_t, uint64_t>> out;
  for (const auto& s : *r) {
    if (s.kv) out.emplace(s.kv->entry.index, s.kv->entry.generation);
  }
  return out;
}

kc::CompleteArgs plan_for(const std::string& agent) {
  kc::CompleteArgs a;
  a.agent = agent;
  a.instruction = "Which box holds item 5?";
  a.method = kc::PlanMethod::kFullReuse;  // every entry as stored: the region's bytes decide
  a.max_tokens = 12;
  return a;
}

}  // namespace

TEST_CASE(
    "a worker plans only for its node's agents: another node's are answered moved, to that "
    "node's worker" *
    doctest::skip(!it::have_etcd())) {
  it::EtcdCluster etcd;
  etcd.wait_ready();
  it::TempDir tmp("wcluster");
  const std::string urls = it::join_urls(etcd.clients);
  const std::string worker_a = "tcp://127.0.0.1:" + std::to_string(it::free_port());
  const auto flags = [&](const std::string& node) {
    return std::vector<std::string>{
        "--etcd",         urls, "--node-id", node, "--shards", std::to_string(kShards),
        "--etcd-lease-s", "2"};
  };
  auto flags_a = flags("a");
  flags_a.insert(flags_a.end(), {"--advertise-worker", worker_a});
  const std::string shm_a = it::unique_name("wca"), shm_b = it::unique_name("wcb");
  it::ManagerProcess ma({(tmp.path() / "a").string(), shm_a, flags_a});
  it::ManagerProcess mb({(tmp.path() / "b").string(), shm_b, flags("b")});
  it::WorkerProcess wa(
      {tmp.str(), ma.endpoint(), shm_a, {"--endpoint", worker_a, "--job-poll-ms", "20"}});
  it::WorkerProcess wb({tmp.str(), mb.endpoint(), shm_b, {"--job-poll-ms", "20"}});
  REQUIRE(wa.endpoint() == worker_a);
  REQUIRE_MESSAGE(it::eventually(
                      [&] {
                        return it::metric(ma, "keep_manager_cluster_shards_owned") == kShards / 2 &&
                               it::metric(mb, "keep_manager_cluster_shards_owned") == kShards / 2;
                      },
                      20s),
                  ma.err() << mb.err());
  auto ec = etcd.client();
  keep::cluster::Placement view(ec.get(), "test");
  const std::string x = agent_of(view, "a"), y = agent_of(view, "b");

  // Every memory written through b: X's follow a's `moved` answer, which now names a's worker.
  auto m = it::manager_client(mb.endpoint(), 10s, /*follow=*/true);
  const std::pair<int, int> boxes[] = {{1, 4}, {2, 5}, {3, 6}};
  for (auto [box, item] : boxes) {
    kc::WriteArgs w;
    w.agent = x;
    w.text = "Box " + std::to_string(box) + " holds item " + std::to_string(item) + ".";
    REQUIRE(m->write(w).is_ok());
    w.agent = y;
    w.text = "Box " + std::to_string(item) + " holds item " + std::to_string(box + 6) + ".";
    REQUIRE(m->write(w).is_ok());
  }
  CHECK(m->moved_answers() == 1);  // X's first write; then remembered
  {
    auto plain = it::manager_client(mb.endpoint(), 10s);
    const keep::Status moved = plain->list_memories(x).status();
    REQUIRE(moved.code() == Code::kMoved);
    const auto t = kc::parse_moved(moved.message());
    REQUIRE_MESSAGE(t.has_value(), moved.message());
    CHECK(t->node == "a");
    CHECK(t->worker == worker_a);
    CHECK(t->endpoint == ma.endpoint());
  }
  // Both regions hold the agents' KV at the same slots: a descriptor of a's region read in b's
  // would find Y's bytes.
  const auto slots_x = kv_slots(*m, x, 3);
  const auto slots_y = kv_slots(*m, y, 3);
  CHECK(slots_x.size() == 3);
  CHECK_MESSAGE(slots_x == slots_y, "the regions' slots no longer coincide");

  // The owner's answer: every entry read from a's region.
  auto on_a = worker_client(wa.endpoint(), false)->complete(plan_for(x));
  REQUIRE_MESSAGE(on_a.is_ok(), on_a.status().to_string());
  CHECK(on_a->stats.entries_hit == 3);

  // b's worker does not plan for X: moved, naming a's worker.
  auto plain_b = worker_client(wb.endpoint(), false);
  auto refused = plain_b->complete(plan_for(x));
  REQUIRE_MESSAGE(!refused.is_ok(),
                  "b's worker planned for a's agent itself: "
                      << refused->stats.entries_hit << " entries read from b's region, tokens "
                      << (refused->tokens == on_a->tokens ? "equal to" : "unlike") << " a's");
  CHECK(refused.status().code() == Code::kMoved);
  const auto t = kc::parse_moved(refused.status().message());
  REQUIRE_MESSAGE(t.has_value(), refused.status().to_string());
  CHECK(t->endpoint == worker_a);
  CHECK(t->node == "a");
  // Followed, the plan is a's, token for token.
  auto follow_b = worker_client(wb.endpoint(), true);
  for (int i = 0; i < 2; ++i) {
    auto followed = follow_b->complete(plan_for(x));
    REQUIRE_MESSAGE(followed.is_ok(), followed.status().to_string());
    CHECK(followed->tokens == on_a->tokens);
    CHECK(followed->stats.entries_hit == 3);
  }
  CHECK(follow_b->moved_answers() == 1);  // then X's worker is remembered
  // b plans for its own agent from its own region.
  auto own = plain_b->complete(plan_for(y));
  REQUIRE_MESSAGE(own.is_ok(), own.status().to_string());
  CHECK(own->stats.entries_hit == 3);

  // b's manager named no worker: a's worker answers moved for Y, with nothing to follow.
  auto follow_a = worker_client(wa.endpoint(), true);
  auto unknown = follow_a->complete(plan_for(y));
  REQUIRE_FALSE(unknown.is_ok());
  CHECK(unknown.status().code() == Code::kMoved);
  CHECK_MESSAGE(
      unknown.status().message().find("served by b, whose keep-worker") != std::string::npos,
      unknown.status().to_string());
  CHECK_FALSE(kc::parse_moved(unknown.status().message()).has_value());

  // With the etcd directory of workers, no plan goes to the wrong worker: X's is sent to a's
  // worker at once; Y's owner named none, so it goes to the configured worker, b's.
  auto dir = keep::cluster::EtcdDirectory::create_for_workers(etcd.clients, kShards);
  REQUIRE(dir.is_ok());
  auto direct = worker_client(wb.endpoint(), true, *dir);
  auto dx = direct->complete(plan_for(x));
  REQUIRE_MESSAGE(dx.is_ok(), dx.status().to_string());
  CHECK(dx->tokens == on_a->tokens);
  auto dy = direct->complete(plan_for(y));
  REQUIRE_MESSAGE(dy.is_ok(), dy.status().to_string());
  CHECK(dy->tokens == own->tokens);
  CHECK(direct->moved_answers() == 0);
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The node-kill fault test: each node serves kRobotsPerNode of the agents.
constexpr uint32_t kKillShards = 8;
constexpr size_t kRobotsPerNode = 3;
constexpr auto kLease = 2s;                                     // pg_cluster_flags' --etcd-lease-s
constexpr auto kRound = std::chrono::milliseconds(kLease) / 4;  // a node's round
// A planner's WorkerClient timeout: how long a call sent to the dead worker waits for nothing.
// Well above a plan's time with every robot's plan queued on one worker (0.3 to 1.3 s here).
constexpr auto kPlanTimeout = 4s;
// One plan on the survivor, queued behind every robot's: 2 * kRobotsPerNode plans of up to 0.5 s
// on a loaded 2-core machine.
constexpr auto kQueuedPlan = 3s;
// The stated time: from the kill to each of the dead node's robots' first plan again. The dead
// node's lease runs out at most kLease after the kill (it renewed before it died); the survivor
// notices at its next round (kRound), takes the shard and replays its log (tens of ms); until then
// the robot's plans are answered moved (to the dead worker: followed) or unavailable. A plan sent
// to the dead worker -- in flight at the kill, remembered, or named by `moved` or by etcd until
// the lease ran out -- waits kPlanTimeout for nothing; then the robot's plan on the survivor.
// Measured on a loaded 2-core machine: 4.5 to 5.6 s (the planner's timeout on the dead worker,
// then a plan), 2.2 to 2.7 s for the robot whose planner asks the survivor's worker and follows
// nothing (the lease, a round, a plan).
constexpr auto kAnswerAgainBound = kLease + kRound + kPlanTimeout + kQueuedPlan;  // 9.5 s

// A successful plan: when it was sent and when its answer came; whether the client sent it again
// (to another worker, after the one it was sent to gave no answer).
struct Answer {
  Clock::time_point sent, received;
  bool resent = false;
};

// What one robot's planner saw.
struct PlannerLog {
  std::vector<Answer> ok;
  std::map<std::string, int> failures;  // code name -> count
  std::string last_failure;
  std::vector<std::string> failed_after_kill;  // failures answered after the kill
};

// What one writer saw, per memory text.
struct WriterLog {
  std::set<std::string> acked, unknown;
  std::vector<std::string> errors;  // any other answer
  size_t acked_on_a_after_kill = 0;
};

}  // namespace

TEST_CASE(
    "kill -9 of a node (manager and worker) under writes and plans: its agents move, no "
    "acknowledged memory is lost or duplicated, planners are answered again within the stated "
    "time, never by a node not owning the agent" *
    doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  it::SyncPgPair pg;
  const std::string conninfo = pg.conninfo();
  it::EtcdCluster etcd;
  etcd.wait_ready();
  const std::string urls = it::join_urls(etcd.clients);
  it::TempDir tmp("wckill");
  const std::string worker_ep[2] = {"tcp://127.0.0.1:" + std::to_string(it::free_port()),
                                    "tcp://127.0.0.1:" + std::to_string(it::free_port())};
  const std::string shm[2] = {it::unique_name("wka"), it::unique_name("wkb")};
  const auto flags = [&](const std::string& node, int i) {
    auto f = it::pg_cluster_flags(urls, node, kKillShards, conninfo);
    f.insert(f.end(), {"--advertise-worker", worker_ep[i]});
    return f;
  };
  it::ManagerProcess ma({(tmp.path() / "a").string(), shm[0], flags("a", 0)});
  it::ManagerProcess mb({(tmp.path() / "b").string(), shm[1], flags("b", 1)});
  const auto worker_flags = [&](int i) {
    return std::vector<std::string>{"--endpoint", worker_ep[i], "--job-poll-ms",
                                    "20",         "--threads",  "1"};
  };
  it::WorkerProcess wa({tmp.str(), ma.endpoint(), shm[0], worker_flags(0)});
  it::WorkerProcess wb({tmp.str(), mb.endpoint(), shm[1], worker_flags(1)});
  it::require_split(ma, mb, kKillShards);

  // kRobotsPerNode robots (agents) of each node: a's, then b's.
  std::vector<std::string> names;
  for (int i = 0; i < 64; ++i) names.push_back("robot-" + std::to_string(i));
  std::vector<std::string> agents;
  for (const char* node : {"a", "b"}) {
    const auto mine = it::agents_of(etcd, node, names, kKillShards);
    REQUIRE(mine.size() >= kRobotsPerNode);
    agents.insert(agents.end(), mine.begin(), std::next(mine.begin(), kRobotsPerNode));
  }
  const std::set<std::string> on_a(agents.begin(), agents.begin() + kRobotsPerNode);

  std::atomic<bool> stop{false};
  std::atomic<bool> killed{false};
  Clock::time_point killed_at{};  // written before `killed` is set

  // Ownership as etcd says it, read every 50 ms: for each of a's agents' shards, the start of the
  // last read that named another owner than b (or none). b may answer for the shard's agents only
  // after that (etcd reads are linearizable; b takes a shard in etcd before it serves it).
  std::map<uint32_t, Clock::time_point> not_b_at;
  std::thread monitor([&] {
    auto ec = etcd.client();
    keep::cluster::Placement view(ec.get(), "test");
    while (!stop.load()) {
      const auto t = Clock::now();
      auto owners = view.owners();
      for (const auto& agent : on_a) {
        if (!owners.is_ok()) break;
        const uint32_t s = keep::cluster::shard_of(agent, kKillShards);
        auto o = owners->find(s);
        if (o == owners->end() || o->second.node != "b") not_b_at[s] = t;
      }
      std::this_thread::sleep_for(50ms);
    }
  });

  // Writers, each with one ManagerClient for the whole test (moved followed): writer 0 configured
  // with b's endpoint, writer 1 with a's and the etcd directory. A write in flight to a at the
  // kill is resent with its request id: by writer 0 through b, by writer 1 once etcd names b
  // (until a's lease runs out it names a, also writer 1's configured endpoint). Neither gives a
  // write up within failover_wait.
  std::vector<std::unique_ptr<kc::ManagerClient>> writer_clients;
  for (int w = 0; w < 2; ++w) {
    kc::ClientOptions o;
    o.endpoint = w == 0 ? mb.endpoint() : ma.endpoint();
    o.timeout = 1000ms;
    if (w == 1) {
      auto d = keep::cluster::EtcdDirectory::create(etcd.clients, kKillShards);
      REQUIRE(d.is_ok());
      o.directory = std::move(d).value();
    }
    auto c = kc::ManagerClient::connect(o);
    REQUIRE(c.is_ok());
    writer_clients.push_back(std::move(c).value());
  }
  std::vector<WriterLog> wlogs(2);
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w) {
    writers.emplace_back([&, w] {
      WriterLog& log = wlogs[static_cast<size_t>(w)];
      // A robot's pace: the managers embed every memory.
      it::write_rounds(
          *writer_clients[static_cast<size_t>(w)], w, agents, stop, killed, 150ms,
          [&](const std::string& agent, const std::string& text, const keep::Status& st,
              bool after_kill) {
            if (st.is_ok()) {
              log.acked.insert(text);
              if (after_kill && on_a.count(agent)) ++log.acked_on_a_after_kill;
            } else if (st.code() == Code::kTimeout || st.code() == Code::kUnavailable) {
              log.unknown.insert(text);  // the client gave up: applied or not
            } else {
              log.errors.push_back(agent + ": " + st.to_string());
            }
          });
    });
  }
  std::this_thread::sleep_for(1000ms);  // every agent has memories before the first plan

  // Each robot's planner: one WorkerClient, a plan a second after its last, again 50 ms after a
  // failure. The i-th robot of each node has a planner of kind i: 0 configured with b's worker,
  // following moved; 1 with a's worker and the etcd directory of workers, following moved; 2 with
  // b's worker, not following (a's robot is answered moved until b owns it: what it is answered
  // shows who served).
  auto worker_dir = keep::cluster::EtcdDirectory::create_for_workers(etcd.clients, kKillShards);
  REQUIRE(worker_dir.is_ok());
  std::vector<std::unique_ptr<kc::WorkerClient>> planners;
  for (size_t r = 0; r < agents.size(); ++r) {
    switch (r % kRobotsPerNode) {
      case 0:
        planners.push_back(worker_client(worker_ep[1], true, nullptr, kPlanTimeout));
        break;
      case 1:
        planners.push_back(worker_client(worker_ep[0], true, *worker_dir, kPlanTimeout));
        break;
      default:
        planners.push_back(worker_client(worker_ep[1], false, nullptr, kPlanTimeout));
    }
  }
  std::mutex plans_mu;  // guards plogs
  std::vector<PlannerLog> plogs(planners.size());
  std::vector<std::thread> planner_threads;
  for (size_t r = 0; r < planners.size(); ++r) {
    planner_threads.emplace_back([&, r] {
      kc::CompleteArgs q;
      q.agent = agents[r];
      q.instruction = "Where is the mug?";
      q.method = kc::PlanMethod::kFullReuse;
      q.k = 1;
      q.max_tokens = 1;
      while (!stop.load()) {
        const auto sent = Clock::now();
        const uint64_t resent_before = planners[r]->calls_resent();
        auto answer = planners[r]->complete(q);
        {
          std::lock_guard<std::mutex> lock(plans_mu);
          PlannerLog& log = plogs[r];
          if (answer.is_ok()) {
            log.ok.push_back({sent, Clock::now(), planners[r]->calls_resent() > resent_before});
          } else {
            log.failures[keep::code_name(answer.status().code())] += 1;
            log.last_failure = answer.status().to_string();
            if (killed.load()) log.failed_after_kill.push_back(log.last_failure);
          }
        }
        std::this_thread::sleep_for(answer.is_ok() ? 1000ms : 50ms);
      }
    });
  }
  // Robot r's first plan answered after the kill by a live node -- sent after the kill, or in
  // flight at the kill and sent again by the client: when its answer came (nullopt: none yet).
  const auto first_after_kill = [&](size_t r) {
    std::optional<Clock::time_point> first;
    for (const Answer& a : plogs[r].ok) {
      const bool after = a.sent >= killed_at || (a.resent && a.received > killed_at);
      if (after && (!first || a.received < *first)) first = a.received;
    }
    return first;
  };

  std::this_thread::sleep_for(2500ms);  // writes and plans flow on both nodes
  wa.kill9();
  ma.kill9();
  killed_at = Clock::now();
  killed.store(true);
  // Until every robot was answered again (or well past the bound).
  it::eventually(
      [&] {
        std::lock_guard<std::mutex> lock(plans_mu);
        for (size_t r = 0; r < agents.size(); ++r) {
          if (!first_after_kill(r)) return false;
        }
        return true;
      },
      kAnswerAgainBound + 5s);
  std::this_thread::sleep_for(500ms);  // a few more writes and plans on the survivor
  stop.store(true);
  for (auto& t : planner_threads) t.join();
  for (auto& t : writers) t.join();
  monitor.join();

  // (2) Every robot of a planned again within the bound; b's planned on.
  double worst = 0;
  for (size_t r = 0; r < agents.size(); ++r) {
    const PlannerLog& log = plogs[r];
    double busy = 0;  // mean time of its answered plans
    for (const Answer& a : log.ok) busy += seconds(a.received - a.sent) / log.ok.size();
    std::string failures;
    for (const auto& [code, n] : log.failures) failures += " " + code + " " + std::to_string(n);
    const auto first = first_after_kill(r);
    MESSAGE(agents[r] << " (node " << (on_a.count(agents[r]) ? "a" : "b") << ", planner kind "
                      << r % kRobotsPerNode << "): " << log.ok.size() << " plans, " << busy
                      << " s each; planned again " << (first ? seconds(*first - killed_at) : -1)
                      << " s after the kill; failures:" << failures
                      << " (the last: " << log.last_failure << ")");
    REQUIRE_MESSAGE(first.has_value(), agents[r] << " never planned again; b's worker:\n"
                                                 << wb.err() << "\nb's manager:\n"
                                                 << mb.err());
    if (on_a.count(agents[r])) worst = std::max(worst, seconds(*first - killed_at));
  }
  MESSAGE("a's robots planned again within " << worst << " s of the kill (stated bound "
                                             << seconds(kAnswerAgainBound) << " s)");
  CHECK(worst < seconds(kAnswerAgainBound));
  // Planners that follow (kinds 0 and 1) never saw a failure after the kill: a plan sent to the
  // dead worker -- in flight at the kill, or named by etcd or `moved` until the lease ran out --
  // was sent again by the client, within the same call, to the node that took the robot over.
  uint64_t resent = 0;
  for (size_t r = 0; r < agents.size(); ++r) {
    if (r % kRobotsPerNode == 2) continue;
    const PlannerLog& log = plogs[r];
    CHECK_MESSAGE(log.failed_after_kill.empty(),
                  agents[r] << ": " << log.failed_after_kill.size() << " failed plan(s) after the "
                            << "kill, the first: "
                            << (log.failed_after_kill.empty() ? "" : log.failed_after_kill[0]));
    resent += planners[r]->calls_resent();
  }
  CHECK(resent > 0);

  // (3) b's worker, asked without following for a's robot of kind 2: answered moved while a
  // lived, and not once before etcd named b the owner of the robot's shard.
  const std::string& watched = agents[2];
  CHECK(plogs[2].failures["moved"] > 0);
  const uint32_t watched_shard = keep::cluster::shard_of(watched, kKillShards);
  for (const Answer& a : plogs[2].ok) {
    CHECK_MESSAGE(a.received > not_b_at[watched_shard],
                  "b's worker answered for " << watched << " "
                                             << seconds(not_b_at[watched_shard] - a.received)
                                             << " s before etcd named b its owner");
  }
  CHECK(planners[0]->moved_answers() > 0);  // a's robot of kind 0 found a's worker through b's

  // (1) Every acknowledged memory exactly once on b (now serving every shard), nothing else.
  REQUIRE(it::eventually(
      [&] { return it::metric(mb, "keep_manager_cluster_shards_ready") == kKillShards; }, 10s));
  auto reader = it::manager_client(mb.endpoint(), 10s, /*follow=*/true);
  const auto seen = it::memory_counts(*reader, agents);
  size_t acked = 0, unknown_there = 0, listed = 0;
  for (const WriterLog& w : wlogs) {
    CHECK_MESSAGE(w.errors.empty(), (w.errors.empty() ? "" : w.errors.front()));
    CHECK(w.acked_on_a_after_kill > 0);
    CHECK_MESSAGE(w.unknown.empty(), w.unknown.size() << " writes given up");
    for (const auto& t : w.acked) {
      const int n = seen.count(t) ? seen.at(t) : 0;
      CHECK_MESSAGE(n == 1, "acknowledged '" << t << "' is there " << n << " times");
    }
    for (const auto& t : w.unknown) {
      const int n = seen.count(t) ? seen.at(t) : 0;
      CHECK_MESSAGE(n <= 1, "'" << t << "' is there " << n << " times");
      unknown_there += static_cast<size_t>(n);
    }
    acked += w.acked.size();
  }
  for (const auto& [t, n] : seen) listed += static_cast<size_t>(n);
  MESSAGE(acked << " writes acknowledged, " << wlogs[0].unknown.size() + wlogs[1].unknown.size()
                << " unconfirmed (" << unknown_there << " of them applied); " << listed
                << " memories on the survivor");
  CHECK(acked > 40);
  CHECK(listed == acked + unknown_there);
}
