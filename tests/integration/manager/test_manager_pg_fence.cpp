// keep-manager in cluster mode when a node is cut off from etcd (issue 31, point 1): node a
// reaches etcd through a proxy this test cuts, so a cannot renew its lease, and b takes a's
// shards once the lease ran out.
//
// 1. a stops serving at its own lease deadline, before etcd frees the shards: once b serves an
//    agent, a answers for none of its old agents -- reads and writes alike, "lease may have run
//    out" -- and its /metrics say it owns and serves no shard. Back in touch with etcd, a takes
//    no shard b owns: it joins again, b hands it its share at new epochs, and it serves them
//    with every write b took meanwhile.
// 2. The fence: a write a accepted while it still held the shard, whose commit reached
//    PostgreSQL only after b took the shard over (a's connection to PostgreSQL goes through a
//    second proxy, holding the commit back), is refused by the log (a's epoch is stale): answered
//    not ok and visible nowhere -- not on b, not in the log.
//
// Real processes: PostgreSQL, a three-member etcd, two keep-manager. Skipped without etcd or
// PostgreSQL.
#include <doctest/doctest.h>

#include <algorithm>
#include <future>

#include "services/manager/store/record_codec.h"
#include "shared/cluster/etcd_directory.h"
#include "shared/cluster/placement.h"
#include "tests/integration/manager/cluster_pg_helpers.h"

using namespace keep;
using namespace std::chrono_literals;
namespace it = keep::itest;
namespace kc = keep::client;

namespace {

constexpr uint32_t kShards = 4;
using Clock = std::chrono::steady_clock;

Status write(kc::ManagerClient& c, const std::string& agent, const std::string& text) {
  kc::WriteArgs a;
  a.agent = agent;
  a.text = text;
  return c.write(a).status();
}

// The texts of the agent's write records in the log, in seq order, with their epochs.
std::vector<std::pair<std::string, uint64_t>> logged_writes(cluster::PgLog& log,
                                                            const std::string& agent) {
  auto rows = log.read(agent);
  REQUIRE(rows.is_ok());
  std::vector<std::pair<std::string, uint64_t>> out;
  for (const auto& r : *rows) {
    auto rec = manager::decode_record(r.record);
    REQUIRE(rec.is_ok());
    if (auto* q = std::get_if<manager::RequestedRecord>(&*rec)) {  // sent with a request id
      rec = manager::decode_record(q->inner);
      REQUIRE(rec.is_ok());
    }
    if (auto* w = std::get_if<manager::WriteRecord>(&*rec)) out.emplace_back(w->text, r.epoch);
  }
  return out;
}

// Two agents of node `node`'s shards, in two different shards, with the epochs they are held at.
struct Owned {
  std::string agent, other;
  uint64_t epoch = 0;
};
Owned agents_of(it::EtcdCluster& etcd, const std::string& node) {
  auto ec = etcd.client();
  cluster::Placement view(ec.get(), "test");
  Owned out;
  for (int i = 0; i < 200 && out.other.empty(); ++i) {
    const std::string name = "robot-" + std::to_string(i);
    auto o = view.owner(cluster::shard_of(name, kShards));
    REQUIRE(o.is_ok());
    REQUIRE(o->has_value());
    if ((*o)->node != node) continue;
    if (out.agent.empty()) {
      out.agent = name;
      out.epoch = (*o)->epoch;
    } else if (cluster::shard_of(name, kShards) != cluster::shard_of(out.agent, kShards)) {
      out.other = name;
    }
  }
  REQUIRE_FALSE(out.other.empty());
  return out;
}

bool lapsed(const Status& st) {
  return st.code() == Code::kUnavailable &&
         st.message().find("lease may have run out") != std::string::npos;
}

int etcd_port(const it::EtcdCluster& etcd) {
  return std::stoi(etcd.clients[0].substr(etcd.clients[0].rfind(':') + 1));
}

}  // namespace

