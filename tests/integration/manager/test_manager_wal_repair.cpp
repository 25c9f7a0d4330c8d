// The real keep-manager process against damaged write-ahead logs (docs/wal-format.md, Recovery):
// garbage appended to the last WAL file and a record cut in the middle are torn tails (truncated,
// logged, every complete record recovered, appends continue after them); a corrupt record
// followed by valid ones makes keep-manager refuse to start with one clear line on stderr.
//
// The WAL is read here from its documented byte layout (services/manager/durability/wal_format.h:
// 32-byte file header, records of crc u32 | length u32 | type u8 | lsn u64 | payload), and the
// store's record payloads start with u8 format version | u8 type (1 = write: agent u32-length
// prefixed, id u64, ...; services/manager/store/record_codec.h).
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "shared/client/manager_client.h"
#include "tests/integration/manager/manager_process.h"

namespace {

using namespace std::chrono_literals;
namespace kc = keep::client;
namespace it = keep::itest;
using keep::Code;

constexpr size_t kFileHeader = 32;
constexpr size_t kRecordHeader = 17;
constexpr uint8_t kWriteRecord = 1;
constexpr uint8_t kRequestedRecord = 8;  // a mutation with the client's request id around it

uint32_t get_u32(const std::string& b, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b[at + static_cast<size_t>(i)]);
  return v;
}
uint64_t get_u64(const std::string& b, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b[at + static_cast<size_t>(i)]);
  return v;
}

struct WalRecord {
  size_t offset = 0;
  uint32_t length = 0;
  uint64_t lsn = 0;
  uint8_t store_type = 0;  // the store's record type (payload byte 1; of the mutation inside a
                           // requested record)
  uint64_t write_id = 0;   // for write records
};

// The records of a WAL file that the manager wrote (all valid: it was killed between batches).
std::vector<WalRecord> parse_wal(const std::string& bytes) {
  std::vector<WalRecord> out;
  REQUIRE(bytes.size() >= kFileHeader);
  REQUIRE(bytes.compare(0, 8, "KEEPWAL1") == 0);
  size_t at = kFileHeader;
  while (at + kRecordHeader <= bytes.size()) {
    WalRecord r;
    r.offset = at;
    r.length = get_u32(bytes, at + 4);
    r.lsn = get_u64(bytes, at + 9);
    REQUIRE(at + kRecordHeader + r.length <= bytes.size());
    const size_t p = at + kRecordHeader;
    REQUIRE(r.length >= 2);
    r.store_type = static_cast<uint8_t>(bytes[p + 1]);
    size_t body = p;  // the mutation's record
    if (r.store_type == kRequestedRecord) {
      // u8 version | u8 type | str agent | u64 client, seq, id, version, step | str inner
      body = p + 2 + 4 + get_u32(bytes, p + 2) + 40 + 4;
      r.store_type = static_cast<uint8_t>(bytes[body + 1]);
    }
    if (r.store_type == kWriteRecord) {
      const uint32_t agent_len = get_u32(bytes, body + 2);
      r.write_id = get_u64(bytes, body + 6 + agent_len);
    }
    out.push_back(r);
    at = p + r.length;
  }
  REQUIRE(at == bytes.size());
  return out;
}

it::fs::path last_wal_file(const std::string& data) {
  it::fs::path last;
  for (const auto& e : it::fs::directory_iterator(it::fs::path(data) / "wal")) {
    if (e.path().extension() == ".log" && e.path().filename() > last.filename()) last = e.path();
  }
  REQUIRE(!last.empty());
  return last;
}

