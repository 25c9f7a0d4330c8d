// WorkerConfig: every setting of keep-worker, read from a config file and flags (shared Options).
// `keep-worker --help` prints each one with its default; deploy/worker.conf lists them too.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "services/worker/server/plan_service.h"
#include "shared/common/options.h"
#include "shared/common/status.h"
#include "shared/kvregion/model_fingerprint.h"

namespace keep::worker {

struct WorkerConfig {
  std::vector<std::string> endpoints;  // ZeroMQ ROUTER endpoints for planners
  std::string manager;                 // keep-manager's endpoint
  std::chrono::milliseconds manager_timeout{20000};
  std::chrono::milliseconds manager_retry{30000};
  std::string metrics_listen;  // host:port of GET /metrics; empty: off
  std::string model_path;      // GGUF file or HF directory (the manager's --model)
  std::string device;          // auto, cpu or cuda
  int threads = 0;             // CPU threads (0: all cores)
  int32_t context = 4096;      // prompt + generated tokens of one request
  std::string shm_name;
  kv::KvDType kv_dtype = kv::KvDType::kBF16;
  PlanDefaults defaults;
  uint32_t max_k = 256;
  int32_t max_tokens = 512;
  size_t max_queue = 64;
  int32_t job_layers = 4;
  bool produce = true;
  bool ablate_position_correction = false;  // issue 30's ablations (never for serving)
  bool ablate_produce_prefix = false;
  uint64_t worker_id = 0;  // 0: derived from the host and pid
  std::chrono::milliseconds job_poll{100};
  uint64_t max_message_bytes = 0;
  std::string device_tier;              // the device KV tier's name; empty: none
  uint64_t device_tier_bytes = 0;       // > 0: own it with this much GPU memory; 0: attach
  uint64_t device_tier_slot_bytes = 0;  // its slot size (owner)
  // The shared KV tier (docs/cluster.md): Redis Cluster masters; empty: off.
  std::vector<std::string> kv_remote;
  std::chrono::milliseconds kv_remote_timeout{50};  // per connect and per command
  std::chrono::seconds kv_remote_ttl{86400};        // expiry of a published entry
  std::string kv_remote_user;                       // AUTH's ACL user; empty: requirepass
  std::string kv_remote_password;                   // AUTH's password; empty: no AUTH
  std::string log_level;
};

void declare_worker_options(Options* opts);
// Reads the declared options into a config; errors name the option.
Result<WorkerConfig> read_worker_config(const Options& opts);

}  // namespace keep::worker
