// The logits kernels of services/worker/kernels (argmax, token_logprob) against their CPU
// references (reference_logits.cpp) on random logits of odd and vocabulary-like sizes, with planted
// ties, NaN, infinities, all-NaN and all -inf rows. argmax must match its reference exactly;
// token_logprob within an fp32 tolerance. Outputs are pre-filled with a poison value so that a row
// the kernel fails to write is caught. Also: the launchers' argument checks, and informational
// timings. A plain main (no doctest): exit 0 when all pass.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "services/worker/kernels/kernels.h"
#include "services/worker/kernels/reference.h"
#include "tests/gpu/gpu_test_util.h"

namespace {

namespace ref = keep::kernels::ref;

using keep::gputest::Buf;
using keep::gputest::fail;
using keep::gputest::g_checks;
using keep::gputest::g_failures;
using keep::gputest::quick;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int32_t kPoisonToken = -7;
constexpr float kPoisonLogprob = 777.0f;

std::string shape(int64_t rows, int64_t vocab) {
  return "(" + std::to_string(rows) + "," + std::to_string(vocab) + ")";
}

// How a test row is filled.
enum class Fill {
  kNormal,     // normal(0, scale)
  kQuantized,  // normal rounded to integers: many ties everywhere
  kPlanted,    // normal, plus per row: a duplicated max, NaN and -inf entries; row 1 all NaN,
               // row 2 all -inf (when there are enough rows)
  kConstant,   // every logit 0.5
};

std::vector<float> make_logits(std::mt19937& rng, int64_t rows, int64_t vocab, float scale,
                               Fill fill) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> l(static_cast<size_t>(rows * vocab));
  for (auto& x : l) x = fill == Fill::kConstant ? 0.5f : nd(rng);
  if (fill == Fill::kQuantized) {
    for (auto& x : l) x = std::round(x);
  }
  if (fill != Fill::kPlanted) return l;
  std::uniform_int_distribution<int64_t> pos(0, vocab - 1);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = l.data() + r * vocab;
    if (r == 1) {
      std::fill(row, row + vocab, kNan);
      continue;
    }
    if (r == 2) {
      std::fill(row, row + vocab, -kInf);
      if (vocab > 3) row[vocab / 2] = kNan;
      continue;
    }
    const float mx = *std::max_element(row, row + vocab) + 1.0f;
    if (vocab >= 3) {
      const int64_t a = pos(rng);
      int64_t b = pos(rng);
      if (b == a) b = (a + 1) % vocab;
      row[std::max(a, b)] = mx;  // the later one first: the kernel must prefer the lower index
      row[std::min(a, b)] = mx;
      const int64_t extra = std::max<int64_t>(1, vocab / 97);
      for (int64_t j = 0; j < extra; ++j) {
        const int64_t n = pos(rng);
        if (row[n] != mx) row[n] = kNan;
        const int64_t m = pos(rng);
        if (row[m] != mx) row[m] = -kInf;
      }
    }
    if (vocab >= 3 && r == 0 && row[0] != mx) row[0] = kNan;  // a NaN before the max
  }
  return l;
}

void check_tokens(const std::string& what, const std::vector<int32_t>& got,
                  const std::vector<int32_t>& want) {
  ++g_checks;
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i]) {
      if (bad < 3) {
        std::fprintf(stderr, "FAIL %s row %zu: got %d want %d\n", what.c_str(), i, got[i], want[i]);
      }
      ++bad;
    }
  }
  if (bad > 0) fail(what, std::to_string(bad) + " of " + std::to_string(want.size()) + " rows off");
}

// ---- argmax ----

