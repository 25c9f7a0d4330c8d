// MetricsHttpServer: serves a Registry over HTTP for Prometheus to scrape (libmicrohttpd).
//
//   GET|HEAD /metrics  -> 200, the registry rendered, Content-Type text/plain; version=0.0.4;
//                         charset=utf-8
//   GET|HEAD /healthz  -> 200, "ok"
//   other paths        -> 404; other methods -> 405 (Allow: GET, HEAD)
//
// One event-driven thread (epoll) serves every connection, so idle or slow clients cost a file
// descriptor each, not a thread, and cannot keep /metrics or /healthz from being answered. What a
// client may hold is bounded by the options below: idle connections and slow requests are closed,
// connections beyond max_connections are closed at accept, and request headers are size-limited.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "shared/common/status.h"
#include "shared/metrics/metrics.h"

namespace keep::metrics {

struct MetricsHttpServerOptions {
  std::string host = "127.0.0.1";  // "0.0.0.0" to listen on every interface
  uint16_t port = 0;               // 0: the kernel picks a free port; see port()
  // A connection that sends and receives nothing for this long is closed. 10 s: far above what a
  // scrape takes, and below Prometheus' 15 s interval, so idle keep-alives do not pile up.
  int idle_timeout_s = 10;
  // Each request, from its connection's opening (or the previous response) until its response is
  // sent, must finish within this; else the connection is closed. Catches a request trickled a
  // byte at a time, which the idle timeout never sees. 10 s: Prometheus' default scrape_timeout.
  int request_timeout_s = 10;
  // Connections open at once; a new one beyond it is closed at once (not queued), so hostile
  // clients cannot exhaust file descriptors. 1024: far above any number of legitimate scrapers.
  int max_connections = 1024;
  // Memory per connection for the request line and headers; a larger request gets 431. 16 KiB:
  // Prometheus sends under 1 KiB of headers.
  int max_request_header_bytes = 16 * 1024;
};

// MetricsHttpServerOptions with host and port from "host:port" (the daemons' --metrics-listen);
// kInvalidArgument naming --metrics-listen otherwise. The other fields keep their defaults.
Result<MetricsHttpServerOptions> parse_metrics_listen(const std::string& listen);

class MetricsHttpServer {
 public:
  // Binds host:port and starts serving `registry` (which must outlive the server). A bind failure
  // (port in use, bad host, no permission) returns kUnavailable with host:port in the message;
  // options out of range return kInvalidArgument.
  static Result<std::unique_ptr<MetricsHttpServer>> start(const Registry& registry,
                                                          const MetricsHttpServerOptions& options);

  ~MetricsHttpServer();  // stop()
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Stops listening, closes every connection and joins the threads; prompt however many clients
  // are connected. Idempotent.
  void stop();

  const std::string& host() const;
  uint16_t port() const;        // the bound port (the real one when options.port was 0)
  std::string address() const;  // "127.0.0.1:9464" ("[::1]:9464" for IPv6)
  uint64_t scrapes() const;     // GET /metrics served so far

 private:
  struct Impl;
  explicit MetricsHttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace keep::metrics
