// The KV region across real, separate processes: the test process is the owner (keep-manager's
// role) and fork+execs tests/integration/kvregion_probe.cpp as readers and writers (workers).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/interprocess/shared_memory_object.hpp>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shared/common/log.h"
#include "shared/kvregion/kv_region.h"
#include "tests/integration/kvregion_test_util.h"

extern char** environ;

using namespace std::chrono_literals;
using keep::Code;
using keep::kv::EntryDescriptor;
using keep::kv::EntryKey;
using keep::kv::KvRegion;
using keep::kv::KvRegionView;
using keep::kv::ModelFingerprint;
using keep::kv::RegionOptions;
namespace testutil = keep::kv::testutil;

namespace {

std::string probe_path() {
  const char* dir = std::getenv("KEEP_BIN_DIR");
  return std::string(dir != nullptr ? dir : KEEP_BINARY_DIR "/bin") + "/kvregion_probe";
}

// A child process running kvregion_probe with its stdout on a pipe. SIGKILLed and reaped on
// destruction if still running, so a failing test leaves no process behind.
class Child {
 public:
  explicit Child(const std::vector<std::string>& args) {
    int fds[2];
    REQUIRE(pipe2(fds, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
    std::vector<std::string> argv_s = {probe_path()};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    out_fd_ = fds[0];
    REQUIRE_MESSAGE(rc == 0, "posix_spawn " << argv_s[0] << ": " << std::strerror(rc));
  }
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      int st = 0;
      waitpid(pid_, &st, 0);
    }
    if (out_fd_ >= 0) close(out_fd_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }

  // The next line of output, or nullopt on EOF / timeout.
  std::optional<std::string> read_line(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{out_fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char tmp[4096];
      const ssize_t n = read(out_fd_, tmp, sizeof(tmp));
      if (n <= 0) return std::nullopt;
      buf_.append(tmp, static_cast<size_t>(n));
    }
  }

  bool exited() {
    if (reaped_) return true;
    int st = 0;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      reaped_ = true;
      status_ = st;
    }
    return reaped_;
  }

  // Waits for exit (SIGKILL after `timeout`); the raw wait status.
  int wait(std::chrono::milliseconds timeout = 30s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!exited()) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status_, 0);
        reaped_ = true;
        break;
      }
      std::this_thread::sleep_for(2ms);
    }
    return status_;
  }

  // wait() and return the exit code (-1 when killed by a signal).
  int exit_code(std::chrono::milliseconds timeout = 30s) {
    const int st = wait(timeout);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string buf_;
};

// A pid-based unique shm name; removed whatever happens.
struct ShmName {
  std::string name;
  ShmName() {
    static int counter = 0;
    name = "keep-test-kvp-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    boost::interprocess::shared_memory_object::remove(name.c_str());
  }
  ~ShmName() { boost::interprocess::shared_memory_object::remove(name.c_str()); }
};

RegionOptions options_for(const std::string& name) {
  RegionOptions o;
  o.name = name;
  o.fingerprint = testutil::smol_fingerprint();
  o.block_bytes = 64 * 1024;
  o.num_blocks = 64;
  o.max_entries = 16;
  return o;
}

EntryKey key_of(uint64_t id) {
  EntryKey k;
  k.agent_hash = keep::kv::fnv1a_64("agent-p");
  k.object_id = id;
  k.object_version = 1;
  return k;
}

std::vector<std::string> write_args(const std::string& name, const EntryDescriptor& d,
                                    uint64_t object, bool stall) {
  std::vector<std::string> a = {"write",
                                "--name",
                                name,
                                "--fp",
                                testutil::to_hex(testutil::smol_fingerprint()),
                                "--index",
                                std::to_string(d.index),
                                "--gen",
                                std::to_string(d.generation),
                                "--offset",
                                std::to_string(d.offset),
                                "--bytes",
                                std::to_string(d.bytes),
                                "--tokens",
                                std::to_string(d.tokens),
                                "--object",
                                std::to_string(object)};
  if (stall) a.push_back("--stall");
  return a;
}

struct ReadCounts {
  uint64_t validated = 0, invalid = 0, corrupt = 0, passes = 0;
};

std::optional<ReadCounts> parse_counts(const std::string& line) {
  ReadCounts c;
  unsigned long long v, i, k, p;
  if (std::sscanf(line.c_str(), "validated=%llu invalid=%llu corrupt=%llu passes=%llu", &v, &i, &k,
                  &p) != 4) {
    return std::nullopt;
  }
  c.validated = v;
  c.invalid = i;
  c.corrupt = k;
  c.passes = p;
  return c;
}

