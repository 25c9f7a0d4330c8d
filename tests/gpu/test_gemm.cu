// cuBLAS products of gemm.h against a double-precision CPU product of the same bf16 operands, on
// odd and model-like sizes, with row strides wider than the matrices; bf16 and fp32 outputs, and
// fp32 accumulation onto a random residual; NaN-poisoned outputs (an unwritten element fails,
// padding read by an accumulation too); gemm_swiglu (our gate/up product with the SwiGLU fused)
// against its double-precision reference. Prints timings of Qwen2.5-7B's four products at 1024 and
// 4096 rows against what GemmTuner picks for each (informational). A plain main: exit 0 when all
// pass.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nvtx3/nvToolsExt.h>

#include "services/worker/kernels/bf16.h"
#include "services/worker/kernels/gemm.h"
#include "services/worker/kernels/kernels.h"
#include "services/worker/kernels/reference.h"
#include "tests/gpu/gpu_test_util.h"

namespace {

using keep::kernels::Bf16;
using keep::kernels::bf16_to_float;
using keep::kernels::float_to_bf16;

using keep::gputest::g_checks;
using keep::gputest::g_failures;

#define BLAS_OK(expr)                                                      \
  do {                                                                     \
    cublasStatus_t st_ = (expr);                                           \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                    \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #expr, \
                   keep::kernels::blas_status_name(st_));                  \
      std::exit(2);                                                        \
    }                                                                      \
  } while (0)

template <typename T>
T* upload(const std::vector<T>& h) {
  T* p = nullptr;
  CUDA_OK(cudaMalloc(&p, std::max<size_t>(1, h.size()) * sizeof(T)));
  if (!h.empty()) CUDA_OK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

std::vector<Bf16> random_bf16(std::mt19937& rng, size_t n, float a) {
  std::uniform_real_distribution<float> d(-a, a);
  std::vector<Bf16> v(n);
  for (auto& x : v) x = float_to_bf16(d(rng));
  return v;
}

// Our products (gemm_wgmma, gemm_wgmma_accumulate) in check_one: with this scratch and schedule.
struct Ours {
  keep::kernels::GemmScratch scratch;
  keep::kernels::GemmSchedule schedule = keep::kernels::GemmSchedule::kAuto;
  int tile_cols = 0;  // 0: the width gemm_wgmma picks
  int max_ctas = 0;   // 0: every SM
};

// Whether the scratch's flags are all zero again, as every launch must leave them. The scratch
// (of gemm_wgmma_scratch_bytes() bytes) holds `clusters` x 2 partial tiles, then as many flags.
bool flags_clear(const keep::kernels::GemmScratch& s) {
  const size_t flags = s.bytes / keep::kernels::gemm_wgmma_scratch_bytes(1) * 2;
  std::vector<unsigned> h(flags, 1);
  CUDA_OK(cudaMemcpy(h.data(), static_cast<unsigned char*>(s.ptr) + s.bytes - flags * 4, flags * 4,
                     cudaMemcpyDeviceToHost));
  return std::all_of(h.begin(), h.end(), [](unsigned v) { return v == 0; });
}

// Our products' stream-K scratch for this device, zeroed once as the backend's is; empty (null)
// where wgmma does not run. The caller frees its ptr.
keep::kernels::GemmScratch zeroed_scratch() {
  keep::kernels::GemmScratch s;
  if (keep::kernels::wgmma_available() &&
      (s.bytes = keep::kernels::gemm_wgmma_scratch_bytes()) > 0) {
    CUDA_OK(cudaMalloc(&s.ptr, s.bytes));
    CUDA_OK(cudaMemset(s.ptr, 0, s.bytes));
  }
  return s;
}

// kAcc: gemm_nt_accumulate (fp32 y += x W^T) onto random y; else gemm_nt onto NaN.
// tuner: run the product through GemmTuner::run (bf16 out or fp32 accumulate), which must take it.
// ours: gemm_wgmma / gemm_wgmma_accumulate instead (bf16 out or fp32 accumulate).
template <bool kF32Out, bool kAcc = false>
void check_one(keep::kernels::BlasHandle& blas, std::mt19937& rng, int64_t rows, int64_t out,
               int64_t in, int64_t x_pad, int64_t y_pad,
               const keep::kernels::GemmTuner* tuner = nullptr, const Ours* ours = nullptr) {
  static_assert(kF32Out || !kAcc, "accumulation is into fp32");
  const int64_t xs = in + x_pad, ys = out + y_pad;
  const auto x = random_bf16(rng, static_cast<size_t>(rows * xs), 1.0f);
  const auto w = random_bf16(rng, static_cast<size_t>(out * in), 1.0f / std::sqrt(float(in)));
  using Y = std::conditional_t<kF32Out, float, Bf16>;
  using DY = std::conditional_t<kF32Out, float, __nv_bfloat16>;
  std::vector<Y> y0(static_cast<size_t>(rows * ys));
  for (auto& v : y0) {
    if constexpr (kF32Out) {
      v = NAN;
    } else {
      v = float_to_bf16(NAN);
    }
  }
  std::uniform_real_distribution<float> dacc(-4.0f, 4.0f);
  if constexpr (kAcc) {  // a residual to add onto; padding columns stay NaN (must not be read)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < out; ++o) y0[r * ys + o] = dacc(rng);
    }
  }
  auto* dx = upload(x);
  auto* dw = upload(w);
  auto* dy = upload(y0);
  if (ours != nullptr) {
    if (kF32Out != kAcc) std::exit(2);
    if constexpr (kAcc) {
      CUDA_OK(keep::kernels::gemm_wgmma_accumulate(
          dy, ys, reinterpret_cast<const __nv_bfloat16*>(dx), xs,
          reinterpret_cast<const __nv_bfloat16*>(dw), rows, out, in, ours->scratch, nullptr,
          ours->schedule, ours->tile_cols, ours->max_ctas));
    } else if constexpr (!kF32Out) {
      CUDA_OK(keep::kernels::gemm_wgmma(
          reinterpret_cast<DY*>(dy), ys, reinterpret_cast<const __nv_bfloat16*>(dx), xs,
          reinterpret_cast<const __nv_bfloat16*>(dw), rows, out, in, ours->scratch, nullptr,
          ours->schedule, ours->tile_cols, ours->max_ctas));
    }
  } else if (tuner != nullptr) {  // the tuner's products: bf16 out or fp32 accumulate
    if (kF32Out != kAcc) std::exit(2);
    BLAS_OK(tuner->run({out, in, xs, ys, kAcc}, rows, dy,
                       reinterpret_cast<const __nv_bfloat16*>(dx),
                       reinterpret_cast<const __nv_bfloat16*>(dw)));
  } else if constexpr (kAcc) {
    BLAS_OK(keep::kernels::gemm_nt_accumulate(
        blas.get(), dy, ys, reinterpret_cast<const __nv_bfloat16*>(dx), xs,
        reinterpret_cast<const __nv_bfloat16*>(dw), rows, out, in));
  } else {
    BLAS_OK(keep::kernels::gemm_nt(blas.get(), reinterpret_cast<DY*>(dy), ys,
                                   reinterpret_cast<const __nv_bfloat16*>(dx), xs,
                                   reinterpret_cast<const __nv_bfloat16*>(dw), rows, out, in));
  }
  CUDA_OK(cudaDeviceSynchronize());
  if (ours != nullptr && ours->scratch.ptr != nullptr && !flags_clear(ours->scratch)) {
    ++g_failures;
    std::fprintf(stderr, "FAIL gemm_wgmma (%lld,%lld,%lld) width %d: stream-K flags left set\n",
                 (long long)rows, (long long)out, (long long)in, ours->tile_cols);
  }
  std::vector<Y> y(y0.size());
  CUDA_OK(cudaMemcpy(y.data(), dy, y.size() * sizeof(Y), cudaMemcpyDeviceToHost));
  // The reference in double, its rows on the host's threads.
  std::vector<float> xf(x.size()), wf(w.size());
  std::transform(x.begin(), x.end(), xf.begin(), [](Bf16 v) { return bf16_to_float(v); });
  std::transform(w.begin(), w.end(), wf.begin(), [](Bf16 v) { return bf16_to_float(v); });
  std::vector<double> wants(static_cast<size_t>(rows * out));
  keep::gputest::parallel_rows(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        double acc = 0.0;
        if constexpr (kAcc) acc = y0[r * ys + o];
        for (int64_t i = 0; i < in; ++i) acc += double(xf[r * xs + i]) * double(wf[o * in + i]);
        wants[r * out + o] = acc;
      }
    }
  });
  double num = 0.0, den = 0.0;
  int bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      const double want = wants[r * out + o];
      float got;
      if constexpr (kF32Out) {
        got = y[r * ys + o];
      } else {
        got = bf16_to_float(y[r * ys + o]);
      }
      // fp32 accumulation of `in` products, then (bf16 out) one rounding: 2^-8 relative.
      const double tol = (kF32Out ? 1e-4 : 8e-3) * std::fabs(want) + 1e-3;
      if (!std::isfinite(got) || std::fabs(got - want) > tol) {
        if (bad < 3) {
          std::fprintf(stderr, "FAIL gemm (%lld,%lld,%lld) at [%lld,%lld]: got %.6g want %.6g\n",
                       (long long)rows, (long long)out, (long long)in, (long long)r, (long long)o,
                       got, want);
        }
        ++bad;
      }
      num += (got - want) * (got - want);
      den += want * want;
    }
    for (int64_t o = out; o < ys; ++o) {  // padding columns must stay untouched (NaN)
      float got;
      if constexpr (kF32Out) {
        got = y[r * ys + o];
      } else {
        got = bf16_to_float(y[r * ys + o]);
      }
      if (!std::isnan(got)) ++bad;
    }
  }
  ++g_checks;
  const double rel = den > 0 ? std::sqrt(num / den) : 0.0;
  if (bad > 0 || rel > (kF32Out ? 1e-5 : 5e-3)) {
    ++g_failures;
    std::fprintf(stderr, "FAIL gemm%s %s (%lld,%lld,%lld) width %d: %d bad, rel %.3g\n",
                 ours != nullptr ? "_wgmma" : "",
                 kAcc      ? "accumulate"
                 : kF32Out ? "f32"
                           : "bf16",
                 (long long)rows, (long long)out, (long long)in,
                 ours != nullptr ? ours->tile_cols : 0, bad, rel);
  }
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dy);
}

