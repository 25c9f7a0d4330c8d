// CPU reference of the attention kernels (kernels.h, attention_prefill.cu / attention_decode.cu):
// scores, log-sum-exp and the weighted sum of values in double, from bf16 Q, K and V;
// the output rounded to bf16 once.
#include <cmath>
#include <limits>
#include <vector>

#include "services/worker/kernels/reference.h"

namespace keep::kernels::ref {

void attention(Bf16* out, int64_t out_stride, float* lse, const Bf16* q, int64_t q_stride,
               const Bf16* k, const Bf16* v, const AttentionRows& rows, int heads, int kv_heads,
               int head_dim, float scale) {
  const int group = heads / kv_heads;
  const int64_t kv_row = static_cast<int64_t>(kv_heads) * head_dim;  // elements per key slot
  std::vector<double> qd(static_cast<size_t>(head_dim));
  std::vector<double> acc(static_cast<size_t>(head_dim));
  std::vector<double> scores;
  for (int32_t r = 0; r < rows.rows; ++r) {
    const KeyRange* span_begin = rows.spans + rows.row_offsets[r];
    const KeyRange* span_end = rows.spans + rows.row_offsets[r + 1];
    for (int h = 0; h < heads; ++h) {
      const int64_t g = h / group;
      const Bf16* qh = q + r * q_stride + static_cast<int64_t>(h) * head_dim;
      for (int d = 0; d < head_dim; ++d) qd[d] = bf16_to_float(qh[d]);
      // Scores of the visible keys, in span order, and their maximum.
      scores.clear();
      double max_score = -std::numeric_limits<double>::infinity();
      for (const KeyRange* s = span_begin; s != span_end; ++s) {
        for (int64_t t = s->begin; t < s->end; ++t) {
          const Bf16* kt = k + t * kv_row + g * head_dim;
          double dot = 0.0;
          for (int d = 0; d < head_dim; ++d)
            dot += qd[d] * static_cast<double>(bf16_to_float(kt[d]));
          const double score = dot * static_cast<double>(scale);
          scores.push_back(score);
          if (score > max_score) max_score = score;
        }
      }
      Bf16* oh = out + r * out_stride + static_cast<int64_t>(h) * head_dim;
      if (scores.empty()) {
        for (int d = 0; d < head_dim; ++d) oh[d] = float_to_bf16(0.0f);
        if (lse != nullptr) lse[r * heads + h] = -std::numeric_limits<float>::infinity();
        continue;
      }
      double sum = 0.0;
      for (double score : scores) sum += std::exp(score - max_score);
      const double log_sum = max_score + std::log(sum);
      for (auto& a : acc) a = 0.0;
      size_t i = 0;
      for (const KeyRange* s = span_begin; s != span_end; ++s) {
        for (int64_t t = s->begin; t < s->end; ++t) {
          const double p = std::exp(scores[i++] - log_sum);
          const Bf16* vt = v + t * kv_row + g * head_dim;
          for (int d = 0; d < head_dim; ++d)
            acc[d] += p * static_cast<double>(bf16_to_float(vt[d]));
        }
      }
      for (int d = 0; d < head_dim; ++d) oh[d] = float_to_bf16(static_cast<float>(acc[d]));
      if (lse != nullptr) lse[r * heads + h] = static_cast<float>(log_sum);
    }
  }
}

}  // namespace keep::kernels::ref
