// OwnerDirectory: where cluster mode serves an agent (docs/cluster.md), asked by ManagerClient
// before it sends an agent's first call, and again after that agent's node stopped answering.
//
// An interface so that keep_client does not link etcd's client (libcurl) into every program that
// talks to a manager; shared/cluster/etcd_directory.h reads the owners from etcd.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "shared/common/status.h"

namespace keep::client {

class OwnerDirectory {
 public:
  virtual ~OwnerDirectory() = default;
  // The endpoint of the node serving `agent` now; nullopt while its shard has no owner; an error
  // when the directory cannot be read (the client then asks its configured endpoint).
  virtual Result<std::optional<std::string>> endpoint_of(std::string_view agent) = 0;
};

}  // namespace keep::client