// gemm_nt_f32: plain fp32 operands and result against double.
void check_f32(keep::kernels::BlasHandle& blas, std::mt19937& rng, int64_t rows, int64_t out,
               int64_t in) {
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * in)), w(static_cast<size_t>(out * in));
  for (auto& v : x) v = d(rng);
  for (auto& v : w) v = d(rng);
  std::vector<float> y0(static_cast<size_t>(rows * out), NAN);
  float* dx = upload(x);
  float* dw = upload(w);
  float* dy = upload(y0);
  BLAS_OK(keep::kernels::gemm_nt_f32(blas.get(), dy, out, dx, in, dw, rows, out, in));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> y(y0.size());
  CUDA_OK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double want = 0.0, mag = 0.0;
      for (int64_t i = 0; i < in; ++i) {
        want += double(x[r * in + i]) * double(w[o * in + i]);
        mag += std::fabs(double(x[r * in + i]) * double(w[o * in + i]));
      }
      // fp32 accumulation (no TF32: that would be ~1e-3 of mag)
      if (!(std::fabs(y[r * out + o] - want) <= 1e-5 * mag + 1e-6)) ++bad;
    }
  }
  ++g_checks;
  if (bad > 0) {
    ++g_failures;
    std::fprintf(stderr, "FAIL gemm_nt_f32 (%lld,%lld,%lld): %d bad\n", (long long)rows,
                 (long long)out, (long long)in, bad);
  }
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dy);
}

// Median ms a launch: 20 samples of 5 launches back to back after 15 warm-up launches (events on
// the legacy stream). Several a sample, so that one launch's host work (argument checks, our
// products' tensor-map encodes) overlaps the previous launch instead of being timed.
float median_ms(const std::function<void()>& launch) {
  return static_cast<float>(keep::gputest::time_launches(launch, 20, 5, 15).median_ms);
}

// gemv / gemv_accumulate against ref::gemv (double) on strided rows; bf16 output within one
// rounding, fp32 accumulation within fp32 summation error; padding columns stay NaN.
template <bool kAcc>
void check_gemv(std::mt19937& rng, int64_t rows, int64_t out, int64_t in, int64_t x_pad,
                int64_t y_pad) {
  const int64_t xs = in + x_pad, ys = out + y_pad;
  const auto x = random_bf16(rng, static_cast<size_t>(rows * xs), 1.0f);
  const auto w = random_bf16(rng, static_cast<size_t>(out * in), 1.0f / std::sqrt(float(in)));
  using Y = std::conditional_t<kAcc, float, Bf16>;
  std::vector<Y> y0(static_cast<size_t>(rows * ys));
  std::uniform_real_distribution<float> d(-4.0f, 4.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < ys; ++o) {
      const float v = o < out && kAcc ? d(rng) : NAN;
      if constexpr (kAcc) {
        y0[r * ys + o] = v;
      } else {
        y0[r * ys + o] = float_to_bf16(v);
      }
    }
  }
  std::vector<Y> want = y0;
  if constexpr (kAcc) {
    keep::kernels::ref::gemv_accumulate(want.data(), ys, x.data(), xs, w.data(), rows, out, in);
  } else {
    keep::kernels::ref::gemv(want.data(), ys, x.data(), xs, w.data(), rows, out, in);
  }
  auto* dx = upload(x);
  auto* dw = upload(w);
  auto* dy = upload(y0);
  cudaError_t err;
  if constexpr (kAcc) {
    err = keep::kernels::gemv_accumulate(dy, ys, reinterpret_cast<const __nv_bfloat16*>(dx), xs,
                                         reinterpret_cast<const __nv_bfloat16*>(dw), rows, out, in,
                                         nullptr);
  } else {
    err = keep::kernels::gemv(reinterpret_cast<__nv_bfloat16*>(dy), ys,
                              reinterpret_cast<const __nv_bfloat16*>(dx), xs,
                              reinterpret_cast<const __nv_bfloat16*>(dw), rows, out, in, nullptr);
  }
  CUDA_OK(err);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<Y> y(y0.size());
  CUDA_OK(cudaMemcpy(y.data(), dy, y.size() * sizeof(Y), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const float got = keep::kernels::to_float(y[i]);
    const float ref = keep::kernels::to_float(want[i]);
    if (std::isnan(ref)) {  // padding
      if (!std::isnan(got)) ++bad;
      continue;
    }
    // bf16: the reference and the kernel may round a value near a bf16 midpoint differently.
    const double tol = kAcc ? 1e-4 * (std::fabs(ref) + 1.0) : 8e-3 * std::fabs(ref) + 1e-3;
    if (!(std::fabs(got - ref) <= tol)) {
      if (bad < 3) {
        std::fprintf(stderr, "FAIL gemv%s (%lld,%lld,%lld) at %zu: got %.7g want %.7g\n",
                     kAcc ? "_accumulate" : "", (long long)rows, (long long)out, (long long)in, i,
                     got, ref);
      }
      ++bad;
    }
  }
  ++g_checks;
  if (bad > 0) {
    ++g_failures;
    std::fprintf(stderr, "FAIL gemv%s (%lld,%lld,%lld): %d bad\n", kAcc ? "_accumulate" : "",
                 (long long)rows, (long long)out, (long long)in, bad);
  }
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dy);
}

