#include "shared/rpc/rpc_server.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <kj/exception.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <zmq.hpp>

#include "shared/rpc/reply_outbox.h"
#include "shared/common/log.h"

namespace keep::wire {

namespace {
constexpr const char* kLog = "rpc";
// How long the socket may hold the last answers after stop() before it closes.
constexpr int kStopLingerMs = 500;
// While an outbox holds replies, the loop cannot be told when a peer's pipe drains: it polls
// without waiting for a moment after the last reply moved (ZeroMQ's I/O thread drains a pipe of
// small answers in microseconds, and a pipelining client's next batch depends on it), then every
// millisecond, and every 10 ms once nothing moved for a second (a peer that does not read costs
// a hundred send attempts a second).
constexpr auto kFlushSpin = std::chrono::microseconds(300);
constexpr auto kFlushRetry = std::chrono::milliseconds(1);
constexpr auto kFlushRetryStuck = std::chrono::milliseconds(10);

// Calls whose answer can be large (a listing page, a retrieve, jobs): only they count toward
// max_batch_per_peer, so that a client pipelining writes keeps its large batches (one fsync).
bool answer_may_be_large(proto::Request::Which which) {
  switch (which) {
    case proto::Request::LIST_MEMORIES:
    case proto::Request::RETRIEVE:
    case proto::Request::LIST_GROUPS:
    case proto::Request::FETCH_JOBS:
      return true;
    default:
      return false;
  }
}
}  // namespace

proto::Response::Builder Call::reply() {
  answered_ = true;
  return response_->getRoot<proto::Response>();
}

void Call::fail(const Status& status) {
  auto response = reply();
  set_error(response.initError(), status.is_ok() ? Status(Code::kInternal, "fail(ok)") : status);
}

std::unique_ptr<Call> Call::defer() {
  KEEP_CHECK_MSG(!deferred_, "call deferred twice");
  auto owned = std::make_unique<Call>(std::move(*this));
  *this = Call();
  deferred_ = true;
  answered_ = true;  // nothing may answer what stays in the batch
  return owned;
}

struct CallAccess {
  static Call make(DecodedRequest decoded, uint64_t request_id, std::string peer = {}) {
    Call call;
    call.request_id_ = request_id;
    call.peer_ = std::move(peer);
    call.received_ = std::chrono::steady_clock::now();
    if (const uint32_t ms = decoded.request.getTimeoutMs(); ms != 0) {
      call.deadline_ = call.received_ + std::chrono::milliseconds(ms);
    }
    call.request_ = decoded.request;
    call.owner_ = std::move(decoded.message);
    call.response_ = std::make_unique<capnp::MallocMessageBuilder>();
    auto response = call.response_->initRoot<proto::Response>();
    response.setProtocolVersion(kProtocolVersion);
    response.setRequestId(request_id);
    return call;
  }
  static capnp::MallocMessageBuilder& response(Call& call) { return *call.response_; }
  static const std::string& peer(const Call& call) { return call.peer_; }
};

namespace {
// The encoded answer of a handled call (one left unanswered is answered kInternal).
std::string answer_of(Call& c) {
  if (!c.answered()) c.fail(Status(Code::kInternal, "request left unanswered"));
  try {
    return encode(CallAccess::response(c));
  } catch (const kj::Exception& e) {
    return encode_error_response(
        c.request_id(),
        Status(Code::kInternal, std::string("encoding the answer: ") + e.getDescription().cStr()));
  }
}
}  // namespace

std::string dispatch_frame(std::span<const std::byte> payload, const WireLimits& limits,
                           RequestHandler& handler) {
  uint64_t request_id = 0;
  auto decoded = decode_request(payload, limits, &request_id);
  if (!decoded.is_ok()) return encode_error_response(request_id, decoded.status());
  Call call = CallAccess::make(std::move(decoded).value(), request_id);
  try {
    handler.handle_batch(std::span<Call>(&call, 1));
  } catch (const kj::Exception& e) {
    if (!call.answered()) call.fail(Status(Code::kInternal, "handler failed"));
  } catch (const std::exception& e) {
    if (!call.answered()) call.fail(Status(Code::kInternal, "handler failed"));
  }
  if (call.deferred()) {
    return encode_error_response(request_id,
                                 Status(Code::kInternal, "call deferred without a server"));
  }
  return answer_of(call);
}

struct RpcServer::Impl {
  ServerOptions options;
  RequestHandler* handler = nullptr;
  zmq::context_t context{1};
  std::unique_ptr<zmq::socket_t> router;
  int wake_fd = -1;
  std::atomic<bool> stopping{false};
  // Deferred calls given back (complete()), waiting for the I/O thread; done_fd wakes it.
  int done_fd = -1;
  std::mutex done_mu;
  std::vector<std::unique_ptr<Call>> done;

