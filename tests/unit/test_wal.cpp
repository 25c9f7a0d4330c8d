// The write-ahead log: round trips across rotations, every kind of torn tail, corruption in the
// middle, LSN gaps, recovery continuing LSNs, and a real process killed with SIGKILL.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "services/manager/durability/wal_format.h"
#include "services/manager/durability/wal_reader.h"
#include "services/manager/durability/wal_writer.h"
#include "shared/common/log.h"
#include "tests/temp_dir.h"

namespace fs = std::filesystem;
using keep::Code;
using keep::Status;
using keep::manager::ReplayStats;
using keep::manager::wal_replay;
using keep::manager::WalOptions;
using keep::manager::WalWriter;
namespace wal = keep::manager::wal;

namespace {

// Each test's own directory.
struct TempDir : keep::test::TempDir {
  TempDir() : keep::test::TempDir("wal") {}
};

// Deterministic payload of each LSN; sizes vary (0 .. 199 bytes).
std::string payload_for(uint64_t lsn) {
  std::string s = "rec-" + std::to_string(lsn) + ":";
  size_t n = lsn % 200;
  for (size_t i = 0; s.size() < n; ++i) s += static_cast<char>('a' + (lsn + i) % 26);
  s.resize(n);
  return s;
}

struct Replayed {
  Status status;
  std::vector<std::pair<uint64_t, std::string>> records;
  ReplayStats stats;
};

Replayed replay(const std::string& dir, uint64_t from = 1) {
  Replayed r;
  r.status = wal_replay(
      dir, from,
      [&](uint64_t lsn, std::string_view p) {
        r.records.emplace_back(lsn, std::string(p));
        return Status::ok();
      },
      &r.stats);
  return r;
}

// Checks records are exactly [first, last] with payload_for() payloads.
void check_dense(const Replayed& r, uint64_t first, uint64_t last) {
  REQUIRE(r.status.is_ok());
  REQUIRE(r.records.size() == last + 1 - first);
  for (uint64_t i = 0; i < r.records.size(); ++i) {
    CHECK(r.records[i].first == first + i);
    CHECK(r.records[i].second == payload_for(first + i));
  }
}

std::unique_ptr<WalWriter> open_writer(const std::string& dir, uint64_t segment_bytes = 64 << 20,
                                       uint64_t next_lsn = 0) {
  WalOptions o;
  o.dir = dir;
  o.fsync = false;  // these tests check formats and recovery rules, not the disk
  o.segment_bytes = segment_bytes;
  o.next_lsn = next_lsn;
  auto w = WalWriter::open(o);
  REQUIRE_MESSAGE(w.is_ok(), w.status().to_string());
  return std::move(w).value();
}

void write_records(const std::string& dir, uint64_t count, uint64_t segment_bytes = 64 << 20) {
  auto w = open_writer(dir, segment_bytes);
  for (uint64_t i = 0; i < count; ++i) {
    auto lsn = w->append(payload_for(w->next_lsn()));
    REQUIRE(lsn.is_ok());
  }
  REQUIRE(w->sync().is_ok());
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Offsets of each record header in a WAL file's bytes.
std::vector<uint64_t> record_offsets(const std::string& bytes) {
  std::vector<uint64_t> offs;
  uint64_t off = wal::kFileHeaderBytes;
  while (off + wal::kRecordHeaderBytes <= bytes.size()) {
    offs.push_back(off);
    off += wal::kRecordHeaderBytes + wal::get_u32(bytes.data() + off + wal::kRecordLengthOffset);
  }
  return offs;
}

// Collects warnings while alive.
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

const std::string kFirstFile = wal::wal_file_name(1);

}  // namespace

TEST_CASE("file names encode the first LSN zero-padded and parse back") {
  CHECK(wal::wal_file_name(42) == "wal-00000000000000000042.log");
  uint64_t lsn = 0;
  CHECK(wal::parse_wal_file_name("wal-00000000000000000042.log", &lsn));
  CHECK(lsn == 42);
  CHECK_FALSE(wal::parse_wal_file_name("wal-42.log", &lsn));
  CHECK_FALSE(wal::parse_wal_file_name("wal-0000000000000000004x.log", &lsn));
  CHECK_FALSE(wal::parse_wal_file_name("wal-99999999999999999999.log", &lsn));  // > u64
  CHECK(wal::snapshot_file_name(7) == "snapshot-00000000000000000007.snap");
}

TEST_CASE("round trip of many records across rotations, and replay from a later LSN") {
  TempDir t;
  const uint64_t n = 3000;
  {
    auto w = open_writer(t.path, 4096);
    for (uint64_t i = 1; i <= n; ++i) {
      auto lsn = w->append(payload_for(i));
      REQUIRE(lsn.is_ok());
      CHECK(*lsn == i);
      if (i % 10 == 0) REQUIRE(w->sync().is_ok());
    }
    REQUIRE(w->sync().is_ok());
    CHECK(w->stats().rotations > 50);
    CHECK(w->durable_lsn() == n);
  }
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(t.path)) {
    files++;
    CHECK(fs::file_size(e.path()) <= 4096);
  }
  CHECK(files > 50);

