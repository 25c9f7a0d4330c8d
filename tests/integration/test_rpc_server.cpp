// RpcServer + ManagerService over a real MemoryStore, driven through real ZeroMQ sockets by the
// client library, raw DEALER sockets (bad input of every kind) and the keepctl binary.
#include <capnp/message.h>
#include <doctest/doctest.h>

#include <unistd.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "services/manager/server/manager_service.h"
#include "shared/client/manager_client.h"
#include "shared/rpc/rpc_server.h"
#include "shared/rpc/wire_codec.h"
#include "tests/integration/manager/raw_peer.h"

using keep::Code;
using keep::Result;
using keep::Status;
namespace kc = keep::client;
namespace km = keep::manager;
namespace wire = keep::wire;
namespace proto = keep::proto;
using namespace std::chrono_literals;

namespace {

// Texts whose first word matches embed to the same direction (cosine 1), others are orthogonal.
// `delay` makes every call take that long; `on_embed` runs at the start of each call (on the
// calling thread, before the delay).
class FirstWordEmbedder : public km::Embedder {
 public:
  int dim() const override { return 32; }
  Result<std::vector<std::vector<float>>> embed(const std::vector<std::string>& texts) override {
    calls.fetch_add(1);
    texts_seen.fetch_add(texts.size());
    size_t most = largest.load();
    while (texts.size() > most && !largest.compare_exchange_weak(most, texts.size())) {
    }
    if (on_embed) on_embed(texts);
    if (fail.load()) return Status(Code::kUnavailable, "encoder down");
    if (delay.load().count() > 0) std::this_thread::sleep_for(delay.load());
    std::vector<std::vector<float>> out;
    for (const auto& t : texts) {
      std::vector<float> v(32, 0.0f);
      v[std::hash<std::string>{}(t.substr(0, t.find(' '))) % 32] = 1.0f;
      out.push_back(std::move(v));
    }
    return out;
  }
  std::atomic<std::chrono::milliseconds> delay{std::chrono::milliseconds(0)};
  std::function<void(const std::vector<std::string>&)> on_embed;
  std::atomic<int> calls{0};
  std::atomic<size_t> texts_seen{0};
  std::atomic<size_t> largest{0};  // the most texts in one call
  std::atomic<bool> fail{false};
};

class WordCounter : public km::TokenCounter {
 public:
  uint32_t count_tokens(std::string_view text) const override {
    uint32_t n = 0;
    bool in = false;
    for (char c : text) {
      const bool space = c == ' ';
      if (!space && !in) ++n;
      in = !space;
    }
    return n;
  }
};

// Counts appends and syncs; can be told to fail or to take time.
class CountingCommitter : public km::BatchCommitter {
 public:
  Status append(std::string_view record) override {
    std::lock_guard<std::mutex> lock(mu);
    records.emplace_back(record);
    return Status::ok();
  }
  Status sync() override {
    if (sync_delay.count() > 0) std::this_thread::sleep_for(sync_delay);
    syncs.fetch_add(1);
    if (fail_sync) return Status(Code::kIoError, "fdatasync: disk on fire");
    return Status::ok();
  }
  size_t appended() {
    std::lock_guard<std::mutex> lock(mu);
    return records.size();
  }
  std::mutex mu;
  std::vector<std::string> records;
  std::atomic<int> syncs{0};
  std::chrono::milliseconds sync_delay{0};
  std::atomic<bool> fail_sync{false};
};

// A small in-process region: enough to drive the reserve/commit/revoke/renew flow exactly.
class TestRegion : public km::KvRegionOps {
 public:
  struct Slot {
    uint64_t generation;
    uint32_t tokens;
    bool committed;
  };
  Result<km::EntryLocation> reserve(const km::KvJob&, uint32_t tokens, uint64_t,
                                    std::chrono::milliseconds) override {
    if (tokens > 100000) return Status(Code::kResourceExhausted, "arena full");
    const uint32_t index = next_index++;
    slots[index] = Slot{++generation, tokens, false};
    return km::EntryLocation{index, generation, uint64_t{index} * 4096, uint64_t{tokens} * 64,
                             tokens};
  }
  Status commit(uint32_t index, uint64_t gen) override {
    auto* s = find(index, gen);
    if (!s || s->committed) return Status(Code::kNotFound, "no such reservation");
    s->committed = true;
    return Status::ok();
  }
  Status revoke(uint32_t index, uint64_t gen) override {
    if (!find(index, gen)) return Status(Code::kNotFound, "no such reservation");
    slots.erase(index);
    return Status::ok();
  }
  Status renew(uint32_t index, uint64_t gen, std::chrono::milliseconds) override {
    return find(index, gen) ? Status::ok() : Status(Code::kNotFound, "no such reservation");
  }
  Status release(uint32_t index, uint64_t gen) override {
    if (!find(index, gen)) return Status(Code::kNotFound, "no such entry");
    slots.erase(index);
    released += 1;
    return Status::ok();
  }
  Result<km::EntryLocation> locate(uint32_t index, uint64_t gen) override {
    auto* s = find(index, gen);
    if (!s || !s->committed) return Status(Code::kNotFound, "no such entry");
    return km::EntryLocation{index, gen, uint64_t{index} * 4096, uint64_t{s->tokens} * 64,
                             s->tokens};
  }
  Slot* find(uint32_t index, uint64_t gen) {
    auto it = slots.find(index);
    return it != slots.end() && it->second.generation == gen ? &it->second : nullptr;
  }
  std::map<uint32_t, Slot> slots;
  uint32_t next_index = 1;
  uint64_t generation = 100;
  int released = 0;
};

// A whole manager: store + service + server on its own thread; retrieves that embed run on the
// service's retrieve threads (deferred calls), as in keep-manager, unless `defer_retrieves` is off.
struct Manager {
  explicit Manager(std::vector<std::string> endpoints = {"tcp://127.0.0.1:0"},
                   size_t max_message_bytes = wire::kDefaultMaxMessageBytes,
                   km::StoreOptions store_options = {}, bool defer_retrieves = true)
      : store(store_options, &embedder, &counter),
        service(&store, &committer, &region, km::ServiceOptions{}) {
    wire::ServerOptions options;
    options.endpoints = std::move(endpoints);
    options.limits.max_message_bytes = max_message_bytes;
    auto s = km::ManagerRpcServer::create(options, &service);
    REQUIRE(s.is_ok());
    server = std::move(s).value();
    if (defer_retrieves) {
      service.start_deferred_retrieves(
          [this](std::unique_ptr<km::ManagerCall> call) { server->complete(std::move(call)); });
    }
    server->start();
  }
  ~Manager() {
    service.stop_deferred_retrieves();  // while the server still sends their answers
    if (server) server->stop();
  }
  std::string endpoint() const { return server->bound_endpoints().at(0); }
  std::unique_ptr<kc::ManagerClient> client(std::chrono::milliseconds timeout = 5000ms) {
    kc::ClientOptions o;
    o.endpoint = endpoint();
    o.timeout = timeout;
    auto c = kc::ManagerClient::connect(o);
    REQUIRE(c.is_ok());
    return std::move(c).value();
  }

