// Tests of MetricsHttpServer on real sockets (127.0.0.1 only): the routes and their answers, bind
// failures, and that idle, trickling and excess connections neither block scrapes nor live long.
// Raw sockets rather than an HTTP client, so that a test can hold a half-sent request.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shared/metrics/http_server.h"
#include "shared/metrics/metrics.h"

using namespace keep::metrics;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The tests hold a few hundred sockets on each side; a CI default soft limit of 1024 is close.
void raise_fd_limit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < 4096 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = std::min<rlim_t>(4096, lim.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
}

// A connected client socket, closed on destruction.
class Socket {
 public:
  explicit Socket(uint16_t port) : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~Socket() { close(); }
  Socket(Socket&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)), connected_(other.connected_) {}
  Socket& operator=(Socket&&) = delete;

  bool connected() const { return connected_; }
  int fd() const { return fd_; }
  void close() {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }
  // False once the peer has gone (MSG_NOSIGNAL: no SIGPIPE).
  bool send(const std::string& bytes) const {
    return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == ssize_t(bytes.size());
  }

 private:
  int fd_;
  bool connected_ = false;
};

// What came back on a socket: the bytes, and whether the peer closed it (EOF or reset).
struct Received {
  std::string data;
  bool closed = false;
  double seconds = 0;  // until closed, complete or timed out
};