  Replayed all = replay(t.path);
  check_dense(all, 1, n);
  CHECK(all.stats.last_lsn == n);
  CHECK(all.stats.next_lsn == n + 1);
  CHECK(all.stats.truncated_bytes == 0);

  Replayed later = replay(t.path, 2500);
  check_dense(later, 2500, n);
  CHECK(later.stats.files_skipped > 0);
  CHECK(later.stats.files_read < files);

  Replayed beyond = replay(t.path, n + 10);  // a snapshot newer than the log
  REQUIRE(beyond.status.is_ok());
  CHECK(beyond.records.empty());
  CHECK(beyond.stats.next_lsn == n + 10);
}

TEST_CASE("an empty or missing directory replays nothing") {
  TempDir t;
  Replayed r = replay(t.sub("missing"));
  CHECK(r.status.is_ok());
  CHECK(r.records.empty());
  CHECK(r.stats.next_lsn == 1);
  fs::create_directory(t.sub("empty"));
  r = replay(t.sub("empty"), 5);
  CHECK(r.status.is_ok());
  CHECK(r.stats.next_lsn == 5);
}

TEST_CASE("append after recovery continues the LSNs") {
  TempDir t;
  {
    auto w = open_writer(t.path);
    for (int i = 0; i < 10; ++i) REQUIRE(w->append(payload_for(w->next_lsn())).is_ok());
    // no sync: the destructor hands the buffer to the kernel (what a clean close does)
  }
  SUBCASE("the writer finds the next LSN") {
    auto w = open_writer(t.path);
    CHECK(w->next_lsn() == 11);
    auto lsn = w->append(payload_for(11));
    REQUIRE(lsn.is_ok());
    CHECK(*lsn == 11);
    REQUIRE(w->sync().is_ok());
    w.reset();
    check_dense(replay(t.path), 1, 11);
  }
  SUBCASE("the caller passes ReplayStats::next_lsn") {
    Replayed r = replay(t.path);
    auto w = open_writer(t.path, 64 << 20, r.stats.next_lsn);
    CHECK(*w->append(payload_for(11)) == 11);
    REQUIRE(w->sync().is_ok());
    w.reset();
    check_dense(replay(t.path), 1, 11);
  }
  SUBCASE("a next LSN below the WAL's end is refused") {
    WalOptions o;
    o.dir = t.path;
    o.fsync = false;
    o.next_lsn = 5;
    auto w = WalWriter::open(o);
    REQUIRE_FALSE(w.is_ok());
    CHECK(w.status().code() == Code::kInvalidArgument);
  }
  SUBCASE("a next LSN above the WAL's end (newer snapshot) starts a new file there") {
    auto w = open_writer(t.path, 64 << 20, 101);
    for (uint64_t i = 101; i <= 105; ++i) CHECK(*w->append(payload_for(i)) == i);
    REQUIRE(w->sync().is_ok());
    w.reset();
    CHECK(fs::exists(t.sub(wal::wal_file_name(101))));
    check_dense(replay(t.path, 101), 101, 105);
    Replayed from_start = replay(t.path, 1);  // 11..100 are missing: refused
    CHECK(from_start.status.code() == Code::kCorrupt);
  }
}

