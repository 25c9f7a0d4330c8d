// The second process of test_device_kv_tier: attaches to a device KV tier by name and answers
// commands on stdin, one line each, on stdout:
//   read OBJ BYTES SEED   find entry OBJ, copy its device bytes out, compare with the pattern of
//                         SEED, validate: "ok", "miss", "bad" (bytes differ) or "invalid"
//   hold OBJ              find entry OBJ and keep the hit: "found SLOT" or "miss"
//   check BYTES SEED      the held hit's bytes now: "match=M valid=V" (M: equal to SEED's pattern)
//   quit
#include <cuda_runtime.h>

#include <cstdio>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "services/worker/engine/cuda/device_kv_tier.h"
#include "tests/gpu/device_tier_pattern.h"

using keep::engine::DeviceKvTier;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: device_tier_probe NAME\n");
    return 2;
  }
  auto tier = DeviceKvTier::attach(argv[1]);
  if (!tier.is_ok()) {
    std::printf("error: %s\n", tier.status().to_string().c_str());
    return 1;
  }
  std::printf("attached slots=%u\n", (*tier)->directory().geometry().slots);
  std::fflush(stdout);
  std::optional<DeviceKvTier::Hit> held;
  std::string line;
  auto copy_out = [](const DeviceKvTier::Hit& h, size_t bytes) {
    std::vector<uint8_t> out(bytes);
    if (cudaMemcpy(out.data(), h.device, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
      out.clear();
    }
    return out;
  };
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "read") {
      uint64_t obj = 0, bytes = 0, seed = 0;
      in >> obj >> bytes >> seed;
      const auto hit = (*tier)->find(keep::testing::tier_key(obj));
      if (!hit) {
        std::printf("miss\n");
      } else {
        const auto got = copy_out(*hit, bytes);
        const bool same = hit->bytes == bytes && got == keep::testing::tier_pattern(seed, bytes);
        std::printf("%s\n", !(*tier)->validate(*hit) ? "invalid" : same ? "ok" : "bad");
      }
    } else if (cmd == "hold") {
      uint64_t obj = 0;
      in >> obj;
      held = (*tier)->find(keep::testing::tier_key(obj));
      if (held) {
        std::printf("found %u\n", held->tier.slot);
      } else {
        std::printf("miss\n");
      }
    } else if (cmd == "check") {
      uint64_t bytes = 0, seed = 0;
      in >> bytes >> seed;
      if (!held) {
        std::printf("nothing held\n");
      } else {
        const auto got = copy_out(*held, bytes);
        std::printf("match=%d valid=%d\n", got == keep::testing::tier_pattern(seed, bytes) ? 1 : 0,
                    (*tier)->validate(*held) ? 1 : 0);
      }
    } else if (cmd == "quit") {
      break;
    } else {
      std::printf("unknown command\n");
    }
    std::fflush(stdout);
  }
  return 0;
}
