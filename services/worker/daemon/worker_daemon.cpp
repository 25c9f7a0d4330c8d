#include "services/worker/daemon/worker_daemon.h"

#include <unistd.h>

#include <filesystem>
#include <functional>

#include "services/worker/engine/open_model.h"
#include "services/worker/server/worker_service.h"
#include "shared/common/log.h"
#include "shared/metrics/http_server.h"
#include "shared/model/model_identity.h"
#include "shared/tokenizer/chat_template.h"
#ifdef KEEP_HAVE_CUDA
#include "services/worker/engine/cuda/cuda_backend.h"
#include "services/worker/engine/cuda/device_kv_tier.h"
#include "services/worker/engine/cuda/host_registration.h"
#endif

namespace keep::worker {
namespace {
constexpr const char* kLog = "worker";
namespace eng = engine;

uint64_t derived_worker_id() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const uint64_t id = kv::fnv1a_64(host) ^ (static_cast<uint64_t>(::getpid()) << 16);
  return id == 0 ? 1 : id;
}

}  // namespace

#ifdef KEEP_HAVE_CUDA
// The plan path's view of the device KV tier.
class TierEntries final : public DeviceEntries {
 public:
  explicit TierEntries(eng::DeviceKvTier* tier) : tier_(tier) {}
  std::optional<Entry> find(const kv::EntryKey& key) const override {
    const auto hit = tier_->find(key);
    if (!hit) return std::nullopt;
    return Entry{{hit->device, hit->bytes}, hit->tier.slot, hit->tier.seq};
  }
  bool validate(const Entry& e) const override {
    return tier_->directory().validate(kv::TierHit{e.slot, e.seq, e.bytes.size()});
  }
  bool owner() const override { return tier_->owner(); }
  Status admit(const kv::EntryKey& key, std::span<const std::byte> bytes) override {
    return tier_->admit(key, bytes);
  }
  bool evict(const kv::EntryKey& key) override { return tier_->evict(key); }

 private:
  eng::DeviceKvTier* tier_;
};
#endif

struct WorkerDaemon::Impl {
  WorkerConfig config;
  metrics::Registry registry;
  std::unique_ptr<WorkerMetrics> metrics;
  std::optional<tok::BpeTokenizer> tokenizer;
  std::unique_ptr<eng::Engine> engine;
  std::optional<PromptBuilder> prompts;
  std::unique_ptr<client::ManagerClient> manager;
  std::unique_ptr<KvAssembler> request_assembler, job_assembler;
  std::optional<PlanService> plans;
  std::unique_ptr<kvremote::SharedKvTier> shared_kv;  // before the producer that uses it
  std::optional<KvProducer> producer;
  std::unique_ptr<WorkerService> service;
  std::unique_ptr<WorkerRpcServer> server;
  std::unique_ptr<metrics::MetricsHttpServer> http;
#ifdef KEEP_HAVE_CUDA
  // The attached region's mapping, page-locked for the GPU (engine thread only).
  std::unique_ptr<eng::HostRegistration> registered;
  // The device KV tier (--device-tier), owned or attached, and its face for the plan path.
  std::unique_ptr<eng::DeviceKvTier> tier;
  std::unique_ptr<DeviceEntries> tier_entries;
#endif

  ~Impl() {
    // Order: the engine thread finishes the queued requests and hands their answers to the
    // server, whose destructor sends them; then the producer revokes what it holds.
    if (service) service->drain();
    server.reset();
    http.reset();
    service.reset();
  }
};

WorkerDaemon::WorkerDaemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
WorkerDaemon::~WorkerDaemon() = default;

