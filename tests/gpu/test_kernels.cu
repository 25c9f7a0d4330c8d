// Each CUDA kernel of services/worker/kernels against its CPU reference (reference.h) on random
// inputs of odd and model-like sizes, in fp32 and bf16, with per-dtype tolerances and a NaN check.
// Outputs are pre-filled with NaN so that an element the kernel fails to write is caught. A plain
// main (no doctest) so that it builds on machines with nothing but CUDA: exit 0 when all pass.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "services/worker/kernels/bf16.h"
#include "services/worker/kernels/kernels.h"
#include "services/worker/kernels/reference.h"

namespace {

using keep::kernels::Bf16;
namespace ref = keep::kernels::ref;

int g_failures = 0;
int g_checks = 0;

#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    cudaError_t err_ = (expr);                                             \
    if (err_ != cudaSuccess) {                                             \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(err_));                              \
      std::exit(2);                                                        \
    }                                                                      \
  } while (0)

// Host T -> device type of the same bytes.
template <typename T>
struct Dev {
  using type = float;
};
template <>
struct Dev<Bf16> {
  using type = __nv_bfloat16;
};

template <typename T>
struct Tol {
  static constexpr float atol = 1e-5f;
  static constexpr float rtol = 1e-4f;
  static constexpr const char* name = "fp32";
};
template <>
struct Tol<Bf16> {  // a result may differ by one rounding: 2 ulp of bf16 (8 mantissa bits)
  static constexpr float atol = 1e-2f;
  static constexpr float rtol = 1.6e-2f;
  static constexpr const char* name = "bf16";
};

