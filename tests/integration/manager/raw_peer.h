// A raw DEALER peer for end-to-end tests of keep-manager: sends arbitrary frames (or requests
// built here) and decodes whatever comes back, without the client library's matching and
// timeouts.
#pragma once

#include <capnp/message.h>
#include <doctest/doctest.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>
#include <zmq.hpp>

#include "shared/client/protocols.h"
#include "shared/rpc/wire_codec.h"

namespace keep::itest {

// An encoded Request with `id`, its call set by `fill`.
inline std::string request_bytes(uint64_t id,
                                 const std::function<void(proto::Request::Builder)>& fill,
                                 uint16_t version = keep::client::ManagerProtocol::kVersion) {
  capnp::MallocMessageBuilder message;
  auto req = message.initRoot<proto::Request>();
  req.setProtocolVersion(version);
  req.setRequestId(id);
  fill(req);
  return wire::encode(message);
}

struct RawPeer {
  // `configure` sets socket options before the connection (e.g. a tiny receive queue).
  explicit RawPeer(const std::string& endpoint,
                   const std::function<void(zmq::socket_t&)>& configure = {})
      : socket(ctx, zmq::socket_type::dealer) {
    socket.set(zmq::sockopt::linger, 0);
    if (configure) configure(socket);
    socket.connect(endpoint);
  }
  void send(const std::vector<std::string>& frames) {
    for (size_t i = 0; i < frames.size(); ++i) {
      socket.send(zmq::buffer(frames[i]),
                  i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
  // The next answer's bytes (one encoded Response); nullopt when none arrives within `wait`.
  std::optional<std::string> payload(
      std::chrono::milliseconds wait = std::chrono::milliseconds(5000)) {
    zmq::pollitem_t item{static_cast<void*>(socket), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, wait);
    if (!(item.revents & ZMQ_POLLIN)) return std::nullopt;
    std::vector<zmq::message_t> frames;
    for (;;) {
      zmq::message_t f;
      REQUIRE(socket.recv(f).has_value());
      const bool more = f.more();
      frames.push_back(std::move(f));
      if (!more) break;
    }
    REQUIRE(frames.size() == 2);
    CHECK(frames[0].size() == 0);
    return std::string(static_cast<const char*>(frames[1].data()), frames[1].size());
  }
  // The next answer's status and request id; nullopt when none arrives within `wait`.
  std::optional<std::pair<Status, uint64_t>> answer(
      std::chrono::milliseconds wait = std::chrono::milliseconds(5000)) {
    const std::optional<std::string> bytes = payload(wait);
    if (!bytes) return std::nullopt;
    auto decoded = wire::decode_message(wire::as_bytes(*bytes), {});
    REQUIRE(decoded.is_ok());
    auto response = (*decoded)->root<proto::Response>();
    CHECK(response.getProtocolVersion() == keep::client::ManagerProtocol::kVersion);
    if (response.which() == proto::Response::ERROR) {
      return std::make_pair(wire::status_from_error(response.getError()), response.getRequestId());
    }
    return std::make_pair(Status::ok(), response.getRequestId());
  }
  // The next answer, which must come within 5 s.
  std::pair<Status, uint64_t> next() {
    auto a = answer();
    REQUIRE(a.has_value());
    return *a;
  }
  zmq::context_t ctx{1};
  zmq::socket_t socket;
};

// A mutation's answer (write, update, delete, advance_step): ok and its fields, or the error.
struct Answered {
  Status status;
  uint64_t id = 0, version = 0, step = 0;
};

// The next answer of `peer`, which must come within 5 s and be a mutation's or an error.
inline Answered read_answer(RawPeer& peer) {
  const std::optional<std::string> bytes = peer.payload();
  REQUIRE(bytes.has_value());
  auto decoded = wire::decode_message(wire::as_bytes(*bytes), {});
  REQUIRE(decoded.is_ok());
  auto r = (*decoded)->root<proto::Response>();
  Answered out;
  switch (r.which()) {
    case proto::Response::ERROR:
      out.status = wire::status_from_error(r.getError());
      break;
    case proto::Response::WRITE_MEMORY:
      out = {Status::ok(), r.getWriteMemory().getId(), r.getWriteMemory().getVersion(),
             r.getWriteMemory().getStep()};
      break;
    case proto::Response::UPDATE_MEMORY:
      out = {Status::ok(), r.getUpdateMemory().getId(), r.getUpdateMemory().getVersion(),
             r.getUpdateMemory().getStep()};
      break;
    case proto::Response::ADVANCE_STEP:
      out.step = r.getAdvanceStep().getStep();
      break;
    case proto::Response::DELETE_MEMORY:
      break;
    default:
      FAIL("not a mutation's answer: " << static_cast<int>(r.which()));
  }
  return out;
}

}  // namespace keep::itest
