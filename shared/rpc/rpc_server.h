// RpcServer<P>: a ZeroMQ ROUTER loop with batched dispatch (group commit), typed on a protocol P
// (shared/client/protocols.h: keep-manager's and keep-worker's).
//
// One I/O thread polls the ROUTER socket(s). When requests are ready it drains up to
// `max_batch` of them, decodes each (size limit before decoding, structure, protocol version;
// see wire_codec.h), hands the WHOLE batch of decoded calls to the handler in one call — so the
// handler can apply every mutation, append their WAL records, fsync once and only then answer —
// and then sends every reply. Requests that do not decode are answered with their error
// (kTooLarge, kMalformed, kVersionMismatch) without reaching the handler. Bad input never stops
// the loop. Frames: [identity][empty][payload] (DEALER or REQ peers).
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
//
// The socket side (RouterSocket, rpc_server.cpp) knows nothing of the protocol; the typed loop
// below decodes, batches and answers.
#pragma once

#include <kj/exception.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "shared/common/log.h"
#include "shared/common/status.h"
#include "shared/rpc/wire_codec.h"

namespace keep::wire {

struct ServerOptions {
  // tcp://127.0.0.1:PORT (PORT 0 or * picks a free port: see bound_endpoints()) and/or ipc://path.
  std::vector<std::string> endpoints;
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
  // Calls of one peer whose answer can be large (P::answer_may_be_large) in one batch; the next
  // one starts the following batch. Bounds the answers built at once for one peer (each up to the
  // largest reply) and lets other peers in; other calls (writes) do not count (group commit).
  size_t max_batch_per_peer = 32;
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

// The protocol-blind half of the server: the bound ROUTER socket, its wake-up eventfds, the
// outbox and the counters. Used by RpcServer<P> on its I/O thread (notify_* from any thread).
class RouterSocket {
 public:
  // One received message: the peer's identity and the payload, or a framing error.
  struct Frame {
    std::string peer;
    std::string payload;
    bool framing_ok = true;
    size_t parts = 0;  // frames after the identity
  };
  struct Events {
    bool readable = false;
    bool stop = false;
    bool done = false;  // notify_done() was called since the last wait
  };

  static Result<std::unique_ptr<RouterSocket>> bind(const ServerOptions& options);
  ~RouterSocket();
  RouterSocket(const RouterSocket&) = delete;
  RouterSocket& operator=(const RouterSocket&) = delete;

  // Polls the socket and both eventfds for at most `timeout` (0: no wait).
  Events wait(std::chrono::milliseconds timeout);
  // The next message without waiting (false: none). Excess frames are dropped.
  bool receive(Frame* out);
  // Sends a reply, or queues it behind the peer's outbox, or drops it (counted).
  void send_reply(const std::string& peer, std::string payload);
  // Hands queued replies to ZeroMQ as far as the pipes take them; whether any moved.
  bool flush_outbox();
  bool outbox_empty() const;
  // Whether `peer` is not reading its answers (see "Replies").
  bool not_reading(const std::string& peer) const;
  // Answers left after stop() may leave for this long once the socket closes.
  void linger_on_close();

  void notify_stop();  // async-signal-safe: an atomic store and a write(2)
  bool stopping() const { return stopping_.load(std::memory_order_acquire); }
  void notify_done();  // wakes wait() with Events::done

  const std::vector<std::string>& bound_endpoints() const { return bound_; }

  struct Counters {
    std::atomic<uint64_t> requests{0}, batches{0}, decode_errors{0}, max_batch_seen{0}, bytes_in{0},
        bytes_out{0}, replies_dropped{0}, deferred{0}, deferred_done{0}, refused_unread{0},
        reply_queued_bytes{0};
  };
  Counters& counters() { return counters_; }
  ServerStats stats() const;

 private:
  struct Impl;
  explicit RouterSocket(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::vector<std::string> bound_;
  std::atomic<bool> stopping_{false};
  Counters counters_;
};

template <typename P>
class RpcServer;

// One decoded request and its response. The handler fills the response through reply() (the
// union member) or fail(); a call left unanswered is answered kInternal by the server.
template <typename P>
class Call {
 public:
  Call() = default;
  uint64_t request_id() const { return request_id_; }
  typename P::Request::Reader request() const { return request_; }
  // The response to fill: protocolVersion and requestId are set already. Marks the call answered.
  typename P::Response::Builder reply() {
    answered_ = true;
    return response_->template getRoot<typename P::Response>();
  }
  // Answers with an error (replaces anything set before).
  void fail(const Status& status) {
    auto response = reply();
    set_error(response.initError(), status.is_ok() ? Status(Code::kInternal, "fail(ok)") : status);
  }
  bool answered() const { return answered_; }

