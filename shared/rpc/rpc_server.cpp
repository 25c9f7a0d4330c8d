#include "shared/rpc/rpc_server.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <zmq.hpp>

#include "shared/common/log.h"
#include "shared/rpc/reply_outbox.h"

namespace keep::wire {

namespace {
constexpr const char* kLog = "rpc";
// How long the socket may hold the last answers after stop() before it closes.
constexpr int kStopLingerMs = 500;
}  // namespace

Status detail::not_reading_status() {
  return Status(Code::kResourceExhausted,
                "answers to this connection are not being read (its queue of answers is full): "
                "request not handled; read the answers, then retry");
}

struct RouterSocket::Impl {
  zmq::context_t context{1};
  std::unique_ptr<zmq::socket_t> router;
  int wake_fd = -1;
  int done_fd = -1;
  // Replies ZeroMQ's pipe could not take yet (the I/O thread's, like the socket).
  std::unique_ptr<ReplyOutbox> outbox;
  Counters* counters = nullptr;

  // Hands [identity][empty][payload] to ZeroMQ without blocking.
  ReplyOutbox::Sent try_send(const std::string& peer, const std::string& payload);

  ~Impl() {
    router.reset();
    if (wake_fd >= 0) ::close(wake_fd);
    if (done_fd >= 0) ::close(done_fd);
  }
};

RouterSocket::RouterSocket(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  impl_->counters = &counters_;
}

RouterSocket::~RouterSocket() = default;

Result<std::unique_ptr<RouterSocket>> RouterSocket::bind(const ServerOptions& options) {
  if (options.endpoints.empty()) return Status(Code::kInvalidArgument, "rpc server: no endpoint");
  if (options.limits.max_message_bytes == 0) {
    return Status(Code::kInvalidArgument, "rpc server: max_message_bytes must be > 0");
  }
  auto impl = std::make_unique<Impl>();
  impl->outbox = std::make_unique<ReplyOutbox>(options.max_queued_reply_bytes_per_peer,
                                               options.reply_stall_timeout);
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
  std::unique_ptr<RouterSocket> socket(new RouterSocket(std::move(impl)));
  socket->bound_ = std::move(bound);
  for (const auto& e : socket->bound_) KEEP_LOG_INFO(kLog, "listening on %s", e.c_str());
  return socket;
}

void RouterSocket::notify_stop() {
  stopping_.store(true, std::memory_order_release);
  const uint64_t one = 1;
  ssize_t n = ::write(impl_->wake_fd, &one, sizeof(one));
  (void)n;
}

void RouterSocket::notify_done() {
  const uint64_t one = 1;
  ssize_t n = ::write(impl_->done_fd, &one, sizeof(one));
  (void)n;
}

RouterSocket::Events RouterSocket::wait(std::chrono::milliseconds timeout) {
  Events ev;
  zmq::pollitem_t items[3] = {{static_cast<void*>(*impl_->router), 0, ZMQ_POLLIN, 0},
                              {nullptr, impl_->wake_fd, ZMQ_POLLIN, 0},
                              {nullptr, impl_->done_fd, ZMQ_POLLIN, 0}};
  try {
    zmq::poll(items, 3, timeout);
  } catch (const zmq::error_t& e) {
    if (e.num() == EINTR) return ev;
    KEEP_LOG_ERROR(kLog, "poll failed: %s", e.what());
    ev.stop = true;
    return ev;
  }
  ev.readable = (items[0].revents & ZMQ_POLLIN) != 0;
  ev.stop = (items[1].revents & ZMQ_POLLIN) != 0 || stopping();
  if (items[2].revents & ZMQ_POLLIN) {
    uint64_t count = 0;
    ssize_t n = ::read(impl_->done_fd, &count, sizeof(count));  // resets the eventfd
    (void)n;
    ev.done = true;
  }
  return ev;
}

bool RouterSocket::receive(Frame* out) {
  // [identity][empty][payload]; at most 4 frames are kept, the rest of a message is dropped.
  std::vector<zmq::message_t> frames;
  bool got = false;
  try {
    for (;;) {
      zmq::message_t frame;
      if (!impl_->router->recv(frame, zmq::recv_flags::dontwait)) break;
      got = true;
      const bool more = frame.more();
      if (frames.size() < 4) frames.push_back(std::move(frame));
      if (!more) break;
    }
  } catch (const zmq::error_t& e) {
    KEEP_LOG_WARN(kLog, "recv failed: %s", e.what());
  }
  if (!got || frames.empty()) return false;
  counters_.requests.fetch_add(1, std::memory_order_relaxed);
  out->peer.assign(static_cast<const char*>(frames[0].data()), frames[0].size());
  out->parts = frames.size() - 1;
  out->framing_ok = frames.size() == 3 && frames[1].size() == 0;
  if (out->framing_ok) {
    out->payload.assign(static_cast<const char*>(frames[2].data()), frames[2].size());
  } else {
    out->payload.clear();
  }
  return true;
}

bool RouterSocket::outbox_empty() const { return impl_->outbox->empty(); }

bool RouterSocket::not_reading(const std::string& peer) const {
  return impl_->outbox->overflowed(peer);
}

void RouterSocket::linger_on_close() {
  try {
    impl_->router->set(zmq::sockopt::linger, kStopLingerMs);
  } catch (const zmq::error_t& e) {
    KEEP_LOG_WARN(kLog, "linger: %s", e.what());
  }
}

ServerStats RouterSocket::stats() const {
  ServerStats s;
  const Counters& c = counters_;
  s.requests = c.requests.load(std::memory_order_relaxed);
  s.batches = c.batches.load(std::memory_order_relaxed);
  s.decode_errors = c.decode_errors.load(std::memory_order_relaxed);
  s.max_batch_seen = c.max_batch_seen.load(std::memory_order_relaxed);
  s.bytes_in = c.bytes_in.load(std::memory_order_relaxed);
  s.bytes_out = c.bytes_out.load(std::memory_order_relaxed);
  s.replies_dropped = c.replies_dropped.load(std::memory_order_relaxed);
  s.deferred = c.deferred.load(std::memory_order_relaxed);
  s.deferred_done = c.deferred_done.load(std::memory_order_relaxed);
  s.refused_unread = c.refused_unread.load(std::memory_order_relaxed);
  s.reply_queued_bytes = c.reply_queued_bytes.load(std::memory_order_relaxed);
  return s;
}

ReplyOutbox::Sent RouterSocket::Impl::try_send(const std::string& peer,
                                               const std::string& payload) {
  try {
    // With ZMQ_ROUTER_MANDATORY the identity frame fails (EAGAIN) when the peer's pipe is full,
    // and throws EHOSTUNREACH when the peer is gone; once it is taken, the other frames are too.
    if (!router->send(zmq::message_t(peer.data(), peer.size()),
                      zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
      return ReplyOutbox::Sent::kFull;
    }
    router->send(zmq::message_t(), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    router->send(zmq::message_t(payload.data(), payload.size()), zmq::send_flags::dontwait);
    counters->bytes_out.fetch_add(payload.size(), std::memory_order_relaxed);
    return ReplyOutbox::Sent::kOk;
  } catch (const zmq::error_t& e) {
    if (e.num() != EHOSTUNREACH) KEEP_LOG_DEBUG(kLog, "reply dropped: %s", e.what());
    return ReplyOutbox::Sent::kGone;
  }
}

void RouterSocket::send_reply(const std::string& peer, std::string payload) {
  Impl& im = *impl_;
  Counters& n = counters_;
  if (!im.outbox->holds(peer)) {  // else behind the replies already waiting, in order
    const ReplyOutbox::Sent sent = im.try_send(peer, payload);
    if (sent == ReplyOutbox::Sent::kOk) return;
    if (sent == ReplyOutbox::Sent::kGone) {
      n.replies_dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  if (!im.outbox->push(peer, std::move(payload), std::chrono::steady_clock::now())) {
    n.replies_dropped.fetch_add(1, std::memory_order_relaxed);
  }
  n.reply_queued_bytes.store(im.outbox->bytes(), std::memory_order_relaxed);
}

bool RouterSocket::flush_outbox() {
  Impl& im = *impl_;
  Counters& n = counters_;
  if (im.outbox->empty()) return false;
  const size_t before = im.outbox->replies();
  const size_t dropped =
      im.outbox->flush([&im](const std::string& peer,
                             const std::string& payload) { return im.try_send(peer, payload); },
                       std::chrono::steady_clock::now());
  n.replies_dropped.fetch_add(dropped, std::memory_order_relaxed);
  n.reply_queued_bytes.store(im.outbox->bytes(), std::memory_order_relaxed);
  return im.outbox->replies() + dropped < before;
}

}  // namespace keep::wire
