// Each CUDA kernel of services/worker/kernels against its CPU reference (reference.h) on random
// inputs of odd and model-like sizes, in fp32 and bf16, with per-dtype tolerances and a NaN check.
// Outputs are pre-filled with NaN so that an element the kernel fails to write is caught. A plain
// main (no doctest) so that it builds on machines with nothing but CUDA: exit 0 when all pass.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "services/worker/kernels/bf16.h"
#include "services/worker/kernels/kernels.h"
#include "services/worker/kernels/reference.h"
#include "tests/gpu/gpu_test_util.h"

namespace {

using keep::kernels::Bf16;
namespace ref = keep::kernels::ref;

using keep::gputest::Buf;
using keep::gputest::g_checks;
using keep::gputest::g_failures;
using keep::gputest::nan_vec;
using keep::gputest::random_vec;

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

void test_rmsnorm(std::mt19937& rng, int64_t rows, int64_t cols, bool with_x) {
  const float eps = 1e-6f;
  auto residual = random_vec<float>(rng, static_cast<size_t>(rows * cols), -3.0f, 3.0f);
  const auto x = random_vec<float>(rng, residual.size(), -3.0f, 3.0f);
  const auto weight = random_vec<float>(rng, static_cast<size_t>(cols), 0.5f, 1.5f);
  auto want_res = residual;
  auto want = nan_vec<float>(residual.size());
  ref::rmsnorm_residual(want.data(), want_res.data(), with_x ? x.data() : nullptr, weight.data(),
                        rows, cols, eps);
  Buf<float> d_res(residual), d_x(x), d_w(weight), d_out(nan_vec<float>(residual.size()));
  CUDA_OK(keep::kernels::rmsnorm_residual(d_out.dev(), d_res.dev(), with_x ? d_x.dev() : nullptr,
                                          d_w.dev(), rows, cols, eps, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::string s =
      std::string(with_x ? "rmsnorm+residual " : "rmsnorm ") + shape({rows, cols});
  check(s + " out", d_out.host(), want);
  check(s + " residual", d_res.host(), want_res);
}

// RoPE's inverse frequencies theta^(-2i / head_dim), i < head_dim / 2, as the engine computes them.
std::vector<float> rope_inv_freq(double theta, int64_t head_dim) {
  std::vector<float> inv_freq(static_cast<size_t>(head_dim / 2));
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] =
        static_cast<float>(1.0 / std::pow(theta, 2.0 * i / static_cast<double>(head_dim)));
  }
  return inv_freq;
}

void test_rope(std::mt19937& rng, int64_t n, int64_t heads, int64_t head_dim, int64_t extra) {
  const int64_t stride = heads * head_dim + extra;  // extra > 0: rows of a wider fused tensor
  const std::vector<float> inv_freq = rope_inv_freq(1000000.0, head_dim);
  std::uniform_int_distribution<int32_t> pos(0, 40000);
  std::vector<int32_t> positions(n);
  for (auto& p : positions) p = pos(rng);
  if (n > 0) positions[0] = 0;  // identity rotation
  const auto x = random_vec<float>(rng, static_cast<size_t>(n * stride), -2.0f, 2.0f);
  auto want = x;
  ref::rope(want.data(), positions.data(), inv_freq.data(), n, heads, head_dim, stride);
  Buf<float> d_x(x);
  Buf<int32_t> d_pos(positions);
  Buf<float> d_inv(inv_freq);
  CUDA_OK(keep::kernels::rope(d_x.dev(), d_pos.template dev<int32_t>(), d_inv.dev(), n, heads,
                              head_dim, stride, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  check("rope " + shape({n, heads, head_dim, stride}), d_x.host(), want);
}

void run_all(std::mt19937& rng) {
  const int64_t odd[] = {1, 3, 7, 19, 733};
  const int64_t hidden[] = {1, 3, 7, 19, 733, 576, 3584};
  for (int64_t rows : odd) {
    for (int64_t cols : hidden) {
      if (rows * cols > 733 * 733) continue;
      test_rmsnorm(rng, rows, cols, true);
    }
  }
  test_rmsnorm(rng, 19, 3584, false);
  test_rmsnorm(rng, 70000, 7, true);  // more rows than the grid: the row loop strides
  const int64_t head_dims[] = {2, 6, 14, 38, 64, 128};
  for (int64_t n : odd) {
    for (int64_t hd : head_dims) {
      test_rope(rng, n, n == 733 ? 2 : 3, hd, 0);
      test_rope(rng, n, 1, hd, 5);
    }
  }
  test_rope(rng, 19, 14, 64, 2 * 2 * 64);  // Qwen2.5-0.5B's Q inside a fused QKV row
}

void test_invalid_arguments() {
  ++g_checks;
  float* p = nullptr;
  int32_t* ip = nullptr;
  const bool ok =
      keep::kernels::rope(p, ip, p, 1, 1, 3, 3, nullptr) == cudaErrorInvalidValue &&  // odd hd
      keep::kernels::rope(p, ip, p, 1, 2, 4, 7, nullptr) == cudaErrorInvalidValue &&  // stride
      keep::kernels::rope(p, ip, p, 1, 1, 4, 4, nullptr) == cudaErrorInvalidValue &&  // null
      keep::kernels::rmsnorm_residual(p, p, p, p, 0, 5, 1e-6f, nullptr) == cudaSuccess &&
      keep::kernels::rmsnorm_residual(p, p, p, p, 3, 5, 1e-6f, nullptr) == cudaErrorInvalidValue;
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "FAIL launcher argument checks\n");
  }
}

// ---- misc.cu: the element-wise / normalisation kernels of the bf16 block (reference_misc.cpp)
// ----

// ||got - want|| / ||want|| over the elements where want is not NaN; fp32 1e-5, bf16 1e-2.
template <typename T>
void check_rel_norm(const std::string& what, const std::vector<T>& got,
                    const std::vector<T>& want) {
  ++g_checks;
  double num = 0.0;
  double den = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = keep::kernels::to_float(want[i]);
    if (std::isnan(w)) continue;
    const double d = static_cast<double>(keep::kernels::to_float(got[i])) - w;
    num += d * d;
    den += w * w;
  }
  const double rel = keep::gputest::relative_norm(num, den);
  const double limit = std::is_same_v<T, Bf16> ? 1e-2 : 1e-5;
  if (!(rel <= limit)) {
    ++g_failures;
    std::fprintf(stderr, "FAIL %s [%s]: relative norm error %.3g > %.3g\n", what.c_str(),
                 Tol<T>::name, rel, limit);
  }
}

