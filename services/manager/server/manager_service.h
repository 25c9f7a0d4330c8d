// ManagerService: the keep-manager's request handler. Maps wire messages (proto/manager.capnp) to
// the MemoryStore API and back, group-commits the WAL records of a batch with ONE sync, and runs
// the KV-job side of the protocol (fetch / reserve / commit / revoke / renew) against the shared
// region through KvRegionOps.
//
// Durability and the region are given as interfaces so the handler is independent of their
// implementations (the daemon wires the real WAL writer and KvRegion; tests may pass small ones).
//
// Threading: handle_batch/on_idle run on the RpcServer's I/O thread. Every store access happens
// under store_mutex(); another thread that mutates the store (the background embedder's
// apply_embeddings) must take the same mutex AND append its record while holding it, so the WAL
// order is the order mutations were applied. BatchCommitter::append is called with the mutex held;
// sync() without it.
//
// Deferred retrieves (start_deferred_retrieves): a retrieve that has something to embed (its
// query, when the query cache misses; its agent's segments still waiting for the background
// embedder) is taken out of its batch (ManagerCall::defer) and answered by one of the service's
// retrieve threads, which embeds without the mutex, then applies the embeddings and answers with
// it, and gives the call back to the server. The I/O thread meanwhile serves every other request:
// one retrieve after a burst of writes no longer holds every client for the seconds its
// embedding takes. Without it (tests of the handler alone) retrieve embeds inline.
//
// The deferred retrieves wait in a FairQueue keyed by peer (the ZeroMQ identity): the threads take
// them round-robin across peers, so one peer's backlog delays another's retrieve by about one
// embedding. Beyond max_waiting_retrieves_per_peer of one peer, or max_waiting_retrieves in all,
// a retrieve is answered kResourceExhausted at once. One whose caller's deadline (the request's
// timeoutMs) passed while it waited is answered kTimeout without being run.
//
// Cluster mode with a log of record (ServiceOptions::record_log, docs/cluster.md): each mutation's
// record becomes the next entry of its agent's log (MemoryStore::set_log_position), goes to the
// local WAL as a cache, and is written to the log of record with the batch's other mutations in
// ONE transaction (group commit: what arrives while a commit runs forms the next batch), with the
// store mutex held; the calls are answered after it. A shard whose part was refused (fenced by a
// newer owner) or failed gets its calls of the batch answered kUnavailable, and every agent that
// had an entry in it is dropped from memory: nothing that was refused stays visible.
//
// Request ids (docs/protocol.md, "Resending a mutation"): a mutation that carries a client's
// request id (Request.clientId/clientSeq) is recorded with it (MemoryStore::set_request: in the
// WAL and the log of record, so replay keeps it); one whose id its agent already applied is
// answered as the first time and not applied again (mutations_deduplicated counts them).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "services/manager/server/fair_queue.h"
#include "services/manager/server/record_log.h"
#include "services/manager/store/memory_store.h"
#include "shared/client/protocols.h"
#include "shared/common/status.h"
#include "shared/rpc/rpc_server.h"