// Device buffer, RAII.
template <typename T>
class Buf {
 public:
  explicit Buf(const std::vector<T>& host) : n_(host.size()) {
    CUDA_OK(cudaMalloc(&p_, std::max<size_t>(1, n_) * sizeof(T)));
    if (n_ > 0) CUDA_OK(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Buf() { cudaFree(p_); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <typename D = typename Dev<T>::type>
  D* dev() {
    return reinterpret_cast<D*>(p_);
  }
  std::vector<T> host() const {
    std::vector<T> h(n_);
    if (n_ > 0) CUDA_OK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  void* p_ = nullptr;
  size_t n_;
};

template <typename T>
std::vector<T> random_vec(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = keep::kernels::from_float<T>(d(rng));
  return v;
}

template <typename T>
std::vector<T> nan_vec(size_t n) {
  return std::vector<T>(n, keep::kernels::from_float<T>(std::numeric_limits<float>::quiet_NaN()));
}

template <typename T>
void check(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
  ++g_checks;
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const float g = keep::kernels::to_float(got[i]);
    const float w = keep::kernels::to_float(want[i]);
    const bool nan_bad = std::isnan(g) != std::isnan(w);
    const bool val_bad =
        !std::isnan(w) && std::fabs(g - w) > Tol<T>::atol + Tol<T>::rtol * std::fabs(w);
    if (nan_bad || val_bad) {
      if (bad < 3) {
        std::fprintf(stderr, "FAIL %s [%s] at %zu: got %.8g want %.8g\n", what.c_str(),
                     Tol<T>::name, i, g, w);
      }
      ++bad;
    }
  }
  if (bad > 0) {
    ++g_failures;
    std::fprintf(stderr, "FAIL %s [%s]: %d of %zu elements off\n", what.c_str(), Tol<T>::name, bad,
                 want.size());
  }
}

std::string shape(std::initializer_list<int64_t> dims) {
  std::string s = "(";
  for (int64_t d : dims) s += std::to_string(d) + ",";
  s.back() = ')';
  return s;
}

template <typename T>
void test_embedding(std::mt19937& rng, int64_t n, int64_t hidden, int64_t vocab) {
  const auto table = random_vec<T>(rng, static_cast<size_t>(vocab * hidden), -2.0f, 2.0f);
  std::uniform_int_distribution<int32_t> id(-1, static_cast<int32_t>(vocab));  // a few off-range
  std::vector<int32_t> ids(n);
  for (auto& v : ids) v = id(rng);
  auto want = nan_vec<T>(static_cast<size_t>(n * hidden));
  ref::embedding(want.data(), table.data(), ids.data(), n, hidden, vocab);
  Buf<T> d_table(table);
  Buf<int32_t> d_ids(ids);
  Buf<T> d_out(nan_vec<T>(want.size()));
  CUDA_OK(keep::kernels::embedding(d_out.dev(), d_table.dev(), d_ids.template dev<int32_t>(), n,
                                   hidden, vocab, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  check("embedding " + shape({n, hidden, vocab}), d_out.host(), want);
}

template <typename T>
void test_rmsnorm(std::mt19937& rng, int64_t rows, int64_t cols, bool with_x) {
  const float eps = 1e-6f;
  auto residual = random_vec<T>(rng, static_cast<size_t>(rows * cols), -3.0f, 3.0f);
  const auto x = random_vec<T>(rng, residual.size(), -3.0f, 3.0f);
  const auto weight = random_vec<T>(rng, static_cast<size_t>(cols), 0.5f, 1.5f);
  auto want_res = residual;
  auto want = nan_vec<T>(residual.size());
  ref::rmsnorm_residual(want.data(), want_res.data(), with_x ? x.data() : nullptr, weight.data(),
                        rows, cols, eps);
  Buf<T> d_res(residual), d_x(x), d_w(weight), d_out(nan_vec<T>(residual.size()));
  CUDA_OK(keep::kernels::rmsnorm_residual(d_out.dev(), d_res.dev(), with_x ? d_x.dev() : nullptr,
                                          d_w.dev(), rows, cols, eps, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::string s =
      std::string(with_x ? "rmsnorm+residual " : "rmsnorm ") + shape({rows, cols});
  check(s + " out", d_out.host(), want);
  check(s + " residual", d_res.host(), want_res);
}

template <typename T>
void test_rope(std::mt19937& rng, int64_t n, int64_t heads, int64_t head_dim, int64_t extra) {
  const int64_t half = head_dim / 2;
  const int64_t stride = heads * head_dim + extra;  // extra > 0: rows of a wider fused tensor
  std::vector<float> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[i] =
        static_cast<float>(1.0 / std::pow(1000000.0, 2.0 * i / static_cast<double>(head_dim)));
  }
  std::uniform_int_distribution<int32_t> pos(0, 40000);
  std::vector<int32_t> positions(n);
  for (auto& p : positions) p = pos(rng);
  if (n > 0) positions[0] = 0;  // identity rotation
  const auto x = random_vec<T>(rng, static_cast<size_t>(n * stride), -2.0f, 2.0f);
  auto want = x;
  ref::rope(want.data(), positions.data(), inv_freq.data(), n, heads, head_dim, stride);
  Buf<T> d_x(x);
  Buf<int32_t> d_pos(positions);
  Buf<float> d_inv(inv_freq);
  CUDA_OK(keep::kernels::rope(d_x.dev(), d_pos.template dev<int32_t>(), d_inv.dev(), n, heads,
                              head_dim, stride, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  check("rope " + shape({n, heads, head_dim, stride}), d_x.host(), want);
}

template <typename T>
void test_swiglu(std::mt19937& rng, int64_t n) {
  auto gate = random_vec<T>(rng, static_cast<size_t>(n), -8.0f, 8.0f);
  const auto up = random_vec<T>(rng, static_cast<size_t>(n), -3.0f, 3.0f);
  if (n > 2) {
    gate[0] = keep::kernels::from_float<T>(-100.0f);  // exp(-g) overflows: silu -> -0
    gate[1] = keep::kernels::from_float<T>(100.0f);
  }
  auto want = nan_vec<T>(gate.size());
  ref::swiglu(want.data(), gate.data(), up.data(), n);
  Buf<T> d_gate(gate), d_up(up), d_out(nan_vec<T>(gate.size()));
  CUDA_OK(keep::kernels::swiglu(d_out.dev(), d_gate.dev(), d_up.dev(), n, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  check("swiglu " + shape({n}), d_out.host(), want);
}

template <typename T>
void run_all(std::mt19937& rng) {
  const int64_t odd[] = {1, 3, 7, 19, 733};
  const int64_t hidden[] = {1, 3, 7, 19, 733, 576, 3584};
  for (int64_t n : odd) {
    for (int64_t h : hidden) test_embedding<T>(rng, n, h, 37);
  }
  for (int64_t rows : odd) {
    for (int64_t cols : hidden) {
      if (rows * cols > 733 * 733) continue;
      test_rmsnorm<T>(rng, rows, cols, true);
    }
  }
  test_rmsnorm<T>(rng, 19, 3584, false);
  test_rmsnorm<T>(rng, 70000, 7, true);  // more rows than the grid: the row loop strides
  const int64_t head_dims[] = {2, 6, 14, 38, 64, 128};
  for (int64_t n : odd) {
    for (int64_t hd : head_dims) {
      test_rope<T>(rng, n, n == 733 ? 2 : 3, hd, 0);
      test_rope<T>(rng, n, 1, hd, 5);
    }
  }
  test_rope<T>(rng, 19, 14, 64, 2 * 2 * 64);  // Qwen2.5-0.5B's Q inside a fused QKV row
  for (int64_t n : odd) test_swiglu<T>(rng, n);
  test_swiglu<T>(rng, 733 * 4864);
  test_swiglu<T>(rng, 3584);
}

void test_invalid_arguments() {
  ++g_checks;
  float* p = nullptr;
  int32_t* ip = nullptr;
  const bool ok =
      keep::kernels::rope(p, ip, p, 1, 1, 3, 3, nullptr) == cudaErrorInvalidValue &&  // odd hd
      keep::kernels::rope(p, ip, p, 1, 2, 4, 7, nullptr) == cudaErrorInvalidValue &&  // stride
      keep::kernels::rope(p, ip, p, 1, 1, 4, 4, nullptr) == cudaErrorInvalidValue &&  // null
      keep::kernels::swiglu(p, p, p, -1, nullptr) == cudaErrorInvalidValue &&
      keep::kernels::swiglu(p, p, p, 0, nullptr) == cudaSuccess &&
      keep::kernels::embedding(p, p, ip, 2, 4, 8, nullptr) == cudaErrorInvalidValue &&
      keep::kernels::rmsnorm_residual(p, p, p, p, 0, 5, 1e-6f, nullptr) == cudaSuccess &&
      keep::kernels::rmsnorm_residual(p, p, p, p, 3, 5, 1e-6f, nullptr) == cudaErrorInvalidValue;
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "FAIL launcher argument checks\n");
  }
}

}  // namespace

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 2;
  }
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  std::mt19937 rng(1234);
  run_all<float>(rng);
  run_all<Bf16>(rng);
  test_invalid_arguments();
  std::printf("%d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
