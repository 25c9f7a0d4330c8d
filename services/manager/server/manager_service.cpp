#include "services/manager/server/manager_service.h"

#include <kj/exception.h>

#include <algorithm>
#include <exception>
#include <iterator>
#include <optional>
#include <unordered_set>

#include "shared/common/log.h"
#include "shared/rpc/wire_codec.h"

namespace keep::manager {

namespace {

constexpr const char* kLog = "service";

std::string str(capnp::Text::Reader t) { return std::string(t.begin(), t.size()); }
using wire::as_text;

Result<SegmentKind> kind_from_wire(proto::SegmentKind kind) {
  KEEP_RETURN_IF_ERROR(wire::check_enum(kind, "kind"));
  switch (kind) {
    case proto::SegmentKind::OBJECT_STATE:
      return SegmentKind::kObjectState;
    case proto::SegmentKind::TASK_RECORD:
      return SegmentKind::kTaskRecord;
    case proto::SegmentKind::EXAMPLE_PLAN:
      return SegmentKind::kExamplePlan;
    default:
      break;
  }
  return Status(Code::kInvalidArgument,
                "kind has unknown value " + std::to_string(static_cast<uint16_t>(kind)));
}

proto::SegmentKind kind_to_wire(SegmentKind kind) {
  switch (kind) {
    case SegmentKind::kObjectState:
      return proto::SegmentKind::OBJECT_STATE;
    case SegmentKind::kTaskRecord:
      return proto::SegmentKind::TASK_RECORD;
    case SegmentKind::kExamplePlan:
      return proto::SegmentKind::EXAMPLE_PLAN;
  }
  return proto::SegmentKind::UNKNOWN;
}

proto::GroupState state_to_wire(GroupState state) {
  switch (state) {
    case GroupState::kDynamic:
      return proto::GroupState::DYNAMIC;
    case GroupState::kStatic:
      return proto::GroupState::STATIC;
  }
  return proto::GroupState::UNKNOWN;
}

// The fields a retrieved segment (proto::RetrievedSegment) and a listed one (proto::MemoryInfo)
// share, from the store's RetrievedSegment or SegmentInfo.
template <typename Builder, typename Segment>
void set_segment_fields(Builder o, const Segment& s) {
  o.setId(s.id);
  o.setText(as_text(s.text));
  o.setKind(kind_to_wire(s.kind));
  o.setTokens(s.tokens);
  o.setVersion(s.version);
  o.setUpdatedStep(s.updated_step);
  o.setGroupId(s.group_id);
}

void set_entry(proto::EntryDescriptor::Builder out, const EntryLocation& e) {
  out.setIndex(e.index);
  out.setGeneration(e.generation);
  out.setOffset(e.offset);
  out.setBytes(e.bytes);
  out.setTokens(e.tokens);
}

void set_write_result(proto::WriteMemoryResponse::Builder out, const WriteResult& r) {
  out.setId(r.id);
  out.setVersion(r.version);
  out.setStep(r.step);
}

uint32_t lease_ms(std::chrono::milliseconds lease) {
  return static_cast<uint32_t>(std::min<int64_t>(lease.count(), UINT32_MAX));
}

}  // namespace

ManagerService::ManagerService(MemoryStore* store, BatchCommitter* committer, KvRegionOps* region,
                               ServiceOptions options)
    : store_(store),
      committer_(committer),
      region_(region),
      options_(std::move(options)),
      retrieve_queue_({options_.max_waiting_retrieves, options_.max_waiting_retrieves_per_peer}) {
  KEEP_CHECK(store_ != nullptr);
}

ManagerService::~ManagerService() { stop_deferred_retrieves(); }

size_t ManagerService::jobs_in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.size();
}

uint64_t ManagerService::mutations_deduplicated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return deduplicated_;
}

namespace {
// The request's idempotency key; nullopt when it carries none (clientId 0).
std::optional<RequestId> request_id_of(const proto::Request::Reader& req) {
  if (req.getClientId() == 0) return std::nullopt;
  return RequestId{req.getClientId(), req.getClientSeq()};
}
}  // namespace

std::optional<bool> ManagerService::answer_resend_locked(ManagerCall& call,
                                                         const std::string& agent, MutationOp op) {
  const std::optional<RequestId> id = request_id_of(call.request());
  if (!id) return std::nullopt;
  const std::optional<AppliedRequest> applied = store_->find_request(agent, *id);
  if (!applied) return std::nullopt;
  if (applied->op != op) {
    call.fail(Status(Code::kInvalidArgument,
                     "request id " + std::to_string(id->client) + ":" + std::to_string(id->seq) +
                         " was already used for a " + mutation_op_name(applied->op) +
                         " of agent '" + agent + "', not this " + mutation_op_name(op) +
                         ": a new mutation needs a new id"));
    return false;
  }
  const WriteResult& r = applied->result;
  switch (op) {
    case MutationOp::kWrite:
      set_write_result(call.reply().initWriteMemory(), r);
      break;
    case MutationOp::kUpdate:
      set_write_result(call.reply().initUpdateMemory(), r);
      break;
    case MutationOp::kRemove:
      call.reply().initDeleteMemory();
      break;
    case MutationOp::kAdvanceStep:
      call.reply().initAdvanceStep().setStep(r.step);
      break;
  }
  ++deduplicated_;
  // The first one may be in this very batch: its answer, too, waits for the batch's sync.
  return committer_ != nullptr;
}

