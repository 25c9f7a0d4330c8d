// The shared KV tier's Redis Cluster client and value codec against three real redis-server
// masters in cluster mode on loopback (tests/integration/redis_cluster.h).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "shared/kvremote/redis_cluster.h"
#include "shared/kvremote/shared_kv_tier.h"
#include "tests/integration/redis_cluster.h"

namespace kr = keep::kvremote;
namespace it = keep::itest;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<kr::RedisCluster> client_of(const it::RedisClusterProcs& rc,
                                            const std::string& password = {},
                                            const std::string& user = {}) {
  kr::RedisClusterOptions o;
  o.seeds = rc.seeds();
  o.password = password;
  o.user = user;
  o.connect_timeout = 200ms;
  o.op_timeout = 500ms;
  o.backoff = 300ms;
  auto c = kr::RedisCluster::create(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

// Every byte value, and a NUL in the middle.
std::string binary_value(size_t n, uint8_t seed) {
  std::string v(n, '\0');
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return v;
}

keep::kvremote::EntryContent sample_content() {
  kr::EntryContent c;
  c.fingerprint.num_layers = 2;
  c.fingerprint.num_kv_heads = 1;
  c.fingerprint.head_dim = 4;
  c.fingerprint.dtype = keep::kv::KvDType::kBF16;
  c.fingerprint.rope_theta = 10000;
  c.fingerprint.tokenizer_hash = 42;
  c.fingerprint.set_model_name("test");
  c.producer = "cpu";
  c.context = {1, 2, 3};
  c.tokens = {10, 11, 12, 13};
  return c;
}

}  // namespace

TEST_CASE("key slots follow the Redis Cluster specification") {
  // The specification's example value: CRC16("123456789") = 0x31C3.
  CHECK(kr::crc16("123456789") == 0x31c3);
  CHECK(kr::key_slot("foo") == 12182);  // redis-cli CLUSTER KEYSLOT foo
  CHECK(kr::key_slot("{user1000}.following") == kr::key_slot("user1000"));
  CHECK(kr::key_slot("foo{}{bar}") == kr::crc16("foo{}{bar}") % 16384);  // empty tag: whole key
  CHECK(kr::key_slot("foo{{bar}}zap") == kr::key_slot("{bar"));
  auto seeds = kr::parse_redis_url("redis://127.0.0.1:7000,localhost:7001");
  REQUIRE(seeds.is_ok());
  CHECK(seeds->size() == 2);
  CHECK(!kr::parse_redis_url("redis://127.0.0.1").is_ok());
  CHECK(!kr::parse_redis_url("").is_ok());
}

TEST_CASE("values: content, length and checksum are checked") {
  const auto content = kr::content_bytes(sample_content());
  std::vector<std::byte> entry(64);
  for (size_t i = 0; i < entry.size(); ++i) entry[i] = static_cast<std::byte>(i * 7);
  const std::string value = kr::encode_value(content, entry);
  std::vector<std::byte> out(64);
  CHECK(kr::decode_value(value, content, out).is_ok());
  CHECK(std::memcmp(out.data(), entry.data(), entry.size()) == 0);

  auto other = sample_content();
  other.tokens.push_back(14);
  CHECK(kr::content_key(content) != kr::content_key(kr::content_bytes(other)));
  CHECK(kr::decode_value(value, kr::content_bytes(other), out).code() == keep::Code::kNotFound);
  auto other_fp = sample_content();
  other_fp.fingerprint.tokenizer_hash = 43;
  CHECK(kr::decode_value(value, kr::content_bytes(other_fp), out).code() == keep::Code::kNotFound);

  std::string flipped = value;
  flipped.back() = static_cast<char>(flipped.back() ^ 1);
  std::vector<std::byte> untouched(64, std::byte{0x5a});
  CHECK(kr::decode_value(flipped, content, untouched).code() == keep::Code::kCorrupt);
  CHECK(untouched[0] == std::byte{0x5a});
  CHECK(kr::decode_value(value.substr(0, value.size() - 1), content, out).code() ==
        keep::Code::kCorrupt);
  std::vector<std::byte> longer(65);
  CHECK(kr::decode_value(value, content, longer).code() == keep::Code::kCorrupt);
}

TEST_CASE("every part of an entry's content is in its key") {
  // A key shared by two contents would make a worker of another model, backend or context take
  // the entry's bytes for its own (decode_value catches it only after the transfer).
  const std::string base = kr::content_key(kr::content_bytes(sample_content()));
  CHECK(base.rfind("keep:kv:1:", 0) == 0);
  CHECK(base.size() == std::string("keep:kv:1:").size() + 32);
  CHECK(kr::content_key(kr::content_bytes(sample_content())) == base);  // deterministic
  const std::vector<std::pair<const char*, void (*)(kr::EntryContent&)>> changes = {
      {"layers", [](kr::EntryContent& c) { c.fingerprint.num_layers = 3; }},
      {"kv heads", [](kr::EntryContent& c) { c.fingerprint.num_kv_heads = 2; }},
      {"head_dim", [](kr::EntryContent& c) { c.fingerprint.head_dim = 8; }},
      {"dtype", [](kr::EntryContent& c) { c.fingerprint.dtype = keep::kv::KvDType::kF32; }},
      {"rope theta", [](kr::EntryContent& c) { c.fingerprint.rope_theta = 1e6; }},
      {"rope scaling",
       [](kr::EntryContent& c) {
         c.fingerprint.rope_scaling = keep::kv::RopeScaling::kLlama3;
         c.fingerprint.rope_scaling_factor = 8;
       }},
      {"tokenizer", [](kr::EntryContent& c) { c.fingerprint.tokenizer_hash = 43; }},
      {"model name", [](kr::EntryContent& c) { c.fingerprint.set_model_name("test-2"); }},
      {"producer", [](kr::EntryContent& c) { c.producer = "cuda"; }},
      {"context", [](kr::EntryContent& c) { c.context[1] = 7; }},
      {"no context", [](kr::EntryContent& c) { c.context.clear(); }},
      {"tokens", [](kr::EntryContent& c) { c.tokens[3] = 14; }},
      // The same token stream cut elsewhere: the entry starts at another position.
      {"context/tokens boundary",
       [](kr::EntryContent& c) {
         c.tokens.insert(c.tokens.begin(), c.context.back());
         c.context.pop_back();
       }},
  };
  std::set<std::string> keys{base};
  for (const auto& [what, change] : changes) {
    kr::EntryContent c = sample_content();
    change(c);
    const std::string key = kr::content_key(kr::content_bytes(c));
    INFO(what);
    CHECK(key != base);
    CHECK(keys.insert(key).second);  // and differs from every other change's
  }
}

TEST_CASE("a three-master cluster: slots, binary values, MOVED, ASK, servers killed") {
  if (!it::have_redis()) {
    MESSAGE("skipped: no redis-server / redis-cli");
    return;
  }
  it::RedisClusterProcs rc;
  auto c = client_of(rc);

  SUBCASE("binary values land on their slots' masters and come back") {
    std::vector<std::string> owners;
    for (int i = 0; i < 30; ++i) {
      const std::string key = "k" + std::to_string(i);
      const std::string v =
          binary_value(static_cast<size_t>(1000 * i + 1), static_cast<uint8_t>(i));
      REQUIRE(c->set(key, v, 60000ms).is_ok());
      auto got = c->get(key);
      REQUIRE(got.is_ok());
      REQUIRE(got->has_value());
      CHECK(**got == v);
      owners.push_back(c->slot_owner(kr::key_slot(key)));
      // The owner redis-cli names is the one the key is stored on.
      const std::string port = owners.back().substr(owners.back().rfind(':') + 1);
      CHECK(rc.cli(std::stoi(port), {"EXISTS", key}).out.find("1") == 0);
    }
    std::sort(owners.begin(), owners.end());
    owners.erase(std::unique(owners.begin(), owners.end()), owners.end());
    CHECK(owners.size() == 3);  // 30 keys spread over the three masters
    auto absent = c->get("never-set");
    REQUIRE(absent.is_ok());
    CHECK(!absent->has_value());
    // A 4 MiB value (a large static group's entry).
    const std::string big = binary_value(4u << 20, 9);
    REQUIRE(c->set("big", big, 60000ms).is_ok());
    auto got = c->get("big");
    REQUIRE(got.is_ok());
    CHECK(**got == big);
    CHECK(c->redirects() == 0);
  }

  SUBCASE("a slot moved to another master: MOVED is followed and the map refreshed") {
    const std::string key = "moving-key";
    const uint16_t slot = kr::key_slot(key);
    REQUIRE(c->refresh_slots().is_ok());
    const std::string from = c->slot_owner(slot);
    int from_i = -1;
    for (int i = 0; i < 3; ++i) {
      if (it::RedisClusterProcs::address(rc.ports[static_cast<size_t>(i)]) == from) from_i = i;
    }
    REQUIRE(from_i >= 0);
    const int to_i = (from_i + 1) % 3;
    // The slot is empty: assign it to the other master on every node.
    const std::string to_id = rc.node_id(to_i);
    for (int p : rc.ports) {
      auto r = rc.cli(p, {"CLUSTER", "SETSLOT", std::to_string(slot), "NODE", to_id});
      INFO(r.out << r.err);
      CHECK(r.out.find("OK") != std::string::npos);
    }
    REQUIRE(c->set(key, "after the move", 60000ms).is_ok());
    CHECK(c->redirects() >= 1);
    auto got = c->get(key);
    REQUIRE(got.is_ok());
    CHECK(**got == "after the move");
    CHECK(c->slot_owner(slot) ==
          it::RedisClusterProcs::address(rc.ports[static_cast<size_t>(to_i)]));
    const uint64_t before = c->redirects();
    REQUIRE(c->get(key).is_ok());
    CHECK(c->redirects() == before);  // the map was read again: no more redirects

    // ASK: the slot migrating back; a key absent on the source is asked of the target.
    const std::string from_id = rc.node_id(from_i);
    auto r1 = rc.cli(rc.ports[static_cast<size_t>(from_i)],
                     {"CLUSTER", "SETSLOT", std::to_string(slot), "IMPORTING", to_id});
    auto r2 = rc.cli(rc.ports[static_cast<size_t>(to_i)],
                     {"CLUSTER", "SETSLOT", std::to_string(slot), "MIGRATING", from_id});
    REQUIRE(r1.out.find("OK") != std::string::npos);
    REQUIRE(r2.out.find("OK") != std::string::npos);
    const uint64_t before_ask = c->redirects();
    auto absent = c->get("{moving-key}absent");  // same slot, not on the source
    REQUIRE(absent.is_ok());
    CHECK(!absent->has_value());
    CHECK(c->redirects() == before_ask + 1);
  }

  SUBCASE("the tier: a miss, a publish, a hit; a refused value is a miss") {
    kr::SharedKvOptions o;
    o.redis.seeds = rc.seeds();
    auto tier = kr::SharedKvTier::create(o);
    REQUIRE(tier.is_ok());
    const auto content = sample_content();
    std::vector<std::byte> entry(4096);
    for (size_t i = 0; i < entry.size(); ++i) entry[i] = static_cast<std::byte>(i * 13 + 1);
    std::vector<std::byte> out(4096);
    CHECK(!(*tier)->fetch(content, out));
    CHECK((*tier)->stats().misses == 1);
    (*tier)->publish(content, entry);
    CHECK((*tier)->stats().published == 1);
    CHECK((*tier)->fetch(content, out));
    CHECK(out == entry);
    CHECK((*tier)->stats().hits == 1);
    // The stored value corrupted under its key: refused, a miss.
    const std::string key = kr::content_key(kr::content_bytes(content));
    std::string bad = kr::encode_value(kr::content_bytes(content), entry);
    bad[bad.size() - 10] = static_cast<char>(bad[bad.size() - 10] ^ 0x40);
    REQUIRE(c->set(key, bad, 60000ms).is_ok());
    std::vector<std::byte> out2(4096);
    CHECK(!(*tier)->fetch(content, out2));
    CHECK((*tier)->stats().rejected == 1);
    CHECK((*tier)->stats().errors == 0);
  }

  SUBCASE("servers killed: errors, fast, no crash") {
    REQUIRE(c->set("a", "1", 60000ms).is_ok());
    rc.kill_all();
    const auto t0 = std::chrono::steady_clock::now();
    int errors = 0;
    for (int i = 0; i < 50; ++i) {
      auto got = c->get("k" + std::to_string(i));
      if (!got.is_ok()) {
        ++errors;
        const auto code = got.status().code();
        CHECK((code == keep::Code::kUnavailable || code == keep::Code::kTimeout));
      }
      CHECK(!c->set("k" + std::to_string(i), "v", 1000ms).is_ok());
    }
    CHECK(errors == 50);
    // Backoff: a hundred calls against dead servers cost a few connect attempts, not a hundred
    // timeouts.
    const auto spent = std::chrono::steady_clock::now() - t0;
    MESSAGE("100 calls with Redis down took "
            << std::chrono::duration_cast<std::chrono::milliseconds>(spent).count() << " ms");
    CHECK(spent < 5s);
    kr::SharedKvOptions o;
    o.redis.seeds = rc.seeds();
    auto tier = kr::SharedKvTier::create(o);
    REQUIRE(tier.is_ok());
    std::vector<std::byte> out(16);
    CHECK(!(*tier)->fetch(sample_content(), out));
    (*tier)->publish(sample_content(), out);
    CHECK((*tier)->stats().errors == 2);
    CHECK((*tier)->stats().hits == 0);
  }
}

TEST_CASE("masters with a password: AUTH on every connection; none or a wrong one is refused") {
  if (!it::have_redis()) {
    MESSAGE("skipped: no redis-server / redis-cli");
    return;
  }
  it::RedisClusterProcs rc("s3cret pass");  // a space: sent as one argument
  // Keys on all three masters: every connection authenticates, CLUSTER SLOTS's included.
  auto c = client_of(rc, "s3cret pass");
  std::vector<std::string> owners;
  for (int i = 0; i < 30; ++i) {
    const std::string key = "auth" + std::to_string(i);
    REQUIRE(c->set(key, "v" + std::to_string(i), 60000ms).is_ok());
    auto got = c->get(key);
    REQUIRE(got.is_ok());
    CHECK(**got == "v" + std::to_string(i));
    owners.push_back(c->slot_owner(kr::key_slot(key)));
  }
  std::sort(owners.begin(), owners.end());
  owners.erase(std::unique(owners.begin(), owners.end()), owners.end());
  CHECK(owners.size() == 3);

  // An ACL user with its own password (Redis 6+), on every master.
  for (int p : rc.ports) {
    auto r = rc.cli(p, {"ACL", "SETUSER", "keep", "on", ">kv-pass", "~*", "+@all"});
    REQUIRE_MESSAGE(r.out.find("OK") != std::string::npos, r.out << r.err);
  }
  auto as_user = client_of(rc, "kv-pass", "keep");
  REQUIRE(as_user->set("auth-user", "u", 60000ms).is_ok());
  CHECK(**as_user->get("auth-user") == "u");

  // Without the password every command is refused (NOAUTH): kUnavailable, not an exception.
  auto none = client_of(rc);
  auto refused = none->get("auth0");
  REQUIRE_FALSE(refused.is_ok());
  CHECK(refused.status().code() == keep::Code::kUnavailable);
  CHECK(refused.status().message().find("NOAUTH") != std::string::npos);
  // A wrong password: refused at AUTH, the node left alone.
  auto wrong = client_of(rc, "not it");
  auto bad = wrong->get("auth0");
  REQUIRE_FALSE(bad.is_ok());
  CHECK(bad.status().code() == keep::Code::kUnavailable);
  INFO(bad.status().to_string());
  CHECK(bad.status().message().find("AUTH") != std::string::npos);
  CHECK(bad.status().message().find("WRONGPASS") != std::string::npos);
  CHECK(wrong->set("auth0", "x", 60000ms).code() == keep::Code::kUnavailable);
  CHECK(**c->get("auth0") == "v0");  // nothing written by the refused clients
}
