// The protocols KEEP speaks, as the traits shared/rpc's codec, server and channel are typed on
// (see shared/rpc/wire_codec.h for what a protocol provides).
#pragma once

#include <cstdint>

#include "proto/manager.capnp.h"
#include "proto/worker.capnp.h"

namespace keep::client {

// keep-manager: agents' memories, retrieval, KV jobs (proto/manager.capnp).
struct ManagerProtocol {
  using Request = proto::Request;
  using Response = proto::Response;
  static constexpr uint16_t kVersion = proto::PROTOCOL_VERSION;
  static constexpr const char* kName = "keep-manager";
  // How long the caller waits, in ms from receipt (0: not said).
  static uint32_t timeout_ms(Request::Reader r) { return r.getTimeoutMs(); }
  // Calls whose answer can be large (a listing page, a retrieve, jobs): only they count toward
  // the server's per-peer batch cap, so that a client pipelining writes keeps its large batches
  // (one fsync).
  static bool answer_may_be_large(Request::Reader r) {
    switch (r.which()) {
      case Request::LIST_MEMORIES:
      case Request::RETRIEVE:
      case Request::LIST_GROUPS:
      case Request::FETCH_JOBS:
        return true;
      default:
        return false;
    }
  }
};

// keep-worker: planners' completions (proto/worker.capnp).
struct WorkerProtocol {
  using Request = proto::worker::Request;
  using Response = proto::worker::Response;
  static constexpr uint16_t kVersion = proto::worker::PROTOCOL_VERSION;
  static constexpr const char* kName = "keep-worker";
  static uint32_t timeout_ms(Request::Reader r) { return r.getTimeoutMs(); }
  static bool answer_may_be_large(Request::Reader r) { return r.which() == Request::COMPLETE; }
};

}  // namespace keep::client
