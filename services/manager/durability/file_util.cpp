#include "services/manager/durability/file_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace keep::manager::fsutil {

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Status errno_status(std::string_view what, const std::string& path) {
  int e = errno;
  std::string m(what);
  m += " '";
  m += path;
  m += "': ";
  m += std::strerror(e);
  return Status(Code::kIoError, std::move(m));
}

std::string join(const std::string& dir, std::string_view name) {
  std::string p = dir;
  if (!p.empty() && p.back() != '/') p += '/';
  p += name;
  return p;
}

Status ensure_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) == 0) return Status::ok();
  if (errno != EEXIST) return errno_status("creating directory", dir);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return errno_status("stat", dir);
  if (!S_ISDIR(st.st_mode)) return Status(Code::kIoError, "not a directory: '" + dir + "'");
  return Status::ok();
}

Status fsync_dir(const std::string& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return errno_status("opening directory", dir);
  if (::fsync(fd.get()) != 0) return errno_status("fsync of directory", dir);
  return Status::ok();
}

Result<std::vector<std::string>> list_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return errno_status("listing directory", dir);
  std::vector<std::string> names;
  errno = 0;
  while (dirent* e = ::readdir(d)) {
    std::string_view n = e->d_name;
    if (n == "." || n == "..") continue;
    names.emplace_back(n);
  }
  int e = errno;
  ::closedir(d);
  if (e != 0) {
    errno = e;
    return errno_status("reading directory", dir);
  }
  return names;
}

Result<std::string> read_file(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return errno_status("opening", path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status("stat", path);
  std::string bytes;
  bytes.resize(static_cast<size_t>(st.st_size));
  size_t got = 0;
  while (got < bytes.size()) {
    ssize_t n = ::read(fd.get(), bytes.data() + got, bytes.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status("reading", path);
    }
    if (n == 0) break;  // shrank under us: keep what is there
    got += static_cast<size_t>(n);
  }
  bytes.resize(got);
  return bytes;
}

Status write_all(int fd, std::string_view bytes, const std::string& path) {
  while (!bytes.empty()) {
    ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status("writing", path);
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return Status::ok();
}

Status truncate_file(const std::string& path, uint64_t size) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd.valid()) return errno_status("opening for truncation", path);
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) return errno_status("truncating", path);
  if (::fdatasync(fd.get()) != 0) return errno_status("fdatasync after truncation", path);
  return Status::ok();
}

Status remove_file(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return errno_status("removing", path);
  return Status::ok();
}

}  // namespace keep::manager::fsutil
