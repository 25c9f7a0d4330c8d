// RoPE as Hugging Face applies it to Llama / Qwen2 ("rotate_half", half-split pairs): for each
// head, dims i and i + hd/2 (i < hd/2) rotate by the angle pos * inv_freq[i]:
//   out[i]        = x[i] * cos - x[i + hd/2] * sin
//   out[i + hd/2] = x[i + hd/2] * cos + x[i] * sin
// inv_freq comes from rope_inv_freq(config) (model_config.h), llama3 rescaling included. The angle
// is rounded to float first (pos * inv_freq in fp32, as HF does) and cos/sin taken of it.
//
// K is stored before RoPE (ARCHITECTURE.md §3) and rotated here to whatever positions the prompt
// gives it, so the same pre-RoPE K serves any placement. Rotation by a then by b equals rotation by
// a + b only up to rounding; loading always rotates pre-RoPE K once, never re-rotates.
#pragma once

#include <cstdint>
#include <vector>

namespace keep::engine {

class RopeTable {
 public:
  RopeTable() = default;
  // Precomputes cos/sin for positions [0, max_cached); other positions are computed on the fly.
  RopeTable(std::vector<float> inv_freq, int32_t max_cached);

  int32_t half_dim() const { return half_; }
  int32_t head_dim() const { return 2 * half_; }

  // cos/sin of one position: (half_dim) each. `scratch` must hold 2 * half_dim floats; the returned
  // pointers point into the table or into scratch.
  void angles(int32_t pos, float* scratch, const float** cos_out, const float** sin_out) const;

  // x (n, heads, head_dim) rotated in place, row i at positions[i].
  void apply(float* x, const int32_t* positions, int64_t n, int64_t heads) const;
  // out (n, heads, head_dim) = x rotated; out may equal x. `x_row_stride`/`out_row_stride` are the
  // distances in floats between rows (heads * head_dim when packed).
  void apply_strided(float* out, int64_t out_row_stride, const float* x, int64_t x_row_stride,
                     const int32_t* positions, int64_t n, int64_t heads) const;

 private:
  std::vector<float> inv_freq_;  // (half)
  std::vector<float> cos_;       // (max_cached, half)
  std::vector<float> sin_;       // (max_cached, half)
  int32_t half_ = 0;
  int32_t max_cached_ = 0;
};

}  // namespace keep::engine
