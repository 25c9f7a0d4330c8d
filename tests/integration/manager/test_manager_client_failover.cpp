// ManagerClient in cluster mode (docs/cluster.md, "Clients"): real keep-manager processes on a
// real three-member etcd (and PostgreSQL for the memories). A client that is not recreated goes on
// reaching an agent after kill -9 of the node it learnt from `moved`: it forgets the silent owner,
// asks its configured endpoint (or etcd) again and reaches the node that took the shard over,
// within the lease plus a margin this test asserts (and prints). A write whose answer died with
// the node is sent again there with its request id: every write is acknowledged, and is there
// exactly once. A write committed by a node that died before its answer reached the client is
// answered by the new owner from the log it replayed, not applied twice -- also when the node
// had checkpointed the agent (compaction) after that write, so that the log no longer holds it
// and the new owner knows its request id only from the checkpoint. With an etcd directory
// the client sends every agent's calls to its owner at once: no `moved` answer at all (and, as a
// control, a client without one does receive some; one whose directory is stale still reaches
// every agent by following them). Skipped without etcd (and PostgreSQL for the first cases).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <thread>

#include "shared/cluster/etcd_directory.h"
#include "shared/cluster/placement.h"
#include "tests/integration/manager/cluster_pg_helpers.h"

using namespace keep;
using namespace std::chrono_literals;
namespace it = keep::itest;
namespace kc = keep::client;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint32_t kShards = 8;
constexpr int kAgents = 16;
// The lease is 2 s (pg_cluster_flags); the survivor takes the shards a round (half a second)
// after it ran out and replays their logs. The margin is for a loaded 2-core machine.
constexpr auto kReachBound = 2s + 8s;

std::unique_ptr<kc::ManagerClient> routed_client(const std::string& endpoint,
                                                 std::shared_ptr<kc::OwnerDirectory> directory) {
  kc::ClientOptions o;
  o.endpoint = endpoint;
  o.timeout = 1000ms;
  o.directory = std::move(directory);
  auto c = kc::ManagerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

std::shared_ptr<cluster::EtcdDirectory> etcd_directory(const std::vector<std::string>& urls,
                                                       uint32_t shards) {
  auto d = cluster::EtcdDirectory::create(urls, shards);
  REQUIRE(d.is_ok());
  return std::move(d).value();
}

std::vector<std::string> agent_names() {
  std::vector<std::string> agents;
  for (int i = 0; i < kAgents; ++i) agents.push_back("robot-" + std::to_string(i));
  return agents;
}

// What one writer saw: per text, what its write was answered (every write is acknowledged: the
// other sets must stay empty).
struct Outcomes {
  std::set<std::string> acked, unknown, refused;
  std::map<std::string, Clock::time_point> first_ok_after_kill;  // agent of a -> first ok write
  std::vector<std::string> errors;                               // any other answer
};

}  // namespace

