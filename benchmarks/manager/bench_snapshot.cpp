// bench_snapshot: how long a keep-manager snapshot keeps the store locked. Writes, retrieves and
// every other store call wait on that lock, so the pause is what clients see. For each M, one
// agent's store of M memories is built in-process (preload_snapshot.h: real token counts, hashed
// bag-of-words embeddings), then, alternating, R times each:
//   serialize   MemoryStore::serialize(): the copy and its encoding (what the lock covered before)
//   capture     MemoryStore::capture(): the copy alone (what it covers now; encode_snapshot runs
//               after the lock is released)
// and checks that encode_snapshot(capture()) gives serialize()'s bytes.
//
//   build/bin/bench_snapshot [--memories 10000,30000] [--reps 5] [--models-dir DIR]
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "benchmarks/manager/bench_support.h"
#include "benchmarks/manager/preload_snapshot.h"
#include "services/manager/store/memory_store.h"
#include "services/manager/store/record_codec.h"
#include "shared/common/options.h"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  keep::Options o("bench_snapshot", "how long a snapshot holds keep-manager's store lock");
  o.add("memories", "10000,30000", "comma-separated memory counts (one agent)");
  o.add("reps", "5", "timings of each form per memory count (medians reported)");
  o.add("models-dir", KEEP_SOURCE_DIR "/models", "directory with qwen2.5-tokenizer/");
  o.add("smoke", "false", "500 memories, one rep: exit 1 unless the two forms give equal bytes");
  keep::Status st = o.parse(argc, argv);
  if (!st.is_ok()) {
    std::fprintf(stderr, "bench_snapshot: %s\n", st.message().c_str());
    return 2;
  }
  if (o.help_requested()) {
    std::fputs(o.help_text().c_str(), stdout);
    return 0;
  }
  auto fail = [](const keep::Status& s) {
    std::fprintf(stderr, "bench_snapshot: %s\n", s.to_string().c_str());
    return 2;
  };
  auto sizes = keep::bench::parse_list(o.str("memories"), "memories");
  auto reps = o.uint64("reps");
  auto smoke = o.boolean("smoke");
  for (const keep::Status& s : {sizes.status(), reps.status(), smoke.status()}) {
    if (!s.is_ok()) return fail(s);
  }
  if (*smoke) {
    *sizes = {500};
    *reps = 1;
  }
  if (*reps == 0) return fail(keep::Status(keep::Code::kInvalidArgument, "--reps must be >= 1"));

  std::printf("%10s %10s %8s %14s %12s %12s %8s\n", "memories", "MB", "build_s", "serialize_ms",
              "capture_ms", "encode_ms", "ratio");
  for (uint64_t m : *sizes) {
    keep::bench::PreloadOptions po;
    po.agent = "bench";
    po.memories = m;
    po.tokenizer_path = o.str("models-dir") + "/qwen2.5-tokenizer/tokenizer.json";
    auto pre = keep::bench::build_store(po);
    if (!pre.is_ok()) return fail(pre.status());
    const keep::manager::MemoryStore& store = (*pre)->store();
    std::vector<double> serialize_ms, capture_ms, encode_ms;
    size_t bytes = 0;
    for (uint64_t r = 0; r < *reps; ++r) {
      auto t0 = Clock::now();
      const std::string whole = store.serialize();
      serialize_ms.push_back(ms_since(t0));
      t0 = Clock::now();
      keep::manager::StoreSnapshot state = store.capture();
      capture_ms.push_back(ms_since(t0));
      t0 = Clock::now();
      const std::string split = keep::manager::encode_snapshot(state);
      encode_ms.push_back(ms_since(t0));
      if (split != whole) {
        std::fprintf(stderr,
                     "bench_snapshot: encode_snapshot(capture()) differs from serialize()\n");
        return 1;
      }
      bytes = whole.size();
    }
    // Medians (summarize's percentiles do not care that these are ms).
    const double s = keep::bench::summarize(serialize_ms).p50_us;
    const double c = keep::bench::summarize(capture_ms).p50_us;
    std::printf("%10llu %10.1f %8.1f %14.2f %12.2f %12.2f %7.2fx\n",
                static_cast<unsigned long long>(m), bytes / 1e6, (*pre)->build_s(), s, c,
                keep::bench::summarize(encode_ms).p50_us, s / c);
  }
  return 0;
}
