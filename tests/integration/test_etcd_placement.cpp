// Placement against a real three-member etcd cluster on loopback (issue 31, point 1): nodes join
// with leases, take shards with growing epochs, lose them when their lease runs out (another node
// takes over with a larger epoch, and the old owner sees it no longer holds its epoch), and the
// cluster goes on answering with one member killed. ShardKeeper cut off from etcd stops serving at
// its own lease deadline, before etcd frees its shards, and back in touch takes only free shards.
// Skipped (doctest skip) without etcd.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <csignal>
#include <thread>

#include "shared/cluster/etcd_client.h"
#include "shared/cluster/placement.h"
#include "shared/cluster/shard_keeper.h"
#include "tests/integration/etcd_cluster.h"
#include "tests/integration/tcp_proxy.h"

using namespace keep;
using namespace keep::cluster;
using namespace std::chrono_literals;
namespace it = keep::itest;

TEST_CASE("etcd client: put, get, prefix, transactions and leases against a real cluster" *
          doctest::skip(!it::have_etcd())) {
  it::EtcdCluster etcd;
  etcd.wait_ready();
  auto c = etcd.client();
  REQUIRE(c->put("/t/a", std::string("x\0y", 3)).is_ok());  // any bytes
  REQUIRE(c->put("/t/b", "2").is_ok());
  REQUIRE(c->put("/u/c", "3").is_ok());
  auto a = c->get("/t/a");
  REQUIRE(a.is_ok());
  REQUIRE(a->has_value());
  CHECK((*a)->value == std::string("x\0y", 3));
  CHECK((*a)->version == 1);
  auto none = c->get("/t/none");
  REQUIRE(none.is_ok());
  CHECK_FALSE(none->has_value());
  auto t = c->get_prefix("/t/");
  REQUIRE(t.is_ok());
  REQUIRE(t->size() == 2);
  CHECK((*t)[1].key == "/t/b");

  // Create-if-absent succeeds once; compare-and-swap on the value.
  auto r = c->txn({{"/t/new", Compare::Target::kCreateRevision, 0, {}}},
                  {{TxnOp::Kind::kPut, "/t/new", "first", 0}});
  REQUIRE(r.is_ok());
  CHECK(r->succeeded);
  r = c->txn({{"/t/new", Compare::Target::kCreateRevision, 0, {}}},
             {{TxnOp::Kind::kPut, "/t/new", "second", 0}});
  REQUIRE(r.is_ok());
  CHECK_FALSE(r->succeeded);
  CHECK((*c->get("/t/new"))->value == "first");
  r = c->txn({{"/t/new", Compare::Target::kValue, 0, "first"}},
             {{TxnOp::Kind::kDelete, "/t/new", {}, 0}});
  REQUIRE(r.is_ok());
  CHECK(r->succeeded);
  CHECK_FALSE(c->get("/t/new")->has_value());

  // A key on a lease goes with it.
  auto lease = c->grant_lease(5);
  REQUIRE(lease.is_ok());
  REQUIRE(c->put("/t/leased", "v", *lease).is_ok());
  CHECK((*c->get("/t/leased"))->lease == *lease);
  auto ttl = c->keep_alive(*lease);
  REQUIRE(ttl.is_ok());
  CHECK(*ttl > 0);
  REQUIRE(c->revoke(*lease).is_ok());
  CHECK_FALSE(c->get("/t/leased")->has_value());
  CHECK(c->keep_alive(*lease).status().code() == Code::kNotFound);

  // Nothing listening: kUnavailable, promptly.
  auto dead = etcd.client({"http://127.0.0.1:" + std::to_string(it::free_port())});
  CHECK(dead->get("/t/a").status().code() == Code::kUnavailable);
}

