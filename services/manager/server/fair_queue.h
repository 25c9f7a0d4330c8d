// FairQueue: a bounded queue of work items kept per client, taken round-robin across clients.
//
// ManagerService queues the retrieves that must embed here, keyed by the ZeroMQ identity of the
// peer that sent them: a peer that pipelines hundreds of retrieves then delays another peer's by
// at most one item per retrieve thread, instead of by its whole backlog. Bounds: at most
// `per_key` items of one key and `total` of all keys (0: no bound); admit() says whether one
// more fits, so the caller can refuse the work at once. Items may carry a deadline (the caller's
// timeout): take_expired() removes those whose deadline has passed, so nobody does work whose
// caller no longer waits. Plain data, not thread-safe: the owner locks.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <deque>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace keep::manager {

template <typename T>
class FairQueue {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr Clock::time_point kNoDeadline = Clock::time_point::max();

  struct Limits {
    size_t total = 0;    // items of all keys; 0: no bound
    size_t per_key = 0;  // items of one key; 0: no bound
  };
  enum class Admit { kYes, kKeyFull, kFull };

  explicit FairQueue(Limits limits = {}) : limits_(limits) {}

  // Whether one more item of `key` fits.
  Admit admit(const std::string& key) const {
    if (limits_.total != 0 && size_ >= limits_.total) return Admit::kFull;
    if (limits_.per_key != 0) {
      auto it = queues_.find(key);
      if (it != queues_.end() && it->second.size() >= limits_.per_key) return Admit::kKeyFull;
    }
    return Admit::kYes;
  }

  // Appends to `key`'s queue regardless of the limits (check admit() first).
  void push(const std::string& key, T item, Clock::time_point deadline = kNoDeadline) {
    auto [it, added] = queues_.try_emplace(key);
    if (added) ring_.push_back(key);  // a new key waits behind the keys already queued
    it->second.push_back(Entry{std::move(item), deadline});
    size_ += 1;
  }

  // The oldest item of the key whose turn it is; that key then goes behind the others.
  std::optional<T> pop() {
    if (ring_.empty()) return std::nullopt;
    std::string key = std::move(ring_.front());
    ring_.pop_front();
    auto it = queues_.find(key);
    T item = std::move(it->second.front().item);
    it->second.pop_front();
    size_ -= 1;
    if (it->second.empty()) {
      queues_.erase(it);
    } else {
      ring_.push_back(std::move(key));
    }
    return item;
  }

  // Moves every item whose deadline is before `now` into `expired`, keys in turn order (O(items)).
  void take_expired(Clock::time_point now, std::vector<T>* expired) {
    std::deque<std::string> ring;
    for (std::string& key : ring_) {
      auto it = queues_.find(key);
      std::deque<Entry>& q = it->second;
      for (auto e = q.begin(); e != q.end();) {
        if (e->deadline < now) {
          expired->push_back(std::move(e->item));
          e = q.erase(e);
          size_ -= 1;
        } else {
          ++e;
        }
      }
      if (q.empty()) {
        queues_.erase(it);
      } else {
        ring.push_back(std::move(key));
      }
    }
    ring_.swap(ring);
  }

  // Removes and returns every item, keys in turn order, each key's oldest first.
  std::vector<T> take_all() {
    std::vector<T> all;
    all.reserve(size_);
    while (auto item = pop()) all.push_back(std::move(*item));
    return all;
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t keys() const { return queues_.size(); }
  // The longest queue of one key.
  size_t max_depth() const {
    size_t most = 0;
    for (const auto& [key, q] : queues_) most = std::max(most, q.size());
    return most;
  }

 private:
  struct Entry {
    T item;
    Clock::time_point deadline;
  };
  Limits limits_;
  std::unordered_map<std::string, std::deque<Entry>> queues_;  // only non-empty queues
  std::deque<std::string> ring_;                               // keys of queues_, in turn order
  size_t size_ = 0;
};

}  // namespace keep::manager
