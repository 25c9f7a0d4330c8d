#include "services/worker/daemon/worker_config.h"

#include <fstream>

#include "shared/kvremote/redis_cluster.h"

namespace keep::worker {

void declare_worker_options(Options* o) {
  o->add("endpoint", "tcp://127.0.0.1:7602",
         "ZeroMQ ROUTER endpoint(s) for planners; comma-separated; tcp:// or ipc://");
  o->add("manager", "tcp://127.0.0.1:7601", "keep-manager's endpoint");
  o->add("manager-timeout-ms", "20000", "how long a call to keep-manager may take");
  o->add("manager-retry-ms", "30000",
         "how long a request's retrieve is retried while keep-manager does not answer (a "
         "restart), at most the request's own timeout; 0: not retried");
  o->add("metrics-listen", "127.0.0.1:9465", "host:port serving GET /metrics; 'off' disables it");
  o->add("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf",
         "the planner model: a GGUF file or a HF directory (the same as keep-manager's --model)");
  o->add("device", "auto", "cpu, cuda, or auto (cuda when built with CUDA and a GPU is usable)");
  o->add("threads", "0", "CPU threads for loading, attention and BLAS; 0 = all cores");
  o->add("context", "4096", "tokens of one request's prompt and generation at most");
  o->add("shm-name", "keep-kv", "POSIX shm object of the manager's KV region");
  o->add("kv-dtype", "bf16", "KV dtype the region was made with (keep-manager's --kv-dtype)");
  o->add("method", "keep",
         "default method: full, prefix, full_reuse, cacheblend, epic or keep (docs/recompute.md)");
  o->add("k", "16", "default number of memories retrieved per request");
  o->add("max-k", "256", "most memories one request may ask for");
  o->add("max-tokens", "48", "default number of new tokens at most");
  o->add("max-tokens-limit", "512", "most new tokens one request may ask for (below --context)");
  o->add("max-candidates", "64", "most candidates one scoring request may carry");
  o->add("keep-decay", "0.96", "keep: d, the recompute schedule's decay per layer");
  o->add("keep-query-rows", "32", "keep: q, the last query rows that score hop 0");
  o->add("keep-max-hops", "8", "keep: the importance hop cap");
  o->add("cacheblend-ratio", "0.15", "cacheblend: the share of memory tokens recomputed");
  o->add("epic-tokens", "16", "epic: leading tokens of each segment recomputed");
  o->add("max-queue", "64",
         "completions waiting for the engine before more are refused (resource_exhausted)");
  o->add("produce", "true", "take the manager's KV jobs (compute memories' KV into the region)");
  o->add("ablate-position-correction", "false",
         "quality ablation only: load K rotated to where it was produced, not to the prompt's "
         "positions (KV stored after RoPE, uncorrected)");
  o->add("ablate-produce-prefix", "false",
         "quality ablation only: compute entries without the system prefix in front");
  o->add("job-layers", "4",
         "layers of a KV job run between two looks at the request queue (a request waits for at "
         "most that)");
  o->add("job-poll-ms", "100", "how often an idle worker asks the manager for KV jobs");
  o->add("worker-id", "0", "this worker's id in the manager's leases; 0: from host and pid");
  o->add("max-message-bytes", "1MiB", "largest request accepted (checked before decoding)");
  o->add("device-tier", "",
         "a device KV tier (hot entries in GPU memory, shared with the other workers on the GPU "
         "by CUDA IPC): its shm name; empty: none");
  o->add("device-tier-bytes", "0",
         "with --device-tier: GPU memory this worker allocates and owns for it; 0: attach to the "
         "tier another worker on this GPU owns");
  o->add("device-tier-slot-bytes", "32MiB",
         "with --device-tier-bytes: the largest entry the tier holds (one per slot)");
  o->add("kv-remote", "",
         "the shared KV tier: Redis Cluster masters, redis://host:port,host:port,...; static "
         "groups' and example plans' KV is looked up there before computing and published "
         "after; empty: off");
  o->add("kv-remote-timeout-ms", "50",
         "the shared KV tier: the longest a connect or a command may take (then the entry is "
         "computed, and that Redis node is left alone for 2 s)");
  o->add("kv-remote-ttl-s", "86400", "the shared KV tier: expiry of a published entry");
  o->add("kv-remote-password-file", "",
         "the shared KV tier: a file whose first line is the Redis password (requirepass, or the "
         "ACL user's), sent as AUTH on each connection; a file, so that it is not in the process "
         "list; empty: no AUTH");
  o->add("kv-remote-user", "",
         "the shared KV tier: the Redis ACL user of --kv-remote-password-file; empty: the "
         "password alone (requirepass)");
  o->add("log-level", "info", "debug, info, warn, error or off");
}

namespace {
Status bad(const std::string& what) { return Status(Code::kInvalidArgument, what); }
}  // namespace

Result<WorkerConfig> read_worker_config(const Options& o) {
  WorkerConfig c;
  c.endpoints = o.list("endpoint");
  if (c.endpoints.empty()) return bad("--endpoint: no endpoint given");
  c.manager = o.str("manager");
  if (c.manager.empty()) return bad("--manager: empty");
  KEEP_ASSIGN_OR_RETURN(uint64_t mt, o.uint64("manager-timeout-ms"));
  if (mt == 0) return bad("--manager-timeout-ms: must be >= 1");
  c.manager_timeout = std::chrono::milliseconds(mt);
  KEEP_ASSIGN_OR_RETURN(uint64_t mr, o.uint64("manager-retry-ms"));
  c.manager_retry = std::chrono::milliseconds(mr);
  c.metrics_listen = o.str("metrics-listen") == "off" ? "" : o.str("metrics-listen");
  c.model_path = o.str("model");
  if (c.model_path.empty()) return bad("--model: empty");
  c.device = o.str("device");
  if (c.device != "auto" && c.device != "cpu" && c.device != "cuda") {
    return bad("--device: must be auto, cpu or cuda, got '" + c.device + "'");
  }
  KEEP_ASSIGN_OR_RETURN(uint64_t threads, o.uint64("threads"));
  if (threads > 4096) return bad("--threads: must be <= 4096");
  c.threads = static_cast<int>(threads);
  KEEP_ASSIGN_OR_RETURN(uint64_t ctx, o.uint64("context"));
  if (ctx < 64 || ctx > (1u << 20)) return bad("--context: must be in 64..1048576");
  c.context = static_cast<int32_t>(ctx);
  c.shm_name = o.str("shm-name");
  auto dtype = kv::parse_region_dtype(o.str("kv-dtype"));
  if (!dtype.is_ok()) {
    return Status(Code::kInvalidArgument, "--kv-dtype: " + dtype.status().message());
  }
  c.kv_dtype = *dtype;
  auto method = parse_method(o.str("method"));
  if (!method) return bad("--method: unknown method '" + o.str("method") + "'");
  c.defaults.method = *method;
  KEEP_ASSIGN_OR_RETURN(uint64_t k, o.uint64("k"));
  KEEP_ASSIGN_OR_RETURN(uint64_t max_k, o.uint64("max-k"));
  if (k == 0 || max_k == 0 || k > max_k || max_k > 65536) {
    return bad("--k and --max-k: need 1 <= k <= max-k <= 65536");
  }
  c.defaults.k = static_cast<uint32_t>(k);
  c.max_k = static_cast<uint32_t>(max_k);
  KEEP_ASSIGN_OR_RETURN(uint64_t mt_default, o.uint64("max-tokens"));
  KEEP_ASSIGN_OR_RETURN(uint64_t mt_limit, o.uint64("max-tokens-limit"));
  if (mt_default == 0 || mt_default > mt_limit || mt_limit >= ctx) {
    return bad(
        "--max-tokens and --max-tokens-limit: need 1 <= max-tokens <= max-tokens-limit "
        "< context");
  }
  c.defaults.max_tokens = static_cast<int32_t>(mt_default);
  c.max_tokens = static_cast<int32_t>(mt_limit);
  KEEP_ASSIGN_OR_RETURN(uint64_t cands, o.uint64("max-candidates"));
  if (cands == 0 || cands > 4096) return bad("--max-candidates: must be in 1..4096");
  c.defaults.max_candidates = static_cast<uint32_t>(cands);
  KEEP_ASSIGN_OR_RETURN(c.defaults.knobs.keep_decay, o.number("keep-decay"));
  KEEP_ASSIGN_OR_RETURN(uint64_t q, o.uint64("keep-query-rows"));
  KEEP_ASSIGN_OR_RETURN(uint64_t hops, o.uint64("keep-max-hops"));
  if (q > (1u << 20) || hops > 1024) return bad("--keep-query-rows / --keep-max-hops: too large");
  c.defaults.knobs.importance.query_rows_used = static_cast<int32_t>(q);
  c.defaults.knobs.importance.max_hops = static_cast<int32_t>(hops);
  KEEP_ASSIGN_OR_RETURN(c.defaults.knobs.cacheblend_ratio, o.number("cacheblend-ratio"));
  KEEP_ASSIGN_OR_RETURN(uint64_t epic, o.uint64("epic-tokens"));
  if (epic > (1u << 20)) return bad("--epic-tokens: too large");
  c.defaults.knobs.epic_tokens = static_cast<int32_t>(epic);
  if (Status st = c.defaults.knobs.validate(); !st.is_ok()) {
    return bad("method knobs (--keep-*, --cacheblend-ratio, --epic-tokens): " + st.message());
  }
  KEEP_ASSIGN_OR_RETURN(uint64_t queue, o.uint64("max-queue"));
  if (queue == 0) return bad("--max-queue: must be >= 1");
  c.max_queue = queue;
  KEEP_ASSIGN_OR_RETURN(c.produce, o.boolean("produce"));
  KEEP_ASSIGN_OR_RETURN(c.ablate_position_correction, o.boolean("ablate-position-correction"));
  KEEP_ASSIGN_OR_RETURN(c.ablate_produce_prefix, o.boolean("ablate-produce-prefix"));
  KEEP_ASSIGN_OR_RETURN(uint64_t jl, o.uint64("job-layers"));
  if (jl == 0 || jl > 4096) return bad("--job-layers: must be in 1..4096");
  c.job_layers = static_cast<int32_t>(jl);
  KEEP_ASSIGN_OR_RETURN(uint64_t poll, o.uint64("job-poll-ms"));
  if (poll == 0) return bad("--job-poll-ms: must be >= 1");
  c.job_poll = std::chrono::milliseconds(poll);
  KEEP_ASSIGN_OR_RETURN(c.worker_id, o.uint64("worker-id"));
  KEEP_ASSIGN_OR_RETURN(c.max_message_bytes, o.bytes("max-message-bytes"));
  if (!o.str("kv-remote").empty()) {
    auto seeds = kvremote::parse_redis_url(o.str("kv-remote"));
    if (!seeds.is_ok()) return bad("--kv-remote: " + seeds.status().message());
    c.kv_remote = std::move(seeds).value();
  }
  KEEP_ASSIGN_OR_RETURN(uint64_t rt, o.uint64("kv-remote-timeout-ms"));
  if (rt == 0 || rt > 60000) return bad("--kv-remote-timeout-ms: must be in 1..60000");
  c.kv_remote_timeout = std::chrono::milliseconds(rt);
  KEEP_ASSIGN_OR_RETURN(uint64_t ttl, o.uint64("kv-remote-ttl-s"));
  if (ttl == 0 || ttl > 365ull * 86400) return bad("--kv-remote-ttl-s: must be in 1..31536000");
  c.kv_remote_ttl = std::chrono::seconds(ttl);
  c.kv_remote_user = o.str("kv-remote-user");
  if (const std::string file = o.str("kv-remote-password-file"); !file.empty()) {
    std::ifstream in(file);
    if (!in) return bad("--kv-remote-password-file: cannot read " + file);
    std::getline(in, c.kv_remote_password);
    if (!c.kv_remote_password.empty() && c.kv_remote_password.back() == '\r') {
      c.kv_remote_password.pop_back();
    }
    if (c.kv_remote_password.empty()) {
      return bad("--kv-remote-password-file: " + file + " holds no password on its first line");
    }
  }
  if (!c.kv_remote_user.empty() && c.kv_remote_password.empty()) {
    return bad("--kv-remote-user: needs --kv-remote-password-file");
  }
  c.device_tier = o.str("device-tier");
  KEEP_ASSIGN_OR_RETURN(c.device_tier_bytes, o.bytes("device-tier-bytes"));
  KEEP_ASSIGN_OR_RETURN(c.device_tier_slot_bytes, o.bytes("device-tier-slot-bytes"));
  if (c.device_tier.empty() && c.device_tier_bytes > 0) {
    return bad("--device-tier-bytes: needs --device-tier (the tier's name)");
  }
  if (c.device_tier_bytes > 0 && c.device_tier_bytes < c.device_tier_slot_bytes) {
    return bad("--device-tier-bytes: less than one slot of --device-tier-slot-bytes");
  }
  if (!c.device_tier.empty() && c.device == "cpu") {
    return bad("--device-tier: needs the GPU (--device auto or cuda)");
  }
  if (c.max_message_bytes < 1024) return bad("--max-message-bytes: must be >= 1KiB");
  c.log_level = o.str("log-level");
  return c;
}

}  // namespace keep::worker
