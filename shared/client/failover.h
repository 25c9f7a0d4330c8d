// What the clients read from a failed call in cluster mode (docs/cluster.md, "Clients"): whether
// the node gave no answer, or answered that the agent's shard is moving, and which endpoints were
// silent lately. ManagerClient and WorkerClient route by the same rules.
#pragma once

#include <chrono>
#include <map>
#include <string>

#include "shared/common/status.h"

namespace keep::client {

// Between two tries of a call whose shard is between owners.
inline constexpr auto kRetryWait = std::chrono::milliseconds(250);
// An endpoint that gave no answer is not sent an agent's call again for this long, even when a
// `moved` answer names it: the node answering still sees the silent node's lease until it runs out
// (10 s by default), and each call to a dead node costs a whole timeout.
inline constexpr auto kSilentFor = std::chrono::seconds(5);

// No answer at all (RpcChannel's kTimeout, or ZeroMQ failing): the request may have been applied.
inline bool transport_failure(const Status& st) {
  return st.code() == Code::kTimeout ||
         (st.code() == Code::kUnavailable && st.message().rfind("zmq: ", 0) == 0);
}

// Answers that say nothing was applied and the same node serves the agent shortly: a shard
// between owners ("no owner yet") or replayed by its new owner ("being taken over"; also a fenced
// node's refusal, after which it gives the shard up and answers `moved`). A keep-worker passes
// its manager's answer on, so planners read the same words.
inline bool retry_here(const Status& st) {
  return st.code() == Code::kUnavailable &&
         (st.message().find("no owner yet") != std::string::npos ||
          st.message().find("being taken over") != std::string::npos);
}

// A node's answer that it no longer serves the agent because its lease may have run out (it lost
// touch with etcd; nothing was applied): another node takes the shard once etcd frees it, so the
// call is routed anew -- through the directory or the configured endpoint -- until then.
inline bool lease_lapsed(const Status& st) {
  return st.code() == Code::kUnavailable &&
         st.message().find("lease may have run out") != std::string::npos;
}

// Endpoints that gave no answer lately (kSilentFor).
class SilentEndpoints {
 public:
  void mark(const std::string& endpoint) { at_[endpoint] = std::chrono::steady_clock::now(); }
  bool contains(const std::string& endpoint) const {
    auto it = at_.find(endpoint);
    return it != at_.end() && std::chrono::steady_clock::now() - it->second < kSilentFor;
  }

 private:
  std::map<std::string, std::chrono::steady_clock::time_point> at_;
};

}  // namespace keep::client
