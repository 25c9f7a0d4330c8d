#include "services/manager/daemon/manager_daemon.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "services/manager/daemon/cluster_log.h"
#include "services/manager/durability/data_dir_lock.h"
#include "services/manager/durability/snapshot_file.h"
#include "services/manager/durability/wal_reader.h"
#include "services/manager/durability/wal_writer.h"
#include "services/manager/encoder/bert_encoder.h"
#include "services/manager/server/manager_service.h"
#include "services/manager/store/memory_store.h"
#include "shared/cluster/shard_keeper.h"
#include "shared/common/log.h"
#include "shared/kvregion/kv_region.h"
#include "shared/metrics/http_server.h"
#include "shared/metrics/metrics.h"
#include "shared/model/model_identity.h"
#include "shared/rpc/rpc_server.h"
#include "shared/tokenizer/bpe_tokenizer.h"

namespace keep::manager {
namespace {

constexpr const char* kLog = "manager";
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- adapters from the real components to the store's and the service's interfaces ------------

class EncoderEmbedder final : public Embedder {
 public:
  explicit EncoderEmbedder(std::unique_ptr<BertEncoder> enc) : enc_(std::move(enc)) {}
  int dim() const override { return enc_->dim(); }
  Result<std::vector<std::vector<float>>> embed(const std::vector<std::string>& texts) override {
    return enc_->encode(texts);
  }

 private:
  std::unique_ptr<BertEncoder> enc_;
};

class TokenizerCounter final : public TokenCounter {
 public:
  explicit TokenizerCounter(tok::BpeTokenizer tok) : tok_(std::move(tok)) {}
  uint32_t count_tokens(std::string_view text) const override {
    return static_cast<uint32_t>(tok_.count_tokens(text));
  }

 private:
  tok::BpeTokenizer tok_;
};

// The WAL behind the handler's BatchCommitter. WalWriter is single-threaded; the handler's I/O
// thread, the embedding thread and housekeeping all reach it, so one mutex guards it.
class WalCommitter final : public BatchCommitter {
 public:
  explicit WalCommitter(std::unique_ptr<WalWriter> w) : w_(std::move(w)) {}
  Status append(std::string_view record) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto lsn = w_->append(record);
    if (!lsn.is_ok()) return lsn.status();
    ++since_snapshot_;
    return Status::ok();
  }
  Status sync() override {
    std::lock_guard<std::mutex> lock(mu_);
    return w_->sync();
  }
  uint64_t last_lsn() const {
    std::lock_guard<std::mutex> lock(mu_);
    return w_->next_lsn() - 1;
  }
  uint64_t since_snapshot() const {
    std::lock_guard<std::mutex> lock(mu_);
    return since_snapshot_;
  }
  void snapshot_taken(uint64_t records_covered) {
    std::lock_guard<std::mutex> lock(mu_);
    since_snapshot_ = since_snapshot_ > records_covered ? since_snapshot_ - records_covered : 0;
  }
  Result<size_t> drop_before(uint64_t lsn) {
    std::lock_guard<std::mutex> lock(mu_);
    return w_->drop_segments_before(lsn);
  }
  WalWriterStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return w_->stats();
  }

 private:
  mutable std::mutex mu_;
  std::unique_ptr<WalWriter> w_;
  uint64_t since_snapshot_ = 0;
};

// The region behind the handler's KvRegionOps. Locations of entries are remembered from
// reserve(), so retrieve can answer where a committed entry lives without touching the directory.
class RegionOps final : public KvRegionOps {
 public:
  // The region comes after the endpoints are bound (set_region), before the first request.
  void set_region(kv::KvRegion* region) { region_ = region; }

