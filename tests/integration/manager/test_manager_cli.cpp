// keep-manager's command line: --help lists every option with its default and exits 0; a bad
// command line or a missing model gives ONE line on stderr and a non-zero exit. keepctl's --etcd
// and --shards likewise (their routing: test_manager_cluster).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "tests/integration/manager/manager_process.h"

namespace {

namespace it = keep::itest;
using namespace std::chrono_literals;

}  // namespace

TEST_CASE("keep-manager --help prints every option with its default") {
  auto r = it::run_command({it::bin_path("keep-manager"), "--help"});
  CHECK(r.exit_code == 0);
  CHECK(r.err.empty());
  const auto lines = it::lines_of(r.out);
  // Each option is a "  --name" line followed by its help and a "default: ..." line (--help itself
  // takes no value).
  std::vector<std::string> options;
  size_t defaults = 0;
  std::string pending;
  for (const auto& l : lines) {
    if (l.rfind("  --help", 0) == 0) continue;  // a flag without a value
    if (l.rfind("  --", 0) == 0) {
      CHECK_MESSAGE(pending.empty(), "option " << pending << " has no default line");
      pending = l.substr(2);
      options.push_back(pending);
    } else if (l.find("default:") != std::string::npos && !pending.empty()) {
      ++defaults;
      pending.clear();
    }
  }
  CHECK_MESSAGE(pending.empty(), "option " << pending << " has no default line");
  CHECK(defaults == options.size());
  for (const char* name : {"--config",
                           "--endpoint",
                           "--metrics-listen",
                           "--data-dir",
                           "--fsync",
                           "--wal-segment-bytes",
                           "--snapshot-every",
                           "--encoder",
                           "--model",
                           "--tau",
                           "--group-token-budget",
                           "--static-after-steps",
                           "--max-text-bytes",
                           "--embed-batch",
                           "--max-pending-embeddings",
                           "--retrieve-threads",
                           "--shm-name",
                           "--shm-bytes",
                           "--shm-block-bytes",
                           "--shm-max-entries",
                           "--shm-mode",
                           "--kv-dtype",
                           "--lease-ms",
                           "--max-message-bytes",
                           "--max-batch",
                           "--log-level"}) {
    bool found = false;
    for (const auto& o : options) found = found || o == name;
    CHECK_MESSAGE(found, name << " missing from --help:\n" << r.out);
  }
}

TEST_CASE("a bad keep-manager command line: one line on stderr, non-zero exit") {
  it::TempDir tmp("cli");
  const std::string shm = it::unique_name("cli");
  struct Case {
    std::vector<std::string> args;
    std::string mention;  // the line must name this
  };
  const std::vector<Case> cases = {
      {{"--no-such-flag", "1"}, "--no-such-flag"},
      {{"--tau", "abc"}, "--tau"},
      {{"--tau", "2"}, "--tau"},
      {{"--shm-bytes", "12 parsecs"}, "--shm-bytes"},
      {{"--fsync=maybe"}, "--fsync"},
      {{"--max-message-bytes", "12"}, "--max-message-bytes"},
      {{"--retrieve-threads", "0"}, "--retrieve-threads"},
      {{"--retrieve-threads", "many"}, "--retrieve-threads"},
      {{"--log-level", "loud"}, "--log-level"},
      {{"stray-argument"}, "stray-argument"},
      {{"--encoder", (tmp.path() / "no-such-encoder").string()}, "no-such-encoder"},
      {{"--model", (tmp.path() / "no-such-model.gguf").string()}, "no-such-model"},
      {{"--model", it::encoder_dir()}, "--model"},  // a directory, but not a planner model
      {{"--kv-dtype", "f8"}, "--kv-dtype"},
      {{"--metrics-listen", "no-port-here"}, "--metrics-listen"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {it::bin_path("keep-manager"),
                                     "--data-dir",
                                     (tmp.path() / "data").string(),
                                     "--endpoint",
                                     "tcp://127.0.0.1:0",
                                     "--metrics-listen",
                                     "off",
                                     "--shm-name",
                                     shm,
                                     "--shm-bytes",
                                     "16MiB",
                                     "--log-level",
                                     "warn",
                                     "--encoder",
                                     it::encoder_dir(),
                                     "--model",
                                     it::model_path()};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    std::string shown;
    for (const auto& a : c.args) shown += a + " ";
    INFO("keep-manager ... " << shown);
    auto r = it::run_command(argv, 30000ms);
    CHECK(r.exit_code > 0);
    const auto lines = it::lines_of(r.err);
    CHECK_MESSAGE(lines.size() == 1, r.err);
    CHECK_MESSAGE(r.err.rfind("keep-manager: ", 0) == 0, r.err);
    CHECK_MESSAGE(r.err.find(c.mention) != std::string::npos, r.err);
    CHECK(r.out.empty());
  }
  ::shm_unlink(shm.c_str());
}

TEST_CASE("keepctl --etcd: bad input is one line on stderr and a non-zero exit") {
  const std::string unreachable = "http://127.0.0.1:" + std::to_string(it::free_port());
  struct Case {
    std::vector<std::string> args;
    int exit_code;        // 2: usage, 1: the call failed
    std::string mention;  // the line must name this
  };
  const std::vector<Case> cases = {
      {{"--etcd", "etcd-host:2379", "ping"}, 2, "'etcd-host:2379' is not an etcd client URL"},
      {{"--etcd", "http://127.0.0.1:2379,", "ping"}, 2, "'' is not an etcd client URL"},
      {{"--etcd", "ping"}, 2, "'ping' is not an etcd client URL"},
      {{"--etcd"}, 2, "--etcd needs a value"},
      {{"--shards", "8", "ping"}, 2, "--shards needs --etcd"},
      {{"--etcd", unreachable, "--shards", "0", "ping"}, 2, "--shards must be 1..65536"},
      {{"--etcd", unreachable, "--shards", "many", "ping"}, 2, "--shards must be"},
      {{"--etcd", unreachable, "worker-ping"}, 2, "worker-ping goes to --worker-endpoint"},
      {{"--etcd", unreachable, "--timeout-ms", "500", "write", "robot", "The cup."},
       1,
       "keepctl: unavailable: reading the cluster's nodes from etcd (" + unreachable + ")"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {it::bin_path("keepctl")};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    std::string shown;
    for (const auto& a : c.args) shown += a + " ";
    INFO("keepctl " << shown);
    auto r = it::run_command(argv, 30000ms);
    CHECK(r.exit_code == c.exit_code);
    const auto lines = it::lines_of(r.err);
    CHECK_MESSAGE(lines.size() == 1, r.err);
    CHECK_MESSAGE(r.err.rfind("keepctl: ", 0) == 0, r.err);
    CHECK_MESSAGE(r.err.find(c.mention) != std::string::npos, r.err);
    CHECK(r.out.empty());
  }
}