  FirstWordEmbedder embedder;
  WordCounter counter;
  CountingCommitter committer;
  TestRegion region;
  km::MemoryStore store;
  km::ManagerService service;
  std::unique_ptr<km::ManagerRpcServer> server;
};

using keep::itest::Answered;
using keep::itest::RawPeer;
using keep::itest::read_answer;
using keep::itest::request_bytes;

}  // namespace

TEST_CASE("every call round-trips through a real server and store") {
  Manager m;
  auto c = m.client();
  auto pong = c->ping();
  REQUIRE(pong.is_ok());
  CHECK(pong->find("protocol 1") != std::string::npos);

  auto w1 = c->write(
      {"robot", std::nullopt, "kitchen apple on the table", kc::SegmentKind::kObjectState, {}});
  REQUIRE(w1.is_ok());
  CHECK(w1->version == 1);
  auto w2 =
      c->write({"robot", 50, "kitchen knife in the drawer", kc::SegmentKind::kObjectState, {}});
  REQUIRE(w2.is_ok());
  CHECK(w2->id == 50);
  auto w3 = c->write(
      {"robot", std::nullopt, "plan: pick apple then slice", kc::SegmentKind::kExamplePlan, {}});
  REQUIRE(w3.is_ok());
  auto dup = c->write({"robot", 50, "kitchen again", kc::SegmentKind::kObjectState, {}});
  CHECK(dup.status().code() == Code::kAlreadyExists);

  auto u = c->update("robot", w1->id, "kitchen apple in the fridge", kc::SegmentKind::kTaskRecord);
  REQUIRE(u.is_ok());
  CHECK(u->version == 2);

  auto r = c->retrieve("robot", "kitchen where is the apple", 2);
  REQUIRE(r.is_ok());
  REQUIRE(r->size() == 3);
  CHECK(r->front().kind == kc::SegmentKind::kExamplePlan);  // example plans come first
  for (const auto& s : *r) {
    CHECK(s.group_id != 0);
    CHECK_FALSE(s.kv.has_value());
  }

  auto groups = c->list_groups("robot");
  REQUIRE(groups.is_ok());
  CHECK_FALSE(groups->empty());

  // The memories by id, in pages: 1 (updated), 50, then the example plan (51).
  auto page = c->list_memories("robot", 0, 2);
  REQUIRE(page.is_ok());
  REQUIRE(page->memories.size() == 2);
  CHECK(page->more);
  CHECK(page->memories[0].id == w1->id);
  CHECK(page->memories[0].version == 2);
  CHECK(page->memories[0].kind == kc::SegmentKind::kTaskRecord);
  CHECK(page->memories[0].text == "kitchen apple in the fridge");
  CHECK(page->memories[0].embedded);  // retrieve embedded it (read-your-writes)
  CHECK_FALSE(page->memories[0].has_kv);
  CHECK(page->memories[1].id == 50);
  CHECK(page->memories[1].group_id != 0);
  page = c->list_memories("robot", page->memories.back().id, 2);
  REQUIRE(page.is_ok());
  REQUIRE(page->memories.size() == 1);
  CHECK_FALSE(page->more);
  CHECK(page->memories[0].id == w3->id);
  CHECK(page->memories[0].kind == kc::SegmentKind::kExamplePlan);

  // Ten steps without change: the groups turn static and group jobs appear.
  auto step = c->advance_step("robot", 10);
  REQUIRE(step.is_ok());
  CHECK(*step == 10);
  groups = c->list_groups("robot");
  REQUIRE(groups.is_ok());
  for (const auto& g : *groups) CHECK(g.state == kc::GroupState::kStatic);

  auto jobs = c->fetch_jobs(7, 64);
  REQUIRE(jobs.is_ok());
  const kc::KvJob* group_job = nullptr;
  for (const auto& j : *jobs) {
    if (j.kind == kc::JobKind::kGroup && j.segments.size() == 2) group_job = &j;
  }
  REQUIRE(group_job != nullptr);
  uint32_t tokens = 0;
  for (const auto& s : group_job->segments) tokens += s.tokens;

  // Another worker may not touch it; zero worker ids are refused.
  CHECK(c->reserve_entry(8, group_job->job_id, tokens).status().code() == Code::kNotFound);
  CHECK(c->reserve_entry(0, group_job->job_id, tokens).status().code() == Code::kInvalidArgument);
  auto res = c->reserve_entry(7, group_job->job_id, tokens);
  REQUIRE(res.is_ok());
  CHECK(res->entry.tokens == tokens);
  CHECK(res->lease_ms == 30000);
  CHECK(c->reserve_entry(7, group_job->job_id, tokens).status().code() == Code::kAlreadyExists);
  auto lease = c->renew_lease(7, group_job->job_id, res->entry.index, res->entry.generation);
  REQUIRE(lease.is_ok());
  CHECK(*lease == 30000);
  CHECK(c->commit_entry(7, group_job->job_id, res->entry.index, res->entry.generation + 1).code() ==
        Code::kInvalidArgument);
  REQUIRE(c->commit_entry(7, group_job->job_id, res->entry.index, res->entry.generation).is_ok());

  r = c->retrieve("robot", "kitchen where is the apple", 2);
  REQUIRE(r.is_ok());
  int joint = 0;
  for (const auto& s : *r) {
    if (s.kv && s.kv->joint) {
      ++joint;
      CHECK(s.kv->entry.index == res->entry.index);
      CHECK(s.kv->entry.offset == uint64_t{res->entry.index} * 4096);
    }
  }
  CHECK(joint == 2);

  // Revoke path: another job, reserved then given back, is requeued.
  const kc::KvJob* other = nullptr;
  for (const auto& j : *jobs) {
    if (j.job_id != group_job->job_id) other = &j;
  }
  if (other != nullptr) {
    auto res2 = c->reserve_entry(7, other->job_id, 4);
    REQUIRE(res2.is_ok());
    CHECK(c->revoke_entry(7, other->job_id, res2->entry.index, res2->entry.generation).is_ok());
    CHECK(c->revoke_entry(7, other->job_id, res2->entry.index, res2->entry.generation).code() ==
          Code::kNotFound);
  }

  // An update invalidates the joint KV: the entry goes back to the region.
  REQUIRE(c->update("robot", 50, "kitchen knife on the floor").is_ok());
  CHECK(m.region.released >= 1);
  REQUIRE(c->remove("robot", 50).is_ok());
  CHECK(c->remove("robot", 50).code() == Code::kNotFound);

  auto stats = c->stats();
  REQUIRE(stats.is_ok());
  CHECK(stats->agents == 1);
  CHECK(stats->memories == 2);
  bool has_counter = false;
  for (const auto& [k, v] : stats->counters) has_counter |= k == "transitions_to_static";
  CHECK(has_counter);
  // Every mutation was logged before its answer.
  CHECK(m.committer.appended() >= 7);
  CHECK(m.committer.syncs.load() >= 1);
}

