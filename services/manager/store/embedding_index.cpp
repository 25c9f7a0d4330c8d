#include "services/manager/store/embedding_index.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "shared/common/status.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KEEP_INDEX_X86 1
#else
#define KEEP_INDEX_X86 0
#endif

namespace keep::manager {

namespace {

constexpr size_t kStrideAlign = 32;  // bytes of one AVX2 register
// Relative slack covering the fp rounding of the exact score (float, 2^-24) and of the bound's
// double arithmetic; absolute slack for float underflow of tiny scores.
constexpr double kRelativeSlack = 1e-6;
constexpr double kAbsoluteSlack = 1e-44;

// The smallest float >= v (v >= 0).
float round_up(double v) {
  float f = static_cast<float>(v);
  if (static_cast<double>(f) < v) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}

// NaN scores (only from non-finite products of huge inputs) order below everything.
float order_score(float s) { return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s; }

#if KEEP_INDEX_X86
__attribute__((target("avx2"))) int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// 32 int8 products r*q summed into 8 int32 lanes, as |q| * (r * sign(q)) through maddubs (u8 x s8
// -> s16 pairs; |pair| <= 2 * 127 * 127 < 2^15: no saturation since -128 never occurs). A row chunk
// costs one sign, one maddubs, one madd and one add (|q| comes from the query chunk, in L1).
__attribute__((target("avx2"))) __m256i madd_i8(__m256i acc, __m256i r, __m256i q_abs, __m256i q,
                                                __m256i ones16) {
  const __m256i p16 = _mm256_maddubs_epi16(q_abs, _mm256_sign_epi8(r, q));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, ones16));
}

__attribute__((target("avx2"))) __m256i load32(const int8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// One row at a time, read strictly sequentially: interleaving four rows (sharing the query loads)
// was as fast while the matrix sits in cache but 1.5x slower streaming from DRAM (100k rows).
__attribute__((target("avx2"))) void dot_i8_rows_avx2(int32_t* out, const int8_t* rows,
                                                      const int8_t* q, size_t n, size_t stride) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (size_t i = 0; i < n; ++i) {
    const int8_t* r = rows + i * stride;
    __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0;
    size_t j = 0;
    for (; j + 2 * kStrideAlign <= stride; j += 2 * kStrideAlign) {
      const __m256i q0 = load32(q + j), q1 = load32(q + j + kStrideAlign);
      acc0 = madd_i8(acc0, load32(r + j), _mm256_sign_epi8(q0, q0), q0, ones16);
      acc1 = madd_i8(acc1, load32(r + j + kStrideAlign), _mm256_sign_epi8(q1, q1), q1, ones16);
    }
    if (j < stride) {
      const __m256i q0 = load32(q + j);
      acc0 = madd_i8(acc0, load32(r + j), _mm256_sign_epi8(q0, q0), q0, ones16);
    }
    out[i] = hsum_epi32(_mm256_add_epi32(acc0, acc1));
  }
}
#endif

using DotFn = void (*)(int32_t*, const int8_t*, const int8_t*, size_t, size_t);

bool cpu_has_avx2() {
#if KEEP_INDEX_X86
  return __builtin_cpu_supports("avx2") != 0;
#else
  return false;
#endif
}

DotFn resolve_dot() {
#if KEEP_INDEX_X86
  if (cpu_has_avx2()) return &dot_i8_rows_avx2;
#endif
  return &dot_i8_rows_portable;
}

}  // namespace

void dot_i8_rows_portable(int32_t* out, const int8_t* rows, const int8_t* q, size_t n,
                          size_t stride) {
  for (size_t i = 0; i < n; ++i) {
    const int8_t* r = rows + i * stride;
    int32_t acc = 0;
    for (size_t j = 0; j < stride; ++j) acc += int32_t{r[j]} * int32_t{q[j]};
    out[i] = acc;
  }
}

void dot_i8_rows(int32_t* out, const int8_t* rows, const int8_t* q, size_t n, size_t stride) {
  static const DotFn fn = resolve_dot();
  fn(out, rows, q, n, stride);
}

bool dot_i8_rows_uses_avx2() { return cpu_has_avx2(); }

