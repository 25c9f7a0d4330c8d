#include "shared/client/worker_client.h"

#include <capnp/message.h>

#include <thread>

#include "shared/client/failover.h"
#include "shared/client/moved.h"
#include "shared/client/protocols.h"
#include "shared/rpc/rpc_channel.h"
#include "shared/rpc/wire_codec.h"

namespace keep::client {

namespace wp = proto::worker;

namespace {

// PlanMethod and proto::worker::Method have the same values (kDefault is the wire's unknown).
static_assert(static_cast<int>(PlanMethod::kKeep) == static_cast<int>(wp::Method::KEEP));
static_assert(static_cast<int>(PlanMethod::kFullReuse) == static_cast<int>(wp::Method::FULL_REUSE));

constexpr const char* kMethodNames[] = {"default",    "full", "prefix", "full_reuse",
                                        "cacheblend", "epic", "keep"};

using wire::as_text;
using wire::to_string;

}  // namespace

const char* plan_method_name(PlanMethod m) {
  const auto i = static_cast<size_t>(m);
  return i < std::size(kMethodNames) ? kMethodNames[i] : "unknown";
}

std::optional<PlanMethod> parse_plan_method(std::string_view name) {
  for (size_t i = 0; i < std::size(kMethodNames); ++i) {
    if (name == kMethodNames[i]) return static_cast<PlanMethod>(i);
  }
  return std::nullopt;
}

WorkerClient::WorkerClient(WorkerClientOptions options)
    : options_(std::move(options)), routes_(options_.endpoint, options_.directory) {}
WorkerClient::~WorkerClient() = default;

Result<std::unique_ptr<WorkerClient>> WorkerClient::connect(WorkerClientOptions options) {
  std::unique_ptr<WorkerClient> client(new WorkerClient(options));
  KEEP_ASSIGN_OR_RETURN(
      client->channel_,
      wire::RpcChannel::connect({options.endpoint, options.timeout, options.max_request_bytes,
                                 options.max_response_bytes}));
  return client;
}

Result<std::string> WorkerClient::call_raw(std::string_view payload) {
  return channel_->call_raw(payload);
}

Result<WorkerPing> WorkerClient::ping() {
  WorkerPing out;
  KEEP_RETURN_IF_ERROR(channel_->call<WorkerProtocol>(
      wp::Response::PING, [](auto req) { req.setPing(); },
      [&](wp::Response::Reader r) {
        out.server_version = to_string(r.getPing().getServerVersion());
        out.model = to_string(r.getPing().getModel());
        return Status::ok();
      }));
  return out;
}

Result<wire::RpcChannel*> WorkerClient::channel_to(const std::string& endpoint) {
  if (endpoint == options_.endpoint) return channel_.get();
  auto& other = others_[endpoint];
  if (!other) {
    KEEP_ASSIGN_OR_RETURN(
        other, wire::RpcChannel::connect({endpoint, options_.timeout, options_.max_request_bytes,
                                          options_.max_response_bytes}));
  }
  return other.get();
}

Result<CompleteReply> WorkerClient::complete(const CompleteArgs& a) {
  std::string endpoint = routes_.first(a.agent);
  // Set once the agent's worker stopped answering or its shard was found moving: the call is
  // routed anew until then. Without either, a shard that moves while we follow it: a few hops.
  std::optional<std::chrono::steady_clock::time_point> failover_until;
  constexpr int kMaxHops = 4;
  bool resent = false;
  const auto send_again = [&] {
    if (!resent) ++calls_resent_;
    resent = true;
  };
  for (int attempt = 0;; ++attempt) {
    KEEP_ASSIGN_OR_RETURN(wire::RpcChannel * ch, channel_to(endpoint));
    auto r = complete_on(*ch, a);
    if (r.is_ok()) return r;
    const Status& st = r.status();
    const bool no_answer = transport_failure(st);
    const bool moving = retry_here(st) || lease_lapsed(st);
    if ((no_answer || moving) && !failover_until) {
      failover_until = std::chrono::steady_clock::now() + options_.failover_wait;
    }
    const bool again = options_.follow_moved &&
                       (attempt < kMaxHops ||
                        (failover_until && std::chrono::steady_clock::now() < *failover_until));
    if (st.code() == Code::kMoved) {
      ++moved_answers_;
      // No target: the answering worker does not know the owner's (see moved.h).
      const std::optional<MovedTarget> t = parse_moved(st.message());
      if (!again || !t || t->endpoint == endpoint) return r;
      endpoint = routes_.after_moved(a.agent, t->endpoint);
      continue;
    }
    if (no_answer) {
      // That worker may be gone: forget it, and send the plan to the node that takes its agents
      // over -- the directory's answer (which names the dead node until its lease runs out) or
      // the configured endpoint (which answers moved).
      routes_.forget(a.agent);
      routes_.mark_silent(endpoint);
      if (!again) return r;
      std::string next = routes_.lookup(a.agent);
      while (next == endpoint && routes_.has_directory() &&
             std::chrono::steady_clock::now() < *failover_until) {
        std::this_thread::sleep_for(kRetryWait);
        next = routes_.lookup(a.agent);
      }
      if (next == endpoint) return r;  // nowhere else to ask
      endpoint = std::move(next);
      send_again();
      continue;
    }
    if (moving) {
      // Nothing was planned; the node serves the agent shortly (or, its lease lapsed, another
      // node does: routed anew).
      routes_.forget(a.agent);
      if (!again) return r;
      std::this_thread::sleep_for(kRetryWait);
      if (lease_lapsed(st)) endpoint = routes_.lookup(a.agent);
      send_again();
      continue;
    }
    if (st.code() == Code::kUnavailable) {
      routes_.forget(a.agent);  // its node may no longer serve the agent: routed anew next time
    }
    return r;
  }
}

Result<CompleteReply> WorkerClient::complete_on(wire::RpcChannel& channel, const CompleteArgs& a) {
  CompleteReply out;
  KEEP_RETURN_IF_ERROR(channel.call<WorkerProtocol>(
      wp::Response::COMPLETE,
      [&](wp::Request::Builder req) {
        auto c = req.initComplete();
        c.setAgent(as_text(a.agent));
        c.setInstruction(as_text(a.instruction));
        auto h = c.initHistory(static_cast<unsigned>(a.history.size()));
        for (unsigned i = 0; i < a.history.size(); ++i) h.set(i, as_text(a.history[i]));
        c.setK(a.k);
        c.setMethod(static_cast<wp::Method>(a.method));
        auto k = c.initKnobs();
        if (a.knobs.decay) {
          k.setHasDecay(true);
          k.setDecay(*a.knobs.decay);
        }
        if (a.knobs.query_rows) {
          k.setHasQueryRows(true);
          k.setQueryRows(*a.knobs.query_rows);
        }
        if (a.knobs.max_hops) {
          k.setHasMaxHops(true);
          k.setMaxHops(*a.knobs.max_hops);
        }
        if (a.knobs.cacheblend_ratio) {
          k.setHasCacheblendRatio(true);
          k.setCacheblendRatio(*a.knobs.cacheblend_ratio);
        }
        if (a.knobs.epic_tokens) {
          k.setHasEpicTokens(true);
          k.setEpicTokens(*a.knobs.epic_tokens);
        }
        if (a.knobs.anchor_tokens) {
          k.setHasAnchorTokens(true);
          k.setAnchorTokens(*a.knobs.anchor_tokens);
        }
        c.setMaxTokens(a.max_tokens);
        auto cands = c.initCandidates(static_cast<unsigned>(a.candidates.size()));
        for (unsigned i = 0; i < a.candidates.size(); ++i) cands.set(i, as_text(a.candidates[i]));
        c.setTemperature(a.temperature);
        c.setSeed(a.seed);
      },
      [&](wp::Response::Reader r) {
        auto c = r.getComplete();
        out.text = to_string(c.getText());
        for (int32_t t : c.getTokens()) out.tokens.push_back(t);
        for (auto s : c.getScores()) out.scores.push_back({s.getLogProb(), s.getTokens()});
        out.best = c.getBest();
        auto s = c.getStats();
        PlanStats& st = out.stats;
        st.ttft_seconds = s.getTtftSeconds();
        st.retrieve_seconds = s.getRetrieveSeconds();
        st.prefill_seconds = s.getPrefillSeconds();
        st.prompt_tokens = s.getPromptTokens();
        st.memory_tokens = s.getMemoryTokens();
        st.cached_prefix_tokens = s.getCachedPrefixTokens();
        for (uint32_t v : s.getRecomputedPerLayer()) st.recomputed_per_layer.push_back(v);
        st.recompute_ratio = s.getRecomputeRatio();
        st.bytes_loaded = s.getBytesLoaded();
        st.entries_hit = s.getEntriesHit();
        st.entries_missing = s.getEntriesMissing();
        st.entries_stale = s.getEntriesStale();
        st.entries_device = s.getEntriesDevice();
        for (uint32_t v : s.getCheckLayers()) st.check_layers.push_back(v);
        for (uint32_t v : s.getHops()) st.hops.push_back(v);
        for (uint64_t v : s.getSegments()) st.segments.push_back(v);
        const auto m = static_cast<uint16_t>(s.getMethod());
        st.method = m <= static_cast<uint16_t>(PlanMethod::kKeep) ? static_cast<PlanMethod>(m)
                                                                  : PlanMethod::kDefault;
        return Status::ok();
      }));
  return out;
}

}  // namespace keep::client
