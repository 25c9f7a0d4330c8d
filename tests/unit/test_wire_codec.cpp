// The wire codec: size limit before decoding, malformed bytes, protocol version, unknown enum
// values, error-code mapping.
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <doctest/doctest.h>

#include <random>
#include <string>

#include "shared/client/protocols.h"
#include "shared/rpc/wire_codec.h"

using keep::Code;
using keep::Status;
namespace wire = keep::wire;
namespace proto = keep::proto;

using MP = keep::client::ManagerProtocol;

namespace {

std::string make_ping(uint64_t request_id, uint16_t version = MP::kVersion) {
  capnp::MallocMessageBuilder message;
  auto req = message.initRoot<proto::Request>();
  req.setProtocolVersion(version);
  req.setRequestId(request_id);
  req.initPing();
  return wire::encode(message);
}

std::string make_write(uint64_t request_id, size_t text_bytes) {
  capnp::MallocMessageBuilder message;
  auto req = message.initRoot<proto::Request>();
  req.setProtocolVersion(MP::kVersion);
  req.setRequestId(request_id);
  auto w = req.initWriteMemory();
  w.setAgent("a");
  w.setText(std::string(text_bytes, 'x'));
  w.setKind(proto::SegmentKind::TASK_RECORD);
  return wire::encode(message);
}

}  // namespace

TEST_CASE("a well-formed request decodes with its id and fields") {
  const std::string bytes = make_write(42, 100);
  uint64_t id = 0;
  auto decoded = wire::decode_request<MP>(wire::as_bytes(bytes), {}, &id);
  REQUIRE(decoded.is_ok());
  CHECK(id == 42);
  CHECK(decoded->request.which() == proto::Request::WRITE_MEMORY);
  CHECK(decoded->request.getWriteMemory().getText().size() == 100);
  CHECK(decoded->request.getWriteMemory().getKind() == proto::SegmentKind::TASK_RECORD);
}

TEST_CASE("the size limit is checked before decoding and the request id is still recovered") {
  wire::WireLimits limits;
  limits.max_message_bytes = 1024;
  const std::string big = make_write(77, 4096);
  uint64_t id = 0;
  auto decoded = wire::decode_request<MP>(wire::as_bytes(big), limits, &id);
  REQUIRE_FALSE(decoded.is_ok());
  CHECK(decoded.status().code() == Code::kTooLarge);
  CHECK(decoded.status().message().find("1024") != std::string::npos);
  CHECK(id == 77);
  // Garbage over the limit is refused as too large too: nothing was decoded.
  std::string garbage(2048, '\xff');
  auto g = wire::decode_request<MP>(wire::as_bytes(garbage), limits, &id);
  CHECK(g.status().code() == Code::kTooLarge);
  CHECK(id == 0);
  // Exactly at the limit is fine.
  const std::string small = make_write(5, 10);
  limits.max_message_bytes = small.size();
  CHECK(wire::decode_request<MP>(wire::as_bytes(small), limits).is_ok());
}

TEST_CASE("malformed bytes are kMalformed, never a crash") {
  uint64_t id = 123;
  CHECK(wire::decode_request<MP>({}, {}, &id).status().code() == Code::kMalformed);
  CHECK(id == 0);
  std::string odd = "abc";
  CHECK(wire::decode_request<MP>(wire::as_bytes(odd), {}).status().code() == Code::kMalformed);
  // A segment table that claims more words than present.
  std::string lying(16, '\0');
  lying[4] = '\x40';
  CHECK(wire::decode_request<MP>(wire::as_bytes(lying), {}).status().code() == Code::kMalformed);
  // Truncations and random bit flips of a valid request: decode or refuse, never crash.
  const std::string good = make_write(9, 64);
  for (size_t n = 8; n < good.size(); n += 8) {
    auto r = wire::decode_request<MP>(wire::as_bytes(std::string_view(good).substr(0, n)), {});
    CHECK_FALSE(r.is_ok());
  }
  std::mt19937 rng(1);
  int refused = 0;
  for (int i = 0; i < 2000; ++i) {
    std::string b = good;
    for (int f = 0; f < 3; ++f) b[rng() % b.size()] ^= static_cast<char>(1 << (rng() % 8));
    auto r = wire::decode_request<MP>(wire::as_bytes(b), {});
    if (!r.is_ok()) {
      ++refused;
      const Code c = r.status().code();
      CHECK((c == Code::kMalformed || c == Code::kVersionMismatch));
    }
  }
  CHECK(refused > 0);
}

TEST_CASE("pointer amplification is bounded by the traversal limit") {
  // A list of many struct pointers all aimed at the same big struct would be read many times.
  capnp::MallocMessageBuilder message;
  auto req = message.initRoot<proto::Request>();
  req.setProtocolVersion(MP::kVersion);
  auto groups = req.initCommitEntry().initSliceTokens(60000);
  for (uint32_t i = 0; i < groups.size(); ++i) groups.set(i, i);
  const std::string bytes = wire::encode(message);
  wire::WireLimits limits;
  CHECK(wire::decode_request<MP>(wire::as_bytes(bytes), limits).is_ok());
  limits.traversal_factor = 0;  // minimal budget: the same message now exceeds it
  CHECK(wire::decode_request<MP>(wire::as_bytes(bytes), limits).status().code() ==
        Code::kMalformed);
}

