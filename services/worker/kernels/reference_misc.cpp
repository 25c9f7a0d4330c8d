// CPU references of misc.cu (reference.h, "misc.cu" section): the element-wise and normalisation
// kernels of the bf16 transformer block. fp32 arithmetic as the kernels do it (operation by
// operation, one rounding to the storage type on store); the RMSNorm sum of squares is a double
// here, a fp32 tree in the kernel (tolerances absorb it). fill_uniform is bit-exact.
#include <cmath>
#include <cstdint>
#include <vector>

#include "services/worker/kernels/reference.h"

namespace keep::kernels::ref {

void embedding_bf16_to_f32(float* out, const Bf16* table, const int32_t* ids, int64_t n,
                           int64_t hidden, int64_t vocab) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t id = ids[t];
    float* o = out + t * hidden;
    const bool in = id >= 0 && id < vocab;
    for (int64_t i = 0; i < hidden; ++i) o[i] = in ? bf16_to_float(table[id * hidden + i]) : 0.0f;
  }
}

// Per element: v = float(x) + bias (bias added to x first, as a projection's bias), residual =
// residual + v; both fp32 adds, no rounding to a narrower type.
void add_rmsnorm(Bf16* out, float* residual, const Bf16* x, const float* bias, const float* weight,
                 int64_t rows, int64_t cols, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* res = residual + r * cols;
    if (x != nullptr) {
      for (int64_t i = 0; i < cols; ++i) {
        float v = bf16_to_float(x[r * cols + i]);
        if (bias != nullptr) v = v + bias[i];
        res[i] = res[i] + v;
      }
    }
    if (out == nullptr) continue;
    double ss = 0.0;
    for (int64_t i = 0; i < cols; ++i) ss += static_cast<double>(res[i]) * res[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(cols)) + eps);
    for (int64_t i = 0; i < cols; ++i)
      out[r * cols + i] = float_to_bf16(weight[i] * (res[i] * inv));
  }
}

void gather_rows(float* out, const float* in, const int32_t* rows, int64_t n, int64_t cols) {
  for (int64_t t = 0; t < n; ++t) {
    const float* src = in + static_cast<int64_t>(rows[t]) * cols;
    for (int64_t i = 0; i < cols; ++i) out[t * cols + i] = src[i];
  }
}

void swiglu_rows(Bf16* out, const Bf16* gate_up, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    const Bf16* gate = gate_up + r * 2 * inter;
    const Bf16* up = gate + inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = bf16_to_float(gate[i]);
      out[r * inter + i] = float_to_bf16(g / (1.0f + std::exp(-g)) * bf16_to_float(up[i]));
    }
  }
}

// Row by row: the biased fp32 Q and K of the row are rotated by ref::rope itself (so that the
// rotated K is exactly ref::rope of k_pre), then rounded once to bf16.
void qkv_finish(Bf16* qkv, float* k_pre, float* v_out, Bf16* kv_k, Bf16* kv_v, const float* bq,
                const float* bk, const float* bv, const int32_t* positions, const int32_t* slots,
                const float* inv_freq, int64_t rows, int64_t heads, int64_t kv_heads,
                int64_t head_dim) {
  const int64_t qd = heads * head_dim;
  const int64_t kvd = kv_heads * head_dim;
  const int64_t stride = qd + 2 * kvd;
  std::vector<float> q(static_cast<size_t>(qd));
  std::vector<float> k(static_cast<size_t>(kvd));
  for (int64_t r = 0; r < rows; ++r) {
    Bf16* row = qkv + r * stride;
    const int64_t slot = slots[r];
    for (int64_t i = 0; i < qd; ++i) {
      q[i] = bf16_to_float(row[i]);
      if (bq != nullptr) q[i] = q[i] + bq[i];
    }
    rope(q.data(), positions + r, inv_freq, 1, heads, head_dim, qd);
    for (int64_t i = 0; i < qd; ++i) row[i] = float_to_bf16(q[i]);

    for (int64_t i = 0; i < kvd; ++i) {
      k[i] = bf16_to_float(row[qd + i]);
      if (bk != nullptr) k[i] = k[i] + bk[i];
      if (k_pre != nullptr) k_pre[r * kvd + i] = k[i];
    }
    rope(k.data(), positions + r, inv_freq, 1, kv_heads, head_dim, kvd);
    for (int64_t i = 0; i < kvd; ++i) kv_k[slot * kvd + i] = float_to_bf16(k[i]);

    for (int64_t i = 0; i < kvd; ++i) {
      float v = bf16_to_float(row[qd + kvd + i]);
      if (bv != nullptr) v = v + bv[i];
      if (v_out != nullptr) v_out[r * kvd + i] = v;
      kv_v[slot * kvd + i] = float_to_bf16(v);
    }
  }
}

