// KvTierDirectory (shared/kvregion/kv_tier_directory.h): the shared directory of a device KV tier
// -- admission, lookup, LRU eviction, the seqlock that invalidates a reader's hit when its slot is
// rewritten, ownership -- across real processes (fork) on a real shm object.
#include "shared/kvregion/kv_tier_directory.h"

#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>

using namespace keep::kv;
using keep::Code;

namespace {

std::string tier_name(const char* stem) {
  return "keep_test_tier_" + std::to_string(::getpid()) + "_" + stem;
}

EntryKey key(uint64_t object, uint64_t version = 1) {
  EntryKey k;
  k.agent_hash = 0xabcdef;
  k.object_id = object;
  k.object_version = version;
  k.group_version = 3;
  return k;
}

TierGeometry geometry(uint32_t slots) {
  TierGeometry g;
  g.slots = slots;
  g.slot_bytes = 1 << 20;
  g.device = 0;
  for (size_t i = 0; i < kTierIpcHandleBytes; ++i) g.ipc_handle[i] = static_cast<uint8_t>(i * 7);
  return g;
}

uint32_t admit(KvTierDirectory& d, const EntryKey& k, uint64_t bytes = 1000) {
  auto slot = d.begin_admit(k, bytes);
  REQUIRE_MESSAGE(slot.is_ok(), slot.status().to_string());
  d.commit(*slot);
  return *slot;
}

// Runs `body` in a child process; its exit status (0 = every CHECK-like condition held).
int in_child(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

}  // namespace

TEST_CASE("tier directory: another process finds admitted entries with the pool's handle") {
  const std::string name = tier_name("find");
  auto owner = KvTierDirectory::create(name, geometry(4));
  REQUIRE_MESSAGE(owner.is_ok(), owner.status().to_string());
  const uint32_t s7 = admit(**owner, key(7), 5000);
  admit(**owner, key(8));
  const int rc = in_child([&] {
    auto d = KvTierDirectory::open(name);
    if (!d.is_ok()) return 1;
    const TierGeometry& g = (*d)->geometry();
    if (g.slots != 4 || g.slot_bytes != (1u << 20) || g.ipc_handle[3] != 21) return 2;
    const auto hit = (*d)->find(key(7));
    if (!hit || hit->slot != s7 || hit->bytes != 5000) return 3;
    if ((*d)->find(key(7, 2))) return 4;  // another version of the segment: a miss
    if ((*d)->begin_admit(key(9), 10).status().code() != Code::kInvalidArgument) return 5;
    if (!(*d)->validate(*hit)) return 6;
    return 0;
  });
  CHECK(rc == 0);
  CHECK((*owner)->stats().used == 2);
  CHECK((*owner)->stats().admits == 2);
}

TEST_CASE("tier directory: a rewritten slot fails the reader's validation; LRU picks the victim") {
  const std::string name = tier_name("lru");
  auto owner = KvTierDirectory::create(name, geometry(2));
  REQUIRE(owner.is_ok());
  KvTierDirectory& d = **owner;
  admit(d, key(1));
  admit(d, key(2));
  auto reader = KvTierDirectory::open(name);
  REQUIRE(reader.is_ok());
  const auto hit1 = (*reader)->find(key(1));  // key 1 used last: key 2 is the LRU victim
  REQUIRE(hit1);
  const auto hit2 = (*reader)->find(key(2));
  REQUIRE(hit2);
  CHECK((*reader)->find(key(1)));
  const uint32_t s3 = admit(d, key(3));
  CHECK(s3 == hit2->slot);
  CHECK_FALSE((*reader)->validate(*hit2));  // mid-use rewrite: invisible to that reader
  CHECK((*reader)->validate(*hit1));
  CHECK_FALSE((*reader)->find(key(2)));
  CHECK(d.stats().evictions == 1);
  // A slot in its write section is not found; after abort it is free.
  auto open_slot = d.begin_admit(key(4), 10);
  REQUIRE(open_slot.is_ok());
  CHECK_FALSE((*reader)->find(key(4)));
  d.abort(*open_slot);
  CHECK_FALSE((*reader)->find(key(4)));
  CHECK(d.stats().used == 1);
  // Evicting invalidates too.
  const auto hit3 = (*reader)->find(key(3));
  REQUIRE(hit3);
  CHECK(d.evict(key(3)));
  CHECK_FALSE((*reader)->validate(*hit3));
  CHECK_FALSE(d.evict(key(3)));
}

TEST_CASE("tier directory: bad admissions and names are refused") {
  const std::string name = tier_name("bad");
  auto owner = KvTierDirectory::create(name, geometry(2));
  REQUIRE(owner.is_ok());
  CHECK((*owner)->begin_admit(key(1), (1u << 20) + 1).status().code() == Code::kInvalidArgument);
  CHECK((*owner)->begin_admit(key(1), 0).status().code() == Code::kInvalidArgument);
  admit(**owner, key(1));
  CHECK((*owner)->begin_admit(key(1), 10).status().code() == Code::kAlreadyExists);
  CHECK(KvTierDirectory::open("no_such_tier_" + name).status().code() == Code::kNotFound);
  CHECK(KvTierDirectory::create("bad/name", geometry(2)).status().code() == Code::kInvalidArgument);
  CHECK(KvTierDirectory::create(name + "_0", geometry(0)).status().code() ==
        Code::kInvalidArgument);
  // A live owner keeps its tier.
  CHECK(in_child([&] {
          auto second = KvTierDirectory::create(name, geometry(2));
          return second.status().code() == Code::kAlreadyExists ? 0 : 1;
        }) == 0);
}

TEST_CASE("tier directory: an object left by a dead owner is replaced; a clean owner removes it") {
  const std::string name = tier_name("stale");
  const int rc = in_child([&] {
    auto d = KvTierDirectory::create(name, geometry(2));
    if (!d.is_ok()) return 1;
    (void)d->release();  // dies without cleaning up
    return 0;
  });
  REQUIRE(rc == 0);
  CHECK(KvTierDirectory::open(name).is_ok());
  {
    auto owner = KvTierDirectory::create(name, geometry(3));
    REQUIRE_MESSAGE(owner.is_ok(), owner.status().to_string());
    CHECK((*owner)->geometry().slots == 3);
    CHECK((*owner)->stats().used == 0);
  }
  CHECK(KvTierDirectory::open(name).status().code() == Code::kNotFound);
}
