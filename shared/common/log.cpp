#include "shared/common/log.h"

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <string>

namespace keep::log {
namespace {

std::atomic<int> g_level{static_cast<int>(Level::kInfo)};
std::mutex g_mu;
Sink g_sink;  // empty: stderr

char level_char(Level l) {
  switch (l) {
    case Level::kDebug:
      return 'D';
    case Level::kInfo:
      return 'I';
    case Level::kWarn:
      return 'W';
    case Level::kError:
      return 'E';
    case Level::kOff:
      return '-';
  }
  return '?';
}

}  // namespace

void set_level(Level l) { g_level.store(static_cast<int>(l)); }
Level level() { return static_cast<Level>(g_level.load(std::memory_order_relaxed)); }

bool parse_level(std::string_view name, Level* out) {
  static constexpr std::pair<std::string_view, Level> kNames[] = {{"debug", Level::kDebug},
                                                                  {"info", Level::kInfo},
                                                                  {"warn", Level::kWarn},
                                                                  {"error", Level::kError},
                                                                  {"off", Level::kOff}};
  for (const auto& [n, l] : kNames) {
    if (n == name) {
      *out = l;
      return true;
    }
  }
  return false;
}

void set_sink(Sink sink) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_sink = std::move(sink);
}

void write(Level l, const char* component, const char* fmt, ...) {
  if (static_cast<int>(l) < g_level.load(std::memory_order_relaxed)) return;
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);

  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  int ms = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char ts[32];
  std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
  std::string line = std::string(ts) + "." + (ms < 100 ? (ms < 10 ? "00" : "0") : "") +
                     std::to_string(ms) + "Z " + level_char(l) + " " + component + ": " + msg;

  std::lock_guard<std::mutex> lock(g_mu);
  if (g_sink) {
    g_sink(l, line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

}  // namespace keep::log
