// Reading the write-ahead log back: the in-memory segment parser, the torn-tail repair shared with
// WalWriter::open, and wal_replay() used by recovery. Recovery rules: docs/wal-format.md.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"

namespace keep::manager {

// One record found in a segment's bytes; `payload` points into the scanned buffer.
struct WalRecordRef {
  uint64_t lsn = 0;
  uint64_t offset = 0;  // of the record header in the file
  std::string_view payload;
};

// What scan_wal_segment() found in one file's bytes.
struct WalSegmentScan {
  bool header_ok = false;             // the 32-byte file header is present and valid
  std::vector<WalRecordRef> records;  // every valid record from the start, in order
  uint64_t valid_end = 0;             // offset just past the last valid record (or the header)
  bool bad_tail = false;              // bytes after valid_end that do not form a valid record
  std::string problem;              // what is wrong at valid_end when bad_tail ("bad checksum" ...)
  bool valid_after_bad = false;     // a valid record with a later LSN exists after the bad bytes:
                                    // corruption in the middle, not a torn tail
  uint64_t valid_after_offset = 0;  // where that record starts
};

// Parses a whole WAL file held in memory. `name_first_lsn` is the LSN in the file's name; the
// header must agree. Never reads outside `bytes`.
// Errors: kVersionMismatch (valid header of another format version); kCorrupt (header's first LSN
// differs from the name, or a record with a valid checksum breaks LSN continuity).
// A torn or corrupt tail is NOT an error here: it is reported through bad_tail/valid_after_bad so
// the caller decides (truncate the last file, refuse anything else).
Result<WalSegmentScan> scan_wal_segment(std::string_view bytes, uint64_t name_first_lsn);

// The WAL files of `dir` as (first LSN, file name), sorted by first LSN. Other names are ignored.
struct WalSegmentFile {
  uint64_t first_lsn = 0;
  std::string name;
};
Result<std::vector<WalSegmentFile>> list_wal_segments(const std::string& dir);

struct ReplayStats {
  uint64_t files_read = 0;
  uint64_t files_skipped = 0;     // wholly below from_lsn, not read
  uint64_t records_replayed = 0;  // delivered to the callback (lsn >= from_lsn)
  uint64_t records_skipped = 0;   // verified but below from_lsn
  uint64_t bytes_read = 0;
  uint64_t last_lsn = 0;         // the last valid record's LSN in the WAL (0: none read)
  uint64_t next_lsn = 0;         // max(last_lsn + 1, from_lsn): what the writer continues with
  uint64_t truncated_bytes = 0;  // torn tail dropped from the last file
  std::string truncated_file;    // which file was truncated or removed ("" when none)
};

using ReplayFn = std::function<Status(uint64_t lsn, std::string_view payload)>;

// Replays every record with lsn >= from_lsn (0 is taken as 1) in order. Records must be dense from
// from_lsn on: the first delivered record must carry exactly from_lsn (when any record >= from_lsn
// exists) and each next one the previous + 1, else kCorrupt. A torn/corrupt tail of the LAST file
// with no valid record after it is truncated (ftruncate + fdatasync, KEEP_LOG_WARN with the byte
// count); corruption anywhere else is kCorrupt naming the file and offset. An error returned by
// `fn` aborts replay and comes back with the LSN as context. A missing directory is an empty WAL.
Status wal_replay(const std::string& dir, uint64_t from_lsn, const ReplayFn& fn,
                  ReplayStats* stats = nullptr);

// Where the WAL of `dir` ends, after repairing a torn tail of its last file exactly as wal_replay
// does (used by WalWriter::open; needs no prior replay).
struct WalTail {
  bool has_files = false;
  uint64_t last_file_first_lsn = 0;
  std::string last_file_name;
  uint64_t last_file_valid_end = 0;  // bytes of the last file after repair
  uint64_t last_file_records = 0;
  uint64_t last_lsn = 0;  // last record's LSN; (last_file_first_lsn - 1) when it has none
};
Result<WalTail> recover_wal_tail(const std::string& dir);

}  // namespace keep::manager
