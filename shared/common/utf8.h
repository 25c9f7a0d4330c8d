// UTF-8 checks for text that crosses a process boundary. Cap'n Proto Text, JSON and most clients
// decode strictly, so what a service stores or echoes must be valid UTF-8 (RFC 3629).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace keep {

// Length of the valid UTF-8 sequence at s[i] (i < s.size()), or 0 when it is not one: overlong
// forms, surrogates and code points above U+10FFFF are invalid.
size_t utf8_sequence_length(std::string_view s, size_t i);

// Byte offset of the first invalid sequence, or s.size() when `s` is valid UTF-8.
size_t utf8_invalid_offset(std::string_view s);
inline bool utf8_valid(std::string_view s) { return utf8_invalid_offset(s) == s.size(); }

// `s` fit to quote in an error message: printable ASCII as it is, every other byte as \xNN, at
// most `max_bytes` of the input ("..." after). Never echoes raw bytes a client may fail to decode.
std::string printable(std::string_view s, size_t max_bytes = 64);

}  // namespace keep
