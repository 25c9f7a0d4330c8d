// EtcdClient: the few etcd v3 calls cluster mode needs (issue 31: placement on etcd), over etcd's
// JSON gateway (POST /v3/...; keys and values base64, 64-bit integers as strings) with libcurl.
// Blocking, one call at a time per client (callers own their client). A call tries the member
// that answered last, then the others in order: a cluster that lost a member (of three) goes on
// answering. kUnavailable when no member answers; kInvalidArgument / kInternal for answers etcd
// itself refuses or that do not parse.
//
// No watch here: owners renew leases and readers re-read (placement.h), which is enough for
// routing with a `moved` answer as the fallback.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shared/common/status.h"

namespace keep::cluster {

struct EtcdOptions {
  std::vector<std::string> endpoints;       // "http://127.0.0.1:2379", ...
  std::chrono::milliseconds timeout{2000};  // per member and call
};

struct KeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t version = 0;
  int64_t lease = 0;
};

// One comparison of a transaction (etcd's Compare with result EQUAL).
struct Compare {
  enum class Target { kCreateRevision, kModRevision, kValue };
  std::string key;
  Target target = Target::kCreateRevision;
  int64_t revision = 0;  // kCreateRevision (0: the key does not exist) / kModRevision
  std::string value;     // kValue
};

// One operation of a transaction's success branch.
struct TxnOp {
  enum class Kind { kPut, kDelete };
  Kind kind = Kind::kPut;
  std::string key;
  std::string value;
  int64_t lease = 0;  // kPut: attach to this lease (0: none)
};

struct TxnResult {
  bool succeeded = false;
  int64_t revision = 0;  // the store's revision after the transaction
};

class EtcdClient {
 public:
  static Result<std::unique_ptr<EtcdClient>> create(EtcdOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // A lease of `ttl_seconds`; its id.
  Result<int64_t> grant_lease(int64_t ttl_seconds);
  // Renews the lease once; its remaining TTL. kNotFound: the lease expired or was revoked.
  Result<int64_t> keep_alive(int64_t lease);
  Status revoke(int64_t lease);

  Status put(const std::string& key, const std::string& value, int64_t lease = 0);
  Result<std::optional<KeyValue>> get(const std::string& key);
  Result<std::vector<KeyValue>> get_prefix(const std::string& prefix);
  Status del(const std::string& key);
  // If every comparison holds, applies `ops` atomically.
  Result<TxnResult> txn(const std::vector<Compare>& compares, const std::vector<TxnOp>& ops);

  // The member that answered last (tests kill others).
  const std::string& current_endpoint() const;

 private:
  struct Impl;
  explicit EtcdClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Standard base64 (RFC 4648, padded), as etcd's gateway writes bytes.
std::string base64_encode(const std::string& bytes);
Result<std::string> base64_decode(const std::string& text);

}  // namespace keep::cluster
