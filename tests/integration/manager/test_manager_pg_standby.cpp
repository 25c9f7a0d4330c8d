// keep-manager's memory log on a PostgreSQL primary with a synchronous standby (issue 31, points
// 2 and 5): a real primary and a streaming standby on loopback (a commit returns once the standby
// has flushed it), a real three-member etcd and two real keep-manager processes whose --pg lists
// both servers (libpq multi-host, target_session_attrs=read-write). Writers write memories for
// many agents through both nodes and record each answer. First one etcd member is killed: writes
// go on and no shard changes hands. Then the PostgreSQL primary is killed -9 and the standby
// promoted (what an operator or patroni does): the managers reconnect to the new primary, writes
// resume within a bound this test asserts (and prints), and every acknowledged memory is there
// exactly once, both on the managers and in keep_log on the new primary; nothing refused is there,
// a write whose answer was lost is there at most once. Skipped without etcd or PostgreSQL.
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
// From the primary's kill to the last agent's first acknowledged write after it: the kill, the
// promotion, the managers' reconnection and their takeovers of the shards they gave up. The
// figure on a loaded 2-core machine is a few seconds; 20 s leaves room.
constexpr auto kUnavailableBound = 20s;

struct Outcomes {
  std::set<std::string> acked, refused, unknown;
};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// shard -> "node epoch" of its owner, as etcd says.
std::map<uint32_t, std::string> owners(it::EtcdCluster& etcd) {
  auto ec = etcd.client();
  cluster::Placement view(ec.get(), "test");
  std::map<uint32_t, std::string> out;
  for (uint32_t s = 0; s < kShards; ++s) {
    auto o = view.owner(s);
    REQUIRE(o.is_ok());
    out[s] = o->has_value() ? (*o)->node + " " + std::to_string((*o)->epoch) : "-";
  }
  return out;
}

}  // namespace

