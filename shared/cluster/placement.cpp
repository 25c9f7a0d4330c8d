#include "shared/cluster/placement.h"

#include <charconv>

namespace keep::cluster {

uint32_t shard_of(std::string_view agent, uint32_t shards) {
  if (shards == 0) return 0;
  uint64_t key = 1469598103934665603ull;  // FNV-1a 64
  for (unsigned char c : agent) {
    key ^= c;
    key *= 1099511628211ull;
  }
  int64_t b = -1, j = 0;
  while (j < static_cast<int64_t>(shards)) {
    b = j;
    key = key * 2862933555777941757ull + 1;
    j = static_cast<int64_t>(static_cast<double>(b + 1) * (static_cast<double>(1ll << 31) /
                                                           static_cast<double>((key >> 33) + 1)));
  }
  return static_cast<uint32_t>(b);
}

namespace {

std::optional<ShardOwner> parse_owner(const std::string& v) {
  const size_t sp = v.rfind(' ');
  if (sp == std::string::npos || sp == 0) return std::nullopt;
  ShardOwner o;
  o.node = v.substr(0, sp);
  const char* first = v.data() + sp + 1;
  const char* last = v.data() + v.size();
  auto [p, ec] = std::from_chars(first, last, o.epoch);
  if (ec != std::errc() || p != last) return std::nullopt;
  return o;
}

std::string owner_value(const std::string& node, uint64_t epoch) {
  return node + " " + std::to_string(epoch);
}

}  // namespace

Placement::Placement(EtcdClient* etcd, std::string node, std::string prefix)
    : etcd_(etcd), node_(std::move(node)), prefix_(std::move(prefix)) {}

std::string Placement::shard_key(uint32_t shard, const char* what) const {
  return prefix_ + "/shards/" + std::to_string(shard) + "/" + what;
}

Status Placement::join(const std::string& endpoint, int64_t ttl_seconds,
                       const std::string& worker_endpoint) {
  if (node_.empty() || node_.find_first_of(" /") != std::string::npos) {
    return Status(Code::kInvalidArgument,
                  "placement: node name '" + node_ + "' is empty or holds a space or '/'");
  }
  KEEP_ASSIGN_OR_RETURN(lease_, etcd_->grant_lease(ttl_seconds));
  if (!worker_endpoint.empty()) {
    KEEP_RETURN_IF_ERROR(etcd_->put(prefix_ + "/workers/" + node_, worker_endpoint, lease_));
  }
  return etcd_->put(prefix_ + "/nodes/" + node_, endpoint, lease_);
}

Status Placement::renew() {
  if (lease_ == 0) return Status(Code::kUnavailable, "placement: not joined");
  auto ttl = etcd_->keep_alive(lease_);
  if (!ttl.is_ok() && ttl.status().code() == Code::kNotFound) lease_ = 0;
  return ttl.status();
}

Status Placement::leave() {
  if (lease_ == 0) return Status::ok();
  const int64_t lease = lease_;
  lease_ = 0;
  return etcd_->revoke(lease);
}

Result<std::optional<uint64_t>> Placement::acquire(uint32_t shard) {
  if (lease_ == 0) return Status(Code::kUnavailable, "placement: not joined");
  const std::string owner_key = shard_key(shard, "owner");
  const std::string epoch_key = shard_key(shard, "epoch");
  KEEP_ASSIGN_OR_RETURN(std::optional<KeyValue> epoch, etcd_->get(epoch_key));
  uint64_t last = 0;
  if (epoch) {
    auto [p, ec] =
        std::from_chars(epoch->value.data(), epoch->value.data() + epoch->value.size(), last);
    if (ec != std::errc()) {
      return Status(Code::kInternal, "placement: " + epoch_key + " holds '" + epoch->value + "'");
    }
  }
  const uint64_t next = last + 1;
  std::vector<Compare> cmp = {{owner_key, Compare::Target::kCreateRevision, 0, {}}};
  cmp.push_back(epoch ? Compare{epoch_key, Compare::Target::kModRevision, epoch->mod_revision, {}}
                      : Compare{epoch_key, Compare::Target::kCreateRevision, 0, {}});
  KEEP_ASSIGN_OR_RETURN(
      TxnResult r,
      etcd_->txn(cmp, {{TxnOp::Kind::kPut, epoch_key, std::to_string(next), 0},
                       {TxnOp::Kind::kPut, owner_key, owner_value(node_, next), lease_}}));
  if (!r.succeeded) return std::optional<uint64_t>();
  return std::optional<uint64_t>(next);
}

Status Placement::release(uint32_t shard, uint64_t epoch) {
  const std::string owner_key = shard_key(shard, "owner");
  return etcd_
      ->txn({{owner_key, Compare::Target::kValue, 0, owner_value(node_, epoch)}},
            {{TxnOp::Kind::kDelete, owner_key, {}, 0}})
      .status();
}

Result<bool> Placement::holds(uint32_t shard, uint64_t epoch) {
  KEEP_ASSIGN_OR_RETURN(std::optional<ShardOwner> o, owner(shard));
  return o.has_value() && o->node == node_ && o->epoch == epoch;
}

Result<std::optional<ShardOwner>> Placement::owner(uint32_t shard) {
  KEEP_ASSIGN_OR_RETURN(std::optional<KeyValue> kv, etcd_->get(shard_key(shard, "owner")));
  if (!kv) return std::optional<ShardOwner>();
  std::optional<ShardOwner> o = parse_owner(kv->value);
  if (!o)
    return Status(Code::kInternal,
                  "placement: shard " + std::to_string(shard) + " owner holds '" + kv->value + "'");
  return o;
}

Result<std::map<uint32_t, ShardOwner>> Placement::owners() {
  const std::string dir = prefix_ + "/shards/";
  KEEP_ASSIGN_OR_RETURN(std::vector<KeyValue> kvs, etcd_->get_prefix(dir));
  std::map<uint32_t, ShardOwner> out;
  for (const KeyValue& kv : kvs) {
    // <dir><n>/owner
    const std::string rest = kv.key.substr(dir.size());
    const size_t slash = rest.find('/');
    if (slash == std::string::npos || rest.substr(slash + 1) != "owner") continue;
    uint32_t shard = 0;
    auto [p, ec] = std::from_chars(rest.data(), rest.data() + slash, shard);
    std::optional<ShardOwner> o = parse_owner(kv.value);
    if (ec != std::errc() || p != rest.data() + slash || !o) {
      return Status(Code::kInternal, "placement: " + kv.key + " holds '" + kv.value + "'");
    }
    out[shard] = *o;
  }
  return out;
}

Result<std::vector<std::pair<std::string, std::string>>> Placement::nodes() {
  return names_under(prefix_ + "/nodes/");
}

Result<std::vector<std::pair<std::string, std::string>>> Placement::workers() {
  return names_under(prefix_ + "/workers/");
}

Result<std::vector<std::pair<std::string, std::string>>> Placement::names_under(
    const std::string& dir) {
  KEEP_ASSIGN_OR_RETURN(std::vector<KeyValue> kvs, etcd_->get_prefix(dir));
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& kv : kvs) out.emplace_back(kv.key.substr(dir.size()), std::move(kv.value));
  return out;
}

}  // namespace keep::cluster
