// bench_keep: TTFT of one planning step with each method (issue 29, point 5), on the CUDA backend
// with random bf16 weights of a real model's shape made on the GPU.
//
//   build/bin/bench_keep --shape qwen2.5-14b --segments 10,20,40,80 [--memory-tokens 4096]
//                        [--reps 10] [--warmup 3] [--decays 0.96,0.80] [--json FILE]
//                        [--keep-ratios 0.15]  (keep at the d whose requests reach ratio R)
//                        [--methods full,keep,...]   (default: all; with CUPTI, one at a time)
//                        [--pool fused|tensor|fp32]  (importance pooling: CudaBackendOptions)
//                        [--loads queue|sync] [--prefetch-mib M] [--loader-blocks B]
//                        [--prefetch-recompute-mib M] [--loader-dma on|off]
//                        (layer-balanced loading: LoadOptions, CudaBackendOptions)
//                        [--autotune-rows N]  (CudaBackendOptions::gemm_autotune_rows)
//                        [--prefill-split on|off]  (CudaBackendOptions::prefill_split)
//                        [--own-few-rows N]  (CudaBackendOptions::own_few_rows; 0: cuBLAS)
//                        [--gemm-leave-loader on|off] [--blas-leave-loader on|off]
//                        (CudaBackendOptions::gemm_leave_loader, blas_leave_loader)
//                        [--prefill-kernel auto|mma|wgmma|wgmma1k|wide]
//                        (CudaBackendOptions::prefill_attention, every layer)
//                        [--loader-bench B[,B...]]  (then the loader alone, below)
//                        [--pool-columns computed|all]  (keep's pooled columns: the segments
//                        computed at the layer, or every segment:
//                        KvAssembler::set_pool_every_segment)
//                        [--choose-early on|off]  (keep's check layers choose the rows that go
//                        on inside the layer and run the MLP for them only:
//                        KvAssembler::set_choose_early)
//                        [--profile on|off]  (after each case's timed requests, one more with
//                        CudaBackend's stage events: a "#   stages" line; "choose" is the
//                        stream's wait for the host's choice at keep's check layers)
//                        [--entries host|tier]  (where requests' entries are read: host: the
//                        registered buffer over the link; tier: every entry admitted into a
//                        device KV tier, as a worker's hot entries, read at device speed)
//
// --loader-bench: the loader on its own over every entry's every layer (all --segments' largest
// count), against the link in the same run: one cudaMemcpyAsync of the registered entries to the
// device (the host->device bandwidth), the loader's kernel with each B blocks (zero-copy from the
// mapping, RoPE fused), and cudaMemcpyBatchAsync of the entries' planes into device staging then
// the same kernel from there (the DMA alternative). Medians of --reps after --warmup.
//
// A prompt is [system prefix (32)][segments][query (128)], random token ids. Segments come in
// the household kinds' relative lengths (object state 25, task record 15, example plan 80; in
// turn), scaled so that --segments 40 holds --memory-tokens in all (0: unscaled). Each segment's
// KV is produced as keep-worker produces it ([prefix][segment], prefix dropped, bf16 pre-RoPE K)
// into one host buffer registered for the GPU, as the shared region is: loads read it in place.
// Each method then runs the same prompt `reps` times (after `warmup`), TTFT = the assembled
// prefill to the last token's logits on the host. `prefix` (vLLM-style prefix caching) runs each
// time after a previous step whose second half of segments came in another order. Printed per
// (segments, method): TTFT median, min and max, the ratio to `full` in the same run, the mean
// recompute ratio, bytes loaded and the load rate over the TTFT; --json appends the same lines.
// keep's rows are followed by a "#" line: the host's time at each check layer of the last request
// (its wait for the pooled columns, its decision), also in the JSON as check_host_us.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <unistd.h>

#include "benchmarks/keep/bench_util.h"
#include "benchmarks/model_shapes.h"
#include "services/worker/engine/cuda/cuda_backend.h"
#include "services/worker/engine/cuda/device_kv_tier.h"
#include "services/worker/engine/cuda/host_registration.h"
#include "services/worker/keep/kv_assembler.h"
#include "services/worker/kernels/attention_schedule.h"
#include "services/worker/kernels/kernels.h"

