#include "services/worker/server/worker_service.h"

#include <kj/exception.h>

#include <cmath>
#include <utility>

#include "shared/common/log.h"
#include "shared/common/utf8.h"

namespace keep::worker {
namespace {

constexpr const char* kLog = "worker";
using Clock = std::chrono::steady_clock;
namespace wp = proto::worker;

Status invalid(std::string what) { return Status(Code::kInvalidArgument, std::move(what)); }

using wire::as_text;

Result<std::string> text_field(capnp::Text::Reader t, std::string_view field, bool required) {
  std::string s(t.begin(), t.size());
  if (required && s.empty()) return invalid(std::string(field) + " is empty");
  if (s.find('\0') != std::string::npos) return invalid(std::string(field) + " contains NUL");
  if (!utf8_valid(s)) {
    return invalid(std::string(field) + " is not valid UTF-8 (at byte " +
                   std::to_string(utf8_invalid_offset(s)) + ")");
  }
  return s;
}

std::vector<double> ratio_buckets() {
  return {0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0};
}
std::vector<double> token_buckets() {
  return {64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
}

}  // namespace

// ---- metrics ----------------------------------------------------------------------------------

WorkerMetrics::WorkerMetrics(metrics::Registry& r)
    : requests(r.counter("keep_worker_requests_total",
                         "Completion requests answered, by method and result code.",
                         {"method", "code"})),
      refused(r.counter("keep_worker_requests_refused_total",
                        "Completion requests refused at arrival: invalid, the queue full, or the "
                        "worker shutting down.",
                        {"code"})),
      ttft(r.histogram("keep_worker_ttft_seconds",
                       "Time to first token (or to the candidates' scores), from arrival.",
                       {"method"})),
      request_time(r.histogram("keep_worker_request_seconds",
                               "Whole request, from arrival to the answer.", {"method"})),
      prompt_tokens(r.histogram("keep_worker_prompt_tokens", "Prompt tokens of a request.",
                                {"method"}, token_buckets())),
      recompute_ratio(r.histogram("keep_worker_recompute_ratio",
                                  "Mean share of memory tokens recomputed per layer.", {"method"},
                                  ratio_buckets())),
      bytes_loaded(r.counter("keep_worker_kv_bytes_loaded_total",
                             "KV bytes read from the shared region for requests.", {"method"})),
      entries(r.counter("keep_worker_entries_total",
                        "Retrieved segments by what their KV entry was: hit (reused), missing "
                        "(none yet), stale (changed, gone or not matching).",
                        {"method", "result"})),
      queue_depth(
          r.gauge("keep_worker_queue_depth", "Completions waiting for the engine.", {"method"})),
      jobs(r.counter("keep_worker_kv_jobs_total",
                     "The manager's KV jobs by outcome: done, failed (revoked), stale (the "
                     "memory changed before the commit).",
                     {"result"})),
      job_bytes(r.counter("keep_worker_kv_bytes_written_total",
                          "KV bytes written into the shared region by committed jobs.")),
      manager_errors(r.counter("keep_worker_manager_errors_total",
                               "Failed calls to keep-manager (retrieve, jobs).")),
      shared_kv(r.counter("keep_worker_kv_shared_total",
                          "The shared KV tier on Redis Cluster (--kv-remote), by result: hit "
                          "(an entry read instead of computed), miss (absent, or refused by its "
                          "checks: also counted as rejected), error (Redis unreachable or slow), "
                          "published.",
                          {"result"})),
      region_attached(r.gauge("keep_worker_region_attached",
                              "1 while the KV region is attached (0: every memory is "
                              "recomputed and no job is taken).")) {}

// ---- decoding ---------------------------------------------------------------------------------

Result<CompleteArgs> decode_complete(wp::CompleteRequest::Reader r,
                                     const WorkerServiceOptions& limits,
                                     const PlanDefaults& defaults) {
  CompleteArgs a;
  KEEP_ASSIGN_OR_RETURN(a.agent, text_field(r.getAgent(), "agent", true));
  KEEP_ASSIGN_OR_RETURN(a.instruction, text_field(r.getInstruction(), "instruction", true));
  auto history = r.getHistory();
  if (history.size() > limits.max_history) {
    return invalid("history has " + std::to_string(history.size()) + " entries, at most " +
                   std::to_string(limits.max_history));
  }
  for (auto h : history) {
    KEEP_ASSIGN_OR_RETURN(std::string s, text_field(h, "history entry", false));
    a.history.push_back(std::move(s));
  }
  a.k = r.getK();
  if (a.k > limits.max_k) {
    return invalid("k = " + std::to_string(a.k) + " exceeds the worker's maximum " +
                   std::to_string(limits.max_k));
  }
  if (r.getMethod() != wp::Method::UNKNOWN) {
    KEEP_RETURN_IF_ERROR(wire::check_enum(r.getMethod(), "method"));
    a.method = static_cast<Method>(static_cast<uint16_t>(r.getMethod()) - 1);
  }
  a.knobs = defaults.knobs;
  auto k = r.getKnobs();
  if (k.getHasDecay()) a.knobs.keep_decay = k.getDecay();
  if (k.getHasQueryRows()) {
    if (k.getQueryRows() > 1u << 20) return invalid("knobs.queryRows is too large");
    a.knobs.importance.query_rows_used = static_cast<int32_t>(k.getQueryRows());
  }
  if (k.getHasMaxHops()) {
    if (k.getMaxHops() > 1024) return invalid("knobs.maxHops must be <= 1024");
    a.knobs.importance.max_hops = static_cast<int32_t>(k.getMaxHops());
  }
  if (k.getHasCacheblendRatio()) a.knobs.cacheblend_ratio = k.getCacheblendRatio();
  if (k.getHasEpicTokens()) {
    if (k.getEpicTokens() > 1u << 20) return invalid("knobs.epicTokens is too large");
    a.knobs.epic_tokens = static_cast<int32_t>(k.getEpicTokens());
  }
  if (k.getHasAnchorTokens()) {
    if (k.getAnchorTokens() > 1u << 20) return invalid("knobs.anchorTokens is too large");
    a.knobs.keep_anchor_tokens = static_cast<int32_t>(k.getAnchorTokens());
  }
  if (Status st = a.knobs.validate(); !st.is_ok()) return st.with_context("knobs");
  if (r.getMaxTokens() > static_cast<uint32_t>(limits.max_tokens)) {
    return invalid("maxTokens = " + std::to_string(r.getMaxTokens()) +
                   " exceeds the worker's maximum " + std::to_string(limits.max_tokens));
  }
  a.max_tokens = static_cast<int32_t>(r.getMaxTokens());
  auto cands = r.getCandidates();
  if (cands.size() > defaults.max_candidates) {
    return invalid(std::to_string(cands.size()) + " candidates, at most " +
                   std::to_string(defaults.max_candidates));
  }
  for (auto c : cands) {
    KEEP_ASSIGN_OR_RETURN(std::string s, text_field(c, "candidate", true));
    a.candidates.push_back(std::move(s));
  }
  const float temperature = r.getTemperature();
  if (!std::isfinite(temperature)) return invalid("temperature is not finite");
  a.sampling.temperature = temperature;
  a.sampling.seed = r.getSeed();
  return a;
}

void encode_complete(const CompleteResult& res, wp::CompleteResponse::Builder out) {
  out.setText(as_text(res.text));
  auto tokens = out.initTokens(static_cast<unsigned>(res.tokens.size()));
  for (unsigned i = 0; i < res.tokens.size(); ++i) tokens.set(i, res.tokens[i]);
  auto scores = out.initScores(static_cast<unsigned>(res.scores.size()));
  for (unsigned i = 0; i < res.scores.size(); ++i) {
    scores[i].setLogProb(res.scores[i].log_prob);
    scores[i].setTokens(static_cast<uint32_t>(res.scores[i].tokens));
  }
  out.setBest(res.best);
  auto s = out.initStats();
  const AssembleStats& a = res.assembly;
  s.setTtftSeconds(res.ttft_seconds);
  s.setRetrieveSeconds(res.retrieve_seconds);
  s.setPrefillSeconds(res.prefill_seconds);
  s.setPromptTokens(static_cast<uint32_t>(a.prompt_tokens));
  s.setMemoryTokens(static_cast<uint32_t>(a.memory_tokens));
  s.setCachedPrefixTokens(static_cast<uint32_t>(a.cached_prefix));
  auto per_layer = s.initRecomputedPerLayer(static_cast<unsigned>(a.recomputed_per_layer.size()));
  for (unsigned i = 0; i < a.recomputed_per_layer.size(); ++i) {
    per_layer.set(i, static_cast<uint32_t>(a.recomputed_per_layer[i]));
  }
  s.setRecomputeRatio(a.recompute_ratio);
  s.setBytesLoaded(a.bytes_loaded);
  s.setEntriesHit(res.entries_hit);
  s.setEntriesMissing(res.entries_missing);
  s.setEntriesStale(res.entries_stale);
  s.setEntriesDevice(res.entries_device);
  auto checks = s.initCheckLayers(static_cast<unsigned>(a.check_layers.size()));
  for (unsigned i = 0; i < a.check_layers.size(); ++i) {
    checks.set(i, static_cast<uint32_t>(a.check_layers[i]));
  }
  auto hops = s.initHops(static_cast<unsigned>(a.hops.size()));
  for (unsigned i = 0; i < a.hops.size(); ++i) hops.set(i, static_cast<uint32_t>(a.hops[i]));
  auto segs = s.initSegments(static_cast<unsigned>(res.segment_ids.size()));
  for (unsigned i = 0; i < res.segment_ids.size(); ++i) segs.set(i, res.segment_ids[i]);
  s.setMethod(static_cast<wp::Method>(static_cast<uint16_t>(res.method) + 1));
}

// ---- the service ------------------------------------------------------------------------------

WorkerService::WorkerService(PlanService* plans, KvProducer* producer, WorkerServiceOptions options,
                             WorkerMetrics* metrics)
    : plans_(plans), producer_(producer), options_(std::move(options)), metrics_(metrics) {}

WorkerService::~WorkerService() { drain(); }

size_t WorkerService::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void WorkerService::count_queue(Method m, double delta) {
  if (metrics_ != nullptr) metrics_->queue_depth.labels({method_name(m)}).inc(delta);
}

void WorkerService::handle_batch(std::span<WorkerCall> calls) {
  const auto refuse = [this](WorkerCall& call, const Status& why) {
    call.fail(why);
    if (metrics_ != nullptr) metrics_->refused.labels({code_name(why.code())}).inc();
  };
  for (auto& call : calls) {
    auto req = call.request();
    switch (req.which()) {
      case wp::Request::PING: {
        auto p = call.reply().initPing();
        p.setServerVersion(as_text(options_.server_version + " protocol " +
                                   std::to_string(client::WorkerProtocol::kVersion)));
        p.setModel(as_text(options_.fingerprint.describe()));
        break;
      }
      case wp::Request::COMPLETE: {
        Result<CompleteArgs> args = Status(Code::kInternal, "not decoded");
        try {
          args = decode_complete(req.getComplete(), options_, plans_->defaults());
        } catch (const kj::Exception& e) {  // e.g. a Text without its NUL
          args = Status(Code::kMalformed,
                        std::string("undecodable completion: ") + e.getDescription().cStr());
        }
        if (!args.is_ok()) {
          refuse(call, args.status());
          break;
        }
        const Method m = args->method.value_or(plans_->defaults().method);
        std::lock_guard<std::mutex> lock(mu_);
        if (draining_) {
          refuse(call, Status(Code::kUnavailable, "keep-worker is shutting down"));
          break;
        }
        if (queue_.size() >= options_.max_queue) {
          refuse(call, Status(Code::kResourceExhausted,
                              std::to_string(queue_.size()) +
                                  " completions are waiting for the engine (--max-queue): retry "
                                  "later"));
          break;
        }
        count_queue(m, +1);
        queue_.push_back({call.defer(), std::move(args).value()});
        cv_.notify_one();
        break;
      }
      default:
        refuse(call, invalid("request without a known operation (" +
                             std::to_string(static_cast<int>(req.which())) + ")"));
    }
  }
}

void WorkerService::start(std::function<void(std::unique_ptr<WorkerCall>)> complete) {
  KEEP_CHECK_MSG(!engine_.joinable(), "worker service started twice");
  complete_ = std::move(complete);
  engine_ = std::thread([this] { engine_loop(); });
}

void WorkerService::drain() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
  }
  cv_.notify_all();
  if (engine_.joinable()) engine_.join();
}

