// WorkerDaemon: keep-worker assembled — the model on the CPU or CUDA backend, the prompt format,
// the manager client, PlanService and KvProducer on one engine thread (WorkerService), the
// planners' ZeroMQ endpoint and /metrics.
//
// Threads: the RPC I/O thread (run()), the engine thread, the HTTP threads of /metrics.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "services/worker/daemon/worker_config.h"
#include "shared/common/status.h"

namespace keep::worker {

class WorkerDaemon {
 public:
  // Loads the model, binds the endpoints and starts the engine thread.
  static Result<std::unique_ptr<WorkerDaemon>> start(const WorkerConfig& config);
  // Finishes the queued requests, revokes the KV job in hand, sends the last answers.
  ~WorkerDaemon();
  WorkerDaemon(const WorkerDaemon&) = delete;
  WorkerDaemon& operator=(const WorkerDaemon&) = delete;

  // Serves requests on the calling thread until stop().
  void run();
  // Async-signal-safe: asks run() to return.
  void stop();

  const std::vector<std::string>& endpoints() const;
  std::string metrics_address() const;  // "" when /metrics is off

 private:
  struct Impl;
  explicit WorkerDaemon(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace keep::worker
