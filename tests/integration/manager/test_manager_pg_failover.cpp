// keep-manager's memories in PostgreSQL (issue 31, point 2), failing over: a real PostgreSQL, a
// real three-member etcd and two real keep-manager processes with --pg. Writers write memories
// for many agents through both nodes (following `moved` themselves) and record each answer; one
// node is killed -9 while they write. The other takes its shards over, replays their logs, and
// then every acknowledged memory of every agent is there exactly once, nothing refused is there,
// a write whose answer was lost is there at most once, and the moved agents take writes again
// within a bound this test asserts (and prints). Then the killed node comes back on its data
// directory: it gets its shards back, keeps what its local WAL holds of their agents and replays
// only what their logs gained since, and every memory is still there exactly once. Skipped without
// etcd or PostgreSQL. Compaction is on (--pg-compact-after 4): logs are truncated behind
// checkpoints before the kill, and the takeovers start from them.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <thread>

#include "shared/cluster/placement.h"
#include "tests/integration/manager/cluster_pg_helpers.h"

using namespace keep;
using namespace std::chrono_literals;
namespace it = keep::itest;
namespace kc = keep::client;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint32_t kShards = 8;
constexpr int kAgents = 40;
constexpr int kWriters = 4;
// The lease is 2 s: the survivor sees the dead node's shards free within it (plus a round of a
// quarter lease), fences them and replays their logs. 15 s leaves room for a loaded machine.
constexpr auto kFailoverBound = 15s;

// What one writer saw: per text, what its write was answered.
struct Outcomes {
  std::map<std::string, std::string> agent_of;  // text -> agent
  std::set<std::string> acked, refused, unknown;
};

}  // namespace