TEST_CASE("shards: one owner at a time, epochs grow, a lapsed owner loses its shards" *
          doctest::skip(!it::have_etcd())) {
  it::EtcdCluster etcd;
  etcd.wait_ready();
  auto ca = etcd.client();
  auto cb = etcd.client();
  Placement a(ca.get(), "node-a");
  Placement b(cb.get(), "node-b");
  CHECK(a.acquire(0).status().code() == Code::kUnavailable);  // not joined yet
  REQUIRE(a.join("tcp://10.0.0.1:7601", 2).is_ok());
  REQUIRE(b.join("tcp://10.0.0.2:7601", 30).is_ok());
  auto nodes = a.nodes();
  REQUIRE(nodes.is_ok());
  CHECK(nodes->size() == 2);

  auto ea = a.acquire(7);
  REQUIRE(ea.is_ok());
  REQUIRE(ea->has_value());
  CHECK(**ea == 1);
  auto eb = b.acquire(7);  // owned: b does not get it
  REQUIRE(eb.is_ok());
  CHECK_FALSE(eb->has_value());
  auto o = b.owner(7);
  REQUIRE(o.is_ok());
  REQUIRE(o->has_value());
  CHECK((*o)->node == "node-a");
  CHECK((*o)->epoch == 1);
  CHECK(*a.holds(7, 1));
  CHECK_FALSE(*b.holds(7, 1));

  // a gives it back; b takes it at epoch 2, and a's epoch 1 is no longer held.
  REQUIRE(a.release(7, 1).is_ok());
  eb = b.acquire(7);
  REQUIRE(eb.is_ok());
  REQUIRE(eb->has_value());
  CHECK(**eb == 2);
  CHECK_FALSE(*a.holds(7, 1));
  REQUIRE(b.release(7, 2).is_ok());

  // a owns shard 3, then stops renewing (a paused or cut-off node): its 2 s lease runs out, the
  // shard frees itself, b takes it at a larger epoch, and a learns it lost everything.
  ea = a.acquire(3);
  REQUIRE(ea.is_ok());
  REQUIRE(ea->has_value());
  const uint64_t old_epoch = **ea;
  bool taken = false;
  for (int i = 0; i < 100 && !taken; ++i) {  // up to 10 s (the TTL is at least 2 s)
    std::this_thread::sleep_for(100ms);
    REQUIRE(b.renew().is_ok());
    auto got = b.acquire(3);
    REQUIRE(got.is_ok());
    if (got->has_value()) {
      taken = true;
      CHECK(**got > old_epoch);
    }
  }
  CHECK(taken);
  CHECK_FALSE(*a.holds(3, old_epoch));
  CHECK(a.renew().code() == Code::kNotFound);
  nodes = b.nodes();
  REQUIRE(nodes.is_ok());
  REQUIRE(nodes->size() == 1);
  CHECK((*nodes)[0].first == "node-b");

  // leave() drops the node and its shards at once.
  REQUIRE(b.leave().is_ok());
  CHECK_FALSE(b.owner(3)->has_value());
}

TEST_CASE("with one of three members killed, placement goes on" * doctest::skip(!it::have_etcd())) {
  it::EtcdCluster etcd;
  etcd.wait_ready();
  auto c = etcd.client();
  Placement p(c.get(), "node-a");
  REQUIRE(p.join("tcp://10.0.0.1:7601", 30).is_ok());
  auto e = p.acquire(1);
  REQUIRE(e.is_ok());
  REQUIRE(e->has_value());
  // Kill the member this client talks to: the next calls go to the others (a new leader is
  // elected within the election timeout when the leader was the one killed).
  const std::string first = c->current_endpoint();
  etcd.kill(static_cast<int>(std::find(etcd.clients.begin(), etcd.clients.end(), first) -
                             etcd.clients.begin()));
  Status renewed = Status(Code::kUnavailable, "not yet");
  for (int i = 0; i < 50 && !renewed.is_ok(); ++i) {
    renewed = p.renew();
    if (!renewed.is_ok()) std::this_thread::sleep_for(100ms);
  }
  REQUIRE_MESSAGE(renewed.is_ok(), renewed.to_string());
  CHECK(c->current_endpoint() != first);
  CHECK(*p.holds(1, **e));
  auto e2 = p.acquire(2);
  REQUIRE(e2.is_ok());
  CHECK(e2->has_value());
}

