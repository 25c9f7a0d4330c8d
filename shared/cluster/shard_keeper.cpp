#include "shared/cluster/shard_keeper.h"

#include <algorithm>

#include "shared/client/moved.h"
#include "shared/common/log.h"

namespace keep::cluster {

namespace {
constexpr char kLog[] = "cluster";
}  // namespace

ShardKeeper::ShardKeeper(std::unique_ptr<EtcdClient> etcd, std::string node, std::string endpoint,
                         ShardKeeperOptions options)
    : etcd_(std::move(etcd)),
      placement_(etcd_.get(), std::move(node), options.prefix),
      endpoint_(std::move(endpoint)),
      opt_(std::move(options)) {}

Result<std::unique_ptr<ShardKeeper>> ShardKeeper::start(EtcdOptions etcd, std::string node,
                                                        std::string endpoint,
                                                        ShardKeeperOptions options) {
  if (options.shards == 0) return Status(Code::kInvalidArgument, "cluster: 0 shards");
  KEEP_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> client, EtcdClient::create(std::move(etcd)));
  std::unique_ptr<ShardKeeper> k(
      new ShardKeeper(std::move(client), std::move(node), std::move(endpoint), std::move(options)));
  KEEP_RETURN_IF_ERROR(
      k->placement_.join(k->endpoint_, k->opt_.lease_ttl_s, k->opt_.worker_endpoint));
  KEEP_RETURN_IF_ERROR(k->tick());
  k->thread_ = std::thread([p = k.get()] { p->run(); });
  return k;
}

ShardKeeper::~ShardKeeper() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  (void)placement_.leave();
}

void ShardKeeper::run() {
  std::unique_lock<std::mutex> lock(stop_mu_);
  for (;;) {
    stop_cv_.wait_for(lock, opt_.period, [this] { return stop_ || wake_; });
    if (stop_) break;
    wake_ = false;
    lock.unlock();
    if (Status st = tick(); !st.is_ok()) {
      KEEP_LOG_WARN(kLog, "placement round: %s", st.to_string().c_str());
    }
    lock.lock();
  }
}

Status ShardKeeper::tick() {
  std::vector<std::pair<uint32_t, uint64_t>> give_up;
  {
    std::lock_guard<std::mutex> lock(mu_);
    give_up.swap(give_up_);
  }
  for (const auto& [shard, epoch] : give_up) {
    if (Status st = placement_.release(shard, epoch); !st.is_ok()) {
      KEEP_LOG_WARN(kLog, "giving up shard %u (epoch %llu): %s", shard,
                    static_cast<unsigned long long>(epoch), st.to_string().c_str());
    } else {
      KEEP_LOG_INFO(kLog, "shard %u given up at epoch %llu", shard,
                    static_cast<unsigned long long>(epoch));
    }
  }
  if (placement_.lease() == 0) {  // the lease ran out: join again
    KEEP_RETURN_IF_ERROR(placement_.join(endpoint_, opt_.lease_ttl_s, opt_.worker_endpoint));
  }
  // etcd counts the TTL from when it handles the renewal, after it was sent: a deadline counted
  // from the send ends first.
  const Clock::time_point sent = Clock::now();
  if (Status st = placement_.renew(); !st.is_ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (st.code() == Code::kNotFound) {
      // Another node may own our shards now: forget them; the next round joins again and takes
      // only shards nobody owns.
      const size_t dropped =
          std::erase_if(owners_, [&](const auto& e) { return e.second.node == placement_.node(); });
      if (dropped > 0) KEEP_LOG_WARN(kLog, "lease ran out: %zu shards dropped", dropped);
    } else if (!within_lease_locked() && !lapsed_) {
      lapsed_ = true;
      KEEP_LOG_WARN(kLog,
                    "no renewal of the lease for %lld ms (%s): not serving any shard until etcd "
                    "answers",
                    static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                               Clock::now() - renewed_at_)
                                               .count()),
                    st.to_string().c_str());
    }
    return st;
  }
  {
    // The lease was alive when etcd handled the renewal: nobody else could take our shards
    // meanwhile, so the ones we hold are still ours at the same epochs.
    std::lock_guard<std::mutex> lock(mu_);
    renewed_at_ = sent;
    serve_until_ = sent + std::chrono::seconds(opt_.lease_ttl_s) - margin();
    if (lapsed_) {
      lapsed_ = false;
      KEEP_LOG_INFO(kLog, "lease renewed again: serving this node's shards again");
    }
  }
  KEEP_ASSIGN_OR_RETURN(auto nodes, placement_.nodes());
  std::map<std::string, std::string> endpoints(nodes.begin(), nodes.end());
  KEEP_ASSIGN_OR_RETURN(auto worker_list, placement_.workers());
  std::map<std::string, std::string> workers(worker_list.begin(), worker_list.end());
  KEEP_ASSIGN_OR_RETURN(auto owners, placement_.owners());
  // What this node still holds, as etcd says.
  std::map<uint32_t, uint64_t> owned;
  for (const auto& [s, o] : owners) {
    if (o.node == placement_.node()) owned[s] = o.epoch;
  }
  const size_t live = std::max<size_t>(endpoints.size(), 1);
  const size_t share = (opt_.shards + live - 1) / live;
  for (uint32_t s = 0; s < opt_.shards && owned.size() < share; ++s) {
    if (owners.count(s)) continue;
    KEEP_ASSIGN_OR_RETURN(std::optional<uint64_t> epoch, placement_.acquire(s));
    if (epoch) {
      owned[s] = *epoch;
      owners[s] = ShardOwner{placement_.node(), *epoch};
    }
  }
  if (owned.size() > share) {  // a node joined: hand one back a round
    const auto last = std::prev(owned.end());
    KEEP_RETURN_IF_ERROR(placement_.release(last->first, last->second));
    owners.erase(last->first);
    owned.erase(last);
  }
  std::lock_guard<std::mutex> lock(mu_);
  owners_ = std::move(owners);
  endpoints_ = std::move(endpoints);
  workers_ = std::move(workers);
  return Status::ok();
}

