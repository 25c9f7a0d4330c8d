// The store's WAL record and snapshot codec: round trips, and every truncation / corruption is a
// clean kCorrupt (never a crash or an over-read; run under ASan to check the latter).
#include <doctest/doctest.h>

#include <random>

#include "services/manager/store/record_codec.h"

using namespace keep;
using namespace keep::manager;

namespace {

std::vector<Record> sample_records() {
  std::vector<Record> out;
  out.push_back(WriteRecord{"agent-1", 7, 2, 42, 5, "put the cup on the table"});
  out.push_back(UpdateRecord{"agent-1", 7, 1, 43, 3, "cup is clean"});
  out.push_back(RemoveRecord{"a", 1});
  out.push_back(AdvanceStepRecord{"a", 10});
  EmbeddingsRecord e;
  e.dim = 3;
  e.entries.push_back(EmbeddingEntry{"a", 1, 2, {0.5f, -0.25f, 1.0f}});
  e.entries.push_back(EmbeddingEntry{"bb", 9, 1, {0.0f, 1e-30f, -3.5f}});
  out.push_back(e);
  out.push_back(LoggedRecord{"agent-1", 3, 9, encode_record(RemoveRecord{"agent-1", 7})});
  out.push_back(DropAgentRecord{"agent-1"});
  out.push_back(RequestedRecord{"agent-1", 0x9e3779b97f4a7c15ull, 12, 7, 1, 42,
                                encode_record(WriteRecord{"agent-1", 7, 2, 42, 5, "a cup"})});
  out.push_back(
      LoggedRecord{"agent-1", 4, 9,
                   encode_record(RequestedRecord{"agent-1", 3, 1, 0, 0, 11,
                                                 encode_record(AdvanceStepRecord{"agent-1", 1})})});
  return out;
}

StoreSnapshot sample_snapshot() {
  StoreSnapshot s;
  s.dim = 2;
  s.next_seq = 5;
  AgentSnapshot a;
  a.name = "robot";
  a.step = 12;
  a.next_id = 4;
  a.next_group_id = 2;
  a.groups.push_back(GroupSnapshot{1, 1, 3, 2});
  a.segments.push_back(SegmentSnapshot{1, 0, 1, 0, 4, 1, 1, false, "cup on table", {1.0f, 0.0f}});
  a.segments.push_back(SegmentSnapshot{3, 2, 2, 5, 2, 4, 0, true, "plan", {}});
  s.agents.push_back(a);
  s.agents.push_back(AgentSnapshot{"z", 0, 1, 1, {}, {}});
  return s;
}

}  // namespace

TEST_CASE("records round-trip exactly") {
  for (const Record& r : sample_records()) {
    const std::string bytes = encode_record(r);
    auto d = decode_record(bytes);
    REQUIRE(d.is_ok());
    CHECK(encode_record(*d) == bytes);
    CHECK(d->index() == r.index());
  }
  auto d = decode_record(encode_record(sample_records()[0]));
  const auto& w = std::get<WriteRecord>(*d);
  CHECK(w.agent == "agent-1");
  CHECK(w.id == 7);
  CHECK(w.kind == 2);
  CHECK(w.step == 42);
  CHECK(w.tokens == 5);
  CHECK(w.text == "put the cup on the table");
}

TEST_CASE("record encoding is little-endian with the documented header") {
  const std::string b = encode_record(RemoveRecord{"ab", 0x0102030405060708ull});
  REQUIRE(b.size() == 2 + 4 + 2 + 8);
  CHECK(static_cast<uint8_t>(b[0]) == kRecordFormatVersion);
  CHECK(static_cast<uint8_t>(b[1]) == static_cast<uint8_t>(RecordType::kRemove));
  CHECK(static_cast<uint8_t>(b[2]) == 2);  // string length, LE
  CHECK(b.substr(6, 2) == "ab");
  CHECK(static_cast<uint8_t>(b[8]) == 0x08);
  CHECK(static_cast<uint8_t>(b[15]) == 0x01);
}

TEST_CASE("every truncated record is kCorrupt") {
  for (const Record& r : sample_records()) {
    const std::string bytes = encode_record(r);
    for (size_t n = 0; n < bytes.size(); ++n) {
      auto d = decode_record(std::string_view(bytes.data(), n));
      REQUIRE_FALSE(d.is_ok());
      CHECK(d.status().code() == Code::kCorrupt);
    }
    auto extra = decode_record(bytes + "x");
    REQUIRE_FALSE(extra.is_ok());
    CHECK(extra.status().code() == Code::kCorrupt);
  }
}

TEST_CASE("bad version, bad type, huge counts") {
  std::string b = encode_record(AdvanceStepRecord{"a", 1});
  b[0] = 9;
  CHECK(decode_record(b).status().code() == Code::kVersionMismatch);
  b[0] = static_cast<char>(kRecordFormatVersion);
  b[1] = 77;
  CHECK(decode_record(b).status().code() == Code::kCorrupt);
  // A request id of client 0 says "no id": never in a record.
  CHECK(decode_record(encode_record(RequestedRecord{"a", 0, 1, 0, 0, 2,
                                                    encode_record(AdvanceStepRecord{"a", 1})}))
            .status()
            .code() == Code::kCorrupt);

  // An embeddings record that claims 2^32-1 entries of dim 1 in a few bytes.
  std::string e;
  e.push_back(static_cast<char>(kRecordFormatVersion));
  e.push_back(static_cast<char>(RecordType::kEmbeddings));
  e.append("\x01\x00\x00\x00", 4);
  e.append("\xff\xff\xff\xff", 4);
  CHECK(decode_record(e).status().code() == Code::kCorrupt);
  // A string length past the end.
  std::string w;
  w.push_back(static_cast<char>(kRecordFormatVersion));
  w.push_back(static_cast<char>(RecordType::kWrite));
  w.append("\xff\xff\xff\x7f", 4);
  w.append("abc");
  CHECK(decode_record(w).status().code() == Code::kCorrupt);
}