void ManagerService::record_request_locked(const proto::Request::Reader& req,
                                           const std::string& agent, const WriteResult& result,
                                           std::string* record) {
  const std::optional<RequestId> id = request_id_of(req);
  if (!id || record->empty()) return;  // no id, or a no-op (nothing logged: nothing to answer)
  Status st = store_->set_request(agent, *id, result, record);
  KEEP_CHECK_MSG(st.is_ok(), st.to_string().c_str());  // the mutation left its agent in place
}

Status ManagerService::mutation_allowed() const {
  if (degraded_) {
    return Status(Code::kUnavailable,
                  "the write-ahead log failed earlier; mutations are refused until restart");
  }
  return Status::ok();
}

Status ManagerService::append_locked(const std::string& record) {
  if (committer_ == nullptr || record.empty()) return Status::ok();
  Status st = committer_->append(record);
  if (!st.is_ok()) {
    degraded_ = true;
    KEEP_LOG_ERROR(kLog, "WAL append failed, refusing mutations from now on: %s",
                   st.to_string().c_str());
    return Status(Code::kIoError,
                  "applied in memory but not logged (WAL append failed): " + st.to_string());
  }
  return st;
}

void ManagerService::handle_batch(std::span<ManagerCall> calls) {
  std::vector<uint8_t> needs_sync(calls.size(), 0);
  bool any = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    log_batch_ = LogBatch{};
    log_batch_.call_shard.resize(calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      log_batch_.call = i;
      log_batch_.route.reset();
      try {
        needs_sync[i] = handle_one(calls[i]) ? 1 : 0;
      } catch (const kj::Exception& e) {
        // Lazily detected structure errors (e.g. text without its NUL terminator).
        calls[i].fail(Status(Code::kMalformed,
                             std::string("undecodable request: ") + e.getDescription().cStr()));
      } catch (const std::exception& e) {
        calls[i].fail(Status(Code::kInternal, std::string("handler: ") + e.what()));
      }
      any = any || needs_sync[i];
    }
    // Cluster mode: the batch's mutations durable in the log of record, with the mutex held (no
    // reader sees one before), or undone.
    if (!log_batch_.shards.empty()) commit_log_locked(calls);
    release_entries_locked();
  }
  if (any && committer_ != nullptr) {
    Status st = committer_->sync();  // ONE sync for every record of the batch
    if (!st.is_ok()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        degraded_ = true;
      }
      KEEP_LOG_ERROR(kLog, "WAL sync failed, refusing mutations from now on: %s",
                     st.to_string().c_str());
      // With a log of record the answers stand: it holds their mutations, the WAL is a cache.
      for (size_t i = 0; options_.record_log == nullptr && i < calls.size(); ++i) {
        if (needs_sync[i]) {
          calls[i].fail(
              Status(Code::kIoError,
                     "applied in memory but not durable (WAL sync failed): " + st.to_string()));
        }
      }
    }
  }
}

void ManagerService::on_idle() { expire_jobs(std::chrono::steady_clock::now()); }

Status ManagerService::log_mutation_locked(std::string_view agent, const std::string& record) {
  if (record.empty()) return Status::ok();
  if (options_.record_log == nullptr || !log_batch_.route) return append_locked(record);
  const RecordLog::Route& route = *log_batch_.route;
  const LogPosition pos{store_->log_position(agent).seq + 1, route.epoch};
  std::string logged = record;
  Status st = store_->set_log_position(agent, pos, &logged);
  KEEP_CHECK_MSG(st.is_ok(), st.to_string().c_str());  // the mutation left its agent in place
  auto batch = std::find_if(log_batch_.shards.begin(), log_batch_.shards.end(),
                            [&](const RecordLog::ShardBatch& b) { return b.shard == route.shard; });
  if (batch == log_batch_.shards.end()) {
    log_batch_.shards.push_back(RecordLog::ShardBatch{route.shard, route.epoch, {}, {}});
    batch = std::prev(log_batch_.shards.end());
  }
  batch->entries.push_back(RecordLog::Entry{std::string(agent), pos.seq, record});
  // The local WAL is a cache of the log of record here: a failure of it degrades the node (no
  // more mutations) but does not fail this one, whose fate the commit decides.
  (void)append_locked(logged);
  return Status::ok();
}

