// Limits for JSON read from files we do not control (model configs, tokenizer.json, safetensors
// headers). Header-only; users link nlohmann_json already.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

namespace keep {

// nlohmann's parser accepts any depth, but dump() (used in our error messages) and our own walks
// recurse, so a few hundred KB of '[' would overflow the stack. Parsers check the text first.
// Real files nest 3 to 6 levels deep.
inline constexpr size_t kMaxJsonDepth = 64;

// True when the arrays and objects of `text` nest deeper than max_depth. Brackets inside strings
// do not count; the text need not be valid JSON (the parser judges that).
inline bool json_nesting_exceeds(std::string_view text, size_t max_depth = kMaxJsonDepth) {
  size_t depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // skips the escaped character, which may be a quote
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return false;
}

// The value of an integer JSON number that fits int64; nullopt for anything else. get<int64_t>()
// would convert a float such as 1e40 (undefined behaviour) or wrap a large unsigned.
inline std::optional<int64_t> json_int64(const nlohmann::json& j) {
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (j.is_number_integer()) return j.get<int64_t>();
  return std::nullopt;
}

}  // namespace keep
