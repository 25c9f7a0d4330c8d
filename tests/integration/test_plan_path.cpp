// The plan path end to end against a real keep-manager process: an agent writes memories over
// ZeroMQ, steps pass so its groups turn static, the worker side (PlanService, KvProducer over the
// CPU backend and the real SmolLM2 model, in this process) computes their KV into the shared
// region and reuses it for a planning step (issue 28, points 2-4, 6).
#include <doctest/doctest.h>

#include <thread>

#include "services/worker/engine/cpu/cpu_backend.h"
#include "services/worker/server/plan_service.h"
#include "shared/kvregion/kv_tier_directory.h"
#include "shared/model/model_identity.h"
#include "tests/integration/manager/manager_process.h"

using namespace keep::worker;
using namespace std::chrono_literals;
namespace eng = keep::engine;
namespace kc = keep::client;
namespace kv = keep::kv;
namespace it = keep::itest;

namespace {

const char* const kMemories[] = {
    "The milk is in the fridge.",
    "The fridge is in the kitchen, next to the sink.",
    "The red mug is on the kitchen counter.",
    "Task done: put the apple in the fruit bowl.",
    "The towel hangs in the bathroom.",
    "The laptop is on the desk in the study.",
};

// The worker's side, built as keep-worker builds it.
struct Worker {
  std::shared_ptr<eng::ModelWeights> weights;
  std::optional<keep::tok::BpeTokenizer> tokenizer;
  std::unique_ptr<eng::Engine> engine;
  std::optional<PromptBuilder> prompts;
  std::unique_ptr<kv::KvRegionView> region;
  std::unique_ptr<kc::ManagerClient> manager;
  std::unique_ptr<KvAssembler> requests, jobs;
  std::optional<PlanService> plans;
  std::optional<KvProducer> producer;

  Worker(const std::string& endpoint, const std::string& shm) {
    const std::string path = it::model_path();
    auto model = eng::load_model(path);
    REQUIRE(model.is_ok());
    auto identity = eng::read_model_identity(path);
    REQUIRE(identity.is_ok());
    tokenizer.emplace(std::move(*model->tokenizer));
    weights = std::make_shared<eng::ModelWeights>(std::move(model->weights));
    auto backend = eng::CpuBackend::create(weights);
    REQUIRE(backend.is_ok());
    auto e = eng::Engine::create(std::move(backend).value(), 256);
    REQUIRE(e.is_ok());
    engine = std::move(e).value();
    auto chat = keep::tok::ChatTemplate::from_jinja(model->chat_template);
    REQUIRE(chat.is_ok());
    auto pb = PromptBuilder::create(&*tokenizer, *chat);
    REQUIRE(pb.is_ok());
    prompts.emplace(std::move(pb).value());
    const kv::ModelFingerprint fp = eng::kv_fingerprint(weights->config, tokenizer->fingerprint(),
                                                        kv::KvDType::kBF16, identity->name);
    auto view = kv::KvRegionView::attach(shm, fp);
    REQUIRE_MESSAGE(view.is_ok(), view.status().to_string());
    region = std::move(view).value();
    kc::ClientOptions co;
    co.endpoint = endpoint;
    co.timeout = 20s;
    auto client = kc::ManagerClient::connect(co);
    REQUIRE(client.is_ok());
    manager = std::move(client).value();
    auto a = KvAssembler::create(*engine, prompts->prefix(), 512);
    auto b = KvAssembler::create(*engine, prompts->prefix(), 512);
    REQUIRE((a.is_ok() && b.is_ok()));
    requests = std::move(a).value();
    jobs = std::move(b).value();
    plans.emplace(requests.get(), &*prompts, &*tokenizer, manager.get(), region.get(),
                  PlanDefaults{});
    producer.emplace(jobs.get(), &*prompts, manager.get(), region.get(), 0x5eed);
  }

  // The agent writes kMemories; a retrieve embeds and groups them, and steps pass until every
  // group is static (the manager then queues their KV jobs).
  void write_memories() {
    for (const char* text : kMemories) {
      kc::WriteArgs a;
      a.agent = "robot";
      a.text = text;
      REQUIRE(manager->write(a).is_ok());
    }
    REQUIRE(manager->retrieve("robot", "milk", 1).is_ok());
    REQUIRE(manager->advance_step("robot", 3).is_ok());
  }

  // Runs background jobs until the manager has none left; returns how many were done.
  uint64_t drain_jobs() {
    for (int idle = 0; idle < 3;) {
      auto r = producer->step(8);
      REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
      idle = *r ? 0 : idle + 1;
    }
    return producer->stats().jobs_done;
  }