// Element-wise (with the NaN check) and relative-norm comparison.
template <typename T>
void compare(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
  check(what, got, want);
  check_rel_norm(what, got, want);
}

// Bit-for-bit equality; NaNs count as equal to any NaN when nan_any.
template <typename T>
void check_bits(const std::string& what, const std::vector<T>& got, const std::vector<T>& want,
                bool nan_any = false) {
  ++g_checks;
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const float g = keep::kernels::to_float(got[i]);
    const float w = keep::kernels::to_float(want[i]);
    if (nan_any && std::isnan(g) && std::isnan(w)) continue;
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      if (bad < 3) {
        std::fprintf(stderr, "FAIL %s [%s] bits at %zu: got %.9g want %.9g\n", what.c_str(),
                     Tol<T>::name, i, g, w);
      }
      ++bad;
    }
  }
  if (bad > 0) {
    ++g_failures;
    std::fprintf(stderr, "FAIL %s [%s]: %zu of %zu elements differ\n", what.c_str(), Tol<T>::name,
                 bad, want.size());
  }
}

void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "FAIL %s\n", what.c_str());
  }
}

template <typename T>
std::vector<T> slice(const std::vector<T>& v, size_t from) {
  return std::vector<T>(v.begin() + static_cast<std::ptrdiff_t>(from), v.end());
}

// host_ids: embedding_host_ids (the ids in the kernel's parameters) instead of device ids.
void test_embedding_f32(std::mt19937& rng, int64_t n, int64_t hidden, int64_t vocab,
                        bool host_ids = false) {
  const auto table = random_vec<Bf16>(rng, static_cast<size_t>(vocab * hidden), -2.0f, 2.0f);
  std::uniform_int_distribution<int32_t> id(-2, static_cast<int32_t>(vocab) + 1);  // some off-range
  std::vector<int32_t> ids(n);
  for (auto& v : ids) v = id(rng);
  auto want = nan_vec<float>(static_cast<size_t>(n * hidden));
  ref::embedding_bf16_to_f32(want.data(), table.data(), ids.data(), n, hidden, vocab);
  Buf<Bf16> d_table(table);
  Buf<int32_t> d_ids(ids);
  Buf<float> d_out(nan_vec<float>(want.size()));
  if (host_ids) {
    CUDA_OK(keep::kernels::embedding_host_ids(d_out.dev(), d_table.dev(), ids.data(), n, hidden,
                                              vocab, nullptr));
  } else {
    CUDA_OK(keep::kernels::embedding(d_out.dev(), d_table.dev(), d_ids.template dev<int32_t>(), n,
                                     hidden, vocab, nullptr));
  }
  CUDA_OK(cudaDeviceSynchronize());
  check_bits(std::string("embedding bf16->fp32") + (host_ids ? " (host ids) " : " ") +
                 shape({n, hidden, vocab}),
             d_out.host(), want);
}