TEST_CASE("a protocol version mismatch names both versions and keeps the request id") {
  const std::string bytes = make_ping(31, MP::kVersion + 1);
  uint64_t id = 0;
  auto r = wire::decode_request<MP>(wire::as_bytes(bytes), {}, &id);
  REQUIRE_FALSE(r.is_ok());
  CHECK(r.status().code() == Code::kVersionMismatch);
  CHECK(id == 31);
  const std::string& m = r.status().message();
  CHECK(m.find(std::to_string(MP::kVersion + 1)) != std::string::npos);
  CHECK(m.find(std::to_string(MP::kVersion)) != std::string::npos);
}

TEST_CASE("the worker's protocol decodes with its own version; a manager frame is refused") {
  using WP = keep::client::WorkerProtocol;
  capnp::MallocMessageBuilder message;
  auto req = message.initRoot<WP::Request>();
  req.setProtocolVersion(WP::kVersion);
  req.setRequestId(5);
  req.setPing();
  const std::string ping = wire::encode(message);
  auto ok = wire::decode_request<WP>(wire::as_bytes(ping), {});
  REQUIRE(ok.is_ok());
  CHECK(ok->request.which() == WP::Request::PING);

  // A frame whose version is wrong for this protocol names the protocol.
  req.setProtocolVersion(WP::kVersion + 7);
  const std::string bad = wire::encode(message);
  uint64_t id = 0;
  auto r = wire::decode_request<WP>(wire::as_bytes(bad), {}, &id);
  REQUIRE_FALSE(r.is_ok());
  CHECK(r.status().code() == Code::kVersionMismatch);
  CHECK(id == 5);
  CHECK(r.status().message().find("keep-worker") != std::string::npos);

  const std::string err = wire::encode_error_response<WP>(5, Status(Code::kTimeout, "late"));
  auto d = wire::decode_message(wire::as_bytes(err), {});
  REQUIRE(d.is_ok());
  auto resp = (*d)->root<WP::Response>();
  CHECK(resp.getProtocolVersion() == WP::kVersion);
  CHECK(resp.which() == WP::Response::ERROR);
  CHECK(wire::status_from_error(resp.getError()).code() == Code::kTimeout);
}

TEST_CASE("unset and unknown enum values are invalid arguments") {
  CHECK(wire::check_enum(proto::SegmentKind::OBJECT_STATE, "kind").is_ok());
  CHECK(wire::check_enum(proto::SegmentKind::EXAMPLE_PLAN, "kind").is_ok());
  Status unset = wire::check_enum(proto::SegmentKind::UNKNOWN, "kind");
  CHECK(unset.code() == Code::kInvalidArgument);
  CHECK(unset.message().find("kind") != std::string::npos);
  Status beyond = wire::check_enum(static_cast<proto::SegmentKind>(99), "kind");
  CHECK(beyond.code() == Code::kInvalidArgument);
  CHECK(beyond.message().find("99") != std::string::npos);
  CHECK(wire::check_enum(static_cast<proto::GroupState>(3), "state").code() ==
        Code::kInvalidArgument);
  // An unknown value set on the wire by a peer survives encoding and is caught on decode.
  capnp::MallocMessageBuilder message;
  auto req = message.initRoot<proto::Request>();
  req.setProtocolVersion(MP::kVersion);
  req.initWriteMemory().setKind(static_cast<proto::SegmentKind>(7));
  const std::string bytes = wire::encode(message);
  auto decoded = wire::decode_request<MP>(wire::as_bytes(bytes), {});
  REQUIRE(decoded.is_ok());
  CHECK(wire::check_enum(decoded->request.getWriteMemory().getKind(), "kind").code() ==
        Code::kInvalidArgument);
}

TEST_CASE("error codes map one to one, and unknown codes degrade to kUnknown") {
  for (int i = 0; i < keep::kCodeCount; ++i) {
    const auto code = static_cast<Code>(i);
    CHECK(wire::from_wire(wire::to_wire(code)) == code);
    CHECK(static_cast<int>(wire::to_wire(code)) == i);
  }
  CHECK(wire::from_wire(static_cast<proto::ErrorCode>(200)) == Code::kUnknown);
  CHECK(wire::to_wire(static_cast<Code>(300)) == proto::ErrorCode::UNKNOWN);

  const std::string bytes =
      wire::encode_error_response<MP>(8, Status(Code::kNotFound, "segment 3"));
  auto decoded = wire::decode_message(wire::as_bytes(bytes), {});
  REQUIRE(decoded.is_ok());
  auto resp = (*decoded)->root<proto::Response>();
  CHECK(resp.getRequestId() == 8);
  CHECK(resp.getProtocolVersion() == MP::kVersion);
  REQUIRE(resp.which() == proto::Response::ERROR);
  Status st = wire::status_from_error(resp.getError());
  CHECK(st.code() == Code::kNotFound);
  CHECK(st.message() == "segment 3");

  capnp::MallocMessageBuilder m2;
  auto err = m2.initRoot<proto::Error>();
  err.setCode(static_cast<proto::ErrorCode>(99));
  err.setMessage("future");
  Status fut = wire::status_from_error(err.asReader());
  CHECK(fut.code() == Code::kUnknown);
  CHECK(fut.message().find("99") != std::string::npos);
  err.setCode(proto::ErrorCode::OK);
  CHECK(wire::status_from_error(err.asReader()).code() == Code::kUnknown);
}
