// WorkerClient: the blocking C++ client of keep-worker (planners, keepctl complete/score, tests).
//
// Every call returns the worker's {code, message} as a Status (or a Result<T>); transport problems
// are as shared/rpc/rpc_channel.h says (kTimeout, kTooLarge, kMalformed, kUnavailable).
// Thread-compatible: one client per thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shared/client/failover.h"
#include "shared/client/owner_directory.h"
#include "shared/common/status.h"

namespace keep::wire {
class RpcChannel;
}

namespace keep::client {

inline constexpr const char* kDefaultWorkerEndpoint = "tcp://127.0.0.1:7602";

// The methods of docs/recompute.md, as on the wire; kDefault: the worker's --method.
enum class PlanMethod : uint8_t {
  kDefault = 0,
  kFull,
  kPrefix,
  kFullReuse,
  kCacheblend,
  kEpic,
  kKeep
};
const char* plan_method_name(PlanMethod m);  // "default", "full", ..., "full_reuse", ...
std::optional<PlanMethod> parse_plan_method(std::string_view name);

// Per-request overrides of the worker's defaults (unset: the default).
struct PlanKnobs {
  std::optional<double> decay;             // keep: d
  std::optional<uint32_t> query_rows;      // keep: q
  std::optional<uint32_t> max_hops;        // keep: hop cap
  std::optional<double> cacheblend_ratio;  // cacheblend: share recomputed
  std::optional<uint32_t> epic_tokens;     // epic: k
  std::optional<uint32_t> anchor_tokens;   // keep: leading tokens always computed
};

struct CompleteArgs {
  std::string agent;
  std::string instruction;
  std::vector<std::string> history;
  uint32_t k = 0;  // 0: the worker's default
  PlanMethod method = PlanMethod::kDefault;
  PlanKnobs knobs;
  uint32_t max_tokens = 0;              // 0: the worker's default
  std::vector<std::string> candidates;  // non-empty: score them instead of generating
  float temperature = 0;                // <= 0: greedy
  uint64_t seed = 0;
};

struct PlanStats {
  double ttft_seconds = 0;
  double retrieve_seconds = 0;
  double prefill_seconds = 0;
  uint32_t prompt_tokens = 0;
  uint32_t memory_tokens = 0;
  uint32_t cached_prefix_tokens = 0;
  std::vector<uint32_t> recomputed_per_layer;
  double recompute_ratio = 0;
  uint64_t bytes_loaded = 0;
  uint32_t entries_hit = 0;
  uint32_t entries_missing = 0;
  uint32_t entries_stale = 0;
  uint32_t entries_device = 0;  // of the hits, read from a device KV tier
  std::vector<uint32_t> check_layers;
  std::vector<uint32_t> hops;
  std::vector<uint64_t> segments;
  PlanMethod method = PlanMethod::kDefault;
};

struct CandidateResult {
  double log_prob = 0;
  uint32_t tokens = 0;
};

struct CompleteReply {
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<CandidateResult> scores;
  uint32_t best = 0;
  PlanStats stats;
};

struct WorkerPing {
  std::string server_version;
  std::string model;
};

struct WorkerClientOptions {
  std::string endpoint = kDefaultWorkerEndpoint;
  std::chrono::milliseconds timeout{120000};  // a completion queues behind others and generates
  size_t max_request_bytes = size_t{1} << 20;
  size_t max_response_bytes = size_t{16} << 20;
  // Cluster mode (docs/cluster.md): a worker plans only for its own node's agents (it reads
  // their KV in its node's region) and answers `moved` for another node's, naming that node's
  // worker; the call is sent there (a plan changes no memory, so sending it again is always safe)
  // and the agent's worker remembered. A worker that gives no answer within `timeout` is
  // forgotten (and not asked again for kSilentFor, even where a `moved` answer names it), and the
  // call is sent again through `directory` or `endpoint` to the node that takes the agent over;
  // one answered "no owner yet" or "being taken over" is sent again shortly. Off: every answer,
  // `moved` included, is returned as it is.
  bool follow_moved = true;
  // Cluster mode, optional: where agents' workers are (cluster::EtcdDirectory::create_for_workers
  // reads etcd), asked before an agent's first call and after its worker stopped answering.
  // Empty: `endpoint` and `moved` answers.
  std::shared_ptr<OwnerDirectory> directory;
  // Cluster mode: once an agent's worker stopped answering or its shard is moving, how long its
  // call keeps being routed anew before the last answer is returned (the shard is taken over a
  // lease plus a round after a node died: 10 s and a quarter by default). A call to a dead worker
  // costs one `timeout` first, so a call takes at most timeout + failover_wait (+ one timeout
  // more if the next worker dies too).
  std::chrono::milliseconds failover_wait{15000};
};

class WorkerClient {
 public:
  static Result<std::unique_ptr<WorkerClient>> connect(WorkerClientOptions options);
  ~WorkerClient();
  WorkerClient(const WorkerClient&) = delete;
  WorkerClient& operator=(const WorkerClient&) = delete;

  Result<WorkerPing> ping();
  Result<CompleteReply> complete(const CompleteArgs& args);
  // Sends raw frame bytes and returns the raw answer (tests; no id matching).
  Result<std::string> call_raw(std::string_view payload);

  const WorkerClientOptions& options() const { return options_; }
  // `moved` answers this client received (each costs a round trip the directory would spare).
  uint64_t moved_answers() const { return moved_answers_; }
  // Calls sent again to another worker after theirs gave no answer, or after "no owner yet".
  uint64_t calls_resent() const { return calls_resent_; }

 private:
  explicit WorkerClient(WorkerClientOptions options);
  // The channel to `endpoint` (the configured one, or one opened for another node's worker).
  Result<wire::RpcChannel*> channel_to(const std::string& endpoint);
  // One complete call on `channel`.
  Result<CompleteReply> complete_on(wire::RpcChannel& channel, const CompleteArgs& args);

  WorkerClientOptions options_;
  std::unique_ptr<wire::RpcChannel> channel_;
  std::map<std::string, std::unique_ptr<wire::RpcChannel>> others_;  // endpoint -> channel
  AgentRoutes routes_;
  uint64_t moved_answers_ = 0;
  uint64_t calls_resent_ = 0;
};

}  // namespace keep::client
