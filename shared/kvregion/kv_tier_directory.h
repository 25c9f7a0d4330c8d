// KvTierDirectory: the directory of a device KV tier, in POSIX shared memory.
//
// A keep-worker may keep hot KV entries in a pool of GPU memory (DeviceKvTier,
// services/worker/engine/cuda/device_kv_tier.h) and export the pool by CUDA IPC handle, so that
// other processes on the same GPU read those entries in place instead of over PCIe. This is the
// part every such process shares, and it needs no CUDA: the pool's geometry and IPC handle, and
// per slot of the pool which entry (the region's EntryKey) it holds.
//
// One owner (the process that allocated the pool) admits and evicts; any process looks entries up,
// uses the slot's bytes, then validates. Each slot carries a seqlock count, as the host region's
// directory does (kv_region.h):
//   owner:  seq odd while a slot's key or bytes change (admission, eviction), even when stable;
//   reader: s = find(key) (even, key matching) ... use the bytes ... validate(slot, s)
// A reader whose validate() fails used bytes the owner rewrote meanwhile: it must not keep what
// it read. Readers also stamp the slot's last use, which the owner's LRU eviction reads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "shared/common/status.h"
#include "shared/kvregion/kv_format.h"

namespace keep::kv {

inline constexpr size_t kTierIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

struct TierGeometry {
  uint32_t slots = 0;
  uint64_t slot_bytes = 0;  // each slot holds one entry of up to this many bytes
  int32_t device = 0;       // the CUDA device ordinal of the pool
  uint8_t ipc_handle[kTierIpcHandleBytes] = {};
};

struct TierHit {
  uint32_t slot = 0;
  uint64_t seq = 0;    // for validate()
  uint64_t bytes = 0;  // the entry's size (<= slot_bytes)
};

struct TierStats {
  uint32_t slots = 0;
  uint32_t used = 0;
  uint64_t admits = 0;
  uint64_t evictions = 0;
};

namespace detail {
struct TierMapping;
}

class KvTierDirectory {
 public:
  // The owner: creates the shm object `name` ([A-Za-z0-9._-], as the region's names) for
  // `geometry`, every slot free. An object of that name left by a dead owner is replaced;
  // kAlreadyExists while its owner (pid recorded in the header) is alive. Removed on destruction.
  static Result<std::unique_ptr<KvTierDirectory>> create(const std::string& name,
                                                         const TierGeometry& geometry);
  // Another process: opens `name` (kNotFound when absent; kCorrupt / kVersionMismatch for a
  // header that is not ours).
  static Result<std::unique_ptr<KvTierDirectory>> open(const std::string& name);
  ~KvTierDirectory();
  KvTierDirectory(const KvTierDirectory&) = delete;
  KvTierDirectory& operator=(const KvTierDirectory&) = delete;

  const TierGeometry& geometry() const { return geometry_; }
  bool owner() const { return owner_; }

  // ---- any process ----
  // The slot holding `key`, stable now (seq even); stamps its last use. nullopt when absent.
  std::optional<TierHit> find(const EntryKey& key) const;
  // True when the slot did not change since find() returned `hit`.
  bool validate(const TierHit& hit) const;
  TierStats stats() const;

  // ---- the owner ----
  // A slot for `key` (bytes <= slot_bytes): a free one, else the least recently used (evicted).
  // Opens its write section: until commit() no reader finds it and every earlier hit on it fails
  // validate(). kInvalidArgument when not the owner or too large;
  // kAlreadyExists when `key` is already held (its slot in the message).
  Result<uint32_t> begin_admit(const EntryKey& key, uint64_t bytes);
  // Closes the write section: `key` is found from now on.
  void commit(uint32_t slot);
  // Closes it with the slot free (the copy failed).
  void abort(uint32_t slot);
  // Frees the slot of `key` if held (readers mid-use fail validate()).
  bool evict(const EntryKey& key);

 private:
  KvTierDirectory() = default;

  std::unique_ptr<detail::TierMapping> map_;
  std::string name_;
  TierGeometry geometry_;
  bool owner_ = false;
};

}  // namespace keep::kv
