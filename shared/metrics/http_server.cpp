#include "shared/metrics/http_server.h"

#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "shared/common/log.h"

namespace keep::metrics {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";
constexpr auto kRefusalLogInterval = std::chrono::seconds(10);
// Least time between two sweeps for overdue requests: bounds the sweeps' CPU when many
// connections arrive, at the cost of closing an overdue one up to this late.
constexpr auto kSweepGranularity = std::chrono::milliseconds(100);

std::string host_port(const std::string& host, uint16_t port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

// A listening socket on host:port (the first address of host that binds), or kUnavailable naming
// host:port. SO_REUSEADDR lets a restart bind while old connections sit in TIME_WAIT; SO_REUSEPORT
// is left off, so a second process binding the same port fails instead of sharing it silently.
Result<int> listen_on(const std::string& host, uint16_t port) {
  const std::string where = "metrics HTTP server: cannot bind " + host_port(host, port) + ": ";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (gai != 0) return Status(Code::kUnavailable, where + ::gai_strerror(gai));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addrs(found, &::freeaddrinfo);
  std::string error = "no address";
  for (const addrinfo* ai = addrs.get(); ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) return fd;
    error = std::strerror(errno);
    ::close(fd);
  }
  return Status(Code::kUnavailable, where + error);
}

uint16_t bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

MHD_Result reply(MHD_Connection* connection, unsigned int status, std::string body,
                 const char* content_type) {
  auto* owned = new std::string(std::move(body));
  MHD_Response* response = MHD_create_response_from_buffer_with_free_callback_cls(
      owned->size(), owned->data(), [](void* cls) { delete static_cast<std::string*>(cls); },
      owned);
  if (response == nullptr) {
    delete owned;
    return MHD_NO;  // MHD closes the connection
  }
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  if (status == MHD_HTTP_METHOD_NOT_ALLOWED) {
    MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  }
  const MHD_Result queued = MHD_queue_response(connection, status, response);
  MHD_destroy_response(response);
  return queued;
}

}  // namespace

// Every MHD callback below runs on MHD's one internal thread; the reaper thread only reads `conns`
// and shuts sockets down, under `mu`.
struct MetricsHttpServer::Impl {
  struct Conn {
    int fd = -1;
    Clock::time_point since;  // when its current request began: accepted, or previous response sent
    bool shut = false;        // the reaper has shut it down; MHD closes it next
  };

  const Registry* registry = nullptr;
  std::string host;
  uint16_t port = 0;
  Clock::duration request_timeout{};
  size_t max_connections = 0;
  MHD_Daemon* daemon = nullptr;
  std::atomic<uint64_t> scrapes{0};

  std::mutex mu;
  std::condition_variable wake;
  bool stopping = false;
  std::unordered_map<MHD_Connection*, Conn> conns;
  uint64_t refused = 0;  // since the last warning
  Clock::time_point last_refusal_log{};
  std::thread reaper;
  std::mutex stop_mu;

  // MHD's timeout only counts inactivity, which a client trickling a byte now and then resets. The
  // request timeout is enforced here: sleep until the earliest request deadline (requests that
  // begin later end later, so nothing needs to wake this thread early), then shutdown() the socket
  // of each request past it; MHD sees the socket end and closes the connection. MHD reports a
  // connection closed (erasing it here, under mu) before closing its fd, so fds shut down here
  // are always still MHD's.
  void reap_loop() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stopping) {
      const auto now = Clock::now();
      auto next = now + request_timeout;
      for (auto& [connection, conn] : conns) {
        if (conn.shut) continue;
        const auto deadline = conn.since + request_timeout;
        if (deadline <= now) {
          ::shutdown(conn.fd, SHUT_RDWR);
          conn.shut = true;
        } else {
          next = std::min(next, deadline);
        }
      }
      next = std::max(next, now + kSweepGranularity);
      wake.wait_until(lock, next, [this] { return stopping; });
    }
  }

  // Refuses a connection beyond max_connections: MHD closes it at once instead of leaving it in
  // the listen queue (MHD's own limit stops accepting, which queues clients until one leaves).
  static MHD_Result on_accept(void* cls, const sockaddr*, socklen_t) {
    auto* self = static_cast<Impl*>(cls);
    std::lock_guard<std::mutex> lock(self->mu);
    if (self->conns.size() < self->max_connections) return MHD_YES;
    ++self->refused;
    const auto now = Clock::now();
    if (now - self->last_refusal_log >= kRefusalLogInterval) {
      KEEP_LOG_WARN("metrics", "%zu connections open (the limit): refused %llu new ones",
                    self->conns.size(), static_cast<unsigned long long>(self->refused));
      self->refused = 0;
      self->last_refusal_log = now;
    }
    return MHD_NO;
  }

  static void on_connection(void* cls, MHD_Connection* connection, void**,
                            MHD_ConnectionNotificationCode code) {
    auto* self = static_cast<Impl*>(cls);
    std::lock_guard<std::mutex> lock(self->mu);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
      const MHD_ConnectionInfo* info =
          MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
      Conn conn;
      conn.fd = info != nullptr ? info->connect_fd : -1;
      conn.since = Clock::now();
      conn.shut = info == nullptr;  // no fd to shut down: left to the idle timeout
      self->conns[connection] = conn;
    } else {
      self->conns.erase(connection);
    }
  }

  static void on_completed(void* cls, MHD_Connection* connection, void**,
                           MHD_RequestTerminationCode) {
    auto* self = static_cast<Impl*>(cls);
    std::lock_guard<std::mutex> lock(self->mu);
    auto it = self->conns.find(connection);
    if (it != self->conns.end()) it->second.since = Clock::now();
  }

  // MHD calls this once the headers are in, then again after any body. A 405 is answered on the
  // first call, leaving any body unread (MHD then closes the connection); GET and HEAD on the
  // second, as MHD keeps a connection alive only when the response comes after the whole request.
  static MHD_Result on_request(void* cls, MHD_Connection* connection, const char* url,
                               const char* method, const char*, const char*, size_t*,
                               void** request) {
    auto* self = static_cast<Impl*>(cls);
    const bool get = std::strcmp(method, MHD_HTTP_METHOD_GET) == 0;
    if (!get && std::strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
      return reply(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n",
                   "text/plain; charset=utf-8");
    }
    if (*request == nullptr) {
      *request = self;  // any non-null marker: the headers of this request have been seen
      return MHD_YES;
    }
    if (std::strcmp(url, "/metrics") == 0) {
      std::string body = self->registry->render();
      if (get) self->scrapes.fetch_add(1, std::memory_order_relaxed);
      return reply(connection, MHD_HTTP_OK, std::move(body), kContentType);
    }
    if (std::strcmp(url, "/healthz") == 0) {
      return reply(connection, MHD_HTTP_OK, "ok", "text/plain; charset=utf-8");
    }
    return reply(connection, MHD_HTTP_NOT_FOUND, "not found\n", "text/plain; charset=utf-8");
  }

  // Client misbehaviour (resets, oversized headers) is routine for a public port: debug level.
  static void on_log(void*, const char* fmt, va_list args) {
    char line[512];
    std::vsnprintf(line, sizeof(line), fmt, args);
    line[std::strcspn(line, "\n")] = '\0';
    KEEP_LOG_DEBUG("metrics", "libmicrohttpd: %s", line);
  }
};

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsHttpServer::~MetricsHttpServer() { stop(); }