  Result<EntryLocation> reserve(const KvJob& job, uint32_t tokens, uint64_t owner_id,
                                std::chrono::milliseconds lease) override {
    if (job.segments.empty()) return Status(Code::kInvalidArgument, "job has no segments");
    kv::EntryKey key;
    key.agent_hash = kv::fnv1a_64(job.agent);
    if (job.kind == KvJobKind::kGroup) {
      key.kind = kv::EntryKind::kGroup;
      key.object_id = job.group_id;
      key.object_version = 0;
    } else {
      key.kind = kv::EntryKind::kSegment;
      key.object_id = job.segments[0].id;
      key.object_version = job.segments[0].version;
    }
    key.group_version = job.group_version;
    KEEP_ASSIGN_OR_RETURN(kv::EntryDescriptor d, region_->reserve(key, tokens, owner_id, lease));
    EntryLocation loc{d.index, d.generation, d.offset, d.bytes, d.tokens};
    std::lock_guard<std::mutex> lock(mu_);
    known_[d.index] = Known{loc, false};
    return loc;
  }
  Status commit(uint32_t index, uint64_t generation) override {
    KEEP_RETURN_IF_ERROR(region_->commit(index, generation));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = known_.find(index);
    if (it != known_.end() && it->second.loc.generation == generation) it->second.committed = true;
    return Status::ok();
  }
  Status revoke(uint32_t index, uint64_t generation) override {
    forget(index, generation);
    return region_->revoke(index, generation);
  }
  Status renew(uint32_t index, uint64_t generation, std::chrono::milliseconds lease) override {
    return region_->renew_lease(index, generation, lease);
  }
  Status release(uint32_t index, uint64_t generation) override {
    forget(index, generation);
    return region_->release(index, generation);
  }
  Result<EntryLocation> locate(uint32_t index, uint64_t generation) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = known_.find(index);
    if (it == known_.end() || it->second.loc.generation != generation || !it->second.committed) {
      return Status(Code::kStale, "KV entry " + std::to_string(index) + " is not committed");
    }
    return it->second.loc;
  }

 private:
  struct Known {
    EntryLocation loc;
    bool committed = false;
  };
  void forget(uint32_t index, uint64_t generation) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = known_.find(index);
    if (it != known_.end() && it->second.loc.generation == generation) known_.erase(it);
  }
  kv::KvRegion* region_ = nullptr;
  std::mutex mu_;
  std::unordered_map<uint32_t, Known> known_;  // by entry index (a reused index overwrites)
};

// Request names for metric labels, indexed by the Request union's discriminant.
const char* request_name(proto::Request::Which w) {
  switch (w) {
    case proto::Request::NONE:
      return "none";
    case proto::Request::WRITE_MEMORY:
      return "write";
    case proto::Request::UPDATE_MEMORY:
      return "update";
    case proto::Request::DELETE_MEMORY:
      return "delete";
    case proto::Request::ADVANCE_STEP:
      return "advance_step";
    case proto::Request::RETRIEVE:
      return "retrieve";
    case proto::Request::LIST_GROUPS:
      return "list_groups";
    case proto::Request::LIST_MEMORIES:
      return "list_memories";
    case proto::Request::STATS:
      return "stats";
    case proto::Request::FETCH_JOBS:
      return "fetch_jobs";
    case proto::Request::RESERVE_ENTRY:
      return "reserve_entry";
    case proto::Request::COMMIT_ENTRY:
      return "commit_entry";
    case proto::Request::REVOKE_ENTRY:
      return "revoke_entry";
    case proto::Request::RENEW_LEASE:
      return "renew_lease";
    case proto::Request::PING:
      return "ping";
  }
  return "unknown";
}

// Wraps the service: counts requests by type and outcome and times them. A call's latency is the
// time of the batch it was handled in (apply + WAL append + fsync), which is what its client waits;
// a deferred call's (a retrieve that embeds) runs from its arrival to its answer.
class InstrumentedHandler final : public wire::RequestHandler<client::ManagerProtocol> {
 public:
  InstrumentedHandler(ManagerService* svc, metrics::Registry* reg)
      : svc_(svc),
        requests_(reg->counter("keep_manager_requests_total",
                               "Requests handled, by type and result code", {"type", "code"})),
        latency_(reg->histogram("keep_manager_request_duration_seconds",
                                "Server-side time of a request (its batch: apply, WAL, fsync)",
                                {"type"})),
        batch_size_(reg->histogram("keep_manager_batch_size", "Requests per handled batch", {},
                                   metrics::exponential_buckets(1, 2, 10))) {}

  void handle_batch(std::span<ManagerCall> calls) override {
    auto t0 = Clock::now();
    svc_->handle_batch(calls);
    double dt = seconds_since(t0);
    batch_size_.get().observe(static_cast<double>(calls.size()));
    for (auto& call : calls) {
      if (!call.deferred()) count(call, dt);  // a deferred one counts when answered
    }
  }
  void on_idle() override { svc_->on_idle(); }
  void on_deferred_done(ManagerCall& call) override { count(call, seconds_since(call.received())); }

 private:
  void count(ManagerCall& call, double seconds) {
    const char* type = request_name(call.request().which());
    const char* code = "ok";
    if (call.answered()) {
      auto resp = call.reply().asReader();
      if (resp.which() == proto::Response::ERROR) {
        code = code_name(wire::from_wire(resp.getError().getCode()));
      }
    }
    requests_.labels({type, code}).inc();
    latency_.labels({type}).observe(seconds);
  }

  ManagerService* svc_;
  metrics::CounterFamily& requests_;
  metrics::HistogramFamily& latency_;
  metrics::HistogramFamily& batch_size_;
};

}  // namespace

