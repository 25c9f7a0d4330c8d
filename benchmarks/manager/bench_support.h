// What the keep-manager benchmarks share: a real keep-manager child process (free ports, temp data
// dir, its own shm object, cleaned up on exit), a generator of varied household-memory texts, a
// pipelining DEALER agent, latency summaries, /proc CPU accounting and a /metrics scrape.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shared/client/manager_client.h"
#include "shared/common/options.h"
#include "shared/common/status.h"

namespace keep::bench {

using Clock = std::chrono::steady_clock;

// ---- the manager process --------------------------------------------------------------------

struct ManagerProcessOptions {
  std::string binary;                // path of keep-manager
  std::string models_dir;            // holds all-MiniLM-L6-v2/ and qwen2.5-tokenizer/
  std::string data_parent = "/tmp";  // the data dir is a fresh mkdtemp() under it
  bool fsync = true;
  std::string openblas_threads = "1";   // OPENBLAS_NUM_THREADS of the manager ("" = inherit)
  std::vector<std::string> extra_args;  // more keep-manager flags
  std::chrono::seconds ready_timeout{120};
  // Called with the (still empty) --data-dir before the manager starts: e.g. to place a snapshot.
  std::function<Status(const std::string& data_dir)> prepare;
};

// The keep-manager launch flags every manager benchmark takes: --fsync, --manager-bin,
// --models-dir, --data-parent, --manager-openblas-threads, --manager-args.
void add_manager_options(Options* o);
// Reads them back (after Options::parse); errors name the flag.
Result<ManagerProcessOptions> manager_options_from(const Options& o);

struct ThreadCpu {
  int tid = 0;
  std::string name;
  double seconds = 0;       // utime + stime
  double wait_seconds = 0;  // runnable but waiting for a CPU (schedstat)
};

class ManagerProcess {
 public:
  // Spawns keep-manager on free loopback ports, waits until it answers ping.
  static Result<std::unique_ptr<ManagerProcess>> start(const ManagerProcessOptions& options);
  ~ManagerProcess();  // SIGTERM (SIGKILL after 60 s), shm object and data dir removed
  ManagerProcess(const ManagerProcess&) = delete;
  ManagerProcess& operator=(const ManagerProcess&) = delete;

  const std::string& endpoint() const { return endpoint_; }
  pid_t pid() const { return pid_; }
  const std::string& data_dir() const { return data_dir_; }
  const std::string& log_path() const { return log_path_; }
  double cpu_seconds() const;                  // utime + stime of the whole process
  std::vector<ThreadCpu> thread_cpu() const;   // per thread (name from /proc/.../comm)
  Result<std::string> scrape_metrics() const;  // GET /metrics (Prometheus text)

 private:
  ManagerProcess() = default;
  pid_t pid_ = -1;
  std::string endpoint_;
  int metrics_port_ = 0;
  std::string data_dir_;
  std::string shm_name_;
  std::string log_path_;
};

// keep-manager's path: `flag` if set, else $KEEP_BIN_DIR/keep-manager, else the directory of
// this executable, else build/bin/keep-manager.
std::string find_manager_binary(const std::string& flag);

// Sum of the samples named exactly `name` (any labels) in Prometheus text; 0 if none.
double metric_sum(const std::string& text, const std::string& name);
// The sample `name` whose label set contains `label` (e.g. type="write"); 0 if none.
double metric_with_label(const std::string& text, const std::string& name,
                         const std::string& label);

// Sum of utime+stime of this process (all threads).
double self_cpu_seconds();

// ---- texts -----------------------------------------------------------------------------------

// Deterministic, varied household memories: object states and task records with different
// objects, rooms, places, ids and steps.
class TextGenerator {
 public:
  explicit TextGenerator(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  std::string next(client::SegmentKind* kind);
  std::string query();  // a planner-style instruction (fresh every call)

 private:
  uint64_t rnd();
  uint64_t state_;
  uint64_t counter_ = 0;
};

// ---- latency ---------------------------------------------------------------------------------

struct LatencySummary {
  size_t n = 0;
  double mean_us = 0, p50_us = 0, p90_us = 0, p99_us = 0, max_us = 0;
};
LatencySummary summarize(std::vector<double> us);  // sorts a copy

// ---- a pipelining agent ----------------------------------------------------------------------

// One agent's DEALER socket that keeps up to `window` writes outstanding, matched by requestId.
// Not thread-safe: one per thread.
class PipelinedWriter {
 public:
  // `context` may be shared by many writers (a zmq::context_t*, as void*).
  static Result<std::unique_ptr<PipelinedWriter>> connect(void* context,
                                                          const std::string& endpoint);
  ~PipelinedWriter();

  // Sends one writeMemory; returns its request id.
  Result<uint64_t> send_write(const std::string& agent, const std::string& text,
                              client::SegmentKind kind);
  // Waits up to `timeout` for one answer; sets *request_id and the call's status.
  // kTimeout when nothing came.
  Status receive(std::chrono::milliseconds timeout, uint64_t* request_id, Status* call_status);

 private:
  PipelinedWriter() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A zmq context to share among PipelinedWriters (owned; freed by the deleter).
std::shared_ptr<void> make_zmq_context(int io_threads);

// Comma-separated unsigned integers ("1,4,16,64").
Result<std::vector<uint64_t>> parse_list(const std::string& s, const std::string& flag);

}  // namespace keep::bench
