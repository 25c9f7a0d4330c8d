// LoadSchedule: the order in which a request's KV loads are queued (layer-balanced loading,
// ARCHITECTURE §5). Plain data: the assembler feeds it, the backend's loader stream runs it.
//
// A slot loaded at layer i is loaded at every later layer (the recomputed set only shrinks), so
// the loads of a request come in cohorts: the slots that stop being computed at layer s, loaded at
// layers s .. L-1. Before layer l runs, before_layer(l) names what to queue, in this order:
//   1. layer l of every cohort not queued for it yet (what layer l cannot run without);
//   2. layer l + 1 of every cohort (the paper's "next layer of the segments still reused");
//   3. layers l + 2, l + 3, ... of the cohorts, nearest layer first, while the bytes queued for
//      layers after l + 1 stay within `budget_bytes`.
// The loader runs its queue in order, so the budget bounds how long a cohort created by a later
// check waits behind prefetched layers (budget / link bandwidth), while the compute of the early,
// expensive layers hides the loads of the later ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace keep::worker {

class LoadSchedule {
 public:
  LoadSchedule(int32_t layers, uint64_t budget_bytes)
      : layers_(layers), budget_(budget_bytes), queued_(static_cast<size_t>(layers), 0) {}

  // A cohort loaded from `first_layer` on, `bytes_per_layer` a layer; returns its index.
  int32_t add_cohort(int32_t first_layer, uint64_t bytes_per_layer);

  struct Item {
    int32_t layer = 0;
    int32_t cohort = 0;
  };
  // What to queue before layer `layer` runs (call with layers in increasing order).
  std::vector<Item> before_layer(int32_t layer) { return before_layer(layer, budget_); }
  // The same with this call's budget instead of the constructor's: the caller may let the loader
  // run further ahead while the layers are compute-heavy (LoadOptions::prefetch_bytes_recomputing).
  std::vector<Item> before_layer(int32_t layer, uint64_t budget_bytes);

  // Bytes queued so far for layers after `layer`.
  uint64_t ahead_of(int32_t layer) const;
  int32_t cohorts() const { return static_cast<int32_t>(cohorts_.size()); }

 private:
  struct Cohort {
    int32_t next = 0;  // the next layer to queue
    uint64_t bytes = 0;
  };
  void take(int32_t layer, int32_t cohort, std::vector<Item>* out);

  int32_t layers_;
  uint64_t budget_;
  std::vector<Cohort> cohorts_;
  std::vector<uint64_t> queued_;  // (layers) bytes queued per layer
};

}  // namespace keep::worker
