// bench_keep: TTFT of one planning step with each method (issue 29, point 5), on the CUDA backend
// with random bf16 weights of a real model's shape made on the GPU.
//
//   build/bin/bench_keep --shape qwen2.5-14b --segments 10,20,40,80 [--memory-tokens 4096]
//                        [--reps 10] [--warmup 3] [--decays 0.96,0.80] [--json FILE]
//                        [--methods full,keep,...]   (default: all; with CUPTI, one at a time)
//
// A prompt is [system prefix (32)][segments][query (128)], random token ids. Segments come in
// the household kinds' relative lengths (object state 25, task record 15, example plan 80; in
// turn), scaled so that --segments 40 holds --memory-tokens in all (0: unscaled). Each segment's
// KV is produced as keep-worker produces it ([prefix][segment], prefix dropped, bf16 pre-RoPE K)
// into one host buffer registered for the GPU, as the shared region is: loads read it in place.
// Each method then runs the same prompt `reps` times (after `warmup`), TTFT = the assembled
// prefill to the last token's logits on the host. Printed per (segments, method): TTFT median,
// min and max, the ratio to `full` in the same run, the mean recompute ratio, bytes loaded and the
// load rate over the TTFT.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/model_shapes.h"
#include "services/worker/engine/cuda/cuda_backend.h"
#include "services/worker/engine/cuda/host_registration.h"
#include "services/worker/keep/kv_assembler.h"

namespace {

using namespace keep;
using namespace keep::worker;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage =
    "usage: bench_keep --shape NAME [--segments N[,N...]] [--memory-tokens T] [--reps R]\n"
    "                  [--warmup W] [--decays D[,D...]] [--json FILE] [--methods M[,M...]]\n";

int fail(const Status& st) {
  std::fprintf(stderr, "bench_keep: %s\n", st.to_string().c_str());
  return 1;
}
int refuse(const std::string& why) {
  std::fprintf(stderr, "bench_keep: %s\n%s", why.c_str(), kUsage);
  return 2;
}

template <typename T>
bool parse_list(const std::string& s, std::vector<T>* out) {
  out->clear();
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = std::min(s.find(',', at), s.size());
    const std::string item = s.substr(at, comma - at);
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0' || v <= 0) return false;
    out->push_back(static_cast<T>(v));
    at = comma + 1;
  }
  return !out->empty();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Case {
  std::string label;
  Method method;
  MethodKnobs knobs;
};

}  // namespace

int main(int argc, char** argv) {
  std::string shape, json, methods = "full,full_reuse,cacheblend,epic,keep";
  std::vector<int32_t> segment_counts = {10, 20, 40, 80};
  std::vector<double> decays = {0.96};
  int64_t memory_tokens = 4096;
  int reps = 10, warmup = 3;
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

  auto backend = engine::CudaBackend::create_random(*cfg, 20261202);
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

  std::vector<Case> cases;
  cases.push_back({"full", Method::kFull, {}});
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

  // --methods: a case runs when its method's name is in the list (full is the ratios' base).
  const std::string wanted = "," + methods + ",";
  cases.erase(std::remove_if(cases.begin(), cases.end(),
                             [&](const Case& c) {
                               return wanted.find("," + std::string(method_name(c.method)) + ",") ==
                                      std::string::npos;
                             }),
              cases.end());
  if (cases.empty()) return refuse("--methods: none of full, full_reuse, cacheblend, epic, keep");
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
                        geometry[s], 0};
      req.segments.push_back(std::move(ps));
      mem += lengths[s];
    }
    req.query = query;
    double full_ms = 0;
    for (const Case& c : cases) {
      req.method = c.method;
      req.knobs = c.knobs;
      std::vector<double> ms;
      AssembleStats st;
      for (int r = 0; r < warmup + reps; ++r) {
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
      if (out) {
        out << "{\"shape\":\"" << shape << "\",\"segments\":" << n << ",\"method\":\"" << c.label
            << "\",\"memory_tokens\":" << mem << ",\"ttft_ms\":" << med
            << ",\"recompute_ratio\":" << st.recompute_ratio
            << ",\"bytes_loaded\":" << st.bytes_loaded << "}\n";
      }
    }
  }
  return 0;
}
