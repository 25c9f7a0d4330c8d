// RecordLog: cluster mode's log of record as ManagerService sees it (docs/cluster.md). Every
// mutation of an agent is an entry (agent, seq) of the agent's log, written at the epoch its
// shard's owner holds; the service answers a mutation only once its entry is durable there. The
// daemon implements it over PostgreSQL and etcd (services/manager/daemon/cluster_log.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"

namespace keep::manager {

class RecordLog {
 public:
  // Where an agent's mutations go: its shard and the epoch this node serves the shard at.
  struct Route {
    uint32_t shard = 0;
    uint64_t epoch = 0;
  };
  // One mutation record of an agent at its log position.
  struct Entry {
    std::string agent;
    uint64_t seq = 0;
    std::string record;  // the store's record (record_codec.h), as the local WAL had it unlogged
  };
  // One shard's part of a group commit; commit() sets `result`.
  struct ShardBatch {
    uint32_t shard = 0;
    uint64_t epoch = 0;
    std::vector<Entry> entries;
    Status result;
  };

  virtual ~RecordLog() = default;

  // Ok with the agent's route when this node serves the agent now (it owns the shard and has
  // replayed the shard's log); else the answer for a request about the agent (kMoved naming the
  // owner, kUnavailable while the shard has no owner or is being taken over). Called with the
  // service's store mutex held.
  virtual Result<Route> route(std::string_view agent) = 0;

  // Writes every batch in ONE transaction (group commit) and sets each batch's result: ok
  // (durable), or why not: kStale (a newer owner fenced the shard: nothing of it written),
  // kUnavailable (the log failed; whether it was written may be unknown). A shard whose batch
  // failed is no longer served here -- route() refuses its agents -- until this node or another
  // takes it again at a new epoch and replays its log. Called with the store mutex held, so that
  // nothing reads a mutation before it is durable.
  virtual void commit(std::vector<ShardBatch>* batches) = 0;
};

}  // namespace keep::manager
