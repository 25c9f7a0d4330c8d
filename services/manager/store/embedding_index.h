// EmbeddingIndex: one agent's embeddings — a dense fp32 matrix plus an int8 copy of it — and an
// EXACT top-k by dot product (cosine for normalised rows) that scans the int8 copy (4x less memory
// traffic than the fp32 matrix) and rescores only the rows that can still be in the top-k.
// docs/memory-model.md ("Retrieval scan") derives the bound in prose.
//
// Quantisation (rows and queries alike): symmetric, one scale per vector,
//   s = max_i |x_i| / 127,  q_i = clamp(round(x_i / s), -127, 127)   (s = 0, q = 0 for x = 0).
// With x^ = s_x q_x, e_x = x - x^ (and y^, e_y for the query), x.y - x^.y^ = e_x.y + x^.e_y, so
//   |x.y - x^.y^| <= ||e_x|| ||y|| + ||x^|| ||e_y||                                        (1)
// ||e_x||, ||x^||, ||x|| are kept per row (computed at insert), the query's once per search.
// top_k: approx a_i = s_x s_y (q_x . q_y) (exact int32 dot), b_i = (1) plus a slack for fp
// rounding; every row whose upper bound a_i + b_i reaches the k-th largest lower bound a_i - b_i is
// rescored exactly; no other row can be in the exact top-k, so the result equals a brute-force
// exact ranking (ids, order, ties, scores).
//
// The exact score is score(): the fp32 vectors' dot product accumulated in double in index order
// and rounded to float once — deterministic, independent of the CPU and of the dispatch path.
//
// Not thread-safe for writers; top_k/score are const and reentrant given distinct scratch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace keep::manager {

// out[i] = sum_j rows[i * stride + j] * q[j] for i < n; rows (n, stride) int8, q (stride),
// stride a multiple of 32, values in [-127, 127] (no -128). Dispatched once at run time to an AVX2
// kernel when the CPU has it, else the portable one.
void dot_i8_rows(int32_t* out, const int8_t* rows, const int8_t* q, size_t n, size_t stride);
// The portable kernel (the reference the AVX2 one is tested against).
void dot_i8_rows_portable(int32_t* out, const int8_t* rows, const int8_t* q, size_t n,
                          size_t stride);
// Whether dot_i8_rows runs the AVX2 kernel on this CPU.
bool dot_i8_rows_uses_avx2();

// Per-vector quantisation facts used by the bound (1).
struct QuantisedNorms {
  float scale = 0.0f;     // s
  float err_norm = 0.0f;  // ||x - s q||, rounded up
  float q_norm = 0.0f;    // ||s q||, rounded up
  float norm = 0.0f;      // ||x||, rounded up
};

// Quantises x (dim floats, finite) into q (stride >= dim int8; q[dim..stride) set to 0).
QuantisedNorms quantise_i8(const float* x, size_t dim, int8_t* q, size_t stride);

struct ScoredRow {
  uint32_t row = 0;
  float score = 0.0f;  // exact: EmbeddingIndex::score(row, query)
};

struct TopKStats {
  size_t eligible = 0;    // rows top_k could return
  size_t candidates = 0;  // rows rescored in fp32 (all eligible ones when eligible <= k)
};

// Buffers top_k reuses between calls (no allocation per search once warm).
struct TopKScratch {
  std::vector<int8_t> query_q;  // (stride)
  std::vector<int32_t> dots;    // (rows)
  std::vector<double> lower;    // (eligible rows)
  std::vector<uint32_t> cand;
  std::vector<ScoredRow> scored;
};

class EmbeddingIndex {
 public:
  explicit EmbeddingIndex(int dim);  // dim >= 1

  int dim() const { return dim_; }
  size_t rows() const { return keys_.size(); }
  uint64_t key(size_t row) const { return keys_[row]; }
  bool eligible(size_t row) const { return eligible_[row] != 0; }
  const float* row(size_t r) const { return f32_.data() + r * static_cast<size_t>(dim_); }  // (dim)

  // Appends a row and returns its index. `v`: dim finite floats. `key` breaks score ties (lower
  // first) and must be unique. Rows with eligible = false are never returned by top_k.
  size_t append(uint64_t key, const float* v, bool eligible);
  // Removes `row` by moving the last row into its place. Returns the key of the row that moved
  // into `row`, or nullopt when `row` was the last one.
  std::optional<uint64_t> swap_remove(size_t row);
  void clear();

  // The exact score of row r against `query` (dim floats).
  float score(size_t r, const float* query) const;

  // The k best eligible rows by exact score (higher first; equal scores: lower key first), best
  // first, into *out (cleared first). Equal to sorting every eligible row by (score desc, key asc)
  // and keeping k. `query`: dim finite floats.
  void top_k(const float* query, size_t k, TopKScratch* scratch, std::vector<ScoredRow>* out,
             TopKStats* stats = nullptr) const;

  // The same result by brute force (every eligible row scored exactly): the reference for tests.
  void top_k_exhaustive(const float* query, size_t k, std::vector<ScoredRow>* out) const;

 private:
  void select_best(size_t k, std::vector<ScoredRow>* scored, std::vector<ScoredRow>* out) const;

  int dim_;
  size_t stride_;                      // int8 row stride: dim rounded up to 32
  std::vector<float> f32_;             // (rows, dim)
  std::vector<int8_t> i8_;             // (rows, stride), zero padded
  std::vector<QuantisedNorms> norms_;  // (rows)
  std::vector<uint64_t> keys_;         // (rows)
  std::vector<uint8_t> eligible_;      // (rows) 0 / 1
  size_t eligible_count_ = 0;
};

}  // namespace keep::manager
