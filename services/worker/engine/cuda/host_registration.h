// HostRegistration: host memory page-locked for the GPU (cudaHostRegister) for as long as the
// object lives -- keep-worker registers the shared KV region's mapping once per attach, so that
// the GPU reads entries from it directly (zero-copy) and copies out of it run at pinned speed.
#pragma once

#include <cstddef>
#include <memory>

#include "shared/common/status.h"

namespace keep::engine {

class HostRegistration {
 public:
  // kUnavailable (with CUDA's message) when the memory cannot be registered.
  static Result<std::unique_ptr<HostRegistration>> register_memory(void* base, size_t bytes);
  ~HostRegistration();  // cudaHostUnregister
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

  void* host() const { return base_; }
  size_t bytes() const { return bytes_; }
  // Where device code reads the memory (with unified addressing, the host address itself).
  void* device() const { return device_; }

 private:
  HostRegistration(void* base, size_t bytes, void* device)
      : base_(base), bytes_(bytes), device_(device) {}
  void* base_;
  size_t bytes_;
  void* device_;
};

}  // namespace keep::engine
