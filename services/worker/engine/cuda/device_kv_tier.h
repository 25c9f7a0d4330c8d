// DeviceKvTier: hot KV entries in a pool of GPU memory, shared by CUDA IPC with the other
// processes on the same GPU (issue 29, point 3).
//
// The owner (a keep-worker) allocates the pool -- byte budget / slot size slots of one entry each
// -- exports it with cudaIpcGetMemHandle and publishes the handle and which entry each slot holds
// in a KvTierDirectory (POSIX shm, no CUDA). A second process on the same GPU (a second
// keep-worker started to attach) opens the handle and reads entries in place, at device memory
// speed instead of over PCIe. Entries are stored as in the host region (bf16 pre-RoPE, the
// region's layout), so the loader reads either the same way.
//
// Consistency is the directory's seqlock: find() returns the slot's count, the reader uses the
// device bytes, then validate() -- false when the owner evicted or rewrote the slot meanwhile, and
// what was read must be dropped (loaded again from the host region, or computed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "shared/common/status.h"
#include "shared/kvregion/kv_tier_directory.h"

namespace keep::engine {

struct DeviceKvTierOptions {
  std::string name;           // the directory's shm name ([A-Za-z0-9._-])
  uint64_t budget_bytes = 0;  // device memory for the pool
  uint64_t slot_bytes = 0;    // the largest entry it holds; slots = budget / slot_bytes
  int device = 0;
};

class DeviceKvTier {
 public:
  // The owner: the pool on `device`, exported; the directory created (kAlreadyExists while
  // another live process owns `name`).
  static Result<std::unique_ptr<DeviceKvTier>> create(const DeviceKvTierOptions& options);
  // Another process: the directory opened and the pool mapped from its IPC handle (kUnavailable
  // when CUDA cannot open it: another GPU, or the same process as the owner).
  static Result<std::unique_ptr<DeviceKvTier>> attach(const std::string& name);
  ~DeviceKvTier();  // owner: the directory removed, then the pool freed; reader: handle closed
  DeviceKvTier(const DeviceKvTier&) = delete;
  DeviceKvTier& operator=(const DeviceKvTier&) = delete;

  struct Hit {
    const std::byte* device = nullptr;  // the entry's bytes in the pool (device memory)
    uint64_t bytes = 0;
    kv::TierHit tier;
  };
  std::optional<Hit> find(const kv::EntryKey& key) const;
  bool validate(const Hit& hit) const { return dir_->validate(hit.tier); }

  // The owner: `entry` (host memory, registered or not, or device memory) copied into a slot (a
  // free one, else the least recently used), visible once the copy is done. Blocks for the copy:
  // call it off the request path. kAlreadyExists when held; kInvalidArgument when larger than a
  // slot or not the owner.
  Status admit(const kv::EntryKey& key, std::span<const std::byte> entry);
  bool evict(const kv::EntryKey& key) { return dir_->evict(key); }

  const kv::KvTierDirectory& directory() const { return *dir_; }
  bool owner() const { return dir_->owner(); }
  uint64_t pool_bytes() const { return pool_bytes_; }

 private:
  DeviceKvTier() = default;

  std::unique_ptr<kv::KvTierDirectory> dir_;
  std::byte* pool_ = nullptr;
  uint64_t pool_bytes_ = 0;
  void* stream_ = nullptr;  // cudaStream_t of the owner's admission copies
};

}  // namespace keep::engine
