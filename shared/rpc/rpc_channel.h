// RpcChannel: the blocking DEALER end of a KEEP protocol (one request, one answer at a time).
//
// Transport problems become statuses: kTimeout (no answer within the timeout), kTooLarge (request
// over the limit, refused before sending; an answer over max_response_bytes), kMalformed (an
// answer that does not decode), kUnavailable (ZeroMQ failed). After a timeout the channel
// reconnects with a fresh socket, and answers whose requestId is not the one awaited are dropped,
// so a late answer to an abandoned request is never mistaken for the current one.
//
// Thread-compatible: one channel per thread (a ZeroMQ socket must not be shared).
#pragma once

#include <capnp/message.h>
#include <kj/exception.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "shared/common/status.h"
#include "shared/rpc/wire_codec.h"

namespace keep::wire {

struct ChannelOptions {
  std::string endpoint;                          // tcp://host:port or ipc://path
  std::chrono::milliseconds timeout{5000};       // per request; sent as the request's timeoutMs
  size_t max_request_bytes = size_t{1} << 20;    // refused locally with kTooLarge
  size_t max_response_bytes = size_t{64} << 20;  // larger answers are kTooLarge
};

class RpcChannel {
 public:
  // Creates the socket and connects (ZeroMQ connects lazily: an absent server shows up as
  // kTimeout on the first call).
  static Result<std::unique_ptr<RpcChannel>> connect(ChannelOptions options);
  ~RpcChannel();
  RpcChannel(const RpcChannel&) = delete;
  RpcChannel& operator=(const RpcChannel&) = delete;

  // Sends one frame and waits for an answer that `accept` takes (returns true), until the
  // timeout.
  Status exchange(std::string_view payload, const std::function<bool(std::string&&)>& accept);
  // Sends raw frame bytes and returns the raw answer (tests and tools; no id matching).
  Result<std::string> call_raw(std::string_view payload);

  // One round trip of protocol P. `fill(request)` sets the request's union member; `extract`
  // reads the response and is called only for a non-error answer of the `expected` kind.
  template <typename P, typename Fill, typename Extract>
  Status call(typename P::Response::Which expected, Fill&& fill, Extract&& extract);

  const ChannelOptions& options() const { return options_; }

 private:
  struct Impl;
  explicit RpcChannel(ChannelOptions options);
  ChannelOptions options_;
  std::unique_ptr<Impl> impl_;
  uint64_t next_request_id_ = 1;
};

template <typename P, typename Fill, typename Extract>
Status RpcChannel::call(typename P::Response::Which expected, Fill&& fill, Extract&& extract) {
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<typename P::Request>();
  const uint64_t id = next_request_id_++;
  request.setProtocolVersion(P::kVersion);
  request.setRequestId(id);
  // The server drops work this call no longer waits for (a queued request).
  request.setTimeoutMs(
      static_cast<uint32_t>(std::clamp<int64_t>(options_.timeout.count(), 0, UINT32_MAX)));
  fill(request);
  const std::string payload = encode(message);

  WireLimits limits;
  limits.max_message_bytes = options_.max_response_bytes;
  Status result;
  KEEP_RETURN_IF_ERROR(exchange(payload, [&](std::string&& bytes) {
    auto decoded = decode_message(as_bytes(bytes), limits);
    if (!decoded.is_ok()) {
      result = decoded.status().with_context("decoding the answer");
      return true;  // an undecodable answer to us (or to nobody): report it
    }
    try {
      auto response = (*decoded)->template root<typename P::Response>();
      if (response.getRequestId() != id) return false;  // late answer to an abandoned request
      if (response.which() == P::Response::ERROR) {
        result = status_from_error(response.getError());
      } else if (response.which() != expected) {
        result = Status(Code::kMalformed,
                        "answer of type " + std::to_string(static_cast<int>(response.which())) +
                            " to a request of type " + std::to_string(static_cast<int>(expected)));
      } else {
        result = extract(response);
      }
    } catch (const kj::Exception& e) {
      result =
          Status(Code::kMalformed, std::string("undecodable answer: ") + e.getDescription().cStr());
    }
    return true;
  }));
  return result;
}

}  // namespace keep::wire
