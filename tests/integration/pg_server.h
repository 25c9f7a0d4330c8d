// A real PostgreSQL server for tests (Debian's postgresql): initdb in a temp dir, the server on a
// free loopback port, run as the postgres user when the test runs as root (PostgreSQL refuses
// root); killed with the object. Tests skip where pg_bin() is empty.
#pragma once

#include <doctest/doctest.h>
#include <pwd.h>

#include <csignal>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shared/cluster/pg_log.h"
#include "tests/integration/manager/manager_process.h"

namespace keep::itest {

// The directory of initdb and postgres, newest major version first; "" when none is installed.
inline std::string pg_bin() {
  for (const char* v : {"17", "16", "15", "14", "13"}) {
    const std::string d = std::string("/usr/lib/postgresql/") + v + "/bin";
    if (fs::exists(d + "/initdb")) return d;
  }
  return "";
}

// One PostgreSQL server in a temp dir; killed with the object.
struct PgServer {
  TempDir dir{"pg"};
  int port = free_port();
  pid_t pid = -1;
  std::vector<std::string> as_user;  // setpriv prefix when root

  PgServer() {
    const std::string bin = pg_bin();
    if (::geteuid() == 0) {
      const passwd* pw = ::getpwnam("postgres");
      REQUIRE(pw != nullptr);
      REQUIRE(::chown(dir.path().c_str(), pw->pw_uid, pw->pw_gid) == 0);
      // setpriv execs (runuser would fork): the postmaster stays our child, reaped on kill.
      as_user = {"/usr/bin/setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"};
    }
    auto argv = as_user;
    argv.insert(argv.end(), {bin + "/initdb", "-D", (dir.path() / "data").string(), "--auth=trust",
                             "-U", "postgres", "--no-sync"});
    auto r = run_command(argv, 120s);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    start();
  }
  PgServer(const PgServer&) = delete;
  PgServer& operator=(const PgServer&) = delete;

  void start() {
    auto argv = as_user;
    argv.insert(argv.end(), {pg_bin() + "/postgres", "-D", (dir.path() / "data").string(), "-p",
                             std::to_string(port), "-k", dir.path().string(), "-c",
                             "listen_addresses=127.0.0.1"});
    pid = spawn(argv, (dir.path() / "pg.out").string(), (dir.path() / "pg.err").string());
  }
  void kill9() {
    ::kill(pid, SIGKILL);
    wait_for(pid, 10s);
    pid = -1;
    // Its backends notice the postmaster's death and exit; the next start then takes over the
    // stale pid file and runs crash recovery.
    std::this_thread::sleep_for(1s);
  }
  ~PgServer() {
    if (pid > 0) kill9();
  }
  std::string conninfo() const {
    return "host=127.0.0.1 port=" + std::to_string(port) +
           " user=postgres dbname=postgres connect_timeout=5";
  }
  // A connection once the server accepts them (it starts in the background).
  std::unique_ptr<cluster::PgLog> log() {
    for (int i = 0; i < 100; ++i) {
      auto l = cluster::PgLog::connect(conninfo());
      if (l.is_ok()) return std::move(l).value();
      std::this_thread::sleep_for(100ms);
    }
    FAIL("postgresql did not start: " << read_text(dir.path() / "pg.err"));
    return nullptr;
  }
};

}  // namespace keep::itest
