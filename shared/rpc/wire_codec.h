// Wire codec: what every KEEP client and server shares about bytes on the wire.
//
// - size limit checked BEFORE any decoding (kTooLarge), then structure validated with capnp
//   ReaderOptions limits (kMalformed on any kj::Exception), then the protocol version
//   (kVersionMismatch with both versions in the message);
// - keep::Code <-> proto::ErrorCode mapping (pinned one to one by static_asserts);
// - checked decoding of wire enums: an unset or unknown value is kInvalidArgument, never a cast.
// A protocol (manager.capnp, worker.capnp) is named by a traits struct P: P::Request and
// P::Response (capnp structs whose protocolVersion @0 and requestId @1 are fixed, and whose
// Response union has `error @2 :Common.Error`), P::kVersion, P::kName. See
// shared/client/protocols.h. The frame layout and limits are documented in docs/protocol.md.
#pragma once

#include <capnp/message.h>
#include <capnp/schema.h>
#include <kj/exception.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "proto/common.capnp.h"
#include "shared/common/status.h"

namespace keep::wire {

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

// Serialises a builder to the bytes of one frame.
std::string encode(capnp::MessageBuilder& message);

// Reads the root struct's requestId (data word 1) straight from a frame, bounds-checked, without
// decoding it: only to address an error reply to a frame that does not decode. 0 when not found.
uint64_t peek_request_id(std::span<const std::byte> bytes);

// The "speaks protocol version" refusal, naming both versions.
Status version_mismatch(const char* protocol, uint16_t theirs, uint16_t ours);

// A decoded P::Request whose protocol version matched.
template <typename P>
struct DecodedRequest {
  std::unique_ptr<DecodedMessage> message;
  typename P::Request::Reader request;
};

// decode_message + root P::Request + protocol version check. On failure `*request_id` (if given)
// holds the request id when it could be read cheaply (also for kTooLarge and kVersionMismatch),
// else 0.
template <typename P>
Result<DecodedRequest<P>> decode_request(std::span<const std::byte> bytes, const WireLimits& limits,
                                         uint64_t* request_id = nullptr) {
  if (request_id) *request_id = 0;
  auto decoded = decode_message(bytes, limits);
  if (!decoded.is_ok()) {
    if (request_id) *request_id = peek_request_id(bytes);
    return decoded.status();
  }
  DecodedRequest<P> out;
  out.message = std::move(decoded).value();
  try {
    out.request = out.message->template root<typename P::Request>();
    if (request_id) *request_id = out.request.getRequestId();
    const uint16_t version = out.request.getProtocolVersion();
    if (version != P::kVersion) return version_mismatch(P::kName, version, P::kVersion);
  } catch (const kj::Exception& e) {
    return Status(Code::kMalformed,
                  std::string("undecodable request: ") + e.getDescription().cStr());
  }
  return out;
}

// An error P::Response for `request_id` (used for requests that could not be decoded).
template <typename P>
std::string encode_error_response(uint64_t request_id, const Status& status) {
  capnp::MallocMessageBuilder message;
  auto response = message.initRoot<typename P::Response>();
  response.setProtocolVersion(P::kVersion);
  response.setRequestId(request_id);
  set_error(response.initError(), status);
  return encode(message);
}

// Text for a builder, sized (Text::Reader's implicit conversion from std::string goes through
// c_str() and stops at a NUL), and a received Text as a string.
inline capnp::Text::Reader as_text(std::string_view s) { return {s.data(), s.size()}; }
inline std::string to_string(capnp::Text::Reader t) { return std::string(t.begin(), t.size()); }

inline std::span<const std::byte> as_bytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

}  // namespace keep::wire
