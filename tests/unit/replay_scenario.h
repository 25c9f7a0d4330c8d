// The engine's recorded prefills (replay_cache.h) as one scenario for any backend that records:
// the CPU stand-in of tests/unit/test_replay_cache.cpp and the CUDA graphs of
// tests/gpu/test_cuda_engine.cpp. A prefill chunk of a recurring key (cache, size before it,
// length, last or not) runs launch by launch the first time, is recorded the second, and from the
// third replays the recording with the new tokens embedded: bit for bit what an eager prefill of
// those tokens gives (logits and every layer's K/V). Another key is another recording; at most
// ReplayCache::kCapacity are kept, the least recently used dropped; recordings the backend dropped
// are made afresh; while the backend cannot replay (each of `not_now`) the chunk runs launch by
// launch and the recording stays.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "services/worker/engine/core/engine.h"
#include "services/worker/engine/core/replay_cache.h"
#include "tests/unit/engine_test_model.h"

namespace keep::engine::testing {

// What the scenario needs of the backend under test.
struct RecordingHooks {
  std::function<void(bool)> set_recording;  // captures on / off (CUDA: graphs)
  std::function<size_t()> recordings;       // recordings the backend holds
  std::function<uint64_t()> replays;        // recordings replayed since its creation
  std::function<void()> drop_all;           // makes the backend drop every recording
  // The first n elements of a KvView array, as fp32.
  std::function<std::vector<float>(const void* view, size_t n)> view_to_host;
  // Settings under which the backend must not replay: {enter, leave}.
  std::vector<std::pair<std::function<void()>, std::function<void()>>> not_now;
};

// `e` has max_rows >= 100 and at least ReplayCache::kSplitLayer + 2 layers.
inline void check_recorded_prefills(Engine& e, const RecordingHooks& h) {
  const ModelConfig& c = e.config();
  REQUIRE(e.max_rows() >= 100);
  REQUIRE(c.num_layers >= ReplayCache::kSplitLayer + 2);
  const int32_t n = 100;  // one chunk
  REQUIRE(n >= ReplayCache::kMinRows);
  const auto t1 = random_tokens(n, c.vocab_size, 21);
  const auto t2 = random_tokens(n, c.vocab_size, 22);
  const size_t kv_elems = static_cast<size_t>(n) * c.kv_dim();
  auto kv_of = [&](const KvCache& cache) {
    std::vector<std::vector<float>> kv;
    for (int32_t l = 0; l < c.num_layers; ++l) {
      kv.push_back(h.view_to_host(cache.layer(l).k, kv_elems));
      kv.push_back(h.view_to_host(cache.layer(l).v, kv_elems));
    }
    return kv;
  };
  // Eager references: t1's logits, t2's logits and K/V.
  h.set_recording(false);
  auto eager = KvCache::create(e.backend(), 2 * n);
  REQUIRE(eager.is_ok());
  auto ref1 = e.prefill(*eager, t1);
  REQUIRE(ref1.is_ok());
  eager->set_size(0);
  auto ref2 = e.prefill(*eager, t2);
  REQUIRE(ref2.is_ok());
  const auto ref2_kv = kv_of(*eager);
  eager->set_size(0);
  REQUIRE(e.prefill(*eager, t2).is_ok());
  CHECK(h.recordings() == 0);  // captures off: nothing recorded

  h.set_recording(true);
  auto cache = KvCache::create(e.backend(), 2 * n);
  REQUIRE(cache.is_ok());
  auto run = [&](KvCache& kc, int32_t past, const std::vector<int32_t>& t) {
    kc.set_size(past);
    auto r = e.prefill(kc, std::span<const int32_t>(t).first(static_cast<size_t>(n - past)));
    REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
    return *r;
  };
  const uint64_t replays = h.replays();
  auto replayed = [&] { return h.replays() - replays; };
  CHECK(run(*cache, 0, t1) == *ref1);  // first sighting: launch by launch
  CHECK(h.recordings() == 0);
  CHECK(run(*cache, 0, t1) == *ref1);  // second: recorded
  CHECK(h.recordings() == 1);
  CHECK(replayed() == 0);
  CHECK(run(*cache, 0, t2) == *ref2);  // third: replayed with t2's embedding
  CHECK(replayed() == 1);
  CHECK(h.recordings() == 1);
  CHECK(kv_of(*cache) == ref2_kv);
  // Another cache is another key, even of the same shape; so is another size before the chunk.
  auto other = KvCache::create(e.backend(), 2 * n);
  REQUIRE(other.is_ok());
  CHECK(run(*other, 0, t2) == *ref2);
  CHECK(run(*other, 0, t2) == *ref2);
  CHECK(run(*cache, 10, t2) == run(*cache, 10, t2));
  CHECK(replayed() == 1);
  CHECK(h.recordings() == 3);
  // More keys than are kept: the least recently used go, dropped on the backend too.
  for (int32_t past = 1; past <= 3; ++past) {
    run(*cache, past, t1);
    run(*cache, past, t1);
  }
  CHECK(h.recordings() == ReplayCache::kCapacity);
  CHECK(replayed() == 1);
  // (cache, 0, n) was the least recently used: run twice more before it replays again.
  CHECK(run(*cache, 0, t1) == *ref1);
  CHECK(run(*cache, 0, t1) == *ref1);
  CHECK(replayed() == 1);
  CHECK(run(*cache, 0, t2) == *ref2);
  CHECK(replayed() == 2);
  // A replay makes its recording the most recently used: (cache, 1) stays, (cache, 2) goes.
  run(*cache, 1, t1);
  CHECK(replayed() == 3);
  run(*other, 0, t1);
  run(*other, 0, t1);  // recorded: one of the four goes
  run(*cache, 1, t1);
  CHECK(replayed() == 4);
  run(*cache, 2, t1);
  CHECK(replayed() == 4);

  // Recordings the backend dropped: the chunk runs afresh, and is recorded on its next run.
  h.drop_all();
  CHECK(h.recordings() == 0);
  CHECK(run(*cache, 0, t2) == *ref2);
  CHECK(run(*cache, 0, t2) == *ref2);
  CHECK(h.recordings() == 1);
  CHECK(run(*cache, 0, t2) == *ref2);
  CHECK(replayed() == 5);
  CHECK(kv_of(*cache) == ref2_kv);
  // While the backend cannot replay, the recording is not replayed but stays: back as it was
  // recorded, it replays.
  for (const auto& [enter, leave] : h.not_now) {
    const uint64_t before = replayed();
    enter();
    CHECK(run(*cache, 0, t2) == *ref2);
    CHECK(run(*cache, 0, t2) == *ref2);
    leave();
    CHECK(replayed() == before);
    CHECK(h.recordings() == 1);
    CHECK(run(*cache, 0, t1) == *ref1);
    CHECK(replayed() == before + 1);
  }

  // Short chunks (decode steps) are never recorded.
  auto small = KvCache::create(e.backend(), n);
  REQUIRE(small.is_ok());
  const uint64_t before = replayed();
  for (int i = 0; i < 3; ++i) run(*small, n - (ReplayCache::kMinRows - 1), t1);
  CHECK(h.recordings() == 1);
  CHECK(replayed() == before);
}

}  // namespace keep::engine::testing
