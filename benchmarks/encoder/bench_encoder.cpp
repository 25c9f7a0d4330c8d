// bench_encoder: sentences per second of the BERT encoder at batch 1 and batch 32, on
// household-memory-like sentences (10-25 tokens). Threads: OpenBLAS's (OPENBLAS_NUM_THREADS).
//
//   OPENBLAS_NUM_THREADS=1 build/bin/bench_encoder [--model models/all-MiniLM-L6-v2]
//                                                  [--seconds 3]
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "services/manager/encoder/bert_encoder.h"
#include "shared/blas/gemm.h"
#include "shared/common/log.h"

namespace {

std::vector<std::string> make_sentences(size_t n) {
  const char* objects[] = {"red cup", "plate", "apple", "towel",       "remote control", "laptop",
                           "sponge",  "knife", "book",  "milk bottle", "lamp",           "pillow"};
  const char* places[] = {"kitchen counter", "fridge",   "sink",       "sofa",    "dining table",
                          "bedroom shelf",   "drawer 2", "dishwasher", "hallway", "desk"};
  const char* templates[] = {
      "The %s is on the %s.",
      "Task done: moved the %s to the %s and checked that it is stable.",
      "Plan: walk to the %s, pick up the %s, then put it back.",
      "The %s near the %s is dirty and should be washed before dinner.",
  };
  std::vector<std::string> out;
  char buf[256];
  for (size_t i = 0; i < n; ++i) {
    const char* t = templates[i % 4];
    const char* a = objects[(i * 7) % 12];
    const char* b = places[(i * 3) % 10];
    if (i % 4 == 2) std::swap(a, b);
    std::snprintf(buf, sizeof buf, t, a, b);
    out.emplace_back(buf);
  }
  return out;
}

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Rate {
  double per_wall_s;  // sentences per wall-clock second
  double per_cpu_s;   // sentences per CPU second of this process (all threads)
};

// Encodes `batch`-sized slices of `pool` for about `seconds`.
Rate run(const keep::manager::BertEncoder& enc, const std::vector<std::string>& pool, size_t batch,
         double seconds) {
  using clock = std::chrono::steady_clock;
  size_t done = 0, at = 0;
  (void)enc.encode({pool.begin(), pool.begin() + static_cast<long>(batch)});  // warm-up
  const auto start = clock::now();
  const double cpu_start = cpu_seconds();
  double elapsed = 0;
  while (elapsed < seconds) {
    std::vector<std::string> texts;
    for (size_t i = 0; i < batch; ++i) texts.push_back(pool[(at + i) % pool.size()]);
    at += batch;
    auto r = enc.encode(texts);
    if (!r.is_ok()) {
      std::fprintf(stderr, "encode failed: %s\n", r.status().to_string().c_str());
      std::exit(1);
    }
    done += batch;
    elapsed = std::chrono::duration<double>(clock::now() - start).count();
  }
  return {static_cast<double>(done) / elapsed,
          static_cast<double>(done) / (cpu_seconds() - cpu_start)};
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "models/all-MiniLM-L6-v2";
  double seconds = 3.0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--model") && i + 1 < argc) {
      model = argv[++i];
    } else if (!std::strcmp(argv[i], "--seconds") && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--model DIR] [--seconds S]\n", argv[0]);
      return 2;
    }
  }
  keep::log::set_level(keep::log::Level::kWarn);
  auto enc = keep::manager::BertEncoder::load(model);
  if (!enc.is_ok()) {
    std::fprintf(stderr, "%s\n", enc.status().to_string().c_str());
    return 1;
  }
  const auto pool = make_sentences(256);
  size_t tokens = 0;
  for (const auto& s : pool) tokens += (*enc)->tokenizer().encode(s, 256).size();
  std::printf("model %s, OpenBLAS threads %d, mean tokens/sentence %.1f\n", model.c_str(),
              keep::blas::num_threads(), static_cast<double>(tokens) / pool.size());
  for (size_t batch : {1, 32}) {
    const Rate r = run(**enc, pool, batch, seconds);
    std::printf("batch %2zu: %8.1f sentences/s (wall), %8.1f sentences per CPU-second\n", batch,
                r.per_wall_s, r.per_cpu_s);
  }
  return 0;
}
