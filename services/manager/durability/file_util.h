// Small POSIX file helpers of the durability layer (internal: not used outside durability/).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"

namespace keep::manager::fsutil {

// An owned file descriptor; closes on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Status(kIoError, "<what> '<path>': <strerror(errno)>").
Status errno_status(std::string_view what, const std::string& path);

std::string join(const std::string& dir, std::string_view name);
// mkdir for one level (parents must exist), mode 0700: memories are private; ok when it exists.
Status ensure_dir(const std::string& dir);
// fsync of the directory itself, so that created/renamed/removed names are durable.
Status fsync_dir(const std::string& dir);
// Names of the regular entries of `dir` (no "." / "..").
Result<std::vector<std::string>> list_dir(const std::string& dir);
// The whole file.
Result<std::string> read_file(const std::string& path);
// write(2) until every byte is written (retries EINTR and short writes).
Status write_all(int fd, std::string_view bytes, const std::string& path);
// ftruncate + fdatasync.
Status truncate_file(const std::string& path, uint64_t size);
// unlink; ok when it does not exist.
Status remove_file(const std::string& path);

}  // namespace keep::manager::fsutil