void ManagerService::commit_log_locked(std::span<ManagerCall> calls) {
  options_.record_log->commit(&log_batch_.shards);
  for (const RecordLog::ShardBatch& b : log_batch_.shards) {
    if (b.result.is_ok()) continue;
    const std::string shard = std::to_string(b.shard);
    const Status answer =
        b.result.code() == Code::kStale
            ? Status(Code::kUnavailable,
                     "shard " + shard + " is being taken over by another node (epoch " +
                         std::to_string(b.epoch) + " here is stale): nothing written, retry")
            : Status(Code::kUnavailable,
                     "the memory log did not confirm the write, which may or may not be "
                     "applied; this node stopped serving shard " +
                         shard + ": " + b.result.to_string());
    // What the refused entries applied is forgotten: the agents come back from the log of
    // record when their shard is taken again.
    std::unordered_set<std::string> dropped;
    for (const RecordLog::Entry& e : b.entries) {
      if (!dropped.insert(e.agent).second) continue;
      std::string record;
      (void)store_->drop_agent(e.agent, &record);
      if (!degraded_ && !record.empty()) (void)append_locked(record);
    }
    for (size_t i = 0; i < calls.size(); ++i) {
      if (log_batch_.call_shard[i] == b.shard && !calls[i].deferred()) calls[i].fail(answer);
    }
    KEEP_LOG_WARN(kLog, "shard %u: %zu log entries of %zu agents not written (%s); agents dropped",
                  b.shard, b.entries.size(), dropped.size(), b.result.to_string().c_str());
  }
}

void ManagerService::release_entries_locked() {
  for (const KvEntry& e : store_->take_released_entries()) {
    if (region_ == nullptr) continue;
    Status st = region_->release(e.index, e.generation);
    if (!st.is_ok()) {
      KEEP_LOG_WARN(kLog, "releasing entry %u gen %llu: %s", e.index,
                    static_cast<unsigned long long>(e.generation), st.to_string().c_str());
    }
  }
}

namespace {
// The agent a request is about; nullopt for the node-wide ones (ping, stats, the KV job calls).
std::optional<std::string> agent_of(const proto::Request::Reader& req) {
  switch (req.which()) {
    case proto::Request::WRITE_MEMORY:
      return str(req.getWriteMemory().getAgent());
    case proto::Request::UPDATE_MEMORY:
      return str(req.getUpdateMemory().getAgent());
    case proto::Request::DELETE_MEMORY:
      return str(req.getDeleteMemory().getAgent());
    case proto::Request::ADVANCE_STEP:
      return str(req.getAdvanceStep().getAgent());
    case proto::Request::RETRIEVE:
      return str(req.getRetrieve().getAgent());
    case proto::Request::LIST_GROUPS:
      return str(req.getListGroups().getAgent());
    case proto::Request::LIST_MEMORIES:
      return str(req.getListMemories().getAgent());
    default:
      return std::nullopt;
  }
}
}  // namespace

