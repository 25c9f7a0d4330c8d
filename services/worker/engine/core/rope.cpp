#include "services/worker/engine/core/rope.h"

#include <cmath>

namespace keep::engine {

namespace {

void compute_angles(const std::vector<float>& inv_freq, int32_t pos, float* c, float* s) {
  const float p = static_cast<float>(pos);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float angle = p * inv_freq[i];  // fp32 product, as HF's freqs = inv_freq @ positions
    c[i] = static_cast<float>(std::cos(static_cast<double>(angle)));
    s[i] = static_cast<float>(std::sin(static_cast<double>(angle)));
  }
}

}  // namespace

RopeTable::RopeTable(std::vector<float> inv_freq, int32_t max_cached)
    : inv_freq_(std::move(inv_freq)),
      half_(static_cast<int32_t>(inv_freq_.size())),
      max_cached_(max_cached > 0 ? max_cached : 0) {
  cos_.resize(static_cast<size_t>(max_cached_) * half_);
  sin_.resize(static_cast<size_t>(max_cached_) * half_);
  for (int32_t p = 0; p < max_cached_; ++p) {
    compute_angles(inv_freq_, p, cos_.data() + static_cast<size_t>(p) * half_,
                   sin_.data() + static_cast<size_t>(p) * half_);
  }
}

void RopeTable::angles(int32_t pos, float* scratch, const float** cos_out,
                       const float** sin_out) const {
  if (pos >= 0 && pos < max_cached_) {
    *cos_out = cos_.data() + static_cast<size_t>(pos) * half_;
    *sin_out = sin_.data() + static_cast<size_t>(pos) * half_;
    return;
  }
  compute_angles(inv_freq_, pos, scratch, scratch + half_);
  *cos_out = scratch;
  *sin_out = scratch + half_;
}

void RopeTable::apply(float* x, const int32_t* positions, int64_t n, int64_t heads) const {
  apply_strided(x, heads * head_dim(), x, heads * head_dim(), positions, n, heads);
}

void RopeTable::apply_strided(float* out, int64_t out_row_stride, const float* x,
                              int64_t x_row_stride, const int32_t* positions, int64_t n,
                              int64_t heads) const {
  const int32_t half = half_;
  const int32_t hd = 2 * half;
  std::vector<float> scratch;  // only for positions beyond the table
  for (int64_t r = 0; r < n; ++r) {
    const float* c;
    const float* s;
    if (positions[r] < 0 || positions[r] >= max_cached_) {
      if (scratch.empty()) scratch.resize(2 * static_cast<size_t>(half));
      angles(positions[r], scratch.data(), &c, &s);
    } else {
      angles(positions[r], nullptr, &c, &s);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* xi = x + r * x_row_stride + h * hd;
      float* o = out + r * out_row_stride + h * hd;
      for (int32_t i = 0; i < half; ++i) {
        const float x1 = xi[i];
        const float x2 = xi[i + half];
        o[i] = x1 * c[i] - x2 * s[i];
        o[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  }
}

}  // namespace keep::engine
