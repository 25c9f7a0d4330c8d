// keep-manager in cluster mode (issue 31, points 1 and 4) against a real three-member etcd: two
// real keep-manager processes split the shards between them; a request about an agent another
// node serves is answered `moved`, naming that node's endpoint; a node killed -9 loses its shards
// to the other within its lease, and the survivor then serves every agent. keepctl --etcd routes
// each agent's command to its node with no node address given. Skipped without etcd.
#include <doctest/doctest.h>

#include <thread>

#include "shared/client/manager_client.h"
#include "shared/cluster/placement.h"
#include "tests/integration/etcd_cluster.h"
#include "tests/integration/manager/manager_process.h"

using namespace keep;
using namespace std::chrono_literals;
namespace it = keep::itest;
namespace kc = keep::client;

namespace {

constexpr uint32_t kShards = 8;

std::unique_ptr<kc::ManagerClient> connect(const std::string& endpoint, bool follow = false) {
  kc::ClientOptions o;
  o.endpoint = endpoint;
  o.timeout = 10s;
  o.follow_moved = follow;
  auto c = kc::ManagerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

Status write(kc::ManagerClient& c, const std::string& agent) {
  kc::WriteArgs a;
  a.agent = agent;
  a.text = "The mug is on the table.";
  return c.write(a).status();
}

double shards_owned(const it::ManagerProcess& m) {
  auto text = it::http_get(m.metrics(), "/metrics");
  REQUIRE(text.has_value());
  auto v = it::metric_value(*text, "keep_manager_cluster_shards_owned");
  REQUIRE(v.has_value());
  return *v;
}

// Polls `pred` every 100 ms for up to `limit`.
template <typename F>
bool eventually(F pred, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(100ms);
  }
  return pred();
}

}  // namespace

TEST_CASE("two managers share the shards, answer moved for the other's agents, and take over" *
          doctest::skip(!it::have_etcd())) {
  it::EtcdCluster etcd;
  etcd.wait_ready();
  std::string urls;
  for (const auto& u : etcd.clients) urls += (urls.empty() ? "" : ",") + u;
  const auto cluster_flags = [&](const std::string& node) {
    return std::vector<std::string>{
        "--etcd",         urls, "--node-id", node, "--shards", std::to_string(kShards),
        "--etcd-lease-s", "2"};
  };
  it::TempDir tmp("cluster");
  it::ManagerProcess a({(tmp.path() / "a").string(), it::unique_name("cla"), cluster_flags("a")});
  CHECK(shards_owned(a) == kShards);  // alone: every shard
  auto ca = connect(a.endpoint());
  CHECK(write(*ca, "robot-0").is_ok());

  it::ManagerProcess b({(tmp.path() / "b").string(), it::unique_name("clb"), cluster_flags("b")});
  // a hands back one shard a round (a quarter of the lease) until each has its share.
  REQUIRE(eventually(
      [&] { return shards_owned(a) == kShards / 2 && shards_owned(b) == kShards / 2; }, 15s));

  // An agent of one of b's shards: a answers moved, naming b's endpoint; b serves it.
  auto ec = etcd.client();
  cluster::Placement view(ec.get(), "test");
  std::string b_agent, a_agent;
  for (int i = 0; i < 200 && (b_agent.empty() || a_agent.empty()); ++i) {
    const std::string agent = "robot-" + std::to_string(i);
    auto o = view.owner(cluster::shard_of(agent, kShards));
    REQUIRE(o.is_ok());
    REQUIRE(o->has_value());
    ((*o)->node == "b" ? b_agent : a_agent) = agent;
  }
  REQUIRE_FALSE(b_agent.empty());
  REQUIRE_FALSE(a_agent.empty());
  auto cb = connect(b.endpoint());
  const Status moved = write(*ca, b_agent);
  CHECK(moved.code() == Code::kMoved);
  CHECK_MESSAGE(moved.message().find("served by b at " + b.endpoint()) != std::string::npos,
                moved.to_string());
  CHECK(write(*cb, b_agent).is_ok());
  CHECK(cb->retrieve(b_agent, "mug", 1).is_ok());
  CHECK(write(*ca, a_agent).is_ok());
  CHECK(cb->list_memories(a_agent, 0, 10).status().code() == Code::kMoved);
  CHECK(ca->stats().is_ok());  // node-wide calls are not routed

  // A client that follows moved reaches every agent through a: b's agents at b.
  auto follower = connect(a.endpoint(), true);
  CHECK(write(*follower, b_agent).is_ok());
  CHECK(write(*follower, a_agent).is_ok());
  auto page = follower->list_memories(b_agent);
  REQUIRE(page.is_ok());
  CHECK(page->memories.size() == 2);  // b's own write and the follower's

  // a dies without leaving: its lease (2 s) runs out and b takes every shard.
  a.kill9();
  REQUIRE(eventually([&] { return shards_owned(b) == kShards; }, 15s));
  CHECK(write(*cb, a_agent).is_ok());
}

