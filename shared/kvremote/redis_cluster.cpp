#include "shared/kvremote/redis_cluster.h"

#include <hiredis/hiredis.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <map>

#include "shared/common/log.h"

namespace keep::kvremote {

namespace {

constexpr const char* kLog = "kvremote";
using Clock = std::chrono::steady_clock;

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;
struct ContextDeleter {
  void operator()(redisContext* c) const { redisFree(c); }
};
using Context = std::unique_ptr<redisContext, ContextDeleter>;

timeval to_timeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

// "host:port" -> host, port; false when malformed.
bool split_address(std::string_view a, std::string* host, int* port) {
  const size_t colon = a.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == a.size()) return false;
  int p = 0;
  const auto* first = a.data() + colon + 1;
  const auto* last = a.data() + a.size();
  auto [ptr, ec] = std::from_chars(first, last, p);
  if (ec != std::errc() || ptr != last || p <= 0 || p > 65535) return false;
  *host = std::string(a.substr(0, colon));
  *port = p;
  return true;
}

std::string reply_text(const redisReply* r) { return std::string(r->str, r->len); }

// "MOVED 3999 127.0.0.1:6381" / "ASK 3999 127.0.0.1:6381": the address; empty otherwise.
std::string redirect_target(std::string_view error, std::string_view kind) {
  if (error.substr(0, kind.size()) != kind || error.size() <= kind.size() ||
      error[kind.size()] != ' ') {
    return {};
  }
  const size_t space = error.rfind(' ');
  if (space == std::string_view::npos || space <= kind.size()) return {};
  return std::string(error.substr(space + 1));
}

}  // namespace

uint16_t crc16(std::string_view bytes) {
  uint16_t crc = 0;
  for (unsigned char b : bytes) {
    crc = static_cast<uint16_t>(crc ^ (static_cast<uint16_t>(b) << 8));
    for (int i = 0; i < 8; ++i) {
      crc = (crc & 0x8000) != 0 ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                                : static_cast<uint16_t>(crc << 1);
    }
  }
  return crc;
}

uint16_t key_slot(std::string_view key) {
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  return static_cast<uint16_t>(crc16(key) % kClusterSlots);
}

Result<std::vector<std::string>> parse_redis_url(std::string_view url) {
  constexpr std::string_view kScheme = "redis://";
  if (url.substr(0, kScheme.size()) == kScheme) url.remove_prefix(kScheme.size());
  std::vector<std::string> seeds;
  while (!url.empty()) {
    const size_t comma = url.find(',');
    const std::string_view part = url.substr(0, comma);
    std::string host;
    int port = 0;
    if (!split_address(part, &host, &port)) {
      return Status(Code::kInvalidArgument,
                    "redis address '" + std::string(part) + "': expected host:port");
    }
    seeds.emplace_back(part);
    if (comma == std::string_view::npos) break;
    url.remove_prefix(comma + 1);
  }
  if (seeds.empty()) return Status(Code::kInvalidArgument, "redis url: no host:port given");
  return seeds;
}

struct RedisCluster::Impl {
  RedisClusterOptions options;
  std::vector<std::string> nodes;              // every address seen (seeds first)
  std::array<int32_t, kClusterSlots> slots{};  // index into nodes; -1: unknown
  bool slots_known = false;
  std::map<std::string, Context> connections;  // by address
  std::map<std::string, Clock::time_point> down_until;

