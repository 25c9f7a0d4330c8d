// A real Redis Cluster for tests: three redis-server masters in cluster mode on loopback (free
// ports, a temp dir each, no persistence, no replicas), made one cluster by `redis-cli --cluster
// create`, killed with the object; with a password, every master requires it (requirepass).
// Debian's redis-server / redis-tools; tests skip without them.
#pragma once

#include <doctest/doctest.h>

#include <csignal>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/manager/manager_process.h"

namespace keep::itest {

inline const char* const kRedisServer = "/usr/bin/redis-server";
inline const char* const kRedisCli = "/usr/bin/redis-cli";

inline bool have_redis() {
  return ::access(kRedisServer, X_OK) == 0 && ::access(kRedisCli, X_OK) == 0;
}

// A loopback port P in 20000..45535 with P and P + 10000 (the cluster bus) both free right now.
inline int free_redis_port() {
  static std::atomic<int> next{20000 + static_cast<int>(::getpid() % 2000) * 12};
  auto is_free = [](int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    return ok;
  };
  for (int i = 0; i < 1000; ++i) {
    const int p = 20000 + (next++ - 20000) % 25535;
    if (is_free(p) && is_free(p + 10000)) return p;
  }
  FAIL("no free port pair for redis-server");
  return 0;
}

struct RedisClusterProcs {
  TempDir dir{"redis"};
  std::vector<int> ports;
  std::vector<pid_t> pids;
  std::string password;  // requirepass (and masterauth) of every master; empty: none

  explicit RedisClusterProcs(std::string pass = {}) : password(std::move(pass)) {
    for (int i = 0; i < 3; ++i) {
      const int port = free_redis_port();  // its bus is port + 10000: at most 55535
      ports.push_back(port);
      const std::string d = (dir.path() / ("m" + std::to_string(i))).string();
      fs::create_directories(d);
      std::vector<std::string> argv = {kRedisServer,
                                       "--port",
                                       std::to_string(port),
                                       "--bind",
                                       "127.0.0.1",
                                       "--dir",
                                       d,
                                       "--cluster-enabled",
                                       "yes",
                                       "--cluster-config-file",
                                       d + "/nodes.conf",
                                       "--save",
                                       "",
                                       "--appendonly",
                                       "no",
                                       "--daemonize",
                                       "no",
                                       "--cluster-node-timeout",
                                       "2000"};
      if (!password.empty()) {
        argv.insert(argv.end(), {"--requirepass", password, "--masterauth", password});
      }
      pids.push_back(spawn(argv, d + ".out", d + ".err"));
    }
    for (int p : ports) {
      bool up = false;
      for (int i = 0; i < 200 && !up; ++i) {
        up = cli(p, {"PING"}).out.find("PONG") != std::string::npos;
        if (!up) std::this_thread::sleep_for(25ms);
      }
      REQUIRE_MESSAGE(up, "redis-server on " << p << " did not start");
    }
    std::vector<std::string> create = {kRedisCli};
    if (!password.empty()) create.insert(create.end(), {"-a", password, "--no-auth-warning"});
    create.insert(create.end(), {"--cluster", "create"});
    for (int p : ports) create.push_back(address(p));
    create.insert(create.end(), {"--cluster-replicas", "0", "--cluster-yes"});
    const auto r = run_command(create, 30000ms);
    REQUIRE_MESSAGE(r.exit_code == 0, "redis-cli --cluster create failed:\n" << r.out << r.err);
    for (int p : ports) {
      bool ok = false;
      for (int i = 0; i < 400 && !ok; ++i) {
        ok = cli(p, {"CLUSTER", "INFO"}).out.find("cluster_state:ok") != std::string::npos;
        if (!ok) std::this_thread::sleep_for(25ms);
      }
      REQUIRE_MESSAGE(ok, "redis cluster not ok on " << p);
    }
  }
  ~RedisClusterProcs() {
    for (size_t i = 0; i < pids.size(); ++i) kill(static_cast<int>(i));
  }
  static std::string address(int port) { return "127.0.0.1:" + std::to_string(port); }
  std::vector<std::string> seeds() const {
    std::vector<std::string> s;
    for (int p : ports) s.push_back(address(p));
    return s;
  }
  // "redis://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
  std::string url() const {
    std::string u = "redis://";
    for (size_t i = 0; i < ports.size(); ++i) u += (i ? "," : "") + address(ports[i]);
    return u;
  }
  // redis-cli on `port`, with the password when the masters have one.
  RunResult cli(int port, std::vector<std::string> args) const {
    std::vector<std::string> argv = {kRedisCli, "-h", "127.0.0.1", "-p", std::to_string(port)};
    if (!password.empty()) argv.insert(argv.end(), {"-a", password, "--no-auth-warning"});
    argv.insert(argv.end(), args.begin(), args.end());
    return run_command(argv, 10000ms);
  }
  std::string node_id(int i) const {
    auto r = cli(ports[static_cast<size_t>(i)], {"CLUSTER", "MYID"});
    std::string id = r.out;
    while (!id.empty() && (id.back() == '\n' || id.back() == '\r')) id.pop_back();
    return id;
  }
  void kill(int i) {
    pid_t& p = pids[static_cast<size_t>(i)];
    if (p <= 0) return;
    ::kill(p, SIGKILL);
    wait_for(p, 5s);
    p = -1;
  }
  void kill_all() {
    for (size_t i = 0; i < pids.size(); ++i) kill(static_cast<int>(i));
  }
};

}  // namespace keep::itest
