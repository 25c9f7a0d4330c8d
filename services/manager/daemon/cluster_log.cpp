#include "services/manager/daemon/cluster_log.h"

#include <algorithm>
#include <chrono>
#include <set>

#include "shared/cluster/placement.h"
#include "shared/common/log.h"

namespace keep::manager {
namespace {

constexpr const char* kLog = "cluster";
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

Result<std::unique_ptr<ClusterLog>> ClusterLog::connect(const std::string& conninfo,
                                                        uint32_t shards, MemoryStore* store,
                                                        BatchCommitter* wal,
                                                        metrics::Registry* registry) {
  KEEP_CHECK(store != nullptr && registry != nullptr && shards > 0);
  KEEP_ASSIGN_OR_RETURN(auto writer, cluster::PgLog::connect(conninfo));
  KEEP_ASSIGN_OR_RETURN(auto reader, cluster::PgLog::connect(conninfo));
  return std::unique_ptr<ClusterLog>(
      new ClusterLog(std::move(writer), std::move(reader), shards, store, wal, registry));
}

ClusterLog::ClusterLog(std::unique_ptr<cluster::PgLog> writer,
                       std::unique_ptr<cluster::PgLog> reader, uint32_t shards, MemoryStore* store,
                       BatchCommitter* wal, metrics::Registry* registry)
    : writer_(std::move(writer)),
      reader_(std::move(reader)),
      shards_(shards),
      store_(store),
      wal_(wal),
      commit_seconds_(registry->histogram(
          "keep_manager_cluster_log_commit_seconds",
          "Cluster mode: time of one group commit of mutations to the log of record (PostgreSQL)",
          {}, metrics::exponential_buckets(0.0001, 2, 16))),
      entries_(registry->counter("keep_manager_cluster_log_entries_total",
                                 "Cluster mode: mutations committed to the log of record")),
      refused_(registry->counter(
          "keep_manager_cluster_log_refused_total",
          "Cluster mode: shards' parts of a commit not written, by reason (stale: fenced by a "
          "newer owner; error: the log failed)",
          {"reason"})),
      takeover_seconds_(registry->histogram(
          "keep_manager_cluster_takeover_seconds",
          "Cluster mode: time to take a shard over (fence, read and replay its log)", {},
          metrics::exponential_buckets(0.001, 2, 16))),
      replayed_(registry->counter("keep_manager_cluster_replayed_entries_total",
                                  "Cluster mode: log entries replayed from the log of record "
                                  "when taking shards over")),
      dropped_(registry->counter(
          "keep_manager_cluster_agents_dropped_total",
          "Cluster mode: agents forgotten in memory (refused or unconfirmed mutations, or local "
          "state that is not a prefix of their log)")),
      checkpoints_(registry->counter(
          "keep_manager_cluster_checkpoints_total",
          "Cluster mode: checkpoints of agents' state written to the log of record (compaction), "
          "by result (ok; stale: fenced by a newer owner; error)",
          {"result"})),
      checkpoints_loaded_(
          registry->counter("keep_manager_cluster_checkpoints_loaded_total",
                            "Cluster mode: agents' checkpoints loaded when taking shards over")),
      compacted_(registry->counter(
          "keep_manager_cluster_compacted_entries_total",
          "Cluster mode: log entries a checkpoint of this node covers (deleted from the log)")) {}

ClusterLog::~ClusterLog() { stop(); }

void ClusterLog::start(cluster::ShardKeeper* keeper, std::mutex* store_mutex) {
  KEEP_CHECK(keeper != nullptr && store_mutex != nullptr && !thread_.joinable());
  store_mutex_ = store_mutex;
  keeper_.store(keeper);
  thread_ = std::thread([this] { run(); });
}

void ClusterLog::stop() {
  keeper_.store(nullptr);
  {
    std::lock_guard<std::mutex> lock(run_mu_);
    stop_ = true;
  }
  run_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Result<RecordLog::Route> ClusterLog::route(std::string_view agent) {
  cluster::ShardKeeper* k = keeper_.load();
  if (k == nullptr) return Status(Code::kUnavailable, "this node is not in the cluster yet");
  const uint32_t shard = cluster::shard_of(agent, shards_);
  const uint64_t epoch = k->epoch_of(shard);
  if (epoch == 0) {
    Status st = k->route(agent);  // kMoved or "no owner yet"
    if (st.is_ok()) {             // taken between the two reads: ask again
      st = Status(Code::kUnavailable, "agent '" + std::string(agent) + "' (shard " +
                                          std::to_string(shard) + ") has no owner yet: retry");
    }
    return st;
  }
  auto it = ready_.find(shard);
  if (it == ready_.end() || it->second != epoch) {
    return Status(Code::kUnavailable, "agent '" + std::string(agent) + "' (shard " +
                                          std::to_string(shard) +
                                          ") is being taken over by this node (replaying its "
                                          "log): retry");
  }
  return Route{shard, epoch};
}

void ClusterLog::commit(std::vector<ShardBatch>* batches) {
  std::vector<cluster::ShardAppend> appends;
  appends.reserve(batches->size());
  size_t entries = 0;
  for (const ShardBatch& b : *batches) {
    cluster::ShardAppend a{b.shard, b.epoch, {}};
    a.records.reserve(b.entries.size());
    for (const Entry& e : b.entries) {
      a.records.push_back(cluster::LogRecord{e.agent, e.seq, b.epoch, e.record});
    }
    entries += b.entries.size();
    appends.push_back(std::move(a));
  }
  const auto t0 = Clock::now();
  auto results = writer_->append_shards(appends);
  commit_seconds_.get().observe(seconds_since(t0));
  for (size_t i = 0; i < batches->size(); ++i) {
    ShardBatch& b = (*batches)[i];
    b.result = results.is_ok() ? (*results)[i] : results.status();
    if (b.result.is_ok()) {
      entries_.get().inc(static_cast<double>(b.entries.size()));
      if (compact_after_ != 0) {
        for (const Entry& e : b.entries) {
          auto c = checkpointed_.find(e.agent);
          if (e.seq > (c == checkpointed_.end() ? 0 : c->second) + compact_after_) {
            compact_due_.insert(e.agent);
          }
        }
      }
      continue;
    }
    refused_.labels({b.result.code() == Code::kStale ? "stale" : "error"}).inc();
    give_up_locked(b.shard, b.epoch);
  }
  if (!results.is_ok()) {
    KEEP_LOG_ERROR(kLog, "commit of %zu entries of %zu shards failed: %s", entries, batches->size(),
                   results.status().to_string().c_str());
  }
}

void ClusterLog::give_up_locked(uint32_t shard, uint64_t epoch) {
  ready_.erase(shard);
  given_up_[shard] = epoch;
  if (cluster::ShardKeeper* k = keeper_.load()) k->give_up(shard, epoch);
  KEEP_LOG_WARN(kLog, "shard %u: not served any more at epoch %llu (given up)", shard,
                static_cast<unsigned long long>(epoch));
}

size_t ClusterLog::shards_ready() const {
  cluster::ShardKeeper* k = keeper_.load();
  if (k == nullptr || store_mutex_ == nullptr) return 0;
  const std::map<uint32_t, uint64_t> owned = k->owned_shards();
  std::lock_guard<std::mutex> lock(*store_mutex_);
  size_t n = 0;
  for (const auto& [shard, epoch] : owned) {
    auto it = ready_.find(shard);
    n += it != ready_.end() && it->second == epoch ? 1 : 0;
  }
  return n;
}

void ClusterLog::run() {
  std::chrono::milliseconds wait{0};
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(run_mu_);
      if (run_cv_.wait_for(lock, wait, [this] { return stop_; })) return;
    }
    wait = std::chrono::milliseconds(50);
    cluster::ShardKeeper* k = keeper_.load();
    if (k == nullptr) continue;
    std::vector<std::pair<uint32_t, uint64_t>> todo;
    {
      const std::map<uint32_t, uint64_t> owned = k->owned_shards();
      std::lock_guard<std::mutex> lock(*store_mutex_);
      std::erase_if(ready_, [&](const auto& e) { return owned.count(e.first) == 0; });
      for (const auto& [shard, epoch] : owned) {
        auto r = ready_.find(shard);
        auto g = given_up_.find(shard);
        if ((r != ready_.end() && r->second == epoch) ||
            (g != given_up_.end() && g->second >= epoch)) {
          continue;
        }
        todo.emplace_back(shard, epoch);
      }
    }
    for (const auto& [shard, epoch] : todo) {
      {
        std::lock_guard<std::mutex> lock(run_mu_);
        if (stop_) return;
      }
      Status st = take_over(shard, epoch);
      if (st.is_ok()) continue;
      KEEP_LOG_WARN(kLog, "taking shard %u over at epoch %llu: %s", shard,
                    static_cast<unsigned long long>(epoch), st.to_string().c_str());
      if (st.code() == Code::kStale) {  // a newer owner fenced it already
        std::lock_guard<std::mutex> lock(*store_mutex_);
        give_up_locked(shard, epoch);
      } else {
        wait = std::chrono::milliseconds(500);  // the log is unreachable: not in a tight loop
      }
    }
    compact();
  }
}

void ClusterLog::compact() {
  struct Due {
    uint32_t shard;
    uint64_t epoch;
    cluster::Checkpoint cp;
  };
  std::vector<Due> due;
  {
    std::lock_guard<std::mutex> lock(*store_mutex_);
    if (compact_due_.empty()) return;
    // Bounded per round, so that a takeover waits for at most that many checkpoints.
    constexpr size_t kPerRound = 64;
    for (auto it = compact_due_.begin(); it != compact_due_.end() && due.size() < kPerRound;) {
      const std::string agent = *it;
      it = compact_due_.erase(it);
      const uint32_t shard = cluster::shard_of(agent, shards_);
      auto r = ready_.find(shard);
      if (r == ready_.end()) continue;  // not served now: its next owner compacts it
      const LogPosition p = store_->log_position(agent);
      if (p.seq == 0 || p.seq <= checkpointed_[agent]) continue;
      // Every entry up to p.seq is committed: commits hold the store mutex, and an agent whose
      // commit failed was dropped.
      due.push_back(
          Due{shard, r->second,
              cluster::Checkpoint{agent, p.seq, p.epoch, r->second, store_->capture_agent(agent)}});
    }
  }
  for (Due& d : due) {
    const uint64_t before = [&] {
      std::lock_guard<std::mutex> lock(*store_mutex_);
      return checkpointed_[d.cp.agent];
    }();
    Status st = reader_->checkpoint(d.shard, d.epoch, d.cp);
    std::lock_guard<std::mutex> lock(*store_mutex_);
    if (st.is_ok()) {
      uint64_t& known = checkpointed_[d.cp.agent];
      known = std::max(known, d.cp.seq);
      checkpoints_.labels({"ok"}).inc();
      compacted_.get().inc(static_cast<double>(d.cp.seq - std::min(before, d.cp.seq)));
      continue;
    }
    KEEP_LOG_WARN(kLog, "checkpoint of agent '%s' at entry %llu (shard %u, epoch %llu): %s",
                  d.cp.agent.c_str(), static_cast<unsigned long long>(d.cp.seq), d.shard,
                  static_cast<unsigned long long>(d.epoch), st.to_string().c_str());
    if (st.code() == Code::kStale) {  // a newer owner fenced the shard: stop serving it
      checkpoints_.labels({"stale"}).inc();
      auto r = ready_.find(d.shard);
      if (r != ready_.end() && r->second == d.epoch) give_up_locked(d.shard, d.epoch);
    } else {
      checkpoints_.labels({"error"}).inc();  // tried again after its next commit
    }
  }
}

void ClusterLog::drop_locked(const std::string& agent) {
  std::string record;
  (void)store_->drop_agent(agent, &record);
  if (wal_ != nullptr && !record.empty()) {
    if (Status st = wal_->append(record); !st.is_ok()) {
      KEEP_LOG_ERROR(kLog, "WAL append (drop of %s): %s", agent.c_str(), st.to_string().c_str());
    }
  }
  dropped_.get().inc();
}

Status ClusterLog::apply_locked(const std::string& agent, const cluster::LogRecord* records,
                                size_t n, uint64_t after) {
  for (size_t i = 0; i < n; ++i) {
    const cluster::LogRecord& rec = records[i];
    if (rec.seq != after + 1 + i) {
      return Status(Code::kCorrupt, "the log of agent '" + agent + "' goes from seq " +
                                        std::to_string(after + i) + " to " +
                                        std::to_string(rec.seq));
    }
    if (Status st = store_->apply_record(rec.record); !st.is_ok()) {
      return st.with_context("replaying entry " + std::to_string(rec.seq) + " of agent '" + agent +
                             "'");
    }
    std::string logged = rec.record;
    KEEP_RETURN_IF_ERROR(store_->set_log_position(agent, {rec.seq, rec.epoch}, &logged));
    if (wal_ != nullptr) {
      if (Status st = wal_->append(logged); !st.is_ok()) {
        KEEP_LOG_ERROR(kLog, "WAL append (replay of %s): %s", agent.c_str(),
                       st.to_string().c_str());
      }
    }
  }
  replayed_.get().inc(static_cast<double>(n));
  return Status::ok();
}

Status ClusterLog::load_checkpoint_locked(const cluster::Checkpoint& cp) {
  std::string record;
  if (Status st = store_->load_agent(cp.state, &record); !st.is_ok()) {
    drop_locked(cp.agent);
    return st.with_context("loading the checkpoint of agent '" + cp.agent + "' at entry " +
                           std::to_string(cp.seq));
  }
  const LogPosition p = store_->log_position(cp.agent);
  if (p.seq != cp.seq || p.epoch != cp.epoch) {
    drop_locked(cp.agent);
    return Status(Code::kCorrupt, "the checkpoint of agent '" + cp.agent + "' at entry " +
                                      std::to_string(cp.seq) + " holds the state of entry " +
                                      std::to_string(p.seq));
  }
  if (wal_ != nullptr) {
    if (Status st = wal_->append(record); !st.is_ok()) {
      KEEP_LOG_ERROR(kLog, "WAL append (checkpoint of %s): %s", cp.agent.c_str(),
                     st.to_string().c_str());
    }
  }
  checkpoints_loaded_.get().inc();
  return Status::ok();
}

Status ClusterLog::take_over(uint32_t shard, uint64_t epoch) {
  const auto t0 = Clock::now();
  // 1. From now on an older owner's batch (or checkpoint) is refused, and every one it committed
  // is visible.
  KEEP_RETURN_IF_ERROR(reader_->fence(shard, epoch));
  // 2. The shard's checkpoints, and what the store holds of the shard's agents: a local state
  // older than the agent's checkpoint (or at its seq but not its epoch) gives way to it; one at
  // the checkpoint is its prefix; one past it is checked against the log below.
  KEEP_ASSIGN_OR_RETURN(std::vector<cluster::Checkpoint> cps, reader_->read_checkpoints(shard));
  std::map<std::string, const cluster::Checkpoint*> cp_of;
  for (const cluster::Checkpoint& c : cps) cp_of[c.agent] = &c;
  const auto after_checkpoint = [&cp_of](const std::string& agent) -> uint64_t {
    auto c = cp_of.find(agent);
    return c == cp_of.end() ? 0 : c->second->seq;
  };
  struct Held {
    LogPosition pos;
    bool verified = false;  // equal to its checkpoint: no log entry to compare
  };
  std::map<std::string, Held> held;
  std::map<std::string, uint64_t> from;
  size_t dropped = 0, loaded = 0;
  {
    std::lock_guard<std::mutex> lock(*store_mutex_);
    for (const std::string& agent : store_->list_agents()) {
      if (cluster::shard_of(agent, shards_) != shard) continue;
      const LogPosition p = store_->log_position(agent);
      if (p.seq == 0) {  // state that did not come from the log (single-node data): not trusted
        KEEP_LOG_WARN(kLog,
                      "agent '%s' of shard %u holds local state that is not from the log (a "
                      "single-node data directory?): dropped, only its log is served",
                      agent.c_str(), shard);
        drop_locked(agent);
        ++dropped;
        continue;
      }
      auto c = cp_of.find(agent);
      if (c != cp_of.end() && p.seq <= c->second->seq) {
        if (p.seq == c->second->seq && p.epoch == c->second->epoch) {
          held[agent] = Held{p, true};
          from[agent] = p.seq + 1;
        } else {
          drop_locked(agent);  // older than its checkpoint: the checkpoint replaces it
          ++dropped;
        }
        continue;
      }
      held[agent] = Held{p, false};
      from[agent] = p.seq;
    }
  }
  KEEP_ASSIGN_OR_RETURN(std::vector<cluster::LogRecord> rows, reader_->read_shard(shard, from));
  // 3. Each agent's entries after what it holds (or after its checkpoint, loaded first); an agent
  // whose position the log does not have is read again from its checkpoint.
  std::vector<std::string> again;
  std::set<std::string> seen;
  size_t applied = 0;
  for (size_t at = 0; at < rows.size();) {
    size_t end = at;
    while (end < rows.size() && rows[end].agent == rows[at].agent) ++end;
    const std::string& agent = rows[at].agent;
    seen.insert(agent);
    std::lock_guard<std::mutex> lock(*store_mutex_);
    auto h = held.find(agent);
    size_t first = at;
    uint64_t after = 0;
    if (h != held.end()) {
      if (!h->second.verified) {
        if (rows[at].seq != h->second.pos.seq || rows[at].epoch != h->second.pos.epoch) {
          drop_locked(agent);
          ++dropped;
          again.push_back(agent);
          at = end;
          continue;
        }
        first = at + 1;
      }
      after = h->second.pos.seq;
    } else if (auto c = cp_of.find(agent); c != cp_of.end()) {
      KEEP_RETURN_IF_ERROR(load_checkpoint_locked(*c->second));
      ++loaded;
      after = c->second->seq;
    }
    if (Status st = apply_locked(agent, rows.data() + first, end - first, after); !st.is_ok()) {
      drop_locked(agent);  // half applied: read it all again next time
      return st;
    }
    applied += end - first;
    at = end;
  }
  for (const auto& [agent, h] : held) {
    if (seen.count(agent) != 0 || h.verified) continue;
    std::lock_guard<std::mutex> lock(*store_mutex_);
    drop_locked(agent);  // the log has nothing at its position (an entry it never committed)
    ++dropped;
    again.push_back(agent);
  }
  for (const cluster::Checkpoint& c : cps) {  // agents whose log is all in their checkpoint
    if (seen.count(c.agent) != 0 || held.count(c.agent) != 0) continue;
    std::lock_guard<std::mutex> lock(*store_mutex_);
    KEEP_RETURN_IF_ERROR(load_checkpoint_locked(c));
    ++loaded;
  }
  for (const std::string& agent : again) {
    const uint64_t after = after_checkpoint(agent);
    KEEP_ASSIGN_OR_RETURN(std::vector<cluster::LogRecord> all, reader_->read(agent, after));
    std::lock_guard<std::mutex> lock(*store_mutex_);
    if (after != 0) {
      KEEP_RETURN_IF_ERROR(load_checkpoint_locked(*cp_of.at(agent)));
      ++loaded;
    }
    if (Status st = apply_locked(agent, all.data(), all.size(), after); !st.is_ok()) {
      drop_locked(agent);
      return st;
    }
    applied += all.size();
  }
  if (wal_ != nullptr) {
    if (Status st = wal_->sync(); !st.is_ok()) {
      KEEP_LOG_ERROR(kLog, "WAL sync after replay: %s", st.to_string().c_str());
    }
  }
  // 4. Served, if still this node's at that epoch.
  cluster::ShardKeeper* k = keeper_.load();
  std::lock_guard<std::mutex> lock(*store_mutex_);
  if (k == nullptr || k->epoch_of(shard) != epoch) {
    return Status(Code::kUnavailable, "the shard moved on while it was replayed");
  }
  for (const std::string& agent : store_->list_agents()) {
    if (cluster::shard_of(agent, shards_) != shard) continue;
    checkpointed_[agent] = after_checkpoint(agent);
    if (compact_after_ != 0 &&
        store_->log_position(agent).seq > checkpointed_[agent] + compact_after_) {
      compact_due_.insert(agent);  // a long log from before: compacted from now on
    }
  }
  ready_[shard] = epoch;
  const double dt = seconds_since(t0);
  takeover_seconds_.get().observe(dt);
  KEEP_LOG_INFO(kLog,
                "shard %u served at epoch %llu: %zu agents held locally, %zu checkpoints loaded, "
                "%zu entries replayed from the log, %zu agents whose local state was not the "
                "log's dropped, in %.3f s",
                shard, static_cast<unsigned long long>(epoch), held.size(), loaded, applied,
                dropped, dt);
  return Status::ok();
}

}  // namespace keep::manager
