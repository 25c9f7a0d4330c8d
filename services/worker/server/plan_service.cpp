#include "services/worker/server/plan_service.h"

#include <algorithm>
#include <map>
#include <thread>
#include <utility>

#include "shared/client/moved.h"
#include "shared/common/log.h"

namespace keep::worker {
namespace {

constexpr const char* kLog = "worker";
using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The manager's `moved` answer for an agent another node serves (its client does not follow
// it: the descriptors of another node's manager name entries of another region), turned into
// the planner's: the owner's worker to ask, or, when its manager did not name one, no target.
Status moved_to_worker(const Status& moved) {
  const std::optional<client::MovedTarget> t = client::parse_moved(moved.message());
  if (!t) {  // not a message this version writes: nothing a planner could follow
    const std::string why = "its manager answered: " + moved.message();
    return Status(Code::kMoved, "the agent is served by another node (" + why +
                                    "); this worker plans for its own node's agents only");
  }
  if (!t->worker.empty()) return Status(Code::kMoved, t->head + " at " + t->worker);
  return Status(Code::kMoved, t->head +
                                  ", whose keep-worker this node does not know (its keep-manager "
                                  "has no --advertise-worker): plan there");
}

kv::EntryDescriptor descriptor(const client::EntryDescriptor& d) {
  kv::EntryDescriptor e;
  e.index = d.index;
  e.generation = d.generation;
  e.offset = d.offset;
  e.bytes = d.bytes;
  e.tokens = d.tokens;
  return e;
}

}  // namespace

PlanService::PlanService(KvAssembler* assembler, const PromptBuilder* prompts,
                         const tok::BpeTokenizer* tokenizer, client::ManagerClient* manager,
                         const kv::KvRegionView* region, PlanDefaults defaults)
    : assembler_(assembler),
      prompts_(prompts),
      tokenizer_(tokenizer),
      manager_(manager),
      region_(region),
      defaults_(std::move(defaults)) {}

Result<CompleteResult> PlanService::complete(const CompleteArgs& args, Clock::time_point received,
                                             Clock::time_point retry_until) {
  if (args.instruction.empty()) {
    return Status(Code::kInvalidArgument, "complete: the instruction is empty");
  }
  if (args.candidates.size() > defaults_.max_candidates) {
    return Status(Code::kInvalidArgument, "complete: " + std::to_string(args.candidates.size()) +
                                              " candidates, at most " +
                                              std::to_string(defaults_.max_candidates));
  }
  CompleteResult out;
  out.method = args.method.value_or(defaults_.method);
  const uint32_t k = args.k > 0 ? args.k : defaults_.k;

  const auto t_retrieve = Clock::now();
  auto retrieved = manager_->retrieve(args.agent, args.instruction, k);
  // No answer (timeout: the client reconnects) or no connection: the manager may be restarting.
  while (!retrieved.is_ok() &&
         (retrieved.status().code() == Code::kTimeout ||
          retrieved.status().code() == Code::kUnavailable) &&
         Clock::now() + manager_->options().timeout <= retry_until) {
    KEEP_LOG_WARN(kLog, "retrieve for agent '%s': %s; retrying", args.agent.c_str(),
                  retrieved.status().to_string().c_str());
    if (retrieved.status().code() == Code::kUnavailable) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    retrieved = manager_->retrieve(args.agent, args.instruction, k);
  }
  if (!retrieved.is_ok()) {
    if (retrieved.status().code() == Code::kMoved) return moved_to_worker(retrieved.status());
    return retrieved.status();
  }
  out.retrieve_seconds = seconds(t_retrieve, Clock::now());

  // Entries are read in place from the region's mapping (registered for the GPU: the loader
  // reads them there, no host copy), each inside a seqlock read section that closes after the
  // prefill: an entry rewritten while the prefill read it is then known, and the prefill runs
  // again with that segment computed from its text.
  struct InPlace {
    uint32_t index;
    uint64_t seq;
    std::vector<size_t> segments;  // which of req.segments read it
  };
  std::map<std::pair<uint32_t, uint64_t>, InPlace> reads;
  // Segments whose loads read a device tier's copy, and that copy's slot.
  std::vector<std::pair<size_t, DeviceEntries::Entry>> device_reads;
  AssembleRequest req;
  req.method = out.method;
  req.knobs = args.knobs;
  // full and prefix never load an entry: nothing read, and nothing counted as hit, missing or
  // stale.
  const bool loads = out.method != Method::kFull && out.method != Method::kPrefix;
  for (const auto& seg : *retrieved) {
    out.segment_ids.push_back(seg.id);
    PromptSegment ps;
    ps.tokens = prompts_->segment(seg.text);
    if (!loads) {
      // computed from its text
    } else if (!seg.kv.has_value()) {
      ++out.entries_missing;
    } else if (region_ == nullptr || seg.kv->tokens != ps.tokens.size()) {
      ++out.entries_stale;  // no region, or computed from other tokens than this prompt's
    } else {
      const kv::EntryDescriptor d = descriptor(seg.kv->entry);
      auto geometry = EntryGeometry::of(region_->fingerprint(), static_cast<int32_t>(d.tokens));
      const auto seq = region_->read_begin(d.index, d.generation);
      auto span = region_->entry_data(d);
      if (!seq || !span.is_ok() || !geometry.is_ok()) {
        ++out.entries_stale;
      } else {
        ps.kv = SegmentKv{*span, *geometry, static_cast<int32_t>(seg.kv->token_offset)};
        auto& r =
            reads.try_emplace({d.index, d.generation}, InPlace{d.index, *seq, {}}).first->second;
        r.segments.push_back(req.segments.size());
        ++out.entries_hit;
        if (device_ != nullptr) use_device(d, req.segments.size(), &ps.kv, &device_reads);
      }
    }
    req.segments.push_back(std::move(ps));
  }
  // The descriptors are the manager's; if its region was replaced meanwhile (a restart), the
  // entries came from a dead region whose indices and generations may collide with the new one's.
  if (out.entries_hit > 0 && !region_->linked()) {
    for (auto& ps : req.segments) ps.kv = SegmentKv{};
    out.entries_stale += out.entries_hit;
    out.entries_hit = 0;
    reads.clear();
    device_reads.clear();
  }
  req.query = prompts_->query(args.instruction, args.history);

  const auto t_prefill = Clock::now();
  KEEP_ASSIGN_OR_RETURN(Prefilled pre, assembler_->prefill(req));
  // Every load has completed (the prefill's logits came after them): close the read sections.
  uint32_t changed = 0;
  for (const auto& [key, r] : reads) {
    if (region_->read_validate(r.index, r.seq)) continue;
    for (size_t i : r.segments) {
      req.segments[i].kv = SegmentKv{};
      ++changed;
    }
  }
  // A device copy rewritten meanwhile: loaded again from the region.
  uint32_t moved = 0;
  for (const auto& [i, e] : device_reads) {
    if (!req.segments[i].kv.device.empty() && !device_->validate(e)) {
      req.segments[i].kv.device = {};
      ++moved;
    }
  }
  for (const auto& [i, e] : device_reads) {
    if (!req.segments[i].kv.device.empty()) ++out.entries_device;
  }
  if (changed > 0 || moved > 0) {
    if (changed > 0) {
      KEEP_LOG_WARN(kLog, "%u segments' KV changed during the prefill: computing them instead",
                    changed);
    }
    out.entries_hit -= changed;
    out.entries_stale += changed;
    KEEP_ASSIGN_OR_RETURN(pre, assembler_->prefill(req));
  }
  out.prefill_seconds = seconds(t_prefill, Clock::now());
  out.assembly = pre.stats;

  if (!args.candidates.empty()) {
    std::vector<std::vector<int32_t>> cands;
    for (const auto& c : args.candidates) {
      cands.push_back(tokenizer_->encode(c, false, /*parse_special=*/false));
    }
    KEEP_ASSIGN_OR_RETURN(out.scores, assembler_->score(pre, cands));
    for (size_t i = 1; i < out.scores.size(); ++i) {
      if (out.scores[i].log_prob > out.scores[out.best].log_prob)
        out.best = static_cast<uint32_t>(i);
    }
    out.ttft_seconds = seconds(received, Clock::now());
    return out;
  }
  // The first token is the prefill's argmax or draw: it is ready once the prefill is done.
  out.ttft_seconds = seconds(received, Clock::now());
  engine::GenerateOptions gen;
  gen.max_tokens = args.max_tokens > 0 ? args.max_tokens : defaults_.max_tokens;
  gen.sampling = args.sampling;
  KEEP_ASSIGN_OR_RETURN(out.tokens, assembler_->generate(pre, gen));
  out.text = tokenizer_->decode(out.tokens, /*skip_special=*/true);
  return out;
}

// The device tier's copy of entry `d` for segment `i`, when the tier holds it; otherwise, on the
// owner, the entry queued for admission.
void PlanService::use_device(const kv::EntryDescriptor& d, size_t i, SegmentKv* kv,
                             std::vector<std::pair<size_t, DeviceEntries::Entry>>* reads) {
  auto info = region_->entry_info(d.index);
  if (!info.is_ok() || info->generation != d.generation) return;
  if (const auto e = device_->find(info->key)) {
    if (e->bytes.size() >= kv->geometry.bytes()) {
      kv->device = e->bytes;
      reads->emplace_back(i, *e);
    }
    return;
  }
  if (!device_->owner()) return;
  for (const Pending& p : pending_) {
    if (p.key == info->key) return;
  }
  constexpr size_t kMaxPending = 256;
  if (pending_.size() >= kMaxPending) pending_.erase(pending_.begin());
  pending_.push_back({info->key, d});
}

size_t PlanService::admit_pending(size_t max) {
  size_t done = 0;
  while (done < max && !pending_.empty() && device_ != nullptr && region_ != nullptr) {
    const Pending p = pending_.front();
    pending_.erase(pending_.begin());
    const auto seq = region_->read_begin(p.descriptor.index, p.descriptor.generation);
    auto span = region_->entry_data(p.descriptor);
    if (!seq || !span.is_ok()) continue;  // gone since the request
    Status st = device_->admit(p.key, *span);
    if (!st.is_ok()) {
      if (st.code() != Code::kAlreadyExists) {
        KEEP_LOG_WARN(kLog, "device KV tier: %s", st.to_string().c_str());
      }
      continue;
    }
    if (!region_->read_validate(p.descriptor.index, *seq)) {
      device_->evict(p.key);  // copied while the region rewrote it
      continue;
    }
    ++done;
  }
  return done;
}

// ---- KvProducer
// ----------------------------------------------------------------------------------

KvProducer::KvProducer(KvAssembler* assembler, const PromptBuilder* prompts,
                       client::ManagerClient* manager, kv::KvRegionView* region, uint64_t worker_id)
    : assembler_(assembler),
      prompts_(prompts),
      manager_(manager),
      region_(region),
      worker_id_(worker_id) {}

KvProducer::~KvProducer() { abandon(); }

void KvProducer::abandon() {
  if (!job_) return;
  const auto& e = job_->reservation.entry;
  Status st = manager_->revoke_entry(worker_id_, job_->job.job_id, e.index, e.generation);
  if (!st.is_ok()) KEEP_LOG_WARN(kLog, "revoking KV job: %s", st.to_string().c_str());
  job_.reset();
}

Status KvProducer::fail(const Status& why) {
  ++stats_.jobs_failed;
  KEEP_LOG_WARN(kLog, "KV job %llu failed: %s",
                static_cast<unsigned long long>(job_ ? job_->job.job_id : 0),
                why.to_string().c_str());
  abandon();
  return why;
}

Status KvProducer::start(client::KvJob job) {
  std::vector<int32_t> tokens;
  std::vector<uint32_t> slices;
  for (const auto& s : job.segments) {
    const auto t = prompts_->segment(s.text);
    tokens.insert(tokens.end(), t.begin(), t.end());
    slices.push_back(static_cast<uint32_t>(t.size()));
  }
  if (tokens.empty()) return Status(Code::kInvalidArgument, "KV job without segments");
  KEEP_ASSIGN_OR_RETURN(auto res, manager_->reserve_entry(worker_id_, job.job_id,
                                                          static_cast<uint32_t>(tokens.size())));
  Job j;
  j.job = std::move(job);
  j.reservation = res;
  j.slices = std::move(slices);
  j.renew_at = Clock::now() + std::chrono::milliseconds(res.lease_ms / 2);
  job_ = std::move(j);
  const kv::EntryDescriptor d = descriptor(res.entry);
  auto entry = region_->entry_data(d);
  if (!entry.is_ok()) return fail(entry.status());
  if (Status st = region_->check_writable(d, kv::monotonic_now_ns()); !st.is_ok()) return fail(st);
  auto geometry = EntryGeometry::of(region_->fingerprint(), static_cast<int32_t>(d.tokens));
  if (!geometry.is_ok()) return fail(geometry.status());
  job_->entry = *entry;
  job_->geometry = *geometry;
  if (shared_ != nullptr && worth_sharing(job_->job)) {
    kvremote::EntryContent c;
    c.fingerprint = region_->fingerprint();
    c.producer = producer_name_;
    if (assembler_->produce_options().with_prefix) c.context = assembler_->prefix();
    c.tokens = tokens;
    // A hit is the entry's bytes exactly (the content fixes them): no compute, commit next step.
    job_->fetched = shared_->fetch(c, job_->entry.first(job_->geometry.bytes()));
    if (!job_->fetched) job_->shared = std::move(c);
    if (job_->fetched) return Status::ok();
  }
  if (Status st = assembler_->begin_produce(tokens); !st.is_ok()) return fail(st);
  return Status::ok();
}

bool KvProducer::worth_sharing(const client::KvJob& job) {
  if (job.kind == client::JobKind::kGroup) return true;
  return job.segments.size() == 1 && job.segments[0].kind == client::SegmentKind::kExamplePlan;
}

Result<bool> KvProducer::step(int32_t layers) {
  if (region_ == nullptr) return false;
  if (!job_) {
    KEEP_ASSIGN_OR_RETURN(auto jobs, manager_->fetch_jobs(worker_id_, 1));
    if (jobs.empty()) return false;
    KEEP_RETURN_IF_ERROR(start(std::move(jobs[0])));
    return true;
  }
  Job& j = *job_;
  const auto& e = j.reservation.entry;
  if (Clock::now() >= j.renew_at) {
    auto lease = manager_->renew_lease(worker_id_, j.job.job_id, e.index, e.generation);
    if (!lease.is_ok()) return fail(lease.status());
    j.renew_at = Clock::now() + std::chrono::milliseconds(*lease / 2);
  }
  if (!j.fetched) {
    auto done = assembler_->produce_layers(layers, KvAssembler::entry_writer(j.entry, j.geometry));
    if (!done.is_ok()) return fail(done.status());
    if (!*done) return true;
    // Published before the commit, while the entry is still ours (bounded by the tier's timeout).
    if (j.shared) shared_->publish(*j.shared, j.entry.first(j.geometry.bytes()));
  }
  const bool fetched = j.fetched;
  // The bytes are in the mapping (CPU stores); the commit request orders them before the commit.
  const bool group = j.job.kind == client::JobKind::kGroup;
  Status st = manager_->commit_entry(worker_id_, j.job.job_id, e.index, e.generation,
                                     group ? j.slices : std::vector<uint32_t>{});
  const uint64_t bytes = j.geometry.bytes();
  job_.reset();  // committed or refused: the entry is the manager's again either way
  if (st.code() == Code::kStale) {
    ++stats_.jobs_stale;
    return true;
  }
  if (!st.is_ok()) {
    ++stats_.jobs_failed;
    return st;
  }
  ++stats_.jobs_done;
  if (fetched) ++stats_.jobs_shared;
  stats_.bytes_written += bytes;
  return true;
}

}  // namespace keep::worker