// The fp32-x gemv (logits) against ref::gemv: fp32 y overwritten, padding untouched.
void check_gemv_f32x(std::mt19937& rng, int64_t rows, int64_t out, int64_t in, int64_t x_pad,
                     int64_t y_pad) {
  const int64_t xs = in + x_pad, ys = out + y_pad;
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  std::vector<float> x(static_cast<size_t>(rows * xs));
  for (auto& v : x) v = d(rng);
  const auto w = random_bf16(rng, static_cast<size_t>(out * in), 1.0f / std::sqrt(float(in)));
  std::vector<float> y0(static_cast<size_t>(rows * ys), NAN);
  std::vector<float> want = y0;
  keep::kernels::ref::gemv(want.data(), ys, x.data(), xs, w.data(), rows, out, in);
  float* dx = upload(x);
  auto* dw = upload(w);
  float* dy = upload(y0);
  CUDA_OK(keep::kernels::gemv(dy, ys, dx, xs, reinterpret_cast<const __nv_bfloat16*>(dw), rows, out,
                              in, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> y(y0.size());
  CUDA_OK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    if (std::isnan(want[i])) {
      if (!std::isnan(y[i])) ++bad;
    } else if (!(std::fabs(y[i] - want[i]) <= 1e-4 * (std::fabs(want[i]) + 1.0))) {
      ++bad;
    }
  }
  ++g_checks;
  if (bad > 0) {
    ++g_failures;
    std::fprintf(stderr, "FAIL gemv fp32 x (%lld,%lld,%lld): %d bad\n", (long long)rows,
                 (long long)out, (long long)in, bad);
  }
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dy);
}

// One check of a bf16 output against its reference: NaN where the reference is NaN (padding the
// kernel must not write), else within one bf16 rounding plus fp32 summation order (8e-3 relative
// + 2e-3). `what` and (rows, out, in) name the case in failure messages.
void expect_bf16_near(const char* what, int64_t rows, int64_t out, int64_t in,
                      const std::vector<Bf16>& got, const std::vector<Bf16>& want) {
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = bf16_to_float(got[i]), r = bf16_to_float(want[i]);
    if (std::isnan(r)) {
      if (!std::isnan(g)) ++bad;
    } else if (!(std::fabs(g - r) <= 8e-3 * std::fabs(r) + 2e-3)) {
      if (bad < 3) {
        std::fprintf(stderr, "FAIL %s (%lld,%lld,%lld) at %zu: got %.7g want %.7g\n", what,
                     (long long)rows, (long long)out, (long long)in, i, g, r);
      }
      ++bad;
    }
  }
  ++g_checks;
  if (bad > 0) {
    ++g_failures;
    std::fprintf(stderr, "FAIL %s (%lld,%lld,%lld): %d bad\n", what, (long long)rows,
                 (long long)out, (long long)in, bad);
  }
}

// gemv_rmsnorm against ref::add_rmsnorm (norm only) then ref::gemv, strided residual rows.
void check_gemv_rmsnorm(std::mt19937& rng, int64_t rows, int64_t out, int64_t in, int64_t res_pad,
                        int64_t y_pad) {
  const int64_t rs = in + res_pad, ys = out + y_pad;
  const float eps = 1e-6f;
  std::uniform_real_distribution<float> d(-3.0f, 3.0f), dw(0.5f, 1.5f);
  std::vector<float> res(static_cast<size_t>(rows * rs)), nw(static_cast<size_t>(in));
  for (auto& v : res) v = d(rng);
  for (auto& v : nw) v = dw(rng);
  const auto w = random_bf16(rng, static_cast<size_t>(out * in), 1.0f / std::sqrt(float(in)));
  // Reference: contiguous copies of the rows, normalised to bf16, then the product.
  std::vector<float> packed(static_cast<size_t>(rows * in));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(res.begin() + r * rs, in, packed.begin() + r * in);
  }
  std::vector<Bf16> xn(packed.size());
  keep::kernels::ref::add_rmsnorm(xn.data(), packed.data(), nullptr, nullptr, nw.data(), rows, in,
                                  eps);
  std::vector<Bf16> y0(static_cast<size_t>(rows * ys), float_to_bf16(NAN));
  std::vector<Bf16> want = y0;
  keep::kernels::ref::gemv(want.data(), ys, xn.data(), in, w.data(), rows, out, in);
  float* dres = upload(res);
  float* dnw = upload(nw);
  auto* dw_ = upload(w);
  auto* dy = upload(y0);
  CUDA_OK(keep::kernels::gemv_rmsnorm(reinterpret_cast<__nv_bfloat16*>(dy), ys, dres, rs, dnw, eps,
                                      reinterpret_cast<const __nv_bfloat16*>(dw_), rows, out, in,
                                      nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<Bf16> y(y0.size());
  CUDA_OK(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));
  expect_bf16_near("gemv_rmsnorm", rows, out, in, y, want);
  cudaFree(dres);
  cudaFree(dnw);
  cudaFree(dw_);
  cudaFree(dy);
}

// gemm_swiglu against ref::gemm_swiglu (double sums) on strided rows: bf16 output within one
// rounding (and fp32 summation order), padding columns stay NaN. Rows that are not a multiple of
// the tile (or of the cluster's two tiles) check the TMA's zero fill and store clipping.
void check_gemm_swiglu(std::mt19937& rng, int64_t rows, int64_t inter, int64_t in, int64_t x_pad,
                       int64_t a_pad, const Ours& ours = {}) {
  const int64_t xs = in + x_pad, as = inter + a_pad;
  const auto x = random_bf16(rng, static_cast<size_t>(rows * xs), 1.0f);
  const auto w = random_bf16(rng, static_cast<size_t>(2 * inter * in), 2.0f / std::sqrt(float(in)));
  std::vector<Bf16> a0(static_cast<size_t>(rows * as), float_to_bf16(NAN));
  std::vector<Bf16> want = a0;
  keep::gputest::parallel_rows(rows, [&](int64_t r0, int64_t r1) {
    keep::kernels::ref::gemm_swiglu(want.data() + r0 * as, as, x.data() + r0 * xs, xs, w.data(),
                                    r1 - r0, inter, in);
  });
  auto* dx = upload(x);
  auto* dw = upload(w);
  auto* da = upload(a0);
  CUDA_OK(keep::kernels::gemm_swiglu(reinterpret_cast<__nv_bfloat16*>(da), as,
                                     reinterpret_cast<const __nv_bfloat16*>(dx), xs,
                                     reinterpret_cast<const __nv_bfloat16*>(dw), rows, inter, in,
                                     nullptr, ours.scratch, ours.schedule, ours.max_ctas));
  CUDA_OK(cudaDeviceSynchronize());
  if (ours.scratch.ptr != nullptr && !flags_clear(ours.scratch)) {
    ++g_failures;
    std::fprintf(stderr, "FAIL gemm_swiglu: stream-K flags left set\n");
  }
  std::vector<Bf16> got(a0.size());
  CUDA_OK(cudaMemcpy(got.data(), da, got.size() * 2, cudaMemcpyDeviceToHost));
  expect_bf16_near("gemm_swiglu", rows, inter, in, got, want);
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(da);
}

// The tuner's margin that keeps its fastest candidate whatever its time: -1 kept one only up to
// 2x the default's, and at 64 rows an H100 once timed every candidate slower than that.
constexpr double kKeepAny = -1e9;

