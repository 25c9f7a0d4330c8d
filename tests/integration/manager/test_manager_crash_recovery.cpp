// Crash durability of the real keep-manager process: concurrent writers, kill -9 at a random
// moment while writes are in flight, restart on the same data dir, and every acknowledged change
// must be there exactly once, with its text, kind and version. Three cycles on one data dir:
// writes only; writes mixed with updates and deletes; writes and updates with snapshots taken
// (--snapshot-every 64). A final clean shutdown (SIGTERM: final snapshot) and restart closes it.
//
// Read path: list_memories, page by page, is the listing. retrieve(agent, query, k = 1024) must
// return the same segments: every example plan plus the top-k others, i.e. all of an agent's
// while it holds <= 1024 other segments (the store clamps k to max_retrieve_k = 1024, and
// retrieve embeds pending segments first). Writers therefore move to a new agent every
// kIdsPerAgent ids.
//
// The model: each writer thread owns its agents and issues one request at a time, so at most one
// request per writer is unacknowledged when the manager dies ("uncertain"): its target may be in
// the state before or after that request; every other segment must match the model exactly.
// Seed: printed; set KEEP_ITEST_SEED to replay one.
//
// A second case resends mutations with their request ids (as a client does whose answers were
// lost) after kill -9 and a restart, and after a clean restart from a snapshot: each is answered
// as the first time from what the WAL or the snapshot kept, and nothing is applied twice.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "shared/client/manager_client.h"
#include "tests/integration/manager/manager_process.h"
#include "tests/integration/manager/raw_peer.h"

