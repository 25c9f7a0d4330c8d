// libFuzzer target: arbitrary bytes as a WAL segment and as a snapshot file.
//
// Checks, beyond "no crash, no out-of-bounds read" (ASan/UBSan): the in-memory scan reports
// records inside the buffer, dense LSNs and a valid_end within the file; wal_replay() on the same
// bytes written as the only file either fails with a Status or leaves a file that replays cleanly
// with the same records (truncation keeps exactly the valid prefix).
// Seeds: tests/fuzz/corpus/fuzz_wal_reader/ (valid files to mutate; the checksum is a wall for
// blind inputs).
#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "services/manager/durability/snapshot_file.h"
#include "services/manager/durability/wal_format.h"
#include "services/manager/durability/wal_reader.h"
#include "shared/common/log.h"
#include "shared/common/status.h"

namespace {

namespace wal = keep::manager::wal;

#define FUZZ_ASSERT(cond)                                                     \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "fuzz_wal_reader: assertion failed: %s\n", #cond); \
      std::abort();                                                           \
    }                                                                         \
  } while (0)

// A per-process directory, created for each input and removed after it (libFuzzer may leave
// through _Exit, so nothing is left behind for an exit handler). tmpfs when available:
// truncation fsyncs, which would cost milliseconds on a disk.
std::string scratch_dir() {
  static const std::string dir =
      std::string(::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp") + "/keep-fuzz-wal-" +
      std::to_string(::getpid());
  return dir;
}

void clear_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  for (const auto& n : names) ::unlink((dir + "/" + n).c_str());
}

void check_scan(std::string_view bytes, uint64_t name_lsn) {
  auto scan = keep::manager::scan_wal_segment(bytes, name_lsn);
  if (!scan.is_ok()) return;
  FUZZ_ASSERT(scan->valid_end <= bytes.size());
  FUZZ_ASSERT(scan->bad_tail || scan->valid_end == bytes.size());
  uint64_t prev = 0;
  for (const auto& r : scan->records) {
    FUZZ_ASSERT(r.payload.data() >= bytes.data());
    FUZZ_ASSERT(r.payload.data() + r.payload.size() <= bytes.data() + bytes.size());
    FUZZ_ASSERT(r.offset + wal::kRecordHeaderBytes + r.payload.size() <= scan->valid_end);
    if (prev != 0) FUZZ_ASSERT(r.lsn == prev + 1);
    prev = r.lsn;
  }
  if (!scan->records.empty()) FUZZ_ASSERT(scan->records.front().lsn == name_lsn);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  keep::log::set_level(keep::log::Level::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  // The LSN a file of these bytes would be named after: the header's, when there is one.
  const uint64_t name_lsn = size >= wal::kFileHeaderBytes
                                ? wal::get_u64(bytes.data() + wal::kFileHeaderFirstLsnOffset)
                                : 1;
  check_scan(bytes, name_lsn);
  check_scan(bytes, 1);

  // The same bytes as the only (hence last) file of a WAL directory.
  if (name_lsn != 0) {
    const std::string dir = scratch_dir();
    ::mkdir(dir.c_str(), 0700);
    clear_dir(dir);
    const std::string path = dir + "/" + wal::wal_file_name(name_lsn);
    FILE* f = std::fopen(path.c_str(), "wb");
    FUZZ_ASSERT(f != nullptr);
    FUZZ_ASSERT(std::fwrite(bytes.data(), 1, size, f) == size);
    std::fclose(f);
    std::vector<uint64_t> first, second;
    keep::Status s = keep::manager::wal_replay(dir, name_lsn, [&](uint64_t lsn, std::string_view) {
      first.push_back(lsn);
      return keep::Status::ok();
    });
    if (s.is_ok()) {
      // After any truncation the log is clean and holds the same records.
      keep::manager::ReplayStats st;
      keep::Status again = keep::manager::wal_replay(
          dir, name_lsn,
          [&](uint64_t lsn, std::string_view) {
            second.push_back(lsn);
            return keep::Status::ok();
          },
          &st);
      FUZZ_ASSERT(again.is_ok());
      FUZZ_ASSERT(st.truncated_bytes == 0);
      FUZZ_ASSERT(first == second);
    }
    clear_dir(dir);
    ::rmdir(dir.c_str());
  }

  // The bytes as a snapshot file.
  auto snap =
      keep::manager::decode_snapshot(bytes, size >= 24 ? wal::get_u64(bytes.data() + 16) : 0);
  if (snap.is_ok()) FUZZ_ASSERT(snap->payload.size() + wal::kSnapshotHeaderBytes == size);
  return 0;
}
