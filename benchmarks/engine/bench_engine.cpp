// bench_engine: prefill and decode tokens/s of the engine's CPU backend.
//
//   OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2 build/bin/bench_engine
//       [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--prompt 256] [--decode 64] [--reps 3]
//       [--random-smollm2]
//
// --random-smollm2 builds random weights of SmolLM2-135M's exact shape in memory instead of
// loading a file (same arithmetic, for machines without the model file).
//
// Prefill: one causal pass over a `--prompt`-token prompt (chunks of 512 rows), best of --reps.
// Decode: --decode single-token steps after that prompt (greedy), tokens / wall second.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/model_shapes.h"
#include "services/worker/engine/core/engine.h"
#include "services/worker/engine/cpu/cpu_backend.h"
#include "shared/blas/gemm.h"
#include "shared/model/model_weights.h"

using namespace keep::engine;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int fail(const keep::Status& st) {
  std::fprintf(stderr, "bench_engine: %s\n", st.to_string().c_str());
  return 1;
}

std::shared_ptr<ModelWeights> random_smollm2() {
  auto w = std::make_shared<ModelWeights>();
  w->config = keep::bench::model_shape("smollm2-135m").value();
  const ModelConfig& c = w->config;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  auto make = [&](std::vector<int64_t> shape, float offset = 0.0f) {
    Tensor t(std::move(shape));
    for (float& v : t.data) v = offset + u(rng);
    return t;
  };
  const int64_t C = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  w->embed = make({c.vocab_size, C});
  w->final_norm = make({C}, 1.0f);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    LayerWeights lw;
    lw.attn_norm = make({C}, 1.0f);
    lw.ffn_norm = make({C}, 1.0f);
    lw.wq = make({Q, C});
    lw.wk = make({KV, C});
    lw.wv = make({KV, C});
    lw.wo = make({C, Q});
    lw.w_gate = make({I, C});
    lw.w_up = make({I, C});
    lw.w_down = make({C, I});
    w->layers.push_back(std::move(lw));
  }
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  int prompt_len = 256, decode = 64, reps = 3;
  bool random = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--random-smollm2") {
      random = true;
      --i;
    } else if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_engine: %s needs a value\n", a.c_str());
      return 2;
    } else if (a == "--model") {
      model = argv[i + 1];
    } else if (a == "--prompt") {
      prompt_len = std::atoi(argv[i + 1]);
    } else if (a == "--decode") {
      decode = std::atoi(argv[i + 1]);
    } else if (a == "--reps") {
      reps = std::atoi(argv[i + 1]);
    } else {
      std::fprintf(stderr,
                   "usage: bench_engine [--model P | --random-smollm2] [--prompt N] [--decode N] "
                   "[--reps N]\n");
      return 2;
    }
  }
  if (prompt_len < 1 || decode < 1 || reps < 1) {
    std::fprintf(stderr, "bench_engine: sizes must be positive\n");
    return 2;
  }
  std::shared_ptr<ModelWeights> weights;
  if (random) {
    weights = random_smollm2();
    model = "random weights, SmolLM2-135M shape";
  } else {
    LoadOptions lo;
    lo.load_tokenizer = false;
    auto loaded = load_model(model, lo);
    if (!loaded.is_ok()) return fail(loaded.status());
    weights = std::make_shared<ModelWeights>(std::move(loaded->weights));
  }
  auto backend = CpuBackend::create(weights);
  if (!backend.is_ok()) return fail(backend.status());
  const std::string backend_name = (*backend)->name();
  auto engine = Engine::create(std::move(backend).value(), 512);
  if (!engine.is_ok()) return fail(engine.status());
  Engine& e = **engine;

  // A deterministic prompt of ordinary token ids (timing does not depend on the ids).
  std::vector<int32_t> prompt(prompt_len);
  uint64_t x = 88172645463325252ull;
  for (auto& t : prompt) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    t = static_cast<int32_t>(1000 + x % 20000);
  }
  double best_prefill = 1e30, best_decode = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto cache = KvCache::create(e.backend(), prompt_len + decode);
    if (!cache.is_ok()) return fail(cache.status());
    auto t0 = Clock::now();
    auto logits = e.prefill(*cache, prompt);
    if (!logits.is_ok()) return fail(logits.status());
    best_prefill = std::min(best_prefill, seconds_since(t0));
    t0 = Clock::now();
    int32_t tok = argmax(*logits);
    for (int i = 0; i < decode; ++i) {
      auto step = e.decode_step(*cache, tok);
      if (!step.is_ok()) return fail(step.status());
      tok = argmax(*step);
    }
    best_decode = std::min(best_decode, seconds_since(t0));
  }
  std::printf("model %s\nbackend %s\n", model.c_str(), backend_name.c_str());
  std::printf("prefill %d tokens: %.3f s, %.1f tokens/s (best of %d)\n", prompt_len, best_prefill,
              prompt_len / best_prefill, reps);
  std::printf("decode %d tokens after %d: %.3f s, %.1f tokens/s (best of %d)\n", decode, prompt_len,
              best_decode, decode / best_decode, reps);
  return 0;
}