namespace {

using namespace keep;
using namespace keep::worker;
using bench::median;
using bench::parse_list;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage =
    "usage: bench_keep --shape NAME [--segments N[,N...]] [--memory-tokens T] [--reps R]\n"
    "                  [--warmup W] [--decays D[,D...]] [--keep-ratios R[,R...]] [--json FILE]\n"
    "                  [--methods M[,M...]]\n"
    "                  [--pool fused|tensor|fp32] [--loads queue|sync] [--prefetch-mib M]\n"
    "                  [--prefetch-recompute-mib M] [--loader-dma on|off]\n"
    "                  [--loader-blocks B] [--loader-bench B[,B...]] [--autotune-rows N]\n"
    "                  [--prefill-split on|off] [--own-few-rows N]\n"
    "                  [--gemm-leave-loader on|off] [--blas-leave-loader on|off]\n"
    "                  [--entries host|tier] [--pool-columns computed|all]\n"
    "                  [--choose-early on|off] [--profile on|off]\n";

int fail(const Status& st) {
  std::fprintf(stderr, "bench_keep: %s\n", st.to_string().c_str());
  return 1;
}
int refuse(const std::string& why) {
  std::fprintf(stderr, "bench_keep: %s\n%s", why.c_str(), kUsage);
  return 2;
}

struct Case {
  std::string label;
  Method method;
  MethodKnobs knobs;
  double target_ratio = 0;  // keep: d chosen per segment count for this average ratio
};

int64_t offset_tokens(const std::vector<int32_t>& lengths, size_t s) {
  int64_t sum = 0;
  for (size_t i = 0; i < s; ++i) sum += lengths[i];
  return sum;
}

// One segment's entry and the slot of its first token in the prompt.
struct EntryPlanes {
  std::span<const std::byte> entry;
  EntryGeometry geometry;
  int32_t slot;
};

double gbps(double bytes, double ms) { return bytes / (ms * 1e6); }

// A device KV tier that this process owns, `entries` admitted one a slot (slots of the largest);
// each entry's bytes in the tier's pool (device memory) to `device`, in order.
Result<std::unique_ptr<engine::DeviceKvTier>> admit_all(
    const std::string& name, const std::vector<std::span<const std::byte>>& entries,
    std::vector<std::span<const std::byte>>* device) {
  engine::DeviceKvTierOptions to;
  to.name = name + "_" + std::to_string(::getpid());
  for (const auto& e : entries) to.slot_bytes = std::max<uint64_t>(to.slot_bytes, e.size());
  to.budget_bytes = to.slot_bytes * entries.size();
  KEEP_ASSIGN_OR_RETURN(auto tier, engine::DeviceKvTier::create(to));
  device->clear();
  for (size_t i = 0; i < entries.size(); ++i) {
    kv::EntryKey key;
    key.object_id = i + 1;
    KEEP_RETURN_IF_ERROR(tier->admit(key, entries[i]));
    const auto hit = tier->find(key);
    if (!hit) return Status(Code::kInternal, "bench_keep: an admitted entry not found");
    device->emplace_back(hit->device, entries[i].size());
  }
  return tier;
}

template <typename F>
Result<double> time_ms(int reps, int warmup, F&& body) {
  std::vector<double> ms;
  for (int r = 0; r < warmup + reps; ++r) {
    if (cudaDeviceSynchronize() != cudaSuccess) return Status(Code::kInternal, "cuda sync");
    const auto t0 = Clock::now();
    KEEP_RETURN_IF_ERROR(body());
    if (cudaDeviceSynchronize() != cudaSuccess) return Status(Code::kInternal, "cuda sync");
    if (r >= warmup)
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return median(ms);
}

// The loader alone (--loader-bench): every entry's every layer into a working cache.
Status bench_loader(engine::Engine& eng, engine::CudaBackend& cuda,
                    const std::vector<EntryPlanes>& entries, const std::vector<std::byte>& region,
                    const std::vector<int32_t>& blocks, int reps, int warmup) {
  const auto& cfg = eng.config();
  const int32_t layers = static_cast<int32_t>(cfg.num_layers);
  int32_t capacity = 0;
  for (const auto& e : entries) capacity = std::max(capacity, e.slot + e.geometry.tokens);
  KEEP_ASSIGN_OR_RETURN(engine::KvCache cache, engine::KvCache::create(eng.backend(), capacity));
  std::vector<engine::Backend::KvRun> runs;
  uint64_t bytes = 0;
  for (int32_t l = 0; l < layers; ++l) {
    const engine::KvView view = cache.layer(l);
    for (const auto& e : entries) {
      const auto p = entry_rows_bf16(e.entry, e.geometry, l, 0, e.geometry.tokens);
      if (!p) return Status(Code::kInternal, "bench_keep: entries are bf16");
      runs.push_back({view, l, e.slot, e.geometry.tokens, p->first, p->second});
      bytes += 2 * static_cast<uint64_t>(e.geometry.tokens) * cfg.kv_dim() * 2;
    }
  }
  std::printf("# loader alone: %zu runs (%d layers x %zu entries), %.1f MiB\n", runs.size(), layers,
              entries.size(), static_cast<double>(bytes) / (1 << 20));
  std::printf("%-34s %9s %8s %9s\n", "path", "ms", "GB/s", "vs_link");
  // The link: the registered entries in one copy.
  void* dev = nullptr;
  if (cudaMalloc(&dev, region.size()) != cudaSuccess) return Status(Code::kInternal, "cudaMalloc");
  KEEP_ASSIGN_OR_RETURN(double link_ms, time_ms(reps, warmup, [&] {
                          return cudaMemcpyAsync(dev, region.data(), region.size(),
                                                 cudaMemcpyHostToDevice, nullptr) == cudaSuccess
                                     ? Status::ok()
                                     : Status(Code::kInternal, "cudaMemcpyAsync");
                        }));
  const double link = gbps(static_cast<double>(region.size()), link_ms);
  std::printf("%-34s %9.2f %8.1f %9.2f\n", "cudaMemcpyAsync (one copy)", link_ms, link, 1.0);
  for (int32_t b : blocks) {
    cuda.set_loader_blocks(b);
    KEEP_ASSIGN_OR_RETURN(double ms, time_ms(reps, warmup, [&] {
                            KEEP_RETURN_IF_ERROR(eng.queue_kv_bf16_runs(runs));
                            return Status::ok();
                          }));
    char label[64];
    std::snprintf(label, sizeof label, "loader kernel, %d blocks", b);
    std::printf("%-34s %9.2f %8.1f %9.2f\n", label, ms, gbps(static_cast<double>(bytes), ms),
                gbps(static_cast<double>(bytes), ms) / link);
  }
  // The same runs from a device KV tier (the entries admitted into a pool of GPU memory, as a
  // second worker on this GPU would read them through CUDA IPC): in place at device speed.
  {
    std::vector<std::span<const std::byte>> host_entries, base;
    for (const auto& e : entries) host_entries.push_back(e.entry);
    KEEP_ASSIGN_OR_RETURN(auto tier, admit_all("keep_bench_tier", host_entries, &base));
    std::vector<engine::Backend::KvRun> from_tier = runs;
    for (size_t r = 0; r < from_tier.size(); ++r) {
      const size_t i = r % entries.size();  // runs go layer by layer over the entries
      const auto* host = reinterpret_cast<const std::byte*>(entries[i].entry.data());
      from_tier[r].k_pre = reinterpret_cast<const uint16_t*>(
          base[i].data() + (reinterpret_cast<const std::byte*>(runs[r].k_pre) - host));
      from_tier[r].v = reinterpret_cast<const uint16_t*>(
          base[i].data() + (reinterpret_cast<const std::byte*>(runs[r].v) - host));
    }
    cuda.set_loader_blocks(blocks.front());
    KEEP_ASSIGN_OR_RETURN(double ms, time_ms(reps, warmup, [&] {
                            KEEP_RETURN_IF_ERROR(eng.queue_kv_bf16_runs(from_tier));
                            return Status::ok();
                          }));
    char label[64];
    std::snprintf(label, sizeof label, "loader kernel from a device tier, %d", blocks.front());
    std::printf("%-34s %9.2f %8.1f %9.2f\n", label, ms, gbps(static_cast<double>(bytes), ms),
                gbps(static_cast<double>(bytes), ms) / link);
  }
  cuda.set_loader_blocks(engine::CudaBackendOptions{}.loader_blocks);
  // DMA: each run's K and V planes into device staging (cudaMemcpyBatchAsync), then the kernel
  // from there over the whole GPU.
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  std::vector<engine::Backend::KvRun> staged = runs;
  auto* base = static_cast<std::byte*>(dev);
  size_t at = 0;
  for (auto& r : staged) {
    const size_t plane = static_cast<size_t>(r.n) * cfg.kv_dim() * 2;
    dsts.push_back(base + at);
    srcs.push_back(r.k_pre);
    sizes.push_back(plane);
    r.k_pre = reinterpret_cast<const uint16_t*>(base + at);
    at += plane;
    dsts.push_back(base + at);
    srcs.push_back(r.v);
    sizes.push_back(plane);
    r.v = reinterpret_cast<const uint16_t*>(base + at);
    at += plane;
  }
  if (at > region.size()) return Status(Code::kInternal, "bench_keep: staging overflow");
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_idx = 0;
  cudaStream_t stream = nullptr;  // batches refuse the legacy default stream
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    return Status(Code::kInternal, "cudaStreamCreate");
  }
  auto batch = [&] {
    const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                                 dsts.size(), &attr, &attr_idx, 1, stream);
    return err == cudaSuccess ? Status::ok()
                              : Status(Code::kInternal, std::string("cudaMemcpyBatchAsync: ") +
                                                            cudaGetErrorString(err));
  };
  KEEP_ASSIGN_OR_RETURN(double copy_ms, time_ms(reps, warmup, batch));
  std::printf("%-34s %9.2f %8.1f %9.2f\n", "cudaMemcpyBatchAsync (planes)", copy_ms,
              gbps(static_cast<double>(bytes), copy_ms),
              gbps(static_cast<double>(bytes), copy_ms) / link);
  KEEP_ASSIGN_OR_RETURN(double both_ms, time_ms(reps, warmup, [&] {
                          KEEP_RETURN_IF_ERROR(batch());
                          if (cudaStreamSynchronize(stream) != cudaSuccess) {
                            return Status(Code::kInternal, "sync");
                          }
                          return eng.load_kv_bf16_runs(staged);  // device sources: the whole GPU
                        }));
  std::printf("%-34s %9.2f %8.1f %9.2f\n", "  + kernel from device staging", both_ms,
              gbps(static_cast<double>(bytes), both_ms),
              gbps(static_cast<double>(bytes), both_ms) / link);
  cudaStreamDestroy(stream);
  cudaFree(dev);
  return Status::ok();
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape, json, methods = "full,prefix,full_reuse,cacheblend,epic,keep";
  std::vector<int32_t> segment_counts = {10, 20, 40, 80};
  std::vector<double> decays = {0.96};
  bool entries_in_tier = false;      // --entries tier
  bool pool_every_segment = false;   // --pool-columns all
  std::optional<bool> choose_early;  // --choose-early (else the assembler's default)
  bool profile = false;              // --profile on
  std::vector<double> keep_ratios;
  int64_t memory_tokens = 4096;
  int reps = 10, warmup = 3;
  engine::CudaBackendOptions options;
  LoadOptions loads;
  std::vector<int32_t> loader_bench;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (i + 1 >= argc) return refuse(a + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    if (a == "--shape") {
      shape = v;
    } else if (a == "--segments") {
      if (!parse_list(v, &segment_counts)) return refuse("--segments: N[,N...] > 0");
    } else if (a == "--decays") {
      if (!parse_list(v, &decays)) return refuse("--decays: D[,D...] in (0, 1]");
    } else if (a == "--keep-ratios") {
      if (!parse_list(v, &keep_ratios)) return refuse("--keep-ratios: R[,R...] in (0, 1]");
    } else if (a == "--memory-tokens") {
      memory_tokens = std::atoll(v.c_str());
    } else if (a == "--reps") {
      reps = std::atoi(v.c_str());
    } else if (a == "--warmup") {
      warmup = std::atoi(v.c_str());
    } else if (a == "--json") {
      json = v;
    } else if (a == "--methods") {
      methods = v;
    } else if (a == "--pool") {
      if (v != "fused" && v != "tensor" && v != "fp32")
        return refuse("--pool: fused, tensor or fp32");
      options.pool_tensor_cores = v != "fp32";
      options.pool_fused = v == "fused";
    } else if (a == "--own-few-rows") {
      const int n = std::atoi(v.c_str());
      if (n < 0 || (n == 0 && v != "0")) return refuse("--own-few-rows: N >= 0");
      options.own_few_rows = n;
    } else if (a == "--pool-columns") {
      if (v != "computed" && v != "all") return refuse("--pool-columns: computed or all");
      pool_every_segment = v == "all";
    } else if (a == "--choose-early") {
      if (v != "on" && v != "off") return refuse("--choose-early: on or off");
      choose_early = v == "on";
    } else if (a == "--profile") {
      if (v != "on" && v != "off") return refuse("--profile: on or off");
      profile = v == "on";
    } else if (a == "--entries") {
      if (v != "host" && v != "tier") return refuse("--entries: host or tier");
      entries_in_tier = v == "tier";
    } else if (a == "--loader-dma") {
      if (v != "on" && v != "off") return refuse("--loader-dma: on or off");
      options.loader_dma = v == "on";
    } else if (a == "--gemm-leave-loader") {
      if (v != "on" && v != "off") return refuse("--gemm-leave-loader: on or off");
      options.gemm_leave_loader = v == "on";
    } else if (a == "--blas-leave-loader") {
      if (v != "on" && v != "off") return refuse("--blas-leave-loader: on or off");
      options.blas_leave_loader = v == "on";
    } else if (a == "--prefill-split") {
      if (v != "on" && v != "off") return refuse("--prefill-split: on or off");
      options.prefill_split = v == "on";
    } else if (a == "--prefill-kernel") {
      if (!keep::kernels::parse_prefill_kernel(v.c_str(), &options.prefill_attention)) {
        return refuse("--prefill-kernel: auto, mma, wgmma, wgmma1k or wide");
      }
    } else if (a == "--loads") {
      if (v != "queue" && v != "sync") return refuse("--loads: queue or sync");
      loads.queue = v == "queue";
    } else if (a == "--prefetch-mib") {
      const double mib = std::atof(v.c_str());
      if (!(mib >= 0)) return refuse("--prefetch-mib: M >= 0");
      loads.prefetch_bytes = static_cast<uint64_t>(mib * (1 << 20));
    } else if (a == "--prefetch-recompute-mib") {
      const double mib = std::atof(v.c_str());
      if (!(mib >= 0)) return refuse("--prefetch-recompute-mib: M >= 0");
      loads.prefetch_bytes_recomputing = static_cast<uint64_t>(mib * (1 << 20));
    } else if (a == "--loader-bench") {
      if (!parse_list(v, &loader_bench)) return refuse("--loader-bench: B[,B...] >= 1");
    } else if (a == "--autotune-rows") {
      options.gemm_autotune_rows = std::atoi(v.c_str());
    } else if (a == "--loader-blocks") {
      options.loader_blocks = std::atoi(v.c_str());
      if (options.loader_blocks < 1) return refuse("--loader-blocks: B >= 1");
    } else {
      return refuse("unknown argument '" + a + "'");
    }
  }
  if (shape.empty()) return refuse("--shape is required");
  if (reps < 1 || warmup < 0 || memory_tokens < 0)
    return refuse("bad --reps/--warmup/--memory-tokens");
  const auto cfg = keep::bench::model_shape(shape);
  if (!cfg.is_ok()) return fail(cfg.status());

