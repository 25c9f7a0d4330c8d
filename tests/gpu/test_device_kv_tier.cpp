// DeviceKvTier (services/worker/engine/cuda/device_kv_tier.h) across two real processes on one
// GPU: this process owns the pool and admits entries from pageable, registered and device
// memory; device_tier_probe (exec'd, not forked: CUDA IPC needs a fresh process) attaches by name
// and reads them in place; a slot evicted and rewritten while the probe holds a hit gives the
// probe the new bytes and a failed validation. Label gpu.
#include "services/worker/engine/cuda/device_kv_tier.h"

#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "tests/gpu/device_tier_pattern.h"

using keep::engine::DeviceKvTier;
using keep::engine::DeviceKvTierOptions;
using keep::testing::tier_key;
using keep::testing::tier_pattern;

namespace {

std::string probe_path() {
  const auto here = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  for (const auto& dir : {here, here.parent_path() / "bin"}) {
    if (std::filesystem::exists(dir / "device_tier_probe")) return (dir / "device_tier_probe");
  }
  const char* bin = std::getenv("KEEP_BIN_DIR");
  return bin != nullptr ? std::string(bin) + "/device_tier_probe" : "device_tier_probe";
}

// The probe with its stdin and stdout on pipes; line-at-a-time exchange.
class Probe {
 public:
  explicit Probe(const std::string& name) {
    int to[2], from[2];
    REQUIRE(::pipe(to) == 0);
    REQUIRE(::pipe(from) == 0);
    const std::string path = probe_path();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(to[0], 0);
      ::dup2(from[1], 1);
      ::close(to[1]);
      ::close(from[0]);
      ::execl(path.c_str(), path.c_str(), name.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(to[0]);
    ::close(from[1]);
    in_ = ::fdopen(to[1], "w");
    out_ = ::fdopen(from[0], "r");
  }
  ~Probe() {
    if (in_ != nullptr) {
      std::fputs("quit\n", in_);
      std::fclose(in_);
    }
    if (out_ != nullptr) std::fclose(out_);
    int status = 0;
    if (pid_ > 0) ::waitpid(pid_, &status, 0);
  }
  std::string line() {
    char buf[512] = {};
    if (std::fgets(buf, sizeof buf, out_) == nullptr) return "<eof>";
    std::string s(buf);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    return s;
  }
  std::string ask(const std::string& cmd) {
    std::fputs((cmd + "\n").c_str(), in_);
    std::fflush(in_);
    return line();
  }

 private:
  pid_t pid_ = -1;
  FILE* in_ = nullptr;
  FILE* out_ = nullptr;
};

std::span<const std::byte> bytes_of(const std::vector<uint8_t>& v) {
  return {reinterpret_cast<const std::byte*>(v.data()), v.size()};
}

}  // namespace

TEST_CASE("device KV tier: a second process reads entries in place; a rewrite mid-use is seen") {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    MESSAGE("no GPU: skipped");
    return;
  }
  const std::string name = "keep_test_device_tier_" + std::to_string(::getpid());
  DeviceKvTierOptions o;
  o.name = name;
  o.slot_bytes = 1 << 20;
  o.budget_bytes = 2 * o.slot_bytes;
  auto owner = DeviceKvTier::create(o);
  REQUIRE_MESSAGE(owner.is_ok(), owner.status().to_string());
  CHECK((*owner)->directory().geometry().slots == 2);

  // Entries from pageable memory and from registered (pinned) memory.
  const auto e1 = tier_pattern(1, 700000);
  auto e2 = tier_pattern(2, 1 << 20);
  REQUIRE((*owner)->admit(tier_key(1), bytes_of(e1)).is_ok());
  REQUIRE(cudaHostRegister(e2.data(), e2.size(), cudaHostRegisterDefault) == cudaSuccess);
  REQUIRE((*owner)->admit(tier_key(2), bytes_of(e2)).is_ok());
  CHECK((*owner)->admit(tier_key(2), bytes_of(e2)).code() == keep::Code::kAlreadyExists);
  const auto too_big = tier_pattern(9, (1 << 20) + 1);
  CHECK((*owner)->admit(tier_key(9), bytes_of(too_big)).code() == keep::Code::kInvalidArgument);
  // The owner reads its own pool directly; attaching to it from here is CUDA's to refuse.
  CHECK_FALSE(DeviceKvTier::attach(name).is_ok());

  {
    Probe probe(name);
    REQUIRE(probe.line() == "attached slots=2");
    CHECK(probe.ask("read 1 700000 1") == "ok");
    CHECK(probe.ask("read 2 1048576 2") == "ok");
    CHECK(probe.ask("read 3 100 3") == "miss");
    // The probe holds entry 2; the owner evicts it and admits entry 3 (from device memory) into
    // the freed slot while the probe still uses its hit.
    const std::string held = probe.ask("hold 2");
    REQUIRE(held.rfind("found ", 0) == 0);
    const auto e3 = tier_pattern(3, 900000);
    void* dev = nullptr;
    REQUIRE(cudaMalloc(&dev, e3.size()) == cudaSuccess);
    REQUIRE(cudaMemcpy(dev, e3.data(), e3.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK((*owner)->evict(tier_key(2)));
    REQUIRE((*owner)->admit(tier_key(3), {static_cast<const std::byte*>(dev), e3.size()}).is_ok());
    const auto hit3 = (*owner)->find(tier_key(3));
    REQUIRE(hit3);
    CHECK("found " + std::to_string(hit3->tier.slot) == held);  // the slot the probe holds
    CHECK(probe.ask("check 900000 3") == "match=1 valid=0");    // new bytes, and it knows
    CHECK(probe.ask("read 3 900000 3") == "ok");
    CHECK(probe.ask("read 2 100 2") == "miss");
    // Full: admitting a fourth evicts the least recently used (entry 1: the probe read 3 last).
    const auto e4 = tier_pattern(4, 4096);
    REQUIRE((*owner)->admit(tier_key(4), bytes_of(e4)).is_ok());
    CHECK(probe.ask("read 1 700000 1") == "miss");
    CHECK(probe.ask("read 3 900000 3") == "ok");
    CHECK(probe.ask("read 4 4096 4") == "ok");
    cudaFree(dev);
  }
  CHECK((*owner)->directory().stats().evictions == 2);
  cudaHostUnregister(e2.data());
  owner->reset();
  // The owner gone, nothing attaches.
  Probe late(name);
  CHECK(late.line().find("no device KV tier") != std::string::npos);
}
