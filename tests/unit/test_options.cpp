#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "shared/common/options.h"

namespace {
keep::Options make() {
  keep::Options o("prog", "test program");
  o.add("endpoint", "tcp://127.0.0.1:5555", "where to listen");
  o.add("fsync", "true", "fsync before ack");
  o.add("arena", "64MiB", "arena size");
  o.add("tau", "0.55", "threshold");
  return o;
}
keep::Status parse(keep::Options& o, std::vector<std::string> args) {
  std::vector<char*> argv;
  static std::string prog = "prog";
  argv.push_back(prog.data());
  for (auto& a : args) argv.push_back(a.data());
  return o.parse(static_cast<int>(argv.size()), argv.data());
}
}  // namespace

TEST_CASE("defaults, flags in both spellings, bare booleans") {
  auto o = make();
  REQUIRE(parse(o, {"--endpoint", "ipc:///tmp/x", "--tau=0.7", "--fsync", "cmd"}).is_ok());
  CHECK(o.str("endpoint") == "ipc:///tmp/x");
  CHECK(*o.number("tau") == doctest::Approx(0.7));
  CHECK(*o.boolean("fsync"));
  CHECK(*o.bytes("arena") == 64ull << 20);
  REQUIRE(o.positional().size() == 1);
  CHECK(o.positional()[0] == "cmd");
}

TEST_CASE("config file applies before flags; errors name the line") {
  std::string path = "/tmp/keep_test_options_" + std::to_string(::getpid()) + ".conf";
  {
    std::ofstream f(path);
    f << "# comment\nendpoint = tcp://127.0.0.1:7000\nfsync = false  # trailing\n";
  }
  auto o = make();
  REQUIRE(parse(o, {"--config", path, "--fsync", "true"}).is_ok());
  CHECK(o.str("endpoint") == "tcp://127.0.0.1:7000");
  CHECK(*o.boolean("fsync"));
  {
    std::ofstream f(path);
    f << "endpoint = x\nbogus = 1\n";
  }
  auto o2 = make();
  auto st = parse(o2, {"--config", path});
  CHECK(st.code() == keep::Code::kInvalidArgument);
  CHECK(st.message().find(":2") != std::string::npos);
  CHECK(st.message().find("bogus") != std::string::npos);
  std::remove(path.c_str());
}

TEST_CASE("bad values and unknown flags are clear errors") {
  auto o = make();
  CHECK(parse(o, {"--nope", "1"}).code() == keep::Code::kInvalidArgument);
  auto o2 = make();
  REQUIRE(parse(o2, {"--tau", "abc", "--arena", "12XB"}).is_ok());
  CHECK(o2.number("tau").status().code() == keep::Code::kInvalidArgument);
  CHECK(o2.bytes("arena").status().message().find("12XB") != std::string::npos);
  auto o4 = make();
  auto missing = parse(o4, {"--tau", "--endpoint", "x"});
  CHECK(missing.code() == keep::Code::kInvalidArgument);
  CHECK(missing.message() == "option --tau needs a value");
  auto o3 = make();
  REQUIRE(parse(o3, {"--help"}).is_ok());
  CHECK(o3.help_requested());
  std::string h = o3.help_text();
  CHECK(h.find("--endpoint") != std::string::npos);
  CHECK(h.find("default: 64MiB") != std::string::npos);
}
