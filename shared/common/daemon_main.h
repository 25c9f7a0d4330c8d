// What the daemons' main() functions share: reading the options (config file, flags, --help) and
// the log level, and the signals that stop them cleanly.
#pragma once

#include <optional>
#include <string>

#include "shared/common/options.h"

namespace keep {

// Parses argv into `opts` (declared by the caller). Returns nullopt to go on, or the exit status
// to return at once: 0 after printing --help, 2 after one line on stderr for a bad flag, a bad
// config file or a positional argument.
std::optional<int> parse_daemon_args(Options& opts, int argc, char** argv);

// Sets the log level from its name; false (one line on stderr) when it is not one.
bool set_log_level(const std::string& program, const std::string& level);

// INT, TERM and HUP call `on_stop` (a HUP from a closed terminal or a supervisor must not kill a
// daemon without its cleanup); PIPE, USR1 and USR2 are ignored.
void install_stop_signals(void (*on_stop)(int));

}  // namespace keep
