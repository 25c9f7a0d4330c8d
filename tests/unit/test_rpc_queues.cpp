// The RPC server's plain-data queues: FairQueue (deferred retrieves, per peer, round-robin,
// bounded, deadlines) and ReplyOutbox (answers ZeroMQ could not take, per peer, bounded in bytes).
#include <doctest/doctest.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "services/manager/server/fair_queue.h"
#include "shared/rpc/reply_outbox.h"

namespace {

using namespace std::chrono_literals;
using keep::manager::FairQueue;
using keep::wire::ReplyOutbox;
using Clock = std::chrono::steady_clock;

TEST_CASE("FairQueue takes keys in turn, each key in order") {
  FairQueue<std::string> q;
  for (int i = 0; i < 5; ++i) q.push("a", "a" + std::to_string(i));
  q.push("b", "b0");
  q.push("b", "b1");
  q.push("c", "c0");
  CHECK(q.size() == 8);
  CHECK(q.keys() == 3);
  CHECK(q.max_depth() == 5);
  std::vector<std::string> order;
  while (auto item = q.pop()) order.push_back(*item);
  // a's backlog delays b and c by one item each, not by five.
  CHECK(order == std::vector<std::string>{"a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"});
  CHECK(q.empty());
  CHECK(q.keys() == 0);
  CHECK_FALSE(q.pop().has_value());
}

TEST_CASE("FairQueue: a key that comes back waits behind the keys queued meanwhile") {
  FairQueue<int> q;
  q.push("a", 1);
  q.push("b", 2);
  CHECK(*q.pop() == 1);  // a is empty and leaves the ring
  q.push("a", 3);
  CHECK(*q.pop() == 2);
  CHECK(*q.pop() == 3);
}

TEST_CASE("FairQueue admits within the per-key and total bounds") {
  FairQueue<int> q({/*total=*/5, /*per_key=*/3});
  using Admit = FairQueue<int>::Admit;
  for (int i = 0; i < 3; ++i) {
    REQUIRE(q.admit("a") == Admit::kYes);
    q.push("a", i);
  }
  CHECK(q.admit("a") == Admit::kKeyFull);
  CHECK(q.admit("b") == Admit::kYes);
  q.push("b", 10);
  q.push("b", 11);
  CHECK(q.admit("c") == Admit::kFull);  // 5 in all
  CHECK(q.admit("a") == Admit::kFull);
  (void)q.pop();  // a0
  CHECK(q.admit("a") == Admit::kYes);
  CHECK(q.admit("c") == Admit::kYes);

  FairQueue<int> unbounded;
  for (int i = 0; i < 1000; ++i) unbounded.push("a", i);
  CHECK(unbounded.admit("a") == Admit::kYes);
}

TEST_CASE("FairQueue drops the items whose deadline passed, keeping the others in order") {
  FairQueue<int> q;
  const auto t0 = Clock::now();
  q.push("a", 1, t0 + 10ms);
  q.push("a", 2);  // no deadline
  q.push("b", 3, t0 + 10ms);
  q.push("a", 4, t0 + 100ms);
  q.push("c", 5, t0 + 5ms);
  std::vector<int> expired;
  q.take_expired(t0 + 1ms, &expired);
  CHECK(expired.empty());
  q.take_expired(t0 + 20ms, &expired);
  CHECK(expired == std::vector<int>{1, 3, 5});
  CHECK(q.size() == 2);
  CHECK(q.keys() == 1);  // b and c left
  CHECK(*q.pop() == 2);
  CHECK(*q.pop() == 4);
  CHECK(q.empty());
}

TEST_CASE("FairQueue take_all empties every key") {
  FairQueue<int> q;
  q.push("a", 1);
  q.push("b", 2);
  q.push("a", 3);
  CHECK(q.take_all() == std::vector<int>{1, 2, 3});
  CHECK(q.empty());
  CHECK(q.keys() == 0);
}

// A socket stand-in: per peer, how many more replies its pipe takes (absent: gone).
struct FakeSocket {
  std::map<std::string, int> room;
  std::map<std::string, std::vector<std::string>> got;
  ReplyOutbox::Sent send(const std::string& peer, const std::string& payload) {
    auto it = room.find(peer);
    if (it == room.end()) return ReplyOutbox::Sent::kGone;
    if (it->second == 0) return ReplyOutbox::Sent::kFull;
    it->second -= 1;
    got[peer].push_back(payload);
    return ReplyOutbox::Sent::kOk;
  }
  ReplyOutbox::SendFn fn() {
    return [this](const std::string& p, const std::string& b) { return send(p, b); };
  }
};

TEST_CASE("ReplyOutbox keeps a peer's replies in order within its byte bound") {
  ReplyOutbox box(100, 1000ms);
  const auto t0 = Clock::now();
  CHECK_FALSE(box.holds("a"));
  CHECK(box.push("a", std::string(40, '1'), t0));
  CHECK(box.push("a", std::string(40, '2'), t0));
  CHECK_FALSE(box.overflowed("a"));
  CHECK_FALSE(box.push("a", std::string(40, '3'), t0));  // 120 > 100: dropped
  CHECK(box.overflowed("a"));
  CHECK(box.push("a", std::string(20, '4'), t0));   // exactly 100 fits
  CHECK(box.push("b", std::string(100, 'b'), t0));  // bounds are per peer
  CHECK_FALSE(box.push("c", std::string(101, 'c'), t0));
  CHECK_FALSE(box.holds("c"));
  CHECK(box.bytes() == 200);
  CHECK(box.replies() == 4);
  CHECK(box.dropped() == 2);

  FakeSocket sock;
  sock.room = {{"a", 2}, {"b", 0}};
  CHECK(box.flush(sock.fn(), t0 + 1ms) == 0);
  REQUIRE(sock.got["a"].size() == 2);
  CHECK(sock.got["a"][0][0] == '1');
  CHECK(sock.got["a"][1][0] == '2');
  CHECK_FALSE(box.overflowed("a"));  // it read: taken as a reader again
  CHECK(box.bytes() == 120);
  sock.room["a"] = 5;
  sock.room["b"] = 5;
  CHECK(box.flush(sock.fn(), t0 + 2ms) == 0);
  CHECK(sock.got["a"].size() == 3);
  CHECK(sock.got["a"][2][0] == '4');
  CHECK(sock.got["b"].size() == 1);
  CHECK(box.empty());
  CHECK(box.bytes() == 0);
  CHECK(box.bytes_sent() == 200);
}

TEST_CASE("ReplyOutbox drops the outbox of a peer that is gone or stalled") {
  ReplyOutbox box(1000, 50ms);
  const auto t0 = Clock::now();
  for (int i = 0; i < 3; ++i) {
    box.push("gone", "x", t0);
    box.push("stuck", "y", t0);
    box.push("slow", "z", t0);
  }
  FakeSocket sock;
  sock.room = {{"stuck", 0}, {"slow", 1}};
  CHECK(box.flush(sock.fn(), t0 + 10ms) == 3);  // gone
  CHECK_FALSE(box.holds("gone"));
  CHECK(box.flush(sock.fn(), t0 + 40ms) == 0);  // not yet stalled
  sock.room["slow"] = 1;
  CHECK(box.flush(sock.fn(), t0 + 70ms) == 3);  // stuck: 70 ms without progress
  CHECK_FALSE(box.holds("stuck"));
  CHECK(box.holds("slow"));  // took one at 10 ms and one at 70 ms: not stalled
  CHECK(box.replies() == 1);
  CHECK(box.dropped() == 6);
  CHECK(box.clear() == 1);
  CHECK(box.empty());
}

}  // namespace