struct ManagerDaemon::Impl {
  ManagerConfig config;
  std::unique_ptr<DataDirLock> data_lock;  // first member: released last, after the final snapshot
  metrics::Registry registry;
  std::unique_ptr<EncoderEmbedder> embedder;
  std::unique_ptr<TokenizerCounter> counter;
  std::unique_ptr<MemoryStore> store;
  std::unique_ptr<WalCommitter> wal;
  std::unique_ptr<kv::KvRegion> region;
  std::unique_ptr<RegionOps> region_ops;
  std::unique_ptr<ManagerService> service;
  std::unique_ptr<InstrumentedHandler> handler;
  std::unique_ptr<ManagerRpcServer> server;
  std::unique_ptr<metrics::MetricsHttpServer> http;
  // Cluster mode: this node's shards (null: one node). `keeper_ptr` is what the request path
  // reads: set once the keeper runs, cleared before it goes.
  std::unique_ptr<cluster::ShardKeeper> keeper;
  std::atomic<cluster::ShardKeeper*> keeper_ptr{nullptr};
  // Cluster mode with --pg: the log of record (null: the local WAL is the record).
  std::unique_ptr<ClusterLog> cluster_log;

  std::atomic<bool> stopping{false};
  std::mutex bg_mu;
  std::condition_variable bg_cv;
  std::thread embed_thread;
  std::thread housekeeping_thread;
  std::mutex snapshot_mu;  // one snapshot at a time

  metrics::HistogramFamily* fsync_seconds = nullptr;
  metrics::HistogramFamily* embed_seconds = nullptr;
  metrics::CounterFamily* embedded_total = nullptr;
  metrics::CounterFamily* snapshots_total = nullptr;
  metrics::HistogramFamily* snapshot_seconds = nullptr;
  metrics::CounterFamily* reaped_total = nullptr;
  std::atomic<bool> region_linked{true};

  std::string wal_dir() const { return config.data_dir + "/wal"; }
  std::string snapshot_dir() const { return config.data_dir + "/snapshots"; }

  Status recover();
  Status take_snapshot();
  void embed_loop();
  void housekeeping_loop();
  void check_region_linked();
  void register_metrics();
  void shutdown();
};

Status ManagerDaemon::Impl::recover() {
  auto t0 = Clock::now();
  uint64_t from_lsn = 1;
  KEEP_ASSIGN_OR_RETURN(auto snap, read_latest_snapshot(snapshot_dir()));
  if (snap.has_value()) {
    KEEP_RETURN_IF_ERROR(
        store->deserialize(snap->payload).with_context("loading snapshot " + snap->file));
    from_lsn = snap->last_lsn + 1;
    KEEP_LOG_INFO(kLog, "snapshot %s loaded (up to LSN %llu)", snap->file.c_str(),
                  static_cast<unsigned long long>(snap->last_lsn));
  }
  ReplayStats rs;
  KEEP_RETURN_IF_ERROR(wal_replay(
                           wal_dir(), from_lsn,
                           [&](uint64_t lsn, std::string_view payload) {
                             return store->apply_record(payload).with_context("WAL record " +
                                                                              std::to_string(lsn));
                           },
                           &rs)
                           .with_context("replaying the WAL"));
  if (rs.truncated_bytes > 0) {
    KEEP_LOG_WARN(kLog, "recovery dropped a torn WAL tail of %llu bytes in %s",
                  static_cast<unsigned long long>(rs.truncated_bytes), rs.truncated_file.c_str());
  }
  WalOptions wo;
  wo.dir = wal_dir();
  wo.fsync = config.fsync;
  wo.segment_bytes = config.wal_segment_bytes;
  wo.next_lsn = std::max<uint64_t>(rs.next_lsn, from_lsn);
  metrics::HistogramFamily* h = fsync_seconds;
  wo.on_sync = [h](double s) { h->get().observe(s); };
  KEEP_ASSIGN_OR_RETURN(auto writer, WalWriter::open(std::move(wo)));
  wal = std::make_unique<WalCommitter>(std::move(writer));
  StoreStats st = store->stats();
  KEEP_LOG_INFO(
      kLog, "recovered %llu memories of %llu agents (%llu WAL records replayed) in %.3f s",
      static_cast<unsigned long long>(st.memories), static_cast<unsigned long long>(st.agents),
      static_cast<unsigned long long>(rs.records_replayed), seconds_since(t0));
  return Status::ok();
}

