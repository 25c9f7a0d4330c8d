#include "services/manager/durability/wal_reader.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <optional>

#include "services/manager/durability/file_util.h"
#include "services/manager/durability/wal_format.h"
#include "shared/common/log.h"

namespace keep::manager {
namespace {

using namespace wal;  // NOLINT(google-build-using-namespace): format constants

constexpr const char* kLog = "wal";

std::string u64s(uint64_t v) { return std::to_string(v); }

// Verifies the record at `pos` completely (bounds, length limit, type, checksum). On success
// stores its LSN and payload length.
bool record_at(std::string_view bytes, uint64_t pos, uint64_t* lsn, uint32_t* len,
               std::string* problem) {
  const uint64_t size = bytes.size();
  const uint64_t remain = size - pos;
  const char* p = bytes.data() + pos;
  if (remain < kRecordHeaderBytes) {
    if (problem) *problem = "partial record header (" + u64s(remain) + " bytes)";
    return false;
  }
  uint32_t n = get_u32(p + kRecordLengthOffset);
  if (n > kMaxPayloadBytes) {
    if (problem) *problem = "record length " + u64s(n) + " exceeds the format limit";
    return false;
  }
  if (remain - kRecordHeaderBytes < n) {
    if (problem) {
      *problem = "short payload (" + u64s(n) + " bytes announced, " +
                 u64s(remain - kRecordHeaderBytes) + " present)";
    }
    return false;
  }
  uint32_t stored = crc32c_unmask(get_u32(p + kRecordCrcOffset));
  uint32_t actual = crc32c(p + kRecordLengthOffset, kRecordHeaderBytes - kRecordLengthOffset + n);
  if (stored != actual) {
    if (problem) *problem = "checksum mismatch";
    return false;
  }
  *lsn = get_u64(p + kRecordLsnOffset);
  *len = n;
  return true;
}

// The first offset >= start where a fully valid record with an LSN in (after_lsn, after_lsn +
// plausible] begins. The LSN window keeps the byte-by-byte search cheap: random bytes almost
// never pass it, so the checksum runs rarely.
std::optional<uint64_t> find_valid_record(std::string_view bytes, uint64_t start,
                                          uint64_t after_lsn) {
  const uint64_t size = bytes.size();
  if (size < kRecordHeaderBytes) return std::nullopt;
  const uint64_t window = (size - std::min(start, size)) / kRecordHeaderBytes + 1;
  for (uint64_t pos = start; pos + kRecordHeaderBytes <= size; ++pos) {
    const char* p = bytes.data() + pos;
    if (static_cast<uint8_t>(p[kRecordTypeOffset]) != static_cast<uint8_t>(RecordType::kFull)) {
      continue;
    }
    uint64_t lsn = get_u64(p + kRecordLsnOffset);
    if (lsn <= after_lsn || lsn - after_lsn > window) continue;
    uint64_t got_lsn = 0;
    uint32_t len = 0;
    if (record_at(bytes, pos, &got_lsn, &len, nullptr)) return pos;
  }
  return std::nullopt;
}

bool dir_exists(const std::string& dir) {
  struct stat st {};
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Applies the tail rule to the last file of the WAL. `removed` tells whether the whole file went.
Status repair_last_file(const std::string& dir, const std::string& name, uint64_t file_size,
                        const WalSegmentScan& scan, uint64_t* dropped, bool* removed) {
  *dropped = 0;
  *removed = false;
  if (!scan.bad_tail) return Status::ok();
  const std::string path = fsutil::join(dir, name);
  if (scan.valid_after_bad) {
    return Status(Code::kCorrupt,
                  "corrupt WAL record in '" + path + "' at offset " + u64s(scan.valid_end) + " (" +
                      scan.problem + ") followed by a valid record at offset " +
                      u64s(scan.valid_after_offset) +
                      "; refusing to drop acknowledged data (see docs/wal-format.md)");
  }
  *dropped = file_size - scan.valid_end;
  if (!scan.header_ok) {
    KEEP_RETURN_IF_ERROR(fsutil::remove_file(path));
    KEEP_RETURN_IF_ERROR(fsutil::fsync_dir(dir));
    *removed = true;
    KEEP_LOG_WARN(kLog, "removed '%s': torn file header (%s), dropped %" PRIu64 " bytes",
                  path.c_str(), scan.problem.c_str(), *dropped);
    return Status::ok();
  }
  KEEP_RETURN_IF_ERROR(fsutil::truncate_file(path, scan.valid_end));
  KEEP_LOG_WARN(kLog,
                "truncated torn tail of '%s' at offset %" PRIu64 ": dropped %" PRIu64 " bytes (%s)",
                path.c_str(), scan.valid_end, *dropped, scan.problem.c_str());
  return Status::ok();
}

Status corrupt_non_last(const std::string& path, const WalSegmentScan& scan) {
  return Status(Code::kCorrupt, "corrupt WAL file '" + path + "' at offset " +
                                    u64s(scan.valid_end) + " (" + scan.problem +
                                    "); it is not the last file, so this is not a torn tail");
}

}  // namespace

Result<WalSegmentScan> scan_wal_segment(std::string_view bytes, uint64_t name_first_lsn) {
  WalSegmentScan s;
  const uint64_t size = bytes.size();
  const uint64_t before_first = name_first_lsn == 0 ? 0 : name_first_lsn - 1;

  // ---- file header
  bool header_valid = size >= kFileHeaderBytes;
  if (header_valid) {
    const char* h = bytes.data();
    header_valid =
        get_u64(h + kFileHeaderMagicOffset) == kFileMagic &&
        crc32c_unmask(get_u32(h + kFileHeaderCrcOffset)) == crc32c(h, kFileHeaderCrcOffset);
  }
  if (!header_valid) {
    s.bad_tail = true;
    s.problem = size < kFileHeaderBytes ? "short file header (" + u64s(size) + " of " +
                                              u64s(kFileHeaderBytes) + " bytes)"
                                        : std::string("bad file header (magic or checksum)");
    if (auto at = find_valid_record(bytes, 1, before_first)) {
      s.valid_after_bad = true;
      s.valid_after_offset = *at;
    }
    return s;
  }
  const char* h = bytes.data();
  uint32_t version = get_u32(h + kFileHeaderVersionOffset);
  if (version != kFormatVersion) {
    return Status(Code::kVersionMismatch, "WAL format version " + u64s(version) +
                                              ", this build reads version " + u64s(kFormatVersion));
  }
  if (get_u32(h + kFileHeaderSizeOffset) != kFileHeaderBytes) {
    return Status(Code::kCorrupt,
                  "WAL file header size field is " + u64s(get_u32(h + kFileHeaderSizeOffset)));
  }
  uint64_t first_lsn = get_u64(h + kFileHeaderFirstLsnOffset);
  if (first_lsn != name_first_lsn || first_lsn == 0) {
    return Status(Code::kCorrupt, "WAL file header says first LSN " + u64s(first_lsn) +
                                      ", its name says " + u64s(name_first_lsn));
  }
  s.header_ok = true;

  // ---- records
  uint64_t off = kFileHeaderBytes;
  uint64_t prev = first_lsn - 1;
  while (off < size) {
    uint64_t lsn = 0;
    uint32_t len = 0;
    if (!record_at(bytes, off, &lsn, &len, &s.problem)) {
      s.bad_tail = true;
      break;
    }
    const char* p = bytes.data() + off;
    if (static_cast<uint8_t>(p[kRecordTypeOffset]) != static_cast<uint8_t>(RecordType::kFull)) {
      return Status(Code::kCorrupt, "record of unknown type " +
                                        u64s(static_cast<uint8_t>(p[kRecordTypeOffset])) +
                                        " at offset " + u64s(off));
    }
    if (lsn != prev + 1) {
      return Status(Code::kCorrupt, "LSN gap: expected " + u64s(prev + 1) + ", found " + u64s(lsn) +
                                        " at offset " + u64s(off));
    }
    s.records.push_back(WalRecordRef{lsn, off, std::string_view(p + kRecordHeaderBytes, len)});
    prev = lsn;
    off += kRecordHeaderBytes + len;
  }
  s.valid_end = off;
  if (s.bad_tail) {
    if (auto at = find_valid_record(bytes, off + 1, prev)) {
      s.valid_after_bad = true;
      s.valid_after_offset = *at;
    }
  }
  return s;
}

Result<std::vector<WalSegmentFile>> list_wal_segments(const std::string& dir) {
  KEEP_ASSIGN_OR_RETURN(std::vector<std::string> names, fsutil::list_dir(dir));
  std::vector<WalSegmentFile> segs;
  for (auto& n : names) {
    uint64_t lsn = 0;
    if (parse_wal_file_name(n, &lsn)) segs.push_back(WalSegmentFile{lsn, std::move(n)});
  }
  std::sort(segs.begin(), segs.end(), [](const WalSegmentFile& a, const WalSegmentFile& b) {
    return a.first_lsn < b.first_lsn;
  });
  return segs;
}

Status wal_replay(const std::string& dir, uint64_t from_lsn, const ReplayFn& fn,
                  ReplayStats* stats_out) {
  ReplayStats local;
  ReplayStats& st = stats_out ? *stats_out : local;
  st = ReplayStats{};
  const uint64_t from = std::max<uint64_t>(from_lsn, 1);
  st.next_lsn = from;
  if (!dir_exists(dir)) return Status::ok();
  KEEP_ASSIGN_OR_RETURN(std::vector<WalSegmentFile> segs, list_wal_segments(dir));
  const size_t n = segs.size();

  // Files wholly below from_lsn (the next file starts at or before it) are not read.
  size_t start = 0;
  while (start + 1 < n && segs[start + 1].first_lsn <= from) ++start;
  st.files_skipped = start;

  uint64_t expected = from;
  uint64_t last_seen = 0;
  for (size_t i = start; i < n; ++i) {
    const std::string path = fsutil::join(dir, segs[i].name);
    KEEP_ASSIGN_OR_RETURN(std::string bytes, fsutil::read_file(path));
    st.files_read++;
    st.bytes_read += bytes.size();
    Result<WalSegmentScan> scanned = scan_wal_segment(bytes, segs[i].first_lsn);
    if (!scanned.is_ok()) return scanned.status().with_context("WAL file '" + path + "'");
    const WalSegmentScan& scan = *scanned;
    if (scan.bad_tail) {
      if (i + 1 < n) return corrupt_non_last(path, scan);
      bool removed = false;
      KEEP_RETURN_IF_ERROR(
          repair_last_file(dir, segs[i].name, bytes.size(), scan, &st.truncated_bytes, &removed));
      st.truncated_file = segs[i].name;
    }
    for (const WalRecordRef& r : scan.records) {
      if (r.lsn <= last_seen) {
        return Status(Code::kCorrupt, "LSN " + u64s(r.lsn) + " in '" + path + "' at offset " +
                                          u64s(r.offset) + " does not follow LSN " +
                                          u64s(last_seen) + " of the previous file");
      }
      last_seen = r.lsn;
      if (r.lsn < from) {
        st.records_skipped++;
        continue;
      }
      if (r.lsn != expected) {
        return Status(Code::kCorrupt, "LSN gap: expected " + u64s(expected) + ", found " +
                                          u64s(r.lsn) + " in '" + path + "' at offset " +
                                          u64s(r.offset));
      }
      Status s = fn(r.lsn, r.payload);
      if (!s.is_ok()) {
        return s.with_context("replaying WAL record " + u64s(r.lsn) + " ('" + path + "' offset " +
                              u64s(r.offset) + ")");
      }
      expected++;
      st.records_replayed++;
    }
  }
  st.last_lsn = last_seen;
  st.next_lsn = std::max(last_seen + 1, from);
  return Status::ok();
}

Result<WalTail> recover_wal_tail(const std::string& dir) {
  WalTail tail;
  if (!dir_exists(dir)) return tail;
  for (;;) {
    KEEP_ASSIGN_OR_RETURN(std::vector<WalSegmentFile> segs, list_wal_segments(dir));
    if (segs.empty()) return tail;
    const WalSegmentFile& last = segs.back();
    const std::string path = fsutil::join(dir, last.name);
    KEEP_ASSIGN_OR_RETURN(std::string bytes, fsutil::read_file(path));
    Result<WalSegmentScan> scanned = scan_wal_segment(bytes, last.first_lsn);
    if (!scanned.is_ok()) return scanned.status().with_context("WAL file '" + path + "'");
    uint64_t dropped = 0;
    bool removed = false;
    KEEP_RETURN_IF_ERROR(
        repair_last_file(dir, last.name, bytes.size(), *scanned, &dropped, &removed));
    if (removed) continue;  // the previous file is now the last one
    tail.has_files = true;
    tail.last_file_first_lsn = last.first_lsn;
    tail.last_file_name = last.name;
    tail.last_file_valid_end = scanned->valid_end;
    tail.last_file_records = scanned->records.size();
    tail.last_lsn = scanned->records.empty() ? last.first_lsn - 1 : scanned->records.back().lsn;
    return tail;
  }
}

}  // namespace keep::manager
