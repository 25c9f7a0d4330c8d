// A real PostgreSQL server for tests (Debian's postgresql): initdb in a temp dir, the server on a
// free loopback port, run as the postgres user when the test runs as root (PostgreSQL refuses
// root); killed with the object. Tests skip where pg_bin() is empty.
//
// A synchronous pair: PgServer primary(PgServer::kSyncPrimary) waits at every commit until the
// standby named kStandbyName flushed it; PgServer standby(PgServer::StandbyOf{&primary}) is
// that standby (pg_basebackup -R, streaming on loopback); SyncPgPair starts both and waits until
// the standby streams. standby.promote() is the manual failover an operator (or patroni) does once
// the primary is gone; multi_host_conninfo() lists both servers, so libpq reaches whichever takes
// writes.
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
  // The standby's name (its cluster_name, which its WAL receiver reports to the primary).
  static constexpr const char* kStandbyName = "keep_standby";
  // A primary whose commits return once kStandbyName has flushed them (it waits for that
  // standby: start one before the first write).
  static inline const std::vector<std::string> kSyncPrimary = {
      std::string("synchronous_standby_names=") + kStandbyName, "synchronous_commit=on"};
  // A standby of `primary`: its data directory is pg_basebackup'd from it.
  struct StandbyOf {
    const PgServer* primary;
  };

  TempDir dir{"pg"};
  int port = free_port();
  pid_t pid = -1;
  std::vector<std::string> as_user;   // setpriv prefix when root
  std::vector<std::string> settings;  // name=value, each passed as -c at every start

  // A fresh database (initdb), started with `settings`.
  explicit PgServer(std::vector<std::string> s = {}) : settings(std::move(s)) {
    own_dir();
    auto argv = as_user;
    argv.insert(argv.end(), {pg_bin() + "/initdb", "-D", data().string(), "--auth=trust", "-U",
                             "postgres", "--no-sync"});
    auto r = run_command(argv, 120s);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    start();
  }
  // A streaming-replication standby of a running primary, started: pg_basebackup -R writes
  // standby.signal and the primary's conninfo; cluster_name makes it kStandbyName.
  explicit PgServer(StandbyOf of) {
    own_dir();
    settings = {std::string("cluster_name=") + kStandbyName};
    of.primary->wait_accepting();
    auto argv = as_user;
    argv.insert(argv.end(), {pg_bin() + "/pg_basebackup", "-D", data().string(), "-h", "127.0.0.1",
                             "-p", std::to_string(of.primary->port), "-U", "postgres", "-R", "-X",
                             "stream", "-c", "fast", "--no-sync"});
    auto r = run_command(argv, 120s);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    start();
  }
  PgServer(const PgServer&) = delete;
  PgServer& operator=(const PgServer&) = delete;

  fs::path data() const { return dir.path() / "data"; }
  void start() {
    auto argv = as_user;
    argv.insert(argv.end(),
                {pg_bin() + "/postgres", "-D", data().string(), "-p", std::to_string(port), "-k",
                 dir.path().string(), "-c", "listen_addresses=127.0.0.1"});
    for (const auto& s : settings) argv.insert(argv.end(), {"-c", s});
    pid = spawn(argv, (dir.path() / "pg.out").string(), (dir.path() / "pg.err").string());
  }
  // The manual failover of a standby (what an operator or patroni does once the primary is
  // gone): pg_ctl promote, waiting until it takes writes. SELECT pg_promote() does the same.
  void promote() {
    auto argv = as_user;
    argv.insert(argv.end(),
                {pg_bin() + "/pg_ctl", "promote", "-w", "-t", "30", "-D", data().string()});
    auto r = run_command(argv, 60s);
    REQUIRE_MESSAGE(r.exit_code == 0, r.out << r.err);
  }
  // One value (the first column of the first row) of `query`, through psql; "" on an error.
  std::string query(const std::string& q) const {
    auto r = run_command({pg_bin() + "/psql", "-h", "127.0.0.1", "-p", std::to_string(port), "-U",
                          "postgres", "-d", "postgres", "-Atc", q},
                         30s);
    std::string out = r.exit_code == 0 ? r.out : "";
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
    return out;
  }
  // Until the server accepts connections (it starts in the background).
  void wait_accepting() const {
    for (int i = 0; i < 300; ++i) {
      if (query("SELECT 1") == "1") return;
      std::this_thread::sleep_for(100ms);
    }
    FAIL("postgresql did not start: " << read_text(dir.path() / "pg.err"));
  }
  // Until this primary's standby kStandbyName streams synchronously.
  void wait_sync_standby() const {
    for (int i = 0; i < 300; ++i) {
      if (query(
              std::string("SELECT sync_state FROM pg_stat_replication WHERE application_name = '") +
              kStandbyName + "'") == "sync") {
        return;
      }
      std::this_thread::sleep_for(100ms);
    }
    FAIL("no synchronous standby streams from port " << port);
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
  void own_dir() {
    if (::geteuid() == 0) {
      const passwd* pw = ::getpwnam("postgres");
      REQUIRE(pw != nullptr);
      REQUIRE(::chown(dir.path().c_str(), pw->pw_uid, pw->pw_gid) == 0);
      // setpriv execs (runuser would fork): the postmaster stays our child, reaped on kill.
      as_user = {"/usr/bin/setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"};
    }
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

// libpq's multi-host conninfo of a primary and its standby: a connection (and a reset of a broken
// one) tries both in order and keeps the one that takes writes, so after a promotion it reaches
// the new primary.
inline std::string multi_host_conninfo(const PgServer& a, const PgServer& b) {
  return "host=127.0.0.1,127.0.0.1 port=" + std::to_string(a.port) + "," + std::to_string(b.port) +
         " user=postgres dbname=postgres connect_timeout=5 target_session_attrs=read-write";
}

// A primary and its synchronous standby, streaming once constructed (every commit on the primary
// returns once the standby flushed it); conninfo() lists both (multi_host_conninfo).
struct SyncPgPair {
  PgServer primary{PgServer::kSyncPrimary};
  PgServer standby{PgServer::StandbyOf{&primary}};

  SyncPgPair() { primary.wait_sync_standby(); }
  std::string conninfo() const { return multi_host_conninfo(primary, standby); }
};

}  // namespace keep::itest