  // Moves the call (request, response, peer) out of its batch into the returned object, to be
  // answered later through RpcServer::complete(). What stays in the batch is an empty call marked
  // deferred: the server sends nothing for it, and its request() must not be read.
  std::unique_ptr<Call> defer() {
    KEEP_CHECK_MSG(!deferred_, "call deferred twice");
    auto owned = std::make_unique<Call>(std::move(*this));
    *this = Call();
    deferred_ = true;
    answered_ = true;  // nothing may answer what stays in the batch
    return owned;
  }
  bool deferred() const { return deferred_; }
  // When the server received the request.
  std::chrono::steady_clock::time_point received() const { return received_; }
  // When its caller stops waiting: received() + the request's timeout; time_point::max() when
  // the request has none (0).
  std::chrono::steady_clock::time_point deadline() const { return deadline_; }
  // The ROUTER identity of the peer that sent it (empty without a server).
  const std::string& peer() const { return peer_; }

  // A call of decoded request `decoded` from `peer` (the server and tests build them).
  static Call make(DecodedRequest<P> decoded, uint64_t request_id, std::string peer = {}) {
    Call call;
    call.request_id_ = request_id;
    call.peer_ = std::move(peer);
    call.received_ = std::chrono::steady_clock::now();
    if (const uint32_t ms = P::timeout_ms(decoded.request); ms != 0) {
      call.deadline_ = call.received_ + std::chrono::milliseconds(ms);
    }
    call.request_ = decoded.request;
    call.owner_ = std::move(decoded.message);
    call.response_ = std::make_unique<capnp::MallocMessageBuilder>();
    auto response = call.response_->template initRoot<typename P::Response>();
    response.setProtocolVersion(P::kVersion);
    response.setRequestId(request_id);
    return call;
  }

  // The encoded answer (one left unanswered is answered kInternal).
  std::string encode_answer() {
    if (!answered_) fail(Status(Code::kInternal, "request left unanswered"));
    try {
      return encode(*response_);
    } catch (const kj::Exception& e) {
      return encode_error_response<P>(
          request_id_, Status(Code::kInternal,
                              std::string("encoding the answer: ") + e.getDescription().cStr()));
    }
  }

 private:
  uint64_t request_id_ = 0;
  typename P::Request::Reader request_;
  std::unique_ptr<DecodedMessage> owner_;
  std::unique_ptr<capnp::MallocMessageBuilder> response_;
  std::string peer_;  // the ROUTER identity to answer
  std::chrono::steady_clock::time_point received_;
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
  bool answered_ = false;
  bool deferred_ = false;
};

template <typename P>
class RequestHandler {
 public:
  virtual ~RequestHandler() = default;
  // Called on the I/O thread with every decoded request of one batch, in arrival order.
  // Must answer each call; should not throw (the server answers kInternal if it does).
  virtual void handle_batch(std::span<Call<P>> calls) = 0;
  // Called on the I/O thread after each batch and every idle_interval_ms without requests
  // (lease expiry, housekeeping).
  virtual void on_idle() {}
  // Called on the I/O thread with a deferred call given back through RpcServer::complete(), just
  // before its answer is sent (metrics).
  virtual void on_deferred_done(Call<P>& /*call*/) {}
};

namespace detail {
// Runs handle_batch; a throw answers every unanswered call kInternal.
template <typename P>
void handle_guarded(RequestHandler<P>& handler, std::span<Call<P>> calls) {
  const char* what = nullptr;
  std::string text;
  try {
    handler.handle_batch(calls);
    return;
  } catch (const kj::Exception& e) {
    text = e.getDescription().cStr();
  } catch (const std::exception& e) {
    text = e.what();
  }
  what = text.c_str();
  KEEP_LOG_ERROR("rpc", "handler threw: %s", what);
  for (auto& c : calls) {
    if (!c.answered()) c.fail(Status(Code::kInternal, "handler failed"));
  }
}
Status not_reading_status();
}  // namespace detail

// The server's per-frame path without sockets: decode `payload` (limits, structure, version),
// hand it to `handler` as a batch of one, and return the encoded answer. Used by the fuzz target
// and tests; the loop runs the same steps over batches.
template <typename P>
std::string dispatch_frame(std::span<const std::byte> payload, const WireLimits& limits,
                           RequestHandler<P>& handler) {
  uint64_t request_id = 0;
  auto decoded = decode_request<P>(payload, limits, &request_id);
  if (!decoded.is_ok()) return encode_error_response<P>(request_id, decoded.status());
  Call<P> call = Call<P>::make(std::move(decoded).value(), request_id);
  detail::handle_guarded(handler, std::span<Call<P>>(&call, 1));
  if (call.deferred()) {
    return encode_error_response<P>(request_id,
                                    Status(Code::kInternal, "call deferred without a server"));
  }
  return call.encode_answer();
}

template <typename P>
class RpcServer {
 public:
  // Binds every endpoint (kInvalidArgument / kUnavailable with the endpoint on failure).
  // `handler` must outlive the server.
  static Result<std::unique_ptr<RpcServer>> create(ServerOptions options,
                                                   RequestHandler<P>* handler) {
    if (handler == nullptr) return Status(Code::kInvalidArgument, "rpc server: no handler");
    if (options.max_batch == 0) options.max_batch = 1;
    if (options.max_batch_per_peer == 0) options.max_batch_per_peer = 1;
    auto socket = RouterSocket::bind(options);
    if (!socket.is_ok()) return socket.status();
    return std::unique_ptr<RpcServer>(
        new RpcServer(std::move(options), handler, std::move(socket).value()));
  }
  // stop() + join; calls given back after the loop's last pass are answered from here.
  ~RpcServer() {
    stop();
    join();
    send_done();
    socket_->flush_outbox();
    socket_->linger_on_close();
  }
  RpcServer(const RpcServer&) = delete;
  RpcServer& operator=(const RpcServer&) = delete;