// The owner's side of the stress: reserve -> write the pattern -> commit, keeping a few entries
// live and releasing the oldest, so freed blocks are reused (and overwritten) at once while the
// reader copies them. Runs until `reader` exits. Returns the number of cycles.
uint64_t churn_until_exit(KvRegion& r, Child& reader) {
  std::mt19937_64 rng(12345);
  std::deque<EntryDescriptor> live;
  uint64_t cycles = 0;
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < give_up) {
    if ((cycles & 15) == 0 && reader.exited()) break;
    const uint32_t tokens = 1 + static_cast<uint32_t>(rng() % 30);
    auto d = r.reserve(key_of(cycles), tokens, /*owner_id=*/1, 10s);
    if (!d.is_ok()) {
      REQUIRE(d.status().code() == Code::kResourceExhausted);
      REQUIRE_FALSE(live.empty());
      REQUIRE(r.release(live.front().index, live.front().generation).is_ok());
      live.pop_front();
      continue;
    }
    auto span = r.entry_data(*d);
    REQUIRE(span.is_ok());
    testutil::fill_pattern(reinterpret_cast<unsigned char*>(span->data()), 0, span->size() / 8,
                           cycles, d->generation);
    REQUIRE(r.commit(d->index, d->generation).is_ok());
    live.push_back(*d);
    if (live.size() > 4) {
      REQUIRE(r.release(live.front().index, live.front().generation).is_ok());
      live.pop_front();
    }
    ++cycles;
  }
  return cycles;
}

}  // namespace

TEST_CASE("a reader process never accepts a torn or reused entry under a concurrent writer") {
  keep::log::set_level(keep::log::Level::kWarn);
  ShmName n;
  auto region = KvRegion::create(options_for(n.name));
  REQUIRE_MESSAGE(region.is_ok(), region.status().to_string());
  const std::string fp = testutil::to_hex(testutil::smol_fingerprint());

  Child reader({"read", "--name", n.name, "--fp", fp, "--duration-ms", "2500"});
  const uint64_t cycles = churn_until_exit(**region, reader);
  auto line = reader.read_line(5s);
  REQUIRE(line.has_value());
  MESSAGE("writer cycles=" << cycles << " reader: " << *line);
  auto counts = parse_counts(*line);
  REQUIRE(counts.has_value());
  CHECK(reader.exit_code() == 0);
  CHECK(counts->corrupt == 0);
  CHECK(counts->validated > 100);
  CHECK(cycles > 100);
  auto st = (*region)->stats();
  CHECK(st.commits >= cycles);
}

TEST_CASE("negative control: without read_validate the same reader does see torn entries") {
  // Shows the stress above can fail: the only difference is skipping read_validate.
  keep::log::set_level(keep::log::Level::kWarn);
  ShmName n;
  auto region = KvRegion::create(options_for(n.name));
  REQUIRE(region.is_ok());
  const std::string fp = testutil::to_hex(testutil::smol_fingerprint());
  Child reader({"read", "--name", n.name, "--fp", fp, "--duration-ms", "5000", "--no-validate"});
  const uint64_t cycles = churn_until_exit(**region, reader);
  auto line = reader.read_line(5s);
  REQUIRE(line.has_value());
  MESSAGE("writer cycles=" << cycles << " unvalidated reader: " << *line);
  auto counts = parse_counts(*line);
  REQUIRE(counts.has_value());
  CHECK(counts->corrupt > 0);
  CHECK(reader.exit_code() == 1);
}

