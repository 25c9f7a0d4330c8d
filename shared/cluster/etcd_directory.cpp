#include "shared/cluster/etcd_directory.h"

#include "shared/cluster/placement.h"

namespace keep::cluster {

namespace {

Result<std::unique_ptr<EtcdClient>> directory_client(std::vector<std::string> endpoints,
                                                     uint32_t shards,
                                                     std::chrono::milliseconds timeout) {
  if (endpoints.empty()) return Status(Code::kInvalidArgument, "etcd directory: no endpoints");
  if (shards == 0) return Status(Code::kInvalidArgument, "etcd directory: shards must be > 0");
  return EtcdClient::create({std::move(endpoints), timeout});
}

}  // namespace

Result<std::shared_ptr<EtcdDirectory>> EtcdDirectory::create(std::vector<std::string> endpoints,
                                                             uint32_t shards, std::string prefix,
                                                             std::chrono::milliseconds timeout) {
  KEEP_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> etcd,
                        directory_client(std::move(endpoints), shards, timeout));
  return std::shared_ptr<EtcdDirectory>(
      new EtcdDirectory(std::move(etcd), shards, std::move(prefix), "nodes"));
}

Result<std::shared_ptr<EtcdDirectory>> EtcdDirectory::create_for_workers(
    std::vector<std::string> endpoints, uint32_t shards, std::string prefix,
    std::chrono::milliseconds timeout) {
  KEEP_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> etcd,
                        directory_client(std::move(endpoints), shards, timeout));
  return std::shared_ptr<EtcdDirectory>(
      new EtcdDirectory(std::move(etcd), shards, std::move(prefix), "workers"));
}

EtcdDirectory::EtcdDirectory(std::unique_ptr<EtcdClient> etcd, uint32_t shards, std::string prefix,
                             std::string registry)
    : etcd_(std::move(etcd)),
      shards_(shards),
      prefix_(std::move(prefix)),
      registry_(std::move(registry)) {}

Result<std::optional<std::string>> EtcdDirectory::endpoint_of(std::string_view agent) {
  // One etcd connection: lookups are rare (an agent's first call, a failover), so clients on
  // several threads sharing a directory take turns.
  std::lock_guard<std::mutex> lock(mu_);
  // Placement reads the owner key and parses "<node> <epoch>"; the node name is not ours to use.
  Placement view(etcd_.get(), "directory", prefix_);
  KEEP_ASSIGN_OR_RETURN(std::optional<ShardOwner> owner, view.owner(shard_of(agent, shards_)));
  if (!owner) return std::optional<std::string>();
  KEEP_ASSIGN_OR_RETURN(std::optional<KeyValue> node,
                        etcd_->get(prefix_ + "/" + registry_ + "/" + owner->node));
  // The owner's lease ran out between the two reads: no owner now (or, for workers, its manager
  // named no worker).
  if (!node) return std::optional<std::string>();
  return std::optional<std::string>(node->value);
}

}  // namespace keep::cluster
