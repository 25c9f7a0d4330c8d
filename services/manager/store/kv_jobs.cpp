#include "services/manager/store/kv_jobs.h"

#include <utility>

namespace keep::manager {

uint64_t KvJobQueue::enqueue(KvJob job) {
  const uint64_t id = next_id_++;
  job.job_id = id;
  jobs_.emplace(id, Entry{std::move(job), false});
  order_.push_back(id);
  ++queued_;
  return id;
}

bool KvJobQueue::cancel(uint64_t job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second.running) return false;
  jobs_.erase(it);
  --queued_;
  return true;
}

std::vector<KvJob> KvJobQueue::take(size_t max) {
  std::vector<KvJob> out;
  while (out.size() < max && !order_.empty()) {
    const uint64_t id = order_.front();
    order_.pop_front();
    auto it = jobs_.find(id);
    if (it == jobs_.end() || it->second.running) continue;  // cancelled, or a stale slot
    it->second.running = true;
    --queued_;
    out.push_back(it->second.job);
  }
  return out;
}

KvJobQueue::Entry* KvJobQueue::find(uint64_t job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

const KvJobQueue::Entry* KvJobQueue::find(uint64_t job_id) const {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

void KvJobQueue::erase(uint64_t job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  if (!it->second.running) --queued_;
  jobs_.erase(it);
}

void KvJobQueue::requeue(uint64_t job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || !it->second.running) return;
  it->second.running = false;
  it->second.job.attempt += 1;
  ++queued_;
  order_.push_back(job_id);
}

void KvJobQueue::forget_agent(std::string_view agent) {
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (it->second.job.agent != agent) {
      ++it;
      continue;
    }
    if (!it->second.running) --queued_;
    it = jobs_.erase(it);  // its slot in order_ is skipped by take()
  }
}

void KvJobQueue::clear() {
  jobs_.clear();
  order_.clear();
  queued_ = 0;
}

}  // namespace keep::manager