  // Segment lengths: object 25, task 15, plan 80 in turn, scaled to memory_tokens at 40 segments.
  const int32_t kinds[3] = {25, 15, 80};
  double scale = 1.0;
  if (memory_tokens > 0) {
    int64_t at40 = 0;
    for (int i = 0; i < 40; ++i) at40 += kinds[i % 3];
    scale = static_cast<double>(memory_tokens) / static_cast<double>(at40);
  }
  const int32_t max_segments = *std::max_element(segment_counts.begin(), segment_counts.end());
  std::vector<int32_t> lengths;
  int64_t total_memory = 0;
  for (int i = 0; i < max_segments; ++i) {
    lengths.push_back(std::max<int32_t>(1, static_cast<int32_t>(kinds[i % 3] * scale + 0.5)));
    total_memory += lengths.back();
  }
  const int32_t prefix_len = 32, query_len = 128;
  const int32_t capacity = static_cast<int32_t>(prefix_len + total_memory + query_len + 8);

  auto backend = engine::CudaBackend::create_random(*cfg, 20261202, options);
  if (!backend.is_ok()) return fail(backend.status());
  const std::string backend_name = (*backend)->name();
  auto eng = engine::Engine::create(std::move(backend).value(), capacity);
  if (!eng.is_ok()) return fail(eng.status());
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg->vocab_size) - 1);
  auto random_tokens = [&](int32_t n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (auto& x : t) x = tok(rng);
    return t;
  };
  const std::vector<int32_t> prefix = random_tokens(prefix_len);
  const std::vector<int32_t> query = random_tokens(query_len);
  std::vector<std::vector<int32_t>> segments;
  for (int32_t len : lengths) segments.push_back(random_tokens(len));
  auto assembler = KvAssembler::create(**eng, prefix, capacity);
  if (!assembler.is_ok()) return fail(assembler.status());
  (*assembler)->set_load_options(loads);
  (*assembler)->set_pool_every_segment(pool_every_segment);
  if (choose_early) (*assembler)->set_choose_early(*choose_early);

  // Every segment's entry, bf16, in one registered buffer (the region's stand-in).
  kv::ModelFingerprint fp;
  fp.num_layers = static_cast<uint32_t>(cfg->num_layers);
  fp.num_kv_heads = static_cast<uint32_t>(cfg->num_kv_heads);
  fp.head_dim = static_cast<uint32_t>(cfg->head_dim);
  fp.dtype = kv::KvDType::kBF16;
  std::vector<EntryGeometry> geometry;
  std::vector<size_t> offset;
  size_t bytes = 0;
  for (int32_t len : lengths) {
    auto g = EntryGeometry::of(fp, len);
    if (!g.is_ok()) return fail(g.status());
    geometry.push_back(*g);
    offset.push_back(bytes);
    bytes += (g->bytes() + 4095) / 4096 * 4096;
  }
  std::vector<std::byte> region(bytes);
  const auto t_produce = Clock::now();
  for (size_t s = 0; s < segments.size(); ++s) {
    std::span<std::byte> entry(region.data() + offset[s], geometry[s].bytes());
    Status st = (*assembler)->produce(segments[s], KvAssembler::entry_writer(entry, geometry[s]));
    if (!st.is_ok()) return fail(st);
  }
  auto reg = engine::HostRegistration::register_memory(region.data(), region.size());
  if (!reg.is_ok()) return fail(reg.status());
  std::printf(
      "# %s | %s | %d segments, %lld memory tokens, %.1f MiB of entries, produced in %.1f s\n",
      shape.c_str(), backend_name.c_str(), max_segments, static_cast<long long>(total_memory),
      static_cast<double>(bytes) / (1 << 20),
      std::chrono::duration<double>(Clock::now() - t_produce).count());

  if (!loader_bench.empty()) {
    auto* cuda = static_cast<engine::CudaBackend*>(&(*eng)->backend());
    std::vector<EntryPlanes> planes;
    for (size_t s = 0; s < segments.size(); ++s) {
      planes.push_back({std::span<const std::byte>(region.data() + offset[s], geometry[s].bytes()),
                        geometry[s], prefix_len + static_cast<int32_t>(offset_tokens(lengths, s))});
    }
    const Status st = bench_loader(**eng, *cuda, planes, region, loader_bench, reps, warmup);
    if (!st.is_ok()) return fail(st);
    return 0;
  }

  // --entries tier: every entry admitted into a device KV tier that this process owns; requests
  // carry the tier's bytes as a worker does for a hit (SegmentKv::device), so loads read GPU
  // memory.
  std::unique_ptr<engine::DeviceKvTier> tier;
  std::vector<std::span<const std::byte>> in_tier(segments.size());
  if (entries_in_tier) {
    std::vector<std::span<const std::byte>> host_entries;
    for (size_t s = 0; s < segments.size(); ++s) {
      host_entries.emplace_back(region.data() + offset[s], geometry[s].bytes());
    }
    auto admitted = admit_all("keep_bench_entries", host_entries, &in_tier);
    if (!admitted.is_ok()) return fail(admitted.status());
    tier = std::move(admitted).value();
    std::printf("# entries read from a device KV tier (%zu entries)\n", segments.size());
  }

  std::vector<Case> cases;
  cases.push_back({"full", Method::kFull, {}});
  cases.push_back({"prefix", Method::kPrefix, {}});
  cases.push_back({"full_reuse", Method::kFullReuse, {}});
  cases.push_back({"cacheblend", Method::kCacheBlend, {}});
  cases.push_back({"epic", Method::kEpic, {}});
  for (double d : decays) {
    MethodKnobs k;
    k.keep_decay = d;
    char label[32];
    std::snprintf(label, sizeof label, "keep d=%.2f", d);
    cases.push_back({label, Method::kKeep, k});
  }
  for (double r : keep_ratios) {
    char label[32];
    std::snprintf(label, sizeof label, "keep ~%.2f", r);
    cases.push_back({label, Method::kKeep, {}, r});
  }

  // --methods: a case runs when its method's name is in the list (full is the ratios' base).
  const std::string wanted = "," + methods + ",";
  cases.erase(std::remove_if(cases.begin(), cases.end(),
                             [&](const Case& c) {
                               return wanted.find("," + std::string(method_name(c.method)) + ",") ==
                                      std::string::npos;
                             }),
              cases.end());
  if (cases.empty()) {
    return refuse("--methods: none of full, prefix, full_reuse, cacheblend, epic, keep");
  }
  std::ofstream out;
  if (!json.empty()) out.open(json, std::ios::app);
  std::printf("%-8s %-12s %8s %10s %9s %9s %8s %9s %11s %8s\n", "segments", "method", "mem_tok",
              "ttft_ms", "min_ms", "max_ms", "vs_full", "recompute", "loaded_MiB", "GB/s");
  for (int32_t n : segment_counts) {
    AssembleRequest req;
    int64_t mem = 0;
    for (int32_t s = 0; s < n; ++s) {
      PromptSegment ps;
      ps.tokens = segments[s];
      ps.kv = SegmentKv{std::span<const std::byte>(region.data() + offset[s], geometry[s].bytes()),
                        geometry[s], 0, in_tier[s]};
      req.segments.push_back(std::move(ps));
      mem += lengths[s];
    }
    req.query = query;
    // `prefix`'s previous step: the same segments with the second half's order reversed (a new
    // instruction reorders what retrieval returns), computed in full before each timed run, so
    // that the longest common prefix is the system prefix and the first half.
    AssembleRequest previous = req;
    std::reverse(previous.segments.begin() + n / 2, previous.segments.end());
    previous.method = Method::kFull;
    double full_ms = 0;
    for (const Case& c : cases) {
      req.method = c.method;
      req.knobs = c.knobs;
      if (c.target_ratio > 0) {
        // The schedule's ratio counts segments; the reached one counts the tokens of the
        // segments importance kept. Start from the schedule's d, then bisect on what requests
        // reach (a few untimed prefills).
        double d =
            decay_for_average_ratio(static_cast<int32_t>(cfg->num_layers), n, c.target_ratio);
        double lo = 0.0, hi = 1.0, best = d, best_err = 2.0;
        for (int it = 0; it < 10; ++it) {
          req.knobs.keep_decay = d;
          auto pre = (*assembler)->prefill(req);
          if (!pre.is_ok()) return fail(pre.status());
          const double got = pre->stats.recompute_ratio;
          if (std::abs(got - c.target_ratio) < best_err) {
            best_err = std::abs(got - c.target_ratio);
            best = d;
          }
          if (best_err < 0.005) break;
          (got < c.target_ratio ? lo : hi) = d;
          d = 0.5 * (lo + hi);
        }
        req.knobs.keep_decay = best;
      }
      std::vector<double> ms;
      AssembleStats st;
      for (int r = 0; r < warmup + reps; ++r) {
        if (c.method == Method::kPrefix) {
          auto prev = (*assembler)->prefill(previous);
          if (!prev.is_ok()) return fail(prev.status());
        }
        const auto t0 = Clock::now();
        auto pre = (*assembler)->prefill(req);
        const double t = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (!pre.is_ok()) return fail(pre.status());
        if (r >= warmup) ms.push_back(t);
        st = pre->stats;
      }
      const double med = median(ms);
      if (c.method == Method::kFull) full_ms = med;
      const double mib = static_cast<double>(st.bytes_loaded) / (1 << 20);
      std::printf("%-8d %-12s %8lld %10.2f %9.2f %9.2f %8.2f %9.3f %11.1f %8.1f\n", n,
                  c.label.c_str(), static_cast<long long>(mem), med,
                  *std::min_element(ms.begin(), ms.end()), *std::max_element(ms.begin(), ms.end()),
                  full_ms > 0 ? full_ms / med : 0.0, st.recompute_ratio, mib,
                  static_cast<double>(st.bytes_loaded) / (med * 1e6));
      // keep's host time at each check of the last request: where the GPU may wait for it.
      std::string checks;
      for (size_t k = 0; k < st.check_wait_us.size(); ++k) {
        char buf[64];
        std::snprintf(buf, sizeof buf, "%s[%d,%.0f,%.0f]", k ? "," : "", st.check_layers[k],
                      st.check_wait_us[k], st.check_decide_us[k]);
        checks += buf;
      }
      if (!checks.empty()) {
        std::printf(
            "#   host at the checks ([layer, wait for the pooled columns, decision] us): %s\n",
            checks.c_str());
      }
      if (profile) {
        // One more request with the backend's stage events (no graphs): where its GPU time goes,
        // and with rows chosen inside a layer ("choose") how long the stream waited for the host.
        auto* cuda = static_cast<engine::CudaBackend*>(&(*eng)->backend());
        cuda->set_profiling(true);
        auto pre = (*assembler)->prefill(req);
        if (!pre.is_ok()) return fail(pre.status());
        const std::vector<engine::StageTime> stages = cuda->profile();
        cuda->set_profiling(false);
        std::string line;
        for (const engine::StageTime& t : stages) {
          if (t.calls == 0) continue;
          char buf[96];
          std::snprintf(buf, sizeof buf, " %s %.3f ms/%lld", t.stage, t.ms,
                        static_cast<long long>(t.calls));
          line += buf;
        }
        std::printf("#   stages (ms/calls):%s\n", line.c_str());
      }
      if (out) {
        out << "{\"shape\":\"" << shape << "\",\"segments\":" << n << ",\"method\":\"" << c.label
            << "\",\"memory_tokens\":" << mem << ",\"prompt_tokens\":" << st.prompt_tokens
            << ",\"ttft_ms\":" << med << ",\"min_ms\":" << *std::min_element(ms.begin(), ms.end())
            << ",\"max_ms\":" << *std::max_element(ms.begin(), ms.end()) << ",\"reps\":" << reps
            << ",\"recompute_ratio\":" << st.recompute_ratio
            << ",\"bytes_loaded\":" << st.bytes_loaded << ",\"entries\":\""
            << (entries_in_tier ? "tier" : "host") << "\",\"check_host_us\":[" << checks << "]}\n";
      }
    }
  }
  return 0;
}