Status ManagerDaemon::Impl::take_snapshot() {
  std::lock_guard<std::mutex> one(snapshot_mu);
  auto t0 = Clock::now();
  StoreSnapshot state;
  uint64_t lsn = 0;
  uint64_t covered = 0;
  {
    // Writes and retrieves wait while the store is copied, not while the copy is encoded
    // (bench_snapshot: 38 ms instead of serialize()'s 303 at 100,000 memories).
    std::lock_guard<std::mutex> lock(service->store_mutex());
    state = store->capture();
    lsn = wal->last_lsn();
    covered = wal->since_snapshot();
  }
  const std::string payload = encode_snapshot(state);
  state = StoreSnapshot();  // the copy's memory back before the file is written
  // Every record the snapshot reflects must be durable before the WAL behind it may go.
  KEEP_RETURN_IF_ERROR(wal->sync().with_context("snapshot"));
  KEEP_ASSIGN_OR_RETURN(SnapshotWriteInfo info,
                        write_snapshot(snapshot_dir(), lsn, payload, config.fsync));
  wal->snapshot_taken(covered);
  auto dropped = wal->drop_before(info.oldest_retained_lsn + 1);
  if (!dropped.is_ok()) {
    KEEP_LOG_WARN(kLog, "dropping old WAL files: %s", dropped.status().to_string().c_str());
  }
  snapshots_total->get().inc();
  snapshot_seconds->get().observe(seconds_since(t0));
  KEEP_LOG_INFO(kLog, "snapshot at LSN %llu: %llu bytes in %.3f s",
                static_cast<unsigned long long>(lsn), static_cast<unsigned long long>(info.bytes),
                seconds_since(t0));
  return Status::ok();
}

void ManagerDaemon::Impl::embed_loop() {
  // The encoder is the heaviest CPU user and is off the request path: let the I/O thread win
  // the CPU when both are runnable (Linux nice values are per thread).
  if (setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10) != 0) {
    KEEP_LOG_DEBUG(kLog, "could not lower the embedding thread's priority");
  }
  while (!stopping.load()) {
    std::vector<PendingEmbedding> pending;
    {
      std::lock_guard<std::mutex> lock(service->store_mutex());
      pending = store->pending_embeddings(config.embed_batch);
    }
    if (pending.empty()) {
      std::unique_lock<std::mutex> lk(bg_mu);
      bg_cv.wait_for(lk, std::chrono::milliseconds(10), [&] { return stopping.load(); });
      continue;
    }
    std::vector<std::string> texts;
    texts.reserve(pending.size());
    for (const auto& p : pending) texts.push_back(p.text);
    auto t0 = Clock::now();
    auto vecs = embedder->embed(texts);
    if (!vecs.is_ok()) {
      KEEP_LOG_ERROR(kLog, "background embedding failed: %s", vecs.status().to_string().c_str());
      std::unique_lock<std::mutex> lk(bg_mu);
      bg_cv.wait_for(lk, std::chrono::seconds(1), [&] { return stopping.load(); });
      continue;
    }
    embed_seconds->get().observe(seconds_since(t0));
    std::vector<SegmentEmbedding> embs;
    embs.reserve(pending.size());
    for (size_t i = 0; i < pending.size(); ++i) {
      embs.push_back({pending[i].agent, pending[i].id, pending[i].version, std::move((*vecs)[i]),
                      pending[i].seq});
    }
    std::lock_guard<std::mutex> lock(service->store_mutex());
    std::string record;
    auto n = store->apply_embeddings(embs, &record);
    if (!n.is_ok()) {
      KEEP_LOG_ERROR(kLog, "applying embeddings: %s", n.status().to_string().c_str());
      continue;
    }
    embedded_total->get().inc(static_cast<double>(*n));
    if (!record.empty()) {
      // Derived state: durable with the next batch's sync; lost on a crash, it is recomputed.
      Status st = wal->append(record);
      if (!st.is_ok()) KEEP_LOG_ERROR(kLog, "WAL append (embeddings): %s", st.to_string().c_str());
    }
  }
}

void ManagerDaemon::Impl::housekeeping_loop() {
  while (!stopping.load()) {
    {
      std::unique_lock<std::mutex> lk(bg_mu);
      bg_cv.wait_for(lk, std::chrono::milliseconds(200), [&] { return stopping.load(); });
    }
    if (stopping.load()) break;
    check_region_linked();
    size_t reaped = region->reap_expired();
    if (reaped > 0) {
      reaped_total->get().inc(static_cast<double>(reaped));
      KEEP_LOG_INFO(kLog, "reclaimed %zu KV reservations whose lease expired", reaped);
    }
    if (config.snapshot_every > 0 && wal->since_snapshot() >= config.snapshot_every) {
      Status st = take_snapshot();
      if (!st.is_ok()) KEEP_LOG_ERROR(kLog, "snapshot failed: %s", st.to_string().c_str());
    }
  }
}

