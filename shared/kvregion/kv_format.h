// Byte layout of the shared KV region. docs/shm-format.md describes it in prose; every size and
// offset here is pinned by a static_assert so the two cannot drift apart silently.
//
//   offset 0                 RegionHeader (kHeaderBytes = 4096, the rest of the page is zero)
//   header.directory_offset  DirectoryEntry[max_entries] (128 bytes each, 64-byte aligned)
//   header.arena_offset      arena: num_blocks blocks of block_bytes (aligned to kArenaAlignment)
//   header.region_bytes      end (== arena_offset + num_blocks * block_bytes)
//
// Fields that change after initialisation are only accessed through std::atomic_ref (see
// kv_region.cpp); all other fields are written once by the creator before it publishes
// `init_state = kInitReady` with release semantics.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "shared/kvregion/model_fingerprint.h"

namespace keep::kv {

// "KEEPKV01": identifies a KEEP KV region; the digits change only with incompatible layouts.
inline constexpr char kRegionMagic[8] = {'K', 'E', 'E', 'P', 'K', 'V', '0', '1'};
inline constexpr uint32_t kFormatVersion = 1;

inline constexpr uint64_t kHeaderBytes = 4096;        // header page; directory starts here
inline constexpr uint64_t kArenaAlignment = 1 << 16;  // 64 KiB: DMA- and huge-page friendly
inline constexpr uint64_t kBlockAlignment = 4096;     // block_bytes is a multiple of this
inline constexpr uint64_t kMaxBlockBytes = 1ull << 30;
inline constexpr uint32_t kMaxEntries = 1u << 24;

// RegionHeader::init_state values.
inline constexpr uint32_t kInitUnset = 0;           // being created (ftruncate zeroes it)
inline constexpr uint32_t kInitReady = 0x52454459;  // "READ(Y)": the header is complete

// DirectoryEntry::state values.
enum class EntryState : uint32_t { kFree = 0, kReserved = 1, kCommitted = 2 };

enum class EntryKind : uint8_t { kSegment = 0, kGroup = 1 };

// What a KV entry caches. The manager fills it; the region only stores and compares it.
struct EntryKey {
  uint64_t agent_hash = 0;               // 0  fnv1a_64 of the agent namespace
  uint64_t object_id = 0;                // 8  segment id (kSegment) or group id (kGroup)
  uint64_t object_version = 0;           // 16 segment version (kSegment); 0 for kGroup
  uint64_t group_version = 0;            // 24 group version the KV was computed at
  EntryKind kind = EntryKind::kSegment;  // 32
  uint8_t reserved[7] = {};              // 33 (zero)

