// Small helpers that bench_keep and bench_decision share: their comma-separated list arguments
// and the median they report.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

namespace keep::bench {

// "a,b,c" of positive numbers into *out (as T); false on an empty item, junk or a value <= 0.
template <typename T>
bool parse_list(const std::string& s, std::vector<T>* out) {
  out->clear();
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = std::min(s.find(',', at), s.size());
    const std::string item = s.substr(at, comma - at);
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0' || v <= 0) return false;
    out->push_back(static_cast<T>(v));
    at = comma + 1;
  }
  return !out->empty();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace keep::bench
