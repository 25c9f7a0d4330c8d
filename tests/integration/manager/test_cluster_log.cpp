// ClusterLog (keep-manager's log of record in cluster mode) against a real PostgreSQL and a real
// three-member etcd, on a store whose local state disagrees with the log in every way a takeover
// must handle: an agent holding a prefix of its log (kept; the rest replayed), one whose last
// entry was refused (its seq holds another epoch in the log: dropped and read again), one holding
// an entry the log never got (dropped and read again), one it does not hold (read), and state that
// never came from the log (dropped). The local WAL then reproduces the store. A commit at the
// node's epoch lands; once a newer owner fenced the shard, one is refused and the shard is no
// longer served. A write the log holds with a client's request id is known by that id after the
// takeover (a resend of it is answered, not applied again). Skipped without etcd or PostgreSQL.
#include <doctest/doctest.h>

#include <mutex>
#include <thread>

#include "services/manager/daemon/cluster_log.h"
#include "services/manager/durability/wal_reader.h"
#include "services/manager/durability/wal_writer.h"
#include "services/manager/store/record_codec.h"
#include "shared/cluster/placement.h"
#include "tests/integration/manager/cluster_pg_helpers.h"

using namespace keep;
using namespace keep::manager;
using namespace std::chrono_literals;
namespace it = keep::itest;

namespace {

// Embeddings play no part here: a fixed vector per text.
class FixedEmbedder : public Embedder {
 public:
  int dim() const override { return 4; }
  Result<std::vector<std::vector<float>>> embed(const std::vector<std::string>& texts) override {
    return std::vector<std::vector<float>>(texts.size(), {1.0f, 0.0f, 0.0f, 0.0f});
  }
};

class OneTokenPerByte : public TokenCounter {
 public:
  uint32_t count_tokens(std::string_view text) const override {
    return static_cast<uint32_t>(text.size());
  }
};

// The local WAL as the daemon uses it: a real WalWriter in a directory.
class LocalWal : public BatchCommitter {
 public:
  explicit LocalWal(const std::string& dir) {
    WalOptions o;
    o.dir = dir;
    o.fsync = false;
    auto w = WalWriter::open(o);
    REQUIRE(w.is_ok());
    w_ = std::move(w).value();
  }
  Status append(std::string_view record) override { return w_->append(record).status(); }
  Status sync() override { return w_->sync(); }

 private:
  std::unique_ptr<WalWriter> w_;
};

std::string write_record(const std::string& agent, uint64_t id, const std::string& text) {
  return encode_record(WriteRecord{agent, id, 0, 0, static_cast<uint32_t>(text.size()), text});
}

cluster::LogRecord entry(const std::string& agent, uint64_t seq, const std::string& text) {
  return cluster::LogRecord{agent, seq, 0, write_record(agent, seq, text)};
}

std::vector<std::string> texts(MemoryStore& store, const std::string& agent) {
  auto page = store.list_memories(agent, 0, 100);
  REQUIRE_MESSAGE(page.is_ok(), agent << ": " << page.status().to_string());
  std::vector<std::string> out;
  for (const auto& m : page->memories) out.push_back(m.text);
  return out;
}

double series(const metrics::Registry& r, const std::string& name) {
  std::stringstream ss(r.render());
  for (std::string l; std::getline(ss, l);) {
    if (l.rfind(name + " ", 0) == 0) return std::stod(l.substr(name.size() + 1));
  }
  return -1;
}

// A node as keep-manager runs one: its ShardKeeper on etcd and its ClusterLog over a store and
// its local WAL. Made by join_node(): connected, not yet started, so it serves nothing.
struct Node {
  std::unique_ptr<cluster::ShardKeeper> keeper;
  std::unique_ptr<ClusterLog> log;
  std::mutex* store_mutex = nullptr;

  // Starts the takeovers and returns once `agent`'s shard is replayed and served.
  void serve(const std::string& agent) {
    log->start(keeper.get(), store_mutex);
    REQUIRE(it::eventually(
        [&] {
          std::lock_guard<std::mutex> lock(*store_mutex);
          return log->route(agent).is_ok();
        },
        10s));
  }
};

// Node `id` joins (lease 5 s, a round every 200 ms), holds shard 0 at `epoch` within 10 s, and
// connects its ClusterLog (checkpoints past `compact_after` entries; 0: never).
Node join_node(const it::EtcdCluster& etcd, const std::string& id, uint64_t epoch,
               const it::PgServer& pg, uint32_t shards, MemoryStore* store, BatchCommitter* wal,
               metrics::Registry* registry, std::mutex* store_mutex, uint64_t compact_after = 0) {
  cluster::EtcdOptions eo;
  eo.endpoints = etcd.clients;
  cluster::ShardKeeperOptions ko;
  ko.shards = shards;
  ko.lease_ttl_s = 5;
  ko.period = 200ms;
  Node n;
  n.store_mutex = store_mutex;
  auto keeper = cluster::ShardKeeper::start(eo, id, "tcp://" + id, ko);
  REQUIRE(keeper.is_ok());
  n.keeper = std::move(keeper).value();
  REQUIRE(it::eventually([&] { return n.keeper->epoch_of(0) == epoch; }, 10s));
  auto cl = ClusterLog::connect(pg.conninfo(), shards, store, wal, registry);
  REQUIRE(cl.is_ok());
  n.log = std::move(cl).value();
  n.log->set_compact_after(compact_after);
  return n;
}

}  // namespace