  // Runs the loop on the calling thread until stop().
  void run() { loop(); }
  // Runs the loop on a thread of its own.
  void start() {
    KEEP_CHECK_MSG(!thread_.joinable(), "rpc server started twice");
    thread_ = std::thread([this] { loop(); });
  }
  // Asks the loop to return; thread-safe, idempotent, async-signal-safe. Joins nothing: the
  // destructor (or the caller of run()) does.
  void stop() { socket_->notify_stop(); }
  void join() {
    if (thread_.joinable()) thread_.join();
  }
  // Gives back a call the handler deferred, its response filled (or failed; one left unanswered
  // is answered kInternal): the I/O thread sends it. Thread-safe. One given back after the loop's
  // last pass (after stop()) is sent when the server is destroyed; it must not be called once
  // the server is destroyed.
  void complete(std::unique_ptr<Call<P>> call) {
    if (call == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(done_mu_);
      done_.push_back(std::move(call));
    }
    socket_->notify_done();
  }

  // The endpoints as bound (a tcp port 0 resolved to the real port).
  const std::vector<std::string>& bound_endpoints() const { return socket_->bound_endpoints(); }
  ServerStats stats() const { return socket_->stats(); }

 private:
  RpcServer(ServerOptions options, RequestHandler<P>* handler, std::unique_ptr<RouterSocket> socket)
      : options_(std::move(options)), handler_(handler), socket_(std::move(socket)) {}

  // Answers the deferred calls given back since the last time (on the socket's thread).
  void send_done() {
    std::vector<std::unique_ptr<Call<P>>> calls;
    {
      std::lock_guard<std::mutex> lock(done_mu_);
      calls.swap(done_);
    }
    for (auto& c : calls) {
      try {
        handler_->on_deferred_done(*c);
      } catch (const std::exception& e) {
        KEEP_LOG_ERROR("rpc", "on_deferred_done threw: %s", e.what());
      } catch (const kj::Exception& e) {
        KEEP_LOG_ERROR("rpc", "on_deferred_done threw: %s", e.getDescription().cStr());
      }
      std::string payload = c->encode_answer();
      // Counted before the reply leaves: a client that has its answer finds it in the stats.
      socket_->counters().deferred_done.fetch_add(1, std::memory_order_relaxed);
      socket_->send_reply(c->peer(), std::move(payload));
    }
  }

  // One received message awaiting its reply: a call for the handler, or an error already.
  struct Pending {
    std::string peer;
    int call = -1;        // index into the batch's calls, or -1
    std::string payload;  // the encoded error reply when call < 0
  };

  void loop();

