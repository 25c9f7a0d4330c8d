// The shared-memory region that holds the host KV cache (format: kv_format.h, docs/shm-format.md).
//
// KvRegion is the OWNER (keep-manager): it creates the POSIX shm object, and it is the only process
// that changes the directory or allocates blocks. Entries go through two phases:
//
//   reserve(key, tokens, owner, lease) -> EntryDescriptor   (free -> reserved, blocks allocated)
//   the writer (a worker) fills the descriptor's bytes, makes them visible (stream sync), asks:
//   commit(index, generation)          (reserved -> committed; kLeaseExpired / kStale otherwise)
//   or revoke(index, generation)       (reserved -> free)
//   release(index, generation)         (committed -> free: the entry became stale)
//   reap_expired(now)                  (reserved past lease + grace -> free: the writer died)
//
// KvRegionView is what any other process (a worker) attaches with: it checks the header and the
// model fingerprint, exposes the mapping (to cudaHostRegister) and lets readers validate an entry
// seqlock-style around their use of its bytes:
//
//   auto seq = view.read_begin(d.index, d.generation);   // nullopt: not committed / other gen
//   ... copy d.bytes from view.base() + d.offset ...
//   if (!view.read_validate(d.index, *seq)) discard the copy;   // changed meanwhile
//
// Times are CLOCK_MONOTONIC nanoseconds (std::chrono::steady_clock on Linux): every process of the
// node shares that clock, it never jumps, and it does not count suspend differences between them.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "shared/common/status.h"
#include "shared/kvregion/block_allocator.h"
#include "shared/kvregion/kv_format.h"
#include "shared/kvregion/model_fingerprint.h"

namespace keep::kv {

// CLOCK_MONOTONIC in nanoseconds.
int64_t monotonic_now_ns();

// Checks a shm object name: 1..200 characters of [A-Za-z0-9._-], not starting with '.'.
Status validate_region_name(const std::string& name);

// Checks a region's header page the way attach() and adopt() do before they use anything in it:
// readiness (kUnavailable), magic, format version and struct sizes (kVersionMismatch / kCorrupt),
// geometry and offsets against `region_bytes`, the shm object's size (kCorrupt), and that the
// recorded fingerprint is well-formed (kCorrupt). `header` needs sizeof(RegionHeader) bytes, any
// alignment; it is copied first.
Status validate_region_header(std::span<const std::byte> header, uint64_t region_bytes);

struct RegionOptions {
  std::string name;                  // shm object name without the leading '/'
  ModelFingerprint fingerprint;      // must validate()
  uint64_t block_bytes = 64 * 1024;  // multiple of kBlockAlignment, <= kMaxBlockBytes
  uint64_t num_blocks = 0;           // > 0
  uint32_t max_entries = 0;          // 1..kMaxEntries
  bool replace = false;              // remove an existing object of that name first, unless its
                                     // owner is alive (kAlreadyExists then)
  bool keep_on_destroy = false;      // leave the shm object in place when the owner goes away
  mode_t mode = 0600;                // permissions of /dev/shm/<name> (umask does not apply)
  bool preallocate = true;           // posix_fallocate the object: a full /dev/shm fails here
                                     // with a clear error instead of SIGBUS on first touch
  FitPolicy fit = FitPolicy::kBestFit;
  // Extra time after a lease expires before reap_expired() frees the blocks, so that a writer
  // that is late rather than dead cannot scribble over blocks already handed to someone else.
  std::chrono::milliseconds reap_grace{0};
  // Clock for leases (tests); null = monotonic_now_ns.
  std::function<int64_t()> clock;
};

struct RegionStats {
  uint64_t region_bytes = 0;
  uint64_t block_bytes = 0;
  uint64_t total_blocks = 0;
  uint64_t used_blocks = 0;
  uint64_t free_blocks = 0;
  uint64_t largest_free_run_blocks = 0;
  uint64_t bytes_used = 0;               // used_blocks * block_bytes
  uint64_t bytes_free = 0;               // free_blocks * block_bytes
  uint64_t payload_bytes_committed = 0;  // sum of committed entries' `bytes`
  uint32_t max_entries = 0;
  uint32_t entries_free = 0;
  uint32_t entries_reserved = 0;
  uint32_t entries_committed = 0;
  // Counters since creation.
  uint64_t reserves = 0;
  uint64_t reserve_failures = 0;
  uint64_t commits = 0;
  uint64_t commit_failures = 0;
  uint64_t revokes = 0;
  uint64_t releases = 0;
  uint64_t reaped = 0;
};

// A consistent copy of one directory entry (seqlock-read).
struct EntryInfo {
  uint32_t index = 0;
  uint64_t generation = 0;
  EntryState state = EntryState::kFree;
  EntryKey key;
  uint32_t tokens = 0;
  uint64_t offset = 0;  // from the start of the mapping
  uint64_t bytes = 0;
  uint64_t owner_id = 0;
  int64_t lease_expiry_ns = 0;
  uint64_t seq = 0;
};

namespace detail {
struct Mapping;  // Boost.Interprocess shm object + mapped region
}

class KvRegion {
 public:
  // Creates and initialises the region and becomes its owner: an exclusive flock(2) on the object,
  // held while this object lives, tells later creators the owner is alive. kAlreadyExists when the
  // name is taken and !replace, or when its owner is alive (the message names the owner's pid);
  // kInvalidArgument for bad options; kResourceExhausted when /dev/shm cannot hold it.
  static Result<std::unique_ptr<KvRegion>> create(RegionOptions options);

