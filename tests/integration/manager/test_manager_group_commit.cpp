// Group commit in cluster mode (issue 31, point 2: "the manager acknowledges a write only after
// its commit (group commit keeps throughput)"): a real keep-manager on a real three-member etcd
// with its log on a PostgreSQL primary whose commits wait for a synchronous standby, as deployed.
// One writer alone first: each of its writes is a transaction of its own (the control). Then many
// writers write at once, each through its own client, every write waiting for its answer: the
// manager hands the requests that arrived while it committed to one transaction, so there are
// several acknowledged writes a PostgreSQL transaction, counted twice -- by the manager (the
// commit histogram) and by PostgreSQL itself (the distinct inserting transactions, xmin, of the
// rows) -- and every acknowledged write is in keep_log exactly once, each agent's log without a
// hole.
// Skipped without etcd or PostgreSQL.
#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include "tests/integration/manager/cluster_pg_helpers.h"

using namespace keep;
using namespace std::chrono_literals;
namespace it = keep::itest;
namespace kc = keep::client;

namespace {

constexpr uint32_t kShards = 4;
constexpr int kAgents = 8;
constexpr int kWriters = 16;
constexpr int kWritesEach = 40;
// Writes per PostgreSQL transaction at least, on average. One transaction a write would be 1;
// with kWriters writers waiting on commits that each wait for the standby, a batch holds the
// writes that arrived during the previous commit (several on a loaded 2-core machine).
constexpr double kMinWritesPerCommit = 2.0;

}  // namespace