TEST_CASE(
    "a writer SIGKILLed mid-write: its lease expires, reap frees the blocks, they are reused") {
  keep::log::set_level(keep::log::Level::kError);
  ShmName n;
  auto region = KvRegion::create(options_for(n.name));
  REQUIRE(region.is_ok());
  KvRegion& r = **region;
  auto view = KvRegionView::attach(n.name, testutil::smol_fingerprint());
  REQUIRE(view.is_ok());

  // The manager reserves on the worker's behalf and hands it the descriptor.
  constexpr auto kLease = 400ms;
  auto d = r.reserve(key_of(1), 20, /*owner_id=*/77, kLease);
  REQUIRE(d.is_ok());
  {
    Child writer(write_args(n.name, *d, 1, /*stall=*/true));
    auto line = writer.read_line(10s);
    REQUIRE(line.has_value());
    REQUIRE(*line == "half");
    REQUIRE(kill(writer.pid(), SIGKILL) == 0);
    const int st = writer.wait();
    CHECK(WIFSIGNALED(st));
    CHECK(WTERMSIG(st) == SIGKILL);
  }
  // The first half really was written by the dead process.
  auto span = r.entry_data(*d);
  REQUIRE(span.is_ok());
  CHECK(testutil::first_mismatch(reinterpret_cast<unsigned char*>(span->data()), 8, 1,
                                 d->generation) == -1);

  auto info = (*view)->entry_info(d->index);
  REQUIRE(info.is_ok());
  CHECK(info->owner_id == 77);
  CHECK(r.stats().entries_reserved == 1);
  if (keep::kv::monotonic_now_ns() < info->lease_expiry_ns) {
    CHECK(r.reap_expired() == 0);  // still leased: nothing to reap yet
  }
  while (keep::kv::monotonic_now_ns() < info->lease_expiry_ns) std::this_thread::sleep_for(5ms);
  CHECK(r.reap_expired() == 1);
  auto stats = r.stats();
  CHECK(stats.used_blocks == 0);
  CHECK(stats.entries_reserved == 0);
  CHECK(stats.reaped == 1);

  // The dead writer's descriptor can no longer be committed.
  CHECK(r.commit(d->index, d->generation).code() == Code::kStale);

  // A new reservation of the same size gets the same blocks.
  auto e = r.reserve(key_of(2), 20, /*owner_id=*/78, 10s);
  REQUIRE(e.is_ok());
  CHECK(e->offset == d->offset);
  CHECK((e->index != d->index || e->generation != d->generation));

  // A late writer holding the old descriptor is refused and writes nothing...
  {
    Child late(write_args(n.name, *d, 1, /*stall=*/false));
    auto line = late.read_line(10s);
    CHECK(late.exit_code() == 5);
    REQUIRE(line.has_value());
    CHECK(line->find("stale") != std::string::npos);
  }
  // ...while the new owner's writer process fills it and the commit makes it readable.
  {
    Child writer(write_args(n.name, *e, 2, /*stall=*/false));
    auto line = writer.read_line(10s);
    REQUIRE(line.has_value());
    CHECK(*line == "done");
    CHECK(writer.exit_code() == 0);
  }
  REQUIRE(r.commit(e->index, e->generation).is_ok());
  auto seq = (*view)->read_begin(e->index, e->generation);
  REQUIRE(seq.has_value());
  auto data = (*view)->entry_data(*e);
  REQUIRE(data.is_ok());
  CHECK(testutil::first_mismatch(reinterpret_cast<unsigned char*>(data->data()), e->bytes / 8, 2,
                                 e->generation) == -1);
  CHECK((*view)->read_validate(e->index, *seq));
}

TEST_CASE("a process with another model fingerprint is refused with a clear error") {
  keep::log::set_level(keep::log::Level::kWarn);
  ShmName n;
  auto region = KvRegion::create(options_for(n.name));
  REQUIRE(region.is_ok());
  {
    Child same(
        {"attach", "--name", n.name, "--fp", testutil::to_hex(testutil::smol_fingerprint())});
    auto line = same.read_line(10s);
    CHECK(same.exit_code() == 0);
    REQUIRE(line.has_value());
    CHECK(line->rfind("attached", 0) == 0);
  }
  ModelFingerprint other = testutil::smol_fingerprint();
  other.num_layers = 24;
  other.num_kv_heads = 4;
  other.set_model_name("Other-1B");
  Child child({"attach", "--name", n.name, "--fp", testutil::to_hex(other)});
  auto line = child.read_line(10s);
  CHECK(child.exit_code() == 3);
  REQUIRE(line.has_value());
  MESSAGE(*line);
  CHECK(line->find("version_mismatch") != std::string::npos);
  CHECK(line->find("model fingerprint mismatch (layers, kv_heads, model_name)") !=
        std::string::npos);
  CHECK(line->find("region has model='SmolLM2-135M-Instruct' layers=30 kv_heads=3 head_dim=64") !=
        std::string::npos);
  CHECK(line->find("this process has model='Other-1B' layers=24 kv_heads=4") != std::string::npos);
}

TEST_CASE("the region is created with mode 0600 by default and removed by its owner") {
  keep::log::set_level(keep::log::Level::kWarn);
  ShmName n;
  const std::string path = "/dev/shm/" + n.name;
  {
    const mode_t old = umask(0);  // the mode must not depend on the umask
    auto region = KvRegion::create(options_for(n.name));
    umask(old);
    REQUIRE(region.is_ok());
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(fd >= 0);
    struct stat st {};
    REQUIRE(fstat(fd, &st) == 0);
    close(fd);
    CHECK((st.st_mode & 0777) == 0600);
    CHECK(st.st_uid == geteuid());
    CHECK(static_cast<uint64_t>(st.st_size) == (*region)->size());
  }
  struct stat st {};
  CHECK(stat(path.c_str(), &st) != 0);
}