TEST_CASE("sync is one fdatasync per batch, observed by the hook; no-op when idle") {
  TempDir t;
  std::vector<double> observed;
  WalOptions o;
  o.dir = t.path;
  o.fsync = true;
  o.on_sync = [&](double s) { observed.push_back(s); };
  auto w = WalWriter::open(o);
  REQUIRE(w.is_ok());
  for (int i = 0; i < 64; ++i) REQUIRE((*w)->append(payload_for(i + 1)).is_ok());
  CHECK((*w)->durable_lsn() == 0);
  REQUIRE((*w)->sync().is_ok());
  CHECK(observed.size() == 1);
  CHECK(observed[0] >= 0.0);
  CHECK((*w)->durable_lsn() == 64);
  REQUIRE((*w)->sync().is_ok());  // nothing new
  CHECK(observed.size() == 1);
  CHECK((*w)->stats().syncs == 1);
  REQUIRE((*w)->append("x").is_ok());
  REQUIRE((*w)->sync().is_ok());
  CHECK(observed.size() == 2);
}

TEST_CASE("records above max_record_bytes are refused with kTooLarge, consuming no LSN") {
  TempDir t;
  WalOptions o;
  o.dir = t.path;
  o.fsync = false;
  o.max_record_bytes = 100;
  auto w = WalWriter::open(o);
  REQUIRE(w.is_ok());
  auto big = (*w)->append(std::string(101, 'x'));
  REQUIRE_FALSE(big.is_ok());
  CHECK(big.status().code() == Code::kTooLarge);
  CHECK(*(*w)->append(std::string(100, 'x')) == 1);
  o.max_record_bytes = wal::kMaxPayloadBytes + 1;
  o.dir = t.sub("other");
  CHECK(WalWriter::open(o).status().code() == Code::kInvalidArgument);
}

TEST_CASE(
    "torn tail at every byte offset of the last two records keeps exactly the complete ones") {
  TempDir t;
  const uint64_t n = 6;
  write_records(t.sub("src"), n);
  const std::string full = read_bytes(t.sub("src") + "/" + kFirstFile);
  const std::vector<uint64_t> offs = record_offsets(full);
  REQUIRE(offs.size() == n);
  LogCapture logs;
  int cases = 0;
  for (uint64_t cut = offs[n - 2]; cut < full.size(); ++cut) {
    CAPTURE(cut);
    const std::string dir = t.sub("cut" + std::to_string(cut));
    fs::create_directory(dir);
    write_bytes(dir + "/" + kFirstFile, full.substr(0, cut));
    const uint64_t complete = cut >= offs[n - 1] ? n - 1 : n - 2;
    const uint64_t keep_bytes = cut >= offs[n - 1] ? offs[n - 1] : offs[n - 2];
    Replayed r = replay(dir);
    check_dense(r, 1, complete);
    CHECK(r.stats.truncated_bytes == cut - keep_bytes);
    CHECK(fs::file_size(dir + "/" + kFirstFile) == keep_bytes);
    if (cut > keep_bytes) {
      CHECK(r.stats.truncated_file == kFirstFile);
      CHECK(logs.contains("dropped " + std::to_string(cut - keep_bytes) + " bytes"));
    }
    // Replaying again finds a clean log; appending continues right after the kept records.
    Replayed again = replay(dir);
    CHECK(again.stats.truncated_bytes == 0);
    {
      auto w = open_writer(dir);
      CHECK(w->next_lsn() == complete + 1);
      for (uint64_t l = complete + 1; l <= n + 1; ++l) REQUIRE(*w->append(payload_for(l)) == l);
      REQUIRE(w->sync().is_ok());
    }
    check_dense(replay(dir), 1, n + 1);
    fs::remove_all(dir);
    cases++;
  }
  CHECK(cases > 2 * static_cast<int>(wal::kRecordHeaderBytes));
}