TEST_CASE("keepctl --etcd sends each agent's command to the node that serves it" *
          doctest::skip(!it::have_etcd())) {
  it::EtcdCluster etcd;
  etcd.wait_ready();
  std::string urls;
  for (const auto& u : etcd.clients) urls += (urls.empty() ? "" : ",") + u;
  const auto keepctl = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {it::bin_path("keepctl"), "--etcd", urls};
    argv.insert(argv.end(), args.begin(), args.end());
    return it::run_command(argv, 30000ms);
  };
  // No node registered yet: nowhere to send a command.
  auto none = keepctl({"--shards", std::to_string(kShards), "ping"});
  CHECK(none.exit_code == 1);
  CHECK_MESSAGE(none.err == "keepctl: unavailable: no keep-manager node is registered in etcd (" +
                                urls + ")\n",
                none.err);

  const auto cluster_flags = [&](const std::string& node) {
    return std::vector<std::string>{
        "--etcd",         urls, "--node-id", node, "--shards", std::to_string(kShards),
        "--etcd-lease-s", "2"};
  };
  it::TempDir tmp("ctletcd");
  it::ManagerProcess a({(tmp.path() / "a").string(), it::unique_name("cea"), cluster_flags("a")});
  it::ManagerProcess b({(tmp.path() / "b").string(), it::unique_name("ceb"), cluster_flags("b")});
  REQUIRE(eventually(
      [&] { return shards_owned(a) == kShards / 2 && shards_owned(b) == kShards / 2; }, 15s));
  auto ca = connect(a.endpoint());
  auto cb = connect(b.endpoint());
  auto ec = etcd.client();
  cluster::Placement view(ec.get(), "test");
  size_t on_a = 0, on_b = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string agent = "robot-" + std::to_string(i);
    const std::string text = "The mug of " + agent + " is on the table.";
    auto w = keepctl({"--shards", std::to_string(kShards), "--json", "write", agent, text});
    REQUIRE_MESSAGE(w.exit_code == 0, w.err);
    CHECK(w.out.find("\"version\":1") != std::string::npos);
    auto l = keepctl({"--shards", std::to_string(kShards), "list", agent});
    REQUIRE_MESSAGE(l.exit_code == 0, l.err);
    CHECK(l.out.find(text) != std::string::npos);
    // On its owner, and only there (a client that does not follow moved asks each node).
    auto o = view.owner(cluster::shard_of(agent, kShards));
    REQUIRE(o.is_ok());
    REQUIRE(o->has_value());
    kc::ManagerClient& owner = (*o)->node == "a" ? *ca : *cb;
    kc::ManagerClient& other = (*o)->node == "a" ? *cb : *ca;
    ((*o)->node == "a" ? on_a : on_b) += 1;
    auto page = owner.list_memories(agent);
    REQUIRE(page.is_ok());
    REQUIRE(page->memories.size() == 1);
    CHECK(page->memories[0].text == text);
    // (The other node learns a shard's new owner at its next round: "no owner yet" until then.)
    Status elsewhere;
    CHECK(eventually(
        [&] {
          elsewhere = other.list_memories(agent).status();
          return elsewhere.code() == Code::kMoved;
        },
        5s));
    CHECK_MESSAGE(elsewhere.code() == Code::kMoved, elsewhere.to_string());
  }
  CHECK(on_a > 0);
  CHECK(on_b > 0);
  // Node-wide commands go to a live node; the default --shards (64) is not the managers' (8):
  // etcd names wrong owners for some agents, whose moved answers keepctl follows.
  auto ping = keepctl({"ping"});
  CHECK_MESSAGE(ping.exit_code == 0, ping.err);
  CHECK(ping.out.rfind("keep-manager", 0) == 0);
  for (int i = 0; i < 8; ++i) {
    const std::string agent = "robot-" + std::to_string(i);
    auto l = keepctl({"--json", "list", agent});
    REQUIRE_MESSAGE(l.exit_code == 0, l.err);
    CHECK(l.out.find("The mug of " + agent) != std::string::npos);
  }
}