bool ManagerService::handle_one(ManagerCall& call) {
  const auto req = call.request();
  std::string record;
  if (options_.record_log != nullptr) {
    if (std::optional<std::string> agent = agent_of(req)) {
      auto route = options_.record_log->route(*agent);
      if (!route.is_ok()) return call.fail(route.status()), false;
      log_batch_.route = *route;
      if (log_batch_.call < log_batch_.call_shard.size()) {
        log_batch_.call_shard[log_batch_.call] = route->shard;
      }
    }
  } else if (options_.route_agent) {
    if (std::optional<std::string> agent = agent_of(req)) {
      if (Status st = options_.route_agent(*agent); !st.is_ok()) return call.fail(st), false;
    }
  }
  switch (req.which()) {
    case proto::Request::NONE:
      call.fail(Status(Code::kInvalidArgument, "empty request (no call set)"));
      return false;

    case proto::Request::PING: {
      call.reply().initPing().setServerVersion(options_.server_version + " protocol " +
                                               std::to_string(client::ManagerProtocol::kVersion));
      return false;
    }

    case proto::Request::WRITE_MEMORY: {
      if (Status st = mutation_allowed(); !st.is_ok()) return call.fail(st), false;
      auto w = req.getWriteMemory();
      WriteRequest wr;
      wr.agent = str(w.getAgent());
      if (w.getHasId()) wr.id = w.getId();
      wr.text = str(w.getText());
      auto kind = kind_from_wire(w.getKind());
      if (!kind.is_ok()) return call.fail(kind.status()), false;
      wr.kind = *kind;
      if (w.getHasStep()) wr.step = w.getStep();
      if (auto resent = answer_resend_locked(call, wr.agent, MutationOp::kWrite)) return *resent;
      auto r = store_->write(wr, &record);
      if (!r.is_ok()) return call.fail(r.status()), false;
      record_request_locked(req, wr.agent, *r, &record);
      if (Status st = log_mutation_locked(wr.agent, record); !st.is_ok()) {
        return call.fail(st), false;
      }
      set_write_result(call.reply().initWriteMemory(), *r);
      return !record.empty();
    }

    case proto::Request::UPDATE_MEMORY: {
      if (Status st = mutation_allowed(); !st.is_ok()) return call.fail(st), false;
      auto u = req.getUpdateMemory();
      UpdateRequest ur;
      ur.agent = str(u.getAgent());
      ur.id = u.getId();
      ur.text = str(u.getText());
      if (u.getHasKind()) {
        auto kind = kind_from_wire(u.getKind());
        if (!kind.is_ok()) return call.fail(kind.status()), false;
        ur.kind = *kind;
      }
      if (u.getHasStep()) ur.step = u.getStep();
      if (auto resent = answer_resend_locked(call, ur.agent, MutationOp::kUpdate)) return *resent;
      auto r = store_->update(ur, &record);
      if (!r.is_ok()) return call.fail(r.status()), false;
      record_request_locked(req, ur.agent, *r, &record);
      if (Status st = log_mutation_locked(ur.agent, record); !st.is_ok()) {
        return call.fail(st), false;
      }
      set_write_result(call.reply().initUpdateMemory(), *r);
      return !record.empty();
    }

    case proto::Request::DELETE_MEMORY: {
      if (Status st = mutation_allowed(); !st.is_ok()) return call.fail(st), false;
      auto d = req.getDeleteMemory();
      const std::string agent = str(d.getAgent());
      if (auto resent = answer_resend_locked(call, agent, MutationOp::kRemove)) return *resent;
      Status st = store_->remove(agent, d.getId(), &record);
      if (!st.is_ok()) return call.fail(st), false;
      record_request_locked(req, agent, WriteResult{d.getId(), 0, 0}, &record);
      if (Status a = log_mutation_locked(agent, record); !a.is_ok()) return call.fail(a), false;
      call.reply().initDeleteMemory();
      return !record.empty();
    }

    case proto::Request::ADVANCE_STEP: {
      if (Status st = mutation_allowed(); !st.is_ok()) return call.fail(st), false;
      auto a = req.getAdvanceStep();
      const std::string agent = str(a.getAgent());
      if (auto resent = answer_resend_locked(call, agent, MutationOp::kAdvanceStep)) {
        return *resent;
      }
      auto r = store_->advance_step(agent, a.getBy(), &record);
      if (!r.is_ok()) return call.fail(r.status()), false;
      record_request_locked(req, agent, WriteResult{0, 0, *r}, &record);
      if (Status st = log_mutation_locked(agent, record); !st.is_ok()) {
        return call.fail(st), false;
      }
      call.reply().initAdvanceStep().setStep(*r);
      return !record.empty();
    }

    case proto::Request::RETRIEVE: {
      auto q = req.getRetrieve();
      std::string agent = str(q.getAgent());
      std::string query = str(q.getQuery());
      if (complete_) {
        auto needs = store_->retrieve_needs(agent, query, q.getK());
        if (!needs.is_ok()) return call.fail(needs.status()), false;
        if (needs->embed_query || !needs->segments.empty()) {
          Status st = defer_retrieve(call, std::move(agent), std::move(query), std::move(*needs));
          if (!st.is_ok()) call.fail(st);
          return false;
        }
        // Nothing to embed (the query came from the cache): answered here.
        auto r = store_->retrieve_embedded(agent, needs->query_embedding, needs->k);
        if (!r.is_ok()) return call.fail(r.status()), false;
        fill_retrieve(call, *r);
        return false;
      }
      auto r = store_->retrieve(agent, query, q.getK(), &record);
      if (!r.is_ok()) return call.fail(r.status()), false;
      // The embedding record is derived state; when the WAL is already broken it is dropped
      // (recovery recomputes embeddings) instead of failing a read.
      bool logged = false;
      if (!degraded_ && !record.empty()) {
        if (Status st = append_locked(record); !st.is_ok()) return call.fail(st), false;
        logged = committer_ != nullptr;
      }
      fill_retrieve(call, *r);
      return logged;
    }

    case proto::Request::LIST_GROUPS: {
      auto r = store_->list_groups(str(req.getListGroups().getAgent()));
      if (!r.is_ok()) return call.fail(r.status()), false;
      auto groups = call.reply().initListGroups().initGroups(static_cast<unsigned>(r->size()));
      for (size_t i = 0; i < r->size(); ++i) {
        const GroupInfo& g = (*r)[i];
        auto o = groups[static_cast<unsigned>(i)];
        o.setId(g.id);
        o.setState(state_to_wire(g.state));
        o.setVersion(g.version);
        auto ids = o.initSegmentIds(static_cast<unsigned>(g.segment_ids.size()));
        for (size_t j = 0; j < g.segment_ids.size(); ++j) {
          ids.set(static_cast<unsigned>(j), g.segment_ids[j]);
        }
        o.setTokens(g.tokens);
        o.setLastChangeStep(g.last_change_step);
      }
      return false;
    }

    case proto::Request::LIST_MEMORIES: {
      auto q = req.getListMemories();
      auto r = store_->list_memories(str(q.getAgent()), q.getAfterId(), q.getLimit());
      if (!r.is_ok()) return call.fail(r.status()), false;
      auto page = call.reply().initListMemories();
      page.setMore(r->more);
      auto out = page.initMemories(static_cast<unsigned>(r->memories.size()));
      for (size_t i = 0; i < r->memories.size(); ++i) {
        const SegmentInfo& s = r->memories[i];
        auto o = out[static_cast<unsigned>(i)];
        set_segment_fields(o, s);
        o.setEmbedded(s.embedded);
        o.setHasKv(s.kv.has_value());
      }
      return false;
    }

    case proto::Request::STATS: {
      const StoreStats s = store_->stats();
      std::vector<std::pair<std::string, uint64_t>> counters = {
          {"pending_embeddings", s.pending_embeddings},
          {"jobs_queued", s.jobs_queued},
          {"jobs_running", s.jobs_running},
          {"jobs_in_flight", jobs_.size()},
          {"released_pending", s.released_pending},
          {"transitions_to_static", s.transitions_to_static},
          {"transitions_to_dynamic", s.transitions_to_dynamic},
          {"jobs_completed", s.jobs_completed},
          {"jobs_stale", s.jobs_stale},
          {"jobs_failed", s.jobs_failed},
          {"kv_evictions", s.kv_evictions},
          {"query_cache_hits", s.query_cache_hits},
          {"query_cache_misses", s.query_cache_misses},
          {"degraded", degraded_ ? 1u : 0u},
          {"mutations_deduplicated", deduplicated_},
      };
      const DeferredRetrieves dr = deferred_retrieves();
      counters.emplace_back("retrieves_deferred", dr.total);
      counters.emplace_back("retrieves_waiting", dr.waiting);
      counters.emplace_back("retrieves_refused", dr.refused);
      counters.emplace_back("retrieves_expired", dr.expired);
      if (options_.extra_stats) options_.extra_stats(&counters);
      auto o = call.reply().initStats();
      o.setAgents(s.agents);
      o.setMemories(s.memories);
      o.setGroupsStatic(s.groups_static);
      o.setGroupsDynamic(s.groups_dynamic);
      o.setJobsPending(s.jobs_queued);
      auto list = o.initCounters(static_cast<unsigned>(counters.size()));
      for (size_t i = 0; i < counters.size(); ++i) {
        list[static_cast<unsigned>(i)].setName(counters[i].first);
        list[static_cast<unsigned>(i)].setValue(counters[i].second);
      }
      return false;
    }

    case proto::Request::FETCH_JOBS:
      do_fetch_jobs(call);
      return false;
    case proto::Request::RESERVE_ENTRY:
      do_reserve(call);
      return false;
    case proto::Request::COMMIT_ENTRY:
      do_commit(call);
      return false;
    case proto::Request::REVOKE_ENTRY:
      do_revoke(call);
      return false;
    case proto::Request::RENEW_LEASE:
      do_renew(call);
      return false;
  }
  call.fail(Status(Code::kInvalidArgument,
                   "unknown request type " + std::to_string(static_cast<unsigned>(req.which()))));
  return false;
}