// GemmTuner: tuned with a negative margin (the fastest cuBLASLt candidate is kept even where
// cuBLAS's default is faster), run() must compute the product at the tuned rows and at rows that
// reuse the choice (more than half of them), and refuse half the rows or fewer, more rows than
// tuned, and another stride.
// ours: the tuner times only our product (use_own_products(scratch, only)), which it must keep and
// run, with its persistent grid capped at max_ctas where that is not 0.
// sm_target: cuBLASLt's candidates picked and sized for that many SMs (set_sm_count_target).
// split_k: the tuner times only the split-k forms of cuBLASLt's candidates, and must keep one
// (its reduction of fp32 partials, with beta 1 when accumulating, checked through run()).
void check_tuner(keep::kernels::BlasHandle& blas, void* ws, size_t ws_bytes, std::mt19937& rng,
                 const keep::kernels::GemmScratch* ours = nullptr, int max_ctas = 0,
                 int sm_target = 0, bool split_k = false) {
  namespace kk = keep::kernels;
  kk::GemmTuner tuner;
  BLAS_OK(tuner.init(nullptr, ws, ws_bytes));
  if (sm_target > 0) BLAS_OK(tuner.set_sm_count_target(sm_target));
  tuner.only_split_k(split_k);
  if (ours != nullptr) tuner.use_own_products(*ours, true, max_ctas);
  // split_k: a deeper k (1024), which 2 or 4 ways still cut into whole k tiles.
  const int64_t rows = 64, out = ours != nullptr ? 512 : 384, in = split_k ? 1024 : 320,
                xs = in + 16, ys = out + 24;
  const auto x = random_bf16(rng, static_cast<size_t>(rows * xs), 1.0f);
  const auto w = random_bf16(rng, static_cast<size_t>(out * in), 0.05f);
  auto* dx = reinterpret_cast<const __nv_bfloat16*>(upload(x));
  auto* dw = reinterpret_cast<const __nv_bfloat16*>(upload(w));
  void* dy = nullptr;
  CUDA_OK(cudaMalloc(&dy, static_cast<size_t>(rows * ys) * 4));
  CUDA_OK(cudaMemset(dy, 0, static_cast<size_t>(rows * ys) * 4));
  const auto free_operands = [&] {
    CUDA_OK(cudaFree(dy));
    CUDA_OK(cudaFree(const_cast<__nv_bfloat16*>(dx)));
    CUDA_OK(cudaFree(const_cast<__nv_bfloat16*>(dw)));
  };
  int kept = 0;
  for (bool acc : {false, true}) {
    kk::GemmTuner::TuneResult res;
    BLAS_OK(tuner.tune(blas.get(), {out, in, xs, ys, acc}, rows, dy, dx, dw, kKeepAny, &res));
    if (split_k && res.split_forms == 0) {
      // Not a failure of ours: the tuner then times no split form, and says so here.
      std::printf(
          "GemmTuner (split-k): cuBLASLt takes no split-k form of its candidates for "
          "(%lld x %lld x %lld, acc %d); not checked\n",
          (long long)rows, (long long)out, (long long)in, acc);
      free_operands();
      return;
    }
    kept += res.chosen >= 0 ? 1 : 0;
    ++g_checks;
    if (res.chosen < 0 || !(res.default_ms > 0.0f) || !(res.best_ms > 0.0f) ||
        (ours != nullptr && res.chosen != kk::GemmTuner::kOurs)) {
      ++g_failures;
      std::fprintf(stderr, "FAIL GemmTuner::tune (acc %d): chosen %d, %.4f / %.4f ms\n", acc,
                   res.chosen, res.default_ms, res.best_ms);
    }
    // describe(): the kept choice ("ours", or a cuBLASLt configuration); nothing for rows that
    // were not tuned.
    const std::string d = tuner.describe({out, in, xs, ys, acc}, rows);
    ++g_checks;
    const size_t at = d.find(" split-k ");
    const int splits = at == d.npos ? -1 : std::atoi(d.c_str() + at + 9);
    const bool named = ours != nullptr
                           ? d == "ours"
                           : d.rfind("algo ", 0) == 0 && d.find(" tile ") != d.npos &&
                                 d.find(" cluster ") != d.npos && (!split_k || splits >= 2);
    if (!named || !tuner.describe({out, in, xs, ys, acc}, rows + 1).empty()) {
      ++g_failures;
      std::fprintf(stderr, "FAIL GemmTuner::describe (acc %d): \"%s\"\n", acc, d.c_str());
    }
  }
  ++g_checks;
  if (tuner.tuned() != static_cast<size_t>(kept) || kept != 2) {
    ++g_failures;
    std::fprintf(stderr, "FAIL GemmTuner: %zu entries for %d kept\n", tuner.tuned(), kept);
  }
  if (kept == 2) {
    for (int64_t r : {rows, int64_t{33}}) {
      for (bool acc : {false, true}) {
        // cuBLASLt may refuse the choice for other rows (run() then says NOT_SUPPORTED, and the
        // backend takes cuBLAS's default); the tuned rows themselves must run.
        if (tuner.run({out, in, xs, ys, acc}, r, dy, dx, dw) == CUBLAS_STATUS_NOT_SUPPORTED &&
            r != rows) {
          std::printf("GemmTuner: cuBLASLt refused the %lld-row choice at %lld rows\n",
                      (long long)rows, (long long)r);
          continue;
        }
        if (acc) {
          check_one<true, true>(blas, rng, r, out, in, 16, 24, &tuner);
        } else {
          check_one<false>(blas, rng, r, out, in, 16, 24, &tuner);
        }
      }
    }
  }
  ++g_checks;
  const bool refused =
      tuner.run({out, in, xs, ys, false}, 32, dy, dx, dw) == CUBLAS_STATUS_NOT_SUPPORTED &&
      tuner.run({out, in, xs, ys, false}, 65, dy, dx, dw) == CUBLAS_STATUS_NOT_SUPPORTED &&
      tuner.run({out, in, in, ys, false}, rows, dy, dx, dw) == CUBLAS_STATUS_NOT_SUPPORTED;
  if (!refused) {
    ++g_failures;
    std::fprintf(stderr, "FAIL GemmTuner::run took rows or a shape it was not tuned for\n");
  }
  free_operands();
  std::printf("GemmTuner%s: %d shapes tuned at %lld rows (forced), checked at 64 and 33 rows%s\n",
              ours != nullptr ? " (ours)" : (split_k ? " (split-k)" : ""), kept, (long long)rows,
              max_ctas > 0    ? (", grid capped at " + std::to_string(max_ctas)).c_str()
              : sm_target > 0 ? (", for " + std::to_string(sm_target) + " SMs").c_str()
                              : "");
}

// Random operands of one timed product: x (rows, in), W (out, in) bf16, y zeroed with room for
// fp32 (rows, out); and the product as the CUDA backend issues it through cuBLAS.
struct TimedOperands {
  __nv_bfloat16* x = nullptr;
  __nv_bfloat16* w = nullptr;
  void* y = nullptr;
  int64_t rows, out, in;
  TimedOperands(int64_t r, int64_t o, int64_t i) : rows(r), out(o), in(i) {
    CUDA_OK(cudaMalloc(&x, rows * in * 2));
    CUDA_OK(cudaMalloc(&w, out * in * 2));
    CUDA_OK(cudaMalloc(&y, rows * out * 4));
    CUDA_OK(keep::kernels::fill_uniform(x, rows * in, 1, -1.0f, 1.0f, nullptr));
    CUDA_OK(keep::kernels::fill_uniform(w, out * in, 2, -0.02f, 0.02f, nullptr));
    CUDA_OK(cudaMemset(y, 0, rows * out * 4));
  }
  ~TimedOperands() {
    cudaFree(x);
    cudaFree(w);
    cudaFree(y);
  }
  void blas(keep::kernels::BlasHandle& h, bool acc) const {
    if (acc) {
      BLAS_OK(keep::kernels::gemm_nt_accumulate(h.get(), static_cast<float*>(y), out, x, in, w,
                                                rows, out, in));
    } else {
      BLAS_OK(keep::kernels::gemm_nt(h.get(), static_cast<__nv_bfloat16*>(y), out, x, in, w, rows,
                                     out, in));
    }
  }
};

// gemv_rmsnorm against the two launches it replaces (add_rmsnorm, then gemv), one decode row.
void time_gemv_rmsnorm(int64_t out, int64_t in) {
  const TimedOperands t(1, out, in);
  float *res, *nw;
  CUDA_OK(cudaMalloc(&res, in * 4));
  CUDA_OK(cudaMalloc(&nw, in * 4));
  CUDA_OK(keep::kernels::fill_uniform(res, in, 5, -2.0f, 2.0f, nullptr));
  CUDA_OK(keep::kernels::fill_uniform(nw, in, 6, 0.5f, 1.5f, nullptr));
  const float t_two = median_ms([&] {
    CUDA_OK(keep::kernels::add_rmsnorm(t.x, res, nullptr, nullptr, nw, 1, in, 1e-6f, nullptr));
    CUDA_OK(keep::kernels::gemv(static_cast<__nv_bfloat16*>(t.y), out, t.x, in, t.w, 1, out, in,
                                nullptr));
  });
  const float t_fused = median_ms([&] {
    CUDA_OK(keep::kernels::gemv_rmsnorm(static_cast<__nv_bfloat16*>(t.y), out, res, in, nw, 1e-6f,
                                        t.w, 1, out, in, nullptr));
  });
  std::printf("rows 1 (%lld x %lld): add_rmsnorm + gemv %.1f us, gemv_rmsnorm %.1f us\n",
              (long long)out, (long long)in, t_two * 1e3, t_fused * 1e3);
  cudaFree(res);
  cudaFree(nw);
}