namespace {

using namespace std::chrono_literals;
namespace kc = keep::client;
namespace it = keep::itest;
using keep::Code;

constexpr int kWriters = 4;
constexpr uint64_t kIdsPerAgent = 100;
constexpr uint64_t kMaxPauseUs = 40000;  // a writer pauses 0..40 ms between requests
constexpr uint32_t kListK = 1024;
constexpr uint32_t kPage = 37;  // list_memories page

struct Mem {
  std::string text;
  kc::SegmentKind kind = kc::SegmentKind::kObjectState;
  uint64_t version = 0;
  bool operator==(const Mem&) const = default;
};

struct AgentModel {
  std::map<uint64_t, Mem> present;
  uint64_t next_id = 1;
};

// The one request a writer had in flight when the manager died (or that timed out).
struct Uncertain {
  std::string agent;
  uint64_t id = 0;
  std::optional<Mem> after;  // nullopt: a delete
};

struct Writer {
  int index = 0;
  std::map<std::string, AgentModel> agents;
  std::string current;
  int agent_seq = 0;
  std::optional<Uncertain> uncertain;
  uint64_t acked = 0, acked_updates = 0, acked_deletes = 0;
  std::string error;  // a definite error answer: the test fails
};

enum class Mix { kWritesOnly, kWithUpdatesAndDeletes };

const char* const kObjects[] = {"the red mug", "a knife",  "the apple",  "two plates",
                                "the towel",   "a sponge", "the laptop", "a potato"};
const char* const kPlaces[] = {
    "on the kitchen counter", "in the fridge", "on the sofa", "in the sink", "on the desk",
    "in the drawer"};

std::string make_text(std::mt19937_64& rng, const std::string& agent, uint64_t id, int cycle,
                      uint64_t seq) {
  return std::string(kObjects[rng() % 8]) + " is " + kPlaces[rng() % 6] + " [" + agent + "#" +
         std::to_string(id) + " c" + std::to_string(cycle) + " s" + std::to_string(seq) + "]";
}

void writer_loop(Writer* w, const std::string& endpoint, Mix mix, int cycle, uint64_t seed,
                 const std::atomic<bool>* stop, std::atomic<int>* in_flight) {
  std::mt19937_64 rng(seed);
  kc::ClientOptions o;
  o.endpoint = endpoint;
  o.timeout = 2000ms;
  auto client = kc::ManagerClient::connect(o);
  if (!client.is_ok()) {
    w->error = client.status().to_string();
    return;
  }
  kc::ManagerClient& c = **client;
  uint64_t seq = 0;
  while (!stop->load()) {
    // Paced (every embedding costs CPU at recovery); the kill waits for a request in flight.
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % kMaxPauseUs));
    if (stop->load()) break;
    if (w->current.empty() || w->agents[w->current].next_id > kIdsPerAgent) {
      w->current = "w" + std::to_string(w->index) + "-a" + std::to_string(w->agent_seq++);
    }
    // Pick an operation; updates and deletes target a random present segment of this writer.
    int op = 0;  // 0 write, 1 update, 2 delete
    std::string agent = w->current;
    uint64_t id = 0;
    if (mix == Mix::kWithUpdatesAndDeletes) {
      const unsigned r = static_cast<unsigned>(rng() % 100);
      op = r < 55 ? 0 : (r < 80 ? 1 : 2);
    }
    if (op != 0) {
      std::vector<std::pair<std::string, uint64_t>> all;
      for (const auto& [name, a] : w->agents) {
        for (const auto& [sid, m] : a.present) all.emplace_back(name, sid);
      }
      if (all.empty()) {
        op = 0;
      } else {
        std::tie(agent, id) = all[rng() % all.size()];
      }
    }
    AgentModel& am = w->agents[agent];
    Uncertain u{agent, 0, std::nullopt};
    keep::Status st;
    in_flight->fetch_add(1);
    struct Done {
      std::atomic<int>* n;
      ~Done() { n->fetch_sub(1); }
    } done{in_flight};
    if (op == 0) {
      id = am.next_id;
      const auto kind = static_cast<kc::SegmentKind>(rng() % 3);
      u.id = id;
      u.after = Mem{make_text(rng, agent, id, cycle, ++seq), kind, 1};
      w->uncertain = u;
      auto r = c.write({agent, id, u.after->text, kind, {}});
      st = r.status();
      if (r.is_ok() && (r->id != id || r->version != 1)) {
        w->error = "write " + agent + "#" + std::to_string(id) + " answered id " +
                   std::to_string(r->id) + " version " + std::to_string(r->version);
        return;
      }
    } else if (op == 1) {
      const Mem& before = am.present.at(id);
      u.id = id;
      u.after = Mem{make_text(rng, agent, id, cycle, ++seq), before.kind, before.version + 1};
      w->uncertain = u;
      auto r = c.update(agent, id, u.after->text);
      st = r.status();
      if (r.is_ok() && r->version != u.after->version) {
        w->error = "update " + agent + "#" + std::to_string(id) + " answered version " +
                   std::to_string(r->version) + ", expected " + std::to_string(u.after->version);
        return;
      }
    } else {
      u.id = id;
      w->uncertain = u;
      st = c.remove(agent, id);
    }
    if (st.is_ok()) {
      if (u.after.has_value()) {
        am.present[id] = *u.after;
      } else {
        am.present.erase(id);
      }
      if (op == 0) am.next_id = id + 1;
      w->uncertain.reset();
      ++w->acked;
      w->acked_updates += op == 1;
      w->acked_deletes += op == 2;
    } else if (st.code() == Code::kTimeout) {
      return;  // the manager died (or stalled): this request stays uncertain
    } else {
      w->error = st.to_string();
      return;
    }
  }
}

