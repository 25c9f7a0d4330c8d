"""Errors of the KEEP services, one class per wire ErrorCode (proto/common.capnp).

Every failure a call reports is a KeepError: `code` is the wire code's name ("not_found", ...),
`value` its number, `message` the server's (or the client's) text. Transport failures use the
same codes as the C++ client: timeout (no answer in time), too_large (a request over the limit,
refused before sending), malformed (an answer that does not decode), unavailable (ZeroMQ failed).
"""

# Same names, order and values as keep::Code (shared/common/status.h) and ErrorCode.
CODES = (
    "ok", "unknown", "invalid_argument", "malformed", "too_large", "version_mismatch",
    "not_found", "already_exists", "stale", "resource_exhausted", "unavailable", "io_error",
    "corrupt", "internal", "lease_expired", "timeout", "moved",
)


class KeepError(Exception):
    """A call failed; `code` names the wire code, `value` is its number."""

    code = "unknown"

    def __init__(self, message, code=None):
        if code is not None:
            self.code = code
        super().__init__(f"{self.code}: {message}")
        self.message = message

    @property
    def value(self):
        return CODES.index(self.code) if self.code in CODES else 1


def _class_name(code):
    if code == "timeout":
        return "RequestTimeoutError"  # not the builtin TimeoutError
    return "".join(part.capitalize() for part in code.split("_")) + "Error"


# InvalidArgumentError, NotFoundError, RequestTimeoutError ... one subclass per code.
_BY_CODE = {}
for _code in CODES[1:]:
    _cls = type(_class_name(_code), (KeepError,), {"code": _code})
    _BY_CODE[_code] = _cls
    globals()[_cls.__name__] = _cls


def error_for(code, message):
    """The KeepError subclass instance for a wire code name (unknown names: KeepError 'unknown')."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return KeepError(message, "unknown")
    return cls(message)


def from_wire(enum_name, message):
    """From a capnp ErrorCode enumerant name ("invalidArgument")."""
    snake = "".join("_" + c.lower() if c.isupper() else c for c in str(enum_name))
    return error_for(snake, message)


def moved_target(message):
    """Where a `moved` answer sends the call (docs/cluster.md, shared/client/moved.h): the word
    after the message's last " at " -- a manager's endpoint in a manager's answer, a worker's in
    a worker's -- or None when the answer names none (a worker that does not know the owner's)."""
    head, sep, target = message.rpartition(" at ")
    if not sep or not target or " " in target:
        return None
    return target


__all__ = ["KeepError", "CODES", "error_for", "from_wire", "moved_target"] + [c.__name__ for c in _BY_CODE.values()]
