// RpcServer: the keep-manager's ZeroMQ ROUTER loop with batched dispatch (group commit).
//
// One I/O thread polls the ROUTER socket(s). When requests are ready it drains up to
// `max_batch` of them, decodes each (size limit before decoding, structure, protocol version;
// see shared/rpc/wire_codec.h), hands the WHOLE batch of decoded calls to the handler in one
// call — so the handler can apply every mutation, append their WAL records, fsync once and only
// then answer — and then sends every reply. Requests that do not decode are answered with their
// error (kTooLarge, kMalformed, kVersionMismatch) without reaching the handler. Bad input never
// stops the loop. Frames: [identity][empty][payload] (DEALER or REQ peers).
//
// Deferred calls: a handler that cannot answer a call without blocking (work that takes long and
// needs no I/O-thread state) takes it out of the batch with Call::defer() and hands it to another
// thread, which fills the response and gives it back through RpcServer::complete(); the I/O thread
// sends it when it next wakes and goes on serving other peers meanwhile. A deferred answer may
// reach its peer after answers to requests that peer sent later (clients match request ids).
//
// Replies: ZeroMQ bounds a peer's queue in messages, not bytes, so its pipe is kept short and the
// answers it cannot take wait in a per-peer outbox bounded in bytes (reply_outbox.h), flushed
// without blocking on every pass of the loop (which polls without waiting right after a reply
// moved, then every millisecond, while any is non-empty). A peer that does not read ends up
// dropping answers; from then until it takes one, its requests are refused (kResourceExhausted)
// without reaching the handler.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "proto/manager.capnp.h"
#include "shared/rpc/wire_codec.h"
#include "shared/common/status.h"

namespace keep::wire {

inline constexpr const char* kDefaultManagerEndpoint = "tcp://127.0.0.1:7601";

struct ServerOptions {
  // tcp://127.0.0.1:PORT (PORT 0 or * picks a free port: see bound_endpoints()) and/or ipc://path.
  std::vector<std::string> endpoints = {kDefaultManagerEndpoint};
  WireLimits limits;                  // max_message_bytes (default 1 MiB) and capnp limits
  size_t hard_max_message_bytes = 0;  // ZMQ_MAXMSGSIZE: peers sending more are disconnected
                                      // without an answer; 0 = 16 x limits.max_message_bytes
  size_t max_batch = 256;             // requests handed to the handler at once
  int idle_interval_ms = 100;         // on_idle() cadence when no request arrives
  int receive_high_water_mark = 100000;
  // Sending (see "Replies" above): ZeroMQ queues at most send_high_water_mark replies per peer
  // (ZMQ_ROUTER_MANDATORY: a full pipe is EAGAIN, not a silent drop); the rest wait in the
  // server's outbox, at most max_queued_reply_bytes_per_peer bytes of them; a reply beyond is
  // dropped, and a peer's outbox that did not move for reply_stall_timeout is dropped whole.
  int send_high_water_mark = 64;
  size_t max_queued_reply_bytes_per_peer = size_t{16} << 20;
  std::chrono::milliseconds reply_stall_timeout{30000};
  // Calls of one peer whose answer can be large (listings, retrieves, jobs) in one batch; the
  // next one starts the following batch. Bounds the answers built at once for one peer (each up
  // to the largest reply) and lets other peers in; writes do not count (group commit).
  size_t max_batch_per_peer = 32;
};

// One decoded request and its response. The handler fills the response through reply() (the
// union member) or fail(); a call left unanswered is answered kInternal by the server.
class Call {
 public:
  uint64_t request_id() const { return request_id_; }
  proto::Request::Reader request() const { return request_; }
  // The response to fill: protocolVersion and requestId are set already. Marks the call answered.
  proto::Response::Builder reply();
  // Answers with an error (replaces anything set before).
  void fail(const Status& status);
  bool answered() const { return answered_; }

