#include "shared/common/daemon_main.h"

#include <csignal>
#include <cstdio>
#include <cstring>

#include "shared/common/log.h"

namespace keep {

std::optional<int> parse_daemon_args(Options& opts, int argc, char** argv) {
  const char* program = argc > 0 ? argv[0] : "daemon";
  if (const char* slash = std::strrchr(program, '/')) program = slash + 1;
  Status st = opts.parse(argc, argv);
  if (!st.is_ok()) {
    std::fprintf(stderr, "%s: %s\n", program, st.message().c_str());
    return 2;
  }
  if (opts.help_requested()) {
    std::fputs(opts.help_text().c_str(), stdout);
    return 0;
  }
  if (!opts.positional().empty()) {
    std::fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", program,
                 opts.positional()[0].c_str());
    return 2;
  }
  return std::nullopt;
}

bool set_log_level(const std::string& program, const std::string& level) {
  log::Level parsed;
  if (!log::parse_level(level, &parsed)) {
    std::fprintf(stderr, "%s: --log-level: unknown level '%s'\n", program.c_str(), level.c_str());
    return false;
  }
  log::set_level(parsed);
  return true;
}

void install_stop_signals(void (*on_stop)(int)) {
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
  for (int sig : {SIGPIPE, SIGUSR1, SIGUSR2}) std::signal(sig, SIG_IGN);
}

}  // namespace keep
