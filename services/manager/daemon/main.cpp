// keep-manager: the KEEP memory daemon. `keep-manager --help` lists every option with its default.
#include <atomic>
#include <csignal>
#include <cstdio>

#include "services/manager/daemon/manager_daemon.h"
#include "shared/common/log.h"

namespace {
std::atomic<keep::manager::ManagerDaemon*> g_daemon{nullptr};
volatile std::sig_atomic_t g_stop_requested = 0;
// INT, TERM and HUP stop the daemon cleanly (docs/operations.md, "Signals"): a HUP from a closed
// terminal or a supervisor must not kill it without its final snapshot and shm cleanup.
void on_signal(int) {
  g_stop_requested = 1;
  keep::manager::ManagerDaemon* d = g_daemon.load();
  if (d != nullptr) d->stop();
}
}  // namespace

int main(int argc, char** argv) {
  keep::Options opts("keep-manager",
                     "the KEEP memory daemon (memories, groups, WAL, shared KV region)");
  keep::manager::declare_manager_options(&opts);
  keep::Status st = opts.parse(argc, argv);
  if (!st.is_ok()) {
    std::fprintf(stderr, "keep-manager: %s\n", st.message().c_str());
    return 2;
  }
  if (opts.help_requested()) {
    std::fputs(opts.help_text().c_str(), stdout);
    return 0;
  }
  if (!opts.positional().empty()) {
    std::fprintf(stderr, "keep-manager: unexpected argument '%s' (see --help)\n",
                 opts.positional()[0].c_str());
    return 2;
  }
  auto config = keep::manager::read_manager_config(opts);
  if (!config.is_ok()) {
    std::fprintf(stderr, "keep-manager: %s\n", config.status().message().c_str());
    return 2;
  }
  keep::log::Level level;
  if (!keep::log::parse_level(config->log_level, &level)) {
    std::fprintf(stderr, "keep-manager: --log-level: unknown level '%s'\n",
                 config->log_level.c_str());
    return 2;
  }
  keep::log::set_level(level);

  // Handlers first: a signal while the models load must not kill the daemon half-started.
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
  for (int sig : {SIGPIPE, SIGUSR1, SIGUSR2}) std::signal(sig, SIG_IGN);

  auto daemon = keep::manager::ManagerDaemon::start(*config);
  if (!daemon.is_ok()) {
    std::fprintf(stderr, "keep-manager: %s\n", daemon.status().to_string().c_str());
    return 1;
  }
  g_daemon.store(daemon->get());
  if (g_stop_requested) (*daemon)->stop();  // a signal came while starting

  (*daemon)->run();
  g_daemon.store(nullptr);
  daemon->reset();  // final sync + snapshot
  KEEP_LOG_INFO("manager", "stopped");
  return 0;
}
