#include "services/worker/kernels/reference.h"

#include <cmath>

namespace keep::kernels::ref {

template <typename T>
void rmsnorm_residual(T* out, T* residual, const T* x, const T* weight, int64_t rows, int64_t cols,
                      float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    T* res = residual + r * cols;
    double ss = 0.0;
    for (int64_t i = 0; i < cols; ++i) {
      if (x != nullptr) res[i] = from_float<T>(to_float(res[i]) + to_float(x[r * cols + i]));
      const double v = to_float(res[i]);
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(cols)) + eps);
    for (int64_t i = 0; i < cols; ++i) {
      out[r * cols + i] = from_float<T>(to_float(weight[i]) * (to_float(res[i]) * inv));
    }
  }
}

template <typename T>
void rope(T* x, const int32_t* positions, const float* inv_freq, int64_t n, int64_t heads,
          int64_t head_dim, int64_t row_stride) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < n; ++r) {
    const float p = static_cast<float>(positions[r]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = p * inv_freq[i];
      const auto c = static_cast<float>(std::cos(static_cast<double>(angle)));
      const auto s = static_cast<float>(std::sin(static_cast<double>(angle)));
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = x + r * row_stride + h * head_dim;
        const float x1 = to_float(xh[i]);
        const float x2 = to_float(xh[i + half]);
        xh[i] = from_float<T>(x1 * c - x2 * s);
        xh[i + half] = from_float<T>(x2 * c + x1 * s);
      }
    }
  }
}

#define KEEP_KERNELS_REF_INSTANTIATE(T)                                                   \
  template void rmsnorm_residual<T>(T*, T*, const T*, const T*, int64_t, int64_t, float); \
  template void rope<T>(T*, const int32_t*, const float*, int64_t, int64_t, int64_t, int64_t);
KEEP_KERNELS_REF_INSTANTIATE(float)
KEEP_KERNELS_REF_INSTANTIATE(Bf16)
#undef KEEP_KERNELS_REF_INSTANTIATE

}  // namespace keep::kernels::ref
