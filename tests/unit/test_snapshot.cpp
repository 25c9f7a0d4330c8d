// Snapshot files: round trip, pruning to the newest two, fallback past a corrupt newest one, and
// decoding of damaged bytes.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "services/manager/durability/snapshot_file.h"
#include "services/manager/durability/wal_format.h"
#include "shared/common/log.h"
#include "tests/temp_dir.h"

namespace fs = std::filesystem;
using keep::Code;
using keep::manager::decode_snapshot;
using keep::manager::encode_snapshot;
using keep::manager::list_snapshots;
using keep::manager::read_latest_snapshot;
using keep::manager::write_snapshot;
namespace wal = keep::manager::wal;

namespace {

struct TempDir : keep::test::TempDir {
  TempDir() : keep::test::TempDir("snap") {}
  std::string file(uint64_t lsn) const { return sub(wal::snapshot_file_name(lsn)); }
};

std::string random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

struct LogCapture {
  std::mutex mu;
  std::vector<std::string> lines;
  LogCapture() {
    keep::log::set_sink([this](keep::log::Level l, std::string_view line) {
      if (l < keep::log::Level::kWarn) return;
      std::lock_guard<std::mutex> lock(mu);
      lines.emplace_back(line);
    });
  }
  ~LogCapture() { keep::log::set_sink(nullptr); }
  bool contains(const std::string& s) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& l : lines) {
      if (l.find(s) != std::string::npos) return true;
    }
    return false;
  }
};

}  // namespace

TEST_CASE("snapshot round trip, including empty and 1 MiB payloads") {
  TempDir t;
  for (size_t n : {size_t{0}, size_t{1}, size_t{4096}, size_t{1} << 20}) {
    CAPTURE(n);
    const std::string payload = random_bytes(n, static_cast<unsigned>(n));
    const uint64_t lsn = 1000 + n;
    auto info = write_snapshot(t.path, lsn, payload, /*fsync=*/n == 4096);
    REQUIRE_MESSAGE(info.is_ok(), info.status().to_string());
    CHECK(info->bytes == wal::kSnapshotHeaderBytes + n);
    CHECK(fs::file_size(t.file(lsn)) == wal::kSnapshotHeaderBytes + n);
    auto got = read_latest_snapshot(t.path);
    REQUIRE(got.is_ok());
    REQUIRE(got->has_value());
    CHECK((*got)->last_lsn == lsn);
    CHECK((*got)->payload == payload);
    CHECK((*got)->file == wal::snapshot_file_name(lsn));
  }
}

TEST_CASE("no snapshot: nullopt for a missing or empty directory") {
  TempDir t;
  auto missing = read_latest_snapshot(t.path + "/nope");
  REQUIRE(missing.is_ok());
  CHECK_FALSE(missing->has_value());
  auto empty = read_latest_snapshot(t.path);
  REQUIRE(empty.is_ok());
  CHECK_FALSE(empty->has_value());
}

TEST_CASE("only the newest two snapshots are kept; leftover tmp files go") {
  TempDir t;
  write_bytes(t.file(5) + ".tmp", "half-written");
  for (uint64_t lsn : {10, 20, 30, 40, 50}) {
    auto info = write_snapshot(t.path, lsn, "state@" + std::to_string(lsn), false);
    REQUIRE(info.is_ok());
    CHECK(info->oldest_retained_lsn == (lsn == 10 ? 10 : lsn - 10));
  }
  auto lsns = list_snapshots(t.path);
  REQUIRE(lsns.is_ok());
  CHECK(*lsns == std::vector<uint64_t>{40, 50});
  CHECK_FALSE(fs::exists(t.file(5) + ".tmp"));
  size_t entries = std::distance(fs::directory_iterator(t.path), fs::directory_iterator{});
  CHECK(entries == 2);
  // Same LSN again replaces the file; an older LSN is refused.
  CHECK(write_snapshot(t.path, 50, "again", false).is_ok());
  CHECK(read_latest_snapshot(t.path).value()->payload == "again");
  CHECK(write_snapshot(t.path, 45, "old", false).status().code() == Code::kInvalidArgument);
}

TEST_CASE("a corrupt newest snapshot falls back to the previous one, logged") {
  TempDir t;
  REQUIRE(write_snapshot(t.path, 10, "older state", false).is_ok());
  REQUIRE(write_snapshot(t.path, 20, "newer state", false).is_ok());
  std::string bytes = read_bytes(t.file(20));
  SUBCASE("payload bit flip") { bytes[wal::kSnapshotHeaderBytes + 3] ^= 0x08; }
  SUBCASE("header bit flip") { bytes[wal::kSnapshotPayloadBytesOffset] ^= 0x01; }
  SUBCASE("truncated") { bytes.resize(bytes.size() - 1); }
  SUBCASE("torn header") { bytes.resize(wal::kSnapshotHeaderBytes - 5); }
  SUBCASE("extra bytes") { bytes += "x"; }
  write_bytes(t.file(20), bytes);
  LogCapture logs;
  auto got = read_latest_snapshot(t.path);
  REQUIRE(got.is_ok());
  REQUIRE(got->has_value());
  CHECK((*got)->last_lsn == 10);
  CHECK((*got)->payload == "older state");
  CHECK(logs.contains(wal::snapshot_file_name(20)));
  CHECK(logs.contains("falling back"));
}

TEST_CASE("every snapshot corrupt is kCorrupt, not an empty state") {
  TempDir t;
  REQUIRE(write_snapshot(t.path, 10, "a", false).is_ok());
  REQUIRE(write_snapshot(t.path, 20, "b", false).is_ok());
  for (uint64_t lsn : {10, 20}) {
    std::string b = read_bytes(t.file(lsn));
    b.back() ^= 1;
    write_bytes(t.file(lsn), b);
  }
  LogCapture logs;
  auto got = read_latest_snapshot(t.path);
  REQUIRE_FALSE(got.is_ok());
  CHECK(got.status().code() == Code::kCorrupt);
  CHECK(got.status().message().find(wal::snapshot_file_name(10)) != std::string::npos);
}

TEST_CASE("decode_snapshot rejects every truncation, a renamed file and another version") {
  const std::string enc = encode_snapshot(77, "payload bytes");
  REQUIRE(decode_snapshot(enc, 77).is_ok());
  for (size_t n = 0; n < enc.size(); ++n) {
    CAPTURE(n);
    CHECK(decode_snapshot(std::string_view(enc).substr(0, n), 77).status().code() ==
          Code::kCorrupt);
  }
  CHECK(decode_snapshot(enc, 78).status().code() == Code::kCorrupt);
  std::string v2 = enc;
  wal::put_u32(v2.data() + 8, wal::kSnapshotVersion + 1);
  wal::put_u32(
      v2.data() + wal::kSnapshotHeaderCrcOffset,
      keep::manager::crc32c_mask(keep::manager::crc32c(v2.data(), wal::kSnapshotHeaderCrcOffset)));
  CHECK(decode_snapshot(v2, 77).status().code() == Code::kVersionMismatch);
}