  int32_t node_index(const std::string& address) {
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i] == address) return static_cast<int32_t>(i);
    }
    nodes.push_back(address);
    return static_cast<int32_t>(nodes.size() - 1);
  }

  bool resting(const std::string& address) const {
    auto it = down_until.find(address);
    return it != down_until.end() && Clock::now() < it->second;
  }

  void mark_down(const std::string& address, const std::string& why) {
    connections.erase(address);
    const bool was_resting = resting(address);
    down_until[address] = Clock::now() + options.backoff;
    if (!was_resting) {
      KEEP_LOG_WARN(kLog, "redis %s: %s (left alone for %lld ms)", address.c_str(), why.c_str(),
                    static_cast<long long>(options.backoff.count()));
    }
  }

  // The connection to `address`, made when needed; null (and the node left alone) on failure.
  redisContext* connection(const std::string& address, Status* error) {
    auto it = connections.find(address);
    if (it != connections.end()) return it->second.get();
    if (resting(address)) {
      *error = Status(Code::kUnavailable, "redis " + address + " failed recently");
      return nullptr;
    }
    std::string host;
    int port = 0;
    if (!split_address(address, &host, &port)) {
      *error = Status(Code::kInternal, "redis address '" + address + "' is malformed");
      return nullptr;
    }
    Context c(redisConnectWithTimeout(host.c_str(), port, to_timeval(options.connect_timeout)));
    if (!c || c->err != 0) {
      const std::string why = c ? std::string(c->errstr) : std::string("out of memory");
      mark_down(address, "connect: " + why);
      *error = Status(Code::kUnavailable, "redis " + address + ": connect: " + why);
      return nullptr;
    }
    if (redisSetTimeout(c.get(), to_timeval(options.op_timeout)) != REDIS_OK) {
      mark_down(address, "setting the timeout failed");
      *error = Status(Code::kUnavailable, "redis " + address + ": setting the timeout failed");
      return nullptr;
    }
    if (!options.password.empty()) {
      std::vector<const char*> argv = {"AUTH"};
      std::vector<size_t> lens = {4};
      if (!options.user.empty()) {
        argv.push_back(options.user.data());
        lens.push_back(options.user.size());
      }
      argv.push_back(options.password.data());
      lens.push_back(options.password.size());
      Reply r(static_cast<redisReply*>(
          redisCommandArgv(c.get(), static_cast<int>(argv.size()), argv.data(), lens.data())));
      if (!r || r->type == REDIS_REPLY_ERROR) {
        // WRONGPASS, or AUTH sent to a server without a password: a configuration error the
        // node keeps answering, so the same rest as a node that is down (and the entries are
        // computed meanwhile).
        const std::string why =
            !r ? (c->errstr[0] != 0 ? std::string(c->errstr) : "no reply") : reply_text(&*r);
        mark_down(address, "AUTH: " + why);
        *error = Status(Code::kUnavailable, "redis " + address + ": AUTH: " + why);
        return nullptr;
      }
    }
    redisContext* raw = c.get();
    connections[address] = std::move(c);
    return raw;
  }

  // One command on `address`; a transport failure drops the connection and rests the node.
  Result<Reply> call(const std::string& address, const std::vector<std::string_view>& args) {
    Status error = Status::ok();
    redisContext* c = connection(address, &error);
    if (c == nullptr) return error;
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (auto a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    Reply r(static_cast<redisReply*>(
        redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data())));
    if (!r) {
      const bool timeout = c->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK);
      const std::string why = c->errstr[0] != 0 ? std::string(c->errstr) : "no reply";
      mark_down(address, why);
      return Status(timeout ? Code::kTimeout : Code::kUnavailable, "redis " + address + ": " + why);
    }
    return r;
  }

  // The slot map from the seeds or any master seen: the first that answers.
  Status refresh() {
    Status last = Status(Code::kUnavailable, "redis: no node to ask for the slot map");
    const std::vector<std::string> known = nodes;  // read_slots_from() may add to nodes
    for (const auto& n : known) {
      last = read_slots_from(n);
      if (last.is_ok()) return last;
    }
    return last;
  }

  // One keyed command, following MOVED and ASK.
  Result<Reply> keyed(uint64_t* redirects, std::string_view key,
                      const std::vector<std::string_view>& args);

  Status read_slots_from(const std::string& address) {
    KEEP_ASSIGN_OR_RETURN(Reply r, call(address, {"CLUSTER", "SLOTS"}));
    if (r->type == REDIS_REPLY_ERROR) {
      return Status(Code::kUnavailable, "redis " + address + ": CLUSTER SLOTS: " + reply_text(&*r));
    }
    if (r->type != REDIS_REPLY_ARRAY) {
      return Status(Code::kInternal, "redis " + address + ": CLUSTER SLOTS: not an array");
    }
    std::array<int32_t, kClusterSlots> map;
    map.fill(-1);
    std::string host;
    int port = 0;
    split_address(address, &host, &port);
    for (size_t i = 0; i < r->elements; ++i) {
      const redisReply* range = r->element[i];
      if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 ||
          range->element[0]->type != REDIS_REPLY_INTEGER ||
          range->element[1]->type != REDIS_REPLY_INTEGER ||
          range->element[2]->type != REDIS_REPLY_ARRAY || range->element[2]->elements < 2 ||
          range->element[2]->element[0]->type != REDIS_REPLY_STRING ||
          range->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
        return Status(Code::kInternal, "redis " + address + ": CLUSTER SLOTS: unexpected entry");
      }
      const long long first = range->element[0]->integer;
      const long long last = range->element[1]->integer;
      if (first < 0 || last >= kClusterSlots || first > last) {
        return Status(Code::kInternal, "redis " + address + ": CLUSTER SLOTS: bad range");
      }
      std::string master_host = reply_text(range->element[2]->element[0]);
      if (master_host.empty() || master_host == "?") master_host = host;  // "the node asked"
      const std::string master =
          master_host + ":" + std::to_string(range->element[2]->element[1]->integer);
      const int32_t index = node_index(master);
      for (long long s = first; s <= last; ++s) map[static_cast<size_t>(s)] = index;
    }
    slots = map;
    slots_known = true;
    return Status::ok();
  }
};

