#include "shared/metrics/http_server.h"

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <httplib.h>

#include "shared/common/log.h"

namespace keep::metrics {

namespace {
constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";
}  // namespace

struct MetricsHttpServer::Impl {
  const Registry* registry = nullptr;
  std::string host;
  uint16_t port = 0;
  httplib::Server server;
  std::thread thread;
  std::atomic<uint64_t> scrapes{0};
  std::atomic<bool> exited{false};
  std::mutex stop_mu;
};

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsHttpServer::~MetricsHttpServer() { stop(); }

Result<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::start(
    const Registry& registry, const MetricsHttpServerOptions& options) {
  if (options.threads < 1 || options.keep_alive_seconds < 1) {
    return Status(Code::kInvalidArgument,
                  "metrics HTTP server: threads and keep_alive_seconds must be >= 1");
  }
  auto impl = std::make_unique<Impl>();
  impl->registry = &registry;
  impl->host = options.host;
  Impl* raw = impl.get();
  httplib::Server& svr = impl->server;

  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which would let a second process bind
  // the same port silently instead of failing.
  svr.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const int threads = options.threads;
  svr.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  svr.set_keep_alive_timeout(options.keep_alive_seconds);
  svr.set_read_timeout(5, 0);
  svr.set_write_timeout(5, 0);

  svr.Get("/metrics", [raw](const httplib::Request&, httplib::Response& res) {
    res.set_content(raw->registry->render(), kContentType);
    raw->scrapes.fetch_add(1, std::memory_order_relaxed);
  });
  svr.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok", "text/plain; charset=utf-8");
  });

  const std::string where = options.host + ":" + std::to_string(options.port);
  int bound = -1;
  if (options.port == 0) {
    bound = svr.bind_to_any_port(options.host);
  } else if (svr.bind_to_port(options.host, options.port)) {
    bound = options.port;
  }
  if (bound <= 0) {
    return Status(Code::kUnavailable, "metrics HTTP server: cannot bind " + where +
                                          " (address in use, unknown host or not permitted)");
  }
  impl->port = static_cast<uint16_t>(bound);
  impl->thread = std::thread([raw] {
    raw->server.listen_after_bind();
    raw->exited.store(true, std::memory_order_release);
  });
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(std::move(impl)));
  KEEP_LOG_INFO("metrics", "serving /metrics on http://%s/metrics", server->address().c_str());
  return server;
}

void MetricsHttpServer::stop() {
  std::lock_guard<std::mutex> lock(impl_->stop_mu);
  if (!impl_->thread.joinable()) return;
  // httplib's stop() is a no-op until the listen loop runs, and must be called once only (it
  // asserts on a second call): wait for the loop to start (or to have ended), then stop it once.
  while (!impl_->exited.load(std::memory_order_acquire)) {
    if (impl_->server.is_running()) {
      impl_->server.stop();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  impl_->thread.join();
}

const std::string& MetricsHttpServer::host() const { return impl_->host; }
uint16_t MetricsHttpServer::port() const { return impl_->port; }
uint64_t MetricsHttpServer::scrapes() const {
  return impl_->scrapes.load(std::memory_order_relaxed);
}

std::string MetricsHttpServer::address() const {
  const bool v6 = impl_->host.find(':') != std::string::npos;
  return (v6 ? "[" + impl_->host + "]" : impl_->host) + ":" + std::to_string(impl_->port);
}

}  // namespace keep::metrics