TEST_CASE(
    "a node cut off from etcd serves none of its agents past its lease, and comes back "
    "only to shards nobody else owns" *
    doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  it::PgServer pg;
  auto log = pg.log();
  it::EtcdCluster etcd;
  etcd.wait_ready();
  it::TcpProxy proxy(etcd_port(etcd));
  it::TempDir tmp("pgfence");
  it::ManagerProcess a({(tmp.path() / "a").string(), it::unique_name("pfa"),
                        it::pg_cluster_flags(proxy.url(), "a", kShards, pg)});
  it::ManagerProcess b({(tmp.path() / "b").string(), it::unique_name("pfb"),
                        it::pg_cluster_flags(it::join_urls(etcd.clients), "b", kShards, pg)});
  it::require_split(a, b, kShards);
  const Owned on_a = agents_of(etcd, "a");
  auto ca = it::manager_client(a.endpoint(), 5s);
  auto cb = it::manager_client(b.endpoint(), 5s);
  REQUIRE(write(*ca, on_a.agent, "before the cut").is_ok());
  REQUIRE(write(*ca, on_a.other, "before the cut").is_ok());
  // A client with the etcd directory, which learns that a serves the agent.
  kc::ClientOptions co;
  co.endpoint = a.endpoint();
  co.timeout = 5s;
  auto dir = cluster::EtcdDirectory::create(etcd.clients, kShards);
  REQUIRE(dir.is_ok());
  co.directory = *dir;
  auto routed = kc::ManagerClient::connect(co);
  REQUIRE(routed.is_ok());
  REQUIRE((*routed)->list_memories(on_a.agent).is_ok());

  // a is cut off: its rounds fail, its lease runs out (2 s), b takes every shard. Polled in turn
  // until b serves the agent: once it does, a must answer for none of them.
  proxy.cut();
  const auto cut_at = Clock::now();
  std::optional<Clock::time_point> a_stopped, b_served;
  int a_served_after_b = 0;
  while (Clock::now() - cut_at < 20s) {
    const bool a_serves = ca->list_memories(on_a.agent).is_ok();
    if (!a_serves && !a_stopped) a_stopped = Clock::now();
    if (a_serves && b_served) ++a_served_after_b;
    if (!b_served && cb->list_memories(on_a.agent).is_ok()) b_served = Clock::now();
    if (b_served && Clock::now() - *b_served > 500ms) break;
    std::this_thread::sleep_for(20ms);
  }
  REQUIRE_MESSAGE(b_served.has_value(), b.err());
  REQUIRE(a_stopped.has_value());
  CHECK(a_served_after_b == 0);
  CHECK(*a_stopped <= *b_served);
  const auto ms = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(t - cut_at).count();
  };
  MESSAGE("after the cut: a stopped serving at " << ms(*a_stopped) << " ms, b served at "
                                                 << ms(*b_served) << " ms");
  CHECK(*a_stopped - cut_at < 2s);  // the lease, less the margin, from a renewal before the cut

  // a serves none of its old agents, reads or writes, and says so; nothing was applied.
  for (const std::string& agent : {on_a.agent, on_a.other}) {
    const Status read = ca->list_memories(agent).status();
    CHECK_MESSAGE(lapsed(read), read.to_string());
    const Status refused = write(*ca, agent, "after the cut, at a");
    CHECK_MESSAGE(lapsed(refused), refused.to_string());
  }
  CHECK(it::metric(a, "keep_manager_cluster_shards_owned") == 0);
  CHECK(it::metric(a, "keep_manager_cluster_shards_ready") == 0);
  REQUIRE_MESSAGE(
      it::eventually([&] { return it::metric(b, "keep_manager_cluster_shards_ready") == kShards; },
                     20s),
      b.err());
  auto on_b = it::all_texts(*cb, on_a.agent);
  REQUIRE(on_b.is_ok());
  CHECK(*on_b == std::vector<std::string>{"before the cut"});  // replayed from the log
  // The client that remembered a is answered "lease may have run out" there, and routes the
  // call anew: the directory names b.
  on_b = it::all_texts(**routed, on_a.agent);
  REQUIRE_MESSAGE(on_b.is_ok(), on_b.status().to_string());
  CHECK(*on_b == std::vector<std::string>{"before the cut"});
  REQUIRE(write(*cb, on_a.agent, "after the cut, at b").is_ok());

  // Back in touch: a's lease is gone, so it joins again; b hands it its share back (one shard a
  // round), which a takes at new epochs and replays. Until then a serves nothing b owns.
  proxy.restore();
  it::require_split(a, b, kShards);
  auto follow = it::manager_client(b.endpoint(), 5s, /*follow=*/true);
  auto texts = it::all_texts(*follow, on_a.agent);
  REQUIRE(texts.is_ok());
  CHECK(*texts == std::vector<std::string>{"before the cut", "after the cut, at b"});
  {
    auto ec = etcd.client();
    cluster::Placement view(ec.get(), "test");
    for (uint32_t s = 0; s < kShards; ++s) {
      auto o = view.owner(s);
      REQUIRE(o.is_ok());
      REQUIRE(o->has_value());
      if ((*o)->node == "a") CHECK((*o)->epoch > on_a.epoch);  // taken again, not resumed
    }
  }
  const auto logged = logged_writes(*log, on_a.agent);
  REQUIRE(logged.size() == 2);
  CHECK(logged[0].second == on_a.epoch);
  CHECK(logged[1].second > on_a.epoch);
}

