// KvJobQueue: the bookkeeping of KV jobs (queued -> running -> completed / failed / cancelled).
// FIFO by job id. Cancelling a queued job removes it; a running job is never cancelled (its
// completion is checked against the current versions instead). Not persisted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string_view>
#include <vector>

#include "services/manager/store/memory_store.h"

namespace keep::manager {

class KvJobQueue {
 public:
  struct Entry {
    KvJob job;
    bool running = false;
  };

  // Queues `job` (its job_id is assigned here) and returns the id.
  uint64_t enqueue(KvJob job);
  // Removes a QUEUED job; returns false when unknown or running (left alone).
  bool cancel(uint64_t job_id);
  // Up to `max` queued jobs, oldest first, now running.
  std::vector<KvJob> take(size_t max);
  Entry* find(uint64_t job_id);
  const Entry* find(uint64_t job_id) const;
  // Removes a job (completed or dropped).
  void erase(uint64_t job_id);
  // A running job goes back to the end of the queue with attempt + 1.
  void requeue(uint64_t job_id);
  // Removes every job of `agent`, queued or running (the agent was dropped).
  void forget_agent(std::string_view agent);
  void clear();

  size_t queued() const { return queued_; }
  size_t running() const { return jobs_.size() - queued_; }

 private:
  uint64_t next_id_ = 1;
  size_t queued_ = 0;
  std::map<uint64_t, Entry> jobs_;
  std::deque<uint64_t> order_;  // queued ids, may hold ids since cancelled/requeued (skipped)
};

}  // namespace keep::manager