TEST_CASE("bad input of every kind gets its error code and the server keeps serving") {
  Manager m({"tcp://127.0.0.1:0"}, 64 * 1024);
  RawPeer peer(m.endpoint());
  auto c = m.client();
  REQUIRE(c->write({"a", 1, "hello world", kc::SegmentKind::kObjectState, {}}).is_ok());
  auto still_serving = [&] {
    auto p = c->ping();
    REQUIRE(p.is_ok());
  };

  SUBCASE("malformed capnp") {
    peer.send({"", std::string(64, '\xa5')});
    auto [st, id] = peer.next();
    CHECK(st.code() == Code::kMalformed);
    CHECK(id == 0);
    peer.send({"", "abc"});
    CHECK(peer.next().first.code() == Code::kMalformed);
    peer.send({"", ""});
    CHECK(peer.next().first.code() == Code::kMalformed);
  }
  SUBCASE("text without its NUL terminator (detected lazily)") {
    std::string bytes = request_bytes(5, [](proto::Request::Builder r) {
      r.initListGroups().setAgent("abcdefg");  // 7 chars + NUL = 8 bytes
    });
    const size_t at = bytes.find("abcdefg");
    REQUIRE(at != std::string::npos);
    bytes[at + 7] = 'h';  // overwrite the NUL
    peer.send({"", bytes});
    auto [st, id] = peer.next();
    CHECK(st.code() == Code::kMalformed);
    CHECK(id == 5);
  }
  SUBCASE("bad framing") {
    peer.send({request_bytes(3, [](auto r) { r.initPing(); })});  // no empty delimiter
    CHECK(peer.next().first.code() == Code::kMalformed);
    peer.send({"", "x", "y"});
    CHECK(peer.next().first.code() == Code::kMalformed);
  }
  SUBCASE("oversized message") {
    const std::string big = request_bytes(11, [](proto::Request::Builder r) {
      auto w = r.initWriteMemory();
      w.setAgent("a");
      w.setText(std::string(100 * 1024, 'x'));
      w.setKind(proto::SegmentKind::OBJECT_STATE);
    });
    peer.send({"", big});
    auto [st, id] = peer.next();
    CHECK(st.code() == Code::kTooLarge);
    CHECK(id == 11);
    // The client refuses it before sending.
    kc::ClientOptions o;
    o.endpoint = m.endpoint();
    o.max_request_bytes = 64 * 1024;
    auto small = kc::ManagerClient::connect(o);
    REQUIRE(small.is_ok());
    CHECK((*small)->write({"a", {}, std::string(100 * 1024, 'x'), {}, {}}).status().code() ==
          Code::kTooLarge);
  }
  SUBCASE("wrong protocol version") {
    peer.send({"", request_bytes(
                       21, [](auto r) { r.initPing(); }, 9)});
    auto [st, id] = peer.next();
    CHECK(st.code() == Code::kVersionMismatch);
    CHECK(id == 21);
    CHECK(st.message().find("9") != std::string::npos);
  }
  SUBCASE("unknown and unset enum values, unknown and empty request types") {
    peer.send({"", request_bytes(31, [](proto::Request::Builder r) {
                 auto w = r.initWriteMemory();
                 w.setAgent("a");
                 w.setText("t");
                 w.setKind(static_cast<proto::SegmentKind>(42));
               })});
    auto [st, id] = peer.next();
    CHECK(st.code() == Code::kInvalidArgument);
    CHECK(id == 31);
    peer.send({"", request_bytes(32, [](proto::Request::Builder r) {
                 auto w = r.initWriteMemory();
                 w.setAgent("a");
                 w.setText("t");  // kind left unset
               })});
    CHECK(peer.next().first.code() == Code::kInvalidArgument);
    peer.send({"", request_bytes(33, [](auto) {})});  // no call set
    CHECK(peer.next().first.code() == Code::kInvalidArgument);
    // A request type from the future: discriminant 99 in the union's slot (data word 0, bits
    // 16..31 of the root struct, right after the segment table and root pointer).
    std::string future = request_bytes(34, [](auto r) { r.initPing(); });
    future[16 + 2] = 99;
    future[16 + 3] = 0;
    peer.send({"", future});
    auto [st2, id2] = peer.next();
    CHECK(st2.code() == Code::kInvalidArgument);
    CHECK(id2 == 34);
  }
  SUBCASE("unknown agent / segment, empty and over-long text") {
    CHECK(c->retrieve("nobody", "q", 3).status().code() == Code::kNotFound);
    CHECK(c->list_groups("nobody").status().code() == Code::kNotFound);
    CHECK(c->list_memories("nobody").status().code() == Code::kNotFound);
    CHECK(c->list_memories("bad name!").status().code() == Code::kInvalidArgument);
    CHECK(c->remove("a", 999).code() == Code::kNotFound);
    CHECK(c->update("a", 999, "x").status().code() == Code::kNotFound);
    CHECK(c->write({"a", {}, "", {}, {}}).status().code() == Code::kInvalidArgument);
    CHECK(c->write({"a", {}, std::string(5000, 'y'), {}, {}}).status().code() == Code::kTooLarge);
    CHECK(c->write({"bad agent!", {}, "x", {}, {}}).status().code() == Code::kInvalidArgument);
    CHECK(c->advance_step("a", 0).status().code() == Code::kInvalidArgument);
    CHECK(c->commit_entry(7, 12345, 1, 1).code() == Code::kNotFound);
  }
  still_serving();
  CHECK(m.server->stats().requests > 0);
}

