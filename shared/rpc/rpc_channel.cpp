#include "shared/rpc/rpc_channel.h"

#include <vector>
#include <zmq.hpp>

namespace keep::wire {

struct RpcChannel::Impl {
  zmq::context_t context{1};
  std::unique_ptr<zmq::socket_t> socket;

  Status reconnect(const std::string& endpoint) {
    try {
      socket.reset();
      auto s = std::make_unique<zmq::socket_t>(context, zmq::socket_type::dealer);
      s->set(zmq::sockopt::linger, 0);
      s->connect(endpoint);
      socket = std::move(s);
    } catch (const zmq::error_t& e) {
      return Status(Code::kInvalidArgument, "connect to '" + endpoint + "': " + e.what());
    }
    return Status::ok();
  }
};

RpcChannel::RpcChannel(ChannelOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>()) {}

RpcChannel::~RpcChannel() = default;

Result<std::unique_ptr<RpcChannel>> RpcChannel::connect(ChannelOptions options) {
  std::unique_ptr<RpcChannel> channel(new RpcChannel(std::move(options)));
  KEEP_RETURN_IF_ERROR(channel->impl_->reconnect(channel->options_.endpoint));
  return channel;
}

Status RpcChannel::exchange(std::string_view payload,
                            const std::function<bool(std::string&&)>& accept) {
  if (payload.size() > options_.max_request_bytes) {
    return Status(Code::kTooLarge, "request of " + std::to_string(payload.size()) +
                                       " bytes exceeds the limit of " +
                                       std::to_string(options_.max_request_bytes));
  }
  Impl& impl = *impl_;
  if (!impl.socket) KEEP_RETURN_IF_ERROR(impl.reconnect(options_.endpoint));
  auto& socket = *impl.socket;
  try {
    socket.send(zmq::message_t(), zmq::send_flags::sndmore);
    socket.send(zmq::message_t(payload.data(), payload.size()), zmq::send_flags::none);
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() < 0) left = std::chrono::milliseconds(0);
      zmq::pollitem_t item{static_cast<void*>(socket), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, left);
      if (!(item.revents & ZMQ_POLLIN)) {
        // Abandon the socket: whatever answer comes later goes to a socket that no longer exists.
        (void)impl.reconnect(options_.endpoint);
        return Status(Code::kTimeout, "no answer from " + options_.endpoint + " within " +
                                          std::to_string(options_.timeout.count()) + " ms");
      }
      std::vector<zmq::message_t> frames;
      for (;;) {
        zmq::message_t frame;
        if (!socket.recv(frame, zmq::recv_flags::dontwait)) break;
        const bool more = frame.more();
        frames.push_back(std::move(frame));
        if (!more) break;
      }
      // Expected: [empty][payload]; anything else is dropped.
      if (frames.size() != 2 || frames[0].size() != 0) continue;
      if (accept(std::string(static_cast<const char*>(frames[1].data()), frames[1].size()))) {
        return Status::ok();
      }
    }
  } catch (const zmq::error_t& e) {
    (void)impl.reconnect(options_.endpoint);
    return Status(Code::kUnavailable, std::string("zmq: ") + e.what());
  }
}

Result<std::string> RpcChannel::call_raw(std::string_view payload) {
  std::string answer;
  KEEP_RETURN_IF_ERROR(exchange(payload, [&](std::string&& bytes) {
    answer = std::move(bytes);
    return true;
  }));
  return answer;
}

}  // namespace keep::wire
