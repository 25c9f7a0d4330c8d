// Back-pressure of the real keep-manager process over real ZeroMQ sockets (issue 27, 3 and 4):
// a client that pipelines hundreds of retrieves needing an embedding neither starves another
// client's retrieves nor queues beyond its cap; retrieves whose caller's timeout passed while
// they waited are dropped unrun; a client that never reads its large answers does not grow the
// daemon's memory, and others keep being served.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>
#include <zmq.hpp>

#include "shared/client/manager_client.h"
#include "tests/integration/manager/manager_process.h"
#include "tests/integration/manager/raw_peer.h"

namespace {

using namespace std::chrono_literals;
namespace kc = keep::client;
namespace it = keep::itest;
namespace proto = keep::proto;
using keep::Code;
using Clock = std::chrono::steady_clock;

// A query of ~40 tokens, distinct per (tag, i): its embedding is never cached (tens of ms on a
// loaded core).
std::string long_query(const std::string& tag, int i) {
  std::string q = tag + " " + std::to_string(i) + ":";
  for (int w = 0; w < 4; ++w) {
    q += " where did robot " + std::to_string(i * 41 + w) + " leave the cup";
  }
  return q;
}

std::string retrieve_bytes(uint64_t id, const std::string& agent, const std::string& query,
                           uint32_t timeout_ms = 0) {
  return it::request_bytes(id, [&](proto::Request::Builder r) {
    r.setTimeoutMs(timeout_ms);
    auto q = r.initRetrieve();
    q.setAgent(agent);
    q.setQuery(query);
    q.setK(4);
  });
}

uint64_t counter(kc::ManagerClient& c, const std::string& name) {
  auto s = c.stats();
  REQUIRE_MESSAGE(s.is_ok(), s.status().to_string());
  for (const auto& [n, v] : s->counters) {
    if (n == name) return v;
  }
  return 0;
}

std::unique_ptr<kc::ManagerClient> connect(const it::ManagerProcess& m,
                                           std::chrono::milliseconds timeout = 10000ms) {
  kc::ClientOptions o;
  o.endpoint = m.endpoint();
  o.timeout = timeout;
  auto c = kc::ManagerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(*c);
}

// VmRSS of `pid` in bytes (0 when unreadable).
uint64_t rss_bytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The answers to `n` requests of `peer`, counted as ok, `error` or other, within 60 s.
struct Tally {
  int ok = 0, error = 0, other = 0;
  std::string message;  // the last `error` answer's
};
Tally collect(it::RawPeer& peer, int n, Code error) {
  Tally t;
  const auto until = Clock::now() + 60s;
  while (t.ok + t.error + t.other < n && Clock::now() < until) {
    auto ans = peer.answer(1000ms);
    if (!ans.has_value()) continue;
    if (ans->first.is_ok()) {
      t.ok += 1;
    } else if (ans->first.code() == error) {
      t.error += 1;
      t.message = ans->first.message();
    } else {
      t.other += 1;
      MESSAGE("unexpected answer: " << ans->first.to_string());
    }
  }
  return t;
}

// A keep-manager with one retrieve thread (on a FIFO every client would then wait for all the
// retrieves queued before its own) and a client that wrote one memory of agent "a".
struct OneRetrieveThread {
  explicit OneRetrieveThread(const std::string& tag)
      : tmp(tag),
        m({(tmp.path() / "data").string(), it::unique_name(tag), {"--retrieve-threads", "1"}}),
        b(connect(m)) {
    REQUIRE(
        b->write({"a", {}, "the cup is on the table", kc::SegmentKind::kObjectState, {}}).is_ok());
  }
  it::TempDir tmp;
  it::ManagerProcess m;
  std::unique_ptr<kc::ManagerClient> b;
};

// The encoder on one thread per call, as benchmarks/manager runs it: OpenBLAS threads that spin
// on two shared cores would make an embedding's cost noise.
const bool kOneBlasThread = ::setenv("OPENBLAS_NUM_THREADS", "1", 1) == 0;

}  // namespace

TEST_CASE("one client's retrieve backlog neither starves another's nor queues beyond its cap") {
  OneRetrieveThread f("fair");
  it::ManagerProcess& m = f.m;
  auto& b = f.b;
  REQUIRE(
      b->write({"b", {}, "the plate is in the sink", kc::SegmentKind::kObjectState, {}}).is_ok());

  constexpr int kBacklog = 300;
  it::RawPeer a(m.endpoint());
  for (int i = 0; i < kBacklog; ++i) a.send({"", retrieve_bytes(i + 1, "a", long_query("a", i))});
  // A's backlog is queued (on a FIFO it would be almost all of it).
  const auto wait_until = Clock::now() + 20s;
  while (counter(*b, "retrieves_waiting") < 32 && Clock::now() < wait_until) {
    std::this_thread::sleep_for(5ms);
  }
  REQUIRE(counter(*b, "retrieves_waiting") >= 32);

  // B's retrieves with new queries wait for about one embedding of A's, not for A's backlog.
  double worst_ms = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    auto r = b->retrieve("b", long_query("b", i), 4);
    const double took = ms_since(t0);
    REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
    worst_ms = std::max(worst_ms, took);
  }
  MESSAGE("B's slowest retrieve behind A's backlog: " << worst_ms << " ms");
  CHECK(worst_ms < 2000);

  // A: its cap (64 by default) queued and answered, the rest refused at once.
  const Tally t = collect(a, kBacklog, Code::kResourceExhausted);
  const int ok = t.ok, exhausted = t.error;
  MESSAGE("A: " << ok << " answered, " << exhausted << " refused");
  CHECK(ok + exhausted == kBacklog);
  CHECK(t.other == 0);
  CHECK(exhausted >= kBacklog - 64 - 16);  // a few more fit as the thread takes some meanwhile
  CHECK(ok >= 64);
  CHECK(t.message.find("retry later") != std::string::npos);
  CHECK(counter(*b, "retrieves_refused") == static_cast<uint64_t>(exhausted));
  CHECK(m.terminate() == 0);
}

