// PgLog: the per-agent memory log in PostgreSQL (issue 31, point 2), the system of record in
// cluster mode: rows (shard, agent, seq, epoch, record), group commit as one transaction.
//
// Fencing: a shard's owner writes with the epoch etcd gave it (placement.h). Each batch first
// raises the shard's row in keep_fence to that epoch -- never lowers it -- in the same
// transaction; a batch whose epoch is below the fence is refused whole (kStale) and writes
// nothing, so an owner that lost its shard (paused, cut off) cannot write behind its successor's
// back once the successor wrote, or fenced, at a larger epoch. The row lock on keep_fence also
// orders two owners' batches of one shard, and a new owner that fenced (fence()) before reading
// sees every batch an older owner committed.
//
// One PgLog is one connection: not thread-safe (give each thread its own). A connection that
// broke is reset at the next call (the server restarted, a network blip).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shared/common/status.h"

namespace keep::cluster {

struct LogRecord {
  std::string agent;
  uint64_t seq = 0;    // per agent, from 1
  uint64_t epoch = 0;  // the writer's epoch (filled in by append)
  std::string record;  // the manager's WAL record bytes
};

// A checkpoint of one agent's log (compaction, docs/cluster.md): the agent's whole state as of
// entry `seq` (written at `epoch`: the entry's, to compare with a node's local position),
// written by the shard's owner at `owner_epoch`. The log keeps only the entries after `seq`.
struct Checkpoint {
  std::string agent;
  uint64_t seq = 0;
  uint64_t epoch = 0;
  uint64_t owner_epoch = 0;
  std::string state;  // the manager's one-agent snapshot bytes (MemoryStore::capture_agent)
};

// One shard's part of a group commit: its records, written at `epoch`.
struct ShardAppend {
  uint32_t shard = 0;
  uint64_t epoch = 0;
  std::vector<LogRecord> records;  // agents of `shard` only
};

class PgLog {
 public:
  // libpq conninfo ("host=... port=... dbname=... user=..."); creates the tables if missing.
  static Result<std::unique_ptr<PgLog>> connect(const std::string& conninfo);
  ~PgLog();
  PgLog(const PgLog&) = delete;
  PgLog& operator=(const PgLog&) = delete;

  // Appends `records` of agents of `shard` in one transaction at `epoch`. kStale: the shard is
  // fenced at a larger epoch (nothing written); kAlreadyExists: an (agent, seq) is taken
  // (nothing written); kUnavailable: the server is gone (whether it committed is unknown only
  // if the connection broke during COMMIT: re-read with last_seq).
  Status append(uint32_t shard, uint64_t epoch, const std::vector<LogRecord>& records);
  // Group commit of several shards in ONE transaction (one fsync on the server): each shard's
  // fence is raised first, in ascending shard order (two writers never wait on each other in a
  // cycle); a shard fenced above its epoch is refused whole and the others are written. The
  // answer has one status per element of `batches`, in order: ok or kStale. An error for the
  // whole call (kAlreadyExists, kUnavailable, kInternal) means nothing was written, except that
  // a connection lost during COMMIT leaves it unknown (kUnavailable).
  Result<std::vector<Status>> append_shards(const std::vector<ShardAppend>& batches);
  // Raises the shard's fence to `epoch` with nothing written (a new owner, before it serves).
  Status fence(uint32_t shard, uint64_t epoch);
  // The agent's records with seq > after_seq, ascending.
  Result<std::vector<LogRecord>> read(const std::string& agent, uint64_t after_seq = 0);
  // Every record of `shard`, by agent then seq, from seq `from[agent]` on (inclusive) for the
  // agents in `from` and from the first for the others (a new owner's replay: what it holds of
  // an agent is up to from[agent], and the record at that seq tells whether it is the log's).
  Result<std::vector<LogRecord>> read_shard(uint32_t shard,
                                            const std::map<std::string, uint64_t>& from);
  Result<uint64_t> last_seq(const std::string& agent);  // 0: none (a checkpoint's seq counts)

  // Compaction, in ONE transaction fenced like a batch (the shard's fence raised to
  // `owner_epoch`; kStale, nothing written, when it is above): stores `cp` as the agent's
  // checkpoint (replacing an older one; one at a seq not above the stored one is kept as is)
  // and deletes the agent's entries with seq <= cp.seq. kCorrupt (nothing written):
  // the log has no entry (cp.seq, cp.epoch) and no checkpoint at or past it -- the state is not
  // the log's prefix. The other errors as append's.
  Status checkpoint(uint32_t shard, uint64_t owner_epoch, const Checkpoint& cp);
  // The checkpoints of the agents of `shard`, by agent (a new owner's replay starts from them).
  Result<std::vector<Checkpoint>> read_checkpoints(uint32_t shard);

 private:
  struct Impl;
  explicit PgLog(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace keep::cluster
