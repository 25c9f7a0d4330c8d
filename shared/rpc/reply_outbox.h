// ReplyOutbox: answers the RPC server could not hand to ZeroMQ yet, per peer, bounded in bytes.
//
// ZeroMQ bounds a peer's queue in messages (ZMQ_SNDHWM), not bytes, so a peer that does not read
// large answers could make the daemon hold gigabytes. The server therefore keeps ZeroMQ's pipe
// short (with ZMQ_ROUTER_MANDATORY a full pipe says EAGAIN instead of dropping silently) and
// keeps the rest here: per peer, in order, at most `max_bytes_per_peer` bytes. A reply that would
// go beyond is dropped; a peer whose outbox has not moved for `stall_timeout` loses it whole, as
// does a peer that is gone. Plain data, not thread-safe: the server's I/O thread owns it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <unordered_map>

namespace keep::wire {

class ReplyOutbox {
 public:
  using Clock = std::chrono::steady_clock;
  // What handing one reply to the socket did.
  enum class Sent { kOk, kFull, kGone };
  using SendFn = std::function<Sent(const std::string& peer, const std::string& payload)>;

  ReplyOutbox(size_t max_bytes_per_peer, std::chrono::milliseconds stall_timeout)
      : max_bytes_(max_bytes_per_peer), stall_timeout_(stall_timeout) {}

  // Whether `peer` has replies queued: a new one must go behind them, not to the socket.
  bool holds(const std::string& peer) const { return peers_.count(peer) != 0; }
  // Whether `peer` dropped a reply for its bound and has taken none since: it is not reading.
  bool overflowed(const std::string& peer) const;
  // Queues `payload` for `peer`; false (the reply dropped and counted) if it would take the
  // peer's outbox beyond its bound.
  bool push(const std::string& peer, std::string payload, Clock::time_point now);
  // Hands each peer's replies to `send`, oldest first, until its pipe is full. The outbox of a
  // peer that is gone, or that took nothing for stall_timeout, is dropped. Returns the replies
  // dropped.
  size_t flush(const SendFn& send, Clock::time_point now);
  // Drops everything (the server stops). Returns the replies dropped.
  size_t clear();

  bool empty() const { return peers_.empty(); }
  size_t bytes() const { return bytes_; }
  size_t replies() const { return replies_; }
  size_t peers() const { return peers_.size(); }
  uint64_t dropped() const { return dropped_; }  // since the start
  uint64_t bytes_sent() const { return sent_; }  // payload bytes flushed to the socket

 private:
  struct Box {
    std::deque<std::string> replies;
    size_t bytes = 0;
    Clock::time_point last_progress;  // queued first, or last reply taken
    bool overflowed = false;
  };
  size_t drop(Box& box);

  size_t max_bytes_;
  std::chrono::milliseconds stall_timeout_;
  std::unordered_map<std::string, Box> peers_;  // only peers with replies queued
  size_t bytes_ = 0;
  size_t replies_ = 0;
  uint64_t dropped_ = 0;
  uint64_t sent_ = 0;
};

}  // namespace keep::wire