std::unique_ptr<kc::ManagerClient> connect(const std::string& endpoint) {
  kc::ClientOptions o;
  o.endpoint = endpoint;
  o.timeout = 30000ms;  // retrieve embeds every pending segment of the agent first
  auto c = kc::ManagerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

// Lists every agent of every writer through retrieve, checks it against the model and then makes
// the model equal to what the manager holds (resolving the uncertain requests).
void verify(const std::string& endpoint, std::vector<Writer>& writers, const std::string& what) {
  INFO(what);
  auto c = connect(endpoint);
  std::set<std::string> texts;
  uint64_t total = 0, agents = 0;
  for (Writer& w : writers) {
    for (auto& [agent, model] : w.agents) {
      INFO("agent " << agent);
      std::map<uint64_t, Mem> actual;
      // The listing: list_memories' pages (37 at a time, so most agents take several).
      bool found = true;
      for (uint64_t after = 0;;) {
        auto page = c->list_memories(agent, after, kPage);
        if (!page.is_ok()) {
          REQUIRE_MESSAGE(page.status().code() == Code::kNotFound, page.status().to_string());
          REQUIRE(after == 0);
          found = false;
          break;
        }
        for (const auto& s : page->memories) {
          CHECK_MESSAGE(s.id > after, "segment id " << s.id << " out of order after " << after);
          CHECK_MESSAGE(texts.insert(s.text).second, "text listed twice: " << s.text);
          actual[s.id] = Mem{s.text, s.kind, s.version};
        }
        if (!page->more) break;
        REQUIRE_FALSE(page->memories.empty());
        after = page->memories.back().id;
      }
      agents += found;
      // retrieve with a k over the agent's size returns the same segments (it embeds the pending
      // ones first).
      auto r = c->retrieve(agent, "where is the red mug", kListK);
      if (found) {
        REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
        REQUIRE(r->size() < kListK);  // else the retrieval could be incomplete
        std::map<uint64_t, Mem> retrieved;
        for (const auto& s : *r) {
          CHECK_MESSAGE(retrieved.count(s.id) == 0, "segment id " << s.id << " retrieved twice");
          retrieved[s.id] = Mem{s.text, s.kind, s.version};
        }
        CHECK_MESSAGE(retrieved == actual, "retrieve and list_memories disagree");
      } else {
        CHECK(r.status().code() == Code::kNotFound);
      }
      total += actual.size();
      const Uncertain* u =
          w.uncertain.has_value() && w.uncertain->agent == agent ? &*w.uncertain : nullptr;
      std::set<uint64_t> ids;
      for (const auto& [id, m] : model.present) ids.insert(id);
      for (const auto& [id, m] : actual) ids.insert(id);
      for (uint64_t id : ids) {
        std::optional<Mem> want;
        if (auto it2 = model.present.find(id); it2 != model.present.end()) want = it2->second;
        std::optional<Mem> got;
        if (auto it2 = actual.find(id); it2 != actual.end()) got = it2->second;
        if (got == want) continue;
        if (u != nullptr && u->id == id && got == u->after) continue;  // the in-flight request
        FAIL_CHECK(
            "segment " << agent << "#" << id << ": manager has "
                       << (got ? got->text + " v" + std::to_string(got->version) : "nothing")
                       << ", acknowledged state is "
                       << (want ? want->text + " v" + std::to_string(want->version) : "nothing"));
      }
      model.present = actual;
      if (!actual.empty()) model.next_id = std::max(model.next_id, actual.rbegin()->first + 1);
      if (u != nullptr && u->after.has_value() && u->after->version == 1) {
        model.next_id = std::max(model.next_id, u->id + 1);  // never reuse an id tried once
      }
    }
    w.uncertain.reset();
  }
  auto stats = c->stats();
  REQUIRE(stats.is_ok());
  CHECK(stats->memories == total);
  CHECK(stats->agents == agents);
  MESSAGE(what << ": " << total << " memories of " << agents << " agents verified");
}

// Starts the writers against `m`, kills it -9 after a random 1-3 s (after the first snapshot when
// `need_snapshot`), then joins the writers.
void crash_cycle(it::ManagerProcess& m, std::vector<Writer>& writers, Mix mix, int cycle,
                 std::mt19937_64& rng, const it::fs::path& snapshots, bool need_snapshot) {
  std::atomic<bool> stop{false};
  std::atomic<int> in_flight{0};
  std::vector<std::thread> threads;
  for (Writer& w : writers) {
    threads.emplace_back(writer_loop, &w, m.endpoint(), mix, cycle, rng(), &stop, &in_flight);
  }
  const auto t0 = std::chrono::steady_clock::now();
  const auto kill_at = t0 + std::chrono::milliseconds(1000 + rng() % 2001);
  auto has_snapshot = [&] {
    std::error_code ec;
    for (const auto& e : it::fs::directory_iterator(snapshots, ec)) {
      if (e.path().extension() == ".snap") return true;
    }
    return false;
  };
  while (std::chrono::steady_clock::now() < kill_at ||
         (need_snapshot && !has_snapshot() && std::chrono::steady_clock::now() < t0 + 15s)) {
    std::this_thread::sleep_for(5ms);
  }
  CHECK_MESSAGE(m.alive(), "keep-manager died before the kill:\n" << m.err());
  // Then at the first moment a request is in flight (within 2 s), with nothing in between: the
  // count read again after other work (a scan of the snapshot folder) was 0 at times, the request
  // answered meanwhile (CI, seed 2144478691).
  const auto give_up = std::chrono::steady_clock::now() + 2s;
  int requests_in_flight = 0;
  while ((requests_in_flight = in_flight.load()) == 0 &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(50us);
  }
  m.kill9();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const bool snap = has_snapshot();  // what recovery will find
  stop.store(true);
  for (auto& t : threads) t.join();
  uint64_t acked = 0, upd = 0, del = 0, uncertain = 0;
  for (const Writer& w : writers) {
    CHECK_MESSAGE(w.error.empty(), "writer " << w.index << ": " << w.error);
    acked += w.acked;
    upd += w.acked_updates;
    del += w.acked_deletes;
    uncertain += w.uncertain.has_value();
  }
  CHECK(requests_in_flight > 0);
  MESSAGE("cycle " << cycle << ": kill -9 after " << ms << " ms with " << requests_in_flight
                   << " requests in flight; " << acked << " acknowledged changes so far (" << upd
                   << " updates, " << del << " deletes), " << uncertain
                   << " unanswered at the kill");
  if (need_snapshot) REQUIRE_MESSAGE(snap, "no snapshot was written before the kill");
}

}  // namespace

