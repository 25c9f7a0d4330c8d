// PlanService: one planning step for a planner (ARCHITECTURE §4): retrieve the agent's memories
// from keep-manager, read their KV entries in place in the shared region (or in a device KV tier)
// inside seqlock read sections validated after the prefill, assemble the prompt with the request's
// method, then generate or score candidates. KvProducer: the manager's KV jobs (fetch -> reserve ->
// compute -> write -> commit, renewing the lease on long jobs, revoking on any failure), a few
// layers per step so that a planner request waits for at most one step.
//
// Both run on the worker's one engine thread (the engine is not thread-safe), each with a
// KvAssembler of its own: a production's working cache must survive the requests in between.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "services/worker/engine/core/engine.h"
#include "services/worker/keep/kv_assembler.h"
#include "services/worker/keep/prompt_builder.h"
#include "services/worker/server/device_entries.h"
#include "shared/client/manager_client.h"
#include "shared/common/status.h"
#include "shared/kvregion/kv_region.h"
#include "shared/kvremote/shared_kv_tier.h"
#include "shared/tokenizer/bpe_tokenizer.h"

namespace keep::worker {

struct PlanDefaults {
  Method method = Method::kKeep;
  MethodKnobs knobs;
  uint32_t k = 16;          // segments retrieved
  int32_t max_tokens = 48;  // generated at most
  uint32_t max_candidates = 64;
};

struct CompleteArgs {
  std::string agent;
  std::string instruction;
  std::vector<std::string> history;
  uint32_t k = 0;                       // 0: the default
  std::optional<Method> method;         // empty: the default
  MethodKnobs knobs;                    // the defaults with the request's overrides applied
  int32_t max_tokens = 0;               // 0: the default
  std::vector<std::string> candidates;  // non-empty: score them
  engine::SamplingParams sampling;
};

struct CompleteResult {
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<engine::CandidateScore> scores;
  uint32_t best = 0;
  Method method = Method::kKeep;
  AssembleStats assembly;
  double ttft_seconds = 0;
  double retrieve_seconds = 0;
  double prefill_seconds = 0;
  uint32_t entries_hit = 0;      // segments whose KV was reused
  uint32_t entries_missing = 0;  // announced without KV
  uint32_t entries_stale = 0;    // announced with KV that changed, went, or does not fit
  uint32_t entries_device = 0;   // of the hits, read from a device KV tier (not over PCIe)
  std::vector<uint64_t> segment_ids;
};

class PlanService {
 public:
  // Every pointer must outlive the service; `region` may be null (nothing is ever reused then).
  PlanService(KvAssembler* assembler, const PromptBuilder* prompts,
              const tok::BpeTokenizer* tokenizer, client::ManagerClient* manager,
              const kv::KvRegionView* region, PlanDefaults defaults);

  const PlanDefaults& defaults() const { return defaults_; }
  // A device KV tier to read entries from before the region (null: none). When this process
  // owns it, entries requests read from the region are queued for admit_pending().
  void set_device_entries(DeviceEntries* device) { device_ = device; }
  // Owner of a device tier: copies up to `max` queued entries into it (each inside a region read
  // section: one that changed during its copy is evicted again). Returns how many went in.
  size_t admit_pending(size_t max);
  // The region entries are read from (null: none, every memory is recomputed).
  void set_region(const kv::KvRegionView* region) { region_ = region; }
  // `received`: when the request arrived (TTFT counts from there). The manager's retrieve is
  // retried while keep-manager does not answer (a restart) until `retry_until`, so a planner
  // whose deadline outlasts the manager's restart does not see it.
  Result<CompleteResult> complete(const CompleteArgs& args,
                                  std::chrono::steady_clock::time_point received,
                                  std::chrono::steady_clock::time_point retry_until = {});

 private:
  KvAssembler* assembler_;
  const PromptBuilder* prompts_;
  const tok::BpeTokenizer* tokenizer_;
  client::ManagerClient* manager_;
  const kv::KvRegionView* region_;
  PlanDefaults defaults_;
  void use_device(const kv::EntryDescriptor& d, size_t i, SegmentKv* kv,
                  std::vector<std::pair<size_t, DeviceEntries::Entry>>* reads);

  DeviceEntries* device_ = nullptr;
  struct Pending {
    kv::EntryKey key;
    kv::EntryDescriptor descriptor;
  };
  std::vector<Pending> pending_;  // entries to admit into the device tier (owner), oldest first
};

struct ProducerStats {
  uint64_t jobs_done = 0;
  uint64_t jobs_shared = 0;  // done with the entry read from the shared KV tier (part of done)
  uint64_t jobs_failed = 0;  // revoked (or refused) after an error
  uint64_t jobs_stale = 0;   // committed too late: the manager found the memory changed
  uint64_t bytes_written = 0;
};

class KvProducer {
 public:
  KvProducer(KvAssembler* assembler, const PromptBuilder* prompts, client::ManagerClient* manager,
             kv::KvRegionView* region, uint64_t worker_id);
  ~KvProducer();  // revokes a reservation still held

  // One step of background work: takes a job when none is under way, or runs up to `layers`
  // more layers of the current one (committing it after its last). False when there was nothing
  // to do. An error is the manager's or the region's; the job in hand is revoked first.
  Result<bool> step(int32_t layers);
  bool busy() const { return job_.has_value(); }
  // Revokes the job under way, if any (shutdown).
  void abandon();
  // The region entries are written to; a job under way is revoked first (its entry belongs to
  // the region it was reserved in). Null: no job can run.
  void set_region(kv::KvRegionView* region) {
    abandon();
    region_ = region;
  }
  const ProducerStats& stats() const { return stats_; }

  // The shared KV tier (docs/cluster.md): entries worth sharing -- a static group's joint KV, an
  // example plan's own KV -- are looked up there before computing (a hit is written into the
  // region and committed at once) and published after. `producer` names the backend computing
  // them (part of the content key). Null: off.
  void set_shared_tier(kvremote::SharedKvTier* tier, std::string producer) {
    shared_ = tier;
    producer_name_ = std::move(producer);
  }
  const kvremote::SharedKvStats* shared_stats() const {
    return shared_ != nullptr ? &shared_->stats() : nullptr;
  }
  // Whether a job's entry is worth sharing: a group job, or one example plan's own KV.
  static bool worth_sharing(const client::KvJob& job);

 private:
  struct Job {
    client::KvJob job;
    client::Reservation reservation;
    std::vector<uint32_t> slices;
    std::span<std::byte> entry;
    EntryGeometry geometry;
    std::chrono::steady_clock::time_point renew_at;
    std::optional<kvremote::EntryContent> shared;  // the content when worth sharing
    bool fetched = false;  // the entry came from the shared tier: commit at the next step
  };
  Status start(client::KvJob job);
  Status fail(const Status& why);

  KvAssembler* assembler_;
  const PromptBuilder* prompts_;
  client::ManagerClient* manager_;
  kv::KvRegionView* region_;
  uint64_t worker_id_;
  std::optional<Job> job_;
  ProducerStats stats_;
  kvremote::SharedKvTier* shared_ = nullptr;
  std::string producer_name_;
};

}  // namespace keep::worker
