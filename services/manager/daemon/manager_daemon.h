// ManagerDaemon: keep-manager assembled — recovery (snapshot + WAL replay), the memory store, the
// background encoder, the WAL group committer, the shared KV region, the request handler on the
// ZeroMQ server, the /metrics endpoint and housekeeping (lease reaping, snapshots).
//
// Threads: the RPC I/O thread (handles batches: apply, append, one fsync, reply), the embedding
// thread (turns queued texts into vectors off the write path), the housekeeping thread, and the
// HTTP threads of /metrics. The store is guarded by ManagerService::store_mutex(); WAL appends
// happen under it so the log order is the apply order. Cluster mode with --pg adds ClusterLog
// (cluster_log.h): mutations are committed to PostgreSQL before they are answered, and a thread
// of its own replays the log of every shard this node takes over before serving it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "services/manager/daemon/manager_config.h"
#include "shared/common/status.h"

namespace keep::manager {

class ManagerDaemon {
 public:
  // Loads the models, recovers the state from config.data_dir, creates the KV region, binds the
  // endpoints and starts the background threads. The RPC loop starts with run().
  static Result<std::unique_ptr<ManagerDaemon>> start(const ManagerConfig& config);
  ~ManagerDaemon();  // stop(), joins, final WAL sync and snapshot
  ManagerDaemon(const ManagerDaemon&) = delete;
  ManagerDaemon& operator=(const ManagerDaemon&) = delete;

  // Serves requests on the calling thread until stop().
  void run();
  // Async-signal-safe: asks run() to return.
  void stop();

  const std::vector<std::string>& endpoints() const;
  std::string metrics_address() const;  // "" when /metrics is off

 private:
  struct Impl;
  explicit ManagerDaemon(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace keep::manager
