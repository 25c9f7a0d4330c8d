// CPU references of the logits kernels (logits.cu): argmax, token_logprob.
#include <algorithm>
#include <cmath>
#include <limits>

#include "services/worker/kernels/reference.h"

namespace keep::kernels::ref {

void argmax(int32_t* out, const float* logits, int64_t rows, int64_t vocab) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * vocab;
    int64_t best = -1;
    for (int64_t i = 0; i < vocab; ++i) {
      if (std::isnan(row[i])) continue;
      if (best < 0 || row[i] > row[best]) best = i;
    }
    out[r] = static_cast<int32_t>(best < 0 ? 0 : best);
  }
}

void token_logprob(float* out, const float* logits, const int32_t* tokens, int64_t rows,
                   int64_t vocab) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * vocab;
    const int32_t tok = tokens[r];
    bool any_nan = false;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < vocab; ++i) {
      if (std::isnan(row[i])) {
        any_nan = true;
      } else {
        mx = std::max(mx, row[i]);
      }
    }
    if (tok < 0 || tok >= vocab || any_nan) {
      out[r] = nan;
      continue;
    }
    double lse = mx;  // an infinite max is the log-sum-exp itself
    if (std::isfinite(mx)) {
      double s = 0.0;
      for (int64_t i = 0; i < vocab; ++i) s += std::exp(static_cast<double>(row[i]) - mx);
      lse = mx + std::log(s);
    }
    out[r] = static_cast<float>(static_cast<double>(row[tok]) - lse);
  }
}

}  // namespace keep::kernels::ref
