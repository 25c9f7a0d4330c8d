#include "services/worker/kernels/reference.h"

#include <cmath>
#include <vector>

namespace keep::kernels::ref {

void rmsnorm_residual(float* out, float* residual, const float* x, const float* weight,
                      int64_t rows, int64_t cols, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* res = residual + r * cols;
    double ss = 0.0;
    for (int64_t i = 0; i < cols; ++i) {
      if (x != nullptr) res[i] = res[i] + x[r * cols + i];
      const double v = res[i];
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(cols)) + eps);
    for (int64_t i = 0; i < cols; ++i) out[r * cols + i] = weight[i] * (res[i] * inv);
  }
}

void rope(float* x, const int32_t* positions, const float* inv_freq, int64_t n, int64_t heads,
          int64_t head_dim, int64_t row_stride) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < n; ++r) {
    const float p = static_cast<float>(positions[r]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = p * inv_freq[i];
      const auto c = static_cast<float>(std::cos(static_cast<double>(angle)));
      const auto s = static_cast<float>(std::sin(static_cast<double>(angle)));
      for (int64_t h = 0; h < heads; ++h) {
        float* xh = x + r * row_stride + h * head_dim;
        const float x1 = xh[i];
        const float x2 = xh[i + half];
        xh[i] = x1 * c - x2 * s;
        xh[i + half] = x2 * c + x1 * s;
      }
    }
  }
}

void load_kv_rope(Bf16* k_out, Bf16* v_out, const Bf16* k_pre, const Bf16* v,
                  const int32_t* positions, const float* inv_freq, int64_t n, int64_t heads,
                  int64_t head_dim) {
  const int64_t row = heads * head_dim;
  std::vector<float> k(static_cast<size_t>(row));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < row; ++j) k[j] = bf16_to_float(k_pre[r * row + j]);
    rope(k.data(), positions + r, inv_freq, 1, heads, head_dim, row);
    for (int64_t j = 0; j < row; ++j) {
      k_out[r * row + j] = float_to_bf16(k[j]);
      v_out[r * row + j] = v[r * row + j];
    }
  }
}

}  // namespace keep::kernels::ref
