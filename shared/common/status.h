// Status and Result<T>: how recoverable errors travel inside KEEP.
//
// The codes mirror `ErrorCode` in proto/common.capnp one to one (pinned by static_asserts in
// shared/proto); everything that crosses a process carries one of them with a message. Invariant
// violations do not use Status: they abort through KEEP_CHECK with file:line.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace keep {

// Keep in the same order and values as proto/common.capnp `ErrorCode`.
enum class Code : uint16_t {
  kOk = 0,
  kUnknown = 1,            // an unexpected failure; the message says what
  kInvalidArgument = 2,    // the request is well formed but a field is out of range
  kMalformed = 3,          // the bytes do not decode
  kTooLarge = 4,           // a message or a field exceeds its limit
  kVersionMismatch = 5,    // protocol, format or model fingerprint differs
  kNotFound = 6,           // unknown agent, segment, group, entry or job
  kAlreadyExists = 7,      // id taken
  kStale = 8,              // a version moved on since the caller read it
  kResourceExhausted = 9,  // arena full, too many entries, queue full
  kUnavailable = 10,       // shutting down or a dependency is not ready
  kIoError = 11,           // disk or OS call failed
  kCorrupt = 12,           // a checksum or an on-disk structure is wrong
  kInternal = 13,          // a bug: an invariant failed on a recoverable path
  kLeaseExpired = 14,      // a reservation's lease ran out before commit
  kTimeout = 15,           // the peer did not answer in time
  kMoved = 16,             // cluster mode: another node serves the agent; the message names it
};
inline constexpr int kCodeCount = 17;

// "ok", "invalid_argument", ... (stable, used in logs, metrics labels and the CLI).
const char* code_name(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }
  bool is_ok() const { return code_ == Code::kOk; }
  explicit operator bool() const { return is_ok(); }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

  // "not_found: segment 7 of agent 'a'".
  std::string to_string() const;

  // Adds context in front of the message: "loading snapshot: " + message.
  Status with_context(std::string_view context) const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// Result<T>: a value or an error Status (never an ok Status).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).is_ok()) {
      v_ = Status(Code::kInternal, "Result constructed from an ok Status");
    }
  }

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }

  const Status& status() const {
    static const Status kOkStatus;
    return is_ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &std::get<T>(v_); }
  const T* operator->() const { return &std::get<T>(v_); }
  T& operator*() & { return std::get<T>(v_); }
  const T& operator*() const& { return std::get<T>(v_); }

 private:
  std::variant<T, Status> v_;
};

[[noreturn]] void check_failed(const char* file, int line, const char* expr, const char* msg);

}  // namespace keep

// Invariants: abort with file:line. Not for input validation.
#define KEEP_CHECK(cond)                                              \
  do {                                                                \
    if (!(cond)) ::keep::check_failed(__FILE__, __LINE__, #cond, ""); \
  } while (0)
#define KEEP_CHECK_MSG(cond, msg)                                        \
  do {                                                                   \
    if (!(cond)) ::keep::check_failed(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)

// Early return of a failed Status / Result from a function returning Status or Result<U>.
#define KEEP_RETURN_IF_ERROR(expr)          \
  do {                                      \
    ::keep::Status _keep_st = (expr);       \
    if (!_keep_st.is_ok()) return _keep_st; \
  } while (0)

#define KEEP_CONCAT_INNER(a, b) a##b
#define KEEP_CONCAT(a, b) KEEP_CONCAT_INNER(a, b)
// KEEP_ASSIGN_OR_RETURN(auto x, make_x()); declares x from a Result or returns its Status.
#define KEEP_ASSIGN_OR_RETURN(decl, expr) \
  KEEP_ASSIGN_OR_RETURN_IMPL(KEEP_CONCAT(_keep_res_, __LINE__), decl, expr)
#define KEEP_ASSIGN_OR_RETURN_IMPL(tmp, decl, expr) \
  auto tmp = (expr);                                \
  if (!tmp.is_ok()) return tmp.status();            \
  decl = std::move(tmp).value()