  // Moves the call (request, response, peer) out of its batch into the returned object, to be
  // answered later through RpcServer::complete(). What stays in the batch is an empty call marked
  // deferred: the server sends nothing for it, and its request() must not be read.
  std::unique_ptr<Call> defer();
  bool deferred() const { return deferred_; }
  // When the server received the request.
  std::chrono::steady_clock::time_point received() const { return received_; }
  // When its caller stops waiting: received() + the request's timeoutMs; time_point::max() when
  // the request has none (0).
  std::chrono::steady_clock::time_point deadline() const { return deadline_; }
  // The ROUTER identity of the peer that sent it (empty without a server).
  const std::string& peer() const { return peer_; }

 private:
  friend class RpcServer;
  friend struct CallAccess;
  uint64_t request_id_ = 0;
  proto::Request::Reader request_;
  std::unique_ptr<DecodedMessage> owner_;
  std::unique_ptr<capnp::MallocMessageBuilder> response_;
  std::string peer_;  // the ROUTER identity to answer
  std::chrono::steady_clock::time_point received_;
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
  bool answered_ = false;
  bool deferred_ = false;
};

class RequestHandler {
 public:
  virtual ~RequestHandler() = default;
  // Called on the I/O thread with every decoded request of one batch, in arrival order.
  // Must answer each call; should not throw (the server answers kInternal if it does).
  virtual void handle_batch(std::span<Call> calls) = 0;
  // Called on the I/O thread after each batch and every idle_interval_ms without requests
  // (lease expiry, housekeeping).
  virtual void on_idle() {}
  // Called on the I/O thread with a deferred call given back through RpcServer::complete(), just
  // before its answer is sent (metrics).
  virtual void on_deferred_done(Call& /*call*/) {}
};

struct ServerStats {
  uint64_t requests = 0;       // frames received
  uint64_t batches = 0;        // handle_batch calls
  uint64_t decode_errors = 0;  // answered without reaching the handler
  uint64_t max_batch_seen = 0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t replies_dropped = 0;     // peer gone, its outbox full or stalled
  uint64_t deferred = 0;            // calls the handler deferred
  uint64_t deferred_done = 0;       // deferred calls given back and answered
  uint64_t refused_unread = 0;      // requests refused because their peer does not read answers
  uint64_t reply_queued_bytes = 0;  // in the outboxes now (beyond ZeroMQ's pipes)
};

// The server's per-frame path without sockets: decode `payload` (limits, structure, version),
// hand it to `handler` as a batch of one, and return the encoded answer. Used by the fuzz target
// and tests; the loop runs the same steps over batches.
std::string dispatch_frame(std::span<const std::byte> payload, const WireLimits& limits,
                           RequestHandler& handler);

class RpcServer {
 public:
  // Binds every endpoint (kInvalidArgument / kUnavailable with the endpoint on failure).
  // `handler` must outlive the server.
  static Result<std::unique_ptr<RpcServer>> create(ServerOptions options, RequestHandler* handler);
  ~RpcServer();  // stop() + join
  RpcServer(const RpcServer&) = delete;
  RpcServer& operator=(const RpcServer&) = delete;

  // Runs the loop on the calling thread until stop().
  void run();
  // Runs the loop on a thread of its own.
  void start();
  // Asks the loop to return; thread-safe, idempotent, async-signal-safe (an atomic store and a
  // write(2) to an eventfd). Joins nothing: the destructor (or the caller of run()) does.
  void stop();
  void join();
  // Gives back a call the handler deferred, its response filled (or failed; one left unanswered
  // is answered kInternal): the I/O thread sends it. Thread-safe. One given back after the loop's
  // last pass (after stop()) is sent when the server is destroyed; it must not be called once
  // the server is destroyed.
  void complete(std::unique_ptr<Call> call);

  // The endpoints as bound (a tcp port 0 resolved to the real port).
  const std::vector<std::string>& bound_endpoints() const { return bound_; }
  ServerStats stats() const;

 private:
  struct Impl;
  explicit RpcServer(std::unique_ptr<Impl> impl);
  void loop();
  std::unique_ptr<Impl> impl_;
  std::vector<std::string> bound_;
  std::thread thread_;
};

}  // namespace keep::wire
