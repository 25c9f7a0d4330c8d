// WorkerProcess: one real keep-worker process for end-to-end tests (spawned like ManagerProcess:
// it dies with the test, binds tcp://127.0.0.1:0 and 127.0.0.1:0 for /metrics and reads the bound
// addresses from its "serving on ..." log line).
#pragma once

#include <string>
#include <vector>

#include "tests/integration/manager/manager_process.h"

namespace keep::itest {

class WorkerProcess {
 public:
  struct Options {
    std::string log_dir;
    std::string manager;   // keep-manager's endpoint
    std::string shm_name;  // its region
    std::vector<std::string> extra;
    bool wait_ready = true;
  };

  explicit WorkerProcess(Options o) : opt_(std::move(o)) {
    static std::atomic<int> run{0};
    const std::string stem = "worker." + std::to_string(run++);
    err_file_ = (fs::path(opt_.log_dir) / (stem + ".stderr")).string();
    out_file_ = (fs::path(opt_.log_dir) / (stem + ".stdout")).string();
    std::vector<std::string> argv = {bin_path("keep-worker"),
                                     "--endpoint",
                                     "tcp://127.0.0.1:0",
                                     "--metrics-listen",
                                     "127.0.0.1:0",
                                     "--manager",
                                     opt_.manager,
                                     "--shm-name",
                                     opt_.shm_name,
                                     "--model",
                                     model_path(),
                                     "--device",
                                     "cpu",
                                     "--context",
                                     "1024"};
    argv.insert(argv.end(), opt_.extra.begin(), opt_.extra.end());
    pid_ = spawn(argv, out_file_, err_file_);
    if (opt_.wait_ready) {
      REQUIRE_MESSAGE(wait_ready(60000ms), "keep-worker did not start:\n" << err());
    }
  }
  ~WorkerProcess() { kill9(); }
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  bool wait_ready(std::chrono::milliseconds timeout) {
    const std::string mark = "worker: serving on ";
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      const std::string log = err();
      const size_t at = log.find(mark);
      if (at != std::string::npos && log.find('\n', at) != std::string::npos) {
        const std::string line = log.substr(at, log.find('\n', at) - at);
        const size_t ep = mark.size();
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
    if (!alive()) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status_, 0);
    exited_ = true;
  }
  // SIGTERM and wait: the exit code (-1 if it had to be killed).
  int terminate(std::chrono::milliseconds timeout = 30000ms) {
    if (alive()) ::kill(pid_, SIGTERM);
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

  const std::string& endpoint() const { return endpoint_; }
  const std::string& metrics() const { return metrics_; }
  std::string err() const { return read_text(err_file_); }

 private:
  Options opt_;
  std::string out_file_, err_file_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
  std::string endpoint_, metrics_;
};

}  // namespace keep::itest