void write_file(const it::fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

std::unique_ptr<kc::ManagerClient> connect(const it::ManagerProcess& m) {
  kc::ClientOptions o;
  o.endpoint = m.endpoint();
  o.timeout = 20000ms;
  auto c = kc::ManagerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

std::string text_of(uint64_t id) {
  return "the mug number " + std::to_string(id) + " is on shelf " + std::to_string(id % 7);
}

// Writes ids [from, to] to agent "t" (each acknowledged, so synced), embeds them with a retrieve
// and kills the manager -9.
void write_and_kill(it::ManagerProcess& m, uint64_t from, uint64_t to) {
  auto c = connect(m);
  for (uint64_t id = from; id <= to; ++id) {
    auto r = c->write({"t", id, text_of(id), kc::SegmentKind::kObjectState, {}});
    REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
  }
  REQUIRE(c->retrieve("t", "mug", 1024).is_ok());
  m.kill9();
}

// The ids agent "t" holds, each checked against its text.
std::vector<uint64_t> ids_present(const it::ManagerProcess& m) {
  auto c = connect(m);
  auto r = c->retrieve("t", "mug", 1024);
  REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
  std::vector<uint64_t> ids;
  for (const auto& s : *r) {
    CHECK(s.text == text_of(s.id));
    ids.push_back(s.id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<uint64_t> range(uint64_t from, uint64_t to) {
  std::vector<uint64_t> v;
  for (uint64_t i = from; i <= to; ++i) v.push_back(i);
  return v;
}

const std::vector<std::string> kFlags = {"--snapshot-every", "0"};

}  // namespace

TEST_CASE("garbage after the last WAL record is a torn tail: truncated, everything recovered") {
  it::TempDir tmp("torn-garbage");
  const std::string data = (tmp.path() / "data").string();
  const std::string shm = it::unique_name("torn");
  {
    it::ManagerProcess m({data, shm, kFlags});
    write_and_kill(m, 1, 30);
  }
  const it::fs::path wal = last_wal_file(data);
  const std::string before = it::read_text(wal);
  parse_wal(before);
  std::mt19937 rng(7);
  std::string garbage;
  for (int i = 0; i < 100; ++i) garbage.push_back(static_cast<char>(rng()));
  write_file(wal, before + garbage);
  {
    it::ManagerProcess m({data, shm, kFlags});
    const std::string log = m.err();
    CHECK_MESSAGE(log.find("recovery dropped a torn WAL tail of 100 bytes") != std::string::npos,
                  log);
    CHECK(it::read_text(wal) == before);
    CHECK(ids_present(m) == range(1, 30));
    // Appends continue after the repaired tail and survive the next crash.
    write_and_kill(m, 31, 40);
  }
  {
    it::ManagerProcess m({data, shm, kFlags});
    CHECK(m.err().find("torn WAL tail") == std::string::npos);
    CHECK(ids_present(m) == range(1, 40));
  }
}

TEST_CASE("a WAL record cut in the middle is a torn tail: earlier records recovered, it is not") {
  it::TempDir tmp("torn-cut");
  const std::string data = (tmp.path() / "data").string();
  const std::string shm = it::unique_name("cut");
  {
    it::ManagerProcess m({data, shm, kFlags});
    write_and_kill(m, 1, 30);
  }
  const it::fs::path wal = last_wal_file(data);
  const std::string bytes = it::read_text(wal);
  const auto records = parse_wal(bytes);
  // Cut the last write record in half (as if the crash hit while it was being written; what
  // followed it is gone too).
  size_t cut_index = records.size();
  for (size_t i = 0; i < records.size(); ++i) {
    if (records[i].store_type == kWriteRecord) cut_index = i;
  }
  REQUIRE(cut_index < records.size());
  const WalRecord& cut = records[cut_index];
  REQUIRE(cut.write_id == 30);
  const size_t new_size = cut.offset + kRecordHeader + cut.length / 2;
  write_file(wal, bytes.substr(0, new_size));
  {
    it::ManagerProcess m({data, shm, kFlags});
    const std::string log = m.err();
    const std::string expect =
        "recovery dropped a torn WAL tail of " + std::to_string(new_size - cut.offset) + " bytes";
    CHECK_MESSAGE(log.find(expect) != std::string::npos, log);
    CHECK(it::fs::file_size(wal) == cut.offset);
    CHECK(ids_present(m) == range(1, 29));
    write_and_kill(m, 30, 35);  // id 30 again: it was lost, so it is free
  }
  {
    it::ManagerProcess m({data, shm, kFlags});
    CHECK(ids_present(m) == range(1, 35));
  }
}

TEST_CASE("a corrupt WAL record followed by valid ones: keep-manager refuses to start") {
  it::TempDir tmp("corrupt");
  const std::string data = (tmp.path() / "data").string();
  const std::string shm = it::unique_name("corrupt");
  {
    it::ManagerProcess m({data, shm, kFlags});
    write_and_kill(m, 1, 20);
  }
  const it::fs::path wal = last_wal_file(data);
  std::string bytes = it::read_text(wal);
  const auto records = parse_wal(bytes);
  REQUIRE(records.size() > 5);
  const WalRecord& victim = records[2];
  bytes[victim.offset + kRecordHeader + victim.length - 1] ^= 0x40;  // one bit of its payload
  write_file(wal, bytes);

  for (const char* level : {"info", "error"}) {
    INFO("--log-level " << std::string(level));
    std::vector<std::string> flags = kFlags;
    flags.insert(flags.end(), {"--log-level", level});
    it::ManagerProcess m({data, shm, flags, /*wait_ready=*/false});
    const int code = m.wait_exit(30000ms);
    CHECK(code != 0);
    CHECK(code != -1);  // exited, not killed
    const std::string err = m.err();
    std::vector<std::string> fatal;
    for (const auto& l : it::lines_of(err)) {
      if (l.rfind("keep-manager: ", 0) == 0) fatal.push_back(l);
    }
    REQUIRE_MESSAGE(fatal.size() == 1, err);
    CHECK_MESSAGE(fatal[0].find("corrupt") != std::string::npos, fatal[0]);
    CHECK_MESSAGE(fatal[0].find(wal.filename().string()) != std::string::npos, fatal[0]);
    CHECK_MESSAGE(fatal[0].find("offset " + std::to_string(victim.offset)) != std::string::npos,
                  fatal[0]);
    CHECK(err.find("serving on") == std::string::npos);
    if (std::string(level) == "error") CHECK_MESSAGE(it::lines_of(err).size() == 1, err);
    // Nothing was repaired or truncated behind the operator's back.
    CHECK(it::read_text(wal) == bytes);
  }
}