  CompleteResult complete(Method m, MethodKnobs knobs = {}) {
    CompleteArgs a;
    a.agent = "robot";
    a.instruction = "Bring me a glass of milk.";
    a.history = {"walk to the kitchen"};
    a.method = m;
    a.knobs = knobs;
    a.k = 8;
    a.max_tokens = 8;
    auto r = plans->complete(a, std::chrono::steady_clock::now());
    REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
    return std::move(r).value();
  }
};

// A device KV tier whose "device" is host memory: the CPU backend loads from any host memory, so
// the plan path's use of a tier (find, load from the copy, validate after the prefill, admit
// between requests) runs here on a real tier directory. rewrite_on_find makes the owner rewrite a
// slot right after a reader found it -- what another process may do while the prefill reads.
class HostTier final : public DeviceEntries {
 public:
  explicit HostTier(const std::string& name) {
    kv::TierGeometry g;
    g.slots = 8;
    g.slot_bytes = 1 << 20;
    auto d = kv::KvTierDirectory::create(name, g);
    REQUIRE_MESSAGE(d.is_ok(), d.status().to_string());
    dir_ = std::move(d).value();
    pool_.resize(g.slots * g.slot_bytes);
  }
  std::optional<Entry> find(const kv::EntryKey& key) const override {
    const auto hit = dir_->find(key);
    if (!hit) return std::nullopt;
    ++finds;
    Entry e{
        {pool_.data() + hit->slot * dir_->geometry().slot_bytes, hit->bytes}, hit->slot, hit->seq};
    if (rewrite_on_find) {  // the owner rewrites the slot with other bytes while it is read
      auto self = const_cast<HostTier*>(this);
      self->dir_->evict(key);
      auto slot = self->dir_->begin_admit(key, hit->bytes);
      REQUIRE(slot.is_ok());
      std::fill_n(self->pool_.data() + *slot * dir_->geometry().slot_bytes, hit->bytes,
                  std::byte{0x7f});
      self->dir_->commit(*slot);
    }
    return e;
  }
  bool validate(const Entry& e) const override {
    return dir_->validate(kv::TierHit{e.slot, e.seq, e.bytes.size()});
  }
  bool owner() const override { return true; }
  keep::Status admit(const kv::EntryKey& key, std::span<const std::byte> bytes) override {
    KEEP_ASSIGN_OR_RETURN(uint32_t slot, dir_->begin_admit(key, bytes.size()));
    std::copy(bytes.begin(), bytes.end(), pool_.data() + slot * dir_->geometry().slot_bytes);
    dir_->commit(slot);
    return keep::Status::ok();
  }
  bool evict(const kv::EntryKey& key) override { return dir_->evict(key); }

  bool rewrite_on_find = false;
  mutable int finds = 0;

 private:
  std::unique_ptr<kv::KvTierDirectory> dir_;
  std::vector<std::byte> pool_;
};

}  // namespace

TEST_CASE("memories' KV is produced into the region and reused for a planning step") {
  it::TempDir tmp("planpath");
  const std::string shm = it::unique_name("planpath");
  it::ManagerProcess m(
      {(tmp.path() / "data").string(), shm, {"--static-after-steps", "2", "--shm-bytes", "64MiB"}});
  Worker w(m.endpoint(), shm);
  w.write_memories();

  const uint64_t produced = w.drain_jobs();
  CHECK(produced >= 1);
  CHECK(w.producer->stats().jobs_failed == 0);
  CHECK(w.producer->stats().bytes_written > 0);

  // full and keep at d = 1 compute every token: the same tokens.
  const CompleteResult full = w.complete(Method::kFull);
  MethodKnobs all;
  all.keep_decay = 1.0;
  const CompleteResult keep1 = w.complete(Method::kKeep, all);
  CHECK(full.tokens == keep1.tokens);
  CHECK_FALSE(full.text.empty());
  CHECK(full.segment_ids.size() == std::size(kMemories));
  CHECK(full.assembly.recompute_ratio == 1.0);

  // Every retrieved memory has KV now: full_reuse loads it all, KEEP a decaying share.
  const CompleteResult reuse = w.complete(Method::kFullReuse);
  CHECK(reuse.entries_hit == std::size(kMemories));
  CHECK(reuse.entries_missing == 0);
  CHECK(reuse.entries_stale == 0);
  CHECK(reuse.assembly.recompute_ratio == 0.0);
  CHECK(reuse.assembly.bytes_loaded > 0);
  const CompleteResult keep = w.complete(Method::kKeep);
  CHECK(keep.assembly.recompute_ratio < 1.0);
  CHECK_FALSE(keep.assembly.check_layers.empty());
  CHECK(keep.entries_hit == std::size(kMemories));
  CHECK(keep.ttft_seconds > 0);

  // Candidate scoring picks the plausible action.
  CompleteArgs score;
  score.agent = "robot";
  score.instruction = "Bring me a glass of milk.";
  score.method = Method::kKeep;
  score.candidates = {"open the fridge", "turn on the laptop"};
  auto scored = w.plans->complete(score, std::chrono::steady_clock::now());
  REQUIRE(scored.is_ok());
  REQUIRE(scored->scores.size() == 2);
  CHECK(std::isfinite(scored->scores[0].log_prob));

  // An update makes that memory's KV stale: the manager no longer announces it (or the worker
  // finds it changed), and the step computes it instead of serving it.
  REQUIRE(w.manager->update("robot", 1, "The milk is on the kitchen table.").is_ok());
  const CompleteResult after = w.complete(Method::kFullReuse);
  CHECK(after.entries_hit < std::size(kMemories));
  CHECK(after.entries_missing + after.entries_stale >= 1);
  CHECK(after.assembly.recompute_ratio > 0.0);
  CHECK(m.terminate() == 0);
}

