#include "shared/client/manager_client.h"

#include <capnp/message.h>
#include <kj/exception.h>

#include <algorithm>
#include <random>
#include <thread>

#include "shared/client/failover.h"
#include "shared/client/moved.h"
#include "shared/client/protocols.h"
#include "shared/rpc/rpc_channel.h"
#include "shared/rpc/wire_codec.h"

namespace keep::client {

namespace {

proto::SegmentKind kind_to_wire(SegmentKind kind) {
  switch (kind) {
    case SegmentKind::kObjectState:
      return proto::SegmentKind::OBJECT_STATE;
    case SegmentKind::kTaskRecord:
      return proto::SegmentKind::TASK_RECORD;
    case SegmentKind::kExamplePlan:
      return proto::SegmentKind::EXAMPLE_PLAN;
  }
  return proto::SegmentKind::UNKNOWN;
}

Result<SegmentKind> kind_from_wire(proto::SegmentKind kind) {
  switch (kind) {
    case proto::SegmentKind::OBJECT_STATE:
      return SegmentKind::kObjectState;
    case proto::SegmentKind::TASK_RECORD:
      return SegmentKind::kTaskRecord;
    case proto::SegmentKind::EXAMPLE_PLAN:
      return SegmentKind::kExamplePlan;
    default:
      break;
  }
  return Status(Code::kMalformed,
                "response has unknown segment kind " + std::to_string(static_cast<uint16_t>(kind)));
}

Result<GroupState> state_from_wire(proto::GroupState state) {
  switch (state) {
    case proto::GroupState::DYNAMIC:
      return GroupState::kDynamic;
    case proto::GroupState::STATIC:
      return GroupState::kStatic;
    default:
      break;
  }
  return Status(Code::kMalformed,
                "response has unknown group state " + std::to_string(static_cast<uint16_t>(state)));
}

Result<JobKind> job_kind_from_wire(proto::JobKind kind) {
  switch (kind) {
    case proto::JobKind::SEGMENT:
      return JobKind::kSegment;
    case proto::JobKind::GROUP:
      return JobKind::kGroup;
    default:
      break;
  }
  return Status(Code::kMalformed,
                "response has unknown job kind " + std::to_string(static_cast<uint16_t>(kind)));
}

EntryDescriptor entry_from_wire(proto::EntryDescriptor::Reader r) {
  return EntryDescriptor{r.getIndex(), r.getGeneration(), r.getOffset(), r.getBytes(),
                         r.getTokens()};
}

using wire::to_string;

// The fields proto::RetrievedSegment and proto::MemoryInfo share (the server's twin is
// set_segment_fields in manager_service.cpp).
template <typename Reader>
Status read_segment_fields(Reader s, SegmentFields* out) {
  out->id = s.getId();
  out->text = to_string(s.getText());
  KEEP_ASSIGN_OR_RETURN(out->kind, kind_from_wire(s.getKind()));
  out->tokens = s.getTokens();
  out->version = s.getVersion();
  out->updated_step = s.getUpdatedStep();
  out->group_id = s.getGroupId();
  return Status::ok();
}

}  // namespace

const char* kind_name(SegmentKind kind) {
  switch (kind) {
    case SegmentKind::kObjectState:
      return "object_state";
    case SegmentKind::kTaskRecord:
      return "task_record";
    case SegmentKind::kExamplePlan:
      return "example_plan";
  }
  return "unknown";
}

const char* state_name(GroupState state) {
  return state == GroupState::kStatic ? "static" : "dynamic";
}

const char* job_kind_name(JobKind kind) { return kind == JobKind::kGroup ? "group" : "segment"; }

std::optional<SegmentKind> parse_kind(std::string_view name) {
  if (name == "object_state" || name == "object") return SegmentKind::kObjectState;
  if (name == "task_record" || name == "task") return SegmentKind::kTaskRecord;
  if (name == "example_plan" || name == "example") return SegmentKind::kExamplePlan;
  return std::nullopt;
}

namespace {
// A client id for the request ids: 64 random bits, never 0 (0 says "no id").
uint64_t random_client_id() {
  std::random_device rd;
  for (;;) {
    const uint64_t id = (uint64_t{rd()} << 32) ^ uint64_t { rd() };
    if (id != 0) return id;
  }
}
}  // namespace

ManagerClient::ManagerClient(ClientOptions options)
    : options_(std::move(options)),
      routes_(options_.endpoint, options_.directory),
      client_id_(random_client_id()) {}

ManagerClient::~ManagerClient() = default;

Result<std::unique_ptr<ManagerClient>> ManagerClient::connect(ClientOptions options) {
  std::unique_ptr<ManagerClient> client(new ManagerClient(options));
  KEEP_ASSIGN_OR_RETURN(client->channel_, client->open(options.endpoint));
  return client;
}

Result<std::unique_ptr<wire::RpcChannel>> ManagerClient::open(const std::string& endpoint) const {
  return wire::RpcChannel::connect(
      {endpoint, options_.timeout, options_.max_request_bytes, options_.max_response_bytes});
}

Result<std::string> ManagerClient::call_raw(std::string_view payload) {
  return channel_->call_raw(payload);
}

// One request/response round trip (see wire::RpcChannel::call).
template <typename Fill, typename Extract>
static Status round_trip(wire::RpcChannel& channel, proto::Response::Which expected, Fill&& fill,
                         Extract&& extract) {
  return channel.call<ManagerProtocol>(expected, std::forward<Fill>(fill),
                                       std::forward<Extract>(extract));
}

namespace {

// A node's answer that its log of record did not confirm a mutation (it may or may not have
// landed); the node gave the shard up, to be taken again and its log replayed.
bool unconfirmed(const Status& st) {
  return st.code() == Code::kUnavailable &&
         st.message().find("did not confirm") != std::string::npos;
}

}  // namespace

Status ManagerClient::routed(std::string_view agent_name, bool mutation,
                             const std::function<Status(wire::RpcChannel&)>& call) {
  const std::string agent(agent_name);
  std::string endpoint = routes_.first(agent);
  // A mutation's try that got no answer, or an unconfirmed one: it may have been applied. Sent
  // again with the same request id, it is answered by whichever node serves the agent then.
  Status lost;
  bool resent = false;
  // Set once the agent's node stopped answering: the call is routed anew until then.
  std::optional<std::chrono::steady_clock::time_point> failover_until;
  const auto give_up = [&](const Status& last) {
    if (lost.is_ok() || last.message() == lost.message()) return lost.is_ok() ? last : lost;
    return Status(lost.code(), lost.message() + "; sent again with the same request id until " +
                                   "the last answer (" + last.to_string() +
                                   "): it may or may not be applied");
  };
  // A shard moving again while we follow it: a few hops; one between owners ("no owner yet") or
  // whose new owner replays its log ("being taken over"): a few short waits. Both answers say
  // nothing was applied, so the call is sent again.
  for (int attempt = 0;; ++attempt) {
    wire::RpcChannel* ch = channel_.get();
    if (endpoint != options_.endpoint) {
      auto& other = others_[endpoint];
      if (!other) {
        KEEP_ASSIGN_OR_RETURN(other, open(endpoint));
      }
      ch = other.get();
    }
    if (!lost.is_ok() && !resent) {
      resent = true;
      ++mutations_resent_;
    }
    Status st = call(*ch);
    const bool lapsed = lease_lapsed(st);
    const bool node_failed =
        transport_failure(st) || (st.code() == Code::kUnavailable && !retry_here(st) && !lapsed);
    if ((node_failed || lapsed) && !failover_until) {
      failover_until = std::chrono::steady_clock::now() + options_.failover_wait;
    }
    const bool again =
        options_.follow_moved &&
        (attempt < 15 || (failover_until && std::chrono::steady_clock::now() < *failover_until));
    if (st.code() == Code::kMoved) {
      ++moved_answers_;
      if (!again) return give_up(st);
      const std::optional<MovedTarget> target = parse_moved(st.message());
      if (!target || target->endpoint == endpoint) return give_up(st);
      endpoint = routes_.after_moved(agent, target->endpoint);
    } else if (retry_here(st)) {
      if (!again) return give_up(st);
      std::this_thread::sleep_for(kRetryWait);
    } else if (lapsed) {
      // Nothing was applied; the node answering may be the only one the client knows, and may
      // serve the agent again once it reaches etcd: ask again shortly, wherever lookup says.
      if (!again) return give_up(st);
      routes_.forget(agent);
      std::this_thread::sleep_for(kRetryWait);
      endpoint = routes_.lookup(agent);
    } else if (node_failed) {
      // The agent's node stopped answering or cannot serve it now: forget it, so that this call
      // -- a read, or a mutation with its request id -- goes to the node that takes its shard
      // over.
      routes_.forget(agent);
      if (transport_failure(st)) routes_.mark_silent(endpoint);
      if (mutation && lost.is_ok() && (transport_failure(st) || unconfirmed(st))) lost = st;
      if (!again) return give_up(st);
      std::string next = routes_.lookup(agent);
      if (next == endpoint && routes_.has_directory() && transport_failure(st)) {
        // etcd names the silent node (here also the configured endpoint) until its lease runs
        // out: ask etcd again shortly for the node taking the shard over, while failover_wait
        // lasts, instead of giving the call up.
        while (next == endpoint && routes_.silent(endpoint) &&
               std::chrono::steady_clock::now() < *failover_until) {
          std::this_thread::sleep_for(kRetryWait);
          next = routes_.lookup(agent);
        }
        if (next == endpoint) {
          if (std::chrono::steady_clock::now() >= *failover_until) return give_up(st);
          continue;  // silent long enough: it may answer again (restarted)
        }
      }
      if (next == endpoint) {
        // The node answered that its log did not confirm the mutation and gave the shard up:
        // it (or another) serves the agent again once the shard is taken and its log replayed.
        if (unconfirmed(st)) {
          std::this_thread::sleep_for(kRetryWait);
          continue;
        }
        return give_up(st);  // nowhere else to ask
      }
      endpoint = std::move(next);
    } else {
      return st;  // the answer (a resent mutation's: the first one's, or its own)
    }
  }
}

Result<std::string> ManagerClient::ping() {
  std::string version;
  KEEP_RETURN_IF_ERROR(round_trip(
      *channel_, proto::Response::PING, [](auto req) { req.initPing(); },
      [&](proto::Response::Reader r) {
        version = to_string(r.getPing().getServerVersion());
        return Status::ok();
      }));
  return version;
}

Result<WriteResult> ManagerClient::write(const WriteArgs& args) {
  WriteResult out;
  const uint64_t seq = next_seq();
  KEEP_RETURN_IF_ERROR(routed(args.agent, /*mutation=*/true, [&](wire::RpcChannel& ch) {
    return round_trip(
        ch, proto::Response::WRITE_MEMORY,
        [&](proto::Request::Builder req) {
          req.setClientId(client_id_);
          req.setClientSeq(seq);
          auto w = req.initWriteMemory();
          // Sized readers: Text::Reader's implicit conversion from std::string goes through
          // c_str() and would cut the text at an embedded NUL, silently.
          w.setAgent(capnp::Text::Reader(args.agent.data(), args.agent.size()));
          if (args.id) {
            w.setHasId(true);
            w.setId(*args.id);
          }
          w.setText(capnp::Text::Reader(args.text.data(), args.text.size()));
          w.setKind(kind_to_wire(args.kind));
          if (args.step) {
            w.setHasStep(true);
            w.setStep(*args.step);
          }
        },
        [&](proto::Response::Reader r) {
          auto w = r.getWriteMemory();
          out = WriteResult{w.getId(), w.getVersion(), w.getStep()};
          return Status::ok();
        });
  }));
  return out;
}

Result<WriteResult> ManagerClient::update(std::string_view agent, uint64_t id,
                                          std::string_view new_text,
                                          std::optional<SegmentKind> kind,
                                          std::optional<uint64_t> step) {
  WriteResult out;
  const uint64_t seq = next_seq();
  KEEP_RETURN_IF_ERROR(routed(agent, /*mutation=*/true, [&](wire::RpcChannel& ch) {
    return round_trip(
        ch, proto::Response::UPDATE_MEMORY,
        [&](proto::Request::Builder req) {
          req.setClientId(client_id_);
          req.setClientSeq(seq);
          auto u = req.initUpdateMemory();
          u.setAgent(capnp::Text::Reader(agent.data(), agent.size()));
          u.setId(id);
          u.setText(capnp::Text::Reader(new_text.data(), new_text.size()));
          if (kind) {
            u.setHasKind(true);
            u.setKind(kind_to_wire(*kind));
          }
          if (step) {
            u.setHasStep(true);
            u.setStep(*step);
          }
        },
        [&](proto::Response::Reader r) {
          auto w = r.getUpdateMemory();
          out = WriteResult{w.getId(), w.getVersion(), w.getStep()};
          return Status::ok();
        });
  }));
  return out;
}

Status ManagerClient::remove(std::string_view agent, uint64_t id) {
  const uint64_t seq = next_seq();
  return routed(agent, /*mutation=*/true, [&](wire::RpcChannel& ch) {
    return round_trip(
        ch, proto::Response::DELETE_MEMORY,
        [&](proto::Request::Builder req) {
          req.setClientId(client_id_);
          req.setClientSeq(seq);
          auto d = req.initDeleteMemory();
          d.setAgent(capnp::Text::Reader(agent.data(), agent.size()));
          d.setId(id);
        },
        [](proto::Response::Reader) { return Status::ok(); });
  });
}

Result<uint64_t> ManagerClient::advance_step(std::string_view agent, uint64_t by) {
  uint64_t step = 0;
  const uint64_t seq = next_seq();
  KEEP_RETURN_IF_ERROR(routed(agent, /*mutation=*/true, [&](wire::RpcChannel& ch) {
    return round_trip(
        ch, proto::Response::ADVANCE_STEP,
        [&](proto::Request::Builder req) {
          req.setClientId(client_id_);
          req.setClientSeq(seq);
          auto a = req.initAdvanceStep();
          a.setAgent(capnp::Text::Reader(agent.data(), agent.size()));
          a.setBy(by);
        },
        [&](proto::Response::Reader r) {
          step = r.getAdvanceStep().getStep();
          return Status::ok();
        });
  }));
  return step;
}

Result<std::vector<RetrievedSegment>> ManagerClient::retrieve(std::string_view agent,
                                                              std::string_view query, uint32_t k) {
  std::vector<RetrievedSegment> out;
  KEEP_RETURN_IF_ERROR(routed(agent, /*mutation=*/false, [&](wire::RpcChannel& ch) {
    return round_trip(
        ch, proto::Response::RETRIEVE,
        [&](proto::Request::Builder req) {
          auto q = req.initRetrieve();
          q.setAgent(capnp::Text::Reader(agent.data(), agent.size()));
          q.setQuery(capnp::Text::Reader(query.data(), query.size()));
          q.setK(k);
        },
        [&](proto::Response::Reader r) -> Status {
          for (auto s : r.getRetrieve().getSegments()) {
            RetrievedSegment seg;
            if (Status st = read_segment_fields(s, &seg); !st.is_ok()) return st;
            KEEP_ASSIGN_OR_RETURN(seg.group_state, state_from_wire(s.getGroupState()));
            seg.group_version = s.getGroupVersion();
            seg.score = s.getScore();
            if (s.getHasKv()) {
              auto kv = s.getKv();
              seg.kv = KvSlice{entry_from_wire(kv.getEntry()), kv.getTokenOffset(), kv.getTokens(),
                               kv.getJoint()};
            }
            out.push_back(std::move(seg));
          }
          return Status::ok();
        });
  }));
  return out;
}

Result<std::vector<GroupInfo>> ManagerClient::list_groups(std::string_view agent) {
  std::vector<GroupInfo> out;
  KEEP_RETURN_IF_ERROR(routed(agent, /*mutation=*/false, [&](wire::RpcChannel& ch) {
    return round_trip(
        ch, proto::Response::LIST_GROUPS,
        [&](proto::Request::Builder req) {
          req.initListGroups().setAgent(capnp::Text::Reader(agent.data(), agent.size()));
        },
        [&](proto::Response::Reader r) -> Status {
          for (auto g : r.getListGroups().getGroups()) {
            GroupInfo info;
            info.id = g.getId();
            KEEP_ASSIGN_OR_RETURN(info.state, state_from_wire(g.getState()));
            info.version = g.getVersion();
            for (uint64_t id : g.getSegmentIds()) info.segment_ids.push_back(id);
            info.tokens = g.getTokens();
            info.last_change_step = g.getLastChangeStep();
            out.push_back(std::move(info));
          }
          return Status::ok();
        });
  }));
  return out;
}

Result<MemoryPage> ManagerClient::list_memories(std::string_view agent, uint64_t after_id,
                                                uint32_t limit) {
  MemoryPage out;
  KEEP_RETURN_IF_ERROR(routed(agent, /*mutation=*/false, [&](wire::RpcChannel& ch) {
    return round_trip(
        ch, proto::Response::LIST_MEMORIES,
        [&](proto::Request::Builder req) {
          auto q = req.initListMemories();
          q.setAgent(capnp::Text::Reader(agent.data(), agent.size()));
          q.setAfterId(after_id);
          q.setLimit(limit);
        },
        [&](proto::Response::Reader r) -> Status {
          auto page = r.getListMemories();
          for (auto m : page.getMemories()) {
            MemoryInfo info;
            if (Status st = read_segment_fields(m, &info); !st.is_ok()) return st;
            info.embedded = m.getEmbedded();
            info.has_kv = m.getHasKv();
            out.memories.push_back(std::move(info));
          }
          out.more = page.getMore();
          return Status::ok();
        });
  }));
  return out;
}

Result<Stats> ManagerClient::stats() {
  Stats out;
  KEEP_RETURN_IF_ERROR(round_trip(
      *channel_, proto::Response::STATS, [](auto req) { req.initStats(); },
      [&](proto::Response::Reader r) {
        auto s = r.getStats();
        out.agents = s.getAgents();
        out.memories = s.getMemories();
        out.groups_static = s.getGroupsStatic();
        out.groups_dynamic = s.getGroupsDynamic();
        out.jobs_pending = s.getJobsPending();
        for (auto c : s.getCounters())
          out.counters.emplace_back(to_string(c.getName()), c.getValue());
        return Status::ok();
      }));
  return out;
}

Result<std::vector<KvJob>> ManagerClient::fetch_jobs(uint64_t worker_id, uint32_t max) {
  std::vector<KvJob> out;
  KEEP_RETURN_IF_ERROR(round_trip(
      *channel_, proto::Response::FETCH_JOBS,
      [&](proto::Request::Builder req) {
        auto f = req.initFetchJobs();
        f.setWorkerId(worker_id);
        f.setMax(max);
      },
      [&](proto::Response::Reader r) -> Status {
        for (auto j : r.getFetchJobs().getJobs()) {
          KvJob job;
          job.job_id = j.getJobId();
          KEEP_ASSIGN_OR_RETURN(job.kind, job_kind_from_wire(j.getKind()));
          job.agent = to_string(j.getAgent());
          job.group_id = j.getGroupId();
          job.group_version = j.getGroupVersion();
          for (auto s : j.getSegments()) {
            auto kind = kind_from_wire(s.getKind());
            job.segments.push_back(JobSegment{s.getId(), s.getVersion(), to_string(s.getText()),
                                              s.getTokens(),
                                              kind.is_ok() ? *kind : SegmentKind::kObjectState});
          }
          out.push_back(std::move(job));
        }
        return Status::ok();
      }));
  return out;
}

Result<Reservation> ManagerClient::reserve_entry(uint64_t worker_id, uint64_t job_id,
                                                 uint32_t tokens) {
  Reservation out;
  KEEP_RETURN_IF_ERROR(round_trip(
      *channel_, proto::Response::RESERVE_ENTRY,
      [&](proto::Request::Builder req) {
        auto q = req.initReserveEntry();
        q.setWorkerId(worker_id);
        q.setJobId(job_id);
        q.setTokens(tokens);
      },
      [&](proto::Response::Reader r) {
        auto q = r.getReserveEntry();
        out = Reservation{entry_from_wire(q.getEntry()), q.getLeaseMs()};
        return Status::ok();
      }));
  return out;
}

namespace {
void fill_ref(proto::EntryRef::Builder ref, uint64_t worker_id, uint64_t job_id, uint32_t index,
              uint64_t generation) {
  ref.setWorkerId(worker_id);
  ref.setJobId(job_id);
  ref.setIndex(index);
  ref.setGeneration(generation);
}
}  // namespace

Status ManagerClient::commit_entry(uint64_t worker_id, uint64_t job_id, uint32_t index,
                                   uint64_t generation, const std::vector<uint32_t>& slice_tokens) {
  return round_trip(
      *channel_, proto::Response::COMMIT_ENTRY,
      [&](proto::Request::Builder req) {
        auto ref = req.initCommitEntry();
        fill_ref(ref, worker_id, job_id, index, generation);
        if (!slice_tokens.empty()) {
          auto list = ref.initSliceTokens(static_cast<unsigned>(slice_tokens.size()));
          for (size_t i = 0; i < slice_tokens.size(); ++i) {
            list.set(static_cast<unsigned>(i), slice_tokens[i]);
          }
        }
      },
      [](proto::Response::Reader) { return Status::ok(); });
}

Status ManagerClient::revoke_entry(uint64_t worker_id, uint64_t job_id, uint32_t index,
                                   uint64_t generation) {
  return round_trip(
      *channel_, proto::Response::REVOKE_ENTRY,
      [&](proto::Request::Builder req) {
        fill_ref(req.initRevokeEntry(), worker_id, job_id, index, generation);
      },
      [](proto::Response::Reader) { return Status::ok(); });
}

Result<uint32_t> ManagerClient::renew_lease(uint64_t worker_id, uint64_t job_id, uint32_t index,
                                            uint64_t generation) {
  uint32_t lease_ms = 0;
  KEEP_RETURN_IF_ERROR(round_trip(
      *channel_, proto::Response::RENEW_LEASE,
      [&](proto::Request::Builder req) {
        fill_ref(req.initRenewLease(), worker_id, job_id, index, generation);
      },
      [&](proto::Response::Reader r) {
        lease_ms = r.getRenewLease().getLeaseMs();
        return Status::ok();
      }));
  return lease_ms;
}

}  // namespace keep::client
