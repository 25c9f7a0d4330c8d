#include "shared/common/status.h"

namespace keep {

const char* code_name(Code code) {
  switch (code) {
    case Code::kOk:
      return "ok";
    case Code::kUnknown:
      return "unknown";
    case Code::kInvalidArgument:
      return "invalid_argument";
    case Code::kMalformed:
      return "malformed";
    case Code::kTooLarge:
      return "too_large";
    case Code::kVersionMismatch:
      return "version_mismatch";
    case Code::kNotFound:
      return "not_found";
    case Code::kAlreadyExists:
      return "already_exists";
    case Code::kStale:
      return "stale";
    case Code::kResourceExhausted:
      return "resource_exhausted";
    case Code::kUnavailable:
      return "unavailable";
    case Code::kIoError:
      return "io_error";
    case Code::kCorrupt:
      return "corrupt";
    case Code::kInternal:
      return "internal";
    case Code::kLeaseExpired:
      return "lease_expired";
    case Code::kTimeout:
      return "timeout";
    case Code::kMoved:
      return "moved";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  std::string s = code_name(code_);
  if (!message_.empty()) {
    s += ": ";
    s += message_;
  }
  return s;
}

Status Status::with_context(std::string_view context) const {
  if (is_ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return Status(code_, std::move(m));
}

void check_failed(const char* file, int line, const char* expr, const char* msg) {
  std::fprintf(stderr, "%s:%d: KEEP_CHECK(%s) failed%s%s\n", file, line, expr, msg[0] ? ": " : "",
               msg);
  std::fflush(stderr);
  std::abort();
}

}  // namespace keep
