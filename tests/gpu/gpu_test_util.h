// What the GPU tests of tests/gpu (plain mains, no doctest: they build where only CUDA is
// installed) share: the CUDA_OK macro, the check counters, a RAII device buffer, random and
// NaN-filled host vectors, dtype names, the relative-norm formula, the KEEP_GPU_TEST_QUICK switch,
// the device banner, the launch timer of the informational timings and parallel_rows for the CPU
// references. Header-only; each test keeps its own checks, tolerances and messages.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "services/worker/kernels/bf16.h"

// Exits with status 2 (not 1: that is a test failure) when a CUDA call fails.
#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    cudaError_t err_ = (expr);                                             \
    if (err_ != cudaSuccess) {                                             \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(err_));                              \
      std::exit(2);                                                        \
    }                                                                      \
  } while (0)

namespace keep::gputest {

// Every check adds one to g_checks and, when it fails, one to g_failures; main prints
// `<test>: N checks, F failures` and exits non-zero on any failure.
inline int g_checks = 0;
inline int g_failures = 0;

// Host T -> device type of the same bytes.
template <typename T>
struct Dev {
  using type = T;
};
template <>
struct Dev<keep::kernels::Bf16> {
  using type = __nv_bfloat16;
};

// Device copy of a host vector, RAII. `shift` elements of padding in front give a pointer that is
// not 16-byte aligned (dev() points past them).
template <typename T>
class Buf {
 public:
  explicit Buf(const std::vector<T>& host, size_t shift = 0) : n_(host.size()), shift_(shift) {
    CUDA_OK(cudaMalloc(&p_, std::max<size_t>(1, n_ + shift_) * sizeof(T)));
    if (n_ > 0) {
      CUDA_OK(cudaMemcpy(static_cast<T*>(p_) + shift_, host.data(), n_ * sizeof(T),
                         cudaMemcpyHostToDevice));
    }
  }
  ~Buf() { cudaFree(p_); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <typename D = typename Dev<T>::type>
  D* dev() {
    return reinterpret_cast<D*>(static_cast<T*>(p_) + shift_);
  }
  std::vector<T> host() const {
    std::vector<T> h(n_);
    if (n_ > 0) {
      CUDA_OK(cudaMemcpy(h.data(), static_cast<const T*>(p_) + shift_, n_ * sizeof(T),
                         cudaMemcpyDeviceToHost));
    }
    return h;
  }

 private:
  void* p_ = nullptr;
  size_t n_;
  size_t shift_;
};

// n values uniform in [lo, hi), rounded to T.
template <typename T>
std::vector<T> random_vec(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = keep::kernels::from_float<T>(d(rng));
  return v;
}

// n quiet NaNs (the poison of outputs: an element a kernel fails to write stays NaN).
template <typename T>
std::vector<T> nan_vec(size_t n) {
  return std::vector<T>(n, keep::kernels::from_float<T>(std::numeric_limits<float>::quiet_NaN()));
}

// ||got - want|| / ||want|| from the two sums of squares; ||got - want|| when want is all zeros.
inline double relative_norm(double diff2, double want2) {
  return want2 > 0.0 ? std::sqrt(diff2 / want2) : std::sqrt(diff2);
}

// KEEP_GPU_TEST_QUICK (set by scripts/gpu-check.sh under compute-sanitizer, which is 100x slower):
// the tests run the same code paths on fewer and smaller cases, without their timings.
inline bool quick() { return std::getenv("KEEP_GPU_TEST_QUICK") != nullptr; }

// Runs f(r0, r1) over slices of [0, rows) on the host's threads: the CPU references of the large
// cases (with test_gemm's on one thread it ran past gpu-check.sh's 120 s limit on an H100). Rows
// are independent in every reference the tests split this way, so the result is the same.
template <typename F>
void parallel_rows(int64_t rows, F f) {
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 32);
  const int64_t n = std::min(rows, threads);
  if (n <= 1) {
    if (rows > 0) f(int64_t{0}, rows);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t i = 0; i < n; ++i) pool.emplace_back(f, rows * i / n, rows * (i + 1) / n);
  for (auto& t : pool) t.join();
}

// The informational timings (never a check): off when quick, and when KEEP_GPU_TEST_TIMINGS=0
// (scripts/gpu-check.sh's default: benchmarks/ hold the performance figures).
inline bool timings() {
  const char* t = std::getenv("KEEP_GPU_TEST_TIMINGS");
  return !quick() && !(t != nullptr && std::string(t) == "0");
}

// Per-launch times in ms, median and minimum over the samples.
struct LaunchTimes {
  double median_ms = 0.0;
  double min_ms = 0.0;
};

// Times `launch` (a callable returning cudaError_t, or void where it checks its calls itself):
// `warmup` launches, then `samples` samples of `per_sample` launches back to back between two
// events on the legacy stream. Several launches a sample let one launch's host work (argument
// checks, tensor-map encodes) overlap the previous launch's GPU time, as a model's layers issue
// them. For informational timings, never for checks.
template <typename F>
LaunchTimes time_launches(F&& launch, int samples, int per_sample, int warmup) {
  const auto once = [&] {
    if constexpr (std::is_void_v<decltype(launch())>) {
      launch();
    } else {
      CUDA_OK(launch());
    }
  };
  for (int i = 0; i < warmup; ++i) once();
  CUDA_OK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < samples; ++i) {
    CUDA_OK(cudaEventRecord(a));
    for (int j = 0; j < per_sample; ++j) once();
    CUDA_OK(cudaEventRecord(b));
    CUDA_OK(cudaEventSynchronize(b));
    float t = 0.0f;
    CUDA_OK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(static_cast<double>(t) / per_sample);
  }
  CUDA_OK(cudaEventDestroy(a));
  CUDA_OK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front()};
}

// Counts a failed check: `FAIL what: detail` on stderr.
inline void fail(const std::string& what, const std::string& detail) {
  ++g_failures;
  std::fprintf(stderr, "FAIL %s: %s\n", what.c_str(), detail.c_str());
}

// Prints `device: <name> (sm_XY)` for device 0; false (after `no CUDA device` on stderr) when
// there is none (main then returns 2).
// Also makes stdout line-buffered: a test killed at its time limit (gpu-check.sh, compute-sanitizer
// passes writing to a log) then still shows which case it was in.
inline bool print_device() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return false;
  }
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  return true;
}

}  // namespace keep::gputest