TEST_CASE("a device tier's copies serve the loads; one rewritten mid-request is not used") {
  it::TempDir tmp("planpath_tier");
  const std::string shm = it::unique_name("planpath_tier");
  it::ManagerProcess m(
      {(tmp.path() / "data").string(), shm, {"--static-after-steps", "2", "--shm-bytes", "64MiB"}});
  Worker w(m.endpoint(), shm);
  w.write_memories();
  REQUIRE(w.drain_jobs() >= 1);

  HostTier tier(it::unique_name("tier"));
  w.plans->set_device_entries(&tier);
  // First request: nothing in the tier yet; what it read from the region is queued, then admitted.
  const CompleteResult first = w.complete(Method::kFullReuse);
  CHECK(first.entries_hit == std::size(kMemories));
  CHECK(first.entries_device == 0);
  const size_t admitted = w.plans->admit_pending(64);
  CHECK(admitted >= 1);
  CHECK(w.plans->admit_pending(64) == 0);  // each entry once
  // Second: every hit comes from the tier, and it computes the same as from the region.
  const CompleteResult second = w.complete(Method::kFullReuse);
  CHECK(second.entries_hit == std::size(kMemories));
  CHECK(second.entries_device == second.entries_hit);
  CHECK(second.tokens == first.tokens);
  // Third: every slot is rewritten with garbage right after the request finds it; validation
  // after the prefill catches it and the request loads from the region instead.
  tier.rewrite_on_find = true;
  const CompleteResult third = w.complete(Method::kFullReuse);
  tier.rewrite_on_find = false;
  CHECK(third.entries_device == 0);
  CHECK(third.entries_hit == std::size(kMemories));
  CHECK(third.tokens == first.tokens);
  w.plans->set_device_entries(nullptr);
  CHECK(m.terminate() == 0);
}

TEST_CASE("a region too small for every memory evicts the least recently used entries") {
  // 1 MiB of arena holds three or four of the six memories' entries (SmolLM2: 22.5 KiB a token).
  // Before eviction, the jobs that found the arena full failed three times and were dropped:
  // those memories never got KV again.
  it::TempDir tmp("planpath_evict");
  const std::string shm = it::unique_name("planpath_evict");
  it::ManagerProcess m({(tmp.path() / "data").string(),
                        shm,
                        {"--static-after-steps", "1000000", "--shm-bytes", "1MiB"}});
  Worker w(m.endpoint(), shm);
  w.write_memories();
  const auto evictions = [&] {
    auto st = w.manager->stats();
    REQUIRE(st.is_ok());
    for (const auto& [name, value] : st->counters) {
      if (name == "kv_evictions") return value;
    }
    FAIL("no kv_evictions counter");
    return uint64_t{0};
  };

  const uint64_t first = w.drain_jobs();
  CHECK(first == std::size(kMemories));  // every memory's entry was produced, none dropped
  CHECK(w.producer->stats().jobs_failed == 0);
  const uint64_t evicted = evictions();
  CHECK(evicted >= 2);

  // The step finds the entries still there and computes the evicted ones; retrieving them
  // queued their KV again, and it is produced (evicting the now least recently used).
  const CompleteResult reuse = w.complete(Method::kFullReuse);
  CHECK(reuse.entries_hit >= 1);
  CHECK(reuse.entries_missing >= 1);
  CHECK(reuse.entries_hit + reuse.entries_missing == std::size(kMemories));
  CHECK(w.drain_jobs() - first == reuse.entries_missing);
  CHECK(w.producer->stats().jobs_failed == 0);
  CHECK(evictions() > evicted);
  CHECK(m.terminate() == 0);
}