TEST_CASE("concurrent clients, group commit and ipc") {
  const std::string ipc = "ipc:///tmp/keep-test-rpc-" + std::to_string(::getpid());
  Manager m({"tcp://127.0.0.1:0", ipc});
  m.committer.sync_delay = 5ms;  // a slow disk: requests pile up while one batch syncs
  constexpr int kThreads = 4, kWrites = 100;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      kc::ClientOptions o;
      o.endpoint = t % 2 ? m.server->bound_endpoints().at(1) : m.endpoint();
      auto c = kc::ManagerClient::connect(o);
      if (!c.is_ok()) return;
      for (int i = 0; i < kWrites; ++i) {
        auto w = (*c)->write({"agent" + std::to_string(t),
                              std::nullopt,
                              "memory " + std::to_string(i),
                              kc::SegmentKind::kTaskRecord,
                              {}});
        if (w.is_ok() && w->id != 0) ok.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(ok.load() == kThreads * kWrites);
  CHECK(m.committer.appended() == size_t{kThreads * kWrites});
  // Group commit: fewer syncs than writes, and some batch held more than one request.
  CHECK(m.committer.syncs.load() < kThreads * kWrites);
  CHECK(m.server->stats().max_batch_seen > 1);
  auto c = m.client();
  auto stats = c->stats();
  REQUIRE(stats.is_ok());
  CHECK(stats->memories == uint64_t{kThreads * kWrites});
  MESSAGE("syncs " << m.committer.syncs.load() << " for " << kThreads * kWrites << " writes");
}

TEST_CASE("timeouts reconnect and late answers are dropped") {
  Manager m;
  m.committer.sync_delay = 400ms;
  auto c = m.client(150ms);
  auto w = c->write({"a", {}, "slow write", kc::SegmentKind::kObjectState, {}});
  CHECK(w.status().code() == keep::Code::kTimeout);
  m.committer.sync_delay = 0ms;
  // The late answer to the write must not be taken for the answer to this call.
  std::this_thread::sleep_for(300ms);
  auto s = c->advance_step("a", 3);
  REQUIRE(s.is_ok());
  CHECK(*s == 3);
}

namespace {

// The manager's mutations of agent "robot", each with request id {client, seq} (client 0: none).
struct Mutator {
  RawPeer& peer;
  uint64_t rid = 1000;
  void send(uint64_t client, uint64_t seq,
            const std::function<void(proto::Request::Builder)>& fill) {
    peer.send({"", request_bytes(++rid, [&](proto::Request::Builder r) {
                 r.setClientId(client);
                 r.setClientSeq(seq);
                 fill(r);
               })});
  }
  void write(uint64_t client, uint64_t seq, const std::string& text) {
    send(client, seq, [&](proto::Request::Builder r) {
      auto w = r.initWriteMemory();
      w.setAgent("robot");
      w.setText(text);
      w.setKind(proto::SegmentKind::OBJECT_STATE);
    });
  }
  void update(uint64_t client, uint64_t seq, uint64_t id, const std::string& text) {
    send(client, seq, [&](proto::Request::Builder r) {
      auto u = r.initUpdateMemory();
      u.setAgent("robot");
      u.setId(id);
      u.setText(text);
    });
  }
  void remove(uint64_t client, uint64_t seq, uint64_t id) {
    send(client, seq, [&](proto::Request::Builder r) {
      auto d = r.initDeleteMemory();
      d.setAgent("robot");
      d.setId(id);
    });
  }
  void advance(uint64_t client, uint64_t seq, uint64_t by) {
    send(client, seq, [&](proto::Request::Builder r) {
      auto a = r.initAdvanceStep();
      a.setAgent("robot");
      a.setBy(by);
    });
  }
};

std::vector<std::string> robot_texts(Manager& m) {
  std::lock_guard<std::mutex> lock(m.service.store_mutex());
  auto page = m.store.list_memories("robot", 0, 100);
  REQUIRE(page.is_ok());
  std::vector<std::string> out;
  for (const auto& s : page->memories) out.push_back(s.text);
  return out;
}

}  // namespace

TEST_CASE(
    "a mutation resent with its request id is answered as the first time and not applied "
    "again, also after a restart that replays the WAL") {
  constexpr uint64_t kClient = 0xC0FFEE;
  Manager m;
  RawPeer peer(m.endpoint());
  Mutator send{peer};
  // A write, and the same write again right behind it (most likely in the same batch).
  send.write(kClient, 1, "kitchen apple on the table");
  send.write(kClient, 1, "kitchen apple on the table");
  const Answered w1 = read_answer(peer), w1_again = read_answer(peer);
  REQUIRE(w1.status.is_ok());
  REQUIRE(w1_again.status.is_ok());
  CHECK(w1_again.id == w1.id);
  CHECK(w1_again.version == 1);
  CHECK(robot_texts(m) == std::vector<std::string>{"kitchen apple on the table"});
  // Each kind of mutation, then its resend in a later batch.
  send.advance(kClient, 2, 3);
  const Answered step = read_answer(peer);
  send.update(kClient, 3, w1.id, "kitchen apple in the fridge");
  const Answered updated = read_answer(peer);
  send.write(kClient, 4, "kitchen knife in the drawer");
  const Answered w2 = read_answer(peer);
  send.remove(kClient, 5, w2.id);
  const Answered removed = read_answer(peer);
  REQUIRE(step.status.is_ok());
  REQUIRE(updated.status.is_ok());
  REQUIRE(removed.status.is_ok());
  CHECK(step.step == 3);
  CHECK(updated.version == 2);
  const size_t records = m.committer.appended();
  const auto resend_all = [&](Manager& to, RawPeer& p) {
    Mutator again{p};
    again.write(kClient, 1, "kitchen apple on the table");
    CHECK(read_answer(p).id == w1.id);
    again.advance(kClient, 2, 3);
    CHECK(read_answer(p).step == 3);  // not 6
    again.update(kClient, 3, w1.id, "kitchen apple in the fridge");
    const Answered u = read_answer(p);
    CHECK(u.version == 2);  // not a no-op's answer (2 as well) by chance: nothing was applied
    again.write(kClient, 4, "kitchen knife in the drawer");
    CHECK(read_answer(p).id == w2.id);  // not a third memory
    again.remove(kClient, 5, w2.id);
    CHECK(read_answer(p).status.is_ok());  // not not_found
    std::lock_guard<std::mutex> lock(to.service.store_mutex());
    CHECK(*to.store.current_step("robot") == 3);
  };
  resend_all(m, peer);
  CHECK(robot_texts(m) == std::vector<std::string>{"kitchen apple in the fridge"});
  CHECK(m.committer.appended() == records);  // nothing logged again
  CHECK(m.service.mutations_deduplicated() == 6);
  // The same id for another mutation is refused; a mutation without an id (an older client) is
  // applied every time.
  send.remove(kClient, 1, w1.id);
  CHECK(read_answer(peer).status.code() == Code::kInvalidArgument);
  send.write(0, 1, "kitchen cup");
  send.write(0, 1, "kitchen cup");
  CHECK(read_answer(peer).status.is_ok());
  CHECK(read_answer(peer).status.is_ok());
  CHECK(robot_texts(m).size() == 3);

  // A restart: a new manager whose store replays the first one's WAL records answers the same
  // resends as the first did, from the ids the records carry.
  Manager restarted;
  {
    std::lock_guard<std::mutex> lock(restarted.service.store_mutex());
    for (const std::string& r : m.committer.records) {
      REQUIRE(restarted.store.apply_record(r).is_ok());
    }
  }
  RawPeer peer2(restarted.endpoint());
  resend_all(restarted, peer2);
  CHECK(restarted.committer.appended() == 0);
  CHECK(restarted.service.mutations_deduplicated() == 5);
  CHECK(robot_texts(restarted) == robot_texts(m));
}

TEST_CASE("a failed sync answers io_error and then refuses mutations") {
  Manager m;
  auto c = m.client();
  REQUIRE(c->write({"a", {}, "first", kc::SegmentKind::kObjectState, {}}).is_ok());
  m.committer.fail_sync = true;
  CHECK(c->write({"a", {}, "second", kc::SegmentKind::kObjectState, {}}).status().code() ==
        Code::kIoError);
  m.committer.fail_sync = false;
  CHECK(c->write({"a", {}, "third", kc::SegmentKind::kObjectState, {}}).status().code() ==
        Code::kUnavailable);
  CHECK(c->ping().is_ok());
  CHECK(c->list_groups("a").is_ok());
  CHECK(m.service.degraded());
}

TEST_CASE("a full embedding backlog answers resource_exhausted until retrieve embeds it") {
  km::StoreOptions o;
  o.max_pending_embeddings = 2;  // this harness has no background embedder
  Manager m({"tcp://127.0.0.1:0"}, wire::kDefaultMaxMessageBytes, o);
  auto c = m.client();
  REQUIRE(
      c->write({"robot", std::nullopt, "kitchen cup", kc::SegmentKind::kObjectState, {}}).is_ok());
  REQUIRE(
      c->write({"robot", std::nullopt, "hall lamp", kc::SegmentKind::kObjectState, {}}).is_ok());
  auto logged = [&] {
    std::lock_guard<std::mutex> lock(m.committer.mu);
    return m.committer.records.size();
  };
  const size_t before = logged();
  auto refused = c->write({"robot", std::nullopt, "desk pen", kc::SegmentKind::kObjectState, {}});
  CHECK(refused.status().code() == Code::kResourceExhausted);
  CHECK(refused.status().message().find("embedding backlog is full") != std::string::npos);
  CHECK(logged() == before);                                  // nothing was logged for it
  CHECK(c->update("robot", 1, "kitchen cup moved").is_ok());  // still pending: no growth
  REQUIRE(c->retrieve("robot", "cup", 1).is_ok());            // embeds the agent's pending segments
  auto w = c->write({"robot", std::nullopt, "desk pen", kc::SegmentKind::kObjectState, {}});
  REQUIRE(w.is_ok());
  CHECK(w->id == 3);
  auto page = c->list_memories("robot");
  REQUIRE(page.is_ok());
  CHECK(page->memories.size() == 3);
}

TEST_CASE("keepctl drives the server as a separate process") {
  const char* bin = std::getenv("KEEP_BIN_DIR");
  const std::string keepctl = std::string(bin ? bin : KEEP_BINARY_DIR "/bin") + "/keepctl";
  if (::access(keepctl.c_str(), X_OK) != 0) {
    MESSAGE("keepctl not built, skipping");
    return;
  }
  Manager m;
  auto run = [&](const std::string& args, int* rc) {
    const std::string cmd = keepctl + " --endpoint " + m.endpoint() + " " + args + " 2>&1";
    FILE* f = ::popen(cmd.c_str(), "r");
    REQUIRE(f != nullptr);
    std::string out;
    char buf[512];
    while (size_t n = std::fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
    const int status = ::pclose(f);
    *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return out;
  };
  int rc = -1;
  auto out = run("--json write robot 'kitchen cup on shelf' --kind task_record", &rc);
  CHECK(rc == 0);
  CHECK(out.find("\"version\":1") != std::string::npos);
  out = run("retrieve robot 'kitchen cup' --k 3", &rc);
  CHECK(rc == 0);
  CHECK(out.find("kitchen cup on shelf") != std::string::npos);
  out = run("delete robot 4242", &rc);
  CHECK(rc == 1);
  CHECK(out.find("keepctl: not_found: ") == 0);
  out = run("write robot", &rc);
  CHECK(rc == 2);
  CHECK(out.find("keepctl: usage: keepctl write <agent> <text>") == 0);  // one line, said once
  out = run("--json stats", &rc);
  CHECK(rc == 0);
  CHECK(out.find("\"memories\":1") != std::string::npos);

  // list: one page with a pointer to the next, --all follows the pages.
  for (int i = 0; i < 4; ++i) {
    run("write robot 'drawer item " + std::to_string(i) + "'", &rc);
    REQUIRE(rc == 0);
  }
  out = run("list robot --limit 2", &rc);
  CHECK(rc == 0);
  CHECK(out.find("kitchen cup on shelf") != std::string::npos);
  CHECK(out.find("drawer item 0") != std::string::npos);
  CHECK(out.find("drawer item 1") == std::string::npos);
  CHECK(out.find("(more: keepctl list robot --after 2)") != std::string::npos);
  out = run("--json list robot --after 2 --limit 2 --all", &rc);
  CHECK(rc == 0);
  CHECK(out.find("drawer item 1") != std::string::npos);
  CHECK(out.find("drawer item 3") != std::string::npos);
  CHECK(out.find("kitchen cup on shelf") == std::string::npos);
  CHECK(out.find("\"more\":false") != std::string::npos);
  out = run("list nobody", &rc);
  CHECK(rc == 1);
  CHECK(out.find("keepctl: not_found: ") == 0);
  out = run("list robot --after x", &rc);
  CHECK(rc == 2);
}

TEST_CASE("a retrieve that embeds does not hold the other clients") {
  Manager m;
  auto a = m.client();
  REQUIRE(
      a->write(
           {"robot", std::nullopt, "kitchen apple on the table", kc::SegmentKind::kObjectState, {}})
          .is_ok());
  REQUIRE(a->write({"robot", std::nullopt, "hall lamp is off", kc::SegmentKind::kObjectState, {}})
              .is_ok());
  m.embedder.delay = 1500ms;  // the query and the two pending segments: one slow embed call
  const auto t0 = std::chrono::steady_clock::now();
  Result<std::vector<kc::RetrievedSegment>> found = Status(Code::kInternal, "not run");
  std::thread retriever([&] { found = a->retrieve("robot", "kitchen apple", 1); });
  while (m.embedder.calls.load() == 0) std::this_thread::sleep_for(1ms);
  // Meanwhile another client is served: a ping, a write (acknowledged: applied and synced) and a
  // listing that shows it, all long before the retrieve's embedding ends.
  auto b = m.client();
  CHECK(b->ping().is_ok());
  auto w = b->write({"robot", std::nullopt, "desk pen", kc::SegmentKind::kObjectState, {}});
  REQUIRE(w.is_ok());
  auto page = b->list_memories("robot");
  REQUIRE(page.is_ok());
  CHECK(page->memories.size() == 3);
  CHECK(std::chrono::steady_clock::now() - t0 < 1000ms);
  retriever.join();
  CHECK(std::chrono::steady_clock::now() - t0 >= 1500ms);
  REQUIRE(found.is_ok());
  REQUIRE(found->size() == 1);  // the two segments written before it were embedded for it
  CHECK(found->at(0).text == "kitchen apple on the table");
  CHECK(found->at(0).score > 0.99f);
  const wire::ServerStats st = m.server->stats();
  CHECK(st.deferred == 1);
  CHECK(st.deferred_done == 1);
  auto stats = b->stats();  // the service's count, as keepctl stats shows it
  REQUIRE(stats.is_ok());
  std::map<std::string, uint64_t> counters(stats->counters.begin(), stats->counters.end());
  CHECK(counters.at("retrieves_deferred") == 1);
  CHECK(counters.at("retrieves_waiting") == 0);
  // The query is cached now and nothing of the agent's waits but the pen: deferred once more,
  // for the pen, which the answer can then hold.
  m.embedder.delay = 0ms;
  auto again = a->retrieve("robot", "desk", 1);
  REQUIRE(again.is_ok());
  REQUIRE(again->size() == 1);
  CHECK(again->at(0).text == "desk pen");
  // Nothing left to embed and a cached query: answered on the request loop, not deferred.
  const int calls = m.embedder.calls.load();
  REQUIRE(a->retrieve("robot", "desk", 1).is_ok());
  CHECK(m.embedder.calls.load() == calls);
  CHECK(m.server->stats().deferred == 2);
}

TEST_CASE("a segment updated while its retrieve embeds is found with its new text") {
  Manager m;
  auto a = m.client();
  REQUIRE(
      a->write({"robot", std::nullopt, "kitchen cup is dirty", kc::SegmentKind::kObjectState, {}})
          .is_ok());
  auto b = m.client();
  std::atomic<bool> updated{false};
  // During the retrieve's first embedding (off the request loop) another client updates the
  // segment: that embedding is stale and the retrieve embeds the new text before answering.
  m.embedder.on_embed = [&](const std::vector<std::string>&) {
    if (!updated.exchange(true)) CHECK(b->update("robot", 1, "kitchen cup is clean").is_ok());
  };
  auto r = a->retrieve("robot", "kitchen", 1);
  REQUIRE(r.is_ok());
  REQUIRE(r->size() == 1);
  CHECK(r->at(0).text == "kitchen cup is clean");
  CHECK(r->at(0).version == 2);
  CHECK(m.embedder.calls.load() == 2);
}

TEST_CASE("retrieve answers alike inline and on the retrieve threads") {
  std::vector<std::vector<std::pair<uint64_t, std::string>>> answers;
  std::vector<std::map<std::string, uint64_t>> counters;
  for (const bool defer : {false, true}) {
    Manager m({"tcp://127.0.0.1:0"}, wire::kDefaultMaxMessageBytes, {}, defer);
    auto c = m.client();
    for (const char* t : {"kitchen apple", "kitchen knife", "hall lamp", "desk pen", "desk lamp"}) {
      REQUIRE(c->write({"robot", std::nullopt, t, kc::SegmentKind::kObjectState, {}}).is_ok());
    }
    REQUIRE(c->write({"robot", std::nullopt, "plan: fetch", kc::SegmentKind::kExamplePlan, {}})
                .is_ok());
    std::vector<std::pair<uint64_t, std::string>> got;
    for (const char* q : {"desk", "kitchen", "hall"}) {
      auto r = c->retrieve("robot", q, 3);
      REQUIRE(r.is_ok());
      for (const auto& s : *r) got.emplace_back(s.id, s.text);
    }
    // Each new query is embedded off the request loop (the first one with the five segments).
    CHECK(m.server->stats().deferred == (defer ? 3u : 0u));
    REQUIRE(c->retrieve("robot", "desk", 3).is_ok());  // a cached query: one hit either way
    answers.push_back(std::move(got));
    auto st = c->stats();
    REQUIRE(st.is_ok());
    counters.emplace_back(st->counters.begin(), st->counters.end());
  }
  CHECK(answers[0] == answers[1]);
  CHECK(!answers[0].empty());
  for (const char* name : {"query_cache_hits", "query_cache_misses", "pending_embeddings"}) {
    CAPTURE(name);
    CHECK(counters[0].at(name) == counters[1].at(name));
  }
  CHECK(counters[1].at("query_cache_hits") == 1);
  CHECK(counters[1].at("query_cache_misses") == 3);
}

TEST_CASE("a failing embedder fails the deferred retrieve with its error; nothing else stops") {
  Manager m;
  auto c = m.client();
  REQUIRE(
      c->write({"robot", std::nullopt, "kitchen cup", kc::SegmentKind::kObjectState, {}}).is_ok());
  m.embedder.fail = true;
  auto r = c->retrieve("robot", "kitchen", 1);
  CHECK(r.status().code() == Code::kUnavailable);
  CHECK(r.status().message().find("encoder down") != std::string::npos);
  CHECK(c->ping().is_ok());
  auto page = c->list_memories("robot");
  REQUIRE(page.is_ok());
  CHECK_FALSE(page->memories.at(0).embedded);  // nothing was applied
  m.embedder.fail = false;
  auto ok = c->retrieve("robot", "kitchen", 1);
  REQUIRE(ok.is_ok());
  REQUIRE(ok->size() == 1);
  CHECK(ok->at(0).text == "kitchen cup");
  CHECK(m.server->stats().deferred_done == 2);
}

// Three retrieves, each with a new query, on separate clients, while every embed call waits for
// release(): the service's two retrieve threads each hold one, the third waits in the queue.
struct HeldRetrieves {
  using Found = Result<std::vector<kc::RetrievedSegment>>;
  explicit HeldRetrieves(Manager& m) {
    auto w = m.client();
    REQUIRE(w->write({"robot", std::nullopt, "kitchen cup", kc::SegmentKind::kObjectState, {}})
                .is_ok());
    m.embedder.on_embed = [this](const std::vector<std::string>&) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [this] { return released; });
    };
    for (int i = 0; i < 3; ++i) clients.push_back(m.client());
    const char* queries[] = {"kitchen", "cup", "table"};
    for (int i = 0; i < 3; ++i) {
      threads.emplace_back(
          [this, i, q = queries[i]] { found[i] = clients[i]->retrieve("robot", q, 1); });
      // In order: the first two start embedding, the third is queued behind them.
      while (m.embedder.calls.load() < std::min(i + 1, 2) ||
             (i == 2 && m.service.deferred_retrieves().waiting == 0)) {
        std::this_thread::sleep_for(1ms);
      }
    }
  }
  ~HeldRetrieves() {
    release();
    for (auto& t : threads) {
      if (t.joinable()) t.join();
    }
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu);
      released = true;
    }
    cv.notify_all();
  }
  // The two that ran found the segment; the queued one was refused as shutting down.
  void check_answers() {
    for (auto& t : threads) {
      if (t.joinable()) t.join();
    }
    for (int i = 0; i < 2; ++i) {
      CAPTURE(i);
      REQUIRE(found[i].is_ok());
      REQUIRE(found[i]->size() == 1);
      CHECK(found[i]->at(0).text == "kitchen cup");
    }
    CHECK(found[2].status().code() == Code::kUnavailable);
    CHECK(found[2].status().message().find("shutting down") != std::string::npos);
  }

  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  std::vector<std::unique_ptr<kc::ManagerClient>> clients;
  Found found[3] = {Status(Code::kInternal, "not run"), Status(Code::kInternal, "not run"),
                    Status(Code::kInternal, "not run")};
  std::vector<std::thread> threads;
};