TEST_CASE("a client that is not recreated reaches its agents again after kill -9 of their node" *
          doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  it::PgServer pg;
  (void)pg.log();  // accepting connections, tables created
  it::EtcdCluster etcd;
  etcd.wait_ready();
  const std::string urls = it::join_urls(etcd.clients);
  it::TempDir tmp("clfail");
  it::ManagerProcess b({(tmp.path() / "b").string(), it::unique_name("cfb"),
                        it::pg_cluster_flags(urls, "b", kShards, pg)});
  it::ManagerProcess a({(tmp.path() / "a").string(), it::unique_name("cfa"),
                        it::pg_cluster_flags(urls, "a", kShards, pg)});
  it::require_split(a, b, kShards);

  const std::vector<std::string> agents = agent_names();
  std::set<std::string> on_a;  // the agents whose node is killed
  {
    auto ec = etcd.client();
    cluster::Placement view(ec.get(), "test");
    for (const auto& agent : agents) {
      auto o = view.owner(cluster::shard_of(agent, kShards));
      REQUIRE(o.is_ok());
      REQUIRE(o->has_value());
      if ((*o)->node == "a") on_a.insert(agent);
    }
  }
  REQUIRE_FALSE(on_a.empty());

  // Two writers, each with one client for the whole test, both configured with b's endpoint:
  // writer 0 learns a's agents from `moved`, writer 1 from etcd.
  const std::string b_ep = b.endpoint();
  std::atomic<bool> a_dead{false}, stop{false};
  std::vector<Outcomes> outcomes(2);
  std::atomic<size_t> reached[2] = {0, 0};  // agents of a written again since the kill
  std::vector<std::unique_ptr<kc::ManagerClient>> clients;
  clients.push_back(routed_client(b_ep, nullptr));
  clients.push_back(routed_client(b_ep, etcd_directory(etcd.clients, kShards)));
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w) {
    writers.emplace_back([&, w] {
      Outcomes& out = outcomes[static_cast<size_t>(w)];
      it::write_rounds(
          *clients[static_cast<size_t>(w)], w, agents, stop, a_dead, 0ms,
          [&](const std::string& agent, const std::string& text, const Status& st,
              bool after_kill) {
            if (st.is_ok()) {
              out.acked.insert(text);
              if (after_kill && on_a.count(agent) &&
                  out.first_ok_after_kill.emplace(agent, Clock::now()).second) {
                reached[w] += 1;
              }
            } else if (st.code() == Code::kTimeout || st.code() == Code::kUnavailable) {
              // The client gave up (failover_wait) on a write it may or may not
              // have applied.
              out.unknown.insert(text + ": " + st.to_string());
            } else if (st.code() == Code::kMoved) {
              out.refused.insert(text);  // routed away: nothing applied
            } else {
              out.errors.push_back(agent + ": " + st.to_string());
            }
          });
    });
  }

  // A reader that knows where one of a's agents lives: after the kill its read is sent again
  // within the call, through b, once b took the shard over.
  auto reader = routed_client(b_ep, nullptr);
  const std::string probe = *on_a.begin();
  // The agent exists once a writer's first write to it landed: until then the read is
  // (rightly) "not found". Any other answer fails the test.
  Status first_read;
  REQUIRE(it::eventually(
      [&] {
        first_read = reader->list_memories(probe, 0, 1).status();
        return first_read.code() != Code::kNotFound;
      },
      5s));
  REQUIRE_MESSAGE(first_read.is_ok(), first_read.to_string());

  std::this_thread::sleep_for(1500ms);  // writes flow to both nodes
  a.kill9();
  const Clock::time_point killed_at = Clock::now();
  a_dead.store(true);
  int read_calls = 0;
  double read_s = -1;
  while (read_s < 0 && Clock::now() - killed_at < kReachBound) {
    ++read_calls;
    if (reader->list_memories(probe, 0, 1).is_ok()) {
      read_s = std::chrono::duration<double>(Clock::now() - killed_at).count();
    }
  }
  MESSAGE("a read of " << probe << " right after the kill was answered after " << read_s
                       << " s, in " << read_calls << " call(s) of the same client");
  CHECK(read_s >= 0);
  it::eventually([&] { return reached[0] == on_a.size() && reached[1] == on_a.size(); },
                 kReachBound + 2s);
  std::this_thread::sleep_for(500ms);  // a few more writes on the survivor
  stop.store(true);
  for (auto& t : writers) t.join();
  for (const Outcomes& o : outcomes) {
    CHECK_MESSAGE(o.errors.empty(), (o.errors.empty() ? "" : o.errors.front()));
    // Every write was acknowledged: the one in flight when its node died too, resent.
    CHECK_MESSAGE(o.unknown.empty(), (o.unknown.empty() ? "" : *o.unknown.begin()));
    CHECK(o.refused.empty());
  }

  // Every agent of the dead node was written again through the same clients, within the bound.
  for (int w = 0; w < 2; ++w) {
    const Outcomes& o = outcomes[static_cast<size_t>(w)];
    double last = 0;
    for (const auto& agent : on_a) {
      auto f = o.first_ok_after_kill.find(agent);
      REQUIRE_MESSAGE(f != o.first_ok_after_kill.end(), "writer " << w << " never reached " << agent
                                                                  << " again; b's log:\n"
                                                                  << b.err());
      last = std::max(last, std::chrono::duration<double>(f->second - killed_at).count());
    }
    const std::string how = w == 1 ? "writer 1 (etcd directory)" : "writer 0 (moved only)";
    MESSAGE(how << ": the " << on_a.size()
                << " agents of the killed node were written again within " << last
                << " s of the kill (lease 2 s); " << o.acked.size() << " writes acknowledged, "
                << clients[static_cast<size_t>(w)]->mutations_resent()
                << " of them resent after their answer was lost, "
                << clients[static_cast<size_t>(w)]->moved_answers() << " moved answers");
    CHECK(last < std::chrono::duration<double>(kReachBound).count());
  }
  CHECK(clients[0]->moved_answers() > 0);  // writer 0 found a's agents by `moved`

  // The writes in flight at the kill lost their answer and were sent again.
  CHECK(clients[0]->mutations_resent() + clients[1]->mutations_resent() > 0);
  // Every acknowledged memory is on the survivor exactly once, and nothing else. Read through
  // writer 0's client, still the one made before the kill.
  CHECK(it::metric(b, "keep_manager_cluster_shards_ready") == kShards);
  std::map<std::string, int> seen;
  for (const auto& agent : agents) {
    auto texts = it::all_texts(*clients[0], agent);
    REQUIRE_MESSAGE(texts.is_ok(), agent << ": " << texts.status().to_string());
    for (const auto& t : *texts) seen[t] += 1;
  }
  size_t acked = 0;
  for (const Outcomes& o : outcomes) {
    for (const auto& t : o.acked) {
      CHECK_MESSAGE(seen[t] == 1, "acknowledged '" << t << "' is there " << seen[t] << " times");
    }
    acked += o.acked.size();
  }
  size_t listed = 0;
  for (const auto& [t, n] : seen) listed += static_cast<size_t>(n);
  MESSAGE(listed << " memories on the survivor, " << acked << " writes acknowledged; "
                 << it::metric(b, "keep_manager_mutations_deduplicated_total")
                 << " resends answered from the log the survivor replayed");
  CHECK(acked > 50);
  CHECK(listed == acked);
}

