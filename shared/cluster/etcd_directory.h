// EtcdDirectory: ManagerClient's OwnerDirectory read from etcd, as keep-manager's placement writes
// it (placement.h): the agent's shard by the same jump hash, `<prefix>/shards/<n>/owner` names
// the node, `<prefix>/nodes/<node>` its endpoint. The twin of keep_client.cluster.EtcdDirectory.
//
//   client::ClientOptions o;
//   o.directory = cluster::EtcdDirectory::create({"http://e1:2379"}, /*shards=*/64).value();
//
// create_for_workers() is WorkerClient's: the same owner, then `<prefix>/workers/<node>`, the
// node's keep-worker as its manager registered it (keep-manager --advertise-worker).
//
// Every lookup reads etcd (two gets); the client caches the answer per agent. Thread-safe: one
// directory may serve clients on several threads (their lookups take turns).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shared/client/owner_directory.h"
#include "shared/cluster/etcd_client.h"

namespace keep::cluster {

class EtcdDirectory : public client::OwnerDirectory {
 public:
  // `shards` and `prefix` must be the managers' --shards and etcd prefix.
  static Result<std::shared_ptr<EtcdDirectory>> create(
      std::vector<std::string> endpoints, uint32_t shards, std::string prefix = "/keep",
      std::chrono::milliseconds timeout = std::chrono::milliseconds(2000));
  // The same for workers: endpoint_of() names the owner's keep-worker (nullopt also when its
  // manager named none).
  static Result<std::shared_ptr<EtcdDirectory>> create_for_workers(
      std::vector<std::string> endpoints, uint32_t shards, std::string prefix = "/keep",
      std::chrono::milliseconds timeout = std::chrono::milliseconds(2000));

  Result<std::optional<std::string>> endpoint_of(std::string_view agent) override;

  uint32_t shards() const { return shards_; }

 private:
  EtcdDirectory(std::unique_ptr<EtcdClient> etcd, uint32_t shards, std::string prefix,
                std::string registry);

  std::mutex mu_;  // guards etcd_'s connection
  std::unique_ptr<EtcdClient> etcd_;
  uint32_t shards_;
  std::string prefix_;
  std::string registry_;  // "nodes" (managers) or "workers"
};

}  // namespace keep::cluster