TEST_CASE("at shutdown the running retrieves finish, the queued and later ones are refused") {
  Manager m;
  HeldRetrieves held(m);
  std::thread stopper([&] { m.service.stop_deferred_retrieves(); });
  // The queued one is answered at once, while the running two still embed.
  held.threads[2].join();
  CHECK(held.found[2].status().code() == Code::kUnavailable);
  // A retrieve that would be deferred now is refused; other requests are served.
  auto c = m.client();
  CHECK(c->retrieve("robot", "hall", 1).status().code() == Code::kUnavailable);
  CHECK(c->ping().is_ok());
  held.release();
  stopper.join();
  held.check_answers();
  CHECK(m.server->stats().deferred_done == 3);
}

TEST_CASE("retrieves given back after the server's loop stopped are answered as it closes") {
  // keep-manager's order on a signal: the loop stops first, then the retrieves are stopped.
  Manager m;
  HeldRetrieves held(m);
  m.server->stop();
  m.server->join();
  std::thread stopper([&] { m.service.stop_deferred_retrieves(); });
  // The queued one is refused (taken out of the queue) before the running two may finish.
  while (m.service.deferred_retrieves().waiting != 0) std::this_thread::sleep_for(1ms);
  held.release();
  stopper.join();
  m.server.reset();  // answers what was given back, then closes
  held.check_answers();
}