TEST_CASE("a flipped bit anywhere in the tail record is truncated") {
  TempDir t;
  const uint64_t n = 5;
  write_records(t.sub("src"), n);
  const std::string full = read_bytes(t.sub("src") + "/" + kFirstFile);
  const std::vector<uint64_t> offs = record_offsets(full);
  const std::string dir = t.sub("flip");
  fs::create_directory(dir);
  LogCapture logs;
  for (uint64_t pos = offs[n - 1]; pos < full.size(); ++pos) {
    for (int bit = 0; bit < 8; ++bit) {
      CAPTURE(pos);
      CAPTURE(bit);
      std::string bytes = full;
      bytes[pos] = static_cast<char>(bytes[pos] ^ (1 << bit));
      write_bytes(dir + "/" + kFirstFile, bytes);
      Replayed r = replay(dir);
      check_dense(r, 1, n - 1);
      CHECK(r.stats.truncated_bytes == full.size() - offs[n - 1]);
      CHECK(fs::file_size(dir + "/" + kFirstFile) == offs[n - 1]);
    }
  }
  CHECK(logs.contains("truncated torn tail"));
}

TEST_CASE("a corrupt record followed by valid records is refused, naming file and offset") {
  TempDir t;
  write_records(t.path, 10);
  const std::string path = t.sub(kFirstFile);
  std::string bytes = read_bytes(path);
  const std::vector<uint64_t> offs = record_offsets(bytes);
  LogCapture logs;
  SUBCASE("payload byte") { bytes[offs[4] + wal::kRecordHeaderBytes] ^= 0x10; }
  SUBCASE("length field") { bytes[offs[4] + wal::kRecordLengthOffset] ^= 0x01; }
  SUBCASE("lsn field") { bytes[offs[4] + wal::kRecordLsnOffset] ^= 0x01; }
  SUBCASE("zeroed record") {
    std::fill(bytes.begin() + static_cast<long>(offs[4]),
              bytes.begin() + static_cast<long>(offs[5]), '\0');
  }
  write_bytes(path, bytes);
  int calls = 0;
  Status s = wal_replay(t.path, 1, [&](uint64_t, std::string_view) {
    calls++;
    return Status::ok();
  });
  CHECK(s.code() == Code::kCorrupt);
  CHECK(s.message().find(kFirstFile) != std::string::npos);
  CHECK(s.message().find("offset " + std::to_string(offs[4])) != std::string::npos);
  CHECK(calls == 0);                           // the file is verified before any record is applied
  CHECK(fs::file_size(path) == bytes.size());  // nothing dropped
  // The writer refuses to open on top of it, too.
  WalOptions o;
  o.dir = t.path;
  o.fsync = false;
  CHECK(WalWriter::open(o).status().code() == Code::kCorrupt);
}

TEST_CASE("corruption or a torn end in a file that is not the last is refused") {
  TempDir t;
  write_records(t.path, 200, 2048);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(t.path)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  REQUIRE(names.size() >= 3);
  const std::string first = t.sub(names[0]);
  std::string bytes = read_bytes(first);
  SUBCASE("bit flip in its last record") { bytes[bytes.size() - 1] ^= 0x40; }
  SUBCASE("torn end") { bytes.resize(bytes.size() - 3); }
  write_bytes(first, bytes);
  Replayed r = replay(t.path);
  CHECK(r.status.code() == Code::kCorrupt);
  CHECK(r.status.message().find(names[0]) != std::string::npos);
  CHECK(r.status.message().find("not the last file") != std::string::npos);
}

