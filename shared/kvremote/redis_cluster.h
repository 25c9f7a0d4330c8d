// RedisCluster: the few Redis Cluster calls the shared KV tier needs (issue 31: KV entries shared
// between workers), over hiredis's blocking API.
//
// Keys map to the 16384 slots of the Redis Cluster specification (CRC16/XMODEM of the key, or of
// its {hash tag}, mod 16384); the slot map comes from CLUSTER SLOTS, asked of any known node. A
// command goes to its slot's master on one connection per master; MOVED updates the map (and the
// whole map is read again before the next command), ASK sends that one command, after ASKING, to
// the node named. Every connect and call has a short timeout, and a node that failed is not tried
// again for `backoff`: with Redis down a call costs at most one timeout per backoff period, then
// returns kUnavailable at once.
//
// Failures are a Status (kUnavailable: no node answers or the cluster refuses; kTimeout: a node
// did not answer in time; kInternal: an answer of the wrong shape), never an exception. Not
// thread-safe: one caller at a time (the worker's engine thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"

namespace keep::kvremote {

inline constexpr uint32_t kClusterSlots = 16384;

// CRC16/XMODEM (polynomial 0x1021, initial 0), the Redis Cluster key hash.
uint16_t crc16(std::string_view bytes);
// The key's slot: of the part between the first '{' and the next '}' when that is non-empty,
// else of the whole key (the specification's hash tags).
uint16_t key_slot(std::string_view key);

struct RedisClusterOptions {
  std::vector<std::string> seeds;                 // "host:port", any of the masters
  std::chrono::milliseconds connect_timeout{50};  // per connection attempt
  std::chrono::milliseconds op_timeout{50};       // per command (reading the reply)
  std::chrono::milliseconds backoff{2000};        // a failed node is left alone this long
  int max_redirects = 5;                          // MOVED / ASK hops of one command
  // Sent as AUTH on every new connection when `password` is not empty: AUTH password (the
  // servers' requirepass), or AUTH user password (a Redis 6+ ACL user).
  std::string user;
  std::string password;
};

// "redis://h1:p1,h2:p2,..." (the scheme optional) into seeds; kInvalidArgument naming the part.
Result<std::vector<std::string>> parse_redis_url(std::string_view url);

class RedisCluster {
 public:
  // Checks the options; connects lazily (at the first command).
  static Result<std::unique_ptr<RedisCluster>> create(RedisClusterOptions options);
  ~RedisCluster();
  RedisCluster(const RedisCluster&) = delete;
  RedisCluster& operator=(const RedisCluster&) = delete;

  // The value, or nullopt when the key is absent. Binary-safe.
  Result<std::optional<std::string>> get(std::string_view key);
  // SET key value PX ttl (ttl 0: no expiry). Binary-safe.
  Status set(std::string_view key, std::string_view value, std::chrono::milliseconds ttl);
  // DEL key (tests).
  Status del(std::string_view key);

  // Reads the slot map again from the first node that answers CLUSTER SLOTS.
  Status refresh_slots();
  // "host:port" of the master the map gives for `slot`; empty when unknown.
  std::string slot_owner(uint16_t slot) const;
  // How many MOVED and ASK answers were followed (tests).
  uint64_t redirects() const { return redirects_; }

 private:
  struct Impl;
  explicit RedisCluster(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  uint64_t redirects_ = 0;
};

}  // namespace keep::kvremote
