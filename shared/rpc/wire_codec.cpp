#include "shared/rpc/wire_codec.h"

#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstring>
#include <exception>

namespace keep::wire {

// keep::Code and proto::ErrorCode are one enum: same order, same values.
#define KEEP_PIN_CODE(ours, theirs)                  \
  static_assert(static_cast<uint16_t>(Code::ours) == \
                static_cast<uint16_t>(proto::ErrorCode::theirs))
KEEP_PIN_CODE(kOk, OK);
KEEP_PIN_CODE(kUnknown, UNKNOWN);
KEEP_PIN_CODE(kInvalidArgument, INVALID_ARGUMENT);
KEEP_PIN_CODE(kMalformed, MALFORMED);
KEEP_PIN_CODE(kTooLarge, TOO_LARGE);
KEEP_PIN_CODE(kVersionMismatch, VERSION_MISMATCH);
KEEP_PIN_CODE(kNotFound, NOT_FOUND);
KEEP_PIN_CODE(kAlreadyExists, ALREADY_EXISTS);
KEEP_PIN_CODE(kStale, STALE);
KEEP_PIN_CODE(kResourceExhausted, RESOURCE_EXHAUSTED);
KEEP_PIN_CODE(kUnavailable, UNAVAILABLE);
KEEP_PIN_CODE(kIoError, IO_ERROR);
KEEP_PIN_CODE(kCorrupt, CORRUPT);
KEEP_PIN_CODE(kInternal, INTERNAL);
KEEP_PIN_CODE(kLeaseExpired, LEASE_EXPIRED);
KEEP_PIN_CODE(kTimeout, TIMEOUT);
KEEP_PIN_CODE(kMoved, MOVED);
#undef KEEP_PIN_CODE
static_assert(kCodeCount == static_cast<int>(proto::ErrorCode::MOVED) + 1,
              "keep::Code and proto ErrorCode have different sizes");

proto::ErrorCode to_wire(Code code) {
  const auto raw = static_cast<uint16_t>(code);
  if (raw >= kCodeCount) return proto::ErrorCode::UNKNOWN;
  return static_cast<proto::ErrorCode>(raw);  // pinned above
}

Code from_wire(proto::ErrorCode code) {
  const auto raw = static_cast<uint16_t>(code);
  if (raw >= kCodeCount) return Code::kUnknown;  // a newer peer's code
  return static_cast<Code>(raw);                 // pinned above, range checked
}

void set_error(proto::Error::Builder out, const Status& status) {
  out.setCode(to_wire(status.code()));
  out.setMessage(status.message());
}

Status status_from_error(proto::Error::Reader error) {
  Code code = from_wire(error.getCode());
  std::string message;
  if (error.hasMessage()) {
    auto m = error.getMessage();
    message.assign(m.begin(), m.size());
  }
  if (code == Code::kOk) {
    code = Code::kUnknown;
    message = "error response with code ok: " + message;
  } else if (static_cast<uint16_t>(error.getCode()) >= kCodeCount) {
    message = "error code " + std::to_string(static_cast<uint16_t>(error.getCode())) +
              " unknown to this build: " + message;
  }
  return Status(code, std::move(message));
}

Status check_enum(uint16_t raw, uint16_t enumerant_count, std::string_view field) {
  if (raw == 0) {
    return Status(Code::kInvalidArgument, std::string(field) + " is unset (unknown)");
  }
  if (raw >= enumerant_count) {
    return Status(Code::kInvalidArgument,
                  std::string(field) + " has unknown value " + std::to_string(raw));
  }
  return Status::ok();
}

DecodedMessage::~DecodedMessage() = default;

Result<std::unique_ptr<DecodedMessage>> decode_message(std::span<const std::byte> bytes,
                                                       const WireLimits& limits) {
  if (bytes.size() > limits.max_message_bytes) {
    return Status(Code::kTooLarge, "message of " + std::to_string(bytes.size()) +
                                       " bytes exceeds the limit of " +
                                       std::to_string(limits.max_message_bytes));
  }
  if (bytes.empty()) return Status(Code::kMalformed, "empty message");
  if (bytes.size() % sizeof(capnp::word) != 0) {
    return Status(Code::kMalformed, "message of " + std::to_string(bytes.size()) +
                                        " bytes is not a whole number of 8-byte words");
  }
  std::unique_ptr<DecodedMessage> msg(new DecodedMessage());
  const size_t nwords = bytes.size() / sizeof(capnp::word);
  msg->words_ = kj::heapArray<capnp::word>(nwords);  // aligned copy: zmq frames may be unaligned
  std::memcpy(msg->words_.begin(), bytes.data(), bytes.size());
  capnp::ReaderOptions options;
  options.traversalLimitInWords = std::max<uint64_t>(64, nwords * limits.traversal_factor);
  options.nestingLimit = limits.nesting_limit;
  try {
    msg->reader_ = std::make_unique<capnp::FlatArrayMessageReader>(msg->words_.asPtr(), options);
    // Walk the whole tree once: every pointer is bounds-checked here, so a structural error is
    // reported now as kMalformed instead of surfacing later inside a handler.
    (void)msg->reader_->getRoot<capnp::AnyPointer>().targetSize();
  } catch (const kj::Exception& e) {
    return Status(Code::kMalformed,
                  std::string("undecodable message: ") + e.getDescription().cStr());
  } catch (const std::exception& e) {
    return Status(Code::kMalformed, std::string("undecodable message: ") + e.what());
  }
  return msg;
}

namespace {

uint32_t load_u32(const std::byte* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;  // capnp is little-endian; so are our targets
}
uint64_t load_u64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

uint64_t peek_request_id(std::span<const std::byte> bytes) {
  if (bytes.size() < 8) return 0;
  const uint64_t segments = uint64_t{load_u32(bytes.data())} + 1;
  const uint64_t seg0_words = load_u32(bytes.data() + 4);
  const uint64_t table_bytes = ((4 + 4 * segments) + 7) / 8 * 8;
  if (segments > 512 || table_bytes >= bytes.size()) return 0;
  const std::byte* seg0 = bytes.data() + table_bytes;
  const uint64_t seg0_bytes = std::min<uint64_t>(seg0_words * 8, bytes.size() - table_bytes);
  if (seg0_bytes < 8) return 0;
  const uint64_t root = load_u64(seg0);
  if ((root & 3) != 0) return 0;  // not a struct pointer
  const int64_t offset_words = static_cast<int32_t>(static_cast<uint32_t>(root)) >> 2;
  const uint64_t data_words = (root >> 32) & 0xffff;
  if (offset_words < 0 || data_words < 2) return 0;
  const uint64_t field = (1 + static_cast<uint64_t>(offset_words) + 1) * 8;
  if (field + 8 > seg0_bytes) return 0;
  return load_u64(seg0 + field);
}

Status version_mismatch(const char* protocol, uint16_t theirs, uint16_t ours) {
  return Status(Code::kVersionMismatch, std::string("request speaks ") + protocol +
                                            " protocol version " + std::to_string(theirs) +
                                            ", this server speaks version " + std::to_string(ours));
}

std::string encode(capnp::MessageBuilder& message) {
  auto words = capnp::messageToFlatArray(message);
  auto bytes = words.asBytes();
  return std::string(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
}

}  // namespace keep::wire