TEST_CASE("LSN gaps are refused") {
  TempDir t;
  auto make_file = [&](const std::string& dir, uint64_t first, std::vector<uint64_t> lsns) {
    fs::create_directories(dir);
    std::string bytes;
    wal::encode_file_header(first, &bytes);
    for (uint64_t l : lsns) wal::encode_record(l, payload_for(l), &bytes);
    write_bytes(dir + "/" + wal::wal_file_name(first), bytes);
  };
  SUBCASE("inside a file") {
    make_file(t.path, 1, {1, 2, 4, 5});
    Replayed r = replay(t.path);
    CHECK(r.status.code() == Code::kCorrupt);
    CHECK(r.status.message().find("LSN gap") != std::string::npos);
  }
  SUBCASE("first record differs from the file's first LSN") {
    make_file(t.path, 1, {2, 3});
    CHECK(replay(t.path).status.code() == Code::kCorrupt);
  }
  SUBCASE("between files") {
    make_file(t.path, 1, {1, 2, 3});
    make_file(t.path, 5, {5, 6});
    Replayed r = replay(t.path);
    CHECK(r.status.code() == Code::kCorrupt);
    CHECK(r.status.message().find("expected 4, found 5") != std::string::npos);
    check_dense(replay(t.path, 5), 5, 6);  // a snapshot at 4 covers the gap
    CHECK(replay(t.path, 4).status.code() == Code::kCorrupt);
  }
  SUBCASE("the log starts after from_lsn (records dropped too early)") {
    make_file(t.path, 7, {7, 8});
    CHECK(replay(t.path, 3).status.code() == Code::kCorrupt);
    check_dense(replay(t.path, 7), 7, 8);
  }
  SUBCASE("header first LSN differs from the file name") {
    make_file(t.path, 1, {1});
    fs::rename(t.sub(wal::wal_file_name(1)), t.sub(wal::wal_file_name(2)));
    CHECK(replay(t.path).status.code() == Code::kCorrupt);
  }
}

TEST_CASE("a callback error aborts replay with context") {
  TempDir t;
  write_records(t.path, 10);
  int calls = 0;
  Status s = wal_replay(t.path, 1, [&](uint64_t lsn, std::string_view) {
    calls++;
    return lsn == 3 ? Status(Code::kMalformed, "bad record") : Status::ok();
  });
  CHECK(calls == 3);
  CHECK(s.code() == Code::kMalformed);
  CHECK(s.message().find("replaying WAL record 3") != std::string::npos);
  CHECK(s.message().find("bad record") != std::string::npos);
}

TEST_CASE("a torn file header of the newest file removes that file") {
  TempDir t;
  write_records(t.path, 3);
  std::string header;
  wal::encode_file_header(4, &header);
  LogCapture logs;
  for (size_t cut = 0; cut <= wal::kFileHeaderBytes; ++cut) {
    CAPTURE(cut);
    const std::string second = t.sub(wal::wal_file_name(4));
    std::string bytes = header.substr(0, cut);
    if (cut == wal::kFileHeaderBytes) bytes[5] ^= 1;  // full size but a bad magic
    write_bytes(second, bytes);
    Replayed r = replay(t.path);
    check_dense(r, 1, 3);
    CHECK_FALSE(fs::exists(second));
    CHECK(r.stats.truncated_bytes == cut);
  }
  CHECK(logs.contains("torn file header"));
  auto w = open_writer(t.path);
  CHECK(*w->append(payload_for(4)) == 4);
}

TEST_CASE("drop_segments_before removes only files wholly below the LSN") {
  TempDir t;
  auto w = open_writer(t.path, 1024);
  for (uint64_t i = 1; i <= 300; ++i) REQUIRE(w->append(payload_for(i)).is_ok());
  REQUIRE(w->sync().is_ok());
  auto count = [&] {
    return std::distance(fs::directory_iterator(t.path), fs::directory_iterator{});
  };
  const auto before = count();
  auto removed = w->drop_segments_before(151);
  REQUIRE(removed.is_ok());
  CHECK(*removed > 0);
  CHECK(count() == before - static_cast<long>(*removed));
  check_dense(replay(t.path, 151), 151, 300);
  CHECK(replay(t.path, 1).status.code() == Code::kCorrupt);  // the dropped part is gone
  // Everything below a far LSN: the file being written stays, and appending goes on.
  REQUIRE(w->drop_segments_before(1'000'000).is_ok());
  CHECK(count() == 1);
  CHECK(*w->append(payload_for(301)) == 301);
  REQUIRE(w->sync().is_ok());
  Replayed r = replay(t.path, 1'000'000);
  CHECK(r.status.is_ok());
}