void WorkerService::ensure_region() {
  const auto now = Clock::now();
  if (region_ != nullptr && region_->linked()) return;
  if (region_ != nullptr) {
    KEEP_LOG_WARN(kLog, "the KV region '%s' was replaced or removed (manager restarted?)",
                  options_.shm_name.c_str());
    producer_->set_region(nullptr);  // revokes the job in hand: its entry was the old region's
    plans_->set_region(nullptr);
    if (options_.on_region) options_.on_region(*region_, false);
    region_.reset();
    attached_.store(false, std::memory_order_relaxed);
    if (metrics_ != nullptr) metrics_->region_attached.get().set(0);
  }
  if (now < next_region_try_) return;
  next_region_try_ = now + options_.region_retry;
  auto view = kv::KvRegionView::attach(options_.shm_name, options_.fingerprint);
  if (!view.is_ok()) {
    if (view.status().code() == Code::kVersionMismatch && !mismatch_logged_) {
      KEEP_LOG_ERROR(kLog, "not using the KV region: %s", view.status().message().c_str());
      mismatch_logged_ = true;
    }
    return;
  }
  mismatch_logged_ = false;
  region_ = std::move(view).value();
  if (options_.on_region) options_.on_region(*region_, true);
  plans_->set_region(region_.get());
  producer_->set_region(region_.get());
  attached_.store(true, std::memory_order_relaxed);
  if (metrics_ != nullptr) metrics_->region_attached.get().set(1);
  KEEP_LOG_INFO(kLog, "attached the KV region '%s' (%zu bytes)", options_.shm_name.c_str(),
                region_->size());
}