std::chrono::milliseconds ShardKeeper::margin() const {
  return opt_.lease_margin.count() > 0 ? opt_.lease_margin
                                       : std::chrono::milliseconds(opt_.lease_ttl_s * 100);
}

bool ShardKeeper::within_lease() const {
  std::lock_guard<std::mutex> lock(mu_);
  return within_lease_locked();
}

Status ShardKeeper::route(std::string_view agent) const {
  const uint32_t s = shard_of(agent, opt_.shards);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = owners_.find(s);
  if (it != owners_.end() && it->second.node == placement_.node()) {
    if (within_lease_locked()) return Status::ok();
    // Clients route such an answer anew ("lease may have run out"): nothing was applied.
    return Status(Code::kUnavailable,
                  "agent '" + std::string(agent) + "' (shard " + std::to_string(s) +
                      ") is not served here: this node's lease may have run out (etcd has not "
                      "renewed it in time), another node takes the shard once it has: retry");
  }
  if (it == owners_.end()) {
    return Status(Code::kUnavailable, "agent '" + std::string(agent) + "' (shard " +
                                          std::to_string(s) + ") has no owner yet: retry");
  }
  auto ep = endpoints_.find(it->second.node);
  auto w = workers_.find(it->second.node);
  return Status(
      Code::kMoved,
      client::moved_message(agent, s, it->second.node, ep == endpoints_.end() ? "?" : ep->second,
                            w == workers_.end() ? std::string() : w->second));
}

uint64_t ShardKeeper::epoch_of(uint32_t shard) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!within_lease_locked()) return 0;
  auto it = owners_.find(shard);
  return it != owners_.end() && it->second.node == placement_.node() ? it->second.epoch : 0;
}

std::map<uint32_t, uint64_t> ShardKeeper::owned_shards() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<uint32_t, uint64_t> out;
  if (!within_lease_locked()) return out;
  for (const auto& [s, o] : owners_) {
    if (o.node == placement_.node()) out[s] = o.epoch;
  }
  return out;
}

void ShardKeeper::give_up(uint32_t shard, uint64_t epoch) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = owners_.find(shard);
    if (it == owners_.end() || it->second.node != placement_.node() || it->second.epoch != epoch) {
      return;  // not ours at that epoch any more
    }
    owners_.erase(it);
    give_up_.emplace_back(shard, epoch);
  }
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    wake_ = true;
  }
  stop_cv_.notify_all();
}

size_t ShardKeeper::owned() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!within_lease_locked()) return 0;
  return static_cast<size_t>(std::count_if(owners_.begin(), owners_.end(), [&](const auto& e) {
    return e.second.node == placement_.node();
  }));
}

}  // namespace keep::cluster