// ---- KV jobs ---------------------------------------------------------------------------------

namespace {
Status no_region() {
  return Status(Code::kUnavailable, "this manager has no KV region: KV jobs are disabled");
}
Status check_worker(uint64_t worker_id) {
  if (worker_id == 0) return Status(Code::kInvalidArgument, "workerId must be non-zero");
  return Status::ok();
}
}  // namespace

Result<ManagerService::JobState*> ManagerService::find_job(uint64_t worker_id, uint64_t job_id) {
  KEEP_RETURN_IF_ERROR(check_worker(worker_id));
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return Status(Code::kNotFound, "job " + std::to_string(job_id) + " is not in flight");
  }
  if (it->second.worker_id != worker_id) {
    return Status(Code::kNotFound, "job " + std::to_string(job_id) + " is not held by worker " +
                                       std::to_string(worker_id));
  }
  return &it->second;
}

void ManagerService::do_fetch_jobs(ManagerCall& call) {
  if (region_ == nullptr) return call.fail(no_region());
  auto f = call.request().getFetchJobs();
  if (Status st = check_worker(f.getWorkerId()); !st.is_ok()) return call.fail(st);
  const uint32_t max = std::min(f.getMax(), options_.max_fetch_jobs);
  std::vector<KvJob> taken = store_->take_jobs(max);
  const auto now = std::chrono::steady_clock::now();
  auto jobs = call.reply().initFetchJobs().initJobs(static_cast<unsigned>(taken.size()));
  for (size_t i = 0; i < taken.size(); ++i) {
    const KvJob& j = taken[i];
    auto o = jobs[static_cast<unsigned>(i)];
    o.setJobId(j.job_id);
    o.setKind(j.kind == KvJobKind::kGroup ? proto::JobKind::GROUP : proto::JobKind::SEGMENT);
    o.setAgent(as_text(j.agent));
    o.setGroupId(j.group_id);
    o.setGroupVersion(j.group_version);
    auto segs = o.initSegments(static_cast<unsigned>(j.segments.size()));
    for (size_t k = 0; k < j.segments.size(); ++k) {
      auto s = segs[static_cast<unsigned>(k)];
      s.setId(j.segments[k].id);
      s.setVersion(j.segments[k].version);
      s.setText(as_text(j.segments[k].text));
      s.setTokens(j.segments[k].tokens);
      s.setKind(kind_to_wire(j.segments[k].kind));
    }
    JobState state;
    state.job = j;
    state.worker_id = f.getWorkerId();
    state.deadline = now + options_.job_timeout;
    jobs_[j.job_id] = std::move(state);
  }
}

