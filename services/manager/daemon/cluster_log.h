// ClusterLog: keep-manager's log of record in cluster mode (docs/cluster.md, issue 31 point 2).
// PostgreSQL (cluster::PgLog) holds every agent's log; etcd (cluster::ShardKeeper) says which
// shards this node serves and at which epoch.
//
//   route(agent)  served here when this node owns the agent's shard AND has replayed the shard's
//                 log at the epoch it owns it at; a shard just taken is kUnavailable ("being
//                 taken over ... retry") until then.
//   commit()      one transaction for a batch of mutations (PgLog::append_shards) on the request
//                 thread's connection. A shard whose part was refused (fenced by a newer owner)
//                 or failed is given up (ShardKeeper::give_up): this node never writes at that
//                 epoch again, so an entry (seq, epoch) held locally equals the log's entry at
//                 that seq exactly when the log has that epoch there.
//   takeovers     a thread of its own, with a second connection: for a shard this node owns and
//                 has not replayed at its epoch, (1) raise the shard's fence to the epoch (an
//                 older owner can no longer write, and every batch it committed is visible),
//                 (2) compare each local agent's log position with the log: an agent whose
//                 position the log does not have (or has at another epoch) is dropped and read
//                 again from seq 1, (3) apply the rest of each agent's log in seq order, each
//                 entry logged to the local WAL with its position, (4) serve the shard.
//   compaction    on the takeover thread: an agent of a served shard with more than
//                 compact_after entries after its last checkpoint gets a new one: its state
//                 (MemoryStore::capture_agent, taken with the store mutex held, so every entry
//                 it covers is committed) written to PostgreSQL at the shard's epoch -- fenced
//                 like a commit: refused, and the shard given up, when a newer owner fenced it
//                 -- and its entries up to the checkpoint deleted, in one transaction. A takeover
//                 starts each agent from its checkpoint (its local state when that is at or past
//                 the checkpoint and the log's, else the checkpoint replaces it) and replays the
//                 entries after it.
//
// The local WAL and snapshots are thus a recovery cache: what a node holds of an agent is a
// prefix of the agent's log (checkpoint included), and a takeover reads only what follows it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "services/manager/server/manager_service.h"
#include "services/manager/server/record_log.h"
#include "services/manager/store/memory_store.h"
#include "shared/cluster/pg_log.h"
#include "shared/cluster/shard_keeper.h"
#include "shared/metrics/metrics.h"

namespace keep::manager {

class ClusterLog final : public RecordLog {
 public:
  // Connects to PostgreSQL (`conninfo`, libpq syntax) twice (requests, takeovers) and creates the
  // tables if missing. `store` and `wal` (the local WAL, may be null) must outlive it; its metrics
  // go to `registry` (keep_manager_cluster_log_* and _takeover*). kUnavailable: no server.
  static Result<std::unique_ptr<ClusterLog>> connect(const std::string& conninfo, uint32_t shards,
                                                     MemoryStore* store, BatchCommitter* wal,
                                                     metrics::Registry* registry);
  ~ClusterLog() override;  // stop()
  ClusterLog(const ClusterLog&) = delete;
  ClusterLog& operator=(const ClusterLog&) = delete;

  // Starts serving: `keeper` (must outlive stop()) says what this node owns; `store_mutex` is the
  // service's (route() and commit() are called with it held; takeovers take it). Until then every
  // agent is kUnavailable.
  void start(cluster::ShardKeeper* keeper, std::mutex* store_mutex);
  // Stops the takeover thread; from then on every agent is kUnavailable.
  void stop();
  // Compaction (see the top): a checkpoint once an agent has more than `entries` log entries
  // after its last one; 0 (the default here; keep-manager's --pg-compact-after is 1000): never.
  // Call before start().
  void set_compact_after(uint64_t entries) { compact_after_ = entries; }

  Result<Route> route(std::string_view agent) override;
  void commit(std::vector<ShardBatch>* batches) override;

  // Shards served now (owned and replayed). Takes the store mutex.
  size_t shards_ready() const;

 private:
  ClusterLog(std::unique_ptr<cluster::PgLog> writer, std::unique_ptr<cluster::PgLog> reader,
             uint32_t shards, MemoryStore* store, BatchCommitter* wal, metrics::Registry* registry);
  void run();
  // Replays `shard`, owned at `epoch`, and serves it (see the top).
  Status take_over(uint32_t shard, uint64_t epoch);
  // Applies `records` (one agent's, seq ascending, the first after `after`) with the store mutex
  // held: each to the store and, with its position, to the local WAL.
  Status apply_locked(const std::string& agent, const cluster::LogRecord* records, size_t n,
                      uint64_t after);
  void drop_locked(const std::string& agent);
  void give_up_locked(uint32_t shard, uint64_t epoch);
  // Replaces the agent's state with its checkpoint (store and local WAL), store mutex held.
  Status load_checkpoint_locked(const cluster::Checkpoint& cp);
  // Writes the checkpoints due (compact_due_) of served shards; logs what failed.
  void compact();

  std::unique_ptr<cluster::PgLog> writer_;  // request thread (commit)
  std::unique_ptr<cluster::PgLog> reader_;  // takeover thread
  const uint32_t shards_;
  MemoryStore* store_;
  BatchCommitter* wal_;
  std::atomic<cluster::ShardKeeper*> keeper_{nullptr};
  std::mutex* store_mutex_ = nullptr;

  // Guarded by the store mutex.
  std::map<uint32_t, uint64_t> ready_;            // shard -> the epoch its log was replayed at
  std::map<uint32_t, uint64_t> given_up_;         // shard -> an epoch this node must not write at
  std::map<std::string, uint64_t> checkpointed_;  // agent -> seq of its last checkpoint known
  std::set<std::string> compact_due_;             // agents past compact_after_ since then
  uint64_t compact_after_ = 0;

  std::mutex run_mu_;
  std::condition_variable run_cv_;
  bool stop_ = false;
  std::thread thread_;

  metrics::HistogramFamily& commit_seconds_;
  metrics::CounterFamily& entries_;
  metrics::CounterFamily& refused_;
  metrics::HistogramFamily& takeover_seconds_;
  metrics::CounterFamily& replayed_;
  metrics::CounterFamily& dropped_;
  metrics::CounterFamily& checkpoints_;
  metrics::CounterFamily& checkpoints_loaded_;
  metrics::CounterFamily& compacted_;
};

}  // namespace keep::manager