RedisCluster::RedisCluster(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RedisCluster::~RedisCluster() = default;

Result<std::unique_ptr<RedisCluster>> RedisCluster::create(RedisClusterOptions options) {
  if (options.seeds.empty()) return Status(Code::kInvalidArgument, "redis: no seed address");
  for (const auto& s : options.seeds) {
    std::string host;
    int port = 0;
    if (!split_address(s, &host, &port)) {
      return Status(Code::kInvalidArgument, "redis address '" + s + "': expected host:port");
    }
  }
  if (options.connect_timeout.count() <= 0 || options.op_timeout.count() <= 0) {
    return Status(Code::kInvalidArgument, "redis: timeouts must be positive");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->slots.fill(-1);
  for (const auto& s : impl->options.seeds) impl->node_index(s);
  return std::unique_ptr<RedisCluster>(new RedisCluster(std::move(impl)));
}

Status RedisCluster::refresh_slots() { return impl_->refresh(); }

std::string RedisCluster::slot_owner(uint16_t slot) const {
  if (slot >= kClusterSlots) return {};
  const int32_t i = impl_->slots[slot];
  return i < 0 ? std::string() : impl_->nodes[static_cast<size_t>(i)];
}

Result<Reply> RedisCluster::Impl::keyed(uint64_t* redirects, std::string_view key,
                                        const std::vector<std::string_view>& args) {
  Impl& d = *this;
  const uint16_t slot = key_slot(key);
  if (!d.slots_known || d.slots[slot] < 0) {
    KEEP_RETURN_IF_ERROR(d.refresh());
    if (d.slots[slot] < 0) {
      return Status(Code::kUnavailable, "redis: slot " + std::to_string(slot) + " has no master");
    }
  }
  std::string address = d.nodes[static_cast<size_t>(d.slots[slot])];
  bool asking = false;
  for (int hop = 0; hop <= d.options.max_redirects; ++hop) {
    if (asking) {
      KEEP_ASSIGN_OR_RETURN(Reply a, d.call(address, {"ASKING"}));
      if (a->type == REDIS_REPLY_ERROR) {
        return Status(Code::kUnavailable, "redis " + address + ": ASKING: " + reply_text(&*a));
      }
    }
    KEEP_ASSIGN_OR_RETURN(Reply r, d.call(address, args));
    if (r->type != REDIS_REPLY_ERROR) return r;
    const std::string error = reply_text(&*r);
    if (std::string to = redirect_target(error, "MOVED"); !to.empty()) {
      ++*redirects;
      d.slots[slot] = d.node_index(to);
      d.slots_known = false;  // read the whole map again before the next command
      address = to;
      asking = false;
      continue;
    }
    if (std::string to = redirect_target(error, "ASK"); !to.empty()) {
      ++*redirects;
      d.node_index(to);
      address = to;
      asking = true;
      continue;
    }
    return Status(Code::kUnavailable, "redis " + address + ": " + error);
  }
  return Status(Code::kUnavailable, "redis: more than " + std::to_string(d.options.max_redirects) +
                                        " redirects for slot " + std::to_string(slot));
}

Result<std::optional<std::string>> RedisCluster::get(std::string_view key) {
  KEEP_ASSIGN_OR_RETURN(Reply r, impl_->keyed(&redirects_, key, {"GET", key}));
  if (r->type == REDIS_REPLY_NIL) return std::optional<std::string>();
  if (r->type != REDIS_REPLY_STRING) {
    return Status(Code::kInternal, "redis GET: unexpected reply type " + std::to_string(r->type));
  }
  return std::optional<std::string>(reply_text(&*r));
}

Status RedisCluster::set(std::string_view key, std::string_view value,
                         std::chrono::milliseconds ttl) {
  const std::string px = std::to_string(ttl.count());
  Result<Reply> r = ttl.count() > 0 ? impl_->keyed(&redirects_, key, {"SET", key, value, "PX", px})
                                    : impl_->keyed(&redirects_, key, {"SET", key, value});
  if (!r.is_ok()) return r.status();
  if ((*r)->type != REDIS_REPLY_STATUS) {
    return Status(Code::kInternal, "redis SET: unexpected reply type");
  }
  return Status::ok();
}

Status RedisCluster::del(std::string_view key) {
  KEEP_ASSIGN_OR_RETURN(Reply r, impl_->keyed(&redirects_, key, {"DEL", key}));
  (void)r;
  return Status::ok();
}

}  // namespace keep::kvremote