// ---- a real process killed at a random moment --------------------------------------------------

namespace {

// Bigger records now and then, so that a kill can land inside a multi-megabyte write(2).
std::string crash_payload(uint64_t lsn) {
  std::string s = payload_for(lsn);
  if (lsn % 97 == 0) s.append(300000, static_cast<char>('A' + lsn % 26));
  return s;
}

[[noreturn]] void crash_child(const std::string& dir, int ack_fd, unsigned seed) {
  WalOptions o;
  o.dir = dir;
  o.fsync = true;
  o.segment_bytes = 1 << 20;
  o.flush_bytes = 64 << 10;
  auto w = WalWriter::open(o);
  if (!w.is_ok()) {
    std::fprintf(stderr, "child: %s\n", w.status().to_string().c_str());
    ::_exit(3);
  }
  std::mt19937 rng(seed);
  for (;;) {
    int batch = 1 + static_cast<int>(rng() % 16);
    uint64_t last = 0;
    for (int i = 0; i < batch; ++i) {
      uint64_t next = (*w)->next_lsn();
      auto lsn = (*w)->append(crash_payload(next));
      if (!lsn.is_ok() || *lsn != next) ::_exit(4);
      last = *lsn;
    }
    if (!(*w)->sync().is_ok()) ::_exit(5);
    if (::write(ack_fd, &last, sizeof last) != sizeof last) ::_exit(6);
  }
}

}  // namespace

TEST_CASE("SIGKILL of a writing process loses no acknowledged record") {
  TempDir t;
  const std::string dir = t.sub("wal");
  std::mt19937 rng(static_cast<unsigned>(std::random_device{}()));
  uint64_t acked_total = 0;
  int torn = 0;
  for (int round = 0; round < 6; ++round) {
    CAPTURE(round);
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(fds[0]);
      crash_child(dir, fds[1], static_cast<unsigned>(rng()));
    }
    ::close(fds[1]);
    std::this_thread::sleep_for(std::chrono::milliseconds(40 + rng() % 250));
    REQUIRE(::kill(pid, SIGKILL) == 0);
    int wstatus = 0;
    REQUIRE(::waitpid(pid, &wstatus, 0) == pid);
    CHECK(WIFSIGNALED(wstatus));  // killed by us, not an early exit of its own
    uint64_t acked = 0, v = 0;
    while (::read(fds[0], &v, sizeof v) == static_cast<ssize_t>(sizeof v)) {
      CHECK(v > acked);
      acked = v;
    }
    ::close(fds[0]);
    if (acked > 0) acked_total = acked;

    std::vector<uint64_t> seen;
    bool payloads_ok = true;
    ReplayStats st;
    Status s = wal_replay(
        dir, 1,
        [&](uint64_t lsn, std::string_view p) {
          seen.push_back(lsn);
          if (p != crash_payload(lsn)) payloads_ok = false;
          return Status::ok();
        },
        &st);
    REQUIRE_MESSAGE(s.is_ok(), s.to_string());
    if (st.truncated_bytes > 0) torn++;
    CHECK(payloads_ok);
    // Every acknowledged LSN exactly once: the replay is dense from 1 and reaches `acked`.
    REQUIRE(seen.size() >= acked_total);
    for (size_t i = 0; i < seen.size(); ++i) CHECK(seen[i] == i + 1);
  }
  MESSAGE("acknowledged LSNs after 6 kills: " << acked_total << ", torn tails repaired: " << torn);
  CHECK(acked_total > 0);
}
