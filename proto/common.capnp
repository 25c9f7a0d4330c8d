# Types every KEEP service shares on the wire. See docs/protocol.md.
@0x905795d3b1e58a83;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("keep::proto");

# One error-code enum for everything that crosses a process. Same names, order and values as
# keep::Code in shared/common/status.h (pinned by static_asserts in shared/client/wire_codec.cpp).
# A value a peer does not know decodes to keep::Code::kUnknown.
enum ErrorCode {
  ok @0;
  unknown @1;
  invalidArgument @2;
  malformed @3;
  tooLarge @4;
  versionMismatch @5;
  notFound @6;
  alreadyExists @7;
  stale @8;
  resourceExhausted @9;
  unavailable @10;
  ioError @11;
  corrupt @12;
  internal @13;
  leaseExpired @14;
  timeout @15;
  moved @16;  # cluster mode: another node serves this agent (the message names it)
}

struct Error {
  code @0 :ErrorCode;
  message @1 :Text;
}