QuantisedNorms quantise_i8(const float* x, size_t dim, int8_t* q, size_t stride) {
  std::fill(q, q + stride, int8_t{0});
  float m = 0.0f;
  for (size_t j = 0; j < dim; ++j) m = std::max(m, std::fabs(x[j]));
  QuantisedNorms n;
  const float s = m / 127.0f;
  double err2 = 0.0, q2 = 0.0, x2 = 0.0;
  for (size_t j = 0; j < dim; ++j) {
    const double xj = x[j];
    x2 += xj * xj;
    if (s == 0.0f) {  // zero vector (or one so tiny its scale underflows): q = 0, e = x
      err2 += xj * xj;
      continue;
    }
    const float v = std::clamp(std::nearbyint(x[j] / s), -127.0f, 127.0f);
    q[j] = static_cast<int8_t>(v);
    const double deq = static_cast<double>(s) * static_cast<double>(v);
    err2 += (xj - deq) * (xj - deq);
    q2 += deq * deq;
  }
  n.scale = s;
  // Square roots in double then rounded up: the bound must not be undercut by rounding.
  n.err_norm = round_up(std::sqrt(err2) * (1.0 + 1e-12));
  n.q_norm = round_up(std::sqrt(q2) * (1.0 + 1e-12));
  n.norm = round_up(std::sqrt(x2) * (1.0 + 1e-12));
  return n;
}

EmbeddingIndex::EmbeddingIndex(int dim)
    : dim_(dim),
      stride_((static_cast<size_t>(dim) + kStrideAlign - 1) / kStrideAlign * kStrideAlign) {
  KEEP_CHECK(dim >= 1);
}

size_t EmbeddingIndex::append(uint64_t key, const float* v, bool eligible) {
  const size_t r = keys_.size();
  const size_t d = static_cast<size_t>(dim_);
  f32_.insert(f32_.end(), v, v + d);
  i8_.resize(i8_.size() + stride_);
  norms_.push_back(quantise_i8(v, d, i8_.data() + r * stride_, stride_));
  keys_.push_back(key);
  eligible_.push_back(eligible ? 1 : 0);
  eligible_count_ += eligible ? 1 : 0;
  return r;
}

std::optional<uint64_t> EmbeddingIndex::swap_remove(size_t row) {
  KEEP_CHECK(row < keys_.size());
  const size_t last = keys_.size() - 1;
  const size_t d = static_cast<size_t>(dim_);
  eligible_count_ -= eligible_[row];
  std::optional<uint64_t> moved;
  if (row != last) {
    std::copy_n(f32_.data() + last * d, d, f32_.data() + row * d);
    std::copy_n(i8_.data() + last * stride_, stride_, i8_.data() + row * stride_);
    norms_[row] = norms_[last];
    keys_[row] = keys_[last];
    eligible_[row] = eligible_[last];
    moved = keys_[row];
  }
  f32_.resize(f32_.size() - d);
  i8_.resize(i8_.size() - stride_);
  norms_.pop_back();
  keys_.pop_back();
  eligible_.pop_back();
  return moved;
}

void EmbeddingIndex::clear() {
  f32_.clear();
  i8_.clear();
  norms_.clear();
  keys_.clear();
  eligible_.clear();
  eligible_count_ = 0;
}

