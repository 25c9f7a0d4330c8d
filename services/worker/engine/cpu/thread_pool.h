// ThreadPool: a fixed set of worker threads for the CPU backend's loops (attention, norms).
//
// Idle workers block on a condition variable instead of spinning: OpenBLAS's own threads run the
// matrix products in between, and spinning workers (as libgomp's default wait policy has them)
// steal those threads' CPU time on machines with few cores.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace keep::engine {

class ThreadPool {
 public:
  // `threads` >= 1 participants: the calling thread plus threads - 1 workers.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i, participant) for every i in [0, n) and returns when all are done. participant is in
  // [0, size()) and unique among concurrently running calls (index per-thread scratch with it).
  // Runs inline when n <= 1 or the pool has one participant. Not reentrant.
  void parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn);

 private:
  void work(int participant);
  void drain(int participant);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int active_ = 0;  // workers still inside the current generation
};

}  // namespace keep::engine