namespace {

// splitmix64's output function (Steele, Lea, Flood 2014).
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Value i of a fill: the top 24 bits of mix64(mix64(seed) + (i + 1) * golden) as u in [0, 1)
// (exact: u = m * 2^-24), then fma(hi - lo, u, lo) (one rounding, std::fma on both sides), moved
// one fp32 step down if that rounding reached hi. misc.cu computes the same bits.
float uniform_at(uint64_t key, int64_t i, float lo, float hi) {
  const uint64_t z = mix64(key + (static_cast<uint64_t>(i) + 1) * 0x9e3779b97f4a7c15ull);
  const float u = static_cast<float>(static_cast<uint32_t>(z >> 40)) * 0x1p-24f;
  const float v = std::fma(hi - lo, u, lo);
  return v < hi ? v : std::nextafter(hi, lo);
}

template <typename T>
T store_in_range(float v, float lo, float hi);
template <>
float store_in_range<float>(float v, float, float) {
  return v;
}
// bf16: rounding to nearest may leave [lo, hi) (lo or hi not a bf16); then one bf16 step back in
// (toward +inf if below lo, toward -inf if at or above hi). Exact for any [lo, hi) that holds a
// bf16.
template <>
Bf16 store_in_range<Bf16>(float v, float lo, float hi) {
  Bf16 b = float_to_bf16(v);
  if (bf16_to_float(b) < lo) {
    if ((b.bits & 0x7fffu) == 0) {
      b.bits = 0x0001u;  // +-0 -> the positive bf16 closest to zero
    } else if ((b.bits & 0x8000u) != 0) {
      --b.bits;  // negative: one step toward zero
    } else {
      ++b.bits;
    }
  }
  if (bf16_to_float(b) >= hi) {
    if ((b.bits & 0x7fffu) == 0) {
      b.bits = 0x8001u;  // +-0 -> the negative bf16 closest to zero
    } else if ((b.bits & 0x8000u) != 0) {
      ++b.bits;  // negative: one step away from zero
    } else {
      --b.bits;
    }
  }
  return b;
}

}  // namespace

template <typename T>
void fill_uniform(T* out, int64_t n, uint64_t seed, float lo, float hi) {
  const uint64_t key = mix64(seed);
  for (int64_t i = 0; i < n; ++i) out[i] = store_in_range<T>(uniform_at(key, i, lo, hi), lo, hi);
}

template void fill_uniform<float>(float*, int64_t, uint64_t, float, float);
template void fill_uniform<Bf16>(Bf16*, int64_t, uint64_t, float, float);

namespace {
double dot_bf16(const Bf16* a, const Bf16* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += double(bf16_to_float(a[i])) * double(bf16_to_float(b[i]));
  return s;
}
}  // namespace

void gemm_swiglu(Bf16* act, int64_t act_stride, const Bf16* x, int64_t x_stride, const Bf16* w,
                 int64_t rows, int64_t inter, int64_t in) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < inter; ++j) {
      const float g = static_cast<float>(dot_bf16(x + r * x_stride, w + j * in, in));
      const float u = static_cast<float>(dot_bf16(x + r * x_stride, w + (inter + j) * in, in));
      act[r * act_stride + j] = float_to_bf16(g / (1.0f + std::exp(-g)) * u);
    }
  }
}

void gemv(Bf16* y, int64_t y_stride, const Bf16* x, int64_t x_stride, const Bf16* w, int64_t rows,
          int64_t out, int64_t in) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      const double d = dot_bf16(x + r * x_stride, w + o * in, in);
      y[r * y_stride + o] = float_to_bf16(static_cast<float>(d));
    }
  }
}

void gemv_accumulate(float* y, int64_t y_stride, const Bf16* x, int64_t x_stride, const Bf16* w,
                     int64_t rows, int64_t out, int64_t in) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      y[r * y_stride + o] = static_cast<float>(double(y[r * y_stride + o]) +
                                               dot_bf16(x + r * x_stride, w + o * in, in));
    }
  }
}

void gemv(float* y, int64_t y_stride, const float* x, int64_t x_stride, const Bf16* w, int64_t rows,
          int64_t out, int64_t in) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = 0.0;
      for (int64_t i = 0; i < in; ++i) {
        s += double(x[r * x_stride + i]) * double(bf16_to_float(w[o * in + i]));
      }
      y[r * y_stride + o] = static_cast<float>(s);
    }
  }
}

}  // namespace keep::kernels::ref