TEST_CASE(
    "a retrieve embeds a backlog in batches from the newest, leaving the rest to the encoder") {
  Manager m;
  auto c = m.client();
  constexpr int kBacklog = 300;
  for (int i = 0; i < kBacklog; ++i) {
    REQUIRE(c->write({"robot",
                      std::nullopt,
                      "drawer item " + std::to_string(i),
                      kc::SegmentKind::kObjectState,
                      {}})
                .is_ok());
  }
  REQUIRE(
      c->write({"robot", std::nullopt, "kitchen cup", kc::SegmentKind::kObjectState, {}}).is_ok());
  // The background encoder (this harness has none: the hook plays it) embeds the 120 oldest while
  // the retrieve embeds its first batch.
  FirstWordEmbedder background;
  std::atomic<bool> once{false};
  m.embedder.on_embed = [&](const std::vector<std::string>&) {
    if (once.exchange(true)) return;
    std::lock_guard<std::mutex> lock(m.service.store_mutex());
    auto oldest = m.store.pending_embeddings(120);
    std::vector<std::string> texts;
    for (const auto& p : oldest) texts.push_back(p.text);
    auto vecs = background.embed(texts);
    REQUIRE(vecs.is_ok());
    std::vector<km::SegmentEmbedding> embs;
    for (size_t i = 0; i < oldest.size(); ++i) {
      embs.push_back({oldest[i].agent, oldest[i].id, oldest[i].version, (*vecs)[i]});
    }
    REQUIRE(m.store.apply_embeddings(embs, nullptr).is_ok());
  };
  auto r = c->retrieve("robot", "kitchen", 1);
  REQUIRE(r.is_ok());
  REQUIRE(r->size() == 1);
  CHECK(r->at(0).text == "kitchen cup");
  CHECK(m.embedder.largest.load() <= 65);  // the query and 64 segments at most a call
  // The retrieve embedded the query and the 181 newest; the encoder's 120 were not embedded again.
  CHECK(m.embedder.texts_seen.load() == 1 + (kBacklog + 1 - 120));
  auto st = c->stats();
  REQUIRE(st.is_ok());
  const std::map<std::string, uint64_t> counters(st->counters.begin(), st->counters.end());
  REQUIRE(counters.count("pending_embeddings") == 1);
  CHECK(counters.at("pending_embeddings") == 0);
}
