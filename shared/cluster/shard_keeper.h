// ShardKeeper: one node's side of placement (issue 31, points 1 and 4), kept by a thread. It joins
// (the node's key on a lease), renews the lease every period, takes free shards up to its fair
// share (ceil(shards / live nodes)), hands back one shard a period while it holds more than that
// (so a node that joins gets work), and keeps a copy of every shard's owner for routing:
// route(agent) is ok when this node owns the agent's shard, else kMoved naming the owner and its
// endpoint (kUnavailable while the shard has no owner). A lease that ran out (this node was cut
// off or paused) drops every shard at once and joins again. give_up() hands one shard back at
// once (its owner learnt from the store of record that it was fenced, or cannot tell whether its
// last write landed): taken again, by this node or another, it comes with a larger epoch.
//
// The local lease deadline. etcd frees a silent node's shards when its lease runs out, whether or
// not the node hears of it: a node cut off from etcd cannot learn it lost them. So the node keeps
// its own deadline: the send time of its last renewal that etcd acknowledged, plus the lease's
// TTL, less a margin (etcd counts the TTL from when it handles the renewal, which is later).
// Past it, this node serves none of its shards -- route() answers kUnavailable ("... lease may
// have run out ..."), epoch_of() 0, owned_shards() nothing -- so it has stopped before etcd can
// give them to another node. A renewal that succeeds again (the lease never ran out, so nobody
// took the shards) serves them again; one that finds the lease gone drops them, joins anew and
// takes only shards that nobody owns, at new epochs.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "shared/cluster/placement.h"

namespace keep::cluster {

struct ShardKeeperOptions {
  uint32_t shards = 64;
  int64_t lease_ttl_s = 10;
  std::chrono::milliseconds period{1000};  // renew, rebalance, refresh owners
  // How long before the lease's end (counted from a renewal's send time) this node stops
  // serving: clocks that run at slightly different rates, a request answered as the deadline
  // passes. 0: a tenth of the lease.
  std::chrono::milliseconds lease_margin{0};
  std::string prefix = "/keep";
  // This node's keep-worker as planners reach it (empty: none known): registered beside the
  // node, and named in `moved` answers for the node's agents, so that another node's worker can
  // send a planner there (docs/cluster.md).
  std::string worker_endpoint;
};

class ShardKeeper {
 public:
  // Joins and takes a first share before returning (kUnavailable: etcd does not answer).
  static Result<std::unique_ptr<ShardKeeper>> start(EtcdOptions etcd, std::string node,
                                                    std::string endpoint,
                                                    ShardKeeperOptions options = {});
  ~ShardKeeper();  // stops the thread and leaves: the node's shards free at once

  Status route(std::string_view agent) const;
  // The epoch this node holds `shard` at (0: not its own, or past the lease deadline).
  uint64_t epoch_of(uint32_t shard) const;
  // Every shard this node serves: shard -> epoch (none past the lease deadline).
  std::map<uint32_t, uint64_t> owned_shards() const;
  size_t owned() const;
  // Whether the lease deadline (see the top) is still ahead.
  bool within_lease() const;
  // Stops serving `shard` now if this node holds it at `epoch` (route() answers "no owner yet"
  // for it) and releases it in etcd at the next round, which runs at once; that round may take
  // it again, at a new epoch.
  void give_up(uint32_t shard, uint64_t epoch);
  const ShardKeeperOptions& options() const { return opt_; }

  // One round now (tests; the thread runs it every period).
  Status tick();

 private:
  using Clock = std::chrono::steady_clock;

  ShardKeeper(std::unique_ptr<EtcdClient> etcd, std::string node, std::string endpoint,
              ShardKeeperOptions options);
  void run();
  bool within_lease_locked() const { return Clock::now() < serve_until_; }
  std::chrono::milliseconds margin() const;  // opt_.lease_margin, or its default

  std::unique_ptr<EtcdClient> etcd_;
  Placement placement_;
  std::string endpoint_;
  ShardKeeperOptions opt_;

  mutable std::mutex mu_;
  std::map<uint32_t, ShardOwner> owners_;         // every owned shard as last read, ours among them
  std::map<std::string, std::string> endpoints_;  // node -> endpoint
  std::map<std::string, std::string> workers_;    // node -> its worker's endpoint (if known)
  Clock::time_point renewed_at_{};                // the send time of the last renewal
  Clock::time_point serve_until_{};               // the lease deadline (see the top)
  bool lapsed_ = false;                           // past it at the last round (logged once)
  std::vector<std::pair<uint32_t, uint64_t>> give_up_;  // shard, epoch: release at the next round

  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  bool wake_ = false;  // a round now (give_up)
  std::thread thread_;
};

}  // namespace keep::cluster
