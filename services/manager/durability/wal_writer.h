// WalWriter: appends opaque payloads to the write-ahead log with group commit.
//
//   auto w = WalWriter::open({.dir = "/var/lib/keep/wal", .next_lsn = stats.next_lsn});
//   for (request in batch) lsn = w->append(record);   // buffered in user space
//   w->sync();                                        // one write(2) + ONE fdatasync for all
//   reply to the batch
//
// Not thread-safe: the server serialises calls. After any I/O error the writer is failed: every
// later call returns that error (a failed fdatasync leaves the page cache in an unknown state, so
// retrying it could report unwritten data as durable).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "services/manager/durability/file_util.h"
#include "shared/common/status.h"

namespace keep::manager {

struct WalOptions {
  std::string dir;    // created when missing (its parent must exist)
  bool fsync = true;  // false: never fdatasync/fsync (benchmarks and tests that say so)
  uint64_t segment_bytes = 64ull << 20;   // rotate when the next record would pass this size
  uint32_t max_record_bytes = 16u << 20;  // larger appends fail with kTooLarge (<= 64 MiB)
  // LSN of the next append. 0: found from the files (last valid record + 1, or 1 when empty).
  // Recovery passes ReplayStats::next_lsn; a value above the WAL's end (a snapshot newer than the
  // log) starts a new file there; a value below it is kInvalidArgument.
  uint64_t next_lsn = 0;
  size_t flush_bytes = 1u << 20;  // write(2) the user-space buffer early when it grows past this
  // Called with the seconds each fdatasync took (the metrics layer records
  // keep_manager_wal_fsync_seconds). Not called when fsync is false.
  std::function<void(double seconds)> on_sync;
};

struct WalWriterStats {
  uint64_t records = 0;  // appended by this writer
  uint64_t bytes = 0;    // framed bytes appended by this writer
  uint64_t syncs = 0;    // fdatasync calls (sync() and rotations)
  uint64_t rotations = 0;
  uint64_t segments_dropped = 0;
  uint64_t next_lsn = 0;
  uint64_t durable_lsn = 0;  // every record <= this is durable (written, and fsynced if fsync)
  double last_sync_seconds = 0;
};

class WalWriter {
 public:
  // Opens or creates the WAL in options.dir. Repairs a torn tail of the last file first (same rule
  // and log line as wal_replay), so it is safe without a prior replay.
  static Result<std::unique_ptr<WalWriter>> open(WalOptions options);
  ~WalWriter();  // writes buffered records (no fsync): nothing is lost that a crash would keep
  WalWriter(const WalWriter&) = delete;
  WalWriter& operator=(const WalWriter&) = delete;

  // Frames `payload` as the next record and returns its LSN. Buffered: durable only after sync().
  // kTooLarge above max_record_bytes (nothing appended, the LSN is not consumed).
  Result<uint64_t> append(std::string_view payload);

  // Makes every record appended so far durable: one write(2) of the buffer and ONE fdatasync
  // (group commit). A no-op when nothing was appended since the last sync.
  Status sync();

  // Deletes the files all of whose records have LSN < lsn (after a snapshot at S, pass S + 1; to
  // keep the fallback to the previous snapshot possible, pass the OLDER retained snapshot's
  // LSN + 1, see SnapshotWriteInfo). Never deletes the file being written. Returns files removed.
  Result<size_t> drop_segments_before(uint64_t lsn);

  uint64_t next_lsn() const { return next_lsn_; }
  uint64_t durable_lsn() const { return durable_lsn_; }
  WalWriterStats stats() const;
  const std::string& dir() const { return options_.dir; }

 private:
  explicit WalWriter(WalOptions options);
  Status start_file(uint64_t first_lsn);  // creates wal-<first_lsn>.log (header buffered)
  Status rotate();
  Status flush();  // write(2) the buffer
  Status fdatasync_timed();
  Status fail(Status s);

  WalOptions options_;
  fsutil::UniqueFd fd_;
  std::string path_;
  std::vector<uint64_t> files_;  // first LSN of every file, ascending; back() is being written
  std::string buffer_;           // framed records not yet written
  uint64_t file_bytes_ = 0;      // written + buffered bytes of the current file
  uint64_t file_records_ = 0;    // records in the current file
  uint64_t next_lsn_ = 1;
  uint64_t written_lsn_ = 0;  // last LSN handed to write(2)
  uint64_t durable_lsn_ = 0;
  bool dirty_ = false;  // bytes written or buffered since the last fdatasync
  Status failed_;
  WalWriterStats stats_;
};

}  // namespace keep::manager
