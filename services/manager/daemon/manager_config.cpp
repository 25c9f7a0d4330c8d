#include "services/manager/daemon/manager_config.h"

namespace keep::manager {

void declare_manager_options(Options* o) {
  o->add("endpoint", "tcp://127.0.0.1:7601",
         "ZeroMQ ROUTER endpoint(s) for agents, keepctl and workers; comma-separated; tcp:// or "
         "ipc://");
  o->add("metrics-listen", "127.0.0.1:9464", "host:port serving GET /metrics; 'off' disables it");
  o->add("data-dir", "keep-data", "directory of the write-ahead log and the snapshots");
  o->add("fsync", "true", "fdatasync the WAL before acknowledging a write (one per batch)");
  o->add("wal-segment-bytes", "64MiB", "WAL file size before rotating to a new file");
  o->add("snapshot-every", "200000",
         "WAL records between snapshots (0: snapshot only at shutdown)");
  o->add("encoder", "models/all-MiniLM-L6-v2", "sentence-transformers BERT model directory");
  o->add("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf",
         "the planner model (a GGUF file or a HF directory, as keep-worker is given): its "
         "tokenizer counts tokens per segment, and its geometry, RoPE and tokenizer make the KV "
         "region's fingerprint; its weights are not read");
  o->add("tau", "0.45", "cosine threshold for a segment to join a group (all-MiniLM-L6-v2 scale)");
  o->add("group-token-budget", "512", "most tokens a group may hold");
  o->add("static-after-steps", "10", "t: a group unchanged for t steps turns static");
  o->add("max-text-bytes", "4096", "longest memory or query text accepted");
  o->add("embed-batch", "32", "segments embedded per background encoder call");
  o->add("retrieve-threads", "2",
         "threads that answer retrieves needing an embedding (the query, pending segments), off "
         "the request loop");
  o->add("max-waiting-retrieves", "1024",
         "retrieves waiting for a retrieve thread, from all clients, before more are refused "
         "(resource_exhausted, retry later); 0: no limit");
  o->add("max-waiting-retrieves-per-client", "64",
         "retrieves of one client connection waiting for a retrieve thread before its next are "
         "refused (resource_exhausted, retry later); the threads serve clients in turn; 0: no "
         "limit");
  o->add("max-pending-embeddings", "1000000",
         "segments waiting for an embedding before writes and updates are refused "
         "(resource_exhausted, retry later); 0: no limit");
  o->add("request-window", "128",
         "per agent, the request ids of its last N mutations are kept with their answers, so "
         "that a client resending one after a lost answer gets that answer instead of a second "
         "apply (about 48 bytes each); 0: none kept");
  o->add("shm-name", "keep-kv", "POSIX shm object of the KV region (/dev/shm/<name>)");
  o->add("shm-bytes", "1GiB", "KV arena size");
  o->add("shm-block-bytes", "64KiB",
         "KV arena block size (an entry is a contiguous run of blocks)");
  o->add("shm-max-entries", "65536", "directory entries of the KV region");
  o->add("shm-mode", "0600", "permissions of the shm object (octal)");
  o->add("kv-dtype", "bf16", "KV dtype in the region: bf16 or f32 (keep-worker reads both)");
  o->add("lease-ms", "30000", "lease of a worker's KV reservation");
  o->add("max-message-bytes", "1MiB",
         "largest request accepted (checked before decoding); also the most text in one "
         "listMemories page");
  o->add("max-queued-reply-bytes-per-client", "16MiB",
         "answers queued for a client connection that does not read them, beyond those ZeroMQ "
         "holds (--zmq-send-hwm); answers beyond are dropped and its requests refused until it "
         "reads");
  o->add("zmq-send-hwm", "64",
         "answers ZeroMQ itself holds per client connection (ZMQ_SNDHWM); the rest wait in the "
         "byte-bounded queue; at least the window of pipelining clients, or their answers "
         "trickle");
  o->add("max-batch", "1024", "requests handled per batch (one fsync covers a batch)");
  o->add("etcd", "",
         "cluster mode: etcd client URLs, comma-separated (http://host:2379,...); empty: one node "
         "serving every agent");
  o->add("node-id", "", "cluster mode: this node's name (empty: host-pid)");
  o->add("advertise", "",
         "cluster mode: the endpoint other nodes name in `moved` answers (empty: the first bound "
         "--endpoint)");
  o->add("advertise-worker", "",
         "cluster mode: the endpoint of this node's keep-worker as planners reach it; registered "
         "in etcd and named in `moved` answers, so that another node's worker sends a planner "
         "here (empty: a worker asked about this node's agents answers moved without a target)");
  o->add("shards", "64",
         "cluster mode: agents are hashed into this many shards (same on every node)");
  o->add("etcd-lease-s", "10",
         "cluster mode: this node's lease; its shards go to others that long after it stops "
         "renewing");
  o->add("pg-compact-after", "1000",
         "cluster mode with --pg: once an agent has more than N log entries after its last "
         "checkpoint, its owner writes a checkpoint of its state to PostgreSQL and deletes the "
         "entries it covers (log compaction); 0: never");
  o->add("pg", "",
         "cluster mode: libpq conninfo of the PostgreSQL database holding every agent's memory "
         "log, the system of record (\"host=db port=5432 dbname=keep user=keep\"): a mutation is "
         "answered after its commit there, a node taking a shard over replays the log, the local "
         "WAL and snapshots become a cache; needs --etcd; empty: the local WAL is the record");
  o->add("log-level", "info", "debug, info, warn, error or off");
}

Result<ManagerConfig> read_manager_config(const Options& o) {
  ManagerConfig c;
  c.endpoints = o.list("endpoint");
  if (c.endpoints.empty()) return Status(Code::kInvalidArgument, "--endpoint: no endpoint given");
  c.metrics_listen = o.str("metrics-listen") == "off" ? "" : o.str("metrics-listen");
  c.data_dir = o.str("data-dir");
  if (c.data_dir.empty()) return Status(Code::kInvalidArgument, "--data-dir: empty");
  KEEP_ASSIGN_OR_RETURN(c.fsync, o.boolean("fsync"));
  KEEP_ASSIGN_OR_RETURN(c.wal_segment_bytes, o.bytes("wal-segment-bytes"));
  KEEP_ASSIGN_OR_RETURN(c.snapshot_every, o.uint64("snapshot-every"));
  c.encoder_dir = o.str("encoder");
  c.model_path = o.str("model");
  if (c.model_path.empty()) return Status(Code::kInvalidArgument, "--model: empty");

  KEEP_ASSIGN_OR_RETURN(double tau, o.number("tau"));
  if (tau < -1.0 || tau > 1.0) return Status(Code::kInvalidArgument, "--tau: must be in [-1, 1]");
  c.store.tau = static_cast<float>(tau);
  KEEP_ASSIGN_OR_RETURN(uint64_t budget, o.uint64("group-token-budget"));
  if (budget == 0 || budget > UINT32_MAX) {
    return Status(Code::kInvalidArgument, "--group-token-budget: must be in 1..2^32-1");
  }
  c.store.group_token_budget = static_cast<uint32_t>(budget);
  KEEP_ASSIGN_OR_RETURN(c.store.static_after_steps, o.uint64("static-after-steps"));
  if (c.store.static_after_steps == 0) {
    return Status(Code::kInvalidArgument, "--static-after-steps: must be >= 1");
  }
  KEEP_ASSIGN_OR_RETURN(uint64_t max_text, o.bytes("max-text-bytes"));
  if (max_text == 0) return Status(Code::kInvalidArgument, "--max-text-bytes: must be >= 1");
  c.store.max_text_bytes = max_text;
  KEEP_ASSIGN_OR_RETURN(uint64_t eb, o.uint64("embed-batch"));
  if (eb == 0 || eb > 4096) return Status(Code::kInvalidArgument, "--embed-batch: must be 1..4096");
  c.embed_batch = eb;
  KEEP_ASSIGN_OR_RETURN(uint64_t rt, o.uint64("retrieve-threads"));
  if (rt == 0 || rt > 64)
    return Status(Code::kInvalidArgument, "--retrieve-threads: must be 1..64");
  c.retrieve_threads = static_cast<int>(rt);
  KEEP_ASSIGN_OR_RETURN(c.max_waiting_retrieves, o.uint64("max-waiting-retrieves"));
  KEEP_ASSIGN_OR_RETURN(c.max_waiting_retrieves_per_client,
                        o.uint64("max-waiting-retrieves-per-client"));
  KEEP_ASSIGN_OR_RETURN(c.max_queued_reply_bytes_per_client,
                        o.bytes("max-queued-reply-bytes-per-client"));
  KEEP_ASSIGN_OR_RETURN(uint64_t hwm, o.uint64("zmq-send-hwm"));
  if (hwm == 0 || hwm > 1000000) {
    return Status(Code::kInvalidArgument, "--zmq-send-hwm: must be 1..1000000");
  }
  c.zmq_send_hwm = static_cast<int>(hwm);
  KEEP_ASSIGN_OR_RETURN(uint64_t pending, o.uint64("max-pending-embeddings"));
  c.store.max_pending_embeddings = pending;
  KEEP_ASSIGN_OR_RETURN(uint64_t window, o.uint64("request-window"));
  if (window > 65536) return Status(Code::kInvalidArgument, "--request-window: must be 0..65536");
  c.store.request_window = window;

  c.etcd = o.list("etcd");
  c.node_id = o.str("node-id");
  c.advertise = o.str("advertise");
  c.advertise_worker = o.str("advertise-worker");
  if (c.advertise_worker.find(' ') != std::string::npos) {
    return Status(Code::kInvalidArgument, "--advertise-worker: an endpoint holds no space");
  }
  KEEP_ASSIGN_OR_RETURN(uint64_t shards, o.uint64("shards"));
  if (shards == 0 || shards > 65536)
    return Status(Code::kInvalidArgument, "--shards: must be 1..65536");
  c.shards = static_cast<uint32_t>(shards);
  KEEP_ASSIGN_OR_RETURN(uint64_t lease_s, o.uint64("etcd-lease-s"));
  if (lease_s < 2 || lease_s > 3600) {
    return Status(Code::kInvalidArgument, "--etcd-lease-s: must be 2..3600");
  }
  c.etcd_lease_s = static_cast<int64_t>(lease_s);
  c.pg = o.str("pg");
  KEEP_ASSIGN_OR_RETURN(c.pg_compact_after, o.uint64("pg-compact-after"));
  if (!c.pg.empty() && c.etcd.empty()) {
    return Status(Code::kInvalidArgument, "--pg: needs --etcd (cluster mode)");
  }

  c.shm_name = o.str("shm-name");
  KEEP_ASSIGN_OR_RETURN(c.shm_bytes, o.bytes("shm-bytes"));
  KEEP_ASSIGN_OR_RETURN(c.shm_block_bytes, o.bytes("shm-block-bytes"));
  if (c.shm_block_bytes == 0 || c.shm_bytes < c.shm_block_bytes) {
    return Status(Code::kInvalidArgument, "--shm-bytes must hold at least one --shm-block-bytes");
  }
  KEEP_ASSIGN_OR_RETURN(uint64_t entries, o.uint64("shm-max-entries"));
  if (entries == 0 || entries > UINT32_MAX) {
    return Status(Code::kInvalidArgument, "--shm-max-entries: must be >= 1");
  }
  c.shm_max_entries = static_cast<uint32_t>(entries);
  {
    const std::string& m = o.str("shm-mode");
    char* end = nullptr;
    unsigned long mode = std::strtoul(m.c_str(), &end, 8);
    if (m.empty() || *end != '\0' || mode > 0777) {
      return Status(Code::kInvalidArgument, "--shm-mode: not an octal mode: '" + m + "'");
    }
    c.shm_mode = static_cast<uint32_t>(mode);
  }

  auto dtype = kv::parse_region_dtype(o.str("kv-dtype"));
  if (!dtype.is_ok()) {
    return Status(Code::kInvalidArgument, "--kv-dtype: " + dtype.status().message());
  }
  c.kv_dtype = *dtype;

  KEEP_ASSIGN_OR_RETURN(uint64_t lease, o.uint64("lease-ms"));
  if (lease == 0) return Status(Code::kInvalidArgument, "--lease-ms: must be >= 1");
  c.lease = std::chrono::milliseconds(lease);
  KEEP_ASSIGN_OR_RETURN(c.max_message_bytes, o.bytes("max-message-bytes"));
  if (c.max_message_bytes < 1024) {
    return Status(Code::kInvalidArgument, "--max-message-bytes: must be >= 1KiB");
  }
  // Every answer then stays near the size of the largest request: a listing page is the one
  // answer that grows with the data.
  c.store.max_list_bytes = c.max_message_bytes;
  KEEP_ASSIGN_OR_RETURN(uint64_t mb, o.uint64("max-batch"));
  if (mb == 0) return Status(Code::kInvalidArgument, "--max-batch: must be >= 1");
  c.max_batch = mb;
  c.log_level = o.str("log-level");
  return c;
}

}  // namespace keep::manager
