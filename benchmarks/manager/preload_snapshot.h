// The retrieve benchmark's fast load path: builds the state of one agent holding M memories
// in-process with the store library (the real tokenizer counts tokens; embeddings come from a
// hashed bag-of-words embedder of the encoder's dimension instead of the BERT encoder, which is
// ~10^4 times faster), and writes it as a snapshot into a data dir that keep-manager then
// recovers from. Retrieval cost (a dense M x dim sgemv, top-k, prompt ordering) does not depend
// on where the vectors came from; what changes is only which memories a query finds.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "shared/common/status.h"

namespace keep::manager {
class MemoryStore;
}  // namespace keep::manager

namespace keep::bench {

struct PreloadOptions {
  std::string agent;
  uint64_t memories = 0;
  std::string tokenizer_path;   // the planner model's tokenizer.json (token counts)
  int dim = 384;                // must equal the manager's encoder dimension
  uint64_t advance_steps = 20;  // steps advanced after the writes (groups turn static)
};

struct PreloadInfo {
  double build_s = 0;     // writes + embeddings + grouping in the store
  double snapshot_s = 0;  // serialise + write the snapshot
  uint64_t bytes = 0;
  uint64_t groups = 0;
};

// The agent's store built in-process (writes, embeddings, steps), with the token counter and
// embedder it points at.
class PreloadedStore {
 public:
  ~PreloadedStore();
  manager::MemoryStore& store();
  double build_s() const;  // writes + embeddings + grouping
  uint64_t groups() const;

 private:
  friend Result<std::unique_ptr<PreloadedStore>> build_store(const PreloadOptions& options);
  struct Impl;
  PreloadedStore();
  std::unique_ptr<Impl> impl_;
};
Result<std::unique_ptr<PreloadedStore>> build_store(const PreloadOptions& options);

// build_store, then its snapshot written under data_dir/snapshots (created).
Result<PreloadInfo> preload_snapshot(const std::string& data_dir, const PreloadOptions& options);

}  // namespace keep::bench
