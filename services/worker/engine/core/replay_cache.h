// ReplayCache: which prefill chunks the engine has its backend record as a launch sequence (a CUDA
// graph on the CUDA backend) and replay, instead of running them launch by launch. Engine-internal
// bookkeeping (Engine::prefill_chunk); the recording itself is the backend's
// (Backend::end_capture_for_replay).
//
// A chunk's Key is what makes its layer loop the same launches again. A chunk of kMinRows rows or
// more runs launch by launch the first time its key is seen, is recorded the second time (so a
// one-off prompt pays no capture), and is replayed from the third on. The kCapacity most recently
// used recordings are kept, each with the plan its launches read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "services/worker/engine/core/backend.h"

namespace keep::engine {

class ReplayCache {
 public:
  // Shorter chunks (decode steps, whose key moves with every token) always run launch by launch.
  static constexpr int32_t kMinRows = 64;
  // A replayed chunk runs its first layer launch by launch, then layers [1, kSplitLayer) and
  // [kSplitLayer, layers) as the recording's two parts (Backend::capture_split).
  static constexpr int32_t kSplitLayer = 4;
  static constexpr size_t kCapacity = 4;  // recordings kept

  // The cache, its size before the chunk, the chunk's rows, whether it is the last (one output
  // row) and the hidden buffer (Engine::ensure_rows may move it). The weights and the backend's
  // workspace are the backend's to track (Backend::replay_state).
  struct Key {
    uint64_t cache_id = 0;
    int32_t past = 0;
    int32_t rows = 0;
    bool last_chunk = false;
    const float* hidden = nullptr;
    bool operator==(const Key&) const = default;
  };

  enum class Action : uint8_t {
    kRun,     // launch by launch
    kRecord,  // launch by launch inside a capture, then add()
    kReplay,  // Backend::replay(handle), reading `plan`
  };
  struct Decision {
    Action action = Action::kRun;
    const AttentionPlan* plan = nullptr;  // kReplay: the plan the recording reads
    uint64_t handle = 0;                  // kReplay: the backend's handle
  };

  // What to do with a chunk of `key` (of kMinRows rows or more) on `backend`. A recording the
  // backend no longer has is forgotten and the key counts as seen; one the backend cannot replay
  // under its present settings (Backend::ReplayState::kNotNow) stays, and the chunk runs.
  Decision find(const Backend& backend, const Key& key);
  // Keeps what a kRecord decision recorded (`handle` > 0) with the plan it reads; past kCapacity
  // the least recently used recording goes, dropped on `backend` too.
  void add(Backend& backend, const Key& key, std::unique_ptr<AttentionPlan> plan, uint64_t handle);
  size_t size() const { return recorded_.size(); }

 private:
  struct Recorded {
    Key key;
    std::unique_ptr<AttentionPlan> plan;
    uint64_t handle = 0;
  };
  static constexpr size_t kSeenKeys = 8;
  std::vector<Recorded> recorded_;  // least recently used first
  std::vector<Key> seen_;           // keys run once and not recorded yet, oldest first
};

}  // namespace keep::engine
