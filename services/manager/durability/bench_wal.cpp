// keep_bench_wal: appends/s and sync (fdatasync) latency of WalWriter with group commit.
//
//   keep_bench_wal [--dir D] [--records N] [--record-bytes B] [--batch K] [--no-fsync]
//
// Appends N records of B bytes, calling sync() after every K appends, into a fresh directory
// D/bench-wal-<pid> (removed afterwards). Prints appends/s and p50/p99/max of sync().
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "services/manager/durability/wal_writer.h"

namespace {

void usage() {
  std::fprintf(stderr,
               "usage: keep_bench_wal [--dir D (default /tmp)] [--records N (default 20000)]\n"
               "                      [--record-bytes B (default 100)] [--batch K (default 1)]\n"
               "                      [--no-fsync]\n");
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp";
  long records = 20000, record_bytes = 100, batch = 1;
  bool fsync = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--dir")
      dir = next();
    else if (a == "--records")
      records = std::atol(next());
    else if (a == "--record-bytes")
      record_bytes = std::atol(next());
    else if (a == "--batch")
      batch = std::atol(next());
    else if (a == "--no-fsync")
      fsync = false;
    else {
      usage();
      return a == "--help" ? 0 : 2;
    }
  }
  if (records <= 0 || record_bytes < 0 || batch <= 0) {
    usage();
    return 2;
  }
  const std::string wal_dir = dir + "/bench-wal-" + std::to_string(::getpid());
  std::vector<double> sync_secs;
  keep::manager::WalOptions opt;
  opt.dir = wal_dir;
  opt.fsync = fsync;
  auto w = keep::manager::WalWriter::open(opt);
  if (!w.is_ok()) {
    std::fprintf(stderr, "open: %s\n", w.status().to_string().c_str());
    return 1;
  }
  std::string payload(static_cast<size_t>(record_bytes), 'x');
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < records; ++i) {
    auto lsn = (*w)->append(payload);
    if (!lsn.is_ok()) {
      std::fprintf(stderr, "append: %s\n", lsn.status().to_string().c_str());
      return 1;
    }
    if ((i + 1) % batch == 0 || i + 1 == records) {
      auto s0 = std::chrono::steady_clock::now();
      keep::Status s = (*w)->sync();
      sync_secs.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count());
      if (!s.is_ok()) {
        std::fprintf(stderr, "sync: %s\n", s.to_string().c_str());
        return 1;
      }
    }
  }
  double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  w->reset();
  std::error_code ec;
  std::filesystem::remove_all(wal_dir, ec);
  std::printf(
      "dir=%s fsync=%s record_bytes=%ld batch=%ld records=%ld: %.0f appends/s, %.1f syncs/s, "
      "sync p50=%.3f ms p99=%.3f ms max=%.3f ms\n",
      dir.c_str(), fsync ? "on" : "off", record_bytes, batch, records,
      static_cast<double>(records) / total, static_cast<double>(sync_secs.size()) / total,
      1e3 * pct(sync_secs, 0.5), 1e3 * pct(sync_secs, 0.99), 1e3 * pct(sync_secs, 1.0));
  return 0;
}