TEST_CASE("every acknowledged change survives kill -9 of keep-manager, three times") {
  uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("KEEP_ITEST_SEED")) seed = std::strtoull(s, nullptr, 10);
  MESSAGE("seed " << seed << " (KEEP_ITEST_SEED replays it)");
  std::mt19937_64 rng(seed);

  it::TempDir tmp("crash");
  const std::string data = (tmp.path() / "data").string();
  const std::string shm = it::unique_name("crash");
  std::vector<Writer> writers(kWriters);
  for (int i = 0; i < kWriters; ++i) writers[static_cast<size_t>(i)].index = i;
  const it::fs::path snapshots = it::fs::path(data) / "snapshots";
  const std::vector<std::string> no_snap = {"--snapshot-every", "0", "--fsync", "true"};
  const std::vector<std::string> snap = {"--snapshot-every", "64", "--fsync", "true"};

  {
    it::ManagerProcess m({data, shm, no_snap});
    crash_cycle(m, writers, Mix::kWritesOnly, 1, rng, snapshots, false);
  }
  {
    it::ManagerProcess m({data, shm, no_snap});
    verify(m.endpoint(), writers, "after cycle 1 (writes)");
    crash_cycle(m, writers, Mix::kWithUpdatesAndDeletes, 2, rng, snapshots, false);
  }
  {
    it::ManagerProcess m({data, shm, snap});
    verify(m.endpoint(), writers, "after cycle 2 (writes, updates, deletes)");
    crash_cycle(m, writers, Mix::kWithUpdatesAndDeletes, 3, rng, snapshots, true);
  }
  {
    it::ManagerProcess m({data, shm, snap});
    const std::string log = m.err();
    CHECK_MESSAGE(log.find("snapshot") != std::string::npos, log);
    CHECK_MESSAGE(log.find("loaded (up to LSN") != std::string::npos, log);
    verify(m.endpoint(), writers, "after cycle 3 (with snapshots)");
    CHECK(m.terminate() == 0);  // clean stop: final snapshot
  }
  {
    it::ManagerProcess m({data, shm, snap});
    verify(m.endpoint(), writers, "after a clean shutdown");
    CHECK(m.terminate() == 0);
  }
}