Result<std::unique_ptr<WorkerDaemon>> WorkerDaemon::start(const WorkerConfig& config) {
  auto impl = std::make_unique<Impl>();
  Impl& d = *impl;
  d.config = config;

  // ---- the model ----
  std::error_code ec;
  if (std::filesystem::is_directory(config.model_path, ec) &&
      !std::filesystem::exists(std::filesystem::path(config.model_path) / "config.json", ec)) {
    return Status(Code::kInvalidArgument,
                  "--model: " + config.model_path + " is a directory without config.json");
  }
  KEEP_ASSIGN_OR_RETURN(auto identity, eng::read_model_identity(config.model_path));
  eng::OpenOptions oo;
  oo.device = config.device;
  oo.threads = config.threads;
  KEEP_ASSIGN_OR_RETURN(eng::OpenedModel model, eng::open_model(config.model_path, oo));
  if (!model.tokenizer) {
    return Status(Code::kInvalidArgument, "--model: " + config.model_path + " has no tokenizer");
  }
  d.tokenizer.emplace(std::move(*model.tokenizer));
  std::unique_ptr<eng::Backend> backend = std::move(model.backend);
  const kv::ModelFingerprint fingerprint = eng::kv_fingerprint(
      backend->config(), d.tokenizer->fingerprint(), config.kv_dtype, identity.name);
  const std::string backend_name = backend->name();
  KEEP_ASSIGN_OR_RETURN(d.engine, eng::Engine::create(std::move(backend)));
  KEEP_ASSIGN_OR_RETURN(auto chat, tok::ChatTemplate::from_jinja(model.chat_template));
  KEEP_ASSIGN_OR_RETURN(auto prompts, PromptBuilder::create(&*d.tokenizer, chat));
  d.prompts.emplace(std::move(prompts));
  KEEP_ASSIGN_OR_RETURN(d.request_assembler,
                        KvAssembler::create(*d.engine, d.prompts->prefix(), config.context));
  KEEP_ASSIGN_OR_RETURN(d.job_assembler,
                        KvAssembler::create(*d.engine, d.prompts->prefix(), config.context));
  if (config.ablate_position_correction) {
    LoadOptions lo;
    lo.position_correction = false;
    d.request_assembler->set_load_options(lo);
    KEEP_LOG_WARN(kLog, "ablation: loaded K is not rotated to the prompt's positions");
  }
  if (config.ablate_produce_prefix) {
    ProduceOptions po;
    po.with_prefix = false;
    d.job_assembler->set_produce_options(po);
    KEEP_LOG_WARN(kLog, "ablation: entries are computed without the system prefix in front");
  }

  // ---- the manager ----
  client::ClientOptions co;
  co.endpoint = config.manager;
  co.timeout = config.manager_timeout;
  // Only this node's manager: its KV descriptors ({index, generation}) name entries of the region
  // this worker maps; another node's would name other bytes at the same slots. An agent another
  // node serves is answered `moved` to the planner, naming that node's worker (PlanService).
  co.follow_moved = false;
  KEEP_ASSIGN_OR_RETURN(d.manager, client::ManagerClient::connect(co));

  const uint64_t worker_id = config.worker_id != 0 ? config.worker_id : derived_worker_id();
  d.plans.emplace(d.request_assembler.get(), &*d.prompts, &*d.tokenizer, d.manager.get(), nullptr,
                  config.defaults);
  d.producer.emplace(d.job_assembler.get(), &*d.prompts, d.manager.get(), nullptr, worker_id);
  if (!config.kv_remote.empty()) {
    kvremote::SharedKvOptions ko;
    ko.redis.seeds = config.kv_remote;
    ko.redis.connect_timeout = config.kv_remote_timeout;
    ko.redis.op_timeout = config.kv_remote_timeout;
    ko.redis.user = config.kv_remote_user;
    ko.redis.password = config.kv_remote_password;
    ko.ttl = config.kv_remote_ttl;
    KEEP_ASSIGN_OR_RETURN(d.shared_kv, kvremote::SharedKvTier::create(ko));
    d.producer->set_shared_tier(d.shared_kv.get(), backend_name);
    KEEP_LOG_INFO(kLog, "shared KV tier on Redis Cluster: %zu seed(s), timeout %lld ms%s",
                  config.kv_remote.size(), static_cast<long long>(config.kv_remote_timeout.count()),
                  config.kv_remote_password.empty() ? "" : ", AUTH");
  }
  d.metrics = std::make_unique<WorkerMetrics>(d.registry);

  WorkerServiceOptions so;
  so.max_queue = config.max_queue;
  so.max_k = config.max_k;
  so.max_tokens = config.max_tokens;
  so.job_layers = config.job_layers;
  so.produce = config.produce;
  so.worker_id = worker_id;
  so.job_poll = config.job_poll;
  so.manager_retry = config.manager_retry;
  so.shm_name = config.shm_name;
  so.fingerprint = fingerprint;
  so.server_version = std::string("keep-worker ") + KEEP_VERSION_STRING + " (" + backend_name + ")";
#ifdef KEEP_HAVE_CUDA
  if (backend_name.find("cuda") != std::string::npos) {
    // Once per attach: the GPU reads entries from the mapping in place (zero-copy).
    so.on_region = [&d](const kv::KvRegionView& region, bool attached) {
      d.registered.reset();
      if (!attached) return;
      auto r = eng::HostRegistration::register_memory(region.base(), region.size());
      if (!r.is_ok()) {
        KEEP_LOG_WARN(kLog, "the KV region stays pageable: %s", r.status().message().c_str());
        return;
      }
      d.registered = std::move(r).value();
    };
  }
#endif
  if (!config.device_tier.empty()) {
#ifdef KEEP_HAVE_CUDA
    if (backend_name.find("cuda") == std::string::npos) {
      return Status(Code::kInvalidArgument, "--device-tier: the model runs on the CPU");
    }
    if (config.device_tier_bytes > 0) {
      eng::DeviceKvTierOptions to;
      to.name = config.device_tier;
      to.budget_bytes = config.device_tier_bytes;
      to.slot_bytes = config.device_tier_slot_bytes;
      KEEP_ASSIGN_OR_RETURN(d.tier, eng::DeviceKvTier::create(to));
    } else {
      KEEP_ASSIGN_OR_RETURN(d.tier, eng::DeviceKvTier::attach(config.device_tier));
    }
    d.tier_entries = std::make_unique<TierEntries>(d.tier.get());
    d.plans->set_device_entries(d.tier_entries.get());
    KEEP_LOG_INFO(kLog, "device KV tier '%s': %s, %u slots of %llu bytes",
                  config.device_tier.c_str(), d.tier->owner() ? "owned" : "attached",
                  d.tier->directory().geometry().slots,
                  static_cast<unsigned long long>(d.tier->directory().geometry().slot_bytes));
#else
    return Status(Code::kInvalidArgument, "--device-tier: this build has no CUDA backend");
#endif
  }
  d.service = std::make_unique<WorkerService>(&*d.plans, &*d.producer, so, d.metrics.get());

  // ---- the endpoints ----
  wire::ServerOptions wo;
  wo.endpoints = config.endpoints;
  wo.limits.max_message_bytes = config.max_message_bytes;
  KEEP_ASSIGN_OR_RETURN(d.server, WorkerRpcServer::create(std::move(wo), d.service.get()));
  d.service->start([server = d.server.get()](std::unique_ptr<WorkerCall> call) {
    server->complete(std::move(call));
  });
  if (!config.metrics_listen.empty()) {
    KEEP_ASSIGN_OR_RETURN(auto mo, metrics::parse_metrics_listen(config.metrics_listen));
    KEEP_ASSIGN_OR_RETURN(d.http, metrics::MetricsHttpServer::start(d.registry, mo));
  }
  d.registry.add_collect_hook(
      [&d] { d.metrics->region_attached.get().set(d.service->region_attached() ? 1 : 0); });

  std::string eps;
  for (const auto& e : d.server->bound_endpoints()) eps += (eps.empty() ? "" : ",") + e;
  KEEP_LOG_INFO(kLog,
                "serving on %s; metrics on %s; model %s on %s; method %s; manager %s; region '%s'",
                eps.c_str(), d.http ? d.http->address().c_str() : "off", identity.name.c_str(),
                backend_name.c_str(), method_name(config.defaults.method), config.manager.c_str(),
                config.shm_name.c_str());
  return std::unique_ptr<WorkerDaemon>(new WorkerDaemon(std::move(impl)));
}

void WorkerDaemon::run() { impl_->server->run(); }

void WorkerDaemon::stop() { impl_->server->stop(); }

const std::vector<std::string>& WorkerDaemon::endpoints() const {
  return impl_->server->bound_endpoints();
}

std::string WorkerDaemon::metrics_address() const {
  return impl_->http ? impl_->http->address() : std::string();
}

}  // namespace keep::worker