void ManagerService::do_reserve(ManagerCall& call) {
  if (region_ == nullptr) return call.fail(no_region());
  auto q = call.request().getReserveEntry();
  auto job = find_job(q.getWorkerId(), q.getJobId());
  if (!job.is_ok()) return call.fail(job.status());
  JobState& js = **job;
  if (js.reserved) {
    return call.fail(Status(Code::kAlreadyExists, "job " + std::to_string(q.getJobId()) +
                                                      " already has entry " +
                                                      std::to_string(js.entry.index)));
  }
  if (q.getTokens() == 0) return call.fail(Status(Code::kInvalidArgument, "tokens must be > 0"));
  auto loc = region_->reserve(js.job, q.getTokens(), js.worker_id, options_.lease);
  // A full region is a cache, not a wall: the least recently used entries make room (their
  // memories get KV again when next retrieved). Doubling what is freed copes with fragmentation
  // (the entry needs one run of blocks).
  for (uint64_t want = q.getTokens();
       !loc.is_ok() && loc.status().code() == Code::kResourceExhausted &&
       want <= (uint64_t{1} << 40);
       want *= 2) {
    if (store_->evict_lru(want) == 0) break;
    release_entries_locked();
    loc = region_->reserve(js.job, q.getTokens(), js.worker_id, options_.lease);
  }
  if (!loc.is_ok()) {
    // The job cannot proceed (arena full, ...): hand it back to the store's queue.
    (void)store_->fail_job(js.job.job_id);
    jobs_.erase(q.getJobId());
    return call.fail(loc.status().with_context("reserving an entry"));
  }
  js.reserved = true;
  js.entry = *loc;
  js.deadline = std::chrono::steady_clock::now() + options_.lease + std::chrono::seconds(1);
  auto o = call.reply().initReserveEntry();
  set_entry(o.initEntry(), *loc);
  o.setLeaseMs(lease_ms(options_.lease));
}

namespace {
Status match_entry(bool reserved, const EntryLocation& entry, proto::EntryRef::Reader ref) {
  if (!reserved) return Status(Code::kNotFound, "the job has no reserved entry");
  if (entry.index != ref.getIndex() || entry.generation != ref.getGeneration()) {
    return Status(Code::kInvalidArgument, "entry " + std::to_string(ref.getIndex()) + " gen " +
                                              std::to_string(ref.getGeneration()) +
                                              " is not the job's (entry " +
                                              std::to_string(entry.index) + " gen " +
                                              std::to_string(entry.generation) + ")");
  }
  return Status::ok();
}
}  // namespace

void ManagerService::do_commit(ManagerCall& call) {
  if (region_ == nullptr) return call.fail(no_region());
  auto ref = call.request().getCommitEntry();
  auto job = find_job(ref.getWorkerId(), ref.getJobId());
  if (!job.is_ok()) return call.fail(job.status());
  JobState& js = **job;
  if (Status st = match_entry(js.reserved, js.entry, ref); !st.is_ok()) return call.fail(st);
  const uint64_t job_id = js.job.job_id;
  const EntryLocation entry = js.entry;
  if (Status st = region_->commit(entry.index, entry.generation); !st.is_ok()) {
    (void)store_->fail_job(job_id);
    jobs_.erase(job_id);
    return call.fail(st.with_context("committing the entry"));
  }
  std::vector<uint32_t> slices;
  for (uint32_t t : ref.getSliceTokens()) slices.push_back(t);
  jobs_.erase(job_id);
  Status st =
      store_->complete_job(job_id, KvEntry{entry.index, entry.generation, entry.tokens}, slices);
  if (st.code() == Code::kNotFound) {
    (void)region_->release(entry.index, entry.generation);  // the entry stayed ours
  }
  if (!st.is_ok()) return call.fail(st);
  call.reply().initCommitEntry();
}

void ManagerService::do_revoke(ManagerCall& call) {
  if (region_ == nullptr) return call.fail(no_region());
  auto ref = call.request().getRevokeEntry();
  auto job = find_job(ref.getWorkerId(), ref.getJobId());
  if (!job.is_ok()) return call.fail(job.status());
  JobState& js = **job;
  if (Status st = match_entry(js.reserved, js.entry, ref); !st.is_ok()) return call.fail(st);
  const uint64_t job_id = js.job.job_id;
  Status st = region_->revoke(js.entry.index, js.entry.generation);
  (void)store_->fail_job(job_id);
  jobs_.erase(job_id);
  if (!st.is_ok()) return call.fail(st.with_context("revoking the entry"));
  call.reply().initRevokeEntry();
}

void ManagerService::do_renew(ManagerCall& call) {
  if (region_ == nullptr) return call.fail(no_region());
  auto ref = call.request().getRenewLease();
  auto job = find_job(ref.getWorkerId(), ref.getJobId());
  if (!job.is_ok()) return call.fail(job.status());
  JobState& js = **job;
  if (Status st = match_entry(js.reserved, js.entry, ref); !st.is_ok()) return call.fail(st);
  if (Status st = region_->renew(js.entry.index, js.entry.generation, options_.lease);
      !st.is_ok()) {
    return call.fail(st.with_context("renewing the lease"));
  }
  js.deadline = std::chrono::steady_clock::now() + options_.lease + std::chrono::seconds(1);
  call.reply().initRenewLease().setLeaseMs(lease_ms(options_.lease));
}

size_t ManagerService::expire_jobs(std::chrono::steady_clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (it->second.deadline > now) {
      ++it;
      continue;
    }
    const JobState& js = it->second;
    KEEP_LOG_WARN(kLog, "job %llu of worker %llu expired (%s)",
                  static_cast<unsigned long long>(js.job.job_id),
                  static_cast<unsigned long long>(js.worker_id),
                  js.reserved ? "lease ran out" : "never reserved");
    if (js.reserved && region_ != nullptr) {
      (void)region_->revoke(js.entry.index, js.entry.generation);  // the reaper may have done it
    }
    (void)store_->fail_job(js.job.job_id);
    it = jobs_.erase(it);
    ++n;
  }
  release_entries_locked();
  return n;
}

