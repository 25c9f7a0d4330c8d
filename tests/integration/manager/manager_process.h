// Test helpers for end-to-end tests of the real keep-manager process: a temp directory, a child
// process runner with captured output, and ManagerProcess (spawn keep-manager, wait until it
// serves, read the endpoint and metrics address it logged, kill -9 / SIGTERM it, clean up).
//
// Children get PR_SET_PDEATHSIG(SIGKILL), so a test process that dies (CTest timeout, crash)
// takes its daemons with it; destructors kill and reap them and unlink their shm objects.
#pragma once

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace keep::itest {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

// Where keep-manager and keepctl live: $KEEP_BIN_DIR (set by keep_add_test), else <build>/bin.
inline std::string bin_path(const std::string& name) {
  const char* dir = std::getenv("KEEP_BIN_DIR");
  std::string d = (dir != nullptr && *dir != '\0') ? dir : std::string(KEEP_BINARY_DIR) + "/bin";
  return d + "/" + name;
}

inline std::string encoder_dir() {
  return std::string(KEEP_SOURCE_DIR) + "/models/all-MiniLM-L6-v2";
}
// The planner model the manager reads its tokenizer and KV fingerprint from.
inline std::string model_path() {
  return std::string(KEEP_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

// A unique name per process and call, for temp dirs and shm objects.
// A loopback TCP port free right now (for servers that cannot bind port 0 and report it).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

inline std::string unique_name(const std::string& tag) {
  static std::atomic<int> counter{0};
  return "keep-itest-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

inline std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class TempDir {
 public:
  explicit TempDir(const std::string& tag) : path_(fs::temp_directory_path() / unique_name(tag)) {
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

// fork + exec with stdout/stderr redirected to files; the child dies with its parent.
inline pid_t spawn(const std::vector<std::string>& argv, const std::string& out_file,
                   const std::string& err_file) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int out = ::open(out_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = ::open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(out >= 0);
  REQUIRE(err >= 0);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(out);
  ::close(err);
  REQUIRE(pid > 0);
  return pid;
}

// Waits up to `timeout` for the child; the raw wait status, or nullopt if it still runs.
inline std::optional<int> wait_for(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0) return std::nullopt;
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(10ms);
  }
}

struct RunResult {
  int exit_code = -1;  // -1: killed by a signal or timed out
  std::string out;
  std::string err;
};

// Runs a command to completion (killed after `timeout`) and returns its exit code and output.
inline RunResult run_command(const std::vector<std::string>& argv,
                             std::chrono::milliseconds timeout = 30000ms) {
  TempDir tmp("run");
  const std::string out = (tmp.path() / "out").string();
  const std::string err = (tmp.path() / "err").string();
  const pid_t pid = spawn(argv, out, err);
  auto st = wait_for(pid, timeout);
  RunResult r;
  if (!st.has_value()) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  } else if (WIFEXITED(*st)) {
    r.exit_code = WEXITSTATUS(*st);
  }
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

// Non-empty lines of `text`.
inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string l; std::getline(ss, l);) {
    if (!l.empty()) out.push_back(l);
  }
  return out;
}

// A daemon child process: its logs, whether it lives, kill -9, SIGTERM, and the endpoint and
// metrics address it logged in its "<tag>: serving on E[,...]; metrics on M; ..." line.
class DaemonProcess {
 public:
  DaemonProcess() = default;
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  ~DaemonProcess() { kill9(); }

  // Polls the log for the "serving on" line; false if the process exited or time ran out.
  bool wait_ready(std::chrono::milliseconds timeout) {
    const std::string mark = tag_ + ": serving on ";
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      const std::string log = err();
      const size_t at = log.find(mark);
      if (at != std::string::npos && log.find('\n', at) != std::string::npos) {
        const std::string line = log.substr(at, log.find('\n', at) - at);
        const size_t ep = mark.size();  // the first endpoint
        endpoint_ = line.substr(ep, line.find_first_of(",;", ep) - ep);
        const size_t m = line.find("metrics on ") + 11;
        metrics_ = line.substr(m, line.find(';', m) - m);
        return true;
      }
      if (!alive()) return false;
      std::this_thread::sleep_for(20ms);
    }
    return false;
  }

  bool alive() {
    if (exited_) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      status_ = status;
      return false;
    }
    return true;
  }
  void kill9() {
    if (pid_ <= 0 || !alive()) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    exited_ = true;
    status_ = status;
  }
  // `sig` (SIGTERM by default) and wait: the exit code (-1 if it had to be killed).
  int terminate(std::chrono::milliseconds timeout = 20000ms, int sig = SIGTERM) {
    if (alive()) ::kill(pid_, sig);
    return wait_exit(timeout);
  }
  // Waits for the process to exit by itself: the exit code, -1 when killed by a signal or after
  // the timeout (then it is killed).
  int wait_exit(std::chrono::milliseconds timeout) {
    if (!exited_) {
      auto st = wait_for(pid_, timeout);
      if (!st.has_value()) {
        kill9();
        return -1;
      }
      exited_ = true;
      status_ = *st;
    }
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }

  pid_t pid() const { return pid_; }
  const std::string& endpoint() const { return endpoint_; }  // e.g. tcp://127.0.0.1:<port>
  const std::string& metrics() const { return metrics_; }    // 127.0.0.1:<port>
  std::string err() const { return read_text(err_file_); }
  std::string out() const { return read_text(out_file_); }

 protected:
  // Starts `argv` with its output in <log_dir>/<stem>.stdout and .stderr.
  void launch(const std::vector<std::string>& argv, const fs::path& log_dir,
              const std::string& stem, std::string tag) {
    tag_ = std::move(tag);
    out_file_ = (log_dir / (stem + ".stdout")).string();
    err_file_ = (log_dir / (stem + ".stderr")).string();
    pid_ = spawn(argv, out_file_, err_file_);
  }

 private:
  std::string tag_;
  std::string out_file_, err_file_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
  std::string endpoint_, metrics_;
};

