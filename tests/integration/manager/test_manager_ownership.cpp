// What one keep-manager owns, against operators' mistakes, with real processes: its data directory
// (a second daemon on it is refused and nothing acknowledged is lost), its KV region (a second
// daemon on the same --shm-name leaves the live region alone; a removed region is reported), its
// signals (HUP stops it cleanly like TERM), and the privacy of what it writes (0700/0600).
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <string>
#include <vector>

#include "shared/client/manager_client.h"
#include "tests/integration/manager/manager_process.h"

namespace {

using namespace std::chrono_literals;
namespace kc = keep::client;
namespace it = keep::itest;

std::unique_ptr<kc::ManagerClient> client_of(const it::ManagerProcess& m) {
  kc::ClientOptions o;
  o.endpoint = m.endpoint();
  o.timeout = 10s;
  auto c = kc::ManagerClient::connect(o);
  REQUIRE_MESSAGE(c.is_ok(), c.status().to_string());
  return std::move(c).value();
}

// Writes `n` memories for `agent`, each acknowledged; returns their ids.
std::vector<uint64_t> write_n(kc::ManagerClient& c, const std::string& agent, int n) {
  std::vector<uint64_t> ids;
  for (int i = 0; i < n; ++i) {
    kc::WriteArgs w;
    w.agent = agent;
    w.text = "the cup number " + std::to_string(i) + " is on the shelf";
    auto r = c.write(w);
    REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
    ids.push_back(r->id);
  }
  return ids;
}

std::vector<uint64_t> listed_ids(kc::ManagerClient& c, const std::string& agent) {
  std::vector<uint64_t> ids;
  uint64_t after = 0;
  for (;;) {
    auto page = c.list_memories(agent, after, 100);
    REQUIRE_MESSAGE(page.is_ok(), page.status().to_string());
    for (const auto& m : page->memories) ids.push_back(m.id);
    if (!page->more || page->memories.empty()) break;
    after = page->memories.back().id;
  }
  return ids;
}

ino_t inode_of(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

unsigned mode_of(const it::fs::path& p) {
  struct stat st {};
  REQUIRE(::stat(p.c_str(), &st) == 0);
  return st.st_mode & 0777;
}

// The process's stderr once it has exited: its last non-empty line.
std::string last_line(const std::string& text) {
  auto lines = it::lines_of(text);
  return lines.empty() ? std::string() : lines.back();
}

}  // namespace

TEST_CASE("a second keep-manager on a live data directory is refused and nothing is lost") {
  it::TempDir tmp("owndir");
  const std::string data = (tmp.path() / "data").string();
  const std::string shm = it::unique_name("own-a");
  const std::string shm_b = it::unique_name("own-b");
  std::vector<uint64_t> acked;
  {
    it::ManagerProcess a({data, shm, {}});
    auto c = client_of(a);
    acked = write_n(*c, "robot", 20);

    it::ManagerProcess b({data, shm_b, {}, /*wait_ready=*/false});
    CHECK(b.wait_exit(30s) == 1);
    const std::string why = last_line(b.err());
    CHECK_MESSAGE(why.find("data directory '" + data + "' is in use by pid " +
                           std::to_string(a.pid())) != std::string::npos,
                  why);
    CHECK_FALSE(it::fs::exists("/dev/shm/" + shm_b));  // refused before touching anything

    // The first goes on acknowledging, and every acknowledged write survives a crash.
    auto more = write_n(*c, "robot", 20);
    acked.insert(acked.end(), more.begin(), more.end());
    a.kill9();
  }
  it::ManagerProcess again({data, shm, {}});
  auto c = client_of(again);
  CHECK(listed_ids(*c, "robot") == acked);
}

TEST_CASE("a second keep-manager on the same --shm-name leaves the live region alone") {
  it::TempDir tmp("ownshm");
  const std::string shm = it::unique_name("own-shm");
  const std::string path = "/dev/shm/" + shm;
  it::ManagerProcess a({(tmp.path() / "a").string(), shm, {}});
  const ino_t before = inode_of(path);
  REQUIRE(before != 0);
  {
    it::ManagerProcess b({(tmp.path() / "b").string(), shm, {}, false, /*unlink_shm=*/false});
    CHECK(b.wait_exit(30s) == 1);
    const std::string why = last_line(b.err());
    CHECK_MESSAGE(why.find(path + " is owned by a running process (pid " +
                           std::to_string(a.pid())) != std::string::npos,
                  why);
  }
  CHECK(inode_of(path) == before);  // neither replaced nor removed
  auto c = client_of(a);
  write_n(*c, "robot", 1);
  auto text = it::http_get(a.metrics(), "/metrics");
  REQUIRE(text.has_value());
  CHECK(it::metric_value(*text, "keep_manager_kv_region_linked") == 1.0);

  // A region left behind by a manager killed -9 is taken over by the next one.
  a.kill9();
  REQUIRE(inode_of(path) == before);
  it::ManagerProcess next({(tmp.path() / "a").string(), shm, {}});
  CHECK(inode_of(path) != 0);
  CHECK(inode_of(path) != before);
}

TEST_CASE("a removed region is noticed and shown in /metrics and stats") {
  it::TempDir tmp("ownrm");
  const std::string shm = it::unique_name("own-rm");
  it::ManagerProcess a({(tmp.path() / "data").string(), shm, {}});
  REQUIRE(::shm_unlink(("/" + shm).c_str()) == 0);  // an operator's rm /dev/shm/<name>
  std::optional<double> linked;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    auto text = it::http_get(a.metrics(), "/metrics");
    REQUIRE(text.has_value());
    linked = it::metric_value(*text, "keep_manager_kv_region_linked");
    if (linked == 0.0) break;
    std::this_thread::sleep_for(100ms);
  }
  CHECK(linked == 0.0);
  CHECK(a.err().find("was removed or replaced by another process") != std::string::npos);
  auto c = client_of(a);
  auto st = c->stats();
  REQUIRE(st.is_ok());
  bool found = false;
  for (const auto& [name, value] : st->counters) {
    if (name == "kv_region_linked") {
      found = true;
      CHECK(value == 0);
    }
  }
  CHECK(found);
}

