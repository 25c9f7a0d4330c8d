// keep-worker: the KEEP inference worker. `keep-worker --help` lists every option with its default.
#include <atomic>
#include <csignal>
#include <cstdio>

#include "services/worker/daemon/worker_daemon.h"
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
  keep::Status st = opts.parse(argc, argv);
  if (!st.is_ok()) {
    std::fprintf(stderr, "keep-worker: %s\n", st.message().c_str());
    return 2;
  }
  if (opts.help_requested()) {
    std::fputs(opts.help_text().c_str(), stdout);
    return 0;
  }
  if (!opts.positional().empty()) {
    std::fprintf(stderr, "keep-worker: unexpected argument '%s' (see --help)\n",
                 opts.positional()[0].c_str());
    return 2;
  }
  auto config = keep::worker::read_worker_config(opts);
  if (!config.is_ok()) {
    std::fprintf(stderr, "keep-worker: %s\n", config.status().message().c_str());
    return 2;
  }
  keep::log::Level level;
  if (!keep::log::parse_level(config->log_level, &level)) {
    std::fprintf(stderr, "keep-worker: --log-level: unknown level '%s'\n",
                 config->log_level.c_str());
    return 2;
  }
  keep::log::set_level(level);

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
  for (int sig : {SIGPIPE, SIGUSR1, SIGUSR2}) std::signal(sig, SIG_IGN);

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
