// How the clients route an agent's calls in cluster mode (docs/cluster.md, "Clients"): what a
// failed call says -- the node gave no answer, or the agent's shard is moving -- which endpoints
// were silent lately, and where an agent's call goes. ManagerClient and WorkerClient route by the
// same rules.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "shared/client/moved.h"
#include "shared/client/owner_directory.h"
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

// Where a client sends an agent's calls: the node remembered for it (followed `moved`, or named by
// the directory), else the directory's answer, else the configured endpoint -- never a node that
// gave no answer lately.
class AgentRoutes {
 public:
  AgentRoutes(std::string configured, std::shared_ptr<OwnerDirectory> directory)
      : configured_(std::move(configured)), directory_(std::move(directory)) {}

  // Where `agent`'s call goes first. An agent remembered on a node that just stopped answering
  // (for another agent's call) is routed anew, rather than costing a timeout of its own.
  std::string first(const std::string& agent) {
    if (auto known = owners_.find(agent);
        known != owners_.end() && !silent_.contains(known->second)) {
      return known->second;
    }
    owners_.erase(agent);
    return lookup(agent);
  }

  // Where to send `agent`'s call when no node is remembered for it: the directory's answer when
  // there is one and its node answers, else the configured endpoint. A directory that cannot be
  // read, or names no owner (or a silent one, whose lease has not run out yet), leaves the call
  // to the configured endpoint, which answers moved or "retry".
  std::string lookup(const std::string& agent) {
    if (directory_) {
      auto found = directory_->endpoint_of(agent);
      if (found.is_ok() && found->has_value() && !silent_.contains(**found)) {
        owners_[agent] = **found;
        return **found;
      }
    }
    return configured_;
  }

  // Where `agent`'s call goes after a `moved` answer naming `target`: there (remembered), or,
  // when `target` gave no answer lately -- the answering node still sees its lease until it runs
  // out -- wherever lookup says after a short wait.
  std::string after_moved(const std::string& agent, const std::string& target) {
    if (silent_.contains(target)) {
      owners_.erase(agent);
      std::this_thread::sleep_for(kRetryWait);
      return lookup(agent);
    }
    return owners_[agent] = target;
  }

  void forget(const std::string& agent) { owners_.erase(agent); }
  // `endpoint` gave no answer: not sent a call for kSilentFor.
  void mark_silent(const std::string& endpoint) { silent_.mark(endpoint); }
  bool silent(const std::string& endpoint) const { return silent_.contains(endpoint); }
  bool has_directory() const { return directory_ != nullptr; }

 private:
  std::string configured_;
  std::shared_ptr<OwnerDirectory> directory_;
  std::map<std::string, std::string> owners_;  // agent -> endpoint
  SilentEndpoints silent_;
};

}  // namespace keep::client