TEST_CASE(
    "a takeover keeps the local prefix of each log, drops what the log lacks, replays the "
    "rest; a fenced commit is refused" *
    doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  it::PgServer pg;
  auto log = pg.log();
  it::EtcdCluster etcd;
  etcd.wait_ready();
  constexpr uint32_t kShards = 1;  // every agent in shard 0

  // Epochs 1 and 2 of shard 0 went to earlier owners.
  auto ec = etcd.client();
  {
    cluster::Placement old(ec.get(), "old");
    REQUIRE(old.join("tcp://old", 10).is_ok());
    for (uint64_t e = 1; e <= 2; ++e) {
      auto got = old.acquire(0);
      REQUIRE(got.is_ok());
      REQUIRE(*got == std::optional<uint64_t>(e));
      REQUIRE(old.release(0, e).is_ok());
    }
    REQUIRE(old.leave().is_ok());
  }
  // What they wrote.
  REQUIRE(log->append(0, 1,
                      {entry("A", 1, "a1"), entry("A", 2, "a2"), entry("B", 1, "b1"),
                       entry("C", 1, "c1"), entry("C", 2, "c2")})
              .is_ok());
  // D's second write was sent with request id 42:7 (the record the service logs for it).
  cluster::LogRecord d2 = entry("D", 2, "d2");
  d2.record = encode_record(RequestedRecord{"D", 42, 7, 2, 1, 0, d2.record});
  REQUIRE(log->append(0, 2,
                      {entry("A", 3, "a3"), entry("A", 4, "a4"), entry("B", 2, "b2 from the log"),
                       entry("D", 1, "d1"), d2})
              .is_ok());

  // What this node holds locally (as its WAL would have given it back).
  it::TempDir tmp("clog");
  FixedEmbedder embedder;
  OneTokenPerByte counter;
  MemoryStore store(StoreOptions{}, &embedder, &counter);
  LocalWal wal((tmp.path() / "wal").string());
  const auto hold = [&](const std::string& agent, uint64_t seq, uint64_t epoch,
                        const std::string& text) {
    std::string rec = write_record(agent, seq, text);
    REQUIRE(store.apply_record(rec).is_ok());
    REQUIRE(store.set_log_position(agent, {seq, epoch}, &rec).is_ok());
    REQUIRE(wal.append(rec).is_ok());
  };
  hold("A", 1, 1, "a1");
  hold("A", 2, 1, "a2");  // a prefix of A's log
  hold("B", 1, 1, "b1");
  hold("B", 2, 1, "b2 refused");  // refused: the log's seq 2 is another owner's (epoch 2)
  hold("C", 1, 1, "c1");
  hold("C", 2, 1, "c2");
  hold("C", 3, 1, "c3 never logged");  // the log has no seq 3
  std::string rec;
  WriteRequest single;
  single.agent = "E";
  single.text = "state from single-node mode";
  REQUIRE(store.write(single, &rec).is_ok());
  REQUIRE(wal.append(rec).is_ok());

  metrics::Registry registry;
  std::mutex store_mutex;
  Node n2 = join_node(etcd, "n2", 3, pg, kShards, &store, &wal, &registry, &store_mutex);
  {
    std::lock_guard<std::mutex> lock(store_mutex);
    CHECK(n2.log->route("A").status().code() == Code::kUnavailable);  // not started
  }
  n2.serve("A");

  {
    std::lock_guard<std::mutex> lock(store_mutex);
    CHECK(texts(store, "A") == std::vector<std::string>{"a1", "a2", "a3", "a4"});
    CHECK(store.log_position("A").seq == 4);
    CHECK(store.log_position("A").epoch == 2);
    CHECK(texts(store, "B") == std::vector<std::string>{"b1", "b2 from the log"});
    CHECK(store.log_position("B").epoch == 2);
    CHECK(texts(store, "C") == std::vector<std::string>{"c1", "c2"});
    CHECK(store.log_position("C").seq == 2);
    CHECK(texts(store, "D") == std::vector<std::string>{"d1", "d2"});
    auto resent = store.find_request("D", RequestId{42, 7});
    REQUIRE(resent.has_value());
    CHECK(resent->op == MutationOp::kWrite);
    CHECK(resent->result.id == 2);
    CHECK_FALSE(store.find_request("D", RequestId{42, 6}).has_value());
    CHECK(store.list_memories("E", 0, 10).status().code() == Code::kNotFound);
    auto r = n2.log->route("A");
    REQUIRE(r.is_ok());
    CHECK(r->shard == 0);
    CHECK(r->epoch == 3);
  }
  CHECK(n2.log->shards_ready() == 1);
  // A: 2 entries after its prefix; B and C read again whole (2 each); D whole (2).
  CHECK(series(registry, "keep_manager_cluster_replayed_entries_total") == 8);
  CHECK(series(registry, "keep_manager_cluster_agents_dropped_total") == 3);  // B, C, E

  // The local WAL reproduces the store, positions included.
  {
    std::lock_guard<std::mutex> lock(store_mutex);
    REQUIRE(wal.sync().is_ok());
    MemoryStore again(StoreOptions{}, &embedder, &counter);
    REQUIRE(wal_replay((tmp.path() / "wal").string(), 1, [&](uint64_t, std::string_view payload) {
              return again.apply_record(payload);
            }).is_ok());
    CHECK(again.serialize() == store.serialize());
  }

  // A commit at this node's epoch lands.
  std::vector<RecordLog::ShardBatch> batch{
      {0, 3, {RecordLog::Entry{"A", 5, write_record("A", 5, "a5")}}, {}}};
  {
    std::lock_guard<std::mutex> lock(store_mutex);
    n2.log->commit(&batch);
  }
  CHECK(batch[0].result.is_ok());
  CHECK(*log->last_seq("A") == 5);
  // A newer owner fences the shard: this node's next commit is refused whole, and it stops
  // serving the shard.
  REQUIRE(log->fence(0, 9).is_ok());
  batch = {{0, 3, {RecordLog::Entry{"A", 6, write_record("A", 6, "a6 refused")}}, {}}};
  {
    std::lock_guard<std::mutex> lock(store_mutex);
    n2.log->commit(&batch);
    CHECK(batch[0].result.code() == Code::kStale);
    CHECK(n2.log->route("A").status().code() == Code::kUnavailable);
  }
  CHECK(*log->last_seq("A") == 5);
  CHECK(series(registry, "keep_manager_cluster_log_refused_total{reason=\"stale\"}") == 1);
  n2.log->stop();
}