TEST_CASE(
    "concurrent writes in cluster mode are committed to PostgreSQL in groups, each acknowledged "
    "write in the log exactly once" *
    doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  it::SyncPgPair pg;
  it::PgServer& primary = pg.primary;
  it::EtcdCluster etcd;
  etcd.wait_ready();
  it::TempDir tmp("gcommit");
  it::ManagerProcess m(
      {(tmp.path() / "a").string(), it::unique_name("gca"),
       it::pg_cluster_flags(it::join_urls(etcd.clients), "a", kShards, pg.conninfo())});
  REQUIRE_MESSAGE(
      it::eventually([&] { return it::metric(m, "keep_manager_cluster_shards_ready") == kShards; },
                     20s),
      m.err());

  std::vector<std::string> agents;
  for (int i = 0; i < kAgents; ++i) agents.push_back("robot-" + std::to_string(i));
  std::vector<std::unique_ptr<kc::ManagerClient>> clients;
  for (int w = 0; w < kWriters; ++w) clients.push_back(it::manager_client(m.endpoint(), 10s));

  // One phase: `writers` writers start at once and each writes kWritesEach memories, one after
  // the other's answer, over every agent (so most batches hold several shards' entries). What the
  // manager and PostgreSQL counted meanwhile.
  struct Phase {
    std::vector<std::string> texts;  // acknowledged
    double seconds = 0, commits = 0, entries = 0, rows = 0, xacts = 0;
  };
  const auto pg_count = [&](const std::string& what) {
    const std::string v = primary.query("SELECT " + what + " FROM keep_log");
    REQUIRE_FALSE(v.empty());
    return std::stod(v);
  };
  const auto run = [&](int writers, const std::string& tag) {
    Phase out;
    const double commits0 = it::metric(m, "keep_manager_cluster_log_commit_seconds_count");
    const double entries0 = it::metric(m, "keep_manager_cluster_log_entries_total");
    const double rows0 = pg_count("count(*)");
    const double xacts0 = pg_count("count(DISTINCT xmin::text)");  // rows' inserting transactions
    REQUIRE(commits0 >= 0);
    REQUIRE(entries0 >= 0);
    std::atomic<bool> go{false};
    std::vector<std::vector<std::string>> acked(writers), failed(writers);
    std::vector<std::thread> threads;
    for (int w = 0; w < writers; ++w) {
      threads.emplace_back([&, w] {
        while (!go.load()) std::this_thread::yield();
        kc::ManagerClient& c = *clients[static_cast<size_t>(w)];
        for (int n = 0; n < kWritesEach; ++n) {
          kc::WriteArgs args;
          args.agent = agents[static_cast<size_t>((w + n) % kAgents)];
          args.text = args.agent + " " + tag + " memory " + std::to_string(n) + " of writer " +
                      std::to_string(w) + ".";
          const Status st = c.write(args).status();
          (st.is_ok() ? acked : failed)[static_cast<size_t>(w)].push_back(
              st.is_ok() ? args.text : args.text + ": " + st.to_string());
        }
      });
    }
    const auto t0 = std::chrono::steady_clock::now();
    go.store(true);
    for (auto& t : threads) t.join();
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (int w = 0; w < writers; ++w) {
      CHECK_MESSAGE(failed[w].empty(), (failed[w].empty() ? "" : failed[w].front()));
      out.texts.insert(out.texts.end(), acked[w].begin(), acked[w].end());
    }
    out.commits = it::metric(m, "keep_manager_cluster_log_commit_seconds_count") - commits0;
    out.entries = it::metric(m, "keep_manager_cluster_log_entries_total") - entries0;
    out.rows = pg_count("count(*)") - rows0;
    out.xacts = pg_count("count(DISTINCT xmin::text)") - xacts0;
    MESSAGE(out.texts.size() << " writes from " << writers << " writer(s) acknowledged in "
                             << out.seconds << " s (" << out.texts.size() / out.seconds
                             << " /s): " << out.entries << " log entries in " << out.commits
                             << " commits by the manager's count (" << out.entries / out.commits
                             << " a commit); " << out.rows << " rows of keep_log in " << out.xacts
                             << " PostgreSQL transactions");
    REQUIRE(out.texts.size() == static_cast<size_t>(writers * kWritesEach));
    // Every write is one entry, one row; the two counts of transactions agree.
    CHECK(out.entries == static_cast<double>(out.texts.size()));
    CHECK(out.rows == out.entries);
    CHECK(out.xacts == out.commits);
    return out;
  };

  // The control: one writer alone waits for each commit before it sends the next write, so each
  // commit holds one write.
  const Phase alone = run(1, "alone");
  CHECK(alone.commits == alone.entries);
  // All at once: the writes that arrive during a commit share the next one.
  const Phase together = run(kWriters, "together");
  CHECK(together.entries / together.commits >= kMinWritesPerCommit);
  CHECK(together.rows / together.xacts >= kMinWritesPerCommit);
  MESSAGE("group commit: " << together.entries / together.commits << " writes a transaction, "
                           << (together.texts.size() / together.seconds) /
                                  (alone.texts.size() / alone.seconds)
                           << " times the throughput of one writer alone");
  std::vector<std::string> texts = alone.texts;
  texts.insert(texts.end(), together.texts.begin(), together.texts.end());

  // Every acknowledged write in the log exactly once (the records hold the texts, each unique and
  // no one a part of another), each agent's seq without a hole; the manager lists it once too.
  auto log = primary.log();
  std::string records;
  for (const auto& agent : agents) {
    auto entries_of = log->read(agent);
    REQUIRE_MESSAGE(entries_of.is_ok(), entries_of.status().to_string());
    for (size_t i = 0; i < entries_of->size(); ++i) {
      CHECK((*entries_of)[i].seq == i + 1);
      records += (*entries_of)[i].record + '\n';
    }
  }
  const auto seen = it::memory_counts(*clients[0], agents);
  for (const auto& t : texts) {
    CHECK_MESSAGE(it::occurrences(records, t) == 1,
                  "'" << t << "' is logged " << it::occurrences(records, t) << " times");
    const int listed = seen.count(t) ? seen.at(t) : 0;
    CHECK_MESSAGE(listed == 1, "'" << t << "' is listed " << listed << " times");
  }
  CHECK(seen.size() == texts.size());
}
