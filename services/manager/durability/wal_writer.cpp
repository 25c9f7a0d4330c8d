#include "services/manager/durability/wal_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>

#include "services/manager/durability/wal_format.h"
#include "services/manager/durability/wal_reader.h"
#include "shared/common/log.h"

namespace keep::manager {
namespace {
constexpr const char* kLog = "wal";
}

WalWriter::WalWriter(WalOptions options) : options_(std::move(options)) {}

WalWriter::~WalWriter() {
  if (failed_.is_ok() && fd_.valid() && !buffer_.empty()) {
    (void)fsutil::write_all(fd_.get(), buffer_, path_);
  }
}

Result<std::unique_ptr<WalWriter>> WalWriter::open(WalOptions options) {
  if (options.dir.empty()) return Status(Code::kInvalidArgument, "WalOptions.dir is empty");
  if (options.max_record_bytes > wal::kMaxPayloadBytes) {
    return Status(Code::kInvalidArgument,
                  "WalOptions.max_record_bytes " + std::to_string(options.max_record_bytes) +
                      " exceeds the format limit " + std::to_string(wal::kMaxPayloadBytes));
  }
  if (options.segment_bytes < wal::kFileHeaderBytes + wal::kRecordHeaderBytes) {
    return Status(Code::kInvalidArgument, "WalOptions.segment_bytes is too small");
  }
  const std::string dir = options.dir;
  KEEP_RETURN_IF_ERROR(fsutil::ensure_dir(dir).with_context("opening WAL"));
  KEEP_ASSIGN_OR_RETURN(WalTail tail, recover_wal_tail(dir));
  KEEP_ASSIGN_OR_RETURN(std::vector<WalSegmentFile> segs, list_wal_segments(dir));

  std::unique_ptr<WalWriter> w(new WalWriter(std::move(options)));
  for (const auto& s : segs) w->files_.push_back(s.first_lsn);
  const uint64_t found_next = tail.has_files ? tail.last_lsn + 1 : 1;
  const uint64_t next = w->options_.next_lsn != 0 ? w->options_.next_lsn : found_next;
  if (next < found_next) {
    return Status(Code::kInvalidArgument,
                  "WAL in '" + dir + "' holds records up to LSN " + std::to_string(found_next - 1) +
                      " but the caller continues at LSN " + std::to_string(next) +
                      " (replay the WAL first and pass ReplayStats::next_lsn)");
  }
  w->next_lsn_ = next;
  w->written_lsn_ = next - 1;
  w->durable_lsn_ = next - 1;

  if (tail.has_files && next == found_next) {
    // Continue the last file after its last valid record.
    w->path_ = fsutil::join(dir, tail.last_file_name);
    w->fd_.reset(::open(w->path_.c_str(), O_WRONLY | O_CLOEXEC));
    if (!w->fd_.valid()) return fsutil::errno_status("opening WAL file", w->path_);
    if (::lseek(w->fd_.get(), static_cast<off_t>(tail.last_file_valid_end), SEEK_SET) < 0) {
      return fsutil::errno_status("seeking in WAL file", w->path_);
    }
    w->file_bytes_ = tail.last_file_valid_end;
    w->file_records_ = tail.last_file_records;
    if (w->options_.fsync && ::fdatasync(w->fd_.get()) != 0) {
      return fsutil::errno_status("fdatasync", w->path_);
    }
  } else {
    if (tail.has_files) {
      KEEP_LOG_INFO(kLog,
                    "WAL in '%s' ends at LSN %" PRIu64 "; continuing at LSN %" PRIu64
                    " in a new file (a snapshot covers the gap)",
                    dir.c_str(), found_next - 1, next);
      if (tail.last_file_records == 0) {  // an empty file would only confuse the order
        KEEP_RETURN_IF_ERROR(fsutil::remove_file(fsutil::join(dir, tail.last_file_name)));
        w->files_.pop_back();
      }
    }
    KEEP_RETURN_IF_ERROR(w->start_file(next));
  }
  w->stats_.next_lsn = next;
  return w;
}

Status WalWriter::start_file(uint64_t first_lsn) {
  path_ = fsutil::join(options_.dir, wal::wal_file_name(first_lsn));
  fd_.reset(::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd_.valid()) return fail(fsutil::errno_status("creating WAL file", path_));
  files_.push_back(first_lsn);
  buffer_.clear();
  wal::encode_file_header(first_lsn, &buffer_);
  file_bytes_ = wal::kFileHeaderBytes;
  file_records_ = 0;
  dirty_ = true;
  if (options_.fsync) {
    Status s = fsutil::fsync_dir(options_.dir);
    if (!s.is_ok()) return fail(s);
  }
  return Status::ok();
}

Status WalWriter::fail(Status s) {
  failed_ = s.with_context("WAL writer failed");
  KEEP_LOG_ERROR(kLog, "%s", failed_.to_string().c_str());
  return failed_;
}

Status WalWriter::flush() {
  if (buffer_.empty()) return Status::ok();
  Status s = fsutil::write_all(fd_.get(), buffer_, path_);
  if (!s.is_ok()) return fail(s);
  buffer_.clear();
  written_lsn_ = next_lsn_ - 1;
  return Status::ok();
}

Status WalWriter::fdatasync_timed() {
  auto t0 = std::chrono::steady_clock::now();
  if (::fdatasync(fd_.get()) != 0) return fail(fsutil::errno_status("fdatasync", path_));
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stats_.syncs++;
  stats_.last_sync_seconds = secs;
  if (options_.on_sync) options_.on_sync(secs);
  return Status::ok();
}

Result<uint64_t> WalWriter::append(std::string_view payload) {
  if (!failed_.is_ok()) return failed_;
  if (payload.size() > options_.max_record_bytes) {
    return Status(Code::kTooLarge, "WAL record of " + std::to_string(payload.size()) +
                                       " bytes exceeds max_record_bytes " +
                                       std::to_string(options_.max_record_bytes));
  }
  const uint64_t framed = wal::kRecordHeaderBytes + payload.size();
  if (file_records_ > 0 && file_bytes_ + framed > options_.segment_bytes) {
    KEEP_RETURN_IF_ERROR(rotate());
  }
  const uint64_t lsn = next_lsn_++;
  wal::encode_record(lsn, payload, &buffer_);
  file_bytes_ += framed;
  file_records_++;
  dirty_ = true;
  stats_.records++;
  stats_.bytes += framed;
  if (buffer_.size() >= options_.flush_bytes) KEEP_RETURN_IF_ERROR(flush());
  return lsn;
}

Status WalWriter::sync() {
  if (!failed_.is_ok()) return failed_;
  if (!dirty_) return Status::ok();
  KEEP_RETURN_IF_ERROR(flush());
  if (options_.fsync) KEEP_RETURN_IF_ERROR(fdatasync_timed());
  dirty_ = false;
  durable_lsn_ = written_lsn_;
  return Status::ok();
}

Status WalWriter::rotate() {
  // The finished file must be durable before the next one exists: otherwise a crash could leave a
  // torn tail in a file that is no longer the last, which recovery refuses.
  KEEP_RETURN_IF_ERROR(sync());
  fd_.reset();
  KEEP_RETURN_IF_ERROR(start_file(next_lsn_));
  stats_.rotations++;
  return Status::ok();
}

Result<size_t> WalWriter::drop_segments_before(uint64_t lsn) {
  if (!failed_.is_ok()) return failed_;
  size_t removed = 0;
  // File i holds LSNs [files_[i], files_[i + 1]); it is wholly below `lsn` when files_[i+1] <= lsn.
  while (files_.size() >= 2 && files_[1] <= lsn) {
    const std::string p = fsutil::join(options_.dir, wal::wal_file_name(files_[0]));
    Status s = fsutil::remove_file(p);
    if (!s.is_ok()) return s;
    files_.erase(files_.begin());
    removed++;
  }
  if (removed > 0) {
    if (options_.fsync) KEEP_RETURN_IF_ERROR(fsutil::fsync_dir(options_.dir));
    stats_.segments_dropped += removed;
    KEEP_LOG_INFO(kLog, "dropped %zu WAL file(s) below LSN %" PRIu64, removed, lsn);
  }
  return removed;
}

WalWriterStats WalWriter::stats() const {
  WalWriterStats s = stats_;
  s.next_lsn = next_lsn_;
  s.durable_lsn = durable_lsn_;
  return s;
}

}  // namespace keep::manager
