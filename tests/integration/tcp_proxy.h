// TcpProxy: a loopback TCP proxy for fault tests (cluster mode: a process cut off from etcd, or
// its commits held on the way to PostgreSQL), in a thread of its own.
//
//   cut()       closes every connection and refuses new ones (accepted and closed at once): the
//               process behind it fails fast rather than waiting on timeouts; restore() undoes it.
//   hold()      forwards nothing any more, in either direction, but closes nothing: what the
//               process sends waits (held_bytes() counts it) until release() forwards it.
#pragma once

#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace keep::itest {

// A proxy on a free loopback port to 127.0.0.1:target_port.
class TcpProxy {
 public:
  explicit TcpProxy(int target_port) : target_(target_port) {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(listen_ >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(listen_, 64) == 0);
    socklen_t len = sizeof a;
    ::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { run(); });
  }
  ~TcpProxy() {
    stop_.store(true);
    thread_.join();
    for (auto [x, y] : pairs_) {
      ::close(x);
      ::close(y);
    }
    ::close(listen_);
  }
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  int port() const { return port_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  void cut() { cut_.store(true); }
  void restore() { cut_.store(false); }
  // Returns once the proxy thread holds: whatever is sent from then on waits.
  void hold() {
    hold_.store(true);
    const uint64_t round = rounds_.load();
    while (rounds_.load() < round + 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void release() {
    hold_.store(false);
    held_.store(0);
  }
  // Bytes the clients sent that wait in the proxy while it holds (refreshed every 20 ms).
  size_t held_bytes() const { return held_.load(); }

 private:
  int connect_target() const {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(target_));
    if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
    if (fd >= 0) ::close(fd);
    return -1;
  }
  // Copies what `from` has to `to`; false at the end of the stream or on an error.
  static bool pump(int from, int to) {
    char buf[65536];
    const ssize_t n = ::read(from, buf, sizeof buf);
    if (n <= 0) return false;
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = ::send(to, buf + done, static_cast<size_t>(n - done), MSG_NOSIGNAL);
      if (w <= 0) return false;
      done += w;
    }
    return true;
  }
  void run() {
    while (!stop_.load()) {
      rounds_.fetch_add(1);  // a round that starts after hold() forwards nothing
      if (cut_.load() && !pairs_.empty()) {
        for (auto [x, y] : pairs_) {
          ::close(x);
          ::close(y);
        }
        pairs_.clear();
      }
      // Held: the connections are not polled, so their bytes stay in the sockets' buffers.
      const bool held = hold_.load();
      std::vector<pollfd> fds{{listen_, POLLIN, 0}};
      if (held) {
        size_t waiting = 0;
        for (auto [x, y] : pairs_) {
          int n = 0;
          if (::ioctl(x, FIONREAD, &n) == 0 && n > 0) waiting += static_cast<size_t>(n);
        }
        held_.store(waiting);
      } else {
        for (auto [x, y] : pairs_) {
          fds.push_back({x, POLLIN, 0});
          fds.push_back({y, POLLIN, 0});
        }
      }
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      std::vector<std::pair<int, int>> keep;
      if (fds[0].revents & POLLIN) {
        const int c = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c >= 0) {
          const int t = cut_.load() ? -1 : connect_target();
          if (t < 0) {
            ::close(c);
          } else {
            keep.emplace_back(c, t);
          }
        }
      }
      for (size_t i = 0; i < pairs_.size(); ++i) {
        const auto [x, y] = pairs_[i];
        if (held) {
          keep.emplace_back(x, y);
          continue;
        }
        const pollfd& px = fds[1 + 2 * i];
        const pollfd& py = fds[2 + 2 * i];
        bool ok = true;
        if (px.revents & (POLLIN | POLLHUP | POLLERR)) ok = pump(x, y);
        if (ok && (py.revents & (POLLIN | POLLHUP | POLLERR))) ok = pump(y, x);
        if (ok) {
          keep.emplace_back(x, y);
        } else {
          ::close(x);
          ::close(y);
        }
      }
      pairs_ = std::move(keep);
    }
  }

  int target_;
  int listen_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> cut_{false};
  std::atomic<bool> hold_{false};
  std::atomic<size_t> held_{0};
  std::atomic<uint64_t> rounds_{0};
  std::vector<std::pair<int, int>> pairs_;  // (client, target), the proxy thread's
  std::thread thread_;
};

}  // namespace keep::itest
