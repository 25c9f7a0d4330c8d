// SharedKvTier: KV entries shared between workers (and nodes) through Redis Cluster, under keys
// made of their content (docs/cluster.md, "The shared KV tier").
//
// An entry's bytes are determined by the model (its fingerprint: geometry, RoPE, tokenizer, KV
// dtype), the backend that computes it (numerics differ between backends), the tokens in front
// of it while it is computed (the system prefix: they fix its positions and what it attends to)
// and its own tokens (a static group's members, in order). That is the *content*; its canonical
// bytes (content_bytes) are hashed into the key and also stored in the value, which is
//
//   magic "KKV1" u32 | version u32 (1) | content_len u64 | entry_len u64 | checksum u64
//   | content bytes | entry bytes
//
// (little-endian; checksum = hash64 of content and entry bytes). A value is used only when its
// content equals the asker's byte for byte, its entry has the expected length and its checksum
// holds: a hash collision, a truncated or corrupted value is a miss, never a wrong entry.
//
// Failures of Redis are counted and otherwise ignored: the caller computes the entry as if the
// tier were not there (losing Redis loses hits, never correctness).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"
#include "shared/kvregion/model_fingerprint.h"
#include "shared/kvremote/redis_cluster.h"

namespace keep::kvremote {

// What determines an entry's bytes.
struct EntryContent {
  kv::ModelFingerprint fingerprint;
  std::string producer;          // the backend computing it ("cpu", "cuda ...")
  std::vector<int32_t> context;  // in front while computing; the entry starts at its length
  std::vector<int32_t> tokens;   // the entry's own tokens
};

// 64-bit hash of `n` bytes (keys and checksums; not cryptographic: the content is compared).
uint64_t hash64(const void* data, size_t n, uint64_t seed);
// The canonical bytes of a content: "KKVC" | fingerprint (128 bytes) | producer length u32 |
// producer | context count u32 | context i32s | token count u32 | token i32s.
std::string content_bytes(const EntryContent& content);
// "keep:kv:1:" + 32 hex digits (two hashes of the content bytes).
std::string content_key(std::string_view content_bytes);
// The value stored for an entry (layout above).
std::string encode_value(std::string_view content_bytes, std::span<const std::byte> entry);
// Copies the value's entry into `out` when the value is for `content_bytes`, holds out.size()
// entry bytes and its checksum holds; kNotFound for another content (a key collision),
// kCorrupt otherwise (with what failed). `out` is untouched unless ok.
Status decode_value(std::string_view value, std::string_view content_bytes,
                    std::span<std::byte> out);

struct SharedKvOptions {
  RedisClusterOptions redis;
  std::chrono::milliseconds ttl{std::chrono::hours(24)};  // expiry of a published entry
};

struct SharedKvStats {
  uint64_t hits = 0;       // entries read from the tier
  uint64_t misses = 0;     // absent, or a value failing its checks
  uint64_t errors = 0;     // Redis unreachable, slow or refusing (fetches and publishes)
  uint64_t published = 0;  // entries written to the tier
  uint64_t rejected = 0;   // values found but failing their checks (part of misses)
};

class SharedKvTier {
 public:
  static Result<std::unique_ptr<SharedKvTier>> create(SharedKvOptions options);

  // True when `out` (the entry's bytes, out.size() of them) was filled from the tier.
  bool fetch(const EntryContent& content, std::span<std::byte> out);
  // Publishes a computed entry; a failure is counted, not returned.
  void publish(const EntryContent& content, std::span<const std::byte> entry);
  const SharedKvStats& stats() const { return stats_; }

 private:
  SharedKvTier(std::unique_ptr<RedisCluster> redis, std::chrono::milliseconds ttl)
      : redis_(std::move(redis)), ttl_(ttl) {}
  std::unique_ptr<RedisCluster> redis_;
  std::chrono::milliseconds ttl_;
  SharedKvStats stats_;
};

}  // namespace keep::kvremote