// gemv against cuBLAS for few rows (informational): the decode-step products.
void time_gemv(keep::kernels::BlasHandle& blas, int64_t rows, int64_t out, int64_t in, bool acc) {
  const TimedOperands t(rows, out, in);
  const float t_blas = median_ms([&] { t.blas(blas, acc); });
  const float t_gemv = median_ms([&] {
    if (acc) {
      CUDA_OK(keep::kernels::gemv_accumulate(static_cast<float*>(t.y), out, t.x, in, t.w, rows, out,
                                             in, nullptr));
    } else {
      CUDA_OK(keep::kernels::gemv(static_cast<__nv_bfloat16*>(t.y), out, t.x, in, t.w, rows, out,
                                  in, nullptr));
    }
  });
  const double gb = 2.0 * out * in / 1e9;
  std::printf("rows %lld (%lld x %lld)%s: cuBLAS %.1f us (%.2f TB/s), gemv %.1f us (%.2f TB/s)\n",
              (long long)rows, (long long)out, (long long)in, acc ? " acc" : "", t_blas * 1e3,
              gb / (t_blas * 1e-3) / 1e3, t_gemv * 1e3, gb / (t_gemv * 1e-3) / 1e3);
}

// gemm_swiglu against what it replaces, cuBLAS's gate/up product and swiglu_rows, at the same
// rows (informational; the end-to-end figures come from benchmarks/prefill): round robin, and as
// the backend runs it (with scratch: kAuto takes lanes and the stream-K share where whole tiles
// would leave clusters idle, e.g. below 512 rows).
void time_gemm_swiglu(keep::kernels::BlasHandle& blas, const keep::kernels::GemmScratch& scratch,
                      int64_t rows, int64_t inter, int64_t in) {
  namespace kk = keep::kernels;
  const TimedOperands t(rows, 2 * inter, in);
  __nv_bfloat16* act = nullptr;
  CUDA_OK(cudaMalloc(&act, rows * inter * 2));
  const float t_two = median_ms([&] {
    t.blas(blas, false);
    CUDA_OK(kk::swiglu_rows(act, static_cast<const __nv_bfloat16*>(t.y), rows, inter, nullptr));
  });
  const float t_fused = median_ms(
      [&] { CUDA_OK(kk::gemm_swiglu(act, inter, t.x, in, t.w, rows, inter, in, nullptr)); });
  const float t_auto = median_ms([&] {
    CUDA_OK(kk::gemm_swiglu(act, inter, t.x, in, t.w, rows, inter, in, nullptr, scratch));
  });
  const double flop = 2.0 * rows * 2 * inter * in;
  std::printf(
      "gate/up + SwiGLU (%lld x %lld x %lld): cuBLAS + swiglu_rows %.3f ms, gemm_swiglu round "
      "robin %.3f ms (%.0f TFLOP/s), as the backend runs it %.3f ms\n",
      (long long)rows, (long long)(2 * inter), (long long)in, t_two, t_fused,
      flop / (t_fused * 1e-3) / 1e12, t_auto);
  cudaFree(act);
}

