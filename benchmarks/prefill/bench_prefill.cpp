// bench_prefill: time-to-first-token of a full causal prefill and batch-1 decode tokens/s on the
// CUDA backend, random bf16 weights of a real model's shape made on the GPU.
//
//   build/bin/bench_prefill --shape qwen2.5-7b --tokens 1024,2048,4096 [--reps 10] [--warmup 3]
//       [--decode 64] [--decode-context 1024] [--json out.jsonl] [--graphs both|on|off|ab]
//       [--profile] [--logits f32rows|f32|bf16] [--attention auto|mma|wgmma|wgmma1k|wide]
//       [--gap-ms G]
//       [--fused-swiglu-rows R] [--gemm-autotune-rows R] [--own-gemm on|off|only]
//       [--pdl on|off|ab] [--l2-persist on|off]
//
// TTFT = wall time of Engine::prefill (embedding, every layer, final norm + lm_head of the last
// row, logits copied to the host), the prompt in one chunk; median of --reps after --warmup runs.
// --gap-ms G leaves the GPU idle for G ms before each run: a planner's request arrives after the
// agent acted, not back to back (back to back, an H200 at its 700 W limit lowers its clocks).
// Decode: greedy generation of --decode tokens after a --decode-context prompt, minus the same
// prompt's one-token generation, per token. --graphs both (the default) times everything launch
// by launch ("keep") and then with CUDA graphs on (CudaBackendOptions::graphs, "keep-graphs": the
// timed prefills, whose shape recurs, replay from their third run, warm-up included); on and off
// time one of them, ab the two in alternation within each rep (give it 2 warm-up runs or more);
// --profile prints the GPU time of each stage of the layers (CudaBackend::profile, launch by
// launch); --attention picks the prefill attention's
// tensor-core instructions (CudaBackendOptions::prefill_attention); --fused-swiglu-rows sets
// CudaBackendOptions::fused_swiglu_rows (0: cuBLAS + swiglu_rows always); --gemm-autotune-rows
// sets CudaBackendOptions::gemm_autotune_rows (0: cuBLAS's default algorithms only); --own-gemm off
// keeps our own product out of that tuning (CudaBackendOptions::gemm_own_products), --own-gemm
// only takes it for every product it fits whatever it times (gemm_own_only); --pdl off
// launches every kernel plainly (kernels::set_dependent_launch), --pdl ab times the prefills with
// and without programmatic dependent launch in alternation ("keep" and "keep-nopdl"); --l2-persist
// sets CudaBackendOptions::l2_persist_residual. --help prints the options; a bad one is refused in
// one line on stderr with exit status 2 (benchmarks/prefill/cli_test.sh). Back to back
// (--gap-ms 0, the default) a line after each length gives the energy of a prefill from the GPU's
// energy counter (NVML, where the driver's library loads).
// benchmarks/prefill/run.sh runs this and HF transformers (hf_prefill.py) in one go and prints the
// ratios.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>
#include <dlfcn.h>

#include "benchmarks/model_shapes.h"
#include "services/worker/engine/core/engine.h"
#include "services/worker/engine/cuda/cuda_backend.h"

using namespace keep::engine;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kUsage =
    "usage: bench_prefill --shape NAME --tokens N[,N...] [--reps R] [--warmup W] [--decode T]\n"
    "  [--decode-context N] [--json FILE] [--graphs both|on|off|ab] [--profile]\n"
    "  [--logits f32rows|f32|bf16] [--attention auto|mma|wgmma|wgmma1k|wide] [--gap-ms G]\n"
    "  [--fused-swiglu-rows R] [--gemm-autotune-rows R] [--own-gemm on|off|only]\n"
    "  [--pdl on|off|ab] [--l2-persist on|off]\n";

// A refused command line: one line on stderr, exit status 2.
int refuse(const std::string& msg) {
  std::fprintf(stderr, "bench_prefill: %s (--help lists the options)\n", msg.c_str());
  return 2;
}