  // Takes over an existing region (a restarted manager): validates it like attach(), requires the
  // same fingerprint and geometry, and rebuilds the allocator and key index from the directory.
  // Reserved entries keep their leases. options.replace is ignored; the mode is not changed.
  // kAlreadyExists while the previous owner is alive.
  static Result<std::unique_ptr<KvRegion>> adopt(RegionOptions options);

  ~KvRegion();  // removes the shm object unless keep_on_destroy
  KvRegion(const KvRegion&) = delete;
  KvRegion& operator=(const KvRegion&) = delete;

  // free -> reserved. bytes = tokens * bytes_per_token(), rounded up to whole blocks.
  // kInvalidArgument (tokens 0, lease <= 0, too large), kResourceExhausted (no free slot or run).
  Result<EntryDescriptor> reserve(const EntryKey& key, uint32_t tokens, uint64_t owner_id,
                                  std::chrono::milliseconds lease);
  // reserved -> committed, when the generation matches and the lease has not run out.
  // kNotFound (index out of range), kStale (not reserved or another generation),
  // kLeaseExpired (the entry is freed then; the writer must reserve again).
  Status commit(uint32_t index, uint64_t generation);
  // reserved -> free (the writer gave up). kNotFound / kStale as for commit.
  Status revoke(uint32_t index, uint64_t generation);
  // committed -> free (the entry became stale). Readers in flight fail read_validate().
  Status release(uint32_t index, uint64_t generation);
  // Extends a reservation's lease to now + lease. kLeaseExpired when it already ran out.
  Status renew_lease(uint32_t index, uint64_t generation, std::chrono::milliseconds lease);
  // Frees every reservation whose lease_expiry + reap_grace <= now_ns; returns how many.
  size_t reap_expired(int64_t now_ns);
  size_t reap_expired() { return reap_expired(now()); }

  // The most recently committed entry with this key, if any.
  std::optional<EntryDescriptor> lookup(const EntryKey& key) const;
  RegionStats stats() const;

  // False once /dev/shm/<name> no longer names this object (removed by hand, or replaced): workers
  // can no longer attach to it, and a restart of the manager is the way back.
  bool linked() const;
  const std::string& name() const { return options_.name; }
  const ModelFingerprint& fingerprint() const { return options_.fingerprint; }
  std::byte* base() const;
  size_t size() const;
  // The bytes of a live (reserved or committed) entry of the current generation; kStale else.
  Result<std::span<std::byte>> entry_data(const EntryDescriptor& d) const;

 private:
  struct Slot {  // the owner's authoritative copy of one directory entry
    EntryState state = EntryState::kFree;
    uint64_t generation = 0;
    EntryKey key;
    uint32_t tokens = 0;
    uint64_t first_block = 0;
    uint64_t block_count = 0;
    uint64_t bytes = 0;
    uint64_t owner_id = 0;
    int64_t lease_expiry_ns = 0;
  };
  struct KeyHash {
    size_t operator()(const EntryKey& k) const;
  };