namespace {

// A write whose answer is lost for certain, committed by its node before it dies: the log's table
// is locked (`LOCK TABLE keep_log IN SHARE MODE` for 2.5 s) while the client writes to one of a's
// agents, so a applies the write and waits in its commit past the client's timeout (1 s); the
// client gives a up and asks b, which sends it back to a (still holding the shard), which it
// leaves alone for 5 s. The lock goes, the commit lands -- the answer goes to a socket the client
// closed -- and a is killed -9 before anything else. The client's one call must return the write's
// id, answered by b from what it took over, and the write must be there once.
//
// compact_after 0: a keeps its default (--pg-compact-after 1000): b replays the write from the
// log. Else a runs with --pg-compact-after compact_after and the lost write is the agent's entry
// compact_after + 1, so a checkpoints the agent right after committing it, and the log keeps
// nothing of the agent: a is killed once the checkpoint is written, and b knows the write's
// request id only from the checkpoint it loads.
void lost_answer_is_answered_by_the_new_owner(uint64_t compact_after) {
  it::PgServer pg;
  (void)pg.log();
  it::EtcdCluster etcd;
  etcd.wait_ready();
  const std::string urls = it::join_urls(etcd.clients);
  it::TempDir tmp("cllost");
  const auto flags = [&](const std::string& node) {
    auto f = it::pg_cluster_flags(urls, node, kShards, pg);
    if (compact_after != 0)
      f.insert(f.end(), {"--pg-compact-after", std::to_string(compact_after)});
    return f;
  };
  it::ManagerProcess b({(tmp.path() / "b").string(), it::unique_name("clb"), flags("b")});
  it::ManagerProcess a({(tmp.path() / "a").string(), it::unique_name("cla"), flags("a")});
  it::require_split(a, b, kShards);
  std::string agent;  // one of a's agents
  {
    auto ec = etcd.client();
    cluster::Placement view(ec.get(), "test");
    for (const auto& name : agent_names()) {
      auto o = view.owner(cluster::shard_of(name, kShards));
      REQUIRE(o.is_ok());
      REQUIRE(o->has_value());
      if ((*o)->node == "a") agent = name;
    }
  }
  REQUIRE_FALSE(agent.empty());
  auto c = routed_client(b.endpoint(), nullptr);  // learns a's agent by `moved`
  // The writes acknowledged before the lost one: as many as a checkpoints after, so that the lost
  // one is the first entry past them.
  const uint64_t before = compact_after != 0 ? compact_after : 1;
  for (uint64_t i = 0; i < before; ++i) {
    kc::WriteArgs w{agent, std::nullopt,
                    "The mug of " + agent + " is on shelf " + std::to_string(i),
                    kc::SegmentKind::kObjectState, std::nullopt};
    REQUIRE(c->write(w).is_ok());
  }
  const auto in_log = [&] {
    return pg.query("SELECT count(*) FROM keep_log WHERE agent = '" + agent + "'");
  };
  const auto checkpointed_at = [&] {
    return pg.query("SELECT seq FROM keep_checkpoint WHERE agent = '" + agent + "'");
  };

  std::thread locker([&] {
    (void)pg.query("BEGIN; LOCK TABLE keep_log IN SHARE MODE; SELECT pg_sleep(2.5); COMMIT;");
  });
  REQUIRE(it::eventually(
      [&] {
        return pg.query(
                   "SELECT count(*) FROM pg_locks l JOIN pg_class c ON l.relation = c.oid "
                   "WHERE c.relname = 'keep_log' AND l.mode = 'ShareLock' AND l.granted") == "1";
      },
      10s));
  kc::WriteArgs lost{agent, std::nullopt, "The cup of " + agent + " is in the sink.",
                     kc::SegmentKind::kObjectState, std::nullopt};
  Result<kc::WriteResult> answer = Status(Code::kInternal, "not answered");
  std::thread writer([&] { answer = c->write(lost); });
  locker.join();
  const std::string committed = std::to_string(before + 1);
  if (compact_after == 0) {
    REQUIRE(it::eventually([&] { return in_log() == committed; }, 10s));
  } else {  // committed, then checkpointed: the log's entries of the agent deleted behind it
    REQUIRE_MESSAGE(
        it::eventually([&] { return checkpointed_at() == committed && in_log() == "0"; }, 10s),
        "no checkpoint at " << committed << "; a's log:\n"
                            << a.err());
  }
  a.kill9();
  writer.join();
  REQUIRE_MESSAGE(answer.is_ok(), answer.status().to_string() << "\nb's log:\n" << b.err());
  CHECK(c->mutations_resent() == 1);
  // b took the shard over and answered the resend from what it took over, without applying it.
  CHECK(it::metric(b, "keep_manager_mutations_deduplicated_total") == 1);
  auto page = c->list_memories(agent);
  REQUIRE(page.is_ok());
  REQUIRE(page->memories.size() == before + 1);
  CHECK(page->memories.back().text == lost.text);
  CHECK(page->memories.back().id == answer->id);
  if (compact_after == 0) {
    CHECK(in_log() == committed);
  } else {
    // b started the agent from the checkpoint, with nothing to replay after it, and wrote nothing.
    CHECK(it::metric(b, "keep_manager_cluster_checkpoints_loaded_total") == 1);
    CHECK(it::metric(b, "keep_manager_cluster_replayed_entries_total") == 0);
    CHECK(checkpointed_at() == committed);
    CHECK(in_log() == "0");
  }
}

}  // namespace