// The whole of s as an integer in [lo, hi].
bool parse_int(const std::string& s, int64_t lo, int64_t hi, int64_t* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

// One option of the command line: its flag, what its value may be (empty: a switch, no value) and
// how the value is taken (false: refused).
struct Option {
  std::string flag;
  std::string accepts;
  std::function<bool(const char*)> take;
};

template <typename T>
Option integer_option(const char* flag, int64_t lo, int64_t hi, T* dst) {
  return {flag, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
          [=](const char* v) {
            int64_t x = 0;
            if (!parse_int(v, lo, hi, &x)) return false;
            *dst = static_cast<T>(x);
            return true;
          }};
}

Option choice_option(const char* flag, const std::vector<std::string>& values, std::string* dst) {
  std::string accepts;
  for (const auto& v : values) accepts += (accepts.empty() ? "" : "|") + v;
  return {flag, "one of " + accepts, [=](const char* v) {
            if (std::find(values.begin(), values.end(), v) == values.end()) return false;
            *dst = v;
            return true;
          }};
}

int fail(const keep::Status& st) {
  std::fprintf(stderr, "bench_prefill: %s\n", st.to_string().c_str());
  return 1;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Matrix-product and attention FLOPs of a causal prefill of n tokens (last row's lm_head only).
double prefill_flops(const ModelConfig& c, int64_t n) {
  const double C = double(c.hidden_size), q = double(c.q_dim()), kv = double(c.kv_dim()),
               I = double(c.intermediate_size), L = double(c.num_layers);
  const double linear = 2.0 * n * L * (C * (q + 2 * kv) + q * C + 3.0 * C * I);
  const double attention =
      4.0 * double(c.head_dim) * double(c.num_heads) * L * (double(n) * (n + 1) / 2);
  return linear + attention + 2.0 * C * double(c.vocab_size);
}

// The GPU's energy counter (NVML's total energy since the driver loaded, in mJ), through the
// driver's libnvidia-ml loaded at run time: none where it is missing. Read around the timed
// prefills; back to back (--gap-ms 0) its difference over the reps is what a prefill costs in
// energy, the figure a power-capped GPU's speed follows. (Its clock and power readings refresh
// every ~100 ms on the H200s we use, too coarse for one 40 ms prefill; the counter integrates.)
class GpuEnergy {
 public:
  explicit GpuEnergy(int cuda_device) {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) return;
    using Init = int (*)();
    using ByBus = int (*)(const char*, void**);
    auto init = reinterpret_cast<Init>(dlsym(lib_, "nvmlInit_v2"));
    auto by_bus = reinterpret_cast<ByBus>(dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    energy_ = reinterpret_cast<Energy>(dlsym(lib_, "nvmlDeviceGetTotalEnergyConsumption"));
    char bus[32] = {};
    if (init == nullptr || by_bus == nullptr || energy_ == nullptr || init() != 0 ||
        cudaDeviceGetPCIBusId(bus, sizeof(bus), cuda_device) != cudaSuccess ||
        by_bus(bus, &device_) != 0) {
      energy_ = nullptr;
    }
  }
  ~GpuEnergy() {
    if (lib_ != nullptr) dlclose(lib_);
  }
  GpuEnergy(const GpuEnergy&) = delete;
  GpuEnergy& operator=(const GpuEnergy&) = delete;
  // Millijoules, or -1 where the counter cannot be read.
  double millijoules() const {
    unsigned long long mj = 0;
    return energy_ != nullptr && energy_(device_, &mj) == 0 ? static_cast<double>(mj) : -1.0;
  }

 private:
  using Energy = int (*)(void*, unsigned long long*);
  void* lib_ = nullptr;
  void* device_ = nullptr;
  Energy energy_ = nullptr;
};

// N[,N...], each in [1, 32768]; false for anything else.
bool parse_lengths(const char* s, std::vector<int64_t>* out) {
  std::vector<int64_t> lens;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int64_t n = 0;
    if (!parse_int(item, 1, 32768, &n)) return false;
    lens.push_back(n);
  }
  if (lens.empty() || s[std::strlen(s) - 1] == ',') return false;
  *out = std::move(lens);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "qwen2.5-7b", json, graphs = "both", logits = "f32rows";
  keep::kernels::PrefillKernel attention = CudaBackendOptions{}.prefill_attention;
  bool profile = false;
  std::vector<int64_t> lens = {1024, 2048, 4096};
  int reps = 10, warmup = 3, decode = 64, gap_ms = 0;
  int fused_swiglu_rows = CudaBackendOptions{}.fused_swiglu_rows;
  int gemm_autotune_rows = CudaBackendOptions{}.gemm_autotune_rows;
  std::string own_gemm = CudaBackendOptions{}.gemm_own_products ? "on" : "off";
  std::string l2_persist = CudaBackendOptions{}.l2_persist_residual ? "on" : "off";
  std::string pdl = "on";
  int64_t decode_context = 1024;
  const std::vector<Option> opts = {
      choice_option("--shape", keep::bench::model_shape_names(), &shape),
      {"--tokens", "N[,N...] with each N in [1, 32768]",
       [&](const char* v) { return parse_lengths(v, &lens); }},
      integer_option("--reps", 1, 1000000, &reps),
      integer_option("--warmup", 0, 1000000, &warmup),
      integer_option("--decode", 0, 32768, &decode),
      integer_option("--decode-context", 1, 32768, &decode_context),
      {"--json", "a file name",
       [&](const char* v) {
         json = v;
         return !json.empty();
       }},
      choice_option("--graphs", {"both", "on", "off", "ab"}, &graphs),
      {"--profile", "",
       [&](const char*) {
         profile = true;
         return true;
       }},
      choice_option("--logits", {"f32rows", "f32", "bf16"}, &logits),
      {"--attention", "one of auto|mma|wgmma|wgmma1k|wide",
       [&](const char* v) { return keep::kernels::parse_prefill_kernel(v, &attention); }},
      integer_option("--gap-ms", 0, 3600000, &gap_ms),
      integer_option("--fused-swiglu-rows", 0, 1 << 30, &fused_swiglu_rows),
      integer_option("--gemm-autotune-rows", 0, 1 << 30, &gemm_autotune_rows),
      choice_option("--own-gemm", {"on", "off", "only"}, &own_gemm),
      choice_option("--pdl", {"on", "off", "ab"}, &pdl),
      choice_option("--l2-persist", {"on", "off"}, &l2_persist),
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s  shapes:", kUsage);
      for (const auto& n : keep::bench::model_shape_names()) std::printf(" %s", n.c_str());
      std::printf("\n");
      return 0;
    }
    const auto o =
        std::find_if(opts.begin(), opts.end(), [&](const Option& x) { return x.flag == a; });
    if (o == opts.end()) return refuse("unknown argument '" + a + "'");
    if (o->accepts.empty()) {
      o->take(nullptr);
      continue;
    }
    if (i + 1 >= argc) return refuse(a + " needs a value: " + o->accepts);
    const char* v = argv[++i];
    if (!o->take(v)) return refuse(a + " '" + v + "': not " + o->accepts);
  }
  if (pdl == "ab" && graphs == "ab") return refuse("--pdl ab and --graphs ab: one A/B at a time");
  const auto cfg = keep::bench::model_shape(shape);
  if (!cfg.is_ok()) return fail(cfg.status());
  keep::kernels::set_dependent_launch(pdl != "off");
  CudaBackendOptions options;
  options.fused_swiglu_rows = fused_swiglu_rows;
  options.gemm_autotune_rows = gemm_autotune_rows;
  options.gemm_own_products = own_gemm != "off";
  options.gemm_own_only = own_gemm == "only";
  options.l2_persist_residual = l2_persist == "on";
  if (logits == "f32rows") {
    options.logits = CudaBackendOptions::Logits::kF32Rows;
  } else if (logits == "f32") {
    options.logits = CudaBackendOptions::Logits::kF32;
  } else {  // bf16
    options.logits = CudaBackendOptions::Logits::kBF16;
  }
  options.prefill_attention = attention;
  const int64_t max_len = std::max(*std::max_element(lens.begin(), lens.end()), decode_context);
  // The results file before the weights: a path that cannot be written fails at once, in one line.
  std::ofstream out;
  if (!json.empty()) {
    out.open(json, std::ios::app);
    if (!out) {
      std::fprintf(stderr, "bench_prefill: cannot open --json %s for appending: %s\n", json.c_str(),
                   std::strerror(errno));
      return 1;
    }
  }

  const auto t_load = Clock::now();
  auto backend = CudaBackend::create_random(*cfg, 20261129, options);
  if (!backend.is_ok()) return fail(backend.status());
  const std::string name = (*backend)->name();
  auto engine = Engine::create(std::move(backend).value(), static_cast<int32_t>(max_len));
  if (!engine.is_ok()) return fail(engine.status());
  Engine& e = **engine;
  std::printf("# %s | %s | weights made in %.1f s\n", shape.c_str(), name.c_str(),
              std::chrono::duration<double>(Clock::now() - t_load).count());
  auto cache = KvCache::create(e.backend(), static_cast<int32_t>(max_len + decode + 1));
  if (!cache.is_ok()) return fail(cache.status());

  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg->vocab_size) - 1);
  std::vector<int32_t> ids(static_cast<size_t>(max_len));
  for (auto& t : ids) t = tok(rng);

  auto& cuda = static_cast<CudaBackend&>(e.backend());

  // TTFTs of prefills of n tokens; with --pdl ab or --graphs ab, each rep times both settings, in
  // turn first (ms_off gets the runs without programmatic dependent launch, or without graphs).
  // Back to back, the energy of the timed prefills goes to joules (per prefill; -1 where it cannot
  // be read).
  const bool ab = pdl == "ab" || graphs == "ab";
  auto set_b = [&](bool on) {
    if (pdl == "ab") keep::kernels::set_dependent_launch(on);
    if (graphs == "ab") cuda.set_graphs(on);
  };
  const GpuEnergy energy(options.device);
  double joules = -1.0;
  auto time_prefill = [&](int64_t n, std::vector<double>& ms,
                          std::vector<double>* ms_off = nullptr) -> keep::Status {
    ms.clear();
    if (ms_off != nullptr) ms_off->clear();
    double mj0 = -1.0;
    for (int r = 0; r < warmup + reps; ++r) {
      if (r == warmup) mj0 = energy.millijoules();
      for (int pass = 0; pass < (ms_off != nullptr ? 2 : 1); ++pass) {
        const bool off = ms_off != nullptr && (pass + r) % 2 == 1;
        if (ms_off != nullptr) set_b(!off);
        cache->set_size(0);
        if (gap_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
        const auto t0 = Clock::now();
        auto lg = e.prefill(*cache, std::span<const int32_t>(ids.data(), static_cast<size_t>(n)));
        const double t = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (!lg.is_ok()) return lg.status();
        if (r >= warmup) (off ? *ms_off : ms).push_back(t);
      }
    }
    if (ms_off != nullptr) set_b(true);
    const double mj1 = energy.millijoules();
    joules = gap_ms == 0 && ms_off == nullptr && mj0 >= 0.0 && mj1 >= mj0
                 ? (mj1 - mj0) / 1000.0 / static_cast<double>(reps)
                 : -1.0;
    return keep::Status::ok();
  };
  // Per-token decode time: generate(decode + 1) minus generate(1), medians of 3.
  GenerateOptions g;
  g.stop_at_eos = false;
  const std::span<const int32_t> prompt(ids.data(), static_cast<size_t>(decode_context));
  auto time_decode = [&](double& per_token) -> keep::Status {
    std::vector<double> one, many;
    for (int r = 0; r < 3; ++r) {
      g.max_tokens = 1;
      auto t0 = Clock::now();
      auto a = e.generate(prompt, g);
      one.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      g.max_tokens = decode + 1;
      t0 = Clock::now();
      auto b = e.generate(prompt, g);
      many.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      if (!a.is_ok()) return a.status();
      if (!b.is_ok()) return b.status();
    }
    per_token = (median(many) - median(one)) / decode;
    return keep::Status::ok();
  };

  // Launch by launch (graphs off) is "keep"; graphs on (the backend's default: a prefill whose
  // shape recurs, as every timed one here does, replays as CUDA graphs from its third run) is
  // "keep-graphs". --graphs ab times both in alternation in one mode ("keep-graphs" and "keep").
  std::vector<bool> modes;
  if (graphs == "off" || graphs == "both") modes.push_back(false);
  if (graphs != "off") modes.push_back(true);
  for (bool on : modes) {
    cuda.set_graphs(on);
    const std::string tag = on ? "keep-graphs" : "keep";
    std::printf("%-14s %-14s %7s %10s %10s %10s %9s\n", "shape", "engine", "tokens", "ttft_ms",
                "min_ms", "tok/s", "TFLOP/s");
    for (int64_t n : lens) {
      std::vector<double> ms, ms_off;
      if (auto st = time_prefill(n, ms, ab ? &ms_off : nullptr); !st.is_ok()) return fail(st);
      auto report = [&](const std::string& who, const std::vector<double>& t) {
        const double med = median(t);
        const double least = *std::min_element(t.begin(), t.end());
        const double tflops = prefill_flops(*cfg, n) / (med * 1e-3) / 1e12;
        std::printf("%-14s %-14s %7lld %10.2f %10.2f %10.0f %9.1f\n", shape.c_str(), who.c_str(),
                    (long long)n, med, least, n / (med * 1e-3), tflops);
        if (out) {
          out << "{\"engine\":\"" << who << "\",\"shape\":\"" << shape << "\",\"tokens\":" << n
              << ",\"ttft_ms\":" << med << ",\"min_ms\":" << least << ",\"tflops\":" << tflops;
          if (joules > 0.0 && who == tag) out << ",\"joules\":" << joules;
          out << "}\n";
        }
      };
      report(tag, ms);
      if (ab) report(graphs == "ab" ? std::string("keep") : tag + "-nopdl", ms_off);
      if (joules > 0.0) {
        std::printf("%-14s %-14s %7lld energy %.2f J a prefill back to back (NVML), %.0f W\n",
                    shape.c_str(), tag.c_str(), (long long)n, joules, joules / (median(ms) * 1e-3));
      }
    }
    if (decode > 0) {
      double per_token = 0.0;
      if (auto st = time_decode(per_token); !st.is_ok()) return fail(st);
      std::printf("%-14s %-14s decode after %lld tokens: %.3f ms/token, %.1f tokens/s\n",
                  shape.c_str(), tag.c_str(), (long long)decode_context, per_token,
                  1000.0 / per_token);
      if (out) {
        out << "{\"engine\":\"" << tag << "\",\"shape\":\"" << shape
            << "\",\"decode_context\":" << decode_context
            << ",\"decode_ms_per_token\":" << per_token << "}\n";
      }
    }
  }
  cuda.set_graphs(false);

  // --profile: GPU time per stage of the layers and around them (events between launches, graphs
  // off), one prefill per length and (with --decode) 16 decode steps.
  if (profile) {
    // The layers' stages, then embed, logits and copy_out; what no stage holds is host time the
    // GPU waited through (the plan, launches, the final synchronisation).
    auto show = [&](const std::string& what, const std::vector<StageTime>& st, double wall_ms) {
      double sum = 0.0, layers = 0.0;
      for (const auto& t : st) {
        sum += t.ms;
        if (t.layer) layers += t.ms;
      }
      std::printf(
          "profile %s: layers' stages %.2f ms, embed + logits + copy %.2f ms, no stage %.2f ms, "
          "of %.2f ms wall\n",
          what.c_str(), layers, sum - layers, wall_ms - sum, wall_ms);
      for (const auto& t : st) {
        if (t.calls == 0) continue;
        std::printf("  %-11s %9.3f ms %5.1f%%  %6lld calls  %8.1f us/call\n", t.stage, t.ms,
                    100.0 * t.ms / sum, (long long)t.calls, 1000.0 * t.ms / double(t.calls));
      }
    };
    for (int64_t n : lens) {
      cache->set_size(0);
      cuda.set_profiling(true);
      const auto t0 = Clock::now();
      auto lg = e.prefill(*cache, std::span<const int32_t>(ids.data(), static_cast<size_t>(n)));
      const double wall = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (!lg.is_ok()) return fail(lg.status());
      auto st = cuda.profile();
      cuda.set_profiling(false);
      show("prefill " + std::to_string(n), st, wall);
    }
    if (decode > 0) {
      g.max_tokens = 1;
      auto a = e.generate(prompt, g);  // warm
      if (!a.is_ok()) return fail(a.status());
      g.max_tokens = 17;
      cuda.set_profiling(true);
      const auto t0 = Clock::now();
      auto b = e.generate(prompt, g);
      const double wall = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (!b.is_ok()) return fail(b.status());
      auto st = cuda.profile();
      cuda.set_profiling(false);
      show("generate 17 after " + std::to_string(decode_context) + " (prefill + 16 steps)", st,
           wall);
    }
  }
  return 0;
}