TEST_CASE(
    "etcd member and PostgreSQL primary killed during writes: writes go on, then resume "
    "on the promoted standby, every acknowledged memory exactly once" *
    doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  it::SyncPgPair pg;
  it::PgServer& primary = pg.primary;
  it::PgServer& standby = pg.standby;
  CHECK(standby.query("SELECT pg_is_in_recovery()") == "t");
  const std::string conninfo = pg.conninfo();
  it::EtcdCluster etcd;
  etcd.wait_ready();
  const std::string urls = it::join_urls(etcd.clients);
  it::TempDir tmp("pgsb");
  it::ManagerProcess b({(tmp.path() / "b").string(), it::unique_name("sbb"),
                        it::pg_cluster_flags(urls, "b", kShards, conninfo)});
  it::ManagerProcess a({(tmp.path() / "a").string(), it::unique_name("sba"),
                        it::pg_cluster_flags(urls, "a", kShards, conninfo)});
  it::require_split(a, b, kShards);

  std::vector<std::string> agents;
  for (int i = 0; i < kAgents; ++i) agents.push_back("robot-" + std::to_string(i));
  const std::string a_ep = a.endpoint(), b_ep = b.endpoint();
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<std::pair<Clock::time_point, std::string>> acks;  // (when, agent), in order
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
          const std::string ep = where.count(agent) ? where[agent] : a_ep;
          kc::WriteArgs args;
          args.agent = agent;
          args.text = agent + " memory " + std::to_string(n) + " of writer " + std::to_string(w);
          const Status st = clients[ep]->write(args).status();
          if (st.is_ok()) {
            out.acked.insert(args.text);
            std::lock_guard<std::mutex> lock(mu);
            acks.emplace_back(Clock::now(), agent);
            continue;
          }
          if (!it::not_applied(st)) {
            out.unknown.insert(args.text);  // unconfirmed (the log unreachable) or no answer
            std::this_thread::sleep_for(20ms);
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
  // Agents with an acknowledged write at or after `t`; the first such ack of each.
  const auto first_acks_after = [&](Clock::time_point t) {
    std::map<std::string, Clock::time_point> first;
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [when, agent] : acks) {
      if (when >= t) first.emplace(agent, when);
    }
    return first;
  };
  // The longest time without any acknowledged write in [from, to]: (its start, its end).
  const auto longest_gap = [&](Clock::time_point from, Clock::time_point to) {
    std::lock_guard<std::mutex> lock(mu);
    Clock::time_point last = from;
    std::pair<Clock::time_point, Clock::time_point> gap{from, from};
    for (const auto& [when, agent] : acks) {
      if (when < from || when > to) continue;
      if (when - last > gap.second - gap.first) gap = {last, when};
      last = when;
    }
    if (to - last > gap.second - gap.first) gap = {last, to};
    return gap;
  };

  // 1. An etcd member dies (the first of the managers' lists, the one they talk to first): the
  // managers renew their leases through the other two, no shard changes hands, writes go on.
  std::this_thread::sleep_for(2000ms);
  const auto before = owners(etcd);
  const auto etcd_killed_at = Clock::now();
  etcd.kill(0);
  std::this_thread::sleep_for(3000ms);  // more than a lease (2 s)
  const auto etcd_window_end = Clock::now();
  {
    const auto back = first_acks_after(etcd_window_end - 1000ms);
    CHECK_MESSAGE(back.size() == agents.size(),
                  back.size() << " of " << agents.size() << " agents written in the last second");
    const auto [from, to] = longest_gap(etcd_killed_at, etcd_window_end);
    const double gap = seconds(to - from);
    MESSAGE("etcd member killed: the longest time without an acknowledged write was " << gap
                                                                                      << " s");
    CHECK(gap < 2.0);
  }
  CHECK(owners(etcd) == before);  // no lease ran out: the same owners at the same epochs
  CHECK(it::metric(a, "keep_manager_cluster_shards_ready") == kShards / 2);
  CHECK(it::metric(b, "keep_manager_cluster_shards_ready") == kShards / 2);

  // 2. The PostgreSQL primary dies; the standby is promoted (pg_ctl promote, as an operator
  // would, here a second after the kill); the managers find it through the multi-host conninfo.
  const auto pg_killed_at = Clock::now();
  primary.kill9();  // returns a second after the kill
  standby.promote();
  const auto promoted_at = Clock::now();
  CHECK(standby.query("SELECT pg_is_in_recovery()") == "f");
  // Every agent written after the promotion (so after the outage), within the bound.
  const bool all_back = it::eventually(
      [&] { return first_acks_after(promoted_at).size() == agents.size(); }, kUnavailableBound);
  std::this_thread::sleep_for(500ms);  // a few more writes on the new primary
  stop.store(true);
  for (auto& t : writers) t.join();
  REQUIRE_MESSAGE(all_back, "writes did not resume; a's log:\n"
                                << a.err() << "\nb's log:\n"
                                << b.err());
  // The outage: the longest time after the kill with no acknowledged write (a commit that raced
  // the kill may still be acknowledged just after it); then each agent's first write after it.
  const auto [down_from, down_to] = longest_gap(pg_killed_at, Clock::now());
  std::vector<double> back;
  for (const auto& [agent, when] : first_acks_after(down_to)) {
    back.push_back(seconds(when - pg_killed_at));
  }
  std::sort(back.begin(), back.end());
  const double promote_s = seconds(promoted_at - pg_killed_at);
  MESSAGE("PostgreSQL primary killed -9, standby promoted "
          << promote_s << " s after the kill: "
          << "no write acknowledged for " << seconds(down_to - down_from)
          << " s; every agent written again " << back.back() << " s after the kill ("
          << back.back() - promote_s << " s after the promotion)");
  CHECK(back.size() == agents.size());
  CHECK(back.back() < seconds(kUnavailableBound));
  REQUIRE(it::eventually(
      [&] {
        return it::metric(a, "keep_manager_cluster_shards_ready") +
                   it::metric(b, "keep_manager_cluster_shards_ready") ==
               kShards;
      },
      10s));

  // Every agent, through either node (moved followed): acknowledged memories once each, refused
  // ones absent, lost answers at most once, nothing else; keep_log on the new primary the same.
  auto follower = it::manager_client(b_ep, 10s, /*follow=*/true);
  auto log = standby.log();
  std::map<std::string, int> seen;
  std::map<std::string, std::string> records_of;  // agent -> its log's records, concatenated
  size_t logged = 0, listed = 0;
  for (const auto& agent : agents) {
    auto texts = it::all_texts(*follower, agent);
    REQUIRE_MESSAGE(texts.is_ok(), agent << ": " << texts.status().to_string());
    for (const auto& t : *texts) seen[t] += 1;
    listed += texts->size();
    auto rows = log->read(agent);
    REQUIRE_MESSAGE(rows.is_ok(), rows.status().to_string());
    for (size_t i = 0; i < rows->size(); ++i) {
      CHECK((*rows)[i].seq == i + 1);  // the log has no hole
      records_of[agent] += (*rows)[i].record + '\n';
    }
    logged += rows->size();
    CHECK_MESSAGE(rows->size() == texts->size(), agent << ": " << rows->size() << " log entries, "
                                                       << texts->size() << " memories");
  }
  const auto in_log = [&](const std::string& text) {
    const std::string agent = text.substr(0, text.find(' '));
    return it::occurrences(records_of[agent], text);
  };
  size_t acked = 0, refused = 0, unknown = 0, unknown_there = 0;
  for (const Outcomes& o : outcomes) {
    for (const auto& t : o.acked) {
      CHECK_MESSAGE(seen[t] == 1, "acknowledged '" << t << "' is there " << seen[t] << " times");
      CHECK_MESSAGE(in_log(t) == 1,
                    "acknowledged '" << t << "' is logged " << in_log(t) << " times");
    }
    for (const auto& t : o.refused) {
      CHECK_MESSAGE(seen[t] == 0, "refused '" << t << "' is there " << seen[t] << " times");
      CHECK(in_log(t) == 0);
    }
    for (const auto& t : o.unknown) {
      CHECK_MESSAGE(seen[t] <= 1, "'" << t << "' is there " << seen[t] << " times");
      CHECK(in_log(t) == static_cast<size_t>(seen[t]));
      unknown_there += seen[t] == 1 ? 1 : 0;
    }
    acked += o.acked.size();
    refused += o.refused.size();
    unknown += o.unknown.size();
  }
  for (const auto& [t, n] : seen) {
    if (n == 0) continue;
    const bool known = std::any_of(outcomes.begin(), outcomes.end(), [&](const Outcomes& o) {
      return o.acked.count(t) || o.unknown.count(t);
    });
    CHECK_MESSAGE(known, "'" << t << "' was never acknowledged");
  }
  MESSAGE(acked << " writes acknowledged, " << refused << " refused or routed away, " << unknown
                << " unconfirmed or unanswered (" << unknown_there << " of them applied); "
                << listed << " memories listed, " << logged << " entries in keep_log");
  CHECK(acked > 100);
  CHECK(listed == acked + unknown_there);
  CHECK(logged == listed);
}
