// keep-worker: the KEEP inference worker. `keep-worker --help` lists every option with its default.
#include <atomic>
#include <csignal>
#include <cstdio>

#include "services/worker/daemon/worker_daemon.h"
#include "shared/common/daemon_main.h"
#include "shared/common/log.h"

namespace {
std::atomic<keep::worker::WorkerDaemon*> g_daemon{nullptr};
volatile std::sig_atomic_t g_stop_requested = 0;
// INT, TERM and HUP stop the worker cleanly: the queued requests are answered and the KV job in
// hand is revoked (docs/operations.md, "Signals").
void on_signal(int) {
  g_stop_requested = 1;
  keep::worker::WorkerDaemon* d = g_daemon.load();
  if (d != nullptr) d->stop();
}
}  // namespace

int main(int argc, char** argv) {
  keep::Options opts("keep-worker",
                     "the KEEP inference worker (planners' completions, the memories' KV)");
  keep::worker::declare_worker_options(&opts);
  if (auto exit_code = keep::parse_daemon_args(opts, argc, argv)) return *exit_code;
  auto config = keep::worker::read_worker_config(opts);
  if (!config.is_ok()) {
    std::fprintf(stderr, "keep-worker: %s\n", config.status().message().c_str());
    return 2;
  }
  if (!keep::set_log_level("keep-worker", config->log_level)) return 2;
  // Handlers first: a signal while the models load must not kill the daemon half-started.
  keep::install_stop_signals(on_signal);

  auto daemon = keep::worker::WorkerDaemon::start(*config);
  if (!daemon.is_ok()) {
    std::fprintf(stderr, "keep-worker: %s\n", daemon.status().to_string().c_str());
    return 1;
  }
  g_daemon.store(daemon->get());
  if (g_stop_requested) (*daemon)->stop();  // a signal came while loading

  (*daemon)->run();
  g_daemon.store(nullptr);
  daemon->reset();  // finishes the queued requests, revokes the job in hand
  KEEP_LOG_INFO("worker", "stopped");
  return 0;
}
