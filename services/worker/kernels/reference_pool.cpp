// CPU reference of kernels.h attention_pool (reference.h ref::attention_pool), in double.
#include <cmath>
#include <cstdint>
#include <vector>

#include "services/worker/kernels/reference.h"

namespace keep::kernels::ref {

// pooled (rows, num_groups) = Σ_h Σ_{t seen by r, key_group[t] == g} exp(s_t(r, h) - lse[r, h]),
// s_t = (q[r, h, :] · k[t, h / group, :]) * scale summed in double from the stored values. Keys
// whose group is outside [0, num_groups) (-1: no group) are skipped.
void attention_pool(float* pooled, const Bf16* q, int64_t q_stride, const Bf16* k, const float* lse,
                    const AttentionRows& rows, const int32_t* key_group, int num_groups, int heads,
                    int kv_heads, int head_dim, float scale) {
  const int group = heads / kv_heads;
  std::vector<double> sums(static_cast<size_t>(num_groups));
  std::vector<double> qd(static_cast<size_t>(head_dim));
  for (int64_t r = 0; r < rows.rows; ++r) {
    sums.assign(sums.size(), 0.0);
    for (int h = 0; h < heads; ++h) {
      const Bf16* qh = q + r * q_stride + static_cast<int64_t>(h) * head_dim;
      for (int d = 0; d < head_dim; ++d) qd[d] = bf16_to_float(qh[d]);
      const double l = lse[r * heads + h];
      const int64_t g = h / group;
      for (int32_t s = rows.row_offsets[r]; s < rows.row_offsets[r + 1]; ++s) {
        for (int32_t t = rows.spans[s].begin; t < rows.spans[s].end; ++t) {
          const int32_t grp = key_group[t];
          if (grp < 0 || grp >= num_groups) continue;
          const Bf16* kt = k + (static_cast<int64_t>(t) * kv_heads + g) * head_dim;
          double dot = 0.0;
          for (int d = 0; d < head_dim; ++d)
            dot += qd[d] * static_cast<double>(bf16_to_float(kt[d]));
          sums[grp] += std::exp(dot * static_cast<double>(scale) - l);
        }
      }
    }
    float* out = pooled + r * num_groups;
    for (int i = 0; i < num_groups; ++i) out[i] = static_cast<float>(sums[i]);
  }
}

}  // namespace keep::kernels::ref
