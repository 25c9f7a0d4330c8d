// WorkerProcess: one real keep-worker process for end-to-end tests (a DaemonProcess, like
// ManagerProcess: it dies with the test, binds tcp://127.0.0.1:0 and 127.0.0.1:0 for /metrics and
// reads the bound addresses from its "serving on ..." log line).
#pragma once

#include <string>
#include <vector>

#include "tests/integration/manager/manager_process.h"

namespace keep::itest {

class WorkerProcess : public DaemonProcess {
 public:
  struct Options {
    std::string log_dir;
    std::string manager;   // keep-manager's endpoint
    std::string shm_name;  // its region
    std::vector<std::string> extra;
    bool wait_ready = true;
  };

  explicit WorkerProcess(Options o) {
    static std::atomic<int> run{0};
    std::vector<std::string> argv = {bin_path("keep-worker"),
                                     "--endpoint",
                                     "tcp://127.0.0.1:0",
                                     "--metrics-listen",
                                     "127.0.0.1:0",
                                     "--manager",
                                     o.manager,
                                     "--shm-name",
                                     o.shm_name,
                                     "--model",
                                     model_path(),
                                     "--device",
                                     "cpu",
                                     "--context",
                                     "1024"};
    argv.insert(argv.end(), o.extra.begin(), o.extra.end());
    launch(argv, o.log_dir, "worker." + std::to_string(run++), "worker");
    if (o.wait_ready) {
      REQUIRE_MESSAGE(wait_ready(60000ms), "keep-worker did not start:\n" << err());
    }
  }
};

}  // namespace keep::itest
