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
  cluster::EtcdOptions eo;
  eo.endpoints = etcd.clients;
  cluster::ShardKeeperOptions ko;
  ko.shards = kShards;
  ko.lease_ttl_s = 5;
  ko.period = 200ms;
  auto keeper = cluster::ShardKeeper::start(eo, "n2", "tcp://n2", ko);
  REQUIRE(keeper.is_ok());
  REQUIRE((*keeper)->epoch_of(0) == 3);
  auto cl = ClusterLog::connect(pg.conninfo(), kShards, &store, &wal, &registry);
  REQUIRE(cl.is_ok());
  {
    std::lock_guard<std::mutex> lock(store_mutex);
    CHECK((*cl)->route("A").status().code() == Code::kUnavailable);  // not started
  }
  (*cl)->start(keeper->get(), &store_mutex);
  REQUIRE(it::eventually(
      [&] {
        std::lock_guard<std::mutex> lock(store_mutex);
        return (*cl)->route("A").is_ok();
      },
      10s));

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
    auto r = (*cl)->route("A");
    REQUIRE(r.is_ok());
    CHECK(r->shard == 0);
    CHECK(r->epoch == 3);
  }
  CHECK((*cl)->shards_ready() == 1);
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
    (*cl)->commit(&batch);
  }
  CHECK(batch[0].result.is_ok());
  CHECK(*log->last_seq("A") == 5);
  // A newer owner fences the shard: this node's next commit is refused whole, and it stops
  // serving the shard.
  REQUIRE(log->fence(0, 9).is_ok());
  batch = {{0, 3, {RecordLog::Entry{"A", 6, write_record("A", 6, "a6 refused")}}, {}}};
  {
    std::lock_guard<std::mutex> lock(store_mutex);
    (*cl)->commit(&batch);
    CHECK(batch[0].result.code() == Code::kStale);
    CHECK((*cl)->route("A").status().code() == Code::kUnavailable);
  }
  CHECK(*log->last_seq("A") == 5);
  CHECK(series(registry, "keep_manager_cluster_log_refused_total{reason=\"stale\"}") == 1);
  (*cl)->stop();
}
