// Placement on etcd (issue 31, point 1): which node serves which agent.
//
//   agent --(jump consistent hash)--> shard (a fixed count, e.g. 64) --(etcd)--> owner node, epoch
//
// Keys under a prefix (default "/keep"):
//   <prefix>/nodes/<node>          the node's endpoint, on the node's lease (gone when it dies)
//   <prefix>/workers/<node>        the endpoint of the node's keep-worker, for planners, on the
//                                  same lease (absent when the node does not name one)
//   <prefix>/shards/<n>/owner      "<node> <epoch>", on the owner's lease
//   <prefix>/shards/<n>/epoch      the last epoch handed out for shard n (no lease: it only grows)
// A node takes a free shard in one transaction that checks the owner key is absent and the epoch
// key unchanged since it was read, then writes epoch + 1 and the owner. When the owner's lease
// runs out (it stopped renewing: dead, or cut off from etcd) the owner key goes, another node takes
// the shard with a larger epoch, and every durable write the old owner still sends carries a
// smaller epoch: the store of record refuses it (etcd's own locks alone do not guarantee
// exclusion: a paused owner can wake up believing it still holds the lock).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/cluster/etcd_client.h"

namespace keep::cluster {

// Jump consistent hash (Lamping & Veach) of FNV-1a(agent): a shard in [0, shards); going from N
// to N + 1 shards moves about 1/(N + 1) of the agents, all of them to the new shard.
uint32_t shard_of(std::string_view agent, uint32_t shards);

struct ShardOwner {
  std::string node;
  uint64_t epoch = 0;
};

class Placement {
 public:
  // `etcd` must outlive the placement; `node` names this node (no spaces or '/').
  Placement(EtcdClient* etcd, std::string node, std::string prefix = "/keep");

  // Registers the node with a lease of `ttl_seconds` (its endpoint as the value), and its
  // worker's endpoint when `worker_endpoint` is not empty.
  Status join(const std::string& endpoint, int64_t ttl_seconds,
              const std::string& worker_endpoint = {});
  // Renews the lease: call well within the TTL. kNotFound: the lease ran out -- this node owns
  // nothing any more and must stop serving its agents (join again to come back).
  Status renew();
  // Revokes the lease: the node's key and every shard it owns go at once.
  Status leave();

  // Takes `shard` if nobody owns it: the new epoch, or nullopt when another node owns it (or
  // took it first). Needs join().
  Result<std::optional<uint64_t>> acquire(uint32_t shard);
  // Gives up `shard` if this node still owns it at `epoch`.
  Status release(uint32_t shard, uint64_t epoch);
  // True while this node owns `shard` at `epoch` (as etcd says now).
  Result<bool> holds(uint32_t shard, uint64_t epoch);

  Result<std::optional<ShardOwner>> owner(uint32_t shard);
  // Every owned shard's owner, in one read.
  Result<std::map<uint32_t, ShardOwner>> owners();
  // Live nodes: name -> endpoint.
  Result<std::vector<std::pair<std::string, std::string>>> nodes();
  // Live nodes that named their worker: name -> the worker's endpoint.
  Result<std::vector<std::pair<std::string, std::string>>> workers();

  const std::string& node() const { return node_; }
  int64_t lease() const { return lease_; }

 private:
  std::string shard_key(uint32_t shard, const char* what) const;
  // Every key under `dir` (a prefix ending in '/'): the rest of its name -> its value.
  Result<std::vector<std::pair<std::string, std::string>>> names_under(const std::string& dir);

  EtcdClient* etcd_;
  std::string node_;
  std::string prefix_;
  int64_t lease_ = 0;
};

}  // namespace keep::cluster
