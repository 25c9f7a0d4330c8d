// DataDirLock: one process owns a data directory (LevelDB's LOCK file).
//
// Two keep-managers on one --data-dir would each treat the other's live WAL segment as torn,
// truncate it and acknowledge writes that a restart then loses. acquire() takes an exclusive
// flock(2) on <dir>/LOCK, held for the object's life (so for the process's: the kernel drops it
// when the process dies, kill -9 included, so a stale LOCK file never blocks a restart), and
// writes the holder's pid into the file for the error the next contender gets.
#pragma once

#include <memory>
#include <string>

#include "shared/common/status.h"

namespace keep::manager {

class DataDirLock {
 public:
  // Creates `dir` (mode 0700, parents as needed) when missing, then locks <dir>/LOCK.
  // kAlreadyExists "data directory '<dir>' is in use by pid N (it holds <dir>/LOCK)" when another
  // process (or another DataDirLock of this one) holds it; kIoError for file-system failures.
  static Result<std::unique_ptr<DataDirLock>> acquire(const std::string& dir);

  ~DataDirLock();  // releases the lock; the file stays (removing it would race a new holder)
  DataDirLock(const DataDirLock&) = delete;
  DataDirLock& operator=(const DataDirLock&) = delete;

  const std::string& path() const { return path_; }  // <dir>/LOCK

 private:
  DataDirLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

}  // namespace keep::manager