void WorkerService::run_one(Queued q) {
  const Method m = q.args.method.value_or(plans_->defaults().method);
  count_queue(m, -1);
  WorkerCall& call = *q.call;
  const auto now = Clock::now();
  Code code = Code::kOk;
  if (now >= call.deadline()) {
    call.fail(Status(Code::kTimeout, "the caller's timeout passed while the request was queued"));
    code = Code::kTimeout;
  } else {
    // Retried across a manager restart while the caller still waits (or for --manager-retry-ms
    // when it said no deadline).
    const auto retry_until = std::min(call.deadline(), call.received() + options_.manager_retry);
    auto result = plans_->complete(q.args, call.received(), retry_until);
    if (!result.is_ok()) {
      code = result.status().code();
      if (code == Code::kTimeout || code == Code::kUnavailable) {
        if (metrics_ != nullptr) metrics_->manager_errors.get().inc();
      }
      call.fail(result.status());
    } else {
      encode_complete(*result, call.reply().initComplete());
      if (metrics_ != nullptr) {
        const char* mn = method_name(result->method);
        metrics_->ttft.labels({mn}).observe(result->ttft_seconds);
        metrics_->prompt_tokens.labels({mn}).observe(result->assembly.prompt_tokens);
        metrics_->recompute_ratio.labels({mn}).observe(result->assembly.recompute_ratio);
        metrics_->bytes_loaded.labels({mn}).inc(static_cast<double>(result->assembly.bytes_loaded));
        metrics_->entries.labels({mn, "hit"}).inc(result->entries_hit);
        metrics_->entries.labels({mn, "missing"}).inc(result->entries_missing);
        metrics_->entries.labels({mn, "stale"}).inc(result->entries_stale);
        metrics_->entries.labels({mn, "device"}).inc(result->entries_device);
      }
    }
  }
  if (metrics_ != nullptr) {
    const char* mn = method_name(m);
    metrics_->requests.labels({mn, code_name(code)}).inc();
    metrics_->request_time.labels({mn}).observe(
        std::chrono::duration<double>(Clock::now() - call.received()).count());
  }
  complete_(std::move(q.call));
}

