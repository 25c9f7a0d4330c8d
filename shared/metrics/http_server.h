// MetricsHttpServer: serves a Registry over HTTP for Prometheus to scrape (cpp-httplib).
//
//   GET /metrics  -> 200, the registry rendered, Content-Type text/plain; version=0.0.4;
//   charset=utf-8 GET /healthz  -> 200, "ok" anything else -> 404
//
// The server runs on its own listener thread plus a small pool of request threads (options.threads;
// Prometheus keeps its connection alive, so one thread would make /healthz wait behind a scrape
// connection). HTTP keep-alive is limited to options.keep_alive_seconds, which also bounds how long
// stop() can take when a client holds a connection open.
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
  int threads = 2;                 // request threads
  int keep_alive_seconds = 2;
};

class MetricsHttpServer {
 public:
  // Binds host:port and starts serving `registry` (which must outlive the server). A bind failure
  // (port in use, bad host, no permission) returns kUnavailable with host:port in the message.
  static Result<std::unique_ptr<MetricsHttpServer>> start(const Registry& registry,
                                                          const MetricsHttpServerOptions& options);

  ~MetricsHttpServer();  // stop()
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Stops listening and joins the threads. Idempotent.
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