TEST_CASE("random corruption never crashes") {
  std::mt19937 rng(1234);
  std::vector<std::string> inputs;
  for (const Record& r : sample_records()) inputs.push_back(encode_record(r));
  inputs.push_back(encode_snapshot(sample_snapshot()));
  int ok = 0, failed = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string b = inputs[rng() % inputs.size()];
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] = static_cast<char>(rng() & 0xff);
    if (rng() % 3 == 0) b.resize(rng() % (b.size() + 1));
    auto r = decode_record(b);
    auto s = decode_snapshot(b);
    (r.is_ok() ? ok : failed) += 1;
    (s.is_ok() ? ok : failed) += 1;
    if (r.is_ok()) CHECK(decode_record(encode_record(*r)).is_ok());
  }
  CHECK(failed > 0);
  MESSAGE("random corruption: " << ok << " decoded, " << failed << " rejected");
}

TEST_CASE("snapshots round-trip; truncations are kCorrupt") {
  const StoreSnapshot s = sample_snapshot();
  const std::string bytes = encode_snapshot(s);
  auto d = decode_snapshot(bytes);
  REQUIRE(d.is_ok());
  CHECK(encode_snapshot(*d) == bytes);
  REQUIRE(d->agents.size() == 2);
  CHECK(d->agents[0].segments[1].awaiting);
  CHECK(d->agents[0].segments[0].embedding == std::vector<float>{1.0f, 0.0f});
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto t = decode_snapshot(std::string_view(bytes.data(), n));
    REQUIRE_FALSE(t.is_ok());
    CHECK(t.status().code() == Code::kCorrupt);
  }
  std::string v = bytes;
  v[4] = 7;  // format version
  CHECK(decode_snapshot(v).status().code() == Code::kVersionMismatch);
  CHECK(decode_snapshot("").status().code() == Code::kCorrupt);
}

TEST_CASE("snapshots carry each agent's log position; version 1 snapshots still decode") {
  StoreSnapshot s = sample_snapshot();
  s.agents.resize(1);
  s.agents[0].log_seq = 12;
  s.agents[0].log_epoch = 4;
  const std::string v3 = encode_snapshot(s);
  auto d = decode_snapshot(v3);
  REQUIRE(d.is_ok());
  CHECK(d->agents[0].log_seq == 12);
  CHECK(d->agents[0].log_epoch == 4);
  // Version 2: the same bytes without the 4 of the (empty) window of request ids, after the
  // agent's name "robot", its three u64 counters and its position: 22 header bytes + 9 + 24 + 16.
  std::string v2 = v3;
  v2.erase(22 + 9 + 24 + 16, 4);
  v2[4] = 2;
  d = decode_snapshot(v2);
  REQUIRE(d.is_ok());
  CHECK(encode_snapshot(*d) == v3);
  // Version 1: nor the 16 of the position.
  std::string v1 = v2;
  v1.erase(22 + 9 + 24, 16);
  v1[4] = 1;
  d = decode_snapshot(v1);
  REQUIRE(d.is_ok());
  CHECK(d->agents[0].log_seq == 0);
  s.agents[0].log_seq = 0;
  s.agents[0].log_epoch = 0;
  CHECK(encode_snapshot(*d) == encode_snapshot(s));
}

TEST_CASE("snapshots carry each agent's window of request ids, oldest first") {
  StoreSnapshot s = sample_snapshot();
  s.agents[0].requests.push_back(RequestSnapshot{77, 1, 1, 3, 1, 12});
  s.agents[0].requests.push_back(RequestSnapshot{77, 2, 4, 0, 0, 13});
  s.agents[1].requests.push_back(RequestSnapshot{5, 9, 3, 1, 0, 0});
  const std::string bytes = encode_snapshot(s);
  auto d = decode_snapshot(bytes);
  REQUIRE(d.is_ok());
  CHECK(encode_snapshot(*d) == bytes);
  REQUIRE(d->agents[0].requests.size() == 2);
  CHECK(d->agents[0].requests[1].seq == 2);
  CHECK(d->agents[0].requests[1].op == 4);
  CHECK(d->agents[0].requests[1].step == 13);
  for (size_t n = 0; n < bytes.size(); ++n) {
    CHECK(decode_snapshot(std::string_view(bytes.data(), n)).status().code() == Code::kCorrupt);
  }
  StoreSnapshot bad = s;
  bad.agents[0].requests[0].op = 5;  // not a mutation
  CHECK(decode_snapshot(encode_snapshot(bad)).status().code() == Code::kCorrupt);
  bad = s;
  bad.agents[0].requests[0].client = 0;  // "no id"
  CHECK(decode_snapshot(encode_snapshot(bad)).status().code() == Code::kCorrupt);
}

TEST_CASE("snapshot with an embedding of the wrong dimension is kCorrupt") {
  StoreSnapshot s = sample_snapshot();
  s.agents[0].segments[0].embedding = {1.0f, 0.0f, 0.0f};
  CHECK(decode_snapshot(encode_snapshot(s)).status().code() == Code::kCorrupt);
  s = sample_snapshot();
  s.agents[0].segments[0].kind = 9;
  CHECK(decode_snapshot(encode_snapshot(s)).status().code() == Code::kCorrupt);
}