TEST_CASE(
    "a write a node accepted before its lease ran out, committed after another node took "
    "the shard, is refused by the fence and visible nowhere" *
    doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  it::PgServer pg;
  auto log = pg.log();
  it::EtcdCluster etcd;
  etcd.wait_ready();
  it::TcpProxy proxy(etcd_port(etcd));
  it::TcpProxy pg_proxy(pg.port);  // a's way to PostgreSQL
  it::TempDir tmp("pgfence");
  it::ManagerProcess a(
      {(tmp.path() / "a").string(), it::unique_name("pfa"),
       it::pg_cluster_flags(proxy.url(), "a", kShards,
                            "host=127.0.0.1 port=" + std::to_string(pg_proxy.port()) +
                                " user=postgres dbname=postgres connect_timeout=5")});
  it::ManagerProcess b({(tmp.path() / "b").string(), it::unique_name("pfb"),
                        it::pg_cluster_flags(it::join_urls(etcd.clients), "b", kShards, pg)});
  it::require_split(a, b, kShards);
  const Owned on_a = agents_of(etcd, "a");
  auto ca = it::manager_client(a.endpoint(), 5s);
  auto cb = it::manager_client(b.endpoint(), 5s);
  REQUIRE(write(*ca, on_a.agent, "before the cut").is_ok());

  // The write is accepted while a holds the shard, and its commit waits in the proxy; a's
  // request thread waits with it (nothing else of a is asked until it answers).
  pg_proxy.hold();
  auto in_flight = std::async(std::launch::async, [&] {
    auto c = it::manager_client(a.endpoint(), 30s);
    return write(*c, on_a.agent, "in flight at the cut");
  });
  REQUIRE_MESSAGE(it::eventually([&] { return pg_proxy.held_bytes() > 0; }, 5s), a.err());
  // a is cut off from etcd; b takes the shard at a larger epoch and fences it.
  proxy.cut();
  REQUIRE_MESSAGE(
      it::eventually([&] { return it::metric(b, "keep_manager_cluster_shards_ready") == kShards; },
                     20s),
      b.err());
  auto on_b = it::all_texts(*cb, on_a.agent);
  REQUIRE(on_b.is_ok());
  CHECK(*on_b == std::vector<std::string>{"before the cut"});

  // The commit reaches PostgreSQL at a's stale epoch: refused, answered not ok.
  pg_proxy.release();
  REQUIRE(in_flight.wait_for(20s) == std::future_status::ready);
  const Status refused = in_flight.get();
  CHECK(refused.code() == Code::kUnavailable);
  CHECK_MESSAGE(refused.message().find("stale") != std::string::npos, refused.to_string());
  CHECK(it::metric(a, "keep_manager_cluster_log_refused_total{reason=\"stale\"}") == 1);
  CHECK(it::metric(a, "keep_manager_cluster_shards_owned") == 0);
  CHECK_FALSE(write(*ca, on_a.agent, "again at a").is_ok());
  CHECK_FALSE(ca->list_memories(on_a.agent).is_ok());

  // Visible nowhere: not on b, not in the log. b serves the agent and takes writes.
  on_b = it::all_texts(*cb, on_a.agent);
  REQUIRE(on_b.is_ok());
  CHECK(*on_b == std::vector<std::string>{"before the cut"});
  REQUIRE(write(*cb, on_a.agent, "after the cut, at b").is_ok());
  on_b = it::all_texts(*cb, on_a.agent);
  REQUIRE(on_b.is_ok());
  CHECK(*on_b == std::vector<std::string>{"before the cut", "after the cut, at b"});
  const auto logged = logged_writes(*log, on_a.agent);
  REQUIRE(logged.size() == 2);
  CHECK(logged[0].first == "before the cut");
  CHECK(logged[0].second == on_a.epoch);
  CHECK(logged[1].first == "after the cut, at b");
  CHECK(logged[1].second > on_a.epoch);
}
