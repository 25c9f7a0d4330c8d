// Shared bits of the libFuzzer targets: an assertion that survives NDEBUG (a failed property is a
// finding, reported through abort() like a sanitizer error) and the input as a string_view.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#define KEEP_FUZZ_ASSERT(cond)                                                               \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: fuzz assertion failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

namespace keep::fuzz {

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace keep::fuzz