TEST_CASE("kill -9 of a node during writes: every acknowledged memory survives, exactly once" *
          doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  it::PgServer pg;
  (void)pg.log();  // accepting connections, tables created
  it::EtcdCluster etcd;
  etcd.wait_ready();
  const std::string urls = it::join_urls(etcd.clients);
  it::TempDir tmp("pgfail");
  // Compaction on, often: agents are checkpointed (their log truncated) before and after the
  // kill, so the takeover and a's return start from checkpoints.
  const auto flags = [&](const std::string& node) {
    auto f = it::pg_cluster_flags(urls, node, kShards, pg);
    f.insert(f.end(), {"--pg-compact-after", "4"});
    return f;
  };
  // b first: it takes every shard, then hands the last ones (4..7) to a, one a round; when a
  // comes back after its kill, b hands the same ones back, so a finds their agents in its WAL.
  it::ManagerProcess b({(tmp.path() / "b").string(), it::unique_name("pgb"), flags("b")});
  it::ManagerProcess a({(tmp.path() / "a").string(), it::unique_name("pga"), flags("a")});
  it::require_split(a, b, kShards);

  std::vector<std::string> agents;
  for (int i = 0; i < kAgents; ++i) agents.push_back("robot-" + std::to_string(i));
  const std::string a_ep = a.endpoint(), b_ep = b.endpoint();
  std::atomic<bool> a_dead{false}, stop{false};
  Clock::time_point killed_at{};
  std::mutex mu;
  std::map<std::string, Clock::time_point> first_ok_after_kill;  // agent -> first ok write
  std::vector<Outcomes> outcomes(kWriters);
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      std::map<std::string, std::unique_ptr<kc::ManagerClient>> clients;
      clients[a_ep] = it::manager_client(a_ep, 1500ms);
      clients[b_ep] = it::manager_client(b_ep, 1500ms);
      std::map<std::string, std::string> where;  // agent -> the endpoint that serves it
      Outcomes& out = outcomes[static_cast<size_t>(w)];
      for (int n = 0; !stop.load(); ++n) {
        for (size_t i = static_cast<size_t>(w); i < agents.size() && !stop.load(); i += kWriters) {
          const std::string& agent = agents[i];
          std::string ep = where.count(agent) ? where[agent] : a_ep;
          if (ep == a_ep && a_dead.load()) ep = b_ep;
          kc::WriteArgs args;
          args.agent = agent;
          args.text = agent + " memory " + std::to_string(n) + " of writer " + std::to_string(w);
          out.agent_of[args.text] = agent;
          const bool after_kill = a_dead.load();
          const Status st = clients[ep]->write(args).status();
          if (st.is_ok()) {
            out.acked.insert(args.text);
            if (after_kill) {
              std::lock_guard<std::mutex> lock(mu);
              first_ok_after_kill.emplace(agent, Clock::now());
            }
            continue;
          }
          if (!it::not_applied(st)) {
            out.unknown.insert(args.text);  // the answer was lost (timeout) or unconfirmed
            continue;
          }
          out.refused.insert(args.text);
          if (st.code() == Code::kMoved) {
            const std::string& m = st.message();
            where[agent] = m.substr(m.rfind(" at ") + 4);
          }
          std::this_thread::sleep_for(20ms);  // between owners: do not spin
        }
      }
    });
  }

  // Writes flow through both nodes; then a dies without leaving.
  std::this_thread::sleep_for(2500ms);
  std::set<std::string> moved;  // a's agents: they move to b
  size_t checkpoints = 0;       // a's and b's, before the kill
  {
    auto log = pg.log();
    for (uint32_t shard = 0; shard < kShards; ++shard) {
      auto cps = log->read_checkpoints(shard);
      REQUIRE(cps.is_ok());
      checkpoints += cps->size();
    }
  }
  MESSAGE(checkpoints << " agents checkpointed before the kill");
  CHECK(checkpoints > 0);
  {
    auto ec = etcd.client();
    cluster::Placement view(ec.get(), "test");
    for (const auto& agent : agents) {
      auto o = view.owner(cluster::shard_of(agent, kShards));
      REQUIRE(o.is_ok());
      REQUIRE(o->has_value());
      if ((*o)->node == "a") moved.insert(agent);
    }
  }
  REQUIRE_FALSE(moved.empty());
  a.kill9();
  killed_at = Clock::now();
  a_dead.store(true);
  const bool all_back = it::eventually(
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        return std::all_of(moved.begin(), moved.end(),
                           [&](const std::string& ag) { return first_ok_after_kill.count(ag); });
      },
      kFailoverBound + 5s);
  std::this_thread::sleep_for(500ms);  // a few more writes on the survivor
  stop.store(true);
  for (auto& t : writers) t.join();
  REQUIRE_MESSAGE(all_back, "moved agents did not take writes again; b's log:\n" << b.err());

  // The failover time: from the kill to the first acknowledged write of each moved agent.
  std::vector<double> back;
  for (const auto& agent : moved) {
    back.push_back(
        std::chrono::duration<double>(first_ok_after_kill.at(agent) - killed_at).count());
  }
  std::sort(back.begin(), back.end());
  MESSAGE("failover after kill -9 (lease 2 s): the "
          << back.size() << " moved agents took writes again after " << back.front()
          << " s (first) to " << back.back() << " s (last)");
  CHECK(back.back() < std::chrono::duration<double>(kFailoverBound).count());
  CHECK(it::metric(b, "keep_manager_cluster_shards_ready") == kShards);
  CHECK(it::metric(b, "keep_manager_cluster_replayed_entries_total") > 0);

  // Every agent on the survivor: acknowledged memories once each, refused ones absent, lost
  // answers at most once, nothing else.
  std::map<std::string, int> seen;
  auto cb = it::manager_client(b_ep, 10s);
  for (const auto& agent : agents) {
    auto texts = it::all_texts(*cb, agent);
    REQUIRE_MESSAGE(texts.is_ok(), agent << ": " << texts.status().to_string());
    for (const auto& t : *texts) seen[t] += 1;
  }
  size_t acked = 0, refused = 0, unknown = 0, unknown_there = 0;
  for (const Outcomes& o : outcomes) {
    for (const auto& t : o.acked) {
      CHECK_MESSAGE(seen[t] == 1, "acknowledged '" << t << "' is there " << seen[t] << " times");
    }
    for (const auto& t : o.refused) {
      CHECK_MESSAGE(seen[t] == 0, "refused '" << t << "' is there " << seen[t] << " times");
    }
    for (const auto& t : o.unknown) {
      CHECK_MESSAGE(seen[t] <= 1, "'" << t << "' is there " << seen[t] << " times");
      unknown_there += seen[t] == 1 ? 1 : 0;
    }
    acked += o.acked.size();
    refused += o.refused.size();
    unknown += o.unknown.size();
  }
  size_t listed = 0;
  for (const auto& [t, n] : seen) {
    if (n == 0) continue;  // looked up above, not listed
    listed += static_cast<size_t>(n);
    const bool known = std::any_of(outcomes.begin(), outcomes.end(), [&](const Outcomes& o) {
      return o.acked.count(t) || o.unknown.count(t);
    });
    CHECK_MESSAGE(known, "'" << t << "' was never acknowledged");
  }
  MESSAGE(acked << " writes acknowledged, " << refused << " refused or routed away, " << unknown
                << " without an answer (" << unknown_there << " of them applied); " << listed
                << " memories listed on the survivor");
  CHECK(acked > 100);
  CHECK(listed == acked + unknown_there);

  // a comes back on its data directory and takes its shards back from b.
  it::ManagerProcess a2({(tmp.path() / "a").string(), it::unique_name("pga2"), flags("a")});
  it::require_split(a2, b, kShards);
  // Every memory exactly as before, through either node (moved followed).
  auto follower = it::manager_client(b_ep, 10s, /*follow=*/true);
  std::map<std::string, int> again;
  size_t on_a2 = 0;  // memories of the agents a2 serves
  {
    auto ec = etcd.client();
    cluster::Placement view(ec.get(), "test");
    for (const auto& agent : agents) {
      auto texts = it::all_texts(*follower, agent);
      REQUIRE_MESSAGE(texts.is_ok(), agent << ": " << texts.status().to_string());
      for (const auto& t : *texts) again[t] += 1;
      auto o = view.owner(cluster::shard_of(agent, kShards));
      REQUIRE(o.is_ok());
      REQUIRE(o->has_value());
      if ((*o)->node == "a") on_a2 += texts->size();
    }
  }
  std::erase_if(seen, [](const auto& e) { return e.second == 0; });
  CHECK(again == seen);
  // a2 replayed less than its agents' logs hold: the rest came from its local WAL and checkpoints.
  const double replayed = it::metric(a2, "keep_manager_cluster_replayed_entries_total");
  MESSAGE("the restarted node serves "
          << on_a2 << " memories and replayed " << replayed
          << " log entries; the rest came from its local WAL and checkpoints");
  CHECK(on_a2 > 0);
  CHECK(replayed < static_cast<double>(on_a2));
}
