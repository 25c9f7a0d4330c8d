#include "shared/kvremote/shared_kv_tier.h"

#include <cstdio>
#include <cstring>

#include "shared/common/log.h"

namespace keep::kvremote {

namespace {

constexpr const char* kLog = "kvremote";
constexpr uint32_t kValueMagic = 0x3156'4b4bu;  // "KKV1" little-endian
constexpr uint32_t kValueVersion = 1;
constexpr size_t kValueHeaderBytes = 32;
constexpr uint64_t kKeySeedA = 0x6b65'6570'6b76'0001ull;
constexpr uint64_t kKeySeedB = 0x6b65'6570'6b76'0002ull;
constexpr uint64_t kChecksumSeed = 0x6b65'6570'6b76'0003ull;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t fmix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

template <typename T>
void put(std::string* out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out->append(b, sizeof(T));
}
template <typename T>
T get_at(std::string_view s, size_t offset) {
  T v;
  std::memcpy(&v, s.data() + offset, sizeof(T));
  return v;
}

// hash64 over two pieces, as if concatenated at a word boundary of the first (the checksum).
uint64_t hash_two(std::string_view a, std::span<const std::byte> b, uint64_t seed) {
  const uint64_t ha = hash64(a.data(), a.size(), seed);
  return hash64(b.data(), b.size(), ha);
}

}  // namespace

uint64_t hash64(const void* data, size_t n, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = seed ^ (static_cast<uint64_t>(n) * 0x9e3779b97f4a7c15ull);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = rotl(h ^ (w * 0x87c37b91114253d5ull), 31) * 0x4cf5ad432745937full;
  }
  uint64_t tail = 0;
  for (size_t j = 0; i + j < n; ++j) tail |= static_cast<uint64_t>(p[i + j]) << (8 * j);
  h = rotl(h ^ (tail * 0x87c37b91114253d5ull), 31) * 0x4cf5ad432745937full;
  return fmix(h);
}

std::string content_bytes(const EntryContent& c) {
  std::string out = "KKVC";
  out.append(reinterpret_cast<const char*>(&c.fingerprint), sizeof(c.fingerprint));
  put<uint32_t>(&out, static_cast<uint32_t>(c.producer.size()));
  out += c.producer;
  put<uint32_t>(&out, static_cast<uint32_t>(c.context.size()));
  for (int32_t t : c.context) put<int32_t>(&out, t);
  put<uint32_t>(&out, static_cast<uint32_t>(c.tokens.size()));
  for (int32_t t : c.tokens) put<int32_t>(&out, t);
  return out;
}

std::string content_key(std::string_view content) {
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx",
                static_cast<unsigned long long>(hash64(content.data(), content.size(), kKeySeedA)),
                static_cast<unsigned long long>(hash64(content.data(), content.size(), kKeySeedB)));
  return std::string("keep:kv:1:") + hex;
}

std::string encode_value(std::string_view content, std::span<const std::byte> entry) {
  std::string out;
  out.reserve(kValueHeaderBytes + content.size() + entry.size());
  put<uint32_t>(&out, kValueMagic);
  put<uint32_t>(&out, kValueVersion);
  put<uint64_t>(&out, content.size());
  put<uint64_t>(&out, entry.size());
  put<uint64_t>(&out, hash_two(content, entry, kChecksumSeed));
  out += content;
  out.append(reinterpret_cast<const char*>(entry.data()), entry.size());
  return out;
}

Status decode_value(std::string_view value, std::string_view content, std::span<std::byte> out) {
  if (value.size() < kValueHeaderBytes) return Status(Code::kCorrupt, "value shorter than header");
  if (get_at<uint32_t>(value, 0) != kValueMagic || get_at<uint32_t>(value, 4) != kValueVersion) {
    return Status(Code::kCorrupt, "unknown value magic or version");
  }
  const uint64_t content_len = get_at<uint64_t>(value, 8);
  const uint64_t entry_len = get_at<uint64_t>(value, 16);
  const uint64_t checksum = get_at<uint64_t>(value, 24);
  if (content_len > value.size() || entry_len > value.size() ||
      kValueHeaderBytes + content_len + entry_len != value.size()) {
    return Status(Code::kCorrupt, "value length does not match its header");
  }
  const std::string_view stored = value.substr(kValueHeaderBytes, content_len);
  if (stored != content) return Status(Code::kNotFound, "value is for another content");
  if (entry_len != out.size()) {
    return Status(Code::kCorrupt, "entry of " + std::to_string(entry_len) + " bytes, expected " +
                                      std::to_string(out.size()));
  }
  const auto* entry =
      reinterpret_cast<const std::byte*>(value.data() + kValueHeaderBytes + content_len);
  if (hash_two(stored, std::span<const std::byte>(entry, entry_len), kChecksumSeed) != checksum) {
    return Status(Code::kCorrupt, "checksum mismatch");
  }
  std::memcpy(out.data(), entry, entry_len);
  return Status::ok();
}

Result<std::unique_ptr<SharedKvTier>> SharedKvTier::create(SharedKvOptions options) {
  KEEP_ASSIGN_OR_RETURN(auto redis, RedisCluster::create(options.redis));
  return std::unique_ptr<SharedKvTier>(new SharedKvTier(std::move(redis), options.ttl));
}

bool SharedKvTier::fetch(const EntryContent& content, std::span<std::byte> out) {
  const std::string bytes = content_bytes(content);
  auto value = redis_->get(content_key(bytes));
  if (!value.is_ok()) {
    ++stats_.errors;
    KEEP_LOG_DEBUG(kLog, "shared KV fetch: %s", value.status().to_string().c_str());
    return false;
  }
  if (!value->has_value()) {
    ++stats_.misses;
    return false;
  }
  Status st = decode_value(**value, bytes, out);
  if (!st.is_ok()) {
    ++stats_.misses;
    ++stats_.rejected;
    KEEP_LOG_WARN(kLog, "shared KV value refused: %s", st.to_string().c_str());
    return false;
  }
  ++stats_.hits;
  return true;
}

void SharedKvTier::publish(const EntryContent& content, std::span<const std::byte> entry) {
  const std::string bytes = content_bytes(content);
  Status st = redis_->set(content_key(bytes), encode_value(bytes, entry), ttl_);
  if (!st.is_ok()) {
    ++stats_.errors;
    KEEP_LOG_DEBUG(kLog, "shared KV publish: %s", st.to_string().c_str());
    return;
  }
  ++stats_.published;
}

}  // namespace keep::kvremote