  // Replies ZeroMQ's pipe could not take yet (same thread rule as send_reply).
  std::unique_ptr<ReplyOutbox> outbox;

  std::atomic<uint64_t> requests{0}, batches{0}, decode_errors{0}, max_batch_seen{0}, bytes_in{0},
      bytes_out{0}, replies_dropped{0}, deferred{0}, deferred_done{0}, refused_unread{0},
      reply_queued_bytes{0};

  // Hands [identity][empty][payload] to ZeroMQ without blocking.
  ReplyOutbox::Sent try_send(const std::string& peer, const std::string& payload);
  // Sends a reply, or queues it behind the peer's outbox, or drops it (counted) when the peer is
  // gone or its outbox full. On the thread that owns the socket: the I/O loop's, or the
  // destructor's once the loop is over.
  void send_reply(const std::string& peer, std::string payload);
  // Hands the outboxes' replies to ZeroMQ as far as the peers' pipes take them (same thread);
  // whether any reply moved.
  bool flush_outbox();
  // Answers the deferred calls given back since the last time (same thread rule).
  void send_done();

  ~Impl() {
    router.reset();
    if (wake_fd >= 0) ::close(wake_fd);
    if (done_fd >= 0) ::close(done_fd);
  }
};

RpcServer::RpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RpcServer::~RpcServer() {
  stop();
  join();
  // The loop is over: calls given back since its last pass (just before stop(), or after it:
  // ManagerService::stop_deferred_retrieves once a signal stopped the loop) are answered from
  // here, and the socket lingers a moment so that those answers leave before it closes.
  impl_->send_done();
  impl_->flush_outbox();
  try {
    impl_->router->set(zmq::sockopt::linger, kStopLingerMs);
  } catch (const zmq::error_t& e) {
    KEEP_LOG_WARN(kLog, "linger: %s", e.what());
  }
}

Result<std::unique_ptr<RpcServer>> RpcServer::create(ServerOptions options,
                                                     RequestHandler* handler) {
  if (handler == nullptr) return Status(Code::kInvalidArgument, "rpc server: no handler");
  if (options.endpoints.empty()) return Status(Code::kInvalidArgument, "rpc server: no endpoint");
  if (options.max_batch == 0) options.max_batch = 1;
  if (options.limits.max_message_bytes == 0) {
    return Status(Code::kInvalidArgument, "rpc server: max_message_bytes must be > 0");
  }
  if (options.max_batch_per_peer == 0) options.max_batch_per_peer = 1;
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->outbox = std::make_unique<ReplyOutbox>(options.max_queued_reply_bytes_per_peer,
                                               options.reply_stall_timeout);
  impl->handler = handler;
  impl->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  impl->done_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl->wake_fd < 0 || impl->done_fd < 0) {
    return Status(Code::kIoError, std::string("rpc server: eventfd: ") + std::strerror(errno));
  }
  std::vector<std::string> bound;
  try {
    impl->router = std::make_unique<zmq::socket_t>(impl->context, zmq::socket_type::router);
    auto& s = *impl->router;
    s.set(zmq::sockopt::linger, 0);
    s.set(zmq::sockopt::sndhwm, options.send_high_water_mark);
    s.set(zmq::sockopt::router_mandatory, 1);
    s.set(zmq::sockopt::rcvhwm, options.receive_high_water_mark);
    const size_t hard = options.hard_max_message_bytes != 0 ? options.hard_max_message_bytes
                                                            : 16 * options.limits.max_message_bytes;
    s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(hard));
    for (const auto& endpoint : options.endpoints) {
      std::string e = endpoint;
      // "tcp://host:0" means "any free port" (ZeroMQ spells it "*").
      if (e.rfind("tcp://", 0) == 0 && e.size() > 2 && e.compare(e.size() - 2, 2, ":0") == 0) {
        e = e.substr(0, e.size() - 1) + "*";
      }
      try {
        s.bind(e);
      } catch (const zmq::error_t& err) {
        return Status(err.num() == EADDRINUSE ? Code::kUnavailable : Code::kInvalidArgument,
                      "rpc server: bind '" + endpoint + "': " + err.what());
      }
      bound.push_back(s.get(zmq::sockopt::last_endpoint));
    }
  } catch (const zmq::error_t& err) {
    return Status(Code::kUnavailable, std::string("rpc server: zmq: ") + err.what());
  }
  std::unique_ptr<RpcServer> server(new RpcServer(std::move(impl)));
  server->bound_ = std::move(bound);
  for (const auto& e : server->bound_) KEEP_LOG_INFO(kLog, "listening on %s", e.c_str());
  return server;
}