Result<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::start(
    const Registry& registry, const MetricsHttpServerOptions& options) {
  if (options.idle_timeout_s < 1 || options.request_timeout_s < 1 || options.max_connections < 1 ||
      options.max_request_header_bytes < 4096) {
    return Status(Code::kInvalidArgument,
                  "metrics HTTP server: idle_timeout_s, request_timeout_s and max_connections must "
                  "be >= 1, max_request_header_bytes >= 4096");
  }
  auto impl = std::make_unique<Impl>();
  impl->registry = &registry;
  impl->host = options.host;
  impl->request_timeout = std::chrono::seconds(options.request_timeout_s);
  impl->max_connections = static_cast<size_t>(options.max_connections);
  KEEP_ASSIGN_OR_RETURN(const int listen_fd, listen_on(options.host, options.port));
  impl->port = bound_port(listen_fd);

  // From here MHD owns listen_fd: it closes it in MHD_stop_daemon, and on most of its start
  // failures, so it is not closed again here (a second close could hit another thread's fd).
  // MHD's own connection limit sits above ours so that on_accept, not MHD, refuses the excess.
  Impl* raw = impl.get();
  impl->daemon = MHD_start_daemon(
      MHD_USE_EPOLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG, 0, &Impl::on_accept, raw,
      &Impl::on_request, raw, MHD_OPTION_LISTEN_SOCKET, listen_fd, MHD_OPTION_CONNECTION_TIMEOUT,
      static_cast<unsigned int>(options.idle_timeout_s), MHD_OPTION_CONNECTION_LIMIT,
      static_cast<unsigned int>(options.max_connections) + 1, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
      static_cast<size_t>(options.max_request_header_bytes), MHD_OPTION_NOTIFY_CONNECTION,
      &Impl::on_connection, raw, MHD_OPTION_NOTIFY_COMPLETED, &Impl::on_completed, raw,
      MHD_OPTION_EXTERNAL_LOGGER, &Impl::on_log, raw, MHD_OPTION_END);
  if (impl->daemon == nullptr) {
    return Status(Code::kUnavailable, "metrics HTTP server: libmicrohttpd did not start on " +
                                          host_port(options.host, impl->port));
  }
  impl->reaper = std::thread([raw] { raw->reap_loop(); });
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(std::move(impl)));
  KEEP_LOG_INFO("metrics", "serving /metrics on http://%s/metrics", server->address().c_str());
  return server;
}

void MetricsHttpServer::stop() {
  std::lock_guard<std::mutex> stop_lock(impl_->stop_mu);
  if (impl_->daemon == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  impl_->reaper.join();
  // Closes the listening socket and every connection without waiting for clients.
  MHD_stop_daemon(impl_->daemon);
  impl_->daemon = nullptr;
}

const std::string& MetricsHttpServer::host() const { return impl_->host; }
uint16_t MetricsHttpServer::port() const { return impl_->port; }
uint64_t MetricsHttpServer::scrapes() const {
  return impl_->scrapes.load(std::memory_order_relaxed);
}

std::string MetricsHttpServer::address() const { return host_port(impl_->host, impl_->port); }

Result<MetricsHttpServerOptions> parse_metrics_listen(const std::string& listen) {
  MetricsHttpServerOptions mo;
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return Status(Code::kInvalidArgument,
                  "--metrics-listen: expected host:port, got '" + listen + "'");
  }
  mo.host = listen.substr(0, colon);
  const int port = std::atoi(listen.c_str() + colon + 1);
  if (port < 0 || port > 65535) {
    return Status(Code::kInvalidArgument, "--metrics-listen: bad port in '" + listen + "'");
  }
  mo.port = static_cast<uint16_t>(port);
  return mo;
}

}  // namespace keep::metrics