float EmbeddingIndex::score(size_t r, const float* query) const {
  const float* x = row(r);
  const size_t d = static_cast<size_t>(dim_);
  // Four independent accumulators in a fixed order: fast and deterministic (products of two
  // floats are exact in double).
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  size_t j = 0;
  for (; j + 4 <= d; j += 4) {
    for (size_t l = 0; l < 4; ++l) {
      acc[l] += static_cast<double>(x[j + l]) * static_cast<double>(query[j + l]);
    }
  }
  for (; j < d; ++j) acc[0] += static_cast<double>(x[j]) * static_cast<double>(query[j]);
  return static_cast<float>((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

void EmbeddingIndex::select_best(size_t k, std::vector<ScoredRow>* scored,
                                 std::vector<ScoredRow>* out) const {
  const auto better = [this](const ScoredRow& x, const ScoredRow& y) {
    const float sx = order_score(x.score), sy = order_score(y.score);
    if (sx != sy) return sx > sy;
    return keys_[x.row] < keys_[y.row];
  };
  if (scored->size() > k) {
    std::nth_element(scored->begin(), scored->begin() + static_cast<std::ptrdiff_t>(k - 1),
                     scored->end(), better);
    scored->resize(k);
  }
  std::sort(scored->begin(), scored->end(), better);
  out->assign(scored->begin(), scored->end());
}

void EmbeddingIndex::top_k_exhaustive(const float* query, size_t k,
                                      std::vector<ScoredRow>* out) const {
  out->clear();
  if (k == 0) return;
  std::vector<ScoredRow> scored;
  for (size_t r = 0; r < rows(); ++r) {
    if (eligible_[r] != 0) scored.push_back(ScoredRow{static_cast<uint32_t>(r), score(r, query)});
  }
  select_best(k, &scored, out);
}

void EmbeddingIndex::top_k(const float* query, size_t k, TopKScratch* scratch,
                           std::vector<ScoredRow>* out, TopKStats* stats) const {
  out->clear();
  TopKScratch& sc = *scratch;
  sc.scored.clear();
  const size_t n = rows();
  if (stats != nullptr) *stats = TopKStats{eligible_count_, 0};
  if (k == 0 || eligible_count_ == 0) return;

  if (eligible_count_ > k) {
    // 1. Approximate scores from the int8 copy.
    sc.query_q.resize(stride_);
    const QuantisedNorms qn =
        quantise_i8(query, static_cast<size_t>(dim_), sc.query_q.data(), stride_);
    sc.dots.resize(n);
    dot_i8_rows(sc.dots.data(), i8_.data(), sc.query_q.data(), n, stride_);

    // 2. Per-row interval [a - b, a + b] around the exact score, bound (1) of the header.
    const double qs = qn.scale, ny = qn.norm, ney = qn.err_norm, nyq = qn.q_norm;
    const auto interval = [&](size_t r, double* lo, double* hi) {
      const QuantisedNorms& x = norms_[r];
      const double a = static_cast<double>(x.scale) * qs * static_cast<double>(sc.dots[r]);
      const double b = (x.err_norm * ny + x.q_norm * ney) * (1.0 + 1e-12) +
                       kRelativeSlack * (x.norm * ny + x.q_norm * nyq) + kAbsoluteSlack;
      *lo = a - b;
      *hi = a + b;
      // Huge inputs (inf * 0): keep the row, never poison the selection with a NaN.
      if (std::isnan(*lo)) *lo = -std::numeric_limits<double>::infinity();
      if (std::isnan(*hi)) *hi = std::numeric_limits<double>::infinity();
    };
    sc.lower.clear();
    for (size_t r = 0; r < n; ++r) {
      if (eligible_[r] == 0) continue;
      double lo = 0.0, hi = 0.0;
      interval(r, &lo, &hi);
      sc.lower.push_back(lo);
    }
    // 3. At least k rows score >= the k-th largest lower bound; a row whose upper bound is below
    // it is beaten strictly by k rows and cannot be in the top-k.
    std::nth_element(sc.lower.begin(), sc.lower.begin() + static_cast<std::ptrdiff_t>(k - 1),
                     sc.lower.end(), std::greater<>());
    const double threshold = sc.lower[k - 1];
    sc.cand.clear();
    for (size_t r = 0; r < n; ++r) {
      if (eligible_[r] == 0) continue;
      double lo = 0.0, hi = 0.0;
      interval(r, &lo, &hi);
      if (hi >= threshold) sc.cand.push_back(static_cast<uint32_t>(r));
    }
    // 4. Exact rescoring of the candidates.
    for (uint32_t r : sc.cand) sc.scored.push_back(ScoredRow{r, score(r, query)});
  } else {
    for (size_t r = 0; r < n; ++r) {
      if (eligible_[r] != 0) {
        sc.scored.push_back(ScoredRow{static_cast<uint32_t>(r), score(r, query)});
      }
    }
  }
  if (stats != nullptr) stats->candidates = sc.scored.size();
  select_best(k, &sc.scored, out);
}

}  // namespace keep::manager
