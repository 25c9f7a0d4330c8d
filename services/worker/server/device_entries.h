// DeviceEntries: a device KV tier as the plan path sees it -- entries of the shared region that
// also lie in GPU memory (keep-worker's DeviceKvTier behind it, owned by this worker or by
// another on the same GPU and attached through CUDA IPC). Kept CUDA-free so that PlanService is.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "shared/common/status.h"
#include "shared/kvregion/kv_format.h"

namespace keep::worker {

class DeviceEntries {
 public:
  virtual ~DeviceEntries() = default;
  struct Entry {
    std::span<const std::byte> bytes;  // device memory: the entry as the region stores it
    uint32_t slot = 0;
    uint64_t seq = 0;
  };
  // The entry `key` when the tier holds it; use its bytes, then validate().
  virtual std::optional<Entry> find(const kv::EntryKey& key) const = 0;
  // False when the tier rewrote the slot since find(): what was read from it must go.
  virtual bool validate(const Entry& entry) const = 0;
  // Whether this process admits (the tier's owner); attached readers only read.
  virtual bool owner() const = 0;
  // Owner: copies `bytes` (host memory) into the tier. Blocks for the copy.
  virtual Status admit(const kv::EntryKey& key, std::span<const std::byte> bytes) = 0;
  virtual bool evict(const kv::EntryKey& key) = 0;
};

}  // namespace keep::worker