// An operator's rm /dev/shm/<name> (or a region put in its place) leaves this daemon serving a
// region no worker can attach to: say so once, loudly, and show it in /metrics.
void ManagerDaemon::Impl::check_region_linked() {
  const bool now = region->linked();
  if (region_linked.exchange(now) == now) return;
  if (now) {
    KEEP_LOG_INFO(kLog, "KV region /dev/shm/%s is linked again", config.shm_name.c_str());
  } else {
    KEEP_LOG_ERROR(kLog,
                   "KV region /dev/shm/%s was removed or replaced by another process: workers "
                   "cannot attach to this manager's region; restart keep-manager",
                   config.shm_name.c_str());
  }
}

void ManagerDaemon::Impl::register_metrics() {
  fsync_seconds = &registry.histogram("keep_manager_wal_fsync_seconds",
                                      "Time of one WAL fdatasync (one per batch of writes)", {},
                                      metrics::exponential_buckets(0.00005, 2, 16));
  embed_seconds = &registry.histogram("keep_manager_embed_batch_seconds",
                                      "Time to embed one background batch of segments");
  embedded_total = &registry.counter("keep_manager_embeddings_total",
                                     "Segment embeddings computed and installed");
  snapshots_total = &registry.counter("keep_manager_snapshots_total", "Snapshots written");
  snapshot_seconds =
      &registry.histogram("keep_manager_snapshot_seconds", "Time to write one snapshot");
  reaped_total = &registry.counter("keep_manager_kv_reservations_reaped_total",
                                   "KV reservations reclaimed after their lease expired");

  auto& agents = registry.gauge("keep_manager_agents", "Agent namespaces");
  auto& memories = registry.gauge("keep_manager_memories", "Memory segments stored");
  auto& groups = registry.gauge("keep_manager_groups", "Semantic groups by state", {"state"});
  auto& pending =
      registry.gauge("keep_manager_embeddings_pending", "Segments waiting for their embedding");
  registry
      .gauge("keep_manager_embeddings_pending_limit",
             "Pending embeddings beyond which writes are refused (0: no limit)")
      .get()
      .set(static_cast<double>(config.store.max_pending_embeddings));
  auto& jobs = registry.gauge("keep_manager_kv_jobs", "KV jobs by state", {"state"});
  auto& transitions = registry.counter("keep_manager_group_transitions_total",
                                       "Group state transitions, by the state entered", {"to"});
  auto& jobs_done = registry.counter("keep_manager_kv_jobs_finished_total",
                                     "KV jobs finished, by outcome", {"outcome"});
  auto& evictions = registry.counter(
      "keep_manager_kv_evictions_total",
      "KV entries released least recently used first to make room in a full region");
  auto& shards_owned = registry.gauge(
      "keep_manager_cluster_shards_owned",
      "Cluster mode: shards (agents' hash buckets) this node serves now (0 in single-node mode)");
  auto& shards_ready = registry.gauge(
      "keep_manager_cluster_shards_ready",
      "Cluster mode with --pg: owned shards whose log was replayed, so that they are served");
  auto& arena = registry.gauge("keep_manager_arena_bytes", "KV arena bytes by use", {"state"});
  auto& entries =
      registry.gauge("keep_manager_kv_entries", "KV region entries by state", {"state"});
  auto& wal_records =
      registry.counter("keep_manager_wal_records_total", "Records appended to the WAL since start");
  auto& wal_bytes =
      registry.counter("keep_manager_wal_bytes_total", "Bytes appended to the WAL since start");
  auto& cache = registry.counter("keep_manager_query_cache_total", "Query embedding cache lookups",
                                 {"result"});
  auto& deferred = registry.counter(
      "keep_manager_retrieves_deferred_total",
      "Retrieves answered by the retrieve threads (they had a query or segments to embed)");
  auto& waiting = registry.gauge("keep_manager_retrieves_waiting",
                                 "Deferred retrieves not yet taken up by a retrieve thread");
  auto& degraded = registry.gauge(
      "keep_manager_degraded", "1 when the WAL failed and mutations are refused until a restart");
  auto& linked = registry.gauge(
      "keep_manager_kv_region_linked",
      "1 while /dev/shm/<shm-name> is this manager's region (0: removed or replaced)");
  auto& waiting_max = registry.gauge("keep_manager_retrieves_waiting_max_per_client",
                                     "Deferred retrieves waiting of the client with the most");
  auto& expired = registry.counter(
      "keep_manager_retrieves_expired_total",
      "Deferred retrieves answered timeout unrun: their caller's timeoutMs passed while waiting");
  auto& dropped = registry.counter(
      "keep_manager_replies_dropped_total",
      "Answers not sent: the client was gone, or its queue of answers full or stalled");
  auto& refused_unread =
      registry.counter("keep_manager_requests_refused_unread_total",
                       "Requests refused unhandled because their client does not read its answers");
  auto& queued_bytes = registry.gauge("keep_manager_reply_queued_bytes",
                                      "Answer bytes queued by the server beyond ZeroMQ's pipes");
  auto& deduplicated = registry.counter(
      "keep_manager_mutations_deduplicated_total",
      "Mutations resent with a request id already applied: answered as the first time, not "
      "applied again");

  // Counters mirror monotonic totals kept by the components: add the delta at each scrape.
  struct Last {
    double to_static = 0, to_dynamic = 0, completed = 0, stale = 0, failed = 0, evicted = 0,
           records = 0, bytes = 0, hits = 0, misses = 0, deferred = 0, expired = 0, dropped = 0,
           unread = 0, deduplicated = 0;
  };
  auto last = std::make_shared<Last>();
  auto bump = [](metrics::Counter& c, double now, double* prev) {
    if (now > *prev) c.inc(now - *prev);
    *prev = now;
  };
  registry.add_collect_hook([this, &agents, &memories, &groups, &pending, &jobs, &transitions,
                             &jobs_done, &evictions, &shards_owned, &shards_ready, &arena, &entries,
                             &wal_records, &wal_bytes, &cache, &deferred, &waiting, &degraded,
                             &linked, &waiting_max, &expired, &dropped, &refused_unread,
                             &queued_bytes, &deduplicated, last, bump] {
    if (!service || !region) return;  // still starting: the endpoints are bound before the region
    StoreStats s;
    {
      std::lock_guard<std::mutex> lock(service->store_mutex());
      s = store->stats();
      degraded.get().set(service->degraded() ? 1 : 0);
    }
    linked.get().set(region_linked.load() ? 1 : 0);
    agents.get().set(static_cast<double>(s.agents));
    memories.get().set(static_cast<double>(s.memories));
    groups.labels({"static"}).set(static_cast<double>(s.groups_static));
    groups.labels({"dynamic"}).set(static_cast<double>(s.groups_dynamic));
    pending.get().set(static_cast<double>(s.pending_embeddings));
    jobs.labels({"queued"}).set(static_cast<double>(s.jobs_queued));
    jobs.labels({"running"}).set(static_cast<double>(s.jobs_running));
    bump(transitions.labels({"static"}), static_cast<double>(s.transitions_to_static),
         &last->to_static);
    bump(transitions.labels({"dynamic"}), static_cast<double>(s.transitions_to_dynamic),
         &last->to_dynamic);
    bump(jobs_done.labels({"completed"}), static_cast<double>(s.jobs_completed), &last->completed);
    bump(jobs_done.labels({"stale"}), static_cast<double>(s.jobs_stale), &last->stale);
    bump(jobs_done.labels({"failed"}), static_cast<double>(s.jobs_failed), &last->failed);
    bump(evictions.get(), static_cast<double>(s.kv_evictions), &last->evicted);
    cluster::ShardKeeper* k = keeper_ptr.load();
    shards_owned.get().set(k == nullptr ? 0.0 : static_cast<double>(k->owned()));
    shards_ready.get().set(cluster_log ? static_cast<double>(cluster_log->shards_ready()) : 0.0);
    bump(cache.labels({"hit"}), static_cast<double>(s.query_cache_hits), &last->hits);
    bump(cache.labels({"miss"}), static_cast<double>(s.query_cache_misses), &last->misses);
    const ManagerService::DeferredRetrieves dr = service->deferred_retrieves();
    bump(deferred.get(), static_cast<double>(dr.total), &last->deferred);
    waiting.get().set(static_cast<double>(dr.waiting));
    waiting_max.get().set(static_cast<double>(dr.waiting_max_per_peer));
    bump(expired.get(), static_cast<double>(dr.expired), &last->expired);
    bump(deduplicated.get(), static_cast<double>(service->mutations_deduplicated()),
         &last->deduplicated);
    if (server) {
      const wire::ServerStats ss = server->stats();
      bump(dropped.get(), static_cast<double>(ss.replies_dropped), &last->dropped);
      bump(refused_unread.get(), static_cast<double>(ss.refused_unread), &last->unread);
      queued_bytes.get().set(static_cast<double>(ss.reply_queued_bytes));
    }
    kv::RegionStats r = region->stats();
    arena.labels({"used"}).set(static_cast<double>(r.bytes_used));
    arena.labels({"free"}).set(static_cast<double>(r.bytes_free));
    entries.labels({"free"}).set(r.entries_free);
    entries.labels({"reserved"}).set(r.entries_reserved);
    entries.labels({"committed"}).set(r.entries_committed);
    WalWriterStats w = wal->stats();
    bump(wal_records.get(), static_cast<double>(w.records), &last->records);
    bump(wal_bytes.get(), static_cast<double>(w.bytes), &last->bytes);
  });
}