TEST_CASE(
    "a keeper cut off from etcd stops serving at its lease deadline, before etcd frees its "
    "shards, and back in touch serves only shards nobody else owns" *
    doctest::skip(!it::have_etcd())) {
  using Clock = std::chrono::steady_clock;
  it::EtcdCluster etcd;
  etcd.wait_ready();
  it::TcpProxy proxy(std::stoi(etcd.clients[0].substr(etcd.clients[0].rfind(':') + 1)));
  ShardKeeperOptions ko;
  ko.shards = 4;
  ko.lease_ttl_s = 2;
  ko.period = 200ms;
  ko.worker_endpoint = "tcp://10.0.0.1:7602";
  EtcdOptions via_proxy{{proxy.url()}, 500ms};
  auto a = ShardKeeper::start(via_proxy, "a", "tcp://10.0.0.1:7601", ko);
  REQUIRE(a.is_ok());
  REQUIRE((*a)->owned() == 4);
  const std::map<uint32_t, uint64_t> before = (*a)->owned_shards();
  auto c = etcd.client();
  Placement view(c.get(), "test");
  auto workers = view.workers();
  REQUIRE(workers.is_ok());
  REQUIRE(workers->size() == 1);
  CHECK((*workers)[0] == std::pair<std::string, std::string>{"a", "tcp://10.0.0.1:7602"});

  // Cut off: a's rounds fail; it stops serving at its deadline (the last renewal's send time +
  // 2 s - 0.2 s), while etcd still has it as the owner (its lease ends 2 s after etcd renewed it).
  proxy.cut();
  const auto cut_at = Clock::now();
  while ((*a)->within_lease() && Clock::now() - cut_at < 5s) std::this_thread::sleep_for(5ms);
  const auto stopped = Clock::now() - cut_at;
  MESSAGE(
      "stopped serving " << std::chrono::duration_cast<std::chrono::milliseconds>(stopped).count()
                         << " ms after the cut");
  CHECK_FALSE((*a)->within_lease());
  CHECK(stopped < 2s);
  auto still = view.owner(0);
  REQUIRE(still.is_ok());
  REQUIRE(still->has_value());
  CHECK((*still)->node == "a");  // etcd has not freed it yet
  CHECK((*a)->owned() == 0);
  CHECK((*a)->owned_shards().empty());
  std::string agent;  // one of shard 0
  for (int i = 0; agent.empty(); ++i) {
    if (shard_of("robot-" + std::to_string(i), 4) == 0) agent = "robot-" + std::to_string(i);
  }
  CHECK((*a)->epoch_of(0) == 0);
  const Status refused = (*a)->route(agent);
  CHECK(refused.code() == Code::kUnavailable);
  CHECK_MESSAGE(refused.message().find("lease may have run out") != std::string::npos,
                refused.to_string());

  // etcd frees the shards; b takes them all at larger epochs.
  auto b = ShardKeeper::start({etcd.clients, 1000ms}, "b", "tcp://10.0.0.2:7601", ko);
  REQUIRE(b.is_ok());
  for (const auto t0 = Clock::now(); (*b)->owned() < 4 && Clock::now() - t0 < 10s;) {
    std::this_thread::sleep_for(20ms);
  }
  REQUIRE((*b)->owned() == 4);
  for (const auto& [s, e] : (*b)->owned_shards()) CHECK(e > before.at(s));

  // Back in touch: a's lease is gone. It must not serve what b owns: it joins again, b hands it
  // its share (a shard a round), which it takes at new epochs. Every shard a serves meanwhile is
  // its own in etcd, at the epoch it serves it at.
  proxy.restore();
  const auto back_at = Clock::now();
  size_t checked = 0;
  while (Clock::now() - back_at < 10s) {
    const auto served = (*a)->owned_shards();
    for (const auto& [s, e] : served) {
      auto o = view.owner(s);
      REQUIRE(o.is_ok());
      // Released by a since it read owned_shards() at most, never another node's.
      if (o->has_value()) {
        CHECK((*o)->node == "a");
        CHECK((*o)->epoch == e);
      }
      CHECK(e > before.at(s));
      ++checked;
    }
    if (served.size() == 2 && (*b)->owned() == 2) break;
    std::this_thread::sleep_for(20ms);
  }
  CHECK((*a)->owned() == 2);
  CHECK((*b)->owned() == 2);
  CHECK(checked > 0);
  CHECK((*a)->route(agent).code() != Code::kUnavailable);  // served by a or moved to b
}
