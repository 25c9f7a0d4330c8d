// PgLog against a real PostgreSQL server (issue 31, point 2): initdb in a temp dir, the server on
// a free loopback port (as the postgres user when the test runs as root: PostgreSQL refuses root),
// then the log's order, epoch fencing, duplicate refusal and durability across kill -9.
#include <doctest/doctest.h>
#include <pwd.h>

#include <filesystem>
#include <thread>

#include "shared/cluster/pg_log.h"
#include "tests/integration/manager/manager_process.h"

using namespace keep;
using namespace keep::cluster;
using namespace std::chrono_literals;
namespace it = keep::itest;
namespace fs = std::filesystem;

namespace {

std::string pg_bin() {
  for (const char* v : {"17", "16", "15", "14", "13"}) {
    const std::string d = std::string("/usr/lib/postgresql/") + v + "/bin";
    if (fs::exists(d + "/initdb")) return d;
  }
  return "";
}

// One PostgreSQL server in a temp dir; killed with the object.
struct PgServer {
  it::TempDir dir{"pg"};
  int port = it::free_port();
  pid_t pid = -1;
  std::vector<std::string> as_user;  // runuser prefix when root

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
    auto r = it::run_command(argv, 120s);
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    start();
  }
  void start() {
    auto argv = as_user;
    argv.insert(argv.end(), {pg_bin() + "/postgres", "-D", (dir.path() / "data").string(), "-p",
                             std::to_string(port), "-k", dir.path().string(), "-c",
                             "listen_addresses=127.0.0.1"});
    pid = it::spawn(argv, (dir.path() / "pg.out").string(), (dir.path() / "pg.err").string());
  }
  void kill9() {
    ::kill(pid, SIGKILL);
    it::wait_for(pid, 10s);
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
           " user=postgres dbname=postgres "
           "connect_timeout=5";
  }
  std::unique_ptr<PgLog> log() {
    for (int i = 0; i < 100; ++i) {
      auto l = PgLog::connect(conninfo());
      if (l.is_ok()) return std::move(l).value();
      std::this_thread::sleep_for(100ms);
    }
    FAIL("postgresql did not start: " << it::read_text(dir.path() / "pg.err"));
    return nullptr;
  }
};

LogRecord rec(const std::string& agent, uint64_t seq, const std::string& bytes) {
  LogRecord r;
  r.agent = agent;
  r.seq = seq;
  r.record = bytes;
  return r;
}

}  // namespace

TEST_CASE("the memory log: order, fencing by epoch, duplicates, durability across kill -9" *
          doctest::skip(pg_bin().empty())) {
  PgServer pg;
  auto log = pg.log();
  const std::string bin("\0\x01\xff record", 10);  // any bytes
  REQUIRE(log->append(3, 1, {rec("robot", 1, bin), rec("robot", 2, "b"), rec("other", 1, "o")})
              .is_ok());
  auto rows = log->read("robot");
  REQUIRE(rows.is_ok());
  REQUIRE(rows->size() == 2);
  CHECK((*rows)[0].record == bin);
  CHECK((*rows)[0].epoch == 1);
  CHECK((*rows)[1].seq == 2);
  CHECK(log->read("robot", 1)->size() == 1);
  CHECK(*log->last_seq("robot") == 2);
  CHECK(*log->last_seq("nobody") == 0);

  // A new owner at epoch 2 fences the shard: the old owner's batch is refused whole.
  REQUIRE(log->fence(3, 2).is_ok());
  Status stale = log->append(3, 1, {rec("robot", 3, "late")});
  CHECK(stale.code() == Code::kStale);
  CHECK(*log->last_seq("robot") == 2);
  CHECK(log->fence(3, 1).code() == Code::kStale);  // fences never go down
  REQUIRE(log->append(3, 2, {rec("robot", 3, "c")}).is_ok());
  CHECK(log->append(4, 1, {rec("elsewhere", 1, "x")}).is_ok());  // another shard: its own fence

  // A taken (agent, seq) refuses the batch, nothing of it written.
  CHECK(log->append(3, 2, {rec("robot", 4, "d"), rec("robot", 3, "again")}).code() ==
        Code::kAlreadyExists);
  CHECK(*log->last_seq("robot") == 3);

  // What was acknowledged survives the server's kill -9.
  pg.kill9();
  CHECK(log->append(3, 2, {rec("robot", 4, "d")}).code() == Code::kUnavailable);
  pg.start();
  auto again = pg.log();
  rows = again->read("robot");
  REQUIRE(rows.is_ok());
  REQUIRE(rows->size() == 3);
  CHECK((*rows)[2].record == "c");
  CHECK((*rows)[2].epoch == 2);
  CHECK(again->append(3, 1, {rec("robot", 4, "late")}).code() == Code::kStale);
}
