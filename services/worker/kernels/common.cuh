// Device helpers shared by the kernels of this folder (not a public header).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <utility>

namespace keep::kernels::detail {

// Whether a pointer allows 16-byte vector accesses (host side, before choosing a kernel form).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Grid size for an elementwise kernel over `n` items, capped (the kernels stride over the rest).
inline unsigned int elementwise_blocks(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 65536 ? blocks : 65536);
}

// A value worked out once per device, then read without a lock (devices 0..63; on others it is
// worked out on every call). get(device, f): f(device) returns {value, keep}; a value not kept (a
// failed query) is asked for again on the next call. Two first calls may both run f, which must
// be idempotent (attribute queries, cudaFuncSetAttribute). Use as a function-local static.
class DeviceMemo {
 public:
  DeviceMemo() {
    for (auto& v : value_) v.store(kUnknown, std::memory_order_relaxed);
  }
  template <typename F>
  int get(int device, F&& f) {
    const bool cached = device >= 0 && device < kDevices;
    if (cached) {
      const int v = value_[device].load(std::memory_order_acquire);
      if (v != kUnknown) return v;
    }
    const std::pair<int, bool> r = f(device);
    if (cached && r.second) value_[device].store(r.first, std::memory_order_release);
    return r.first;
  }

 private:
  static constexpr int kDevices = 64;
  static constexpr int kUnknown = INT_MIN;
  std::atomic<int> value_[kDevices];
};

// ---- programmatic dependent launch (sm_90) ----
// launch_dependent() starts a kernel with programmatic stream serialization: it may begin while
// the previous kernel of its stream is still running, once every block of that kernel has called
// allow_next_grid() or exited. So a kernel launched this way calls wait_previous_grid() before it
// touches global memory that an earlier kernel writes or reads (only read-only data such as
// weights may come before), and that wait returns once the previous kernel has completed and its
// writes are visible. Both are no-ops in a kernel launched plainly. What overlaps is the launch,
// the block's set-up (shared memory, barriers) and loads of weights (gemm_wgmma's first stages)
// with the previous kernel's last blocks. So a kernel that writes weights must not let the next
// one launch early. The non-coherent path (__ldg, const __restrict__) promises data read-only for
// the kernel's lifetime, which a dependent launch starts before the previous kernel's writes land:
// gemv reading x that way broke token-by-token prefill (benchmarks/RESULTS.md run 15).
// add_rmsnorm's norm-only form reads the residual that way and passes every test; new code reads
// the previous kernels' output with coherent loads.
__device__ __forceinline__ void wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The attribute launch_dependent() adds, or none where kernels::dependent_launch() is off.
inline unsigned int dependent_launch_attribute(cudaLaunchAttribute& attr, bool on) {
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return on ? 1u : 0u;
}

bool dependent_launch_on();  // kernels::dependent_launch(), without including kernels.h
// SMs of the current device (cached per device; 132, the H100/H200's, where the query fails):
// sizes grids of persistent kernels and kAuto's attention choice.
int sm_count();

template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr{};
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent_launch_attribute(attr, dependent_launch_on());
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace keep::kernels::detail
