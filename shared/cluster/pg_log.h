// PgLog: the per-agent memory log in PostgreSQL (issue 31, point 2), the system of record in
// cluster mode: rows (agent, seq, epoch, record), one transaction per batch (group commit).
//
// Fencing: a shard's owner writes with the epoch etcd gave it (placement.h). Each batch first
// raises the shard's row in keep_fence to that epoch -- never lowers it -- in the same
// transaction; a batch whose epoch is below the fence is refused whole (kStale) and writes
// nothing, so an owner that lost its shard (paused, cut off) cannot write behind its successor's
// back once the successor wrote, or fenced, at a larger epoch. The row lock on keep_fence also
// orders two owners' batches of one shard.
#pragma once

#include <cstdint>
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
  // Raises the shard's fence to `epoch` with nothing written (a new owner, before it serves).
  Status fence(uint32_t shard, uint64_t epoch);
  // The agent's records with seq > after_seq, ascending.
  Result<std::vector<LogRecord>> read(const std::string& agent, uint64_t after_seq = 0);
  Result<uint64_t> last_seq(const std::string& agent);  // 0: none

 private:
  struct Impl;
  explicit PgLog(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace keep::cluster
