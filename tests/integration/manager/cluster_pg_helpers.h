// Helpers of the tests of keep-manager in cluster mode with its log in PostgreSQL
// (test_manager_pg_failover, _pg_fence, _pg_standby, test_manager_client_failover): the cluster
// flags, metrics by label, a client per endpoint, polling, the shards' split between two nodes,
// and a loopback TCP proxy that can cut a process off from etcd.
#pragma once

#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shared/client/manager_client.h"
#include "tests/integration/etcd_cluster.h"
#include "tests/integration/manager/manager_process.h"
#include "tests/integration/pg_server.h"

namespace keep::itest {

// keep-manager's flags for node `node` of a cluster of `shards` shards on `etcd_urls` (comma-
// separated), its log in the database of `conninfo`, with a 2 s lease.
inline std::vector<std::string> pg_cluster_flags(const std::string& etcd_urls,
                                                 const std::string& node, uint32_t shards,
                                                 const std::string& conninfo) {
  return {"--etcd",         etcd_urls, "--node-id", node,    "--shards", std::to_string(shards),
          "--etcd-lease-s", "2",       "--pg",      conninfo};
}
inline std::vector<std::string> pg_cluster_flags(const std::string& etcd_urls,
                                                 const std::string& node, uint32_t shards,
                                                 const PgServer& pg) {
  return pg_cluster_flags(etcd_urls, node, shards, pg.conninfo());
}

inline std::string join_urls(const std::vector<std::string>& urls) {
  std::string out;
  for (const auto& u : urls) out += (out.empty() ? "" : ",") + u;
  return out;
}

// The value of series `series` (a name, with its labels if any: `x{reason="stale"}`) in the
// process's /metrics; -1 when absent or unreachable.
inline double metric(const DaemonProcess& m, const std::string& series) {
  auto text = http_get(m.metrics(), "/metrics");
  if (!text) return -1;
  std::stringstream ss(*text);
  for (std::string l; std::getline(ss, l);) {
    if (l.rfind(series + " ", 0) == 0) return std::stod(l.substr(series.size() + 1));
  }
  return -1;
}

inline std::unique_ptr<client::ManagerClient> manager_client(const std::string& endpoint,
                                                             std::chrono::milliseconds timeout,
                                                             bool follow = false) {
  client::ClientOptions o;
  o.endpoint = endpoint;
  o.timeout = timeout;
  o.follow_moved = follow;
  auto c = client::ManagerClient::connect(o);
  REQUIRE(c.is_ok());
  return std::move(c).value();
}

// Polls `pred` every 50 ms for up to `limit`.
template <typename F>
bool eventually(F pred, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(50ms);
  }
  return pred();
}

// Whether a write's answer says it was not applied: moved, "no owner yet", "being taken over"
// (also a fenced node's refusal): routed away or refused before anything was applied.
inline bool not_applied(const Status& st) {
  return st.code() == Code::kMoved ||
         (st.code() == Code::kUnavailable &&
          (st.message().find("no owner yet") != std::string::npos ||
           st.message().find("being taken over") != std::string::npos));
}

// Requires that nodes a and b each serve half of the `shards` shards within 20 s (their stderr
// otherwise).
inline void require_split(const DaemonProcess& a, const DaemonProcess& b, uint32_t shards) {
  REQUIRE_MESSAGE(eventually(
                      [&] {
                        return metric(a, "keep_manager_cluster_shards_ready") == shards / 2 &&
                               metric(b, "keep_manager_cluster_shards_ready") == shards / 2;
                      },
                      20s),
                  a.err() << b.err());
}

// Every memory text of `agent`, all pages (what list_memories answers).
inline Result<std::vector<std::string>> all_texts(client::ManagerClient& c,
                                                  const std::string& agent) {
  std::vector<std::string> out;
  uint64_t after = 0;
  for (;;) {
    KEEP_ASSIGN_OR_RETURN(client::MemoryPage page, c.list_memories(agent, after, 1000));
    for (const auto& m : page.memories) {
      out.push_back(m.text);
      after = m.id;
    }
    if (!page.more) return out;
  }
}

// A TCP proxy on a free loopback port to 127.0.0.1:target_port, in a thread of its own. cut()
// closes every connection and refuses new ones (they are accepted and closed at once): the
// process behind it is cut off from the target, and fails fast rather than waiting on timeouts.
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
      if (cut_.load() && !pairs_.empty()) {
        for (auto [x, y] : pairs_) {
          ::close(x);
          ::close(y);
        }
        pairs_.clear();
      }
      std::vector<pollfd> fds{{listen_, POLLIN, 0}};
      for (auto [x, y] : pairs_) {
        fds.push_back({x, POLLIN, 0});
        fds.push_back({y, POLLIN, 0});
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
  std::vector<std::pair<int, int>> pairs_;  // (client, target), the proxy thread's
  std::thread thread_;
};

}  // namespace keep::itest
