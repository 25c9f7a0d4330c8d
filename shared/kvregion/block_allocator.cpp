#include "shared/kvregion/block_allocator.h"

#include <string>

namespace keep::kv {

BlockAllocator::BlockAllocator(uint64_t num_blocks, FitPolicy policy)
    : num_blocks_(num_blocks), policy_(policy) {
  if (num_blocks_ > 0) insert_run(0, num_blocks_);
}

void BlockAllocator::insert_run(uint64_t start, uint64_t length) {
  by_start_.emplace(start, length);
  by_length_.emplace(length, start);
  free_blocks_ += length;
}

void BlockAllocator::erase_run(std::map<uint64_t, uint64_t>::iterator it) {
  by_length_.erase({it->second, it->first});
  free_blocks_ -= it->second;
  by_start_.erase(it);
}

uint64_t BlockAllocator::largest_free_run() const {
  return by_length_.empty() ? 0 : by_length_.rbegin()->first;
}

Result<uint64_t> BlockAllocator::allocate(uint64_t count) {
  if (count == 0 || count > num_blocks_) {
    return Status(Code::kInvalidArgument, "allocate " + std::to_string(count) +
                                              " blocks: arena has " + std::to_string(num_blocks_));
  }
  std::map<uint64_t, uint64_t>::iterator chosen = by_start_.end();
  if (policy_ == FitPolicy::kBestFit) {
    auto it = by_length_.lower_bound({count, 0});
    if (it != by_length_.end()) chosen = by_start_.find(it->second);
  } else if (largest_free_run() >= count) {
    for (auto it = by_start_.begin(); it != by_start_.end(); ++it) {
      if (it->second >= count) {
        chosen = it;
        break;
      }
    }
  }
  if (chosen == by_start_.end()) {
    return Status(Code::kResourceExhausted,
                  "arena full: need a run of " + std::to_string(count) + " blocks, " +
                      std::to_string(free_blocks_) + " of " + std::to_string(num_blocks_) +
                      " blocks free, largest free run " + std::to_string(largest_free_run()));
  }
  const uint64_t start = chosen->first;
  const uint64_t length = chosen->second;
  erase_run(chosen);
  if (length > count) insert_run(start + count, length - count);
  return start;
}

Status BlockAllocator::free(uint64_t first, uint64_t count) {
  if (count == 0 || first >= num_blocks_ || count > num_blocks_ - first) {
    return Status(Code::kInvalidArgument, "free [" + std::to_string(first) + ", +" +
                                              std::to_string(count) + ") out of bounds (" +
                                              std::to_string(num_blocks_) + " blocks)");
  }
  const uint64_t end = first + count;
  auto next = by_start_.lower_bound(first);  // first run starting at or after `first`
  if (next != by_start_.end() && next->first < end) {
    return Status(Code::kInvalidArgument, "free [" + std::to_string(first) + ", +" +
                                              std::to_string(count) + ") overlaps free run at " +
                                              std::to_string(next->first) + " (double free)");
  }
  if (next != by_start_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > first) {
      return Status(Code::kInvalidArgument, "free [" + std::to_string(first) + ", +" +
                                                std::to_string(count) + ") overlaps free run at " +
                                                std::to_string(prev->first) + " (double free)");
    }
  }
  // Coalesce with the neighbours.
  uint64_t start = first;
  uint64_t length = count;
  if (next != by_start_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      start = prev->first;
      length += prev->second;
      erase_run(prev);
    }
  }
  if (next != by_start_.end() && next->first == end) {
    length += next->second;
    erase_run(next);
  }
  insert_run(start, length);
  return Status::ok();
}

Status BlockAllocator::mark_used(uint64_t first, uint64_t count) {
  if (count == 0 || first >= num_blocks_ || count > num_blocks_ - first) {
    return Status(Code::kInvalidArgument, "mark_used [" + std::to_string(first) + ", +" +
                                              std::to_string(count) + ") out of bounds");
  }
  auto it = by_start_.upper_bound(first);
  if (it == by_start_.begin()) {
    return Status(Code::kInvalidArgument, "mark_used [" + std::to_string(first) + ", +" +
                                              std::to_string(count) + ") is not free");
  }
  --it;  // the run starting at or before `first`
  const uint64_t run_start = it->first;
  const uint64_t run_end = it->first + it->second;
  if (first + count > run_end) {
    return Status(Code::kInvalidArgument, "mark_used [" + std::to_string(first) + ", +" +
                                              std::to_string(count) + ") is not free");
  }
  erase_run(it);
  if (first > run_start) insert_run(run_start, first - run_start);
  if (run_end > first + count) insert_run(first + count, run_end - (first + count));
  return Status::ok();
}

bool BlockAllocator::check_invariants() const {
  if (by_start_.size() != by_length_.size()) return false;
  uint64_t sum = 0;
  uint64_t prev_end = 0;
  bool first = true;
  for (const auto& [start, length] : by_start_) {
    if (length == 0 || start + length > num_blocks_) return false;
    if (!first && start <= prev_end) return false;  // overlapping or adjacent (not coalesced)
    if (by_length_.count({length, start}) != 1) return false;
    prev_end = start + length;
    first = false;
    sum += length;
  }
  return sum == free_blocks_;
}

}  // namespace keep::kv
