// Bad input against the real keep-manager process (the daemon assembly: its limits from flags, its
// ROUTER socket, its store): each case gets its error code and the daemon keeps serving. The
// exhaustive per-case coverage is in-process, in tests/integration/test_rpc_server.cpp.
#include <capnp/message.h>
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "shared/client/manager_client.h"
#include "shared/common/utf8.h"
#include "shared/rpc/wire_codec.h"
#include "tests/integration/manager/manager_process.h"
#include "tests/integration/manager/raw_peer.h"

namespace {

using namespace std::chrono_literals;
namespace kc = keep::client;
namespace it = keep::itest;
namespace wire = keep::wire;
namespace proto = keep::proto;
using it::RawPeer;
using it::request_bytes;
using keep::Code;
using keep::Status;

std::string write_bytes(uint64_t id, size_t text_bytes) {
  return request_bytes(id, [&](proto::Request::Builder r) {
    auto w = r.initWriteMemory();
    w.setAgent("a");
    w.setText(std::string(text_bytes, 'x'));
    w.setKind(proto::SegmentKind::OBJECT_STATE);
  });
}

}  // namespace

TEST_CASE("the keep-manager process answers bad input with its error code and keeps serving") {
  it::TempDir tmp("badinput");
  it::ManagerProcess m({(tmp.path() / "data").string(),
                        it::unique_name("badinput"),
                        {"--max-message-bytes", "4KiB", "--max-text-bytes", "256"}});
  kc::ClientOptions o;
  o.endpoint = m.endpoint();
  o.timeout = 10000ms;
  o.max_request_bytes = 1 << 20;  // let oversized requests reach the daemon
  auto client = kc::ManagerClient::connect(o);
  REQUIRE(client.is_ok());
  kc::ManagerClient& c = **client;
  REQUIRE(
      c.write({"a", 1, "the red mug is in the sink", kc::SegmentKind::kObjectState, {}}).is_ok());

  RawPeer peer(m.endpoint());
  auto still_serving = [&](const char* after) {
    INFO("after " << after);
    REQUIRE_MESSAGE(m.alive(), m.err());
    auto p = c.ping();
    REQUIRE_MESSAGE(p.is_ok(), p.status().to_string());
    CHECK(p->find("keep-manager") != std::string::npos);
  };

  // Malformed bytes.
  peer.send({"", std::string(64, '\xa5')});
  auto a = peer.answer();
  REQUIRE(a.has_value());
  CHECK(a->first.code() == Code::kMalformed);
  CHECK(a->second == 0);
  peer.send({"", ""});
  a = peer.answer();
  REQUIRE(a.has_value());
  CHECK(a->first.code() == Code::kMalformed);
  still_serving("malformed bytes");

  // Bad framing: no empty delimiter frame.
  peer.send({request_bytes(3, [](auto r) { r.initPing(); })});
  a = peer.answer();
  REQUIRE(a.has_value());
  CHECK(a->first.code() == Code::kMalformed);
  still_serving("bad framing");

  // Over --max-message-bytes (4 KiB): tooLarge before decoding, the request id still answered.
  peer.send({"", write_bytes(11, 8 * 1024)});
  a = peer.answer();
  REQUIRE(a.has_value());
  CHECK(a->first.code() == Code::kTooLarge);
  CHECK(a->second == 11);
  // ... and through the client library.
  CHECK(c.write({"a", {}, std::string(8 * 1024, 'y'), {}, {}}).status().code() == Code::kTooLarge);
  still_serving("oversized message");

  // Beyond the hard cap (16 x the limit): ZeroMQ drops that peer; nobody else notices.
  {
    RawPeer rude(m.endpoint());
    rude.send({"", write_bytes(12, 80 * 1024)});
    CHECK_FALSE(rude.answer(1500ms).has_value());
  }
  still_serving("a frame over the hard cap");

  // Wrong protocol version: versionMismatch naming both versions.
  peer.send({"", request_bytes(
                     21, [](auto r) { r.initPing(); }, 9)});
  a = peer.answer();
  REQUIRE(a.has_value());
  CHECK(a->first.code() == Code::kVersionMismatch);
  CHECK(a->second == 21);
  CHECK(a->first.message().find('9') != std::string::npos);
  still_serving("wrong protocol version");

  // Store-level errors through the client library.
  CHECK(c.retrieve("nobody", "mug", 3).status().code() == Code::kNotFound);
  CHECK(c.list_groups("nobody").status().code() == Code::kNotFound);
  still_serving("unknown agent");
  CHECK(c.update("a", 999, "x").status().code() == Code::kNotFound);
  CHECK(c.remove("a", 999).code() == Code::kNotFound);
  still_serving("unknown segment");
  CHECK(c.write({"a", {}, "", {}, {}}).status().code() == Code::kInvalidArgument);
  CHECK(c.update("a", 1, "").status().code() == Code::kInvalidArgument);
  still_serving("empty text");
  // Over --max-text-bytes (256) but well under --max-message-bytes.
  CHECK(c.write({"a", {}, std::string(300, 'z'), {}, {}}).status().code() == Code::kTooLarge);
  CHECK(c.retrieve("a", std::string(300, 'q'), 3).status().code() == Code::kTooLarge);
  still_serving("over-long text");
  CHECK(c.write({"a", 1, "a duplicate id", {}, {}}).status().code() == Code::kAlreadyExists);
  still_serving("a duplicate id");

  // Text clients cannot decode is refused at the door, and no error echoes its raw bytes.
  auto refused_cleanly = [](const Status& st) {
    CHECK(st.code() == Code::kInvalidArgument);
    CHECK_MESSAGE(keep::utf8_valid(st.message()), st.message());
    CHECK(st.message().find('\xff') == std::string::npos);
  };
  const std::vector<std::string> bad_texts = {"the mug \xff is here", "\xc0\xafoverlong",
                                              "\xed\xa0\x80surrogate",
                                              std::string("a NUL\0byte", 11)};
  for (const std::string& bad : bad_texts) {
    refused_cleanly(c.write({"a", {}, bad, {}, {}}).status());
    refused_cleanly(c.update("a", 1, bad).status());
    refused_cleanly(c.retrieve("a", bad, 3).status());
  }
  refused_cleanly(c.write({"robot\xff", {}, "the mug", {}, {}}).status());
  refused_cleanly(c.list_memories("robot\xff\xfe").status());
  CHECK(c.write({"a", {}, "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x8d\x8e", {}, {}}).is_ok());
  still_serving("invalid UTF-8");

  // A step beyond the largest one is refused; the agent's steps still advance afterwards.
  refused_cleanly(c.write({"a", {}, "far future", {}, UINT64_MAX}).status());
  refused_cleanly(c.advance_step("a", UINT64_MAX).status());
  auto stepped = c.advance_step("a", 1);
  CHECK_MESSAGE(stepped.is_ok(), stepped.status().to_string());
  still_serving("a step beyond the largest");

  // The state is intact: exactly the good writes.
  auto r = c.retrieve("a", "mug", 10);
  REQUIRE(r.is_ok());
  REQUIRE(r->size() == 2);
  CHECK(((*r)[0].text == "the red mug is in the sink" ||
         (*r)[1].text == "the red mug is in the sink"));
  CHECK(m.terminate() == 0);
}