void test_argmax(std::mt19937& rng, int64_t rows, int64_t vocab, float scale, Fill fill,
                 size_t misalign = 0) {
  const auto logits = make_logits(rng, rows, vocab, scale, fill);
  std::vector<int32_t> want(static_cast<size_t>(rows));
  ref::argmax(want.data(), logits.data(), rows, vocab);
  Buf<float> d_logits(logits, misalign);
  Buf<int32_t> d_out(std::vector<int32_t>(static_cast<size_t>(rows), kPoisonToken));
  CUDA_OK(keep::kernels::argmax(d_out.dev(), d_logits.dev(), rows, vocab, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  check_tokens("argmax " + shape(rows, vocab) + (misalign ? " misaligned" : ""), d_out.host(),
               want);
}

// ---- token_logprob ----

void test_logprob(std::mt19937& rng, int64_t rows, int64_t vocab, float scale, Fill fill,
                  size_t misalign = 0) {
  auto logits = make_logits(rng, rows, vocab, scale, fill);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> tokens(static_cast<size_t>(rows));
  for (auto& t : tokens) t = tok(rng);
  if (rows >= 3) {
    tokens[rows - 1] = static_cast<int32_t>(vocab);  // out of range: NaN
    tokens[rows - 2] = -1;
  }
  if (fill == Fill::kPlanted && rows >= 4 && vocab >= 2) {
    logits[3 * vocab + 1] = kInf;  // an infinite max: l - inf
    tokens[3] = 0;
  }
  std::vector<float> want(static_cast<size_t>(rows));
  ref::token_logprob(want.data(), logits.data(), tokens.data(), rows, vocab);
  Buf<float> d_logits(logits, misalign);
  Buf<int32_t> d_tokens(tokens);
  Buf<float> d_out(std::vector<float>(static_cast<size_t>(rows), kPoisonLogprob));
  CUDA_OK(keep::kernels::token_logprob(d_out.dev(), d_logits.dev(), d_tokens.dev(), rows, vocab,
                                       nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto got = d_out.host();
  const std::string what = "token_logprob " + shape(rows, vocab) + (misalign ? " misaligned" : "");
  ++g_checks;
  int bad = 0;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const float g = got[i];
    const float w = want[i];
    bool ok;
    if (std::isnan(w) || std::isnan(g)) {
      ok = std::isnan(w) && std::isnan(g);
    } else if (std::isinf(w) || std::isinf(g)) {
      ok = g == w;
    } else {
      ok = std::fabs(g - w) <= 1e-4f + 1e-5f * std::fabs(w);
      num += (static_cast<double>(g) - w) * (static_cast<double>(g) - w);
      den += static_cast<double>(w) * w;
    }
    if (!ok) {
      if (bad < 3) {
        std::fprintf(stderr, "FAIL %s row %zu: got %.8g want %.8g\n", what.c_str(), i, g, w);
      }
      ++bad;
    }
  }
  if (bad > 0) fail(what, std::to_string(bad) + " of " + std::to_string(want.size()) + " rows off");
  ++g_checks;
  if (den > 0.0 && std::sqrt(num / den) > 1e-5) {
    fail(what, "relative norm " + std::to_string(std::sqrt(num / den)));
  }
}

void run_all(std::mt19937& rng) {
  const int64_t all_vocabs[] = {1, 3, 7, 19, 733, 49152, 151936};
  const int64_t quick_vocabs[] = {1, 7, 733, 49152};
  const std::vector<int64_t> vocabs =
      quick() ? std::vector<int64_t>(std::begin(quick_vocabs), std::end(quick_vocabs))
              : std::vector<int64_t>(std::begin(all_vocabs), std::end(all_vocabs));
  const int64_t row_counts[] = {1, 3, 17};
  const Fill fills[] = {Fill::kNormal, Fill::kPlanted, Fill::kQuantized, Fill::kConstant};
  int n = 0;
  for (int64_t vocab : vocabs) {
    for (int64_t rows : row_counts) {
      for (int f = 0; f < 4; ++f) {
        const float scale = (n++ % 2 == 0) ? 3.0f : 10.0f;
        test_argmax(rng, rows, vocab, scale, fills[f]);
        test_logprob(rng, rows, vocab, scale, fills[f]);
      }
    }
  }
  test_argmax(rng, 3, 49152, 3.0f, Fill::kPlanted, 1);  // scalar loads
  test_logprob(rng, 3, 49152, 3.0f, Fill::kPlanted, 1);
  test_argmax(rng, 70000, 7, 3.0f, Fill::kPlanted);  // more rows than the grid
  test_logprob(rng, 70000, 7, 3.0f, Fill::kPlanted);
}

void test_invalid_arguments() {
  ++g_checks;
  float* p = nullptr;
  int32_t* ip = nullptr;
  float dummy_f = 0.0f;
  int32_t dummy_i = 0;
  float* f = &dummy_f;  // any non-null pointer: the launchers reject before launching
  int32_t* i = &dummy_i;
  namespace k = keep::kernels;
  const bool ok = k::argmax(ip, p, -1, 5, nullptr) == cudaErrorInvalidValue &&
                  k::argmax(ip, p, 0, 5, nullptr) == cudaSuccess &&
                  k::argmax(ip, p, 2, 5, nullptr) == cudaErrorInvalidValue &&
                  k::argmax(i, f, 2, 0, nullptr) == cudaErrorInvalidValue &&
                  k::token_logprob(p, p, ip, 0, 5, nullptr) == cudaSuccess &&
                  k::token_logprob(f, f, ip, 2, 5, nullptr) == cudaErrorInvalidValue;
  if (!ok) fail("launcher argument checks", "unexpected return code");
}

// Median per launch of 50 samples of 10 back-to-back launches after 5 warm-ups; informational.
template <typename F>
float median_ms(F launch) {
  return static_cast<float>(keep::gputest::time_launches(launch, 50, 10, 5).median_ms);
}

void timings(std::mt19937& rng) {
  const int64_t vocab = 151936;
  const auto logits = make_logits(rng, 1, vocab, 3.0f, Fill::kNormal);
  Buf<float> d_logits(logits);
  Buf<int32_t> d_out(std::vector<int32_t>{0});
  Buf<int32_t> d_tok(std::vector<int32_t>{17});
  Buf<float> d_lp(std::vector<float>{0.0f});
  namespace k = keep::kernels;
  std::printf("timings, rows 1, vocab %lld (median of 50):\n", static_cast<long long>(vocab));
  std::printf(
      "  argmax                       %8.1f us\n",
      1e3f * median_ms([&] { return k::argmax(d_out.dev(), d_logits.dev(), 1, vocab, nullptr); }));
  std::printf("  token_logprob                %8.1f us\n",
              1e3f * median_ms([&] {
                return k::token_logprob(d_lp.dev(), d_logits.dev(), d_tok.dev(), 1, vocab, nullptr);
              }));
}

}  // namespace

int main() {
  if (!keep::gputest::print_device()) return 2;
  std::mt19937 rng(4321);
  run_all(rng);
  test_invalid_arguments();
  if (keep::gputest::timings()) timings(rng);
  std::printf("test_logits: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