// Our products against cuBLAS's default on the same operands (informational; for swiglu, against
// cuBLAS's gate/up product and swiglu_rows, what the backend runs without it): whole tiles round
// robin and (kStreamK) in lanes with the stream-K share. Each sample times 10 launches in a row
// (the host's per-launch work stays hidden, as in a prefill); the variants take turns so that
// they see the same clocks; medians of 20 samples.
void time_ours(keep::kernels::BlasHandle& blas, const keep::kernels::GemmScratch& scratch,
               int64_t rows, int64_t out, int64_t in, bool acc, bool swiglu = false) {
  namespace kk = keep::kernels;
  const TimedOperands t(rows, out, in);
  __nv_bfloat16* act = nullptr;  // swiglu: (rows, out / 2)
  if (swiglu) CUDA_OK(cudaMalloc(&act, rows * (out / 2) * 2));
  auto ours = [&](kk::GemmSchedule sched, int width, int max_ctas = 0) {
    if (swiglu) {
      CUDA_OK(kk::gemm_swiglu(act, out / 2, t.x, in, t.w, rows, out / 2, in, nullptr, scratch,
                              sched, max_ctas));
    } else if (acc) {
      CUDA_OK(kk::gemm_wgmma_accumulate(static_cast<float*>(t.y), out, t.x, in, t.w, rows, out, in,
                                        scratch, nullptr, sched, width, max_ctas));
    } else {
      CUDA_OK(kk::gemm_wgmma(static_cast<__nv_bfloat16*>(t.y), out, t.x, in, t.w, rows, out, in,
                             scratch, nullptr, sched, width, max_ctas));
    }
  };
  // cuBLAS (+ swiglu_rows), ours as picked (kAuto), ours at 256 in lanes with the stream-K share,
  // then (plain products) ours round robin at every width that divides `out`.
  std::vector<std::string> names = {swiglu ? "cuBLAS + swiglu_rows" : "cuBLAS", "ours",
                                    "256 lanes"};
  std::vector<std::function<void()>> runs = {[&] { t.blas(blas, acc); },
                                             [&] { ours(kk::GemmSchedule::kAuto, 0); },
                                             [&] { ours(kk::GemmSchedule::kStreamK, 256); }};
  // As the CUDA backend runs few rows: the grid leaves the loader's 16 SMs (H200: 116 of 132).
  if (rows <= kk::kGemmTileRows) {
    names.push_back("ours 116");
    runs.push_back([&] { ours(kk::GemmSchedule::kAuto, 0, 116); });
  }
  if (swiglu) {
    runs[0] = [&] {
      t.blas(blas, false);
      CUDA_OK(kk::swiglu_rows(act, static_cast<const __nv_bfloat16*>(t.y), rows, out / 2, nullptr));
    };
    runs[2] = [&] { ours(kk::GemmSchedule::kStreamK, 0); };
  } else {
    for (const int bn : kk::kGemmWidths) {
      if (!kk::gemm_width_fits(bn, out, acc)) continue;
      names.push_back(std::to_string(bn) + " rr");
      runs.push_back([&ours, bn] { ours(kk::GemmSchedule::kDataParallel, bn); });
    }
  }
  std::vector<std::vector<float>> ms(runs.size());
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  for (int it = 0; it < 23; ++it) {
    for (size_t v = 0; v < runs.size(); ++v) {
      CUDA_OK(cudaEventRecord(a));
      for (int rep = 0; rep < 10; ++rep) runs[v]();
      CUDA_OK(cudaEventRecord(b));
      CUDA_OK(cudaEventSynchronize(b));
      float x = 0;
      CUDA_OK(cudaEventElapsedTime(&x, a, b));
      if (it >= 3) ms[v].push_back(x / 10);
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  const double tf = 2.0 * rows * out * in / 1e12;
  std::string line;
  for (size_t v = 0; v < runs.size(); ++v) {
    std::sort(ms[v].begin(), ms[v].end());
    const float med = ms[v][ms[v].size() / 2];
    char buf[96];
    std::snprintf(buf, sizeof buf, "%s%s %.3f ms (%.0f)", v ? ", " : "", names[v].c_str(), med,
                  tf / (med * 1e-3));
    line += buf;
  }
  std::printf(
      "ours %s (%lld x %lld x %lld), width %d: %s (TFLOP/s)\n",
      swiglu ? "swiglu"
      : acc  ? "acc f32"
             : "bf16",
      (long long)rows, (long long)out, (long long)in,
      swiglu ? 256 : kk::gemm_wgmma_tile_cols(rows, out, in, acc, kk::gemm_wgmma_clusters(), true),
      line.c_str());
  cudaFree(act);
}

// Times one product as the CUDA backend issues it (bf16 out, or fp32 accumulate) and what
// GemmTuner would run instead (its cuBLASLt candidates and our product, the fastest kept whatever
// the margin): how much the per-shape choice gains over cuBLAS's default pick (informational).
void time_one(keep::kernels::BlasHandle& blas, void* ws, size_t ws_bytes,
              const keep::kernels::GemmScratch& scratch, int64_t rows, int64_t out, int64_t in,
              bool acc) {
  namespace kk = keep::kernels;
  const TimedOperands t(rows, out, in);
  const double flop = 2.0 * rows * out * in;
  const float med = median_ms([&] { t.blas(blas, acc); });
  kk::GemmTuner tuner;
  BLAS_OK(tuner.init(nullptr, ws, ws_bytes));
  if (scratch.ptr != nullptr) tuner.use_own_products(scratch);
  kk::GemmTuner::TuneResult r;
  BLAS_OK(tuner.tune(blas.get(), {out, in, in, out, acc}, rows, t.y, t.x, t.w, kKeepAny, &r));
  const float pick = median_ms([&] {
    BLAS_OK(tuner.run({out, in, in, out, acc}, rows, t.y, t.x, t.w));
  });
  const std::string who = tuner.describe({out, in, in, out, acc}, rows);
  std::printf(
      "gemm_nt %s (%lld x %lld x %lld): %.3f ms, %.0f TFLOP/s | tuner's pick (%s) %.3f ms "
      "(%.0f TFLOP/s)\n",
      acc ? "acc f32" : "bf16", (long long)rows, (long long)out, (long long)in, med,
      flop / (med * 1e-3) / 1e12, who.c_str(), pick, flop / (pick * 1e-3) / 1e12);
}

// KEEP_GPU_TEST_ONLY=profile: for Nsight Compute, not a check. Qwen2.5-14B's QKV and o_proj at
// 1024 rows, each launched once inside the NVTX range "profile" as ours (the picked width),
// cuBLASLt's fastest heuristic candidate and cuBLAS's default, after a warm-up of each. Run as
// KEEP_GPU_TEST_ONLY=profile ncu --nvtx --nvtx-include "profile/" --clock-control none
// --section SpeedOfLight --section WarpStateStats test_gemm
void profile_products(keep::kernels::BlasHandle& blas, void* ws, size_t ws_bytes) {
  namespace kk = keep::kernels;
  const kk::GemmScratch scratch = zeroed_scratch();
  if (scratch.ptr == nullptr) {
    std::printf("profile: no wgmma on this device\n");
    return;
  }
  for (const bool acc : {false, true}) {
    const int64_t rows = 1024, out = acc ? 5120 : 7168, in = 5120;
    const TimedOperands t(rows, out, in);
    kk::GemmTuner tuner;
    BLAS_OK(tuner.init(nullptr, ws, ws_bytes));
    BLAS_OK(tuner.tune(blas.get(), {out, in, in, out, acc}, rows, t.y, t.x, t.w, kKeepAny));
    const auto ours = [&] {
      if (acc) {
        CUDA_OK(kk::gemm_wgmma_accumulate(static_cast<float*>(t.y), out, t.x, in, t.w, rows, out,
                                          in, scratch, nullptr));
      } else {
        CUDA_OK(kk::gemm_wgmma(static_cast<__nv_bfloat16*>(t.y), out, t.x, in, t.w, rows, out, in,
                               scratch, nullptr));
      }
    };
    const auto lt = [&] { BLAS_OK(tuner.run({out, in, in, out, acc}, rows, t.y, t.x, t.w)); };
    for (int warm = 0; warm < 3; ++warm) {
      ours();
      lt();
      t.blas(blas, acc);
    }
    CUDA_OK(cudaDeviceSynchronize());
    nvtxRangePushA("profile");
    ours();
    lt();
    t.blas(blas, acc);
    CUDA_OK(cudaDeviceSynchronize());
    nvtxRangePop();
    std::printf("profile %s (%lld x %lld x %lld): ours width %d, cuBLASLt %s, cuBLAS default\n",
                acc ? "acc f32" : "bf16", (long long)rows, (long long)out, (long long)in,
                kk::gemm_wgmma_tile_cols(rows, out, in, acc, kk::gemm_wgmma_clusters(), true),
                tuner.describe({out, in, in, out, acc}, rows).c_str());
  }
  cudaFree(scratch.ptr);
}

// Qwen2.5-7B's and 14B's products on ours against cuBLAS (QKV, o_proj, down; gate/up).
void time_products(keep::kernels::BlasHandle& blas, const keep::kernels::GemmScratch& scratch,
                   const std::vector<int64_t>& row_counts) {
  for (const int64_t rows : row_counts) {
    time_ours(blas, scratch, rows, 3584 + 2 * 512, 3584, false);
    time_ours(blas, scratch, rows, 3584, 3584, true);
    time_ours(blas, scratch, rows, 3584, 18944, true);
    time_ours(blas, scratch, rows, 5120 + 2 * 1024, 5120, false);
    time_ours(blas, scratch, rows, 5120, 5120, true);
    time_ours(blas, scratch, rows, 5120, 13824, true);
    time_ours(blas, scratch, rows, 2 * 13824, 5120, false, true);
    time_ours(blas, scratch, rows, 2 * 18944, 3584, false, true);
  }
}

}  // namespace

int main() {
  if (!keep::gputest::print_device()) return 2;
  void* ws = nullptr;
  const size_t ws_bytes = size_t{32} << 20;
  CUDA_OK(cudaMalloc(&ws, ws_bytes));
  keep::kernels::BlasHandle blas;
  BLAS_OK(blas.init(nullptr, ws, ws_bytes));
  std::mt19937 rng(1234);
  // KEEP_GPU_TEST_ONLY=gemm_swiglu: our fused product's checks alone (racecheck runs those; it
  // fails inside cuBLAS's own kernels).
  const char* only = std::getenv("KEEP_GPU_TEST_ONLY");
  if (only != nullptr && std::string(only) == "profile") {
    profile_products(blas, ws, ws_bytes);
    cudaFree(ws);
    return 0;
  }
  // KEEP_GPU_TEST_ONLY=gemv_times: one-row gemv at Qwen2.5-14B's shapes (a decode step's products,
  // lm_head in the backend's slices and whole) against cuBLAS, alone (for scripts/gpu-ab.sh).
  if (only != nullptr && std::string(only) == "gemv_times") {
    for (auto [out, in, acc] : {std::tuple<int64_t, int64_t, bool>{5120 + 2 * 1024, 5120, false},
                                {5120, 5120, true},
                                {2 * 13824, 5120, false},
                                {5120, 13824, true},
                                {19008, 5120, false},
                                {152064, 5120, false}}) {
      time_gemv(blas, 1, out, in, acc);
    }
    cudaFree(ws);
    return 0;
  }
  // KEEP_GPU_TEST_ONLY=times: the products' timings at 1024 and 2048 rows (KEEP_GEMM_ROWS: a
  // comma-separated list instead) alone, no checks (for scripts/gpu-ab.sh).
  if (only != nullptr && std::string(only) == "times") {
    const keep::kernels::GemmScratch scratch = zeroed_scratch();
    std::vector<int64_t> rows = {1024, 2048};
    if (const char* list = std::getenv("KEEP_GEMM_ROWS")) {
      rows.clear();
      for (const char* p = list; *p != '\0';) {
        char* end = nullptr;
        const long long r = std::strtoll(p, &end, 10);
        if (end == p || r <= 0) {
          std::fprintf(stderr, "test_gemm: KEEP_GEMM_ROWS wants positive counts: %s\n", list);
          return 2;
        }
        rows.push_back(r);
        p = *end == ',' ? end + 1 : end;
      }
    }
    if (scratch.ptr != nullptr) time_products(blas, scratch, rows);
    cudaFree(scratch.ptr);
    cudaFree(ws);
    return 0;
  }
  // KEEP_GPU_TEST_ONLY=tuner: GemmTuner's checks alone (cuBLASLt's candidates, for every SM and
  // for a few; our product, on every SM and on one CTA).
  if (only != nullptr && std::string(only) == "tuner") {
    const keep::kernels::GemmScratch scratch = zeroed_scratch();
    check_tuner(blas, ws, ws_bytes, rng);
    check_tuner(blas, ws, ws_bytes, rng, nullptr, 0, 7);
    check_tuner(blas, ws, ws_bytes, rng, nullptr, 0, 0, true);
    if (scratch.ptr != nullptr) {
      check_tuner(blas, ws, ws_bytes, rng, &scratch);
      check_tuner(blas, ws, ws_bytes, rng, &scratch, 1);
    }
    std::printf("test_gemm: %d checks, %d failures\n", g_checks, g_failures);
    cudaFree(scratch.ptr);
    cudaFree(ws);
    return g_failures == 0 ? 0 : 1;
  }
  const bool all = only == nullptr || std::string(only) != "gemm_swiglu";
  for (int64_t rows : {1, 3, 7, 19, 733}) {
    if (!all) break;
    for (auto [out, in] :
         {std::pair<int64_t, int64_t>{1, 1}, {7, 3}, {64, 576}, {733, 19}, {576, 1536}}) {
      check_one<false>(blas, rng, rows, out, in, 0, 0);
      check_one<true>(blas, rng, rows, out, in, 0, 0);
      check_one<true, true>(blas, rng, rows, out, in, 0, 0);
    }
    check_one<false>(blas, rng, rows, 384, 320, 16, 24);  // strided x and y (fused buffers)
    check_one<true>(blas, rng, rows, 384, 320, 8, 40);
    check_one<true, true>(blas, rng, rows, 384, 320, 8, 40);
  }
  for (int64_t rows : {1, 3, 19}) {
    if (all) check_f32(blas, rng, rows, 733, 576);
  }
  if (all) {
    check_tuner(blas, ws, ws_bytes, rng);
    check_tuner(blas, ws, ws_bytes, rng, nullptr, 0, 7);  // sized for 7 SMs (blas_leave_loader)
    check_tuner(blas, ws, ws_bytes, rng, nullptr, 0, 0, true);  // a split-k form kept
  }
  for (int64_t rows = 1; all && rows <= keep::kernels::kGemvMaxRows; ++rows) {
    for (auto [out, in] :
         {std::pair<int64_t, int64_t>{1, 8}, {7, 24}, {733, 576}, {64, 1800}, {19, 3584}}) {
      check_gemv<false>(rng, rows, out, in, 0, 0);
      check_gemv<true>(rng, rows, out, in, 0, 0);
    }
    check_gemv<false>(rng, rows, 384, 320, 16, 24);  // strided x and y (fused buffers)
    check_gemv<true>(rng, rows, 384, 320, 8, 40);
    check_gemv_f32x(rng, rows, 733, 576, 0, 0);
    check_gemv_f32x(rng, rows, 1001, 64, 8, 3);
    check_gemv_rmsnorm(rng, rows, 733, 576, 0, 0);
    check_gemv_rmsnorm(rng, rows, 37, 1536, 12, 5);
    if (rows <= 3) check_gemv_rmsnorm(rng, rows, 4608, 3584, 4, 0);
  }
  if (all) {  // refused: rows beyond the maximum, `in` not a multiple of 8, misaligned x
    ++g_checks;
    __nv_bfloat16* p = nullptr;
    CUDA_OK(cudaMalloc(&p, 4096));
    const bool refused =
        keep::kernels::gemv(p, 8, p, 8, p, 9, 8, 8, nullptr) == cudaErrorInvalidValue &&
        keep::kernels::gemv(p, 8, p, 12, p, 1, 8, 12, nullptr) == cudaErrorInvalidValue &&
        keep::kernels::gemv(p, 8, p + 1, 8, p, 1, 8, 8, nullptr) == cudaErrorInvalidValue &&
        // 8 rows x 4096 bf16 of normalised x: over the shared-memory bound
        keep::kernels::gemv_rmsnorm(p, 8, reinterpret_cast<float*>(p), 4096,
                                    reinterpret_cast<float*>(p), 1e-6f, p, 8, 8, 4096,
                                    nullptr) == cudaErrorInvalidValue;
    if (!refused) {
      ++g_failures;
      std::fprintf(stderr, "FAIL gemv: bad sizes accepted\n");
    }
    cudaFree(p);
  }
  namespace kk = keep::kernels;
  const kk::GemmScratch scratch = zeroed_scratch();  // the stream-K share's
  if (keep::kernels::wgmma_available()) {
    for (int64_t rows : {1, 3, 7, 19, 128, 255, 256, 733}) {
      check_gemm_swiglu(rng, rows, 128, 64, 0, 0);
      check_gemm_swiglu(rng, rows, 384, 576, 8, 24);  // strided x and act
    }
    check_gemm_swiglu(rng, 600, 3072, 128, 0, 8);  // more cluster tiles (72) than clusters
    // Our plain products: round robin on odd rows and strided operands; in lanes with the
    // stream-K share (on the H200's 66 clusters): 3 row tiles x 2 columns of 48 k steps in 22
    // lanes (each column cut among ~11 lanes), 5 x 27 columns of 4 k steps in 13 lanes (14 cut,
    // 13 whole); without scratch (round robin).
    const Ours dp{scratch, kk::GemmSchedule::kDataParallel};
    const Ours sk{scratch, kk::GemmSchedule::kStreamK};
    const Ours no_scratch{};
    for (int64_t rows : {1, 3, 19, 255, 256, 733}) {
      check_one<false>(blas, rng, rows, 512, 576, 8, 24, nullptr, &dp);
      check_one<true, true>(blas, rng, rows, 512, 576, 8, 40, nullptr, &dp);
    }
    check_one<false>(blas, rng, 733, 512, 3072, 0, 0, nullptr, &sk);
    check_one<true, true>(blas, rng, 733, 512, 3072, 0, 8, nullptr, &sk);
    check_one<false>(blas, rng, 1100, 6912, 256, 0, 0, nullptr, &sk);
    check_one<true, true>(blas, rng, 1100, 6912, 256, 8, 2, nullptr, &sk);
    check_one<true, true>(blas, rng, 733, 512, 3072, 0, 0, nullptr, &no_scratch);
    // At most 128 rows: one-CTA clusters (132 on the H200), 4 columns of 48 k steps cut among
    // them, and at 128 rows exactly (a whole tile, no rows past the end).
    for (int64_t rows : {100, 128}) {
      check_one<false>(blas, rng, rows, 512, 3072, 0, 0, nullptr, &sk);
      check_one<true, true>(blas, rng, rows, 512, 3072, 0, 8, nullptr, &sk);
      check_gemm_swiglu(rng, rows, 512, 3072, 0, 8, sk);
    }
    // Grids capped (max_ctas, the loader's SMs left free): 116 and 7 CTAs in lanes after launches
    // on every SM (whose partial tiles lie where a smaller grid's flags would if they followed its
    // own partials), one-CTA clusters and pairs.
    for (const int cap : {116, 7}) {
      const Ours capped{scratch, kk::GemmSchedule::kStreamK, 0, cap};
      for (int64_t rows : {100, 733}) {
        check_one<false>(blas, rng, rows, 512, 3072, 0, 0, nullptr, &capped);
        check_one<true, true>(blas, rng, rows, 512, 3072, 0, 8, nullptr, &capped);
        check_gemm_swiglu(rng, rows, 512, 3072, 0, 8, capped);
      }
    }
    // Lanes with spare clusters (on the H200's 66 clusters), 128 wide: 4 row tiles (the last
    // one part) in 16 lanes and 2 spare clusters of 2 row tiles each, where of 34 columns of 4 k
    // steps the spare ones take the last, the lanes cut 17 and deal 16 whole; 5 row tiles in 13
    // lanes and one spare cluster walking all 5 of the last of 66 columns (2 k steps).
    const Ours sk128{scratch, kk::GemmSchedule::kStreamK, 128};
    check_one<false>(blas, rng, 1000, 4352, 256, 0, 8, nullptr, &sk128);
    check_one<true, true>(blas, rng, 1000, 4352, 256, 8, 0, nullptr, &sk128);
    check_one<false>(blas, rng, 1280, 8448, 128, 0, 0, nullptr, &sk128);
    check_one<true, true>(blas, rng, 1280, 8448, 128, 0, 0, nullptr, &sk128);
    // The same 34-column schedule with spare clusters in gemm_swiglu.
    check_gemm_swiglu(rng, 1000, 4352, 256, 8, 0, sk);
    // Every tile width, bf16 out (160 and 224 end on a 32-column staging panel) and fp32
    // accumulate (320 too: accumulate only), round robin and in lanes (320-wide tiles go round
    // robin whatever the schedule): out = 3 tiles of each width (plus a strided y), odd rows;
    // 96 k steps cut among the lanes.
    for (const int bn : {128, 160, 192, 224, 256, 320}) {
      const Ours w_dp{scratch, kk::GemmSchedule::kDataParallel, bn};
      const Ours w_sk{scratch, kk::GemmSchedule::kStreamK, bn};
      for (int64_t rows : {1, 19, 733}) {
        if (bn != 320) check_one<false>(blas, rng, rows, 3 * bn, 576, 8, 24, nullptr, &w_dp);
        check_one<true, true>(blas, rng, rows, 3 * bn, 576, 0, 8, nullptr, &w_dp);
      }
      if (bn != 320) check_one<false>(blas, rng, 300, 2 * bn, 6144, 0, 0, nullptr, &w_sk);
      check_one<true, true>(blas, rng, 300, 2 * bn, 6144, 8, 2, nullptr, &w_sk);
    }
    check_gemm_swiglu(rng, 600, 3072, 576, 0, 8, sk);  // 3 x 24 columns of 9 k steps, all cut
    if (all) {
      check_tuner(blas, ws, ws_bytes, rng, &scratch);
      // One CTA doing every tile in turn: the capped grid of CudaBackendOptions::gemm_leave_loader.
      check_tuner(blas, ws, ws_bytes, rng, &scratch, 1);
    }
    ++g_checks;  // refused: out fitting no width, a width not dividing out or not one of the
                 // five, in not a multiple of 64, odd fp32 stride, misaligned
    __nv_bfloat16* q = nullptr;
    CUDA_OK(cudaMalloc(&q, 1 << 20));
    float* qf = reinterpret_cast<float*>(q);
    const bool refused_plain =
        kk::gemm_wgmma(q, 400, q, 64, q, 4, 400, 64, scratch, nullptr) == cudaErrorInvalidValue &&
        kk::gemm_wgmma(q, 256, q, 64, q, 4, 256, 64, scratch, nullptr, kk::GemmSchedule::kAuto,
                       160) == cudaErrorInvalidValue &&
        kk::gemm_wgmma(q, 384, q, 64, q, 4, 384, 64, scratch, nullptr, kk::GemmSchedule::kAuto,
                       96) == cudaErrorInvalidValue &&
        kk::gemm_wgmma(q, 640, q, 64, q, 4, 640, 64, scratch, nullptr, kk::GemmSchedule::kAuto,
                       320) == cudaErrorInvalidValue &&
        kk::gemm_wgmma(q, 256, q, 96, q, 4, 256, 96, scratch, nullptr) == cudaErrorInvalidValue &&
        kk::gemm_wgmma(q + 8, 256, q + 1, 64, q, 4, 256, 64, scratch, nullptr) ==
            cudaErrorInvalidValue &&
        kk::gemm_wgmma_accumulate(qf, 257, q, 64, q, 4, 256, 64, scratch, nullptr) ==
            cudaErrorInvalidValue &&
        kk::gemm_wgmma_accumulate(qf + 1, 256, q, 64, q, 4, 256, 64, scratch, nullptr) ==
            cudaErrorInvalidValue;
    if (!refused_plain) {
      ++g_failures;
      std::fprintf(stderr, "FAIL gemm_wgmma: bad sizes accepted\n");
    }
    cudaFree(q);
    ++g_checks;  // refused: inter not a multiple of 128, in not of 64, odd stride, misaligned
    __nv_bfloat16* p = nullptr;
    CUDA_OK(cudaMalloc(&p, 1 << 20));
    const bool refused = keep::kernels::gemm_swiglu(p, 192, p, 64, p, 4, 192, 64, nullptr) ==
                             cudaErrorInvalidValue &&
                         keep::kernels::gemm_swiglu(p, 128, p, 96, p, 4, 128, 96, nullptr) ==
                             cudaErrorInvalidValue &&
                         keep::kernels::gemm_swiglu(p, 130, p, 64, p, 4, 128, 64, nullptr) ==
                             cudaErrorInvalidValue &&
                         keep::kernels::gemm_swiglu(p + 1, 128, p, 64, p, 4, 128, 64, nullptr) ==
                             cudaErrorInvalidValue;
    if (!refused) {
      ++g_failures;
      std::fprintf(stderr, "FAIL gemm_swiglu: bad sizes accepted\n");
    }
    cudaFree(p);
  } else {
    ++g_checks;  // where it cannot run it says so
    if (keep::kernels::gemm_swiglu(nullptr, 128, nullptr, 64, nullptr, 0, 128, 64, nullptr) !=
            cudaSuccess ||
        keep::kernels::gemm_swiglu(
            reinterpret_cast<__nv_bfloat16*>(ws), 128, reinterpret_cast<__nv_bfloat16*>(ws), 64,
            reinterpret_cast<__nv_bfloat16*>(ws), 1, 128, 64, nullptr) != cudaErrorNotSupported) {
      ++g_failures;
      std::fprintf(stderr, "FAIL gemm_swiglu: no wgmma here, yet not cudaErrorNotSupported\n");
    }
    std::printf(
        "gemm_swiglu: no wgmma on this device (sm_90a build, compute 9.0); checked the "
        "refusal only\n");
  }
  // Invalid sizes are refused without touching memory.
  if (all && keep::kernels::gemm_nt(blas.get(), static_cast<__nv_bfloat16*>(nullptr), 4, nullptr, 4,
                                    nullptr, 2, 8, 4) != CUBLAS_STATUS_INVALID_VALUE) {
    ++g_failures;
    std::fprintf(stderr, "FAIL gemm: y_stride < out accepted\n");
  }
  ++g_checks;
  if (all && keep::gputest::timings()) {
    time_gemv_rmsnorm(3584 + 2 * 512, 3584);
    time_gemv_rmsnorm(18944 * 2, 3584);
    for (int64_t rows : {1, 2, 4, 8}) {  // the decode step's products
      time_gemv(blas, rows, 3584 + 2 * 512, 3584, false);
      time_gemv(blas, rows, 3584, 3584, true);
      time_gemv(blas, rows, 18944 * 2, 3584, false);
      time_gemv(blas, rows, 3584, 18944, true);
    }
    if (keep::kernels::wgmma_available()) {
      for (int64_t rows : {128, 256, 384, 512, 1024, 4096}) {
        time_gemm_swiglu(blas, scratch, rows, 18944, 3584);
      }
      for (int64_t rows : {256, 512, 2048}) time_gemm_swiglu(blas, scratch, rows, 13824, 5120);
      time_products(blas, scratch, {1024, 2048, 4096});
    }
    // Qwen2.5-7B's four products (QKV, o_proj, gate|up, down) at 1024 and 4096 rows.
    for (int64_t rows : {1024, 4096}) {
      time_one(blas, ws, ws_bytes, scratch, rows, 3584 + 2 * 512, 3584, false);
      time_one(blas, ws, ws_bytes, scratch, rows, 3584, 3584, true);
      time_one(blas, ws, ws_bytes, scratch, rows, 18944 * 2, 3584, false);
      time_one(blas, ws, ws_bytes, scratch, rows, 3584, 18944, true);
    }
    // Qwen2.5-14B's QKV, o_proj and down at 1024 rows (the 1k-token prefill's).
    time_one(blas, ws, ws_bytes, scratch, 1024, 5120 + 2 * 1024, 5120, false);
    time_one(blas, ws, ws_bytes, scratch, 1024, 5120, 5120, true);
    time_one(blas, ws, ws_bytes, scratch, 1024, 5120, 13824, true);
  }
  std::printf("test_gemm: %d checks, %d failures\n", g_checks, g_failures);
  cudaFree(scratch.ptr);
  cudaFree(ws);
  return g_failures == 0 ? 0 : 1;
}