namespace keep::manager {

// The WAL as the handler sees it.
class BatchCommitter {
 public:
  virtual ~BatchCommitter() = default;
  // Appends one record (buffered; not yet durable).
  virtual Status append(std::string_view record) = 0;
  // Makes every record appended so far durable (one fdatasync: group commit).
  virtual Status sync() = 0;
};

// Where a region entry lives (the wire's EntryDescriptor).
struct EntryLocation {
  uint32_t index = 0;
  uint64_t generation = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint32_t tokens = 0;
};

// The shared KV region as the handler sees it (implemented over keep::kv::KvRegion).
class KvRegionOps {
 public:
  virtual ~KvRegionOps() = default;
  // Reserves an entry of `tokens` tokens for `job` (the implementation derives the EntryKey from
  // the job: agent, kind, object id/versions), owned by worker `owner_id` for `lease`.
  virtual Result<EntryLocation> reserve(const KvJob& job, uint32_t tokens, uint64_t owner_id,
                                        std::chrono::milliseconds lease) = 0;
  virtual Status commit(uint32_t index, uint64_t generation) = 0;
  virtual Status revoke(uint32_t index, uint64_t generation) = 0;
  virtual Status renew(uint32_t index, uint64_t generation, std::chrono::milliseconds lease) = 0;
  // Frees a committed entry the store no longer uses.
  virtual Status release(uint32_t index, uint64_t generation) = 0;
  // The location of a committed entry (retrieve answers); an error means "no KV" for the caller.
  virtual Result<EntryLocation> locate(uint32_t index, uint64_t generation) = 0;
};

struct ServiceOptions {
  std::chrono::milliseconds lease{30000};        // reservation lease handed to workers
  std::chrono::milliseconds job_timeout{60000};  // fetched but not reserved: failed after this
  uint32_t max_fetch_jobs = 256;                 // a larger fetchJobs max is clamped
  std::string server_version = "keep-manager";   // ping answer (protocol version appended)
  // Extra name/value pairs for the stats answer (region use, WAL position ...), optional.
  std::function<void(std::vector<std::pair<std::string, uint64_t>>*)> extra_stats;
  int retrieve_threads = 2;  // start_deferred_retrieves' threads (at least 1)
  // Deferred retrieves waiting for a thread, in all and of one peer (0: no bound).
  size_t max_waiting_retrieves = 1024;
  size_t max_waiting_retrieves_per_peer = 64;
  // Cluster mode: ok when this node serves `agent`, else the answer for every request about it
  // (kMoved naming the owner, kUnavailable while nobody owns it). Unset: every agent is ours.
  std::function<Status(std::string_view agent)> route_agent;
  // Cluster mode with a log of record (see the top): routes agents in place of route_agent and
  // makes every mutation durable in it before it is answered. Must outlive the service.
  RecordLog* record_log = nullptr;
};

using ManagerCall = wire::Call<client::ManagerProtocol>;
using ManagerRpcServer = wire::RpcServer<client::ManagerProtocol>;

class ManagerService : public wire::RequestHandler<client::ManagerProtocol> {
 public:
  // `store` must outlive the service; `committer` and `region` may be null (no durability / no
  // KV region: the job calls then answer kUnavailable and retrieve returns no KV).
  ManagerService(MemoryStore* store, BatchCommitter* committer, KvRegionOps* region,
                 ServiceOptions options = {});
  ~ManagerService() override;

  void handle_batch(std::span<ManagerCall> calls) override;
  void on_idle() override;

  // Answers retrieves that must embed on options.retrieve_threads threads of the service's own
  // (see the top of this file), each answer handed to `complete` (RpcServer::complete). Call
  // once, before the server starts.
  void start_deferred_retrieves(std::function<void(std::unique_ptr<ManagerCall>)> complete);
  // Shutting down: the retrieves still queued are answered kUnavailable at once, the running
  // ones finish with their results, and a retrieve that would be deferred from now on is answered
  // kUnavailable; returns once every one was handed to `complete`, the threads joined. Call
  // before the server is destroyed (it sends what it was given back, also after stop()); the
  // destructor calls it too.
  void stop_deferred_retrieves();
  // Retrieves handed to the retrieve threads since the start, those not yet taken up, and
  // those refused (queue full) or dropped (deadline passed while waiting) since the start.
  struct DeferredRetrieves {
    uint64_t total = 0;
    size_t waiting = 0;
    size_t waiting_max_per_peer = 0;  // the longest queue of one peer
    uint64_t refused = 0;
    uint64_t expired = 0;
  };
  DeferredRetrieves deferred_retrieves() const;

  std::mutex& store_mutex() { return mu_; }
  // After a failed append or sync the WAL no longer matches memory: mutations are refused with
  // kUnavailable from then on (reads still work) until the daemon restarts and recovers.
  bool degraded() const { return degraded_; }
  size_t jobs_in_flight() const;
  // Mutations answered from their request id's first answer, not applied again, since the start.
  uint64_t mutations_deduplicated() const;

  // Housekeeping at `now` (on_idle() uses the clock): fails jobs whose reservation lease ran out
  // or that were never reserved within job_timeout. Returns how many were failed.
  size_t expire_jobs(std::chrono::steady_clock::time_point now);

