#include "shared/rpc/reply_outbox.h"

#include <iterator>

namespace keep::wire {

bool ReplyOutbox::overflowed(const std::string& peer) const {
  auto it = peers_.find(peer);
  return it != peers_.end() && it->second.overflowed;
}

bool ReplyOutbox::push(const std::string& peer, std::string payload, Clock::time_point now) {
  auto [it, added] = peers_.try_emplace(peer);
  Box& box = it->second;
  if (added) box.last_progress = now;
  if (box.bytes + payload.size() > max_bytes_) {
    box.overflowed = true;
    dropped_ += 1;
    if (box.replies.empty()) peers_.erase(it);  // a reply larger than the bound on its own
    return false;
  }
  box.bytes += payload.size();
  bytes_ += payload.size();
  replies_ += 1;
  box.replies.push_back(std::move(payload));
  return true;
}

size_t ReplyOutbox::drop(Box& box) {
  const size_t n = box.replies.size();
  bytes_ -= box.bytes;
  replies_ -= n;
  dropped_ += n;
  box.replies.clear();
  box.bytes = 0;
  return n;
}

size_t ReplyOutbox::flush(const SendFn& send, Clock::time_point now) {
  size_t dropped = 0;
  for (auto it = peers_.begin(); it != peers_.end();) {
    Box& box = it->second;
    bool gone = false;
    while (!box.replies.empty()) {
      const Sent s = send(it->first, box.replies.front());
      if (s == Sent::kFull) break;
      if (s == Sent::kGone) {
        gone = true;
        break;
      }
      const size_t n = box.replies.front().size();
      box.bytes -= n;
      bytes_ -= n;
      sent_ += n;
      replies_ -= 1;
      box.replies.pop_front();
      box.last_progress = now;
      box.overflowed = false;
    }
    if (gone || (!box.replies.empty() && now - box.last_progress >= stall_timeout_)) {
      dropped += drop(box);
    }
    it = box.replies.empty() ? peers_.erase(it) : std::next(it);
  }
  return dropped;
}

size_t ReplyOutbox::clear() {
  size_t dropped = 0;
  for (auto& [peer, box] : peers_) dropped += drop(box);
  peers_.clear();
  return dropped;
}

}  // namespace keep::wire