void RpcServer::start() {
  KEEP_CHECK_MSG(!thread_.joinable(), "rpc server started twice");
  thread_ = std::thread([this] { loop(); });
}

void RpcServer::run() { loop(); }

void RpcServer::stop() {
  impl_->stopping.store(true, std::memory_order_release);
  const uint64_t one = 1;
  ssize_t n = ::write(impl_->wake_fd, &one, sizeof(one));
  (void)n;
}

void RpcServer::join() {
  if (thread_.joinable()) thread_.join();
}

void RpcServer::complete(std::unique_ptr<Call> call) {
  if (call == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(impl_->done_mu);
    impl_->done.push_back(std::move(call));
  }
  const uint64_t one = 1;
  ssize_t n = ::write(impl_->done_fd, &one, sizeof(one));
  (void)n;
}

ServerStats RpcServer::stats() const {
  ServerStats s;
  s.requests = impl_->requests.load(std::memory_order_relaxed);
  s.batches = impl_->batches.load(std::memory_order_relaxed);
  s.decode_errors = impl_->decode_errors.load(std::memory_order_relaxed);
  s.max_batch_seen = impl_->max_batch_seen.load(std::memory_order_relaxed);
  s.bytes_in = impl_->bytes_in.load(std::memory_order_relaxed);
  s.bytes_out = impl_->bytes_out.load(std::memory_order_relaxed);
  s.replies_dropped = impl_->replies_dropped.load(std::memory_order_relaxed);
  s.deferred = impl_->deferred.load(std::memory_order_relaxed);
  s.deferred_done = impl_->deferred_done.load(std::memory_order_relaxed);
  s.refused_unread = impl_->refused_unread.load(std::memory_order_relaxed);
  s.reply_queued_bytes = impl_->reply_queued_bytes.load(std::memory_order_relaxed);
  return s;
}

namespace {

// One received message awaiting its reply: either a call for the handler or an error already.
struct Pending {
  std::string peer;     // the ROUTER identity
  int call = -1;        // index into the batch's calls, or -1
  std::string payload;  // the encoded error reply when call < 0
};

Status not_reading() {
  return Status(Code::kResourceExhausted,
                "answers to this connection are not being read (its queue of answers is full): "
                "request not handled; read the answers, then retry");
}

}  // namespace