TEST_CASE(
    "a write committed by a node that died before its answer arrived is answered by the new "
    "owner from the log it replayed, not applied twice" *
    doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  lost_answer_is_answered_by_the_new_owner(0);
}

TEST_CASE(
    "a write whose answer was lost and which a checkpoint then covered is answered by the new "
    "owner from the checkpoint, not applied twice" *
    doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  lost_answer_is_answered_by_the_new_owner(4);
}

TEST_CASE("with the etcd directory a client reaches every agent without a moved answer" *
          doctest::skip(!it::have_etcd())) {
  it::EtcdCluster etcd;
  etcd.wait_ready();
  const std::string urls = it::join_urls(etcd.clients);
  it::TempDir tmp("cldir");
  const auto flags = [&](const std::string& node) {
    return std::vector<std::string>{
        "--etcd",         urls, "--node-id", node, "--shards", std::to_string(kShards),
        "--etcd-lease-s", "2"};
  };
  it::ManagerProcess a({(tmp.path() / "a").string(), it::unique_name("cda"), flags("a")});
  it::ManagerProcess b({(tmp.path() / "b").string(), it::unique_name("cdb"), flags("b")});
  REQUIRE(it::eventually(
      [&] {
        return it::metric(a, "keep_manager_cluster_shards_owned") == kShards / 2 &&
               it::metric(b, "keep_manager_cluster_shards_owned") == kShards / 2;
      },
      20s));
  const std::vector<std::string> agents = agent_names();

  // Through a's endpoint, the owners read from etcd: every call goes to the right node.
  auto direct = routed_client(a.endpoint(), etcd_directory(etcd.clients, kShards));
  for (const auto& agent : agents) {
    kc::WriteArgs args;
    args.agent = agent;
    args.text = "The mug of " + agent + " is on the table.";
    REQUIRE_MESSAGE(direct->write(args).is_ok(), agent);
    auto texts = it::all_texts(*direct, agent);
    REQUIRE(texts.is_ok());
    CHECK(*texts == std::vector<std::string>{args.text});
  }
  CHECK(direct->moved_answers() == 0);

  // The control: without the directory, half the agents cost a moved answer each.
  auto plain = routed_client(a.endpoint(), nullptr);
  for (const auto& agent : agents) REQUIRE(it::all_texts(*plain, agent).is_ok());
  CHECK(plain->moved_answers() > 0);
  CHECK(plain->moved_answers() < agents.size());

  // A stale directory (the wrong shard count: wrong owners for some agents) still reaches every
  // agent: `moved` is followed.
  auto stale = routed_client(a.endpoint(), etcd_directory(etcd.clients, kShards - 3));
  for (const auto& agent : agents) {
    auto texts = it::all_texts(*stale, agent);
    REQUIRE_MESSAGE(texts.is_ok(), agent << ": " << texts.status().to_string());
    CHECK(texts->size() == 1);
  }
  CHECK(stale->moved_answers() > 0);
  MESSAGE("moved answers for " << agents.size() << " agents: " << direct->moved_answers()
                               << " with the etcd directory, " << plain->moved_answers()
                               << " without, " << stale->moved_answers() << " with a stale one");
}