 private:
  struct JobState {
    KvJob job;
    uint64_t worker_id = 0;
    std::chrono::steady_clock::time_point deadline;  // reservation or job timeout
    bool reserved = false;
    EntryLocation entry;
  };

  // Cluster mode: the entries of one batch for the log of record, and which shard each call of
  // the batch was about.
  struct LogBatch {
    std::vector<RecordLog::ShardBatch> shards;
    std::vector<std::optional<uint32_t>> call_shard;  // by call index
    size_t call = 0;                                  // the call being handled
    std::optional<RecordLog::Route> route;            // its agent's route
  };

  // Answers one call; returns true when the call produced a WAL record that must be synced
  // before the answer is sent.
  bool handle_one(ManagerCall& call);
  void release_entries_locked();
  Status mutation_allowed() const;
  Status append_locked(const std::string& record);
  // A mutation's record of `agent` (empty: a no-op): to the WAL, and in cluster mode with a log
  // of record first to the agent's log (the batch's commit makes it durable).
  Status log_mutation_locked(std::string_view agent, const std::string& record);
  // Commits log_batch_ and undoes what a failed shard's part applied (see the top).
  void commit_log_locked(std::span<ManagerCall> calls);
  // A mutation (`op` of `agent`) whose request id the agent already applied: answers it as the
  // first time, or refuses an id used by another op, and returns handle_one's result; nullopt
  // when the request carries no id or a new one.
  std::optional<bool> answer_resend_locked(ManagerCall& call, const std::string& agent,
                                           MutationOp op);
  // The mutation that produced *record (non-empty) was answered `result`: with a request id, the
  // id goes into the agent's window and *record is wrapped with it (MemoryStore::set_request).
  void record_request_locked(const proto::Request::Reader& req, const std::string& agent,
                             const WriteResult& result, std::string* record);

  // A deferred retrieve: the call, its arguments, what it must embed.
  struct RetrieveJob {
    std::unique_ptr<ManagerCall> call;
    std::string agent;
    std::string query;
    MemoryStore::RetrieveNeeds needs;
  };
  // Queues a retrieve for the threads (the call deferred), or says why not (the call untouched).
  Status defer_retrieve(ManagerCall& call, std::string agent, std::string query,
                        MemoryStore::RetrieveNeeds needs);
  // Answers kTimeout the retrieves whose caller's deadline passed while they waited.
  void answer_expired(std::vector<RetrieveJob> expired);
  void retrieve_loop();
  static Status shutting_down();  // a retrieve refused by stop_deferred_retrieves
  void run_retrieve(RetrieveJob& job);
  // The retrieve answer for `segments` (with the mutex held: the region's locations).
  void fill_retrieve(ManagerCall& call, const std::vector<RetrievedSegment>& segments);

  void do_fetch_jobs(ManagerCall& call);
  void do_reserve(ManagerCall& call);
  void do_commit(ManagerCall& call);
  void do_revoke(ManagerCall& call);
  void do_renew(ManagerCall& call);
  Result<JobState*> find_job(uint64_t worker_id, uint64_t job_id);

  MemoryStore* store_;
  BatchCommitter* committer_;
  KvRegionOps* region_;
  ServiceOptions options_;
  mutable std::mutex mu_;
  bool degraded_ = false;
  std::unordered_map<uint64_t, JobState> jobs_;  // handed out and not finished
  LogBatch log_batch_;                           // of the batch being handled
  uint64_t deduplicated_ = 0;                    // mutations_deduplicated()

  std::function<void(std::unique_ptr<ManagerCall>)> complete_;  // set: retrieves may be deferred
  mutable std::mutex retrieve_mu_;
  uint64_t retrieves_deferred_ = 0;
  uint64_t retrieves_refused_ = 0;
  uint64_t retrieves_expired_ = 0;
  std::condition_variable retrieve_cv_;
  FairQueue<RetrieveJob> retrieve_queue_;  // keyed by peer
  bool retrieve_stop_ = false;
  std::vector<std::thread> retrieve_threads_;
};

}  // namespace keep::manager