TEST_CASE("SIGHUP stops the daemon cleanly: snapshot, region removed, exit 0") {
  it::TempDir tmp("ownhup");
  const std::string data = (tmp.path() / "data").string();
  const std::string shm = it::unique_name("own-hup");
  std::vector<uint64_t> acked;
  {
    it::ManagerProcess a({data, shm, {}});
    auto c = client_of(a);
    acked = write_n(*c, "robot", 5);
    CHECK(a.terminate(20s, SIGHUP) == 0);
    CHECK(a.err().find("final snapshot failed") == std::string::npos);
  }
  CHECK_FALSE(it::fs::exists("/dev/shm/" + shm));
  bool snapshot = false;
  for (const auto& e : it::fs::directory_iterator(it::fs::path(data) / "snapshots")) {
    snapshot = snapshot || e.is_regular_file();
  }
  CHECK(snapshot);
  it::ManagerProcess again({data, shm, {}});
  auto c = client_of(again);
  CHECK(listed_ids(*c, "robot") == acked);
}

TEST_CASE("memories on disk are private: the data directory 0700, its files 0600") {
  it::TempDir tmp("ownmode");
  const it::fs::path data = tmp.path() / "data";
  const std::string shm = it::unique_name("own-mode");
  const mode_t old = ::umask(0022);  // the usual umask, which made them 0755/0644
  {
    it::ManagerProcess a({data.string(), shm, {}});
    auto c = client_of(a);
    write_n(*c, "robot", 3);
    CHECK(a.terminate() == 0);  // writes the final snapshot
  }
  ::umask(old);
  CHECK(mode_of(data) == 0700);
  CHECK(mode_of(data / "LOCK") == 0600);
  int files = 0;
  for (const char* sub : {"wal", "snapshots"}) {
    CHECK(mode_of(data / sub) == 0700);
    for (const auto& e : it::fs::directory_iterator(data / sub)) {
      CHECK_MESSAGE(mode_of(e.path()) == 0600, e.path());
      ++files;
    }
  }
  CHECK(files >= 2);
}

TEST_CASE("a failed WAL (writes refused) shows as keep_manager_degraded in /metrics") {
  it::TempDir tmp("owndeg");
  const it::fs::path data = tmp.path() / "data";
  const std::string shm = it::unique_name("own-deg");
  // Small WAL files, so that a write soon needs a new one in the directory we take away.
  it::ManagerProcess a({data.string(), shm, {"--wal-segment-bytes", "4KiB"}});
  auto text = it::http_get(a.metrics(), "/metrics");
  REQUIRE(text.has_value());
  CHECK(it::metric_value(*text, "keep_manager_degraded") == 0.0);
  it::fs::remove_all(data / "wal");
  { std::ofstream(data / "wal") << "not a directory"; }
  auto c = client_of(a);
  keep::Status failed;
  for (int i = 0; i < 200 && failed.is_ok(); ++i) {
    kc::WriteArgs w;
    w.agent = "robot";
    w.text = std::string(200, 'a' + i % 26);
    auto r = c->write(w);
    if (!r.is_ok()) failed = r.status();
  }
  REQUIRE_FALSE(failed.is_ok());
  CHECK(failed.code() == keep::Code::kIoError);
  text = it::http_get(a.metrics(), "/metrics");
  REQUIRE(text.has_value());
  CHECK(it::metric_value(*text, "keep_manager_degraded") == 1.0);
}