void ManagerService::fill_retrieve(ManagerCall& call,
                                   const std::vector<RetrievedSegment>& segments) {
  auto segs = call.reply().initRetrieve().initSegments(static_cast<unsigned>(segments.size()));
  for (size_t i = 0; i < segments.size(); ++i) {
    const RetrievedSegment& s = segments[i];
    auto o = segs[static_cast<unsigned>(i)];
    set_segment_fields(o, s);
    o.setGroupState(state_to_wire(s.group_state));
    o.setGroupVersion(s.group_version);
    o.setScore(s.score);
    if (s.kv && region_ != nullptr) {
      auto loc = region_->locate(s.kv->entry_index, s.kv->entry_generation);
      if (loc.is_ok()) {
        o.setHasKv(true);
        auto kv = o.initKv();
        set_entry(kv.initEntry(), *loc);
        kv.setTokenOffset(s.kv->token_offset);
        kv.setTokens(s.kv->tokens);
        kv.setJoint(s.kv->joint);
      }
    }
  }
}

// ---- deferred retrieves ----

Status ManagerService::shutting_down() {
  return Status(Code::kUnavailable, "keep-manager is shutting down: retrieve not run");
}

void ManagerService::start_deferred_retrieves(
    std::function<void(std::unique_ptr<ManagerCall>)> complete) {
  KEEP_CHECK_MSG(!complete_ && retrieve_threads_.empty(), "deferred retrieves started twice");
  KEEP_CHECK(complete != nullptr);
  complete_ = std::move(complete);
  retrieve_stop_ = false;
  for (int i = 0; i < std::max(1, options_.retrieve_threads); ++i) {
    retrieve_threads_.emplace_back([this] { retrieve_loop(); });
  }
}

void ManagerService::stop_deferred_retrieves() {
  std::vector<RetrieveJob> queued;
  {
    std::lock_guard<std::mutex> lock(retrieve_mu_);
    retrieve_stop_ = true;
    queued = retrieve_queue_.take_all();
  }
  retrieve_cv_.notify_all();
  // Not embedded for: a client waits for none of the seconds that could take.
  for (RetrieveJob& job : queued) {
    job.call->fail(shutting_down());
    complete_(std::move(job.call));
  }
  for (auto& t : retrieve_threads_) t.join();
  retrieve_threads_.clear();
}

ManagerService::DeferredRetrieves ManagerService::deferred_retrieves() const {
  std::lock_guard<std::mutex> lock(retrieve_mu_);
  return {retrieves_deferred_, retrieve_queue_.size(), retrieve_queue_.max_depth(),
          retrieves_refused_, retrieves_expired_};
}

Status ManagerService::defer_retrieve(ManagerCall& call, std::string agent, std::string query,
                                      MemoryStore::RetrieveNeeds needs) {
  using Admit = FairQueue<RetrieveJob>::Admit;
  std::vector<RetrieveJob> expired;
  Admit admit = Admit::kYes;
  {
    std::lock_guard<std::mutex> lock(retrieve_mu_);
    if (retrieve_stop_) return shutting_down();
    admit = retrieve_queue_.admit(call.peer());
    if (admit != Admit::kYes) {  // full: first make room from those nobody waits for any more
      retrieve_queue_.take_expired(std::chrono::steady_clock::now(), &expired);
      retrieves_expired_ += expired.size();
      admit = retrieve_queue_.admit(call.peer());
    }
    if (admit == Admit::kYes) {
      const std::string peer = call.peer();
      const auto deadline = call.deadline();
      retrieve_queue_.push(
          peer, RetrieveJob{call.defer(), std::move(agent), std::move(query), std::move(needs)},
          deadline);
      retrieves_deferred_ += 1;
    } else {
      retrieves_refused_ += 1;
    }
  }
  answer_expired(std::move(expired));
  if (admit == Admit::kKeyFull) {
    return Status(Code::kResourceExhausted,
                  "this client already has " +
                      std::to_string(options_.max_waiting_retrieves_per_peer) +
                      " retrieves waiting for an embedding (the most per client): retry later");
  }
  if (admit == Admit::kFull) {
    return Status(Code::kResourceExhausted,
                  std::to_string(options_.max_waiting_retrieves) +
                      " retrieves are waiting for an embedding (the most): retry later");
  }
  retrieve_cv_.notify_one();
  return Status::ok();
}

void ManagerService::answer_expired(std::vector<RetrieveJob> expired) {
  for (RetrieveJob& job : expired) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(job.call->deadline() -
                                                                              job.call->received());
    job.call->fail(Status(Code::kTimeout, "the caller's timeout (" +
                                              std::to_string(waited.count()) +
                                              " ms) passed while the retrieve waited: not run"));
    complete_(std::move(job.call));
  }
}