  ServerOptions options_;
  RequestHandler<P>* handler_;
  std::unique_ptr<RouterSocket> socket_;
  std::thread thread_;
  std::mutex done_mu_;
  std::vector<std::unique_ptr<Call<P>>> done_;
};

// While an outbox holds replies, the loop cannot be told when a peer's pipe drains: it polls
// without waiting for a moment after the last reply moved (ZeroMQ's I/O thread drains a pipe of
// small answers in microseconds, and a pipelining client's next batch depends on it), then every
// millisecond, and every 10 ms once nothing moved for a second (a peer that does not read costs
// a hundred send attempts a second).
inline constexpr auto kFlushSpin = std::chrono::microseconds(300);
inline constexpr auto kFlushRetry = std::chrono::milliseconds(1);
inline constexpr auto kFlushRetryStuck = std::chrono::milliseconds(10);

template <typename P>
void RpcServer<P>::loop() {
  RouterSocket& sock = *socket_;
  auto& n = sock.counters();
  const auto idle = std::chrono::milliseconds(std::max(1, options_.idle_interval_ms));
  auto last_idle = std::chrono::steady_clock::now();
  std::vector<Pending> pending;
  std::vector<Call<P>> calls;
  pending.reserve(options_.max_batch);
  calls.reserve(options_.max_batch);
  std::unordered_map<std::string, size_t> per_peer;  // large-answer calls of each peer in batch
  RouterSocket::Frame frame;
  bool carried = false;  // `frame` ended the last batch: it starts the next one
  auto last_moved = std::chrono::steady_clock::now();  // a queued reply last left the outbox

  while (!sock.stopping()) {
    auto timeout = idle;
    if (carried) {
      timeout = std::chrono::milliseconds(0);
    } else if (!sock.outbox_empty()) {
      const auto since = std::chrono::steady_clock::now() - last_moved;
      if (since < kFlushSpin) {
        timeout = std::chrono::milliseconds(0);
        std::this_thread::yield();  // let ZeroMQ's I/O thread drain the pipes
      } else {
        timeout = since < std::chrono::seconds(1) ? kFlushRetry : kFlushRetryStuck;
      }
    }
    const RouterSocket::Events ev = sock.wait(timeout);
    if (ev.stop) break;
    if (sock.flush_outbox()) last_moved = std::chrono::steady_clock::now();
    if (ev.done) send_done();

    const bool readable = ev.readable || carried;
    if (readable) {
      pending.clear();
      calls.clear();
      per_peer.clear();
      // ---- drain up to max_batch messages (max_batch_per_peer of one peer) and decode them ----
      while (pending.size() < options_.max_batch && (carried || sock.receive(&frame))) {
        carried = false;
        Pending p;
        p.peer = frame.peer;
        if (!frame.framing_ok) {
          n.decode_errors.fetch_add(1, std::memory_order_relaxed);
          p.payload = encode_error_response<P>(
              0, Status(Code::kMalformed,
                        "bad framing: expected [empty][payload] after the identity, got " +
                            std::to_string(frame.parts) + " frame(s)"));
          pending.push_back(std::move(p));
          continue;
        }
        const bool unread = sock.not_reading(p.peer);
        uint64_t request_id = 0;
        auto decoded = decode_request<P>(as_bytes(frame.payload), options_.limits, &request_id);
        if (!unread && decoded.is_ok() && P::answer_may_be_large(decoded->request) &&
            ++per_peer[p.peer] > options_.max_batch_per_peer) {
          carried = true;  // decoded again as the first of the next batch
          break;
        }
        n.bytes_in.fetch_add(frame.payload.size(), std::memory_order_relaxed);
        if (!decoded.is_ok() || unread) {
          Status refused = decoded.is_ok() ? detail::not_reading_status() : decoded.status();
          (unread ? n.refused_unread : n.decode_errors).fetch_add(1, std::memory_order_relaxed);
          KEEP_LOG_DEBUG("rpc", "request %llu refused: %s",
                         static_cast<unsigned long long>(request_id), refused.to_string().c_str());
          p.payload = encode_error_response<P>(request_id, refused);
          pending.push_back(std::move(p));
          continue;
        }
        p.call = static_cast<int>(calls.size());
        calls.push_back(Call<P>::make(std::move(decoded).value(), request_id, p.peer));
        pending.push_back(std::move(p));
      }

      // ---- the handler sees the whole batch ----
      if (!calls.empty()) {
        n.batches.fetch_add(1, std::memory_order_relaxed);
        uint64_t seen = n.max_batch_seen.load(std::memory_order_relaxed);
        while (calls.size() > seen && !n.max_batch_seen.compare_exchange_weak(seen, calls.size())) {
        }
        detail::handle_guarded(*handler_, std::span<Call<P>>(calls));
      }

      // ---- send every reply, in arrival order (deferred calls are answered later) ----
      for (auto& p : pending) {
        std::string payload;
        if (p.call >= 0) {
          Call<P>& c = calls[static_cast<size_t>(p.call)];
          if (c.deferred()) {
            n.deferred.fetch_add(1, std::memory_order_relaxed);
            continue;
          }
          payload = c.encode_answer();
          c = Call<P>();  // its response builder goes now, not with the whole batch
        } else {
          payload = std::move(p.payload);
        }
        sock.send_reply(p.peer, std::move(payload));
      }
      pending.clear();
      calls.clear();  // releases the request buffers and response builders
    }

    const auto now = std::chrono::steady_clock::now();
    if (now - last_idle >= idle || readable) {
      last_idle = now;
      try {
        handler_->on_idle();
      } catch (const std::exception& e) {
        KEEP_LOG_ERROR("rpc", "on_idle threw: %s", e.what());
      } catch (const kj::Exception& e) {
        KEEP_LOG_ERROR("rpc", "on_idle threw: %s", e.getDescription().cStr());
      }
    }
  }
  KEEP_LOG_INFO("rpc", "stopped after %llu requests",
                static_cast<unsigned long long>(n.requests.load()));
}

}  // namespace keep::wire
