// Snapshot files: the store's serialized state as of a WAL LSN, written atomically, checksummed,
// the newest two kept. Layout: wal_format.h and docs/wal-format.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"

namespace keep::manager {

inline constexpr size_t kSnapshotsKept = 2;

struct Snapshot {
  uint64_t last_lsn = 0;  // every WAL record <= last_lsn is reflected in the payload
  std::string payload;
  std::string file;  // the file name it came from
};

struct SnapshotWriteInfo {
  std::string path;
  uint64_t bytes = 0;
  // LSN of the oldest snapshot still kept. WAL files below oldest_retained_lsn + 1 may be
  // dropped without losing the fallback to that snapshot (WalWriter::drop_segments_before).
  uint64_t oldest_retained_lsn = 0;
};

// Writes snapshot-<last_lsn>.snap atomically: a .tmp file, fsync, rename, fsync of the directory
// (the fsyncs are skipped when fsync is false, for tests). Then prunes all but the newest
// kSnapshotsKept snapshots and leftover .tmp files. kInvalidArgument when a newer snapshot exists.
Result<SnapshotWriteInfo> write_snapshot(const std::string& dir, uint64_t last_lsn,
                                         std::string_view payload, bool fsync = true);

// The newest snapshot whose checksums verify. A corrupt newer one is skipped with a KEEP_LOG_WARN
// (falls back to the previous one). nullopt when there is none (or no directory); kCorrupt when
// snapshot files exist but none is valid.
Result<std::optional<Snapshot>> read_latest_snapshot(const std::string& dir);

// The LSNs of the snapshot files in `dir`, ascending (validity not checked).
Result<std::vector<uint64_t>> list_snapshots(const std::string& dir);

// Decodes a whole snapshot file held in memory; `name_lsn` is the LSN in its name.
// kCorrupt (size, magic, checksums, LSN differs from the name) or kVersionMismatch.
Result<Snapshot> decode_snapshot(std::string_view bytes, uint64_t name_lsn);
// Encodes header + payload (what write_snapshot writes).
std::string encode_snapshot(uint64_t last_lsn, std::string_view payload);
// Only the 48-byte header for `payload`.
std::string encode_snapshot_header(uint64_t last_lsn, std::string_view payload);

}  // namespace keep::manager