TEST_CASE("retrieves whose caller's timeout passed while they waited are dropped unrun") {
  OneRetrieveThread f("deadline");
  it::ManagerProcess& m = f.m;
  auto& b = f.b;
  // What one embedding of such a query costs here.
  std::vector<double> took;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    REQUIRE(b->retrieve("a", long_query("calibrate", i), 4).is_ok());
    took.push_back(ms_since(t0));
  }
  std::sort(took.begin(), took.end());
  const double embed_ms = std::max(2.0, took[1]);
  const auto timeout_ms = static_cast<uint32_t>(std::max(200.0, 4 * embed_ms));

  constexpr int kSent = 60;
  it::RawPeer a(m.endpoint());
  const auto t0 = Clock::now();
  for (int i = 0; i < kSent; ++i) {
    a.send({"", retrieve_bytes(i + 1, "a", long_query("late", i), timeout_ms)});
  }
  const Tally t = collect(a, kSent, Code::kTimeout);
  const int ok = t.ok, timed_out = t.error;
  const double drained_ms = ms_since(t0);
  MESSAGE("embedding ~" << embed_ms << " ms, timeoutMs " << timeout_ms << ": " << ok
                        << " answered, " << timed_out << " expired, all in " << drained_ms
                        << " ms");
  CHECK(ok + timed_out == kSent);
  CHECK(t.other == 0);
  CHECK(timed_out > kSent / 2);
  // Embedding every one would take kSent x embed_ms.
  CHECK(drained_ms < kSent * embed_ms / 2);
  CHECK(counter(*b, "retrieves_expired") == static_cast<uint64_t>(timed_out));
  CHECK(m.terminate() == 0);
}

TEST_CASE("a client that never reads large answers does not grow the daemon's memory") {
  it::TempDir tmp("nonreader");
  // Pages of at most 512 KiB of text: at the default --zmq-send-hwm (64) and
  // --max-queued-reply-bytes-per-client (16 MiB) the daemon may hold ~48 MiB for this client.
  it::ManagerProcess m({(tmp.path() / "data").string(),
                        it::unique_name("nonreader"),
                        {"--max-text-bytes", "64KiB", "--max-message-bytes", "512KiB"}});
  auto b = connect(m);
  // ~1.2 MB of text: one listMemories page is as large as a page may be.
  for (int i = 0; i < 20; ++i) {
    const std::string text = "memory " + std::to_string(i) + " " + std::string(60000, 'x');
    REQUIRE(b->write({"big", {}, text, kc::SegmentKind::kTaskRecord, {}}).is_ok());
  }
  std::this_thread::sleep_for(500ms);
  const uint64_t rss_before = rss_bytes(m.pid());
  REQUIRE(rss_before > 0);

  // Reads nothing: its own ZeroMQ takes one answer and a few KiB, then the daemon holds the rest.
  it::RawPeer deaf(m.endpoint(), [](zmq::socket_t& s) {
    s.set(zmq::sockopt::rcvhwm, 1);
    s.set(zmq::sockopt::rcvbuf, 4096);
  });
  constexpr int kRequests = 400;
  for (int i = 0; i < kRequests; ++i) {
    deaf.send({"", it::request_bytes(i + 1, [](proto::Request::Builder r) {
                 auto l = r.initListMemories();
                 l.setAgent("big");
                 l.setLimit(1000);
               })});
  }

  // Until every request was handled or refused (the counters stop moving), sampling the RSS;
  // the other client is served all along.
  uint64_t rss_max = rss_before;
  double slowest_ping_ms = 0;
  std::pair<uint64_t, uint64_t> last{0, 0};  // replies dropped, requests refused
  auto stable_since = Clock::now();
  const auto until = Clock::now() + 30s;
  while (Clock::now() < until) {
    rss_max = std::max(rss_max, rss_bytes(m.pid()));
    const auto t0 = Clock::now();
    auto p = b->ping();
    REQUIRE_MESSAGE(p.is_ok(), p.status().to_string());
    slowest_ping_ms = std::max(slowest_ping_ms, ms_since(t0));
    const std::pair<uint64_t, uint64_t> now{counter(*b, "replies_dropped"),
                                            counter(*b, "requests_refused_unread")};
    if (now != last) {
      last = now;
      stable_since = Clock::now();
    } else if (now.second != 0 && Clock::now() - stable_since > 1s) {
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  rss_max = std::max(rss_max, rss_bytes(m.pid()));
  const uint64_t dropped = counter(*b, "replies_dropped");
  const uint64_t refused = counter(*b, "requests_refused_unread");
  const uint64_t queued = counter(*b, "reply_queued_bytes");
  MESSAGE("RSS " << rss_before / 1000000 << " MB -> max " << rss_max / 1000000 << " MB; dropped "
                 << dropped << ", refused " << refused << ", queued " << queued
                 << " B; slowest ping " << slowest_ping_ms << " ms");
  CHECK(rss_max - rss_before < 100'000'000);
  CHECK(dropped > 0);
  CHECK(refused > 0);
  CHECK(queued <= (16u << 20));
  CHECK(slowest_ping_ms < 1000);
  // Still serving everyone else, listings included.
  auto page = b->list_memories("big", 0, 1000);
  REQUIRE_MESSAGE(page.is_ok(), page.status().to_string());
  CHECK(page->memories.size() == 8);  // a page holds at most 512 KiB of text
  CHECK(page->more);
  CHECK(m.terminate() == 0);
}
