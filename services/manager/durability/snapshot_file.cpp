#include "services/manager/durability/snapshot_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>

#include "services/manager/durability/file_util.h"
#include "services/manager/durability/wal_format.h"
#include "shared/common/log.h"

namespace keep::manager {
namespace {

using namespace wal;  // NOLINT(google-build-using-namespace): format constants

constexpr const char* kLog = "snapshot";
constexpr std::string_view kTmpSuffix = ".tmp";

bool is_tmp_snapshot(std::string_view n) {
  return n.size() > kSnapshotPrefix.size() + kTmpSuffix.size() &&
         n.substr(0, kSnapshotPrefix.size()) == kSnapshotPrefix &&
         n.substr(n.size() - kTmpSuffix.size()) == kTmpSuffix;
}

}  // namespace

std::string encode_snapshot_header(uint64_t last_lsn, std::string_view payload) {
  std::string out(kSnapshotHeaderBytes, '\0');
  char* h = out.data();
  put_u64(h, kSnapshotMagic);
  put_u32(h + 8, kSnapshotVersion);
  put_u32(h + 12, static_cast<uint32_t>(kSnapshotHeaderBytes));
  put_u64(h + kSnapshotLsnOffset, last_lsn);
  put_u64(h + kSnapshotPayloadBytesOffset, payload.size());
  put_u32(h + kSnapshotPayloadCrcOffset, crc32c_mask(crc32c(payload)));
  put_u32(h + kSnapshotHeaderCrcOffset, crc32c_mask(crc32c(h, kSnapshotHeaderCrcOffset)));
  return out;
}

std::string encode_snapshot(uint64_t last_lsn, std::string_view payload) {
  std::string out = encode_snapshot_header(last_lsn, payload);
  out.append(payload.data(), payload.size());
  return out;
}

Result<Snapshot> decode_snapshot(std::string_view bytes, uint64_t name_lsn) {
  if (bytes.size() < kSnapshotHeaderBytes) {
    return Status(Code::kCorrupt, "snapshot is " + std::to_string(bytes.size()) +
                                      " bytes, shorter than its header");
  }
  const char* h = bytes.data();
  if (get_u64(h) != kSnapshotMagic) return Status(Code::kCorrupt, "bad snapshot magic");
  if (crc32c_unmask(get_u32(h + kSnapshotHeaderCrcOffset)) != crc32c(h, kSnapshotHeaderCrcOffset)) {
    return Status(Code::kCorrupt, "snapshot header checksum mismatch");
  }
  if (get_u32(h + 8) != kSnapshotVersion) {
    return Status(Code::kVersionMismatch,
                  "snapshot format version " + std::to_string(get_u32(h + 8)) +
                      ", this build reads version " + std::to_string(kSnapshotVersion));
  }
  if (get_u32(h + 12) != kSnapshotHeaderBytes) {
    return Status(Code::kCorrupt, "snapshot header size field is wrong");
  }
  uint64_t lsn = get_u64(h + kSnapshotLsnOffset);
  if (lsn != name_lsn) {
    return Status(Code::kCorrupt, "snapshot header says LSN " + std::to_string(lsn) +
                                      ", its name says " + std::to_string(name_lsn));
  }
  uint64_t n = get_u64(h + kSnapshotPayloadBytesOffset);
  if (n != bytes.size() - kSnapshotHeaderBytes) {
    return Status(Code::kCorrupt, "snapshot payload is " +
                                      std::to_string(bytes.size() - kSnapshotHeaderBytes) +
                                      " bytes, its header says " + std::to_string(n));
  }
  std::string_view payload = bytes.substr(kSnapshotHeaderBytes);
  if (crc32c_unmask(get_u32(h + kSnapshotPayloadCrcOffset)) != crc32c(payload)) {
    return Status(Code::kCorrupt, "snapshot payload checksum mismatch");
  }
  Snapshot s;
  s.last_lsn = lsn;
  s.payload.assign(payload.data(), payload.size());
  return s;
}

Result<std::vector<uint64_t>> list_snapshots(const std::string& dir) {
  KEEP_ASSIGN_OR_RETURN(std::vector<std::string> names, fsutil::list_dir(dir));
  std::vector<uint64_t> lsns;
  for (const auto& n : names) {
    uint64_t lsn = 0;
    if (parse_snapshot_file_name(n, &lsn)) lsns.push_back(lsn);
  }
  std::sort(lsns.begin(), lsns.end());
  return lsns;
}

Result<SnapshotWriteInfo> write_snapshot(const std::string& dir, uint64_t last_lsn,
                                         std::string_view payload, bool fsync) {
  KEEP_RETURN_IF_ERROR(fsutil::ensure_dir(dir).with_context("writing snapshot"));
  KEEP_ASSIGN_OR_RETURN(std::vector<uint64_t> existing, list_snapshots(dir));
  if (!existing.empty() && existing.back() > last_lsn) {
    return Status(Code::kInvalidArgument, "snapshot at LSN " + std::to_string(last_lsn) +
                                              " is older than the existing snapshot at LSN " +
                                              std::to_string(existing.back()));
  }
  const std::string name = snapshot_file_name(last_lsn);
  const std::string path = fsutil::join(dir, name);
  const std::string tmp = path + std::string(kTmpSuffix);
  {
    fsutil::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd.valid()) return fsutil::errno_status("creating snapshot", tmp);
    const std::string h = encode_snapshot_header(last_lsn, payload);  // payload is not copied
    KEEP_RETURN_IF_ERROR(fsutil::write_all(fd.get(), h, tmp));
    KEEP_RETURN_IF_ERROR(fsutil::write_all(fd.get(), payload, tmp));
    if (fsync && ::fsync(fd.get()) != 0) return fsutil::errno_status("fsync", tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fsutil::errno_status("renaming", tmp);
  if (fsync) KEEP_RETURN_IF_ERROR(fsutil::fsync_dir(dir));

  // Prune: keep the newest kSnapshotsKept, drop leftover .tmp files.
  KEEP_ASSIGN_OR_RETURN(std::vector<std::string> names, fsutil::list_dir(dir));
  KEEP_ASSIGN_OR_RETURN(std::vector<uint64_t> lsns, list_snapshots(dir));
  bool removed = false;
  for (const auto& n : names) {
    if (is_tmp_snapshot(n)) {
      KEEP_RETURN_IF_ERROR(fsutil::remove_file(fsutil::join(dir, n)));
      removed = true;
    }
  }
  while (lsns.size() > kSnapshotsKept) {
    KEEP_RETURN_IF_ERROR(fsutil::remove_file(fsutil::join(dir, snapshot_file_name(lsns.front()))));
    lsns.erase(lsns.begin());
    removed = true;
  }
  if (removed && fsync) KEEP_RETURN_IF_ERROR(fsutil::fsync_dir(dir));

  SnapshotWriteInfo info;
  info.path = path;
  info.bytes = kSnapshotHeaderBytes + payload.size();
  info.oldest_retained_lsn = lsns.empty() ? last_lsn : lsns.front();
  KEEP_LOG_INFO(kLog, "wrote '%s' (%" PRIu64 " bytes, LSN %" PRIu64 ")", path.c_str(), info.bytes,
                last_lsn);
  return info;
}

Result<std::optional<Snapshot>> read_latest_snapshot(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return std::optional<Snapshot>();
  KEEP_ASSIGN_OR_RETURN(std::vector<uint64_t> lsns, list_snapshots(dir));
  std::string problems;
  for (auto it = lsns.rbegin(); it != lsns.rend(); ++it) {
    const std::string name = snapshot_file_name(*it);
    const std::string path = fsutil::join(dir, name);
    KEEP_ASSIGN_OR_RETURN(std::string bytes, fsutil::read_file(path));
    Result<Snapshot> s = decode_snapshot(bytes, *it);
    if (s.is_ok()) {
      s->file = name;
      return std::optional<Snapshot>(std::move(s).value());
    }
    if (s.status().code() != Code::kCorrupt) {
      return s.status().with_context("reading snapshot '" + path + "'");
    }
    KEEP_LOG_WARN(kLog, "snapshot '%s' is corrupt (%s); falling back to the previous one",
                  path.c_str(), s.status().message().c_str());
    if (!problems.empty()) problems += "; ";
    problems += name + ": " + s.status().message();
  }
  if (!lsns.empty()) {
    return Status(Code::kCorrupt, "no valid snapshot in '" + dir + "' (" + problems + ")");
  }
  return std::optional<Snapshot>();
}

}  // namespace keep::manager
