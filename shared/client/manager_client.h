// ManagerClient: the blocking C++ client of keep-manager (one call per protocol request).
//
// Every call returns the server's {code, message} as a Status (or a Result<T>); transport problems
// are as shared/rpc/rpc_channel.h says (kTimeout, kTooLarge, kMalformed, kUnavailable).
//
// Thread-compatible: one client per thread (a ZeroMQ socket must not be shared).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/client/failover.h"
#include "shared/client/owner_directory.h"
#include "shared/common/status.h"

namespace keep::wire {
class RpcChannel;
}

namespace keep::client {

inline constexpr const char* kDefaultEndpoint = "tcp://127.0.0.1:7601";

enum class SegmentKind : uint8_t { kObjectState = 0, kTaskRecord = 1, kExamplePlan = 2 };
enum class GroupState : uint8_t { kDynamic = 0, kStatic = 1 };
enum class JobKind : uint8_t { kSegment = 0, kGroup = 1 };

const char* kind_name(SegmentKind kind);   // "object_state", "task_record", "example_plan"
const char* state_name(GroupState state);  // "dynamic", "static"
const char* job_kind_name(JobKind kind);   // "segment", "group"
std::optional<SegmentKind> parse_kind(std::string_view name);

struct EntryDescriptor {
  uint32_t index = 0;
  uint64_t generation = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint32_t tokens = 0;
};

struct KvSlice {
  EntryDescriptor entry;
  uint32_t token_offset = 0;
  uint32_t tokens = 0;
  bool joint = false;
};

struct WriteArgs {
  std::string agent;
  std::optional<uint64_t> id;  // empty: the manager assigns one
  std::string text;
  SegmentKind kind = SegmentKind::kObjectState;
  std::optional<uint64_t> step;  // empty: the agent's current step
};

struct WriteResult {
  uint64_t id = 0;
  uint64_t version = 0;
  uint64_t step = 0;
};

// What every answer that describes a segment carries (retrieve, listMemories).
struct SegmentFields {
  uint64_t id = 0;
  std::string text;
  SegmentKind kind = SegmentKind::kObjectState;
  uint32_t tokens = 0;
  uint64_t version = 0;
  uint64_t updated_step = 0;
  uint64_t group_id = 0;  // 0: not in a group yet
};

struct RetrievedSegment : SegmentFields {
  GroupState group_state = GroupState::kDynamic;
  uint64_t group_version = 0;
  float score = 0;
  std::optional<KvSlice> kv;  // empty: no KV yet
};

struct GroupInfo {
  uint64_t id = 0;
  GroupState state = GroupState::kDynamic;
  uint64_t version = 0;
  std::vector<uint64_t> segment_ids;
  uint32_t tokens = 0;
  uint64_t last_change_step = 0;
};

struct MemoryInfo : SegmentFields {
  bool embedded = false;
  bool has_kv = false;
};

// A page of list_memories: ascending id; `more`: ask again with after_id = memories.back().id.
struct MemoryPage {
  std::vector<MemoryInfo> memories;
  bool more = false;
};

struct Stats {
  uint64_t agents = 0;
  uint64_t memories = 0;
  uint64_t groups_static = 0;
  uint64_t groups_dynamic = 0;
  uint64_t jobs_pending = 0;
  std::vector<std::pair<std::string, uint64_t>> counters;
};

struct JobSegment {
  uint64_t id = 0;
  uint64_t version = 0;
  std::string text;
  uint32_t tokens = 0;
  // kObjectState when the manager sent none (older than the shared KV tier): not shared.
  SegmentKind kind = SegmentKind::kObjectState;
};

struct KvJob {
  uint64_t job_id = 0;
  JobKind kind = JobKind::kSegment;
  std::string agent;
  uint64_t group_id = 0;
  uint64_t group_version = 0;
  std::vector<JobSegment> segments;
};

struct Reservation {
  EntryDescriptor entry;
  uint32_t lease_ms = 0;
};

struct ClientOptions {
  std::string endpoint = kDefaultEndpoint;       // tcp://host:port or ipc://path
  std::chrono::milliseconds timeout{5000};       // per request; sent as the request's timeoutMs
  size_t max_request_bytes = size_t{1} << 20;    // refused locally with kTooLarge (server default)
  size_t max_response_bytes = size_t{64} << 20;  // larger answers are kTooLarge
  // Cluster mode (docs/cluster.md): a call about an agent answered `moved` goes to the node the
  // answer names (remembered for that agent); one answered "no owner yet" or "being taken over"
  // (nothing applied) is retried shortly. An agent whose node stops answering (no answer in time,
  // or `unavailable`) is forgotten: its calls go back through `endpoint` (or `directory`), which
  // name the node that took its shard over, and the call is sent again there at once -- a
  // mutation too, with the same request id (every mutation carries one: this client's id and
  // its count of mutations), so that the node that took the agent over answers it as the dead
  // node did if that one applied it, and applies it otherwise: exactly once either way.
  bool follow_moved = true;
  // Cluster mode, optional: where agents live (cluster::EtcdDirectory reads etcd, the managers'
  // placement). Asked before an agent's first call, and again after its node stopped answering;
  // `moved` is still followed when it was stale. Empty: `endpoint` and `moved` answers only.
  std::shared_ptr<OwnerDirectory> directory;
  // Cluster mode: once an agent's node stopped answering, how long its call keeps being routed
  // anew (the shard is taken over a lease plus a round after the node died: 10 s and a quarter
  // by default) before it gives up. A mutation that gives up after its answer was lost returns
  // that loss (kTimeout or kUnavailable, saying it may or may not be applied).
  std::chrono::milliseconds failover_wait{15000};
};

class ManagerClient {
 public:
  // Creates the socket and connects (ZeroMQ connects lazily: an absent server shows up as
  // kTimeout on the first call).
  static Result<std::unique_ptr<ManagerClient>> connect(ClientOptions options);
  ~ManagerClient();
  ManagerClient(const ManagerClient&) = delete;
  ManagerClient& operator=(const ManagerClient&) = delete;

