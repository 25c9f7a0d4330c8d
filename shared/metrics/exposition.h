// Pieces of the Prometheus text exposition format 0.0.4 that the families render with.
// https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format
//
//   # HELP <name> <help, with \ and newline escaped as \\ and \n>
//   # TYPE <name> counter|gauge|histogram
//   <name>{<label>="<value, with \ " and newline escaped as \\ \" \n>",...} <value>
//
// Values are written like Go's strconv.FormatFloat(v, 'g', -1, 64), as client_golang does: the
// shortest digits that parse back to the same double, scientific notation when the exponent is
// < -4 or >= 6 (0.0001, 0.5, 100000, 1e+06, 1.5e-05, 1.7976931348623157e+308); infinities and NaN
// as +Inf, -Inf and NaN, the spellings Prometheus's parser accepts. Integer counts (histogram
// buckets, _count) are written as integers.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace keep::metrics {

// Shortest round-trip decimal form of v; "+Inf", "-Inf", "NaN" for the special values.
std::string format_value(double v);
void append_value(std::string* out, double v);

// Appends s with \ " and newline escaped (label values). Invalid UTF-8 becomes U+FFFD.
void append_escaped_label_value(std::string* out, std::string_view s);
// Appends s with \ and newline escaped (HELP text). Invalid UTF-8 becomes U+FFFD.
void append_escaped_help(std::string* out, std::string_view s);

// Appends `{n1="v1",n2="v2"}` (nothing when there are no labels). When extra_name is not empty,
// `extra_name="extra_value"` is appended last (the histogram's `le`).
void append_labels(std::string* out, std::span<const std::string> names,
                   std::span<const std::string> values, std::string_view extra_name = {},
                   std::string_view extra_value = {});

}  // namespace keep::metrics