  friend bool operator==(const EntryKey& a, const EntryKey& b) {
    return a.agent_hash == b.agent_hash && a.object_id == b.object_id &&
           a.object_version == b.object_version && a.group_version == b.group_version &&
           a.kind == b.kind;
  }
};
static_assert(std::is_standard_layout_v<EntryKey> && std::is_trivially_copyable_v<EntryKey>);
static_assert(sizeof(EntryKey) == 40);
static_assert(offsetof(EntryKey, object_id) == 8);
static_assert(offsetof(EntryKey, object_version) == 16);
static_assert(offsetof(EntryKey, group_version) == 24);
static_assert(offsetof(EntryKey, kind) == 32);

struct RegionHeader {
  char magic[8];                 // 0   kRegionMagic
  uint32_t format_version;       // 8   kFormatVersion
  uint32_t header_bytes;         // 12  sizeof(RegionHeader)
  uint64_t region_bytes;         // 16  size of the whole shm object
  uint64_t block_bytes;          // 24
  uint64_t num_blocks;           // 32
  uint32_t max_entries;          // 40
  uint32_t entry_bytes;          // 44  sizeof(DirectoryEntry)
  uint64_t directory_offset;     // 48  == kHeaderBytes
  uint64_t arena_offset;         // 56  multiple of kArenaAlignment
  uint64_t arena_bytes;          // 64  num_blocks * block_bytes
  int64_t creator_pid;           // 72
  int64_t created_unix_ns;       // 80  CLOCK_REALTIME, informational
  uint32_t init_state;           // 88  atomic; kInitReady once the header is complete
  uint32_t reserved0;            // 92
  int64_t owner_pid;             // 96  atomic; pid of the process that owns it now
  uint64_t reserved1[3];         // 104
  ModelFingerprint fingerprint;  // 128
  uint8_t reserved2[256];        // 256 (zero; room for later fields)
};
static_assert(std::is_standard_layout_v<RegionHeader> &&
              std::is_trivially_copyable_v<RegionHeader>);
static_assert(sizeof(RegionHeader) == 512);
static_assert(sizeof(RegionHeader) <= kHeaderBytes);
static_assert(offsetof(RegionHeader, format_version) == 8);
static_assert(offsetof(RegionHeader, header_bytes) == 12);
static_assert(offsetof(RegionHeader, region_bytes) == 16);
static_assert(offsetof(RegionHeader, block_bytes) == 24);
static_assert(offsetof(RegionHeader, num_blocks) == 32);
static_assert(offsetof(RegionHeader, max_entries) == 40);
static_assert(offsetof(RegionHeader, entry_bytes) == 44);
static_assert(offsetof(RegionHeader, directory_offset) == 48);
static_assert(offsetof(RegionHeader, arena_offset) == 56);
static_assert(offsetof(RegionHeader, arena_bytes) == 64);
static_assert(offsetof(RegionHeader, creator_pid) == 72);
static_assert(offsetof(RegionHeader, created_unix_ns) == 80);
static_assert(offsetof(RegionHeader, init_state) == 88);
static_assert(offsetof(RegionHeader, owner_pid) == 96);
static_assert(offsetof(RegionHeader, fingerprint) == 128);
static_assert(offsetof(RegionHeader, init_state) % 4 == 0);
static_assert(offsetof(RegionHeader, owner_pid) % 8 == 0);

// One directory slot. Written only by the owner, inside a seqlock write section (seq odd), with
// relaxed atomic stores; read by any process inside a seqlock read section with relaxed loads.
struct alignas(64) DirectoryEntry {
  uint64_t seq;             // 0   seqlock: odd while the owner changes the entry
  uint64_t generation;      // 8   +1 on every reserve of this slot; 0 = never used
  uint32_t state;           // 16  EntryState
  uint32_t tokens;          // 20
  EntryKey key;             // 24  (40 bytes)
  uint64_t first_block;     // 64  index of the first arena block
  uint64_t block_count;     // 72
  uint64_t bytes;           // 80  tokens * fingerprint.bytes_per_token()
  uint64_t owner_id;        // 88  the writer the entry was reserved for (a worker id)
  int64_t lease_expiry_ns;  // 96  CLOCK_MONOTONIC; meaningful while kReserved
  int64_t committed_ns;     // 104 CLOCK_MONOTONIC time of commit; 0 otherwise
  uint64_t reserved[2];     // 112
};
static_assert(std::is_standard_layout_v<DirectoryEntry>);
static_assert(std::is_trivially_copyable_v<DirectoryEntry>);
static_assert(sizeof(DirectoryEntry) == 128);
static_assert(offsetof(DirectoryEntry, generation) == 8);
static_assert(offsetof(DirectoryEntry, state) == 16);
static_assert(offsetof(DirectoryEntry, tokens) == 20);
static_assert(offsetof(DirectoryEntry, key) == 24);
static_assert(offsetof(DirectoryEntry, first_block) == 64);
static_assert(offsetof(DirectoryEntry, block_count) == 72);
static_assert(offsetof(DirectoryEntry, bytes) == 80);
static_assert(offsetof(DirectoryEntry, owner_id) == 88);
static_assert(offsetof(DirectoryEntry, lease_expiry_ns) == 96);
static_assert(offsetof(DirectoryEntry, committed_ns) == 104);
static_assert(kHeaderBytes % alignof(DirectoryEntry) == 0);

// The shared fields are accessed with std::atomic_ref; it must be lock-free (a lock inside a
// shared mapping would not be shared between processes) and the fields suitably aligned.
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free);
static_assert(std::atomic_ref<int64_t>::is_always_lock_free);
static_assert(std::atomic_ref<uint64_t>::required_alignment <= 8);
static_assert(std::atomic_ref<uint32_t>::required_alignment <= 4);
static_assert(std::atomic_ref<int64_t>::required_alignment <= 8);

// Layout arithmetic shared by the creator and the validator.
inline constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
inline constexpr uint64_t directory_bytes(uint32_t max_entries) {
  return static_cast<uint64_t>(max_entries) * sizeof(DirectoryEntry);
}
inline constexpr uint64_t arena_offset_for(uint32_t max_entries) {
  return align_up(kHeaderBytes + directory_bytes(max_entries), kArenaAlignment);
}

// The only thing about an entry that crosses processes (in protocol messages). `offset` is the
// byte offset of the entry's first byte from the start of the mapping (not of the arena).
struct EntryDescriptor {
  uint32_t index = 0;
  uint64_t generation = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint32_t tokens = 0;

  friend bool operator==(const EntryDescriptor&, const EntryDescriptor&) = default;
};

}  // namespace keep::kv