  Result<std::string> ping();  // the server's version string
  Result<WriteResult> write(const WriteArgs& args);
  Result<WriteResult> update(std::string_view agent, uint64_t id, std::string_view text,
                             std::optional<SegmentKind> kind = std::nullopt,
                             std::optional<uint64_t> step = std::nullopt);
  Status remove(std::string_view agent, uint64_t id);
  Result<uint64_t> advance_step(std::string_view agent, uint64_t by = 1);  // the new step
  Result<std::vector<RetrievedSegment>> retrieve(std::string_view agent, std::string_view query,
                                                 uint32_t k);
  Result<std::vector<GroupInfo>> list_groups(std::string_view agent);
  // The agent's memories with id > after_id, ascending, at most `limit` (0: the server's default
  // page, 100; the server clamps larger pages to its maximum, 1000, and ends a page early at
  // 4 MiB of text). Follow `more` for the rest.
  Result<MemoryPage> list_memories(std::string_view agent, uint64_t after_id = 0,
                                   uint32_t limit = 0);
  Result<Stats> stats();
  Result<std::vector<KvJob>> fetch_jobs(uint64_t worker_id, uint32_t max);
  Result<Reservation> reserve_entry(uint64_t worker_id, uint64_t job_id, uint32_t tokens);
  // slice_tokens (group jobs, optional): tokens of each member in job order.
  Status commit_entry(uint64_t worker_id, uint64_t job_id, uint32_t index, uint64_t generation,
                      const std::vector<uint32_t>& slice_tokens = {});
  Status revoke_entry(uint64_t worker_id, uint64_t job_id, uint32_t index, uint64_t generation);
  Result<uint32_t> renew_lease(uint64_t worker_id, uint64_t job_id, uint32_t index,
                               uint64_t generation);  // the new lease in ms

  // Sends raw frame bytes and returns the raw answer (tests and tools; no id matching).
  Result<std::string> call_raw(std::string_view payload);

  const ClientOptions& options() const { return options_; }
  // `moved` answers this client received (each costs a round trip the directory would spare).
  uint64_t moved_answers() const { return moved_answers_; }
  // Mutations sent again with their request id after their answer was lost (or unconfirmed).
  uint64_t mutations_resent() const { return mutations_resent_; }
  // The client part of this client's request ids (random, never 0).
  uint64_t client_id() const { return client_id_; }

 private:
  explicit ManagerClient(ClientOptions options);
  // A channel to `endpoint` with this client's timeout and size limits.
  Result<std::unique_ptr<wire::RpcChannel>> open(const std::string& endpoint) const;
  // `call` on the channel of the node serving `agent`, following moved answers, and sent again
  // when the node stopped answering (see ClientOptions::follow_moved). `mutation`: the call
  // carries a request id, and a lost answer is reported as such if it gives up.
  Status routed(std::string_view agent, bool mutation,
                const std::function<Status(wire::RpcChannel&)>& call);
  // The request id of the next mutation: {client_id_, its sequence number}.
  uint64_t next_seq() { return next_seq_++; }

  ClientOptions options_;
  std::unique_ptr<wire::RpcChannel> channel_;
  std::map<std::string, std::unique_ptr<wire::RpcChannel>> others_;  // endpoint -> channel
  AgentRoutes routes_;
  uint64_t moved_answers_ = 0;
  uint64_t mutations_resent_ = 0;
  uint64_t client_id_ = 0;  // random, never 0
  uint64_t next_seq_ = 1;
};

}  // namespace keep::client
