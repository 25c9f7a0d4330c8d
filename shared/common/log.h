// One logging facility for every KEEP binary: levels, printf-style, a settable sink.
// Never used inside kernels or launchers.
#pragma once

#include <functional>
#include <string_view>

namespace keep::log {

enum class Level : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

void set_level(Level level);
Level level();
// Parses "debug", "info", "warn", "error", "off"; false when the name is unknown.
bool parse_level(std::string_view name, Level* out);

// The sink receives one formatted line without the trailing newline. The default writes
// "2026-11-29T18:17:47.123Z I component: message" to stderr. Thread-safe.
using Sink = std::function<void(Level, std::string_view line)>;
void set_sink(Sink sink);

void write(Level level, const char* component, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));

}  // namespace keep::log

#define KEEP_LOG_DEBUG(component, ...)                                        \
  do {                                                                        \
    if (::keep::log::level() <= ::keep::log::Level::kDebug)                   \
      ::keep::log::write(::keep::log::Level::kDebug, component, __VA_ARGS__); \
  } while (0)
#define KEEP_LOG_INFO(component, ...) \
  ::keep::log::write(::keep::log::Level::kInfo, component, __VA_ARGS__)
#define KEEP_LOG_WARN(component, ...) \
  ::keep::log::write(::keep::log::Level::kWarn, component, __VA_ARGS__)
#define KEEP_LOG_ERROR(component, ...) \
  ::keep::log::write(::keep::log::Level::kError, component, __VA_ARGS__)