void ManagerDaemon::Impl::shutdown() {
  stopping.store(true);
  keeper_ptr.store(nullptr);  // requests about agents are answered unavailable from now on
  if (cluster_log) cluster_log->stop();  // the same with --pg; no takeover from now on
  bg_cv.notify_all();
  if (embed_thread.joinable()) embed_thread.join();
  if (housekeeping_thread.joinable()) housekeeping_thread.join();
  // The retrieves still deferred are answered (the queued ones kUnavailable) before the server
  // goes: its destructor sends the last of them.
  if (service) service->stop_deferred_retrieves();
  if (server) server->stop();
  http.reset();  // before the server: a scrape reads its counters
  // Leave the cluster (after the last scrape read the keeper): the shards go to the other nodes
  // at once, not a lease later.
  keeper.reset();
  server.reset();  // joins the I/O thread if it runs one
  if (wal && service) {
    Status st = take_snapshot();
    if (!st.is_ok()) KEEP_LOG_ERROR(kLog, "final snapshot failed: %s", st.to_string().c_str());
  }
}

Result<std::unique_ptr<ManagerDaemon>> ManagerDaemon::start(const ManagerConfig& config) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  Impl& d = *impl;
  // Order matters: nothing may touch the data directory, the endpoints' owners or the region
  // before this process owns the directory, and the region is replaced only once every endpoint is
  // ours, so a second daemon started by mistake fails before it can harm the first.
  KEEP_ASSIGN_OR_RETURN(d.data_lock, DataDirLock::acquire(config.data_dir));
  d.register_metrics();

  auto t0 = Clock::now();
  KEEP_ASSIGN_OR_RETURN(auto enc, BertEncoder::load(config.encoder_dir));
  d.embedder = std::make_unique<EncoderEmbedder>(std::move(enc));
  // The planner model as keep-worker loads it, weights aside: its tokenizer counts tokens and
  // the region's fingerprint is the one the worker derives from the same model.
  auto identity = engine::read_model_identity(config.model_path);
  if (!identity.is_ok()) return identity.status().with_context("--model");
  engine::ModelIdentity model = std::move(identity).value();
  if (!model.tokenizer) {
    return Status(Code::kInvalidArgument,
                  "--model " + config.model_path + ": the model carries no tokenizer");
  }
  const kv::ModelFingerprint fingerprint = engine::kv_fingerprint(
      model.config, model.tokenizer->fingerprint(), config.kv_dtype, model.name);
  d.counter = std::make_unique<TokenizerCounter>(std::move(*model.tokenizer));
  KEEP_LOG_INFO(kLog, "encoder %s (dim %d) and planner model %s loaded in %.2f s",
                config.encoder_dir.c_str(), d.embedder->dim(), config.model_path.c_str(),
                seconds_since(t0));

  d.store = std::make_unique<MemoryStore>(config.store, d.embedder.get(), d.counter.get());
  KEEP_RETURN_IF_ERROR(d.recover().with_context("recovery from " + config.data_dir));

  d.region_ops = std::make_unique<RegionOps>();

  ServiceOptions so;
  so.lease = config.lease;
  so.server_version = "keep-manager 0.1.0";
  so.retrieve_threads = config.retrieve_threads;
  so.max_waiting_retrieves = config.max_waiting_retrieves;
  so.max_waiting_retrieves_per_peer = config.max_waiting_retrieves_per_client;
  if (!config.pg.empty()) {
    auto cl =
        ClusterLog::connect(config.pg, config.shards, d.store.get(), d.wal.get(), &d.registry);
    if (!cl.is_ok()) return cl.status().with_context("--pg");
    d.cluster_log = std::move(cl).value();
    d.cluster_log->set_compact_after(config.pg_compact_after);
    so.record_log = d.cluster_log.get();
  } else if (!config.etcd.empty()) {
    so.route_agent = [&d](std::string_view agent) {
      cluster::ShardKeeper* k = d.keeper_ptr.load();
      if (k == nullptr) return Status(Code::kUnavailable, "this node is not in the cluster yet");
      return k->route(agent);
    };
  }
  so.extra_stats = [&d](std::vector<std::pair<std::string, uint64_t>>* out) {
    out->emplace_back("kv_region_linked", d.region_linked.load() ? 1 : 0);
    if (!d.server) return;
    const wire::ServerStats s = d.server->stats();
    out->emplace_back("replies_dropped", s.replies_dropped);
    out->emplace_back("reply_queued_bytes", s.reply_queued_bytes);
    out->emplace_back("requests_refused_unread", s.refused_unread);
  };
  d.service = std::make_unique<ManagerService>(d.store.get(), d.wal.get(), d.region_ops.get(), so);
  d.handler = std::make_unique<InstrumentedHandler>(d.service.get(), &d.registry);

  wire::ServerOptions wo;
  wo.endpoints = config.endpoints;
  wo.limits.max_message_bytes = config.max_message_bytes;
  wo.max_batch = config.max_batch;
  wo.max_queued_reply_bytes_per_peer = config.max_queued_reply_bytes_per_client;
  wo.send_high_water_mark = config.zmq_send_hwm;
  KEEP_ASSIGN_OR_RETURN(d.server, ManagerRpcServer::create(std::move(wo), d.handler.get()));
  d.service->start_deferred_retrieves([server = d.server.get()](std::unique_ptr<ManagerCall> call) {
    server->complete(std::move(call));
  });

  if (!config.metrics_listen.empty()) {
    KEEP_ASSIGN_OR_RETURN(auto mo, metrics::parse_metrics_listen(config.metrics_listen));
    KEEP_ASSIGN_OR_RETURN(d.http, metrics::MetricsHttpServer::start(d.registry, mo));
  }

  kv::RegionOptions ro;
  ro.name = config.shm_name;
  ro.fingerprint = fingerprint;
  ro.block_bytes = config.shm_block_bytes;
  ro.num_blocks = config.shm_bytes / config.shm_block_bytes;
  ro.max_entries = config.shm_max_entries;
  ro.mode = static_cast<mode_t>(config.shm_mode);
  // The KV region is a cache: a restarted manager starts it afresh over its dead predecessor's,
  // never over a live owner's (KvRegion::create refuses that).
  ro.replace = true;
  KEEP_ASSIGN_OR_RETURN(d.region, kv::KvRegion::create(std::move(ro)));
  d.region_ops->set_region(d.region.get());

  d.embed_thread = std::thread([&d] { d.embed_loop(); });
  d.housekeeping_thread = std::thread([&d] { d.housekeeping_loop(); });
  if (!config.etcd.empty()) {
    cluster::EtcdOptions eo;
    eo.endpoints = config.etcd;
    cluster::ShardKeeperOptions ko;
    ko.shards = config.shards;
    ko.lease_ttl_s = config.etcd_lease_s;
    ko.period = std::chrono::milliseconds(std::max<int64_t>(200, config.etcd_lease_s * 1000 / 4));
    ko.worker_endpoint = config.advertise_worker;
    std::string node = config.node_id;
    if (node.empty()) {
      char host[256] = {};
      ::gethostname(host, sizeof host - 1);
      node = std::string(host) + "-" + std::to_string(::getpid());
    }
    const std::string advertise =
        config.advertise.empty() ? d.server->bound_endpoints().front() : config.advertise;
    auto k = cluster::ShardKeeper::start(std::move(eo), node, advertise, ko);
    if (!k.is_ok()) return k.status().with_context("--etcd");
    d.keeper = std::move(k).value();
    d.keeper_ptr.store(d.keeper.get());
    if (d.cluster_log) d.cluster_log->start(d.keeper.get(), &d.service->store_mutex());
    KEEP_LOG_INFO(kLog, "cluster node %s (%s): %zu of %u shards", node.c_str(), advertise.c_str(),
                  d.keeper->owned(), config.shards);
  }
  std::string eps;
  for (const auto& e : d.server->bound_endpoints()) eps += (eps.empty() ? "" : ",") + e;
  KEEP_LOG_INFO(kLog, "serving on %s; metrics on %s; KV region /dev/shm/%s (%s)", eps.c_str(),
                d.http ? d.http->address().c_str() : "off", config.shm_name.c_str(),
                d.region->fingerprint().describe().c_str());
  return std::unique_ptr<ManagerDaemon>(new ManagerDaemon(std::move(impl)));
}

ManagerDaemon::ManagerDaemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ManagerDaemon::~ManagerDaemon() { impl_->shutdown(); }

void ManagerDaemon::run() { impl_->server->run(); }

void ManagerDaemon::stop() {
  if (impl_->server) impl_->server->stop();
}

const std::vector<std::string>& ManagerDaemon::endpoints() const {
  return impl_->server->bound_endpoints();
}

std::string ManagerDaemon::metrics_address() const {
  return impl_->http ? impl_->http->address() : std::string();
}

}  // namespace keep::manager