TEST_CASE(
    "a mutation resent with its request id after kill -9 and a restart is not applied twice") {
  it::TempDir tmp("resend");
  const std::string data = (tmp.path() / "data").string();
  const std::string shm = it::unique_name("resend");
  const std::vector<std::string> flags = {"--snapshot-every", "0", "--fsync", "true"};
  constexpr uint64_t kClient = 0x5eed;
  uint64_t rid = 1;
  const auto write = [&](it::RawPeer& p, uint64_t seq, const std::string& text) {
    p.send({"", it::request_bytes(++rid, [&](keep::proto::Request::Builder r) {
              r.setClientId(kClient);
              r.setClientSeq(seq);
              auto w = r.initWriteMemory();
              w.setAgent("robot");
              w.setText(text);
              w.setKind(keep::proto::SegmentKind::OBJECT_STATE);
            })});
    return it::read_answer(p);
  };
  const auto advance = [&](it::RawPeer& p, uint64_t seq) {
    p.send({"", it::request_bytes(++rid, [&](keep::proto::Request::Builder r) {
              r.setClientId(kClient);
              r.setClientSeq(seq);
              auto a = r.initAdvanceStep();
              a.setAgent("robot");
              a.setBy(2);
            })});
    return it::read_answer(p);
  };
  const auto check_state = [&](const it::ManagerProcess& m, const char* when) {
    INFO(when);
    kc::ClientOptions o;
    o.endpoint = m.endpoint();
    auto c = kc::ManagerClient::connect(o);
    REQUIRE(c.is_ok());
    auto page = (*c)->list_memories("robot");
    REQUIRE(page.is_ok());
    REQUIRE(page->memories.size() == 2);
    CHECK(page->memories[0].text == "The mug is on the table.");
    CHECK(page->memories[1].text == "The cup is in the sink.");
    auto stats = (*c)->stats();
    REQUIRE(stats.is_ok());
    std::map<std::string, uint64_t> counters(stats->counters.begin(), stats->counters.end());
    return counters.at("mutations_deduplicated");
  };
  it::Answered w1, w2, step;
  {
    it::ManagerProcess m({data, shm, flags});
    it::RawPeer p(m.endpoint());
    w1 = write(p, 1, "The mug is on the table.");
    step = advance(p, 2);
    w2 = write(p, 3, "The cup is in the sink.");
    REQUIRE(w1.status.is_ok());
    REQUIRE(step.status.is_ok());
    REQUIRE(w2.status.is_ok());
    CHECK(step.step == 2);
    CHECK(w2.step == 2);
    m.kill9();
  }
  const auto resend = [&](const it::ManagerProcess& m, const char* when) {
    INFO(when);
    it::RawPeer p(m.endpoint());
    const it::Answered again1 = write(p, 1, "The mug is on the table.");
    const it::Answered again_step = advance(p, 2);
    const it::Answered again2 = write(p, 3, "The cup is in the sink.");
    REQUIRE(again1.status.is_ok());
    CHECK(again1.id == w1.id);
    CHECK(again_step.step == 2);  // not 4
    CHECK(again2.id == w2.id);    // not a third memory
    CHECK(again2.step == 2);
  };
  {
    it::ManagerProcess m({data, shm, flags});  // recovers from the WAL
    resend(m, "after kill -9: from the WAL");
    CHECK(check_state(m, "after kill -9") == 3);
    CHECK(m.terminate() == 0);  // clean stop: a final snapshot holds the request ids
  }
  {
    it::ManagerProcess m({data, shm, flags});
    const std::string log = m.err();
    CHECK_MESSAGE(log.find("loaded (up to LSN") != std::string::npos, log);
    resend(m, "after a clean restart: from the snapshot");
    CHECK(check_state(m, "after a clean restart") == 3);
  }
}
