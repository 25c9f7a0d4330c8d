#include "services/manager/durability/data_dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>

#include "services/manager/durability/file_util.h"
#include "shared/common/log.h"

namespace keep::manager {

Result<std::unique_ptr<DataDirLock>> DataDirLock::acquire(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) {
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status(Code::kIoError, "cannot create directory '" + dir + "': " + ec.message());
    // Memories are private: the directory is the owner's alone (create_directories uses 0777 &
    // ~umask).
    if (::chmod(dir.c_str(), 0700) != 0) return fsutil::errno_status("chmod 0700", dir);
  } else if (!std::filesystem::is_directory(dir, ec)) {
    return Status(Code::kIoError, "not a directory: '" + dir + "'");
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
    KEEP_LOG_WARN("manager",
                  "data directory '%s' is readable by others (mode %03o); memories are private: "
                  "chmod 700 it",
                  dir.c_str(), static_cast<unsigned>(st.st_mode & 0777));
  }

  const std::string path = fsutil::join(dir, "LOCK");
  fsutil::UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!fd.valid()) return fsutil::errno_status("opening lock file", path);
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return fsutil::errno_status("locking", path);
    // The holder wrote its pid after locking; a holder still writing it leaves the text empty.
    auto text = fsutil::read_file(path);
    std::string pid = text.is_ok() ? *text : std::string();
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) pid = "?";
    return Status(Code::kAlreadyExists, "data directory '" + dir + "' is in use by pid " + pid +
                                            " (it holds " + path + ")");
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd.get(), 0) != 0) return fsutil::errno_status("truncating", path);
  KEEP_RETURN_IF_ERROR(fsutil::write_all(fd.get(), pid, path));
  return std::unique_ptr<DataDirLock>(new DataDirLock(path, fd.release()));
}

DataDirLock::~DataDirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor of the file releases the flock
}

}  // namespace keep::manager