void ManagerService::retrieve_loop() {
  for (;;) {
    std::optional<RetrieveJob> next;
    std::vector<RetrieveJob> expired;
    bool stop = false;
    {
      std::unique_lock<std::mutex> lock(retrieve_mu_);
      retrieve_cv_.wait(lock, [&] { return retrieve_stop_ || !retrieve_queue_.empty(); });
      retrieve_queue_.take_expired(std::chrono::steady_clock::now(), &expired);
      retrieves_expired_ += expired.size();
      next = retrieve_queue_.pop();
      stop = retrieve_stop_;
    }
    answer_expired(std::move(expired));
    if (!next.has_value()) {
      if (stop) return;  // stopping, nothing left to answer
      continue;
    }
    RetrieveJob& job = *next;
    try {
      run_retrieve(job);
    } catch (const std::exception& e) {
      job.call->fail(Status(Code::kInternal, std::string("retrieve: ") + e.what()));
    } catch (const kj::Exception& e) {
      job.call->fail(
          Status(Code::kInternal, std::string("retrieve: ") + e.getDescription().cStr()));
    }
    complete_(std::move(job.call));
  }
}

// Embeds what the retrieve needs without the mutex, then with it applies the embeddings (their
// record appended like the embedding thread's: derived state, durable with the next batch's sync)
// and answers. The pending segments go kRetrieveEmbedBatch at a time from the newest back, while
// the background encoder works forward from the oldest: after each batch the ones it embedded
// meanwhile are dropped, so the two do not embed the same texts and the lock is held briefly. A
// segment pending when the retrieve arrived and pending again at the end (updated meanwhile) is
// embedded once more, at most twice, so that every segment written before the retrieve is among
// its candidates.
void ManagerService::run_retrieve(RetrieveJob& job) {
  constexpr size_t kRetrieveEmbedBatch = 64;
  ManagerCall& call = *job.call;
  Embedder* embedder = store_->embedder();
  std::vector<float> query_embedding = std::move(job.needs.query_embedding);
  bool embed_query = job.needs.embed_query;
  std::vector<PendingEmbedding> todo = std::move(job.needs.segments);  // write order
  std::unordered_set<uint64_t> arrived;
  for (const auto& p : todo) arrived.insert(p.id);
  for (int rechecks = 0;;) {
    const size_t take = std::min(todo.size(), kRetrieveEmbedBatch);
    std::vector<PendingEmbedding> batch(std::make_move_iterator(todo.end() - take),
                                        std::make_move_iterator(todo.end()));
    todo.resize(todo.size() - take);
    std::vector<std::string> texts;
    if (embed_query) texts.push_back(job.query);
    for (const auto& p : batch) texts.push_back(p.text);
    std::vector<std::vector<float>> vecs;
    if (!texts.empty()) {
      auto r = embedder->embed(texts);
      if (!r.is_ok()) {
        return call.fail(r.status().with_context(embed_query ? "embedding the query"
                                                             : "embedding pending segments"));
      }
      if (r->size() != texts.size()) {
        return call.fail(Status(Code::kInternal, "embedder returned " + std::to_string(r->size()) +
                                                     " vectors for " +
                                                     std::to_string(texts.size())));
      }
      vecs = std::move(*r);
    }
    std::lock_guard<std::mutex> lock(mu_);
    size_t at = 0;
    if (embed_query) {
      auto q = store_->add_query_embedding(job.query, std::move(vecs[at++]));
      if (!q.is_ok()) return call.fail(q.status());
      query_embedding = std::move(*q);
      embed_query = false;
    }
    if (!batch.empty()) {
      std::vector<SegmentEmbedding> embs;
      embs.reserve(batch.size());
      for (auto& p : batch) {
        embs.push_back({std::move(p.agent), p.id, p.version, std::move(vecs[at++]), p.seq});
      }
      std::string record;
      auto n = store_->apply_embeddings(embs, &record);
      if (!n.is_ok()) return call.fail(n.status().with_context("embedding pending segments"));
      if (!degraded_ && !record.empty()) {
        if (Status st = append_locked(record); !st.is_ok()) return call.fail(st);
      }
      release_entries_locked();
    }
    std::erase_if(todo, [&](const PendingEmbedding& p) {
      return !store_->embedding_pending(job.agent, p.id, p.version);
    });
    if (!todo.empty()) continue;
    // k = 0: the agent's pending segments only (the query is embedded; a lookup would count a
    // second query-cache hit for this retrieve).
    auto again = store_->retrieve_needs(job.agent, job.query, 0);
    if (!again.is_ok()) return call.fail(again.status());  // e.g. the agent was removed
    for (auto& p : again->segments) {
      if (arrived.count(p.id) != 0) todo.push_back(std::move(p));
    }
    if (!todo.empty() && rechecks++ < 2) continue;
    // The shard may have gone while the retrieve waited (moved, or this node's lease ran out).
    if (options_.record_log != nullptr) {
      if (auto route = options_.record_log->route(job.agent); !route.is_ok()) {
        return call.fail(route.status());
      }
    } else if (options_.route_agent) {
      if (Status st = options_.route_agent(job.agent); !st.is_ok()) return call.fail(st);
    }
    auto r = store_->retrieve_embedded(job.agent, query_embedding, job.needs.k);
    if (!r.is_ok()) return call.fail(r.status());
    return fill_retrieve(call, *r);
  }
}

}  // namespace keep::manager
