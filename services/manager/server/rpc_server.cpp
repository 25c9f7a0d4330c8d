#include "services/manager/server/rpc_server.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <kj/exception.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <zmq.hpp>

#include "shared/common/log.h"

namespace keep::wire {

namespace {
constexpr const char* kLog = "rpc";
// How long the socket may hold the last answers after stop() before it closes.
constexpr int kStopLingerMs = 500;
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

  std::atomic<uint64_t> requests{0}, batches{0}, decode_errors{0}, max_batch_seen{0}, bytes_in{0},
      bytes_out{0}, replies_dropped{0}, deferred{0}, deferred_done{0};

  // Sends [identity][empty][payload] without blocking; a reply the peer's queue cannot take, or
  // to a peer that is gone, is dropped and counted. On the thread that owns the socket: the I/O
  // loop's, or the destructor's once the loop is over.
  void send_reply(zmq::message_t identity, const std::string& payload);
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
  auto impl = std::make_unique<Impl>();
  impl->options = options;
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
  return s;
}

namespace {

// One received message awaiting its reply: either a call for the handler or an error already.
struct Pending {
  zmq::message_t identity;
  int call = -1;        // index into the batch's calls, or -1
  std::string payload;  // the encoded error reply when call < 0
};

}  // namespace

void RpcServer::Impl::send_reply(zmq::message_t identity, const std::string& payload) {
  try {
    const size_t n = payload.size();
    if (!router->send(std::move(identity), zmq::send_flags::sndmore | zmq::send_flags::dontwait) ||
        !router->send(zmq::message_t(), zmq::send_flags::sndmore | zmq::send_flags::dontwait) ||
        !router->send(zmq::message_t(payload.data(), n), zmq::send_flags::dontwait)) {
      replies_dropped.fetch_add(1, std::memory_order_relaxed);
    } else {
      bytes_out.fetch_add(n, std::memory_order_relaxed);
    }
  } catch (const zmq::error_t& e) {
    replies_dropped.fetch_add(1, std::memory_order_relaxed);
    KEEP_LOG_DEBUG(kLog, "reply dropped: %s", e.what());
  }
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
    const std::string payload = answer_of(*c);
    const std::string& peer = CallAccess::peer(*c);
    // Counted before the reply leaves: a client that has its answer finds it in the stats.
    deferred_done.fetch_add(1, std::memory_order_relaxed);
    send_reply(zmq::message_t(peer.data(), peer.size()), payload);
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

  while (!im.stopping.load(std::memory_order_acquire)) {
    zmq::pollitem_t items[3] = {{static_cast<void*>(router), 0, ZMQ_POLLIN, 0},
                                {nullptr, im.wake_fd, ZMQ_POLLIN, 0},
                                {nullptr, im.done_fd, ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, 3, idle);
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      KEEP_LOG_ERROR(kLog, "poll failed: %s", e.what());
      break;
    }
    if (items[1].revents & ZMQ_POLLIN) break;
    if (items[2].revents & ZMQ_POLLIN) {
      uint64_t count = 0;
      ssize_t n = ::read(im.done_fd, &count, sizeof(count));  // resets the eventfd
      (void)n;
      im.send_done();
    }

    if (items[0].revents & ZMQ_POLLIN) {
      pending.clear();
      calls.clear();
      // ---- drain up to max_batch messages and decode them ----
      while (pending.size() < im.options.max_batch) {
        std::vector<zmq::message_t> frames;
        bool got = false;
        try {
          for (;;) {
            zmq::message_t frame;
            if (!router.recv(frame, zmq::recv_flags::dontwait)) break;
            got = true;
            const bool more = frame.more();
            if (frames.size() < 4) frames.push_back(std::move(frame));  // excess frames dropped
            if (!more) break;
          }
        } catch (const zmq::error_t& e) {
          KEEP_LOG_WARN(kLog, "recv failed: %s", e.what());
        }
        if (!got) break;
        im.requests.fetch_add(1, std::memory_order_relaxed);
        if (frames.empty()) continue;
        Pending p;
        p.identity = std::move(frames[0]);
        if (frames.size() != 3 || frames[1].size() != 0) {
          im.decode_errors.fetch_add(1, std::memory_order_relaxed);
          p.payload = encode_error_response(
              0, Status(Code::kMalformed,
                        "bad framing: expected [empty][payload] after the identity, got " +
                            std::to_string(frames.size() - 1) + " frame(s)"));
          pending.push_back(std::move(p));
          continue;
        }
        const auto* data = static_cast<const std::byte*>(frames[2].data());
        im.bytes_in.fetch_add(frames[2].size(), std::memory_order_relaxed);
        uint64_t request_id = 0;
        auto decoded = decode_request({data, frames[2].size()}, im.options.limits, &request_id);
        if (!decoded.is_ok()) {
          im.decode_errors.fetch_add(1, std::memory_order_relaxed);
          KEEP_LOG_DEBUG(kLog, "request %llu refused: %s",
                         static_cast<unsigned long long>(request_id),
                         decoded.status().to_string().c_str());
          p.payload = encode_error_response(request_id, decoded.status());
          pending.push_back(std::move(p));
          continue;
        }
        p.call = static_cast<int>(calls.size());
        calls.push_back(CallAccess::make(
            std::move(decoded).value(), request_id,
            std::string(static_cast<const char*>(p.identity.data()), p.identity.size())));
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
        } else {
          payload = std::move(p.payload);
        }
        im.send_reply(std::move(p.identity), payload);
      }
      pending.clear();
      calls.clear();  // releases the request buffers and response builders
    }

    const auto now = std::chrono::steady_clock::now();
    if (now - last_idle >= idle || (items[0].revents & ZMQ_POLLIN)) {
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
