// WorkerService: keep-worker's side of the wire (proto/worker.capnp) and its one engine thread.
//
// The I/O thread (wire::RpcServer) hands every batch to handle_batch(): a ping is answered there;
// a completion is decoded and checked (bad input: invalidArgument with the field, the worker goes
// on), deferred and queued (a full queue: resourceExhausted at once). The engine thread takes the
// queued requests in arrival order and, when none waits, runs the manager's KV jobs a few layers
// at a time (KvProducer), so that a planner request waits for at most one job step. A request
// whose caller stopped waiting (its timeoutMs passed while queued) is answered timeout unrun.
//
// The KV region is attached lazily and again whenever its name stops naming the mapped object
// (a restarted manager makes a new one); while none is attached every memory is recomputed and no
// job is taken. A region of another model is refused with both fingerprints in the log, and the
// worker serves without reuse.
//
// drain(): on SIGTERM, new completions are refused (unavailable), the queued ones finish, the job
// in hand is revoked, and the engine thread ends.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "services/worker/server/plan_service.h"
#include "shared/client/protocols.h"
#include "shared/kvregion/kv_region.h"
#include "shared/metrics/metrics.h"
#include "shared/rpc/rpc_server.h"

namespace keep::worker {

using WorkerCall = wire::Call<client::WorkerProtocol>;
using WorkerRpcServer = wire::RpcServer<client::WorkerProtocol>;

struct WorkerServiceOptions {
  size_t max_queue = 64;  // completions waiting for the engine; more are refused
  uint32_t max_k = 256;
  int32_t max_tokens = 1024;                     // the most new tokens one request may ask for
  size_t max_history = 256;                      // history entries per request
  int32_t job_layers = 4;                        // layers of a KV job per engine step
  bool produce = true;                           // take the manager's KV jobs
  uint64_t worker_id = 1;                        // this worker's id in the manager's leases
  std::chrono::milliseconds job_poll{100};       // idle: how often to ask for jobs
  std::chrono::milliseconds region_retry{1000};  // how often to try attaching the region
  // How long a request's retrieve is retried while keep-manager does not answer (bounded by the
  // request's own timeoutMs).
  std::chrono::milliseconds manager_retry{30000};
  std::string shm_name = "keep-kv";
  kv::ModelFingerprint fingerprint;  // what the region must have been made for
  std::string server_version;
  // Called on the engine thread after a region is attached (true) and before one is let go
  // (false): the CUDA build registers the mapping for zero-copy transfers there.
  std::function<void(const kv::KvRegionView&, bool attached)> on_region;
};

// The worker's Prometheus families (docs/operations.md lists them).
struct WorkerMetrics {
  explicit WorkerMetrics(metrics::Registry& registry);
  metrics::CounterFamily& requests;  // {method, code}: run (or timed out in the queue)
  metrics::CounterFamily& refused;   // {code}: answered at arrival (invalid, queue full, closing)
  metrics::HistogramFamily& ttft;    // {method}
  metrics::HistogramFamily& request_time;     // {method}
  metrics::HistogramFamily& prompt_tokens;    // {method}
  metrics::HistogramFamily& recompute_ratio;  // {method}
  metrics::CounterFamily& bytes_loaded;       // {method}
  metrics::CounterFamily& entries;            // {method, result}
  metrics::GaugeFamily& queue_depth;          // {method}
  metrics::CounterFamily& jobs;               // {result}
  metrics::CounterFamily& job_bytes;
  metrics::CounterFamily& manager_errors;
  metrics::CounterFamily& shared_kv;  // {result}: the shared KV tier (hit, miss, error, published)
  metrics::GaugeFamily& region_attached;
};

class WorkerService final : public wire::RequestHandler<client::WorkerProtocol> {
 public:
  // `plans`, `producer`, `manager` are used on the engine thread only and must outlive the
  // service; `metrics` may be null.
  WorkerService(PlanService* plans, KvProducer* producer, WorkerServiceOptions options,
                WorkerMetrics* metrics);
  ~WorkerService() override;  // drain()

  // I/O thread.
  void handle_batch(std::span<WorkerCall> calls) override;

  // Starts the engine thread; each answered completion goes to `complete` (RpcServer::complete).
  void start(std::function<void(std::unique_ptr<WorkerCall>)> complete);
  // Refuses new completions, finishes the queued ones, revokes the job in hand, joins.
  void drain();

  bool region_attached() const { return attached_.load(std::memory_order_relaxed); }
  size_t queued() const;

 private:
  struct Queued {
    std::unique_ptr<WorkerCall> call;
    CompleteArgs args;
  };
  void engine_loop();
  void run_one(Queued q);
  void ensure_region();
  void count_queue(Method m, double delta);

  PlanService* plans_;
  KvProducer* producer_;
  WorkerServiceOptions options_;
  WorkerMetrics* metrics_;
  std::function<void(std::unique_ptr<WorkerCall>)> complete_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  bool draining_ = false;
  std::thread engine_;

  // Engine thread only.
  std::unique_ptr<kv::KvRegionView> region_;
  std::chrono::steady_clock::time_point next_region_try_{};
  std::chrono::steady_clock::time_point next_job_poll_{};
  bool mismatch_logged_ = false;
  std::atomic<bool> attached_{false};
};

// The checks and conversion of a CompleteRequest (I/O thread; also the fuzz target's and tests').
Result<CompleteArgs> decode_complete(proto::worker::CompleteRequest::Reader r,
                                     const WorkerServiceOptions& limits,
                                     const PlanDefaults& defaults);
// Fills a CompleteResponse from a result.
void encode_complete(const CompleteResult& result, proto::worker::CompleteResponse::Builder out);

}  // namespace keep::worker
