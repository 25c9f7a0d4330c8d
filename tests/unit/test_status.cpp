#include <doctest/doctest.h>

#include <string>

#include "shared/common/log.h"
#include "shared/common/status.h"

using keep::Code;
using keep::Result;
using keep::Status;

namespace {
Result<int> parse_positive(int v) {
  if (v <= 0) return Status(Code::kInvalidArgument, "not positive: " + std::to_string(v));
  return v;
}
Result<int> doubled(int v) {
  KEEP_ASSIGN_OR_RETURN(int x, parse_positive(v));
  return 2 * x;
}
}  // namespace

TEST_CASE("status carries code, message and context") {
  Status ok;
  CHECK(ok.is_ok());
  CHECK(ok.to_string() == "ok");
  Status st(Code::kNotFound, "segment 7");
  CHECK_FALSE(st.is_ok());
  CHECK(st.to_string() == "not_found: segment 7");
  CHECK(st.with_context("retrieve").message() == "retrieve: segment 7");
  CHECK(st.with_context("retrieve").code() == Code::kNotFound);
}

TEST_CASE("every code has a distinct name") {
  for (int i = 0; i < keep::kCodeCount; ++i) {
    for (int j = i + 1; j < keep::kCodeCount; ++j) {
      CHECK(std::string(keep::code_name(static_cast<Code>(i))) !=
            keep::code_name(static_cast<Code>(j)));
    }
  }
}

TEST_CASE("result propagates errors through KEEP_ASSIGN_OR_RETURN") {
  auto good = doubled(4);
  REQUIRE(good.is_ok());
  CHECK(*good == 8);
  auto bad = doubled(-1);
  REQUIRE_FALSE(bad.is_ok());
  CHECK(bad.status().code() == Code::kInvalidArgument);
  Result<int> from_ok{Status::ok()};
  CHECK_FALSE(from_ok.is_ok());
  CHECK(from_ok.status().code() == Code::kInternal);
}

TEST_CASE("log sink receives lines at or above the level") {
  std::string got;
  keep::log::set_sink(
      [&](keep::log::Level, std::string_view line) { got += std::string(line) + "\n"; });
  keep::log::set_level(keep::log::Level::kWarn);
  KEEP_LOG_INFO("test", "hidden %d", 1);
  KEEP_LOG_WARN("test", "shown %d", 2);
  keep::log::set_sink(nullptr);
  keep::log::set_level(keep::log::Level::kInfo);
  CHECK(got.find("hidden") == std::string::npos);
  CHECK(got.find("W test: shown 2") != std::string::npos);
  keep::log::Level l;
  CHECK(keep::log::parse_level("debug", &l));
  CHECK(l == keep::log::Level::kDebug);
  CHECK_FALSE(keep::log::parse_level("loud", &l));
}