// Compaction: the owner checkpoints an agent past compact_after entries and the log keeps only
// the entries after the checkpoint; a node taking the shard over -- its local cache older than
// the checkpoint -- starts from the checkpoint, replays the rest, and knows the request ids of
// mutations the checkpoint covers (a resend of one is a duplicate). Its WAL reproduces its store.
TEST_CASE("compaction: checkpoint, log truncated behind it, a takeover starts from it" *
          doctest::skip(!it::have_etcd() || it::pg_bin().empty())) {
  it::PgServer pg;
  auto log = pg.log();
  it::EtcdCluster etcd;
  etcd.wait_ready();
  constexpr uint32_t kShards = 1;
  FixedEmbedder embedder;
  OneTokenPerByte counter;

  // Node 1 owns shard 0 at epoch 1 and commits A's writes 1..5 (with request ids 7:1..7:5), then
  // 6 and 7; it checkpoints past 3 entries.
  it::TempDir tmp1("clog1");
  MemoryStore store1(StoreOptions{}, &embedder, &counter);
  LocalWal wal1((tmp1.path() / "wal").string());
  metrics::Registry registry1;
  std::mutex mu1;
  Node n1 = join_node(etcd, "n1", 1, pg, kShards, &store1, &wal1, &registry1, &mu1, 3);
  n1.serve("A");
  const auto commit = [&](uint64_t from, uint64_t to) {
    std::lock_guard<std::mutex> lock(mu1);
    std::vector<RecordLog::ShardBatch> batch{{0, 1, {}, {}}};
    for (uint64_t seq = from; seq <= to; ++seq) {
      const std::string text = "a" + std::to_string(seq);
      std::string rec =
          encode_record(RequestedRecord{"A", 7, seq, seq, 1, 0, write_record("A", seq, text)});
      REQUIRE(store1.apply_record(rec).is_ok());
      std::string logged = rec;
      REQUIRE(store1.set_log_position("A", {seq, 1}, &logged).is_ok());
      REQUIRE(wal1.append(logged).is_ok());
      batch[0].entries.push_back(RecordLog::Entry{"A", seq, rec});
    }
    n1.log->commit(&batch);
    REQUIRE(batch[0].result.is_ok());
  };
  commit(1, 5);
  const auto checkpoint_seq = [&]() -> uint64_t {
    auto cps = log->read_checkpoints(0);
    REQUIRE(cps.is_ok());
    return cps->empty() ? 0 : cps->front().seq;
  };
  REQUIRE(it::eventually([&] { return checkpoint_seq() == 5; }, 10s));
  CHECK(log->read("A")->empty());  // every entry is in the checkpoint
  commit(6, 7);                    // 2 after it: no checkpoint yet
  std::this_thread::sleep_for(300ms);
  CHECK(checkpoint_seq() == 5);
  auto rows = log->read("A");
  REQUIRE(rows->size() == 2);
  CHECK((*rows)[0].seq == 6);
  CHECK((*rows)[1].seq == 7);
  CHECK(series(registry1, "keep_manager_cluster_checkpoints_total{result=\"ok\"}") == 1);
  CHECK(series(registry1, "keep_manager_cluster_compacted_entries_total") == 5);

  // Node 2 holds A at entry 2 from an older life (its local cache, older than the checkpoint).
  it::TempDir tmp2("clog2");
  MemoryStore store2(StoreOptions{}, &embedder, &counter);
  LocalWal wal2((tmp2.path() / "wal").string());
  {
    std::string rec = write_record("X", 1, "x1");  // another agent, for the write order
    REQUIRE(store2.apply_record(rec).is_ok());
    REQUIRE(store2.set_log_position("X", {1, 1}, &rec).is_ok());
    REQUIRE(wal2.append(rec).is_ok());
    for (uint64_t seq = 1; seq <= 2; ++seq) {
      std::string a = write_record("A", seq, "a" + std::to_string(seq));
      REQUIRE(store2.apply_record(a).is_ok());
      REQUIRE(store2.set_log_position("A", {seq, 1}, &a).is_ok());
      REQUIRE(wal2.append(a).is_ok());
    }
  }
  REQUIRE(log->append(0, 1, {entry("X", 1, "x1")}).is_ok());
  // Node 1 leaves (as if killed: nothing more of it reaches the log); node 2 takes shard 0.
  n1.log->stop();
  n1.keeper.reset();  // leaves: the shard is free at once
  metrics::Registry registry2;
  std::mutex mu2;
  Node n2 = join_node(etcd, "n2", 2, pg, kShards, &store2, &wal2, &registry2, &mu2, 3);
  n2.serve("A");
  {
    std::lock_guard<std::mutex> lock(mu2);
    CHECK(texts(store2, "A") ==
          std::vector<std::string>{"a1", "a2", "a3", "a4", "a5", "a6", "a7"});  // once each
    CHECK(store2.log_position("A").seq == 7);
    CHECK(texts(store2, "X") == std::vector<std::string>{"x1"});
    // Mutations before the checkpoint (1..5) and after it (6, 7) are known by their ids.
    for (uint64_t seq = 1; seq <= 7; ++seq) {
      auto resent = store2.find_request("A", RequestId{7, seq});
      REQUIRE_MESSAGE(resent.has_value(), "request 7:" << seq);
      CHECK(resent->result.id == seq);
    }
  }
  CHECK(series(registry2, "keep_manager_cluster_checkpoints_loaded_total") == 1);
  CHECK(series(registry2, "keep_manager_cluster_replayed_entries_total") == 2);  // 6, 7
  CHECK(series(registry2, "keep_manager_cluster_agents_dropped_total") == 1);    // A at 2
  {  // The local WAL reproduces the store, the checkpoint included.
    std::lock_guard<std::mutex> lock(mu2);
    REQUIRE(wal2.sync().is_ok());
    MemoryStore again(StoreOptions{}, &embedder, &counter);
    REQUIRE(wal_replay((tmp2.path() / "wal").string(), 1, [&](uint64_t, std::string_view payload) {
              return again.apply_record(payload);
            }).is_ok());
    CHECK(again.serialize() == store2.serialize());
  }
  // Node 1's state, a checkpoint at its old epoch: refused now that node 2 fenced the shard.
  CHECK(
      log->checkpoint(0, 1, cluster::Checkpoint{"A", 7, 1, 0, store1.capture_agent("A")}).code() ==
      Code::kStale);
  CHECK(checkpoint_seq() == 5);
  CHECK(log->read("A")->size() == 2);
  n2.log->stop();
}
