// The entry keys and byte patterns test_device_kv_tier and device_tier_probe agree on.
#pragma once

#include <cstdint>
#include <vector>

#include "shared/kvregion/kv_format.h"

namespace keep::testing {

inline kv::EntryKey tier_key(uint64_t object) {
  kv::EntryKey k;
  k.agent_hash = 0x5eed;
  k.object_id = object;
  k.object_version = 1;
  return k;
}

inline std::vector<uint8_t> tier_pattern(uint64_t seed, uint64_t bytes) {
  std::vector<uint8_t> v(bytes);
  for (uint64_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(seed * 131 + i * 7 + (i >> 9));
  return v;
}

}  // namespace keep::testing
