// keep-manager: the KEEP memory daemon. `keep-manager --help` lists every option with its default.
#include <atomic>
#include <csignal>
#include <cstdio>

#include "services/manager/daemon/manager_daemon.h"
#include "shared/common/daemon_main.h"
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
  if (auto exit_code = keep::parse_daemon_args(opts, argc, argv)) return *exit_code;
  auto config = keep::manager::read_manager_config(opts);
  if (!config.is_ok()) {
    std::fprintf(stderr, "keep-manager: %s\n", config.status().message().c_str());
    return 2;
  }
  if (!keep::set_log_level("keep-manager", config->log_level)) return 2;
  // Handlers first: a signal while the models load must not kill the daemon half-started.
  keep::install_stop_signals(on_signal);

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