// One keep-manager process on a data dir. Binds tcp://127.0.0.1:0 and 127.0.0.1:0 for /metrics
// and reads the bound addresses from its "serving on ..." log line, so no port can be raced for.
class ManagerProcess : public DaemonProcess {
 public:
  struct Options {
    std::string data_dir;
    std::string shm_name;
    std::vector<std::string> extra;  // more flags, e.g. {"--snapshot-every", "64"}
    bool wait_ready = true;
    bool unlink_shm = true;  // false: the name may be another live manager's; leave it
  };

  explicit ManagerProcess(Options o) : opt_(std::move(o)) {
    static std::atomic<int> run{0};
    std::vector<std::string> argv = {bin_path("keep-manager"),
                                     "--data-dir",
                                     opt_.data_dir,
                                     "--endpoint",
                                     "tcp://127.0.0.1:0",
                                     "--metrics-listen",
                                     "127.0.0.1:0",
                                     "--shm-name",
                                     opt_.shm_name,
                                     "--shm-bytes",
                                     "16MiB",
                                     "--encoder",
                                     encoder_dir(),
                                     "--model",
                                     model_path()};
    argv.insert(argv.end(), opt_.extra.begin(), opt_.extra.end());
    launch(argv, fs::path(opt_.data_dir).parent_path(),
           fs::path(opt_.data_dir).filename().string() + "." + std::to_string(run++), "manager");
    if (opt_.wait_ready)
      REQUIRE_MESSAGE(wait_ready(30000ms), "keep-manager did not start:\n" << err());
  }
  ~ManagerProcess() {
    kill9();
    if (opt_.unlink_shm) ::shm_unlink(opt_.shm_name.c_str());
  }

 private:
  Options opt_;
};

// GET http://<host:port><path> over a plain socket: the body of a 200 answer, or nullopt.
inline std::optional<std::string> http_get(const std::string& host_port, const std::string& path) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(host_port.substr(colon + 1))));
  if (::inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return std::nullopt;
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string answer;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req =
        "GET " + path + " HTTP/1.1\r\nHost: " + host_port + "\r\nConnection: close\r\n\r\n";
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) answer.append(buf, n);
    }
  }
  ::close(fd);
  const size_t body = answer.find("\r\n\r\n");
  if (answer.rfind("HTTP/1.1 200", 0) != 0 || body == std::string::npos) return std::nullopt;
  return answer.substr(body + 4);
}

// The value of an unlabelled series in a /metrics text (nullopt when absent).
inline std::optional<double> metric_value(const std::string& text, const std::string& name) {
  std::stringstream ss(text);
  for (std::string l; std::getline(ss, l);) {
    if (l.rfind(name + " ", 0) == 0) return std::stod(l.substr(name.size() + 1));
  }
  return std::nullopt;
}

}  // namespace keep::itest
