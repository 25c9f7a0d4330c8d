// BlockAllocator: contiguous runs of arena blocks, kept in the owner's memory only.
//
// Free space is a set of maximal free runs (adjacent free runs are always coalesced), indexed by
// start (for coalescing and double-free detection) and by (length, start) (for the fit). The shared
// directory is the persistent truth: a restarted owner rebuilds the allocator with mark_used() for
// every live entry. Not thread-safe (KvRegion holds its mutex around it).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <utility>

#include "shared/common/status.h"

namespace keep::kv {

enum class FitPolicy : uint8_t {
  kBestFit = 0,   // the smallest free run that fits; the lowest start among equals (default)
  kFirstFit = 1,  // the lowest-addressed free run that fits
};

class BlockAllocator {
 public:
  explicit BlockAllocator(uint64_t num_blocks, FitPolicy policy = FitPolicy::kBestFit);

  // The first block of a run of `count` blocks. kInvalidArgument for 0 or more than the arena;
  // kResourceExhausted when no free run is long enough (the message gives free blocks and the
  // largest run, so fragmentation and a full arena can be told apart).
  Result<uint64_t> allocate(uint64_t count);

  // Returns [first, first + count) to the free space. kInvalidArgument when the range is out of
  // bounds or overlaps free space (a double free); nothing changes then.
  Status free(uint64_t first, uint64_t count);

  // Marks [first, first + count) used (rebuilding from the directory). kInvalidArgument when the
  // range is out of bounds or not entirely free.
  Status mark_used(uint64_t first, uint64_t count);

  uint64_t num_blocks() const { return num_blocks_; }
  uint64_t free_blocks() const { return free_blocks_; }
  uint64_t used_blocks() const { return num_blocks_ - free_blocks_; }
  uint64_t largest_free_run() const;
  size_t free_runs() const { return by_start_.size(); }

  // Full consistency check (tests): the two indexes agree, runs are disjoint, never adjacent,
  // and sum to free_blocks().
  bool check_invariants() const;

 private:
  void insert_run(uint64_t start, uint64_t length);
  void erase_run(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t num_blocks_;
  FitPolicy policy_;
  uint64_t free_blocks_ = 0;
  std::map<uint64_t, uint64_t> by_start_;              // start -> length
  std::set<std::pair<uint64_t, uint64_t>> by_length_;  // (length, start)
};

}  // namespace keep::kv