// Reads until the peer closes, `complete(data)` holds, or timeout_s passes.
template <typename Complete>
Received receive(const Socket& s, double timeout_s, Complete complete) {
  const auto t0 = Clock::now();
  Received r;
  while (!complete(r.data)) {
    const double left = timeout_s - seconds_since(t0);
    if (left <= 0) break;
    pollfd p{s.fd(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) continue;
    char buf[16384];
    const ssize_t got = ::recv(s.fd(), buf, sizeof(buf), 0);
    if (got > 0) {
      r.data.append(buf, static_cast<size_t>(got));
    } else if (got == 0 || errno != EINTR) {
      r.closed = true;
      break;
    }
  }
  r.seconds = seconds_since(t0);
  return r;
}

Received receive_until_closed(const Socket& s, double timeout_s) {
  return receive(s, timeout_s, [](const std::string&) { return false; });
}

struct Reply {
  int status = 0;  // 0: no complete answer
  std::string head;
  std::string body;
  double seconds = 0;
};

// A complete HTTP/1.1 response at the front of `data` (Content-Length framed; HEAD: no body).
bool parse_reply(const std::string& data, bool head_request, Reply* out) {
  const size_t end = data.find("\r\n\r\n");
  if (data.rfind("HTTP/1.", 0) != 0 || end == std::string::npos) return false;
  size_t length = 0;
  const size_t cl = data.find("Content-Length: ");
  if (!head_request && cl != std::string::npos && cl < end) {
    length = std::strtoul(data.c_str() + cl + 16, nullptr, 10);
  }
  if (data.size() < end + 4 + length) return false;
  out->status = std::atoi(data.c_str() + 9);
  out->head = data.substr(0, end + 2);
  out->body = data.substr(end + 4, length);
  return true;
}

// Sends one request on `s` and reads its response.
Reply exchange(const Socket& s, const std::string& request, double timeout_s) {
  Reply reply;
  const bool head_request = request.rfind("HEAD ", 0) == 0;
  if (!s.send(request)) return reply;
  const Received r = receive(s, timeout_s, [&](const std::string& data) {
    Reply unused;
    return parse_reply(data, head_request, &unused);
  });
  parse_reply(r.data, head_request, &reply);
  reply.seconds = r.seconds;
  return reply;
}

std::string request(const std::string& method, const std::string& path,
                    const std::string& extra_headers = "") {
  return method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra_headers + "\r\n";
}

// One request on a fresh connection.
Reply http(uint16_t port, const std::string& method, const std::string& path,
           double timeout_s = 1.0, const std::string& extra_headers = "") {
  Socket s(port);
  if (!s.connected()) return Reply{};
  return exchange(s, request(method, path, "Connection: close\r\n" + extra_headers), timeout_s);
}

std::string header(const Reply& reply, const std::string& name) {
  const std::string key = "\r\n" + name + ": ";
  const size_t at = reply.head.find(key);
  if (at == std::string::npos) return "";
  const size_t from = at + key.size();
  return reply.head.substr(from, reply.head.find("\r\n", from) - from);
}

// Holds `count` connections that send a request one byte per `interval` (a slow-loris client)
// from a thread of its own, until destroyed.
class Tricklers {
 public:
  Tricklers(uint16_t port, int count, std::chrono::milliseconds interval) {
    for (int i = 0; i < count; ++i) sockets_.emplace_back(port);
    thread_ = std::thread([this, interval] {
      const std::string bytes = request("GET", "/metrics");
      for (size_t i = 0; !done_.load(); i = (i + 1) % bytes.size()) {
        for (const Socket& s : sockets_) s.send(bytes.substr(i, 1));
        const auto until = Clock::now() + interval;
        while (!done_.load() && Clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
    });
  }
  ~Tricklers() {
    done_.store(true);
    thread_.join();
  }

 private:
  std::vector<Socket> sockets_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

std::vector<Socket> open_idle(uint16_t port, int count) {
  std::vector<Socket> held;
  for (int i = 0; i < count; ++i) {
    held.emplace_back(port);
    REQUIRE(held.back().connected());
  }
  return held;
}

std::unique_ptr<MetricsHttpServer> start_server(const Registry& reg,
                                                const MetricsHttpServerOptions& options = {}) {
  auto started = MetricsHttpServer::start(reg, options);
  REQUIRE(started.is_ok());
  return std::move(*started);
}

}  // namespace

TEST_CASE("MetricsHttpServer serves /metrics and /healthz; 404 and 405 otherwise") {
  Registry reg;
  reg.counter("keep_http_test_total", "T.", {"k"}).labels({"v"}).inc(7);
  auto server = start_server(reg);
  const uint16_t port = server->port();
  CHECK(port != 0);
  CHECK(server->address() == "127.0.0.1:" + std::to_string(port));

  const Reply metrics = http(port, "GET", "/metrics");
  CHECK(metrics.status == 200);
  CHECK(header(metrics, "Content-Type") == "text/plain; version=0.0.4; charset=utf-8");
  CHECK(metrics.body == reg.render());
  CHECK(metrics.body.find("keep_http_test_total{k=\"v\"} 7\n") != std::string::npos);
  CHECK(server->scrapes() == 1);

  const Reply head = http(port, "HEAD", "/metrics");
  CHECK(head.status == 200);
  CHECK(head.body.empty());
  CHECK(header(head, "Content-Type") == "text/plain; version=0.0.4; charset=utf-8");
  CHECK(server->scrapes() == 1);  // HEAD is not a scrape

  const Reply health = http(port, "GET", "/healthz");
  CHECK(health.status == 200);
  CHECK(health.body == "ok");
  CHECK(http(port, "GET", "/nope").status == 404);
  CHECK(http(port, "GET", "/metrics/x").status == 404);

  const Reply post = http(port, "POST", "/metrics", 1.0, "Content-Length: 1\r\n");
  CHECK(post.status == 405);
  CHECK(header(post, "Allow") == "GET, HEAD");
  CHECK(http(port, "DELETE", "/healthz").status == 405);

  // Headers beyond max_request_header_bytes are refused (431) or the connection closed, never
  // served; the server goes on answering.
  const Reply huge =
      http(port, "GET", "/metrics", 2.0, "X-Big: " + std::string(64 * 1024, 'a') + "\r\n");
  CHECK(huge.status != 200);
  CHECK(http(port, "GET", "/healthz").status == 200);

  // Prometheus keeps its connection alive between scrapes.
  Socket keep_alive(port);
  REQUIRE(keep_alive.connected());
  for (int i = 0; i < 3; ++i) {
    const Reply r = exchange(keep_alive, request("GET", "/metrics"), 1.0);
    CHECK(r.status == 200);
    CHECK(r.body == reg.render());
  }
  CHECK(server->scrapes() == 4);

  // Clients still connected; stop() returns promptly and the port no longer answers.
  const auto t0 = Clock::now();
  server->stop();
  CHECK(seconds_since(t0) < 1.0);
  server->stop();  // idempotent
  CHECK(receive_until_closed(keep_alive, 1.0).closed);
  CHECK_FALSE(Socket(port).connected());
}

TEST_CASE("MetricsHttpServer bind failures and bad options are a Status, not a crash") {
  Registry reg;
  auto first = start_server(reg);
  MetricsHttpServerOptions same;
  same.port = first->port();
  auto second = MetricsHttpServer::start(reg, same);
  REQUIRE_FALSE(second.is_ok());
  CHECK(second.status().code() == keep::Code::kUnavailable);
  CHECK(second.status().message().find("127.0.0.1:" + std::to_string(same.port)) !=
        std::string::npos);

  MetricsHttpServerOptions bad_host;
  bad_host.host = "no.such.host.invalid";
  auto unresolved = MetricsHttpServer::start(reg, bad_host);
  REQUIRE_FALSE(unresolved.is_ok());
  CHECK(unresolved.status().code() == keep::Code::kUnavailable);
  CHECK(unresolved.status().message().find("no.such.host.invalid:0") != std::string::npos);

  for (auto bad :
       {&MetricsHttpServerOptions::idle_timeout_s, &MetricsHttpServerOptions::request_timeout_s,
        &MetricsHttpServerOptions::max_connections}) {
    MetricsHttpServerOptions options;
    options.*bad = 0;
    CHECK(MetricsHttpServer::start(reg, options).status().code() == keep::Code::kInvalidArgument);
  }
}

TEST_CASE("MetricsHttpServer starts and stops repeatedly (destructor stops)") {
  Registry reg;
  for (int i = 0; i < 20; ++i) start_server(reg);
}

TEST_CASE("MetricsHttpServer answers scrapes while 300 idle and 4 trickling connections are held") {
  raise_fd_limit();
  Registry reg;
  reg.gauge("keep_http_load_test", "T.").get().set(1);
  auto server = start_server(reg);
  const uint16_t port = server->port();
  std::vector<Socket> idle = open_idle(port, 300);
  Tricklers trickling(port, 4, std::chrono::milliseconds(1000));

  for (int round = 0; round < 5; ++round) {
    const Reply metrics = http(port, "GET", "/metrics", 1.0);
    CHECK(metrics.status == 200);
    CHECK(metrics.seconds < 1.0);
    const Reply health = http(port, "GET", "/healthz", 1.0);
    CHECK(health.status == 200);
    CHECK(health.seconds < 1.0);
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
  }
  CHECK(server->scrapes() == 5);
}

TEST_CASE("MetricsHttpServer closes a request trickled past request_timeout_s") {
  Registry reg;
  MetricsHttpServerOptions options;
  options.request_timeout_s = 2;
  options.idle_timeout_s = 10;  // the trickle keeps it active: only the request timeout applies
  auto server = start_server(reg, options);

  Socket slow(server->port());
  REQUIRE(slow.connected());
  const auto t0 = Clock::now();
  const std::string bytes = request("GET", "/metrics");
  Received r;
  for (size_t i = 0; i < bytes.size() - 1 && !r.closed && seconds_since(t0) < 6.0; ++i) {
    slow.send(bytes.substr(i, 1));
    r = receive_until_closed(slow, 0.3);
  }
  const double closed_after = seconds_since(t0);
  CHECK(r.closed);
  CHECK(closed_after > 1.5);
  CHECK(closed_after < 3.5);
  CHECK(r.data.find(" 200 ") == std::string::npos);

  // The timeout restarts with each request: a keep-alive client scraping now and then for longer
  // than the timeout is served every time.
  Socket scraper(server->port());
  REQUIRE(scraper.connected());
  for (int i = 0; i < 3; ++i) {
    CHECK(exchange(scraper, request("GET", "/metrics"), 1.0).status == 200);
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  }
  CHECK(exchange(scraper, request("GET", "/healthz"), 1.0).status == 200);
}

TEST_CASE("MetricsHttpServer closes a connection idle for idle_timeout_s") {
  Registry reg;
  MetricsHttpServerOptions options;
  options.idle_timeout_s = 1;
  auto server = start_server(reg, options);

  Socket silent(server->port());
  Socket stalled(server->port());  // sent half a request, then nothing
  REQUIRE(silent.connected());
  REQUIRE(stalled.connected());
  REQUIRE(stalled.send("GET /metrics HTTP/1.1\r\nHo"));
  const Received a = receive_until_closed(silent, 4.0);
  CHECK(a.closed);
  CHECK(a.seconds < 2.5);
  CHECK(a.data.empty());
  const Received b = receive_until_closed(stalled, 4.0);
  CHECK(b.closed);
  CHECK(b.data.find(" 200 ") == std::string::npos);
}

TEST_CASE("MetricsHttpServer closes connections beyond max_connections at once") {
  Registry reg;
  MetricsHttpServerOptions options;
  options.max_connections = 8;
  auto server = start_server(reg, options);
  const uint16_t port = server->port();
  std::vector<Socket> idle = open_idle(port, 8);

  // The kernel completes the handshake; the server then closes it at once, answer or not.
  const Reply refused = http(port, "GET", "/healthz", 2.0);
  CHECK(refused.status == 0);
  CHECK(refused.seconds < 0.5);
  Socket excess(port);
  const Received r = receive_until_closed(excess, 2.0);
  CHECK(r.closed);
  CHECK(r.seconds < 0.5);

  // Once the idle clients leave, scrapes are answered again.
  for (Socket& s : idle) s.close();
  const auto t0 = Clock::now();
  Reply again;
  while (again.status != 200 && seconds_since(t0) < 2.0) {
    again = http(port, "GET", "/metrics", 0.5);
    if (again.status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(again.status == 200);
}

TEST_CASE("MetricsHttpServer stop() is prompt with 300 connections open") {
  raise_fd_limit();
  Registry reg;
  auto server = start_server(reg);
  const uint16_t port = server->port();
  std::vector<Socket> idle = open_idle(port, 200);
  std::vector<Socket> partial = open_idle(port, 100);
  for (const Socket& s : partial) REQUIRE(s.send("GET /metrics HTTP/1.1\r\n"));
  REQUIRE(http(port, "GET", "/healthz").status == 200);  // every connection above is accepted

  const auto t0 = Clock::now();
  server->stop();
  CHECK(seconds_since(t0) < 1.0);
  CHECK(receive_until_closed(idle.front(), 1.0).closed);
  CHECK(receive_until_closed(partial.back(), 1.0).closed);
}
