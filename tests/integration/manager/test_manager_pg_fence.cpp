// keep-manager's memories in PostgreSQL (issue 31, point 2), the fence: node a reaches etcd
// through a proxy this test cuts, so a goes on believing it owns its shards after its lease ran
// out and b took them over (b raised their fences in PostgreSQL to its larger epochs). A write
// sent to a is then refused by the log (a's epoch is stale), answered not ok, is visible nowhere
// -- not on b, not in the log, not on a, which stops serving that shard -- and b serves the agent
// with what was acknowledged before. Real processes: PostgreSQL, a three-member etcd, two
// keep-manager. Skipped without etcd or PostgreSQL.
#include <doctest/doctest.h>

#include <algorithm>

#include "services/manager/store/record_codec.h"
#include "shared/cluster/placement.h"
#include "tests/integration/manager/cluster_pg_helpers.h"

using namespace keep;
using namespace std::chrono_literals;
namespace it = keep::itest;
namespace kc = keep::client;

namespace {

constexpr uint32_t kShards = 4;

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

}  // namespace

TEST_CASE("a node with a stale epoch has its write refused by the log, and it is visible nowhere" *
          doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  it::PgServer pg;
  auto log = pg.log();
  it::EtcdCluster etcd;
  etcd.wait_ready();
  it::TcpProxy proxy(std::stoi(etcd.clients[0].substr(etcd.clients[0].rfind(':') + 1)));
  it::TempDir tmp("pgfence");
  it::ManagerProcess a({(tmp.path() / "a").string(), it::unique_name("pfa"),
                        it::pg_cluster_flags(proxy.url(), "a", kShards, pg)});
  it::ManagerProcess b({(tmp.path() / "b").string(), it::unique_name("pfb"),
                        it::pg_cluster_flags(it::join_urls(etcd.clients), "b", kShards, pg)});
  it::require_split(a, b, kShards);

  // An agent of one of a's shards, written through a.
  std::string agent;
  uint64_t a_epoch = 0;
  {
    auto ec = etcd.client();
    cluster::Placement view(ec.get(), "test");
    for (int i = 0; i < 100 && agent.empty(); ++i) {
      const std::string name = "robot-" + std::to_string(i);
      auto o = view.owner(cluster::shard_of(name, kShards));
      REQUIRE(o.is_ok());
      REQUIRE(o->has_value());
      if ((*o)->node == "a") {
        agent = name;
        a_epoch = (*o)->epoch;
      }
    }
  }
  REQUIRE_FALSE(agent.empty());
  auto ca = it::manager_client(a.endpoint(), 5s);
  auto cb = it::manager_client(b.endpoint(), 5s);
  REQUIRE(write(*ca, agent, "before the cut").is_ok());

  // a is cut off from etcd: its lease runs out, b takes every shard at a larger epoch and fences
  // them; a does not know (its rounds fail) and still routes the agent to itself.
  proxy.cut();
  REQUIRE_MESSAGE(
      it::eventually([&] { return it::metric(b, "keep_manager_cluster_shards_ready") == kShards; },
                     20s),
      b.err());
  auto on_b = it::all_texts(*cb, agent);
  REQUIRE(on_b.is_ok());
  CHECK(*on_b == std::vector<std::string>{"before the cut"});  // replayed from the log
  CHECK(it::metric(a, "keep_manager_cluster_shards_owned") == kShards / 2);  // a still believes

  // The write at a's stale epoch: refused by the fence, answered not ok.
  const Status refused = write(*ca, agent, "after the cut, at a");
  CHECK(refused.code() == Code::kUnavailable);
  CHECK_MESSAGE(refused.message().find("stale") != std::string::npos, refused.to_string());
  CHECK(it::metric(a, "keep_manager_cluster_log_refused_total{reason=\"stale\"}") == 1);
  // a stopped serving the shard: neither the write again nor a read.
  CHECK_FALSE(write(*ca, agent, "again at a").is_ok());
  CHECK_FALSE(ca->list_memories(agent).is_ok());

  // Visible nowhere: not on b, not in the log. b serves the agent and takes writes.
  on_b = it::all_texts(*cb, agent);
  REQUIRE(on_b.is_ok());
  CHECK(*on_b == std::vector<std::string>{"before the cut"});
  REQUIRE(write(*cb, agent, "after the cut, at b").is_ok());
  on_b = it::all_texts(*cb, agent);
  REQUIRE(on_b.is_ok());
  CHECK(*on_b == std::vector<std::string>{"before the cut", "after the cut, at b"});
  const auto logged = logged_writes(*log, agent);
  REQUIRE(logged.size() == 2);
  CHECK(logged[0].first == "before the cut");
  CHECK(logged[0].second == a_epoch);
  CHECK(logged[1].first == "after the cut, at b");
  CHECK(logged[1].second > a_epoch);
}