void WorkerService::engine_loop() {
  ProducerStats seen;
  kvremote::SharedKvStats seen_shared;
  for (;;) {
    std::optional<Queued> next;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!queue_.empty()) {
        next = std::move(queue_.front());
        queue_.pop_front();
      } else if (draining_) {
        break;
      }
    }
    ensure_region();
    if (next) {
      run_one(std::move(*next));
      continue;
    }
    // No request waits: entries the last requests read from the host go into the device tier
    // (its owner), then one step of background KV production.
    bool worked = plans_->admit_pending(4) > 0;
    if (options_.produce && region_ != nullptr &&
        (producer_->busy() || Clock::now() >= next_job_poll_)) {
      auto step = producer_->step(options_.job_layers);
      if (!step.is_ok()) {
        KEEP_LOG_WARN(kLog, "KV job step: %s", step.status().to_string().c_str());
        if (metrics_ != nullptr) metrics_->manager_errors.get().inc();
      }
      const bool stepped = step.is_ok() && *step;
      if (!stepped) next_job_poll_ = Clock::now() + options_.job_poll;
      worked = worked || stepped;
    }
    if (metrics_ != nullptr) {
      const ProducerStats& s = producer_->stats();
      metrics_->jobs.labels({"done"}).inc(static_cast<double>(s.jobs_done - seen.jobs_done));
      metrics_->jobs.labels({"failed"}).inc(static_cast<double>(s.jobs_failed - seen.jobs_failed));
      metrics_->jobs.labels({"stale"}).inc(static_cast<double>(s.jobs_stale - seen.jobs_stale));
      metrics_->job_bytes.get().inc(static_cast<double>(s.bytes_written - seen.bytes_written));
      seen = s;
      if (const kvremote::SharedKvStats* t = producer_->shared_stats(); t != nullptr) {
        auto& f = metrics_->shared_kv;
        f.labels({"hit"}).inc(static_cast<double>(t->hits - seen_shared.hits));
        f.labels({"miss"}).inc(static_cast<double>(t->misses - seen_shared.misses));
        f.labels({"error"}).inc(static_cast<double>(t->errors - seen_shared.errors));
        f.labels({"published"}).inc(static_cast<double>(t->published - seen_shared.published));
        f.labels({"rejected"}).inc(static_cast<double>(t->rejected - seen_shared.rejected));
        seen_shared = *t;
      }
    }
    if (!worked) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, options_.job_poll, [this] { return !queue_.empty() || draining_; });
    }
  }
  producer_->abandon();  // revokes the reservation in hand
  if (region_ != nullptr && options_.on_region) options_.on_region(*region_, false);
}

}  // namespace keep::worker