  KvRegion(RegionOptions options, std::unique_ptr<detail::Mapping> mapping);
  int64_t now() const;
  RegionHeader* header() const;
  DirectoryEntry* dir(uint32_t index) const;
  EntryDescriptor descriptor(uint32_t index) const;
  // Publishes slots_[index] into the shared directory inside a seqlock write section.
  void publish(uint32_t index, int64_t committed_ns);
  // Checks that `index` is in range and holds `state` at `generation`.
  Status check_slot(uint32_t index, uint64_t generation, EntryState state, const char* op) const;
  void free_slot(uint32_t index);  // any -> free; returns its blocks; caller holds mu_

  RegionOptions options_;
  std::unique_ptr<detail::Mapping> mapping_;
  mutable std::mutex mu_;
  BlockAllocator allocator_;
  std::vector<Slot> slots_;
  std::deque<uint32_t> free_slots_;  // FIFO: a freed slot is reused as late as possible
  std::set<uint32_t> reserved_;      // indices in kReserved (what reap_expired scans)
  std::unordered_map<EntryKey, uint32_t, KeyHash> committed_by_key_;
  uint32_t committed_count_ = 0;
  uint64_t committed_payload_ = 0;
  RegionStats counters_;
};

class KvRegionView {
 public:
  enum class Access { kReadWrite, kReadOnly };

  // Opens the named region and validates magic, format version, sizes and offsets (kCorrupt /
  // kVersionMismatch with the offending values), readiness (kUnavailable), then the fingerprint
  // (kVersionMismatch: "model fingerprint mismatch (...): region has ...; this process has ...").
  // kNotFound when no object has that name.
  static Result<std::unique_ptr<KvRegionView>> attach(const std::string& name,
                                                      const ModelFingerprint& expected,
                                                      Access access = Access::kReadWrite);
  ~KvRegionView();
  KvRegionView(const KvRegionView&) = delete;
  KvRegionView& operator=(const KvRegionView&) = delete;

  // The whole mapping (the worker cudaHostRegisters [base, base + size)).
  std::byte* base() const;
  size_t size() const;
  const ModelFingerprint& fingerprint() const { return fingerprint_; }
  uint64_t block_bytes() const { return block_bytes_; }
  uint64_t num_blocks() const { return num_blocks_; }
  uint32_t max_entries() const { return max_entries_; }
  uint64_t arena_offset() const { return arena_offset_; }

  // The descriptor's bytes after bounds checks (inside the arena, block-aligned, within the
  // mapping) and a check against the directory (same generation, reserved or committed, same
  // offset/bytes): kInvalidArgument / kStale otherwise. The span stays addressable while the view
  // lives; whether its content is still the entry's is what read_validate() answers.
  Result<std::span<std::byte>> entry_data(const EntryDescriptor& d) const;

  // Seqlock read section. nullopt when the index is out of range, the entry is not committed, or
  // its generation differs (also when the owner is mid-change for longer than a short spin).
  std::optional<uint64_t> read_begin(uint32_t index, uint64_t generation) const;
  // True when the entry did not change since read_begin returned `seq`: what was read in between
  // is the committed content.
  bool read_validate(uint32_t index, uint64_t seq) const;

  // A consistent copy of directory entry `index` (kNotFound when out of range, kUnavailable when
  // it kept changing).
  Result<EntryInfo> entry_info(uint32_t index) const;

  // Writer-side check before (and during) filling a reservation: the entry is still reserved for
  // this generation and its lease has not run out at `now_ns`. kStale / kLeaseExpired otherwise.
  Status check_writable(const EntryDescriptor& d, int64_t now_ns) const;

  // Whether the region's name still names the mapped object. False once a restarted manager made
  // a new region under the name (or removed it): this mapping is then a dead region, whose
  // descriptors must not be matched against the new manager's answers; attach again.
  bool linked() const;
  const std::string& name() const { return name_; }

 private:
  KvRegionView() = default;
  const DirectoryEntry* dir(uint32_t index) const;

  std::unique_ptr<detail::Mapping> mapping_;
  std::string name_;
  ModelFingerprint fingerprint_;
  uint64_t block_bytes_ = 0;
  uint64_t num_blocks_ = 0;
  uint32_t max_entries_ = 0;
  uint64_t directory_offset_ = 0;
  uint64_t arena_offset_ = 0;
};

}  // namespace keep::kv
