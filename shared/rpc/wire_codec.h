// Wire codec: what the keep-manager's client and server share about bytes on the wire.
//
// - size limit checked BEFORE any decoding (kTooLarge), then structure validated with capnp
//   ReaderOptions limits (kMalformed on any kj::Exception), then the protocol version
//   (kVersionMismatch with both versions in the message);
// - keep::Code <-> proto::ErrorCode mapping (pinned one to one by static_asserts);
// - checked decoding of wire enums: an unset or unknown value is kInvalidArgument, never a cast.
// The frame layout and limits are documented in docs/protocol.md.
#pragma once

#include <capnp/message.h>
#include <capnp/schema.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "proto/common.capnp.h"
#include "proto/manager.capnp.h"
#include "shared/common/status.h"

namespace keep::wire {

inline constexpr uint16_t kProtocolVersion = proto::PROTOCOL_VERSION;
inline constexpr size_t kDefaultMaxMessageBytes = size_t{1} << 20;  // 1 MiB

struct WireLimits {
  // Frames larger than this are refused with kTooLarge before decoding.
  size_t max_message_bytes = kDefaultMaxMessageBytes;
  // capnp traversal limit = traversal_factor * message words (bounds pointer amplification; the
  // codec validates the whole tree once and the reader reads it again, hence > 1).
  uint64_t traversal_factor = 4;
  // capnp nesting limit (our schemas nest at most ~6 deep).
  int nesting_limit = 32;
};

// keep::Code <-> proto::ErrorCode. An ErrorCode value this build does not know maps to kUnknown.
proto::ErrorCode to_wire(Code code);
Code from_wire(proto::ErrorCode code);

// Fills an Error from a Status / turns a received Error into a Status (ok codes become kUnknown
// errors: an error response always carries an error).
void set_error(proto::Error::Builder out, const Status& status);
Status status_from_error(proto::Error::Reader error);

// Checks a wire enum value: the `unknown @0` case (unset) and values beyond the schema's
// enumerants are kInvalidArgument naming the field.
Status check_enum(uint16_t raw, uint16_t enumerant_count, std::string_view field);
template <typename E>
Status check_enum(E value, std::string_view field) {
  return check_enum(static_cast<uint16_t>(value),
                    static_cast<uint16_t>(capnp::Schema::from<E>().getEnumerants().size()), field);
}

// One received message, validated: owns the (8-byte aligned) copy of the bytes and the reader.
class DecodedMessage {
 public:
  ~DecodedMessage();
  DecodedMessage(const DecodedMessage&) = delete;
  DecodedMessage& operator=(const DecodedMessage&) = delete;

  template <typename T>
  typename T::Reader root() {
    return reader_->getRoot<T>();
  }

 private:
  friend Result<std::unique_ptr<DecodedMessage>> decode_message(std::span<const std::byte>,
                                                                const WireLimits&);
  DecodedMessage() = default;
  kj::Array<capnp::word> words_;
  std::unique_ptr<capnp::MessageReader> reader_;
};

// Size limit, alignment copy, segment table and full structure validation of `bytes`.
// kTooLarge / kMalformed with context; never throws, never reads past `bytes`.
Result<std::unique_ptr<DecodedMessage>> decode_message(std::span<const std::byte> bytes,
                                                       const WireLimits& limits);

// A decoded Request whose protocol version matched.
struct DecodedRequest {
  std::unique_ptr<DecodedMessage> message;
  proto::Request::Reader request;
};

// decode_message + root Request + protocol version check. On failure `*request_id` (if given)
// holds the request id when it could be read cheaply (also for kTooLarge and kVersionMismatch),
// else 0.
Result<DecodedRequest> decode_request(std::span<const std::byte> bytes, const WireLimits& limits,
                                      uint64_t* request_id = nullptr);

// Serialises a builder to the bytes of one frame.
std::string encode(capnp::MessageBuilder& message);

// An error Response for `request_id` (used for requests that could not be decoded).
std::string encode_error_response(uint64_t request_id, const Status& status);

inline std::span<const std::byte> as_bytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

}  // namespace keep::wire