ReplyOutbox::Sent RpcServer::Impl::try_send(const std::string& peer, const std::string& payload) {
  try {
    // With ZMQ_ROUTER_MANDATORY the identity frame fails (EAGAIN) when the peer's pipe is full,
    // and throws EHOSTUNREACH when the peer is gone; once it is taken, the other frames are too.
    if (!router->send(zmq::message_t(peer.data(), peer.size()),
                      zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
      return ReplyOutbox::Sent::kFull;
    }
    router->send(zmq::message_t(), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    router->send(zmq::message_t(payload.data(), payload.size()), zmq::send_flags::dontwait);
    bytes_out.fetch_add(payload.size(), std::memory_order_relaxed);
    return ReplyOutbox::Sent::kOk;
  } catch (const zmq::error_t& e) {
    if (e.num() != EHOSTUNREACH) KEEP_LOG_DEBUG(kLog, "reply dropped: %s", e.what());
    return ReplyOutbox::Sent::kGone;
  }
}

void RpcServer::Impl::send_reply(const std::string& peer, std::string payload) {
  if (!outbox->holds(peer)) {  // else behind the replies already waiting, in order
    const ReplyOutbox::Sent sent = try_send(peer, payload);
    if (sent == ReplyOutbox::Sent::kOk) return;
    if (sent == ReplyOutbox::Sent::kGone) {
      replies_dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  if (!outbox->push(peer, std::move(payload), std::chrono::steady_clock::now())) {
    replies_dropped.fetch_add(1, std::memory_order_relaxed);
  }
  reply_queued_bytes.store(outbox->bytes(), std::memory_order_relaxed);
}

bool RpcServer::Impl::flush_outbox() {
  if (outbox->empty()) return false;
  const size_t before = outbox->replies();
  const size_t dropped =
      outbox->flush([this](const std::string& peer,
                           const std::string& payload) { return try_send(peer, payload); },
                    std::chrono::steady_clock::now());
  replies_dropped.fetch_add(dropped, std::memory_order_relaxed);
  reply_queued_bytes.store(outbox->bytes(), std::memory_order_relaxed);
  return outbox->replies() + dropped < before;
}

void RpcServer::Impl::send_done() {
  std::vector<std::unique_ptr<Call>> calls;
  {
    std::lock_guard<std::mutex> lock(done_mu);
    calls.swap(done);
  }
  for (auto& c : calls) {
    try {
      handler->on_deferred_done(*c);
    } catch (const std::exception& e) {
      KEEP_LOG_ERROR(kLog, "on_deferred_done threw: %s", e.what());
    } catch (const kj::Exception& e) {
      KEEP_LOG_ERROR(kLog, "on_deferred_done threw: %s", e.getDescription().cStr());
    }
    std::string payload = answer_of(*c);
    // Counted before the reply leaves: a client that has its answer finds it in the stats.
    deferred_done.fetch_add(1, std::memory_order_relaxed);
    send_reply(CallAccess::peer(*c), std::move(payload));
  }
}

void RpcServer::loop() {
  Impl& im = *impl_;
  zmq::socket_t& router = *im.router;
  const auto idle = std::chrono::milliseconds(std::max(1, im.options.idle_interval_ms));
  auto last_idle = std::chrono::steady_clock::now();
  std::vector<Pending> pending;
  std::vector<Call> calls;
  pending.reserve(im.options.max_batch);
  calls.reserve(im.options.max_batch);
  std::unordered_map<std::string, size_t> per_peer;  // large-answer calls of each peer in batch
  std::vector<zmq::message_t> carry;  // the message that ended the last batch: the next one's
  auto last_moved = std::chrono::steady_clock::now();  // a queued reply last left the outbox

  // Receives the next message without waiting (false: none); excess frames are dropped.
  auto receive = [&](std::vector<zmq::message_t>* frames) {
    frames->clear();
    if (!carry.empty()) {
      frames->swap(carry);
      return true;
    }
    bool got = false;
    try {
      for (;;) {
        zmq::message_t frame;
        if (!router.recv(frame, zmq::recv_flags::dontwait)) break;
        got = true;
        const bool more = frame.more();
        if (frames->size() < 4) frames->push_back(std::move(frame));
        if (!more) break;
      }
    } catch (const zmq::error_t& e) {
      KEEP_LOG_WARN(kLog, "recv failed: %s", e.what());
    }
    if (got) im.requests.fetch_add(1, std::memory_order_relaxed);
    return got;
  };

  while (!im.stopping.load(std::memory_order_acquire)) {
    auto timeout = idle;
    if (!carry.empty()) {
      timeout = std::chrono::milliseconds(0);
    } else if (!im.outbox->empty()) {
      const auto since = std::chrono::steady_clock::now() - last_moved;
      if (since < kFlushSpin) {
        timeout = std::chrono::milliseconds(0);
        std::this_thread::yield();  // let ZeroMQ's I/O thread drain the pipes
      } else {
        timeout = since < std::chrono::seconds(1) ? kFlushRetry : kFlushRetryStuck;
      }
    }
    zmq::pollitem_t items[3] = {{static_cast<void*>(router), 0, ZMQ_POLLIN, 0},
                                {nullptr, im.wake_fd, ZMQ_POLLIN, 0},
                                {nullptr, im.done_fd, ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, 3, timeout);
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      KEEP_LOG_ERROR(kLog, "poll failed: %s", e.what());
      break;
    }
    if (items[1].revents & ZMQ_POLLIN) break;
    if (im.flush_outbox()) last_moved = std::chrono::steady_clock::now();
    if (items[2].revents & ZMQ_POLLIN) {
      uint64_t count = 0;
      ssize_t n = ::read(im.done_fd, &count, sizeof(count));  // resets the eventfd
      (void)n;
      im.send_done();
    }

    const bool readable = (items[0].revents & ZMQ_POLLIN) || !carry.empty();
    if (readable) {
      pending.clear();
      calls.clear();
      per_peer.clear();
      // ---- drain up to max_batch messages (max_batch_per_peer of one peer) and decode them ----
      std::vector<zmq::message_t> frames;
      while (pending.size() < im.options.max_batch && receive(&frames)) {
        if (frames.empty()) continue;
        Pending p;
        p.peer.assign(static_cast<const char*>(frames[0].data()), frames[0].size());
        if (frames.size() != 3 || frames[1].size() != 0) {
          im.decode_errors.fetch_add(1, std::memory_order_relaxed);
          p.payload = encode_error_response(
              0, Status(Code::kMalformed,
                        "bad framing: expected [empty][payload] after the identity, got " +
                            std::to_string(frames.size() - 1) + " frame(s)"));
          pending.push_back(std::move(p));
          continue;
        }
        const bool unread = im.outbox->overflowed(p.peer);
        const auto* data = static_cast<const std::byte*>(frames[2].data());
        uint64_t request_id = 0;
        auto decoded = decode_request({data, frames[2].size()}, im.options.limits, &request_id);
        if (!unread && decoded.is_ok() && answer_may_be_large(decoded->request.which()) &&
            ++per_peer[p.peer] > im.options.max_batch_per_peer) {
          carry.swap(frames);  // decoded again as the first of the next batch
          break;
        }
        im.bytes_in.fetch_add(frames[2].size(), std::memory_order_relaxed);
        if (!decoded.is_ok() || unread) {
          Status refused = decoded.is_ok() ? not_reading() : decoded.status();
          if (unread) {
            im.refused_unread.fetch_add(1, std::memory_order_relaxed);
          } else {
            im.decode_errors.fetch_add(1, std::memory_order_relaxed);
          }
          KEEP_LOG_DEBUG(kLog, "request %llu refused: %s",
                         static_cast<unsigned long long>(request_id), refused.to_string().c_str());
          p.payload = encode_error_response(request_id, refused);
          pending.push_back(std::move(p));
          continue;
        }
        p.call = static_cast<int>(calls.size());
        calls.push_back(CallAccess::make(std::move(decoded).value(), request_id, p.peer));
        pending.push_back(std::move(p));
      }

      // ---- the handler sees the whole batch ----
      if (!calls.empty()) {
        im.batches.fetch_add(1, std::memory_order_relaxed);
        uint64_t seen = im.max_batch_seen.load(std::memory_order_relaxed);
        while (calls.size() > seen &&
               !im.max_batch_seen.compare_exchange_weak(seen, calls.size())) {
        }
        try {
          im.handler->handle_batch(std::span<Call>(calls));
        } catch (const kj::Exception& e) {
          KEEP_LOG_ERROR(kLog, "handler threw: %s", e.getDescription().cStr());
          for (auto& c : calls) {
            if (!c.answered()) c.fail(Status(Code::kInternal, "handler failed"));
          }
        } catch (const std::exception& e) {
          KEEP_LOG_ERROR(kLog, "handler threw: %s", e.what());
          for (auto& c : calls) {
            if (!c.answered()) c.fail(Status(Code::kInternal, "handler failed"));
          }
        }
      }

      // ---- send every reply, in arrival order (deferred calls are answered later) ----
      for (auto& p : pending) {
        std::string payload;
        if (p.call >= 0) {
          Call& c = calls[static_cast<size_t>(p.call)];
          if (c.deferred()) {
            im.deferred.fetch_add(1, std::memory_order_relaxed);
            continue;
          }
          payload = answer_of(c);
          c = Call();  // its response builder goes now, not with the whole batch
        } else {
          payload = std::move(p.payload);
        }
        im.send_reply(p.peer, std::move(payload));
      }
      pending.clear();
      calls.clear();  // releases the request buffers and response builders
    }

    const auto now = std::chrono::steady_clock::now();
    if (now - last_idle >= idle || readable) {
      last_idle = now;
      try {
        im.handler->on_idle();
      } catch (const std::exception& e) {
        KEEP_LOG_ERROR(kLog, "on_idle threw: %s", e.what());
      } catch (const kj::Exception& e) {
        KEEP_LOG_ERROR(kLog, "on_idle threw: %s", e.getDescription().cStr());
      }
    }
  }
  KEEP_LOG_INFO(kLog, "stopped after %llu requests",
                static_cast<unsigned long long>(im.requests.load()));
}

}  // namespace keep::wire