// offset > 0 shifts every pointer by one element (no 16-byte alignment: the scalar path).
// alias_x: out is x's buffer.
void test_add_rmsnorm(std::mt19937& rng, int64_t rows, int64_t cols, bool with_x, bool with_bias,
                      bool with_out, size_t offset = 0, bool alias_x = false) {
  const float eps = 1e-6f;
  const size_t nc = static_cast<size_t>(rows * cols);
  const auto residual = random_vec<float>(rng, nc + offset, -3.0f, 3.0f);
  const auto x = random_vec<Bf16>(rng, nc + offset, -3.0f, 3.0f);
  const auto bias = random_vec<float>(rng, static_cast<size_t>(cols) + offset, -0.5f, 0.5f);
  const auto weight = random_vec<float>(rng, static_cast<size_t>(cols) + offset, 0.5f, 1.5f);
  auto want_res = slice(residual, offset);
  auto want = nan_vec<Bf16>(nc);
  ref::add_rmsnorm(with_out ? want.data() : nullptr, want_res.data(),
                   with_x ? x.data() + offset : nullptr, with_bias ? bias.data() + offset : nullptr,
                   weight.data() + offset, rows, cols, eps);
  Buf<float> d_res(residual), d_bias(bias), d_w(weight);
  Buf<Bf16> d_x(x), d_out(nan_vec<Bf16>(nc + offset));
  __nv_bfloat16* out = alias_x ? d_x.dev() + offset : d_out.dev() + offset;
  CUDA_OK(keep::kernels::add_rmsnorm(
      with_out ? out : nullptr, d_res.dev() + offset, with_x ? d_x.dev() + offset : nullptr,
      with_bias ? d_bias.dev() + offset : nullptr, d_w.dev() + offset, rows, cols, eps, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::string s = std::string("add_rmsnorm") + (with_x ? " +x" : "") +
                        (with_bias ? " +bias" : "") + (with_out ? " +out" : "") +
                        (offset > 0 ? " misaligned" : "") + (alias_x ? " out=x" : "") + " " +
                        shape({rows, cols});
  compare(s + " residual", slice(d_res.host(), offset), want_res);
  if (with_out) {
    compare(s + " out", slice(alias_x ? d_x.host() : d_out.host(), offset), want);
  } else {
    check_bits(s + " out untouched", d_out.host(), nan_vec<Bf16>(nc + offset), true);
  }
}

void test_gather_rows(std::mt19937& rng, int64_t n, int64_t cols, int64_t src_rows,
                      size_t offset = 0) {
  const auto in = random_vec<float>(rng, static_cast<size_t>(src_rows * cols) + offset, -5, 5);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(src_rows) - 1);
  std::vector<int32_t> rows(n);
  for (auto& r : rows) r = pick(rng);
  auto want = nan_vec<float>(static_cast<size_t>(n * cols));
  ref::gather_rows(want.data(), in.data() + offset, rows.data(), n, cols);
  Buf<float> d_in(in), d_out(nan_vec<float>(want.size() + offset));
  Buf<int32_t> d_rows(rows);
  CUDA_OK(keep::kernels::gather_rows(d_out.dev() + offset, d_in.dev() + offset,
                                     d_rows.template dev<int32_t>(), n, cols, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  check_bits("gather_rows " + shape({n, cols, src_rows}) + (offset > 0 ? " misaligned" : ""),
             slice(d_out.host(), offset), want);
}

void test_swiglu_rows(std::mt19937& rng, int64_t rows, int64_t inter) {
  auto gate_up = random_vec<Bf16>(rng, static_cast<size_t>(rows * 2 * inter), -8.0f, 8.0f);
  if (inter > 2) {
    gate_up[0] = keep::kernels::from_float<Bf16>(-100.0f);  // exp(-g) overflows: silu -> -0
    gate_up[1] = keep::kernels::from_float<Bf16>(100.0f);
  }
  auto want = nan_vec<Bf16>(static_cast<size_t>(rows * inter));
  ref::swiglu_rows(want.data(), gate_up.data(), rows, inter);
  Buf<Bf16> d_gu(gate_up), d_out(nan_vec<Bf16>(want.size()));
  CUDA_OK(keep::kernels::swiglu_rows(d_out.dev(), d_gu.dev(), rows, inter, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  compare("swiglu_rows " + shape({rows, inter}), d_out.host(), want);
}

struct QkvCase {
  int64_t heads;
  int64_t kv_heads;
  int64_t head_dim;
  double theta;
};

// variant: 0 all biases and both fp32 outputs; 1 no bias, no k_pre, no v_out; 2 bias on K only,
// v_out only. misalign_kpre: k_pre one float off 16-byte alignment (the scalar path).
void test_qkv_finish(std::mt19937& rng, int64_t rows, const QkvCase& c, int variant,
                     bool misalign_kpre = false) {
  const int64_t hd = c.head_dim;
  const int64_t qd = c.heads * hd;
  const int64_t kvd = c.kv_heads * hd;
  const int64_t capacity = 2 * rows + 5;
  const bool bias_q = variant == 0;
  const bool bias_k = variant == 0 || variant == 2;
  const bool bias_v = variant == 0;
  const bool with_kpre = variant == 0 || (misalign_kpre && variant != 1);
  const bool with_vout = variant == 0 || variant == 2;
  const std::vector<float> inv_freq = rope_inv_freq(c.theta, hd);
  std::uniform_int_distribution<int32_t> pos(0, 40000);
  std::vector<int32_t> positions(rows);
  for (auto& p : positions) p = pos(rng);
  positions[0] = 0;                      // identity rotation
  if (rows > 2) positions[1] = 131071;   // beyond any table
  if (rows > 3) positions[2] = 1000003;  // large angles (slow sincosf path)
  std::vector<int32_t> all(static_cast<size_t>(capacity));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  const std::vector<int32_t> slots(all.begin(), all.begin() + rows);  // distinct, scattered
  const auto qkv = random_vec<Bf16>(rng, static_cast<size_t>(rows * (qd + 2 * kvd)), -2.0f, 2.0f);
  const auto bq = random_vec<float>(rng, static_cast<size_t>(qd), -0.5f, 0.5f);
  const auto bk = random_vec<float>(rng, static_cast<size_t>(kvd), -0.5f, 0.5f);
  const auto bv = random_vec<float>(rng, static_cast<size_t>(kvd), -0.5f, 0.5f);
  const size_t koff = misalign_kpre ? 1 : 0;

  auto want_qkv = qkv;
  auto want_kpre = nan_vec<float>(static_cast<size_t>(rows * kvd));
  auto want_vout = nan_vec<float>(static_cast<size_t>(rows * kvd));
  auto want_k = nan_vec<Bf16>(static_cast<size_t>(capacity * kvd));
  auto want_v = nan_vec<Bf16>(static_cast<size_t>(capacity * kvd));
  ref::qkv_finish(want_qkv.data(), with_kpre ? want_kpre.data() : nullptr,
                  with_vout ? want_vout.data() : nullptr, want_k.data(), want_v.data(),
                  bias_q ? bq.data() : nullptr, bias_k ? bk.data() : nullptr,
                  bias_v ? bv.data() : nullptr, positions.data(), slots.data(), inv_freq.data(),
                  rows, c.heads, c.kv_heads, hd);

  Buf<Bf16> d_qkv(qkv);
  Buf<float> d_kpre(nan_vec<float>(want_kpre.size() + koff)),
      d_vout(nan_vec<float>(want_vout.size()));
  Buf<Bf16> d_k(nan_vec<Bf16>(want_k.size())), d_v(nan_vec<Bf16>(want_v.size()));
  Buf<float> d_bq(bq), d_bk(bk), d_bv(bv), d_inv(inv_freq);
  Buf<int32_t> d_pos(positions), d_slots(slots);
  CUDA_OK(keep::kernels::qkv_finish(
      d_qkv.dev(), with_kpre ? d_kpre.dev() + koff : nullptr, with_vout ? d_vout.dev() : nullptr,
      d_k.dev(), d_v.dev(), bias_q ? d_bq.dev() : nullptr, bias_k ? d_bk.dev() : nullptr,
      bias_v ? d_bv.dev() : nullptr, d_pos.template dev<int32_t>(), d_slots.template dev<int32_t>(),
      d_inv.dev(), rows, c.heads, c.kv_heads, hd, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::string s = std::string("qkv_finish v") + std::to_string(variant) +
                        (misalign_kpre ? " misaligned" : "") + " " +
                        shape({rows, c.heads, c.kv_heads, hd});
  compare(s + " q (qkv)", d_qkv.host(), want_qkv);  // K and V of qkv must be unchanged
  const auto kpre = d_kpre.host();
  if (koff > 0) expect(std::isnan(kpre[0]), s + " k_pre: element before the output untouched");
  compare(s + " k_pre", slice(kpre, koff), want_kpre);  // all NaN when null: nothing written
  compare(s + " v_out", d_vout.host(), want_vout);
  compare(s + " kv_k", d_k.host(), want_k);  // slots not in `slots` stay NaN
  compare(s + " kv_v", d_v.host(), want_v);
}

template <typename T>
void test_fill_uniform(int64_t n, uint64_t seed, float lo, float hi, size_t offset = 0) {
  std::vector<T> want(static_cast<size_t>(n));
  ref::fill_uniform<T>(want.data(), n, seed, lo, hi);
  Buf<T> d_out(nan_vec<T>(want.size() + offset));
  CUDA_OK(keep::kernels::fill_uniform(d_out.dev() + offset, n, seed, lo, hi, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto all = d_out.host();
  const auto got = slice(all, offset);
  const std::string s = "fill_uniform " + shape({n}) + " seed " + std::to_string(seed) + " [" +
                        std::to_string(lo) + ", " + std::to_string(hi) + ")" +
                        (offset > 0 ? " misaligned" : "");
  check_bits(s, got, want);
  if (offset > 0) expect(std::isnan(keep::kernels::to_float(all[0])), s + ": before untouched");
  double sum = 0.0;
  bool in_range = true;
  bool any_nonzero = false;
  for (const T& v : got) {
    const float f = keep::kernels::to_float(v);
    in_range = in_range && f >= lo && f < hi;
    any_nonzero = any_nonzero || f != 0.0f;
    sum += f;
  }
  expect(in_range, s + ": values in [lo, hi)");
  expect(any_nonzero, s + ": not all zeros");
  if (n >= 100000) {
    const double mean = sum / static_cast<double>(n);
    const double mid = 0.5 * (static_cast<double>(lo) + hi);
    expect(std::fabs(mean - mid) < 0.01 * (static_cast<double>(hi) - lo), s + ": mean near centre");
  }
}

template <typename T>
void test_fill_uniform_seeds() {
  const int64_t n = 4099;
  Buf<T> a(nan_vec<T>(n)), b(nan_vec<T>(n));
  CUDA_OK(keep::kernels::fill_uniform(a.dev(), n, 0, -1.0f, 1.0f, nullptr));
  CUDA_OK(keep::kernels::fill_uniform(b.dev(), n, 1, -1.0f, 1.0f, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto ha = a.host();
  const auto hb = b.host();
  size_t same = 0;
  for (size_t i = 0; i < ha.size(); ++i) same += std::memcmp(&ha[i], &hb[i], sizeof(T)) == 0;
  expect(same < ha.size() / 20,
         std::string("fill_uniform seeds 0 and 1 differ [") + Tol<T>::name + "]");
}

// fp32 -> bf16 (round to nearest even, NaN stays NaN, bits of float_to_bf16) -> fp32 (exact).
void test_convert(std::mt19937& rng, int64_t n, size_t offset = 0) {
  auto in = random_vec<float>(rng, static_cast<size_t>(n) + offset, -1000.0f, 1000.0f);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            -0.0f,
                            0.0f,
                            1.0f + 0x1p-8f,                     // tie: to even (down)
                            1.0f + 3 * 0x1p-8f,                 // tie: to even (up)
                            std::numeric_limits<float>::max(),  // rounds to inf
                            std::numeric_limits<float>::denorm_min(),
                            1e-40f,
                            -3.0e38f};
  for (size_t i = 0; i < std::size(specials) && offset + i < in.size(); ++i) {
    in[offset + i] = specials[i];
  }
  std::vector<Bf16> want16(static_cast<size_t>(n));
  std::vector<float> want32(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    want16[i] = keep::kernels::float_to_bf16(in[offset + i]);
    want32[i] = keep::kernels::bf16_to_float(want16[i]);
  }
  Buf<float> d_in(in), d_back(nan_vec<float>(static_cast<size_t>(n) + offset));
  Buf<Bf16> d_16(nan_vec<Bf16>(static_cast<size_t>(n) + offset));
  CUDA_OK(keep::kernels::convert(d_16.dev() + offset, d_in.dev() + offset, n, nullptr));
  CUDA_OK(keep::kernels::convert(d_back.dev() + offset, d_16.dev() + offset, n, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::string s = "convert " + shape({n}) + (offset > 0 ? " misaligned" : "");
  check_bits(s + " fp32->bf16", slice(d_16.host(), offset), want16, true);
  check_bits(s + " bf16->fp32", slice(d_back.host(), offset), want32, true);
  // bf16 -> fp32 is exact: the bits of each bf16 the kernel wrote, shifted.
  const auto got16 = slice(d_16.host(), offset);
  std::vector<float> exact(got16.size());
  for (size_t i = 0; i < got16.size(); ++i) exact[i] = keep::kernels::bf16_to_float(got16[i]);
  check_bits(s + " bf16->fp32 exact", slice(d_back.host(), offset), exact, true);
}

// The loader's pass: bf16 pre-RoPE K and V rows into a bf16 view, from device memory or (mapped)
// read in place from registered host memory, as keep-worker reads the shared KV region.
void test_load_kv_rope(std::mt19937& rng, int64_t n, int64_t heads, int64_t head_dim, bool mapped) {
  const std::vector<float> inv_freq = rope_inv_freq(1000000.0, head_dim);
  std::uniform_int_distribution<int32_t> pos(0, 40000);
  std::vector<int32_t> positions(n);
  for (auto& p : positions) p = pos(rng);
  if (n > 0) positions[0] = 0;
  const size_t elems = static_cast<size_t>(n * heads * head_dim);
  auto k_pre = random_vec<Bf16>(rng, elems, -2.0f, 2.0f);
  auto v = random_vec<Bf16>(rng, elems, -2.0f, 2.0f);
  std::vector<Bf16> want_k(elems), want_v(elems);
  ref::load_kv_rope(want_k.data(), want_v.data(), k_pre.data(), v.data(), positions.data(),
                    inv_freq.data(), n, heads, head_dim);
  Buf<Bf16> d_k(keep::gputest::nan_vec<Bf16>(elems)), d_v(keep::gputest::nan_vec<Bf16>(elems));
  Buf<int32_t> d_pos(positions);
  Buf<float> d_inv(inv_freq);
  Buf<Bf16> src_k(k_pre), src_v(v);
  const __nv_bfloat16* in_k = src_k.dev();
  const __nv_bfloat16* in_v = src_v.dev();
  if (mapped && elems > 0) {  // the kernel reads host memory in place
    CUDA_OK(cudaHostRegister(k_pre.data(), elems * sizeof(Bf16), cudaHostRegisterMapped));
    CUDA_OK(cudaHostRegister(v.data(), elems * sizeof(Bf16), cudaHostRegisterMapped));
    void* hk = nullptr;
    void* hv = nullptr;
    CUDA_OK(cudaHostGetDevicePointer(&hk, k_pre.data(), 0));
    CUDA_OK(cudaHostGetDevicePointer(&hv, v.data(), 0));
    in_k = static_cast<const __nv_bfloat16*>(hk);
    in_v = static_cast<const __nv_bfloat16*>(hv);
  }
  CUDA_OK(keep::kernels::load_kv_rope(d_k.dev(), d_v.dev(), in_k, in_v,
                                      d_pos.template dev<int32_t>(), d_inv.dev(), n, heads,
                                      head_dim, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  if (mapped && elems > 0) {
    CUDA_OK(cudaHostUnregister(k_pre.data()));
    CUDA_OK(cudaHostUnregister(v.data()));
  }
  const std::string what =
      std::string(mapped ? "load_kv_rope mapped " : "load_kv_rope ") + shape({n, heads, head_dim});
  check(what + " k", d_k.host(), want_k);
  check_bits(what + " v", d_v.host(), want_v);  // V is copied, bit for bit
}

// load_kv_runs: several runs into two layer views in one launch, against load_kv_rope's
// reference run by run (positions = slots); slots between the runs stay untouched. `blocks`
// bounds the grid (the loader's few SMs: one block strides over every run); `vec` takes the
// 16-byte path, else the sources sit one element off 16-byte alignment (the element path).
// `in_place`: the copy engines' form -- pre-RoPE K and V already in the views' slots, the runs
// rotating K there (k_pre = the view's slots, v null: V left as it is).
void test_load_kv_runs(std::mt19937& rng, int n_runs, int64_t heads, int64_t head_dim, bool mapped,
                       int32_t blocks, bool vec, bool in_place = false) {
  const std::vector<float> inv_freq = rope_inv_freq(1000000.0, head_dim);
  const int64_t row = heads * head_dim;
  std::uniform_int_distribution<int32_t> len(1, 90), gap(0, 5);
  std::vector<int32_t> slot, count;
  int32_t at = gap(rng);
  for (int i = 0; i < n_runs; ++i) {
    slot.push_back(at);
    count.push_back(len(rng));
    at += count.back() + gap(rng);
  }
  const int64_t capacity = at + 1;
  // Run i goes to view i % 2 (two layers' views in one launch).
  std::vector<std::vector<Bf16>> k(n_runs), v(n_runs);
  std::vector<std::vector<Bf16>> want_k(2, nan_vec<Bf16>(static_cast<size_t>(capacity * row)));
  auto want_v = want_k;
  for (int i = 0; i < n_runs; ++i) {
    k[i] = random_vec<Bf16>(rng, static_cast<size_t>(count[i] * row + 8), -2.0f, 2.0f);
    v[i] = random_vec<Bf16>(rng, k[i].size(), -2.0f, 2.0f);
    std::vector<int32_t> pos(static_cast<size_t>(count[i]));
    for (int32_t r = 0; r < count[i]; ++r) pos[r] = slot[i] + r;
    const size_t off = vec || in_place ? 0 : 1;
    ref::load_kv_rope(want_k[i % 2].data() + slot[i] * row, want_v[i % 2].data() + slot[i] * row,
                      k[i].data() + off, v[i].data() + off, pos.data(), inv_freq.data(), count[i],
                      heads, head_dim);
  }
  std::vector<std::vector<Bf16>> init(4, nan_vec<Bf16>(want_k[0].size()));
  if (in_place) {  // what the copies put in the slots: the entries' bytes as they are
    for (int i = 0; i < n_runs; ++i) {
      std::copy_n(k[i].begin(), count[i] * row, init[2 * (i % 2)].begin() + slot[i] * row);
      std::copy_n(v[i].begin(), count[i] * row, init[2 * (i % 2) + 1].begin() + slot[i] * row);
    }
  }
  std::vector<std::unique_ptr<Buf<Bf16>>> views;
  for (int b = 0; b < 4; ++b) views.push_back(std::make_unique<Buf<Bf16>>(init[b]));
  std::vector<std::unique_ptr<Buf<Bf16>>> src;
  std::vector<keep::kernels::KvLoadRun> runs;
  for (int i = 0; i < n_runs; ++i) {
    keep::kernels::KvLoadRun r{};
    const size_t off = vec ? 0 : 1;
    if (in_place) {
      r.k_pre = views[2 * (i % 2)]->dev() + slot[i] * row;
      r.v = nullptr;
    } else if (mapped) {
      CUDA_OK(cudaHostRegister(k[i].data(), k[i].size() * sizeof(Bf16), cudaHostRegisterMapped));
      CUDA_OK(cudaHostRegister(v[i].data(), v[i].size() * sizeof(Bf16), cudaHostRegisterMapped));
      void* hk = nullptr;
      void* hv = nullptr;
      CUDA_OK(cudaHostGetDevicePointer(&hk, k[i].data(), 0));
      CUDA_OK(cudaHostGetDevicePointer(&hv, v[i].data(), 0));
      r.k_pre = static_cast<const __nv_bfloat16*>(hk) + off;
      r.v = static_cast<const __nv_bfloat16*>(hv) + off;
    } else {
      src.push_back(std::make_unique<Buf<Bf16>>(k[i]));
      r.k_pre = src.back()->dev() + off;
      src.push_back(std::make_unique<Buf<Bf16>>(v[i]));
      r.v = src.back()->dev() + off;
    }
    r.k_view = views[2 * (i % 2)]->dev();
    r.v_view = views[2 * (i % 2) + 1]->dev();
    r.slot = slot[i];
    r.count = count[i];
    runs.push_back(r);
  }
  void* d_runs = nullptr;
  CUDA_OK(cudaMalloc(&d_runs, std::max<size_t>(1, runs.size()) * sizeof(runs[0])));
  if (!runs.empty()) {
    CUDA_OK(cudaMemcpy(d_runs, runs.data(), runs.size() * sizeof(runs[0]), cudaMemcpyHostToDevice));
  }
  Buf<float> d_inv(inv_freq);
  CUDA_OK(keep::kernels::load_kv_runs(static_cast<const keep::kernels::KvLoadRun*>(d_runs), n_runs,
                                      d_inv.dev(), heads, head_dim, blocks, vec, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  cudaFree(d_runs);
  if (mapped) {
    for (int i = 0; i < n_runs; ++i) {
      CUDA_OK(cudaHostUnregister(k[i].data()));
      CUDA_OK(cudaHostUnregister(v[i].data()));
    }
  }
  const std::string what =
      std::string(in_place ? "load_kv_runs in place "
                           : (mapped ? "load_kv_runs mapped " : "load_kv_runs ")) +
      shape({n_runs, heads, head_dim}) + " blocks " + std::to_string(blocks) +
      (vec ? " vec" : " scalar");
  for (int l = 0; l < 2; ++l) {
    check(what + " k" + std::to_string(l), views[2 * l]->host(), want_k[l]);
    check_bits(what + " v" + std::to_string(l), views[2 * l + 1]->host(), want_v[l],
               /*nan_any=*/true);
  }
}

// Arguments load_kv_runs refuses before launching.
void test_load_kv_runs_arguments() {
  ++g_checks;
  const auto* runs = reinterpret_cast<const keep::kernels::KvLoadRun*>(uintptr_t{256});
  const auto* f = reinterpret_cast<const float*>(uintptr_t{256});
  const bool ok =
      keep::kernels::load_kv_runs(runs, 1, f, 8, 128, 0, true, nullptr) == cudaErrorInvalidValue &&
      keep::kernels::load_kv_runs(runs, 1, f, 8, 72, 4, true, nullptr) == cudaErrorInvalidValue &&
      keep::kernels::load_kv_runs(runs, -1, f, 8, 128, 4, true, nullptr) == cudaErrorInvalidValue &&
      keep::kernels::load_kv_runs(nullptr, 1, f, 8, 128, 4, true, nullptr) ==
          cudaErrorInvalidValue &&
      keep::kernels::load_kv_runs(nullptr, 0, nullptr, 8, 128, 4, true, nullptr) == cudaSuccess;
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "FAIL load_kv_runs argument checks\n");
  }
}

void run_misc(std::mt19937& rng) {
  test_load_kv_runs_arguments();
  test_load_kv_runs(rng, 1, 3, 64, false, 4, true);
  test_load_kv_runs(rng, 3, 3, 64, false, 1, false);  // one block over every run
  test_load_kv_runs(rng, 40, 8, 128, false, 32, true);
  test_load_kv_runs(rng, 40, 8, 128, false, 7, false);
  test_load_kv_runs(rng, 40, 8, 128, true, 32, true);  // the registered region, read in place
  test_load_kv_runs(rng, 40, 4, 64, true, 1000, false);
  test_load_kv_runs(rng, 0, 8, 128, false, 32, true);
  test_load_kv_runs(rng, 40, 8, 128, false, 16, true, /*in_place=*/true);  // loader_dma's rotation
  test_load_kv_runs(rng, 5, 3, 64, false, 2, false, /*in_place=*/true);
  for (const int64_t n : {1, 3, 7, 19, 733}) {
    test_load_kv_rope(rng, n, 3, 64, false);
    test_load_kv_rope(rng, n, 8, 128, n == 19);  // Qwen2.5-7B/14B's K rows
  }
  test_load_kv_rope(rng, 0, 8, 128, false);
  const int64_t odd[] = {1, 3, 7, 19, 733};
  const int64_t cols[] = {1, 3, 7, 19, 733, 576, 3584, 5120};
  for (int64_t n : odd) {
    for (int64_t h : cols) test_embedding_f32(rng, n, h, 37);
  }
  test_embedding_f32(rng, 4096, 3584, 1000);
  // The ids in the kernel's parameters: each parameter block size, its edges, then refused past it.
  for (int64_t n : {1, 3, 16, 17, 733, 1024, 1025, 4096}) {
    for (int64_t h : {7, 576, 5120}) test_embedding_f32(rng, n, h, 37, true);
  }
  {
    ++g_checks;
    std::vector<int32_t> ids(keep::kernels::kEmbedParamIds + 1, 0);
    float* p = nullptr;
    CUDA_OK(cudaMalloc(&p, 64));
    const cudaError_t err =
        keep::kernels::embedding_host_ids(p, reinterpret_cast<const __nv_bfloat16*>(p), ids.data(),
                                          static_cast<int64_t>(ids.size()), 8, 4, nullptr);
    if (err != cudaErrorInvalidValue) {
      ++g_failures;
      std::fprintf(stderr, "FAIL embedding_host_ids: %zu ids accepted\n", ids.size());
    }
    cudaFree(p);
  }

  for (int64_t rows : odd) {
    for (int64_t c : cols) {
      test_add_rmsnorm(rng, rows, c, true, true, true);
      test_add_rmsnorm(rng, rows, c, true, false, true);
    }
  }
  for (int64_t c : {int64_t{576}, int64_t{3584}, int64_t{5120}}) {
    test_add_rmsnorm(rng, 19, c, false, false, true);        // norm only
    test_add_rmsnorm(rng, 19, c, true, true, false);         // add only
    test_add_rmsnorm(rng, 19, c, true, false, false);        // add only, no bias
    test_add_rmsnorm(rng, 7, c, true, true, true, 1);        // misaligned: scalar path
    test_add_rmsnorm(rng, 7, c, true, true, true, 0, true);  // out = x
  }
  test_add_rmsnorm(rng, 7, 3584, false, false, true, 1);
  test_add_rmsnorm(rng, 19, 8200, true, true, true);      // wider than the registers hold
  test_add_rmsnorm(rng, 19, 1031, true, true, true);      // four chunks a thread, scalar
  test_add_rmsnorm(rng, 19, 2053, true, true, true);      // wider than the registers hold, scalar
  test_add_rmsnorm(rng, 1024, 5120, false, false, true);  // 14B norm: two chunks, 320 threads
  test_add_rmsnorm(rng, 3, 18944, true, false, true);
  test_add_rmsnorm(rng, 4096, 3584, true, true, true);  // model-like
  test_add_rmsnorm(rng, 1024, 5120, true, false, true);
  test_add_rmsnorm(rng, 70000, 8, true, true, true);  // more rows than the grid: rows stride

  for (int64_t n : odd) {
    for (int64_t c : cols) test_gather_rows(rng, n, c, 41);
  }
  test_gather_rows(rng, 733, 3584, 4096);
  test_gather_rows(rng, 19, 3584, 100, 1);
  test_gather_rows(rng, 70000, 4, 50);

  const int64_t inters[] = {1, 3, 7, 19, 733, 576, 4864, 18944};
  for (int64_t rows : odd) {
    for (int64_t inter : inters) {
      if (rows * inter > 733 * 4864) continue;
      test_swiglu_rows(rng, rows, inter);
    }
  }
  test_swiglu_rows(rng, 733, 4864);
  test_swiglu_rows(rng, 1024, 18944);
  test_swiglu_rows(rng, 70000, 8);  // rows beyond grid.y: rows stride

  const QkvCase cases[] = {
      {9, 3, 64, 10000.0},      // SmolLM2-135M
      {28, 4, 128, 1000000.0},  // Qwen2.5-7B
      {14, 2, 64, 1000000.0},   // Qwen2.5-0.5B
      {3, 1, 6, 10000.0},       // half not a multiple of 8: scalar path
      {2, 2, 14, 10000.0},
  };
  for (int64_t rows : odd) {
    for (const QkvCase& c : cases) {
      for (int variant = 0; variant < 3; ++variant) {
        test_qkv_finish(rng, rows, c, variant);
      }
    }
  }
  test_qkv_finish(rng, 19, cases[1], 0, true);
  test_qkv_finish(rng, 19, cases[0], 2, true);
  test_qkv_finish(rng, 4096, cases[1], 0);  // model-like prefill
  test_qkv_finish(rng, 2048, cases[0], 0);
  test_qkv_finish(rng, 70000, cases[3], 1);  // more rows than the grid

  for (int64_t n : odd) {
    test_fill_uniform<float>(n, 42, -1.0f, 1.0f);
    test_fill_uniform<Bf16>(n, 42, -1.0f, 1.0f);
    test_fill_uniform<float>(n, 7, -0.02f, 0.02f, 1);
    test_fill_uniform<Bf16>(n, 7, -0.02f, 0.02f, 1);
  }
  test_fill_uniform<float>((1 << 20) + 3, 0, 0.0f, 1.0f);
  test_fill_uniform<Bf16>((1 << 20) + 3, 0, 0.0f, 1.0f);
  test_fill_uniform<float>((1 << 20) + 5, 123456789, -0.05f, 0.05f, 1);
  test_fill_uniform<Bf16>((1 << 20) + 5, 123456789, 2.0f, 3.0f, 1);
  test_fill_uniform<Bf16>(4099, 5, 1.0f, 1.0078125f);  // one bf16 step wide: every value is lo
  test_fill_uniform<float>(4099, 5, 1.0f, std::nextafter(1.0f, 2.0f));
  test_fill_uniform_seeds<float>();
  test_fill_uniform_seeds<Bf16>();

  for (int64_t n : odd) {
    test_convert(rng, n);
    test_convert(rng, n, 1);
  }
  test_convert(rng, (1 << 20) + 5);
  test_convert(rng, 4099, 1);
}

void test_misc_invalid_arguments() {
  ++g_checks;
  float* f = nullptr;
  __nv_bfloat16* b = nullptr;
  int32_t* ip = nullptr;
  namespace k = keep::kernels;
  __nv_bfloat16 fake_out;  // non-null, never written: the launcher refuses before any launch
  // Each call with the code it must return; a mismatch names the call.
  struct Case {
    const char* call;
    cudaError_t got, want;
  };
  const Case cases[] = {
      {"k::embedding(f, b, ip, 2, 8, 4, nullptr)", k::embedding(f, b, ip, 2, 8, 4, nullptr),
       cudaErrorInvalidValue},
      {"k::embedding(f, b, ip, 0, 8, 4, nullptr)", k::embedding(f, b, ip, 0, 8, 4, nullptr),
       cudaSuccess},
      {"k::add_rmsnorm(&fake_out, nullptr residual, ...)",
       k::add_rmsnorm(&fake_out, f, nullptr, f, f, 3, 8, 1e-6f, nullptr), cudaErrorInvalidValue},
      {"k::add_rmsnorm(b, f, b, f, f, -1, 8, 1e-6f, nullptr)",
       k::add_rmsnorm(b, f, b, f, f, -1, 8, 1e-6f, nullptr), cudaErrorInvalidValue},
      {"k::add_rmsnorm(b, f, b, f, f, 0, 8, 1e-6f, nullptr)",
       k::add_rmsnorm(b, f, b, f, f, 0, 8, 1e-6f, nullptr), cudaSuccess},
      {"k::add_rmsnorm(nullptr, f, nullptr, f, f, 3, 8, 1e-6f, nullptr)",
       k::add_rmsnorm(nullptr, f, nullptr, f, f, 3, 8, 1e-6f, nullptr), cudaSuccess},
      {"k::gather_rows(f, f, ip, 3, 8, nullptr)", k::gather_rows(f, f, ip, 3, 8, nullptr),
       cudaErrorInvalidValue},
      {"k::gather_rows(f, f, ip, 3, 0, nullptr)", k::gather_rows(f, f, ip, 3, 0, nullptr),
       cudaSuccess},
      {"k::swiglu_rows(b, b, 2, 8, nullptr)", k::swiglu_rows(b, b, 2, 8, nullptr),
       cudaErrorInvalidValue},
      {"k::swiglu_rows(b, b, 2, -8, nullptr)", k::swiglu_rows(b, b, 2, -8, nullptr),
       cudaErrorInvalidValue},
      {"k::qkv_finish(b, f, f, b, b, f, f, f, ip, ip, f, 2, 2, 1, 6, nullptr)",
       k::qkv_finish(b, f, f, b, b, f, f, f, ip, ip, f, 2, 2, 1, 6, nullptr),
       cudaErrorInvalidValue},  // null pointers
      {"k::qkv_finish(b, f, f, b, b, f, f, f, ip, ip, f, 2, 2, 1, 7, nullptr)",
       k::qkv_finish(b, f, f, b, b, f, f, f, ip, ip, f, 2, 2, 1, 7, nullptr),
       cudaErrorInvalidValue},  // odd head_dim
      {"k::qkv_finish(b, f, f, b, b, f, f, f, ip, ip, f, 0, 2, 1, 8, nullptr)",
       k::qkv_finish(b, f, f, b, b, f, f, f, ip, ip, f, 0, 2, 1, 8, nullptr), cudaSuccess},
      {"k::fill_uniform(f, 4, 1, 0.0f, 1.0f, nullptr)",
       k::fill_uniform(f, 4, 1, 0.0f, 1.0f, nullptr), cudaErrorInvalidValue},
      {"k::fill_uniform(f, 0, 1, 0.0f, 1.0f, nullptr)",
       k::fill_uniform(f, 0, 1, 0.0f, 1.0f, nullptr), cudaSuccess},
      {"k::fill_uniform(b, 0, 1, 1.0f, 1.0f, nullptr)",
       k::fill_uniform(b, 0, 1, 1.0f, 1.0f, nullptr), cudaErrorInvalidValue},  // lo == hi
      {"k::fill_uniform(b, 0, 1, 0.0f, std::numeric_limits<float>::quiet_NaN(), nullptr)",
       k::fill_uniform(b, 0, 1, 0.0f, std::numeric_limits<float>::quiet_NaN(), nullptr),
       cudaErrorInvalidValue},  // NaN hi
      {"k::convert(b, f, 5, nullptr)", k::convert(b, f, 5, nullptr), cudaErrorInvalidValue},
      {"k::convert(f, b, -1, nullptr)", k::convert(f, b, -1, nullptr), cudaErrorInvalidValue},
      {"k::convert(f, b, 0, nullptr)", k::convert(f, b, 0, nullptr), cudaSuccess},
  };
  for (const Case& c : cases) {
    if (c.got != c.want) {
      ++g_failures;
      std::fprintf(stderr, "FAIL misc launcher argument check: %s returned %s, want %s\n", c.call,
                   cudaGetErrorName(c.got), cudaGetErrorName(c.want));
    }
  }
}

// Median of one launch's time, in us: 20 samples of 10 launches back to back after 3 warm-ups.
template <typename F>
double median_launch_us(F&& call) {
  return keep::gputest::time_launches(call, 20, 10, 3).median_ms * 1e3;
}

// Informational timings, not checks: the per-layer element-wise kernels of a 1024-token prefill
// (the norm-only add_rmsnorm before QKV and gate/up, and qkv_finish into a bf16 view) at the
// Qwen2.5-7B and 14B shapes. Their operands stay in L2 between launches, as in the model (ncu:
// RESULTS.md run 16). qkv_finish rotates Q in place on every launch; the values do not change its
// path (the positions, and with them the sincosf branches, are fixed).
void time_elementwise(std::mt19937& rng) {
  struct Shape {
    const char* name;
    int64_t hidden;
    int64_t heads;
    int64_t kv_heads;
  };
  const int64_t rows = 1024;
  const int64_t hd = 128;
  for (const Shape& sh : {Shape{"7B", 3584, 28, 4}, Shape{"14B", 5120, 40, 8}}) {
    const size_t nc = static_cast<size_t>(rows * sh.hidden);
    Buf<float> d_res(random_vec<float>(rng, nc, -3.0f, 3.0f));
    Buf<float> d_w(random_vec<float>(rng, static_cast<size_t>(sh.hidden), 0.5f, 1.5f));
    Buf<Bf16> d_out(nan_vec<Bf16>(nc));
    const double norm_us = median_launch_us([&] {
      return keep::kernels::add_rmsnorm(d_out.dev(), d_res.dev(), nullptr, nullptr, d_w.dev(), rows,
                                        sh.hidden, 1e-6f, nullptr);
    });
    std::printf("  timing add_rmsnorm (norm only) %s %lld x %lld: %.2f us median of 20 x 10\n",
                sh.name, static_cast<long long>(rows), static_cast<long long>(sh.hidden), norm_us);

    const int64_t qd = sh.heads * hd;
    const int64_t kvd = sh.kv_heads * hd;
    const std::vector<float> inv_freq = rope_inv_freq(1e6, hd);
    std::vector<int32_t> positions(static_cast<size_t>(rows));
    std::iota(positions.begin(), positions.end(), 0);
    Buf<Bf16> d_qkv(random_vec<Bf16>(rng, static_cast<size_t>(rows * (qd + 2 * kvd)), -2.0f, 2.0f));
    Buf<Bf16> d_k(nan_vec<Bf16>(static_cast<size_t>(rows * kvd)));
    Buf<Bf16> d_v(nan_vec<Bf16>(static_cast<size_t>(rows * kvd)));
    Buf<float> d_bq(random_vec<float>(rng, static_cast<size_t>(qd), -0.5f, 0.5f));
    Buf<float> d_bk(random_vec<float>(rng, static_cast<size_t>(kvd), -0.5f, 0.5f));
    Buf<float> d_bv(random_vec<float>(rng, static_cast<size_t>(kvd), -0.5f, 0.5f));
    Buf<float> d_inv(inv_freq);
    Buf<int32_t> d_pos(positions);
    const double qkv_us = median_launch_us([&] {
      return keep::kernels::qkv_finish(d_qkv.dev(), nullptr, nullptr, d_k.dev(), d_v.dev(),
                                       d_bq.dev(), d_bk.dev(), d_bv.dev(),
                                       d_pos.template dev<int32_t>(), d_pos.template dev<int32_t>(),
                                       d_inv.dev(), rows, sh.heads, sh.kv_heads, hd, nullptr);
    });
    std::printf("  timing qkv_finish %s %lld rows, %lld/%lld hd%lld: %.2f us median of 20 x 10\n",
                sh.name, static_cast<long long>(rows), static_cast<long long>(sh.heads),
                static_cast<long long>(sh.kv_heads), static_cast<long long>(hd), qkv_us);
  }
}

}  // namespace

int main() {
  if (!keep::gputest::print_device()) return 2;
  std::mt19937 rng(1234);
  // KEEP_GPU_TEST_ONLY=times: the element-wise timings alone, no checks (scripts/gpu-ab.sh).
  const char* only = std::getenv("KEEP_GPU_TEST_ONLY");
  if (only != nullptr && std::string(only) == "times") {
    time_elementwise(rng);
    return 0;
  }
  run_all(rng);
  test_invalid_arguments();
  run_misc(rng);
  test_misc_invalid_arguments();
  if (keep::gputest::timings()) time_elementwise(rng);
  std::printf("test_kernels: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
