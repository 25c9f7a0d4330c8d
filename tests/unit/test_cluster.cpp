// shared/cluster without a cluster: base64 as etcd's gateway writes it, and the agent -> shard
// hash (deterministic, balanced, and moving few agents when shards are added).
#include <doctest/doctest.h>

#include <map>
#include <string>

#include "shared/cluster/etcd_client.h"
#include "shared/cluster/placement.h"

using namespace keep;
using namespace keep::cluster;

TEST_CASE("base64 round-trips every length and byte, and refuses what is not base64") {
  CHECK(base64_encode("") == "");
  CHECK(base64_encode("f") == "Zg==");
  CHECK(base64_encode("fo") == "Zm8=");
  CHECK(base64_encode("foo") == "Zm9v");
  CHECK(base64_encode("/keep/shards/7") == "L2tlZXAvc2hhcmRzLzc=");
  std::string all;
  for (int c = 0; c < 256; ++c) all.push_back(static_cast<char>(c));
  for (size_t n = 0; n <= all.size(); n += 37) {
    const std::string s = all.substr(0, n);
    auto back = base64_decode(base64_encode(s));
    REQUIRE(back.is_ok());
    CHECK(*back == s);
  }
  CHECK(base64_decode("Zm9").status().code() == Code::kInvalidArgument);
  CHECK(base64_decode("Zm9*").status().code() == Code::kInvalidArgument);
  CHECK(base64_decode("Z=9v").status().code() == Code::kInvalidArgument);
}

TEST_CASE("agents map to shards deterministically, evenly, and few move when shards are added") {
  constexpr uint32_t kShards = 64;
  constexpr int kAgents = 20000;
  std::map<uint32_t, int> per_shard;
  int moved = 0;
  for (int i = 0; i < kAgents; ++i) {
    const std::string agent = "robot-" + std::to_string(i);
    const uint32_t s = shard_of(agent, kShards);
    REQUIRE(s < kShards);
    CHECK(s == shard_of(agent, kShards));
    per_shard[s] += 1;
    const uint32_t s2 = shard_of(agent, kShards + 1);
    if (s2 != s) {
      moved += 1;
      CHECK(s2 == kShards);  // only to the new shard
    }
  }
  CHECK(per_shard.size() == kShards);
  for (const auto& [s, n] : per_shard) {
    CHECK(n > kAgents / static_cast<int>(kShards) * 7 / 10);
    CHECK(n < kAgents / static_cast<int>(kShards) * 13 / 10);
  }
  // About 1/65 of the agents move (~308): far from the half a modulo hash would move.
  CHECK(moved > kAgents / 100);
  CHECK(moved < kAgents / 40);
  CHECK(shard_of("anyone", 1) == 0);
  CHECK(shard_of("anyone", 0) == 0);
}
