// keep-worker in cluster mode (issue 31, point 4: no request is silently served by a node that
// does not own the agent). A worker reads its node's KV region; the descriptors another node's
// manager hands out ({index, generation}) name other bytes at the same slots of this region. Two
// nodes of keep-manager + keep-worker (CPU, SmolLM2) on a real three-member etcd; agent X lives
// on a, Y on b, with memories of the same token lengths, so both regions hold their KV at the
// same slots and generations. A plan for X sent to b's worker is answered `moved`, naming a's
// worker (a's manager registered it: --advertise-worker); a client following it gets a's answer,
// never one computed from b's region. b's manager names no worker: a's worker answers `moved`
// for Y with nothing to follow. Skipped without Debian's etcd-server.
#include <doctest/doctest.h>

#include <set>

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
                                                std::shared_ptr<kc::OwnerDirectory> dir = {}) {
  kc::WorkerClientOptions o;
  o.endpoint = endpoint;
  o.timeout = 60s;
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
