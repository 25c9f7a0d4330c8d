// ManagerConfig: every setting of keep-manager, read from a config file and flags (shared Options).
// `keep-manager --help` prints each one with its default; deploy/manager.conf lists them too.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "services/manager/store/memory_store.h"
#include "shared/common/options.h"
#include "shared/common/status.h"
#include "shared/kvregion/model_fingerprint.h"

namespace keep::manager {

struct ManagerConfig {
  std::vector<std::string> endpoints;  // ZeroMQ ROUTER endpoints
  std::string metrics_listen;          // host:port of GET /metrics; empty: off
  std::string data_dir;                // WAL and snapshots
  bool fsync = true;                   // fdatasync before acknowledging (group commit)
  uint64_t wal_segment_bytes = 0;
  uint64_t snapshot_every = 0;  // WAL records between snapshots; 0: only at shutdown
  std::string encoder_dir;      // sentence-transformers BERT directory
  std::string model_path;       // the planner model: GGUF file or HF directory
  StoreOptions store;
  size_t embed_batch = 32;
  int retrieve_threads = 2;                      // ServiceOptions::retrieve_threads
  size_t max_waiting_retrieves = 1024;           // ServiceOptions, 0: no bound
  size_t max_waiting_retrieves_per_client = 64;  // ServiceOptions (per peer), 0: no bound
  // wire::ServerOptions::max_queued_reply_bytes_per_peer
  uint64_t max_queued_reply_bytes_per_client = uint64_t{16} << 20;
  int zmq_send_hwm = 64;  // wire::ServerOptions::send_high_water_mark
  // The shared KV region.
  std::string shm_name;
  uint64_t shm_bytes = 0;  // arena bytes
  uint64_t shm_block_bytes = 0;
  uint32_t shm_max_entries = 0;
  uint32_t shm_mode = 0600;
  kv::KvDType kv_dtype = kv::KvDType::kBF16;  // the region's fingerprint comes from the model
  std::chrono::milliseconds lease{30000};
  uint64_t max_message_bytes = 0;
  size_t max_batch = 256;
  std::string log_level;
  // Cluster mode (issue 31): placement on etcd; empty etcd: one node, every agent.
  std::vector<std::string> etcd;
  std::string node_id;           // empty: host-pid
  std::string advertise;         // empty: the first bound endpoint
  std::string advertise_worker;  // this node's keep-worker for planners; empty: not named
  uint32_t shards = 64;
  int64_t etcd_lease_s = 10;
  // Cluster mode's log of record (libpq conninfo); empty: the local WAL is the record.
  std::string pg;
  uint64_t pg_compact_after = 1000;  // log entries after an agent's checkpoint; 0: no compaction
};

// Declares every option with its default.
void declare_manager_options(Options* opts);
// Reads the declared options into a config; errors name the option.
Result<ManagerConfig> read_manager_config(const Options& opts);

}  // namespace keep::manager
