#include "shared/metrics/exposition.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "shared/common/utf8.h"

namespace keep::metrics {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

template <bool kQuote>
void append_escaped(std::string* out, std::string_view s) {
  out->reserve(out->size() + s.size());
  size_t i = 0;
  while (i < s.size()) {
    const size_t n = utf8_sequence_length(s, i);
    if (n == 0) {
      out->append(kReplacement);
      ++i;
      continue;
    }
    if (n == 1) {
      const char c = s[i];
      if (c == '\\') {
        out->append("\\\\");
      } else if (c == '\n') {
        out->append("\\n");
      } else if (kQuote && c == '"') {
        out->append("\\\"");
      } else {
        out->push_back(c);
      }
    } else {
      out->append(s.substr(i, n));
    }
    i += n;
  }
}

}  // namespace

void append_value(std::string* out, double v) {
  if (std::isnan(v)) {
    out->append("NaN");
    return;
  }
  if (std::isinf(v)) {
    out->append(v > 0 ? "+Inf" : "-Inf");
    return;
  }
  // Go's strconv.FormatFloat(v, 'g', -1, 64), which client_golang writes values and `le` labels
  // with: the shortest digits that round-trip; scientific when the exponent is < -4 or >= 6
  // (0.0001, 100000, 1e+06, 1.5e-05). Matching it keeps `le` label values identical to other
  // exporters' (Prometheus 2.x compares them as strings).
  char buf[64];
  auto sci = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  if (sci.ec != std::errc()) {  // cannot happen with 64 bytes; be safe anyway
    out->append("NaN");
    return;
  }
  char* e = std::find(buf, sci.ptr, 'e');
  int exponent = 0;
  if (e != sci.ptr) {
    const char* digits = e + 1;
    if (digits != sci.ptr && *digits == '+') ++digits;  // from_chars takes '-' but not '+'
    std::from_chars(digits, sci.ptr, exponent);
  }
  if (exponent < -4 || exponent >= 6) {
    out->append(buf, sci.ptr);
    return;
  }
  auto fixed = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::fixed);
  if (fixed.ec != std::errc()) {
    out->append("NaN");
    return;
  }
  out->append(buf, fixed.ptr);
}

std::string format_value(double v) {
  std::string s;
  append_value(&s, v);
  return s;
}

void append_escaped_label_value(std::string* out, std::string_view s) {
  append_escaped<true>(out, s);
}

void append_escaped_help(std::string* out, std::string_view s) { append_escaped<false>(out, s); }

void append_labels(std::string* out, std::span<const std::string> names,
                   std::span<const std::string> values, std::string_view extra_name,
                   std::string_view extra_value) {
  if (names.empty() && extra_name.empty()) return;
  out->push_back('{');
  bool first = true;
  for (size_t i = 0; i < names.size() && i < values.size(); ++i) {
    if (!first) out->push_back(',');
    first = false;
    out->append(names[i]);
    out->append("=\"");
    append_escaped_label_value(out, values[i]);
    out->push_back('"');
  }
  if (!extra_name.empty()) {
    if (!first) out->push_back(',');
    out->append(extra_name);
    out->append("=\"");
    append_escaped_label_value(out, extra_value);
    out->push_back('"');
  }
  out->push_back('}');
}

}  // namespace keep::metrics
