// attention_prefill (services/worker/kernels/attention_prefill.cu) against ref::attention on random
// layouts: causal chunks after a past, recompute subsets, blocks after a prefix, rows with many
// spans, rows with no key; GQA shapes of SmolLM2 (9/3, hd 64), Qwen2.5-7B (28/4, hd 128) and 40/8;
// Q inside a fused QKV row; padded, odd and misaligned strides; bf16 K/V. Outputs are
// NaN-poisoned (every element the kernel must write is checked, the columns past heads * head_dim
// must stay NaN) and the K/V of keys no row sees are NaN (the kernel must not let them leak). Also
// times a 4096-row causal prefill (informational). A plain main: exit 0 when all pass.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "services/worker/kernels/attention_schedule.h"
#include "services/worker/kernels/bf16.h"
#include "services/worker/kernels/kernels.h"
#include "services/worker/kernels/reference.h"
#include "tests/attention_test_layouts.h"
#include "tests/gpu/gpu_test_util.h"

namespace {

using keep::kernels::AttentionRows;
using keep::kernels::Bf16;
using keep::kernels::KeyRange;
namespace kk = keep::kernels;
namespace ref = keep::kernels::ref;

using keep::gputest::Buf;
using keep::gputest::g_checks;
using keep::gputest::g_failures;
using keep::kernels::testing::blocks;
using keep::kernels::testing::causal;
using keep::kernels::testing::Layout;
using keep::kernels::testing::random_spans;
using keep::kernels::testing::recompute;
using keep::kernels::testing::seen_keys;

// ---- the test case ----
struct Shape {
  int heads;
  int kv_heads;
  int head_dim;
};
constexpr Shape kSmol{9, 3, 64};
constexpr Shape kQwen7{28, 4, 128};
constexpr Shape kQwen14{40, 8, 128};

struct Options {
  bool fused_q = true;       // q_stride = (heads + 2 * kv_heads) * head_dim, else heads * hd
  int64_t out_extra = 8;     // out_stride = heads * head_dim + out_extra
  bool misalign = false;     // q, out, k, v at an odd element offset (the kernel's scalar paths)
  float q_amplitude = 1.0f;  // q uniform in [-a, a] (larger: peakier softmax)
  float k_ramp = 0.0f;       // key t's K scaled by 1 + k_ramp * t / num_keys (rising scores)
  bool with_lse = true;
  kk::PrefillKernel kernel = kk::PrefillKernel::kMma;
  // Split-key runs (kk::PrefillSplit): 1 = no workspace; 0 = kAuto's choice (prefill_key_splits,
  // with a workspace of prefill_split_max_bytes); n > 1 = n runs. The workspace starts as NaN
  // (0xff bytes): every run must write its part.
  int splits = 1;
};

int device_sms() {
  int device = 0, sms = 0;
  CUDA_OK(cudaGetDevice(&device));
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// A split-key workspace for `splits` (Options::splits) over rows x heads at head_dim.
std::vector<unsigned char> split_workspace(int splits, int32_t rows, int heads, int head_dim) {
  const size_t bytes = splits == 0 ? kk::prefill_split_max_bytes(head_dim, device_sms())
                                   : kk::prefill_split_bytes(rows, heads, head_dim, splits);
  return std::vector<unsigned char>(std::max<size_t>(bytes, 1), 0xff);
}

// The kernels to check: mma.sync always, wgmma where this build and device run it.
std::vector<kk::PrefillKernel> kernels_here() {
  std::vector<kk::PrefillKernel> v{kk::PrefillKernel::kMma};
  if (kk::wgmma_available()) {
    v.push_back(kk::PrefillKernel::kWgmma);
    v.push_back(kk::PrefillKernel::kWgmmaOneK);
    v.push_back(kk::PrefillKernel::kWgmmaWide);
  }
  return v;
}

// Runs ref::attention over rows split across threads (each slice of rows is an AttentionRows of
// its own: row_offsets shifted, spans shared).
void reference_parallel(std::vector<Bf16>& out, int64_t out_stride, std::vector<float>& lse,
                        const std::vector<Bf16>& q, int64_t q_stride, const std::vector<Bf16>& k,
                        const std::vector<Bf16>& v, const Layout& lay, const Shape& sh,
                        float scale) {
  keep::gputest::parallel_rows(lay.rows(), [&](int64_t r0, int64_t r1) {
    const AttentionRows sub{lay.offsets.data() + r0, lay.spans.data(),
                            static_cast<int32_t>(r1 - r0), lay.num_keys};
    ref::attention(out.data() + r0 * out_stride, out_stride,
                   lse.empty() ? nullptr : lse.data() + r0 * sh.heads, q.data() + r0 * q_stride,
                   q_stride, k.data(), v.data(), sub, sh.heads, sh.kv_heads, sh.head_dim, scale);
  });
}

struct Compare {
  int64_t bad = 0;
  int64_t count = 0;
  double diff2 = 0.0;
  double ref2 = 0.0;
};

void run_case(const std::string& name, std::mt19937& rng, const Layout& lay, const Shape& sh,
              const Options& opt) {
  const int32_t rows = lay.rows();
  const int64_t width = static_cast<int64_t>(sh.heads) * sh.head_dim;
  const int64_t q_stride =
      opt.fused_q ? static_cast<int64_t>(sh.heads + 2 * sh.kv_heads) * sh.head_dim : width;
  const int64_t out_stride = width + opt.out_extra;
  const float scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
  const size_t shift = opt.misalign ? 1 : 0;

  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<Bf16> q(static_cast<size_t>(rows) * q_stride);
  for (auto& x : q) x = kk::float_to_bf16(opt.q_amplitude * unit(rng));
  const size_t kv_elems = static_cast<size_t>(lay.num_keys) * sh.kv_heads * sh.head_dim;
  std::vector<Bf16> k(kv_elems), v(kv_elems);
  const size_t per_key = static_cast<size_t>(sh.kv_heads) * sh.head_dim;
  for (size_t i = 0; i < kv_elems; ++i) {
    const float ramp = 1.0f + opt.k_ramp * static_cast<float>(i / per_key) /
                                  static_cast<float>(std::max(lay.num_keys, 1));
    k[i] = kk::float_to_bf16(ramp * unit(rng));
  }
  for (auto& x : v) x = kk::float_to_bf16(unit(rng));
  // Keys nobody sees hold NaN: slots of a view never written.
  const auto seen = seen_keys(lay);
  const Bf16 nan = kk::float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  for (int32_t t = 0; t < lay.num_keys; ++t) {
    if (seen[t]) continue;
    std::fill(k.begin() + t * per_key, k.begin() + (t + 1) * per_key, nan);
    std::fill(v.begin() + t * per_key, v.begin() + (t + 1) * per_key, nan);
  }

  const Bf16 bnan = kk::float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  std::vector<Bf16> want(static_cast<size_t>(rows) * out_stride, bnan);
  std::vector<float> want_lse(opt.with_lse ? static_cast<size_t>(rows) * sh.heads : 0,
                              std::numeric_limits<float>::quiet_NaN());
  reference_parallel(want, out_stride, want_lse, q, q_stride, k, v, lay, sh, scale);

  const auto sched = kk::build_prefill_schedule(lay.view());
  Buf<int32_t> d_offsets(lay.offsets), d_tile_offsets(sched.tile_offsets), d_tiles(sched.tiles);
  Buf<KeyRange> d_spans(lay.spans);
  Buf<Bf16> d_q(q, shift), d_out(std::vector<Bf16>(want.size(), bnan), shift);
  Buf<Bf16> d_k(k, shift), d_v(v, shift);
  Buf<float> d_lse(std::vector<float>(want_lse.size(), std::numeric_limits<float>::quiet_NaN()));
  const AttentionRows d_rows{d_offsets.dev(), d_spans.dev(), rows, lay.num_keys};
  const kk::PrefillSchedule d_sched{d_tile_offsets.dev(), d_tiles.dev()};
  const auto workspace = split_workspace(opt.splits, rows, sh.heads, sh.head_dim);
  Buf<unsigned char> d_split(workspace);
  const kk::PrefillSplit split{opt.splits == 1 ? nullptr : d_split.dev(), workspace.size(),
                               opt.splits};
  CUDA_OK(kk::attention_prefill(d_out.dev(), out_stride, opt.with_lse ? d_lse.dev() : nullptr,
                                d_q.dev(), q_stride, d_k.dev(), d_v.dev(), d_rows, d_sched,
                                sh.heads, sh.kv_heads, sh.head_dim, scale, nullptr, opt.kernel,
                                split));
  CUDA_OK(cudaDeviceSynchronize());
  const auto got = d_out.host();
  const auto got_lse = d_lse.host();

  const std::string what = std::string(kk::prefill_kernel_name(opt.kernel)) + " " + name +
                           (opt.splits == 1 ? "" : " splits=" + std::to_string(opt.splits)) +
                           " rows=" + std::to_string(rows) +
                           " keys=" + std::to_string(lay.num_keys) + " " +
                           std::to_string(sh.heads) + "/" + std::to_string(sh.kv_heads) + " hd" +
                           std::to_string(sh.head_dim) + " kv bf16";
  // out: every element of the heads' columns within tolerance; the padding columns untouched.
  Compare c;
  int64_t untouched_bad = 0;
  for (int32_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < out_stride; ++i) {
      const float g = kk::bf16_to_float(got[r * out_stride + i]);
      const float w = kk::bf16_to_float(want[r * out_stride + i]);
      if (i >= width) {
        if (!std::isnan(g)) ++untouched_bad;
        continue;
      }
      ++c.count;
      const bool ok = !std::isnan(g) && std::fabs(g - w) <= 2e-2f + 2e-2f * std::fabs(w);
      if (!ok) {
        if (c.bad < 3) {
          std::fprintf(stderr, "FAIL %s out[%d, %lld]: got %.6g want %.6g\n", what.c_str(), r,
                       static_cast<long long>(i), g, w);
        }
        ++c.bad;
      }
      c.diff2 += (static_cast<double>(g) - w) * (static_cast<double>(g) - w);
      c.ref2 += static_cast<double>(w) * w;
    }
  }
  ++g_checks;
  if (c.bad > 0) {
    ++g_failures;
    std::fprintf(stderr, "FAIL %s: %lld of %lld outputs off\n", what.c_str(),
                 static_cast<long long>(c.bad), static_cast<long long>(c.count));
  }
  ++g_checks;
  const double rel = keep::gputest::relative_norm(c.diff2, c.ref2);
  if (!(rel < 1e-2)) {
    ++g_failures;
    std::fprintf(stderr, "FAIL %s: relative norm %.3g\n", what.c_str(), rel);
  }
  ++g_checks;
  if (untouched_bad > 0) {
    ++g_failures;
    std::fprintf(stderr, "FAIL %s: %lld padding columns written\n", what.c_str(),
                 static_cast<long long>(untouched_bad));
  }
  // lse: natural log, -inf for rows with no key.
  if (opt.with_lse) {
    const double tol = 1e-3;
    int64_t bad = 0;
    for (size_t i = 0; i < want_lse.size(); ++i) {
      const float g = got_lse[i];
      const float w = want_lse[i];
      const bool ok = std::isinf(w) ? (std::isinf(g) && g < 0)
                                    : (std::fabs(g - w) <= tol * std::max(1.0f, std::fabs(w)));
      if (!ok) {
        if (bad < 3) {
          std::fprintf(stderr, "FAIL %s lse[%zu]: got %.8g want %.8g\n", what.c_str(), i, g, w);
        }
        ++bad;
      }
    }
    ++g_checks;
    if (bad > 0) {
      ++g_failures;
      std::fprintf(stderr, "FAIL %s: %lld of %zu lse off\n", what.c_str(),
                   static_cast<long long>(bad), want_lse.size());
    }
  }
  std::printf("  %-70s rel %.2e  tiles %lld\n", what.c_str(), rel,
              static_cast<long long>(sched.visited_pairs));
}

// Times a large call (median of 20 samples of 10 launches) and checks a sample of its rows
// against the reference.
// A KEEP layer's rows: runs of 15 to 80 memory slots, each recomputed with probability `share`,
// then `query` rows; each row sees every slot up to its own.
Layout keep_layer(std::mt19937& rng, int32_t memory, int32_t query, double share) {
  std::uniform_int_distribution<int32_t> run(15, 80);
  std::bernoulli_distribution pick(share);
  Layout l;
  l.num_keys = memory + query;
  for (int32_t s = 0; s < memory;) {
    const int32_t e = std::min(memory, s + run(rng));
    if (pick(rng)) {
      for (int32_t t = s; t < e; ++t) l.add_row({{0, t + 1}});
    }
    s = e;
  }
  for (int32_t t = memory; t < l.num_keys; ++t) l.add_row({{0, t + 1}});
  return l;
}

// force_sanitize: clean V in every tile not marked full, as if some key were unseen (the cost
// PrefillSchedule::sanitize_v saves, measured on the same layout).
void bench(std::mt19937& rng, const Layout& lay, const Shape& sh, kk::PrefillKernel kernel,
           int splits = 1, const char* label = "causal", bool force_sanitize = false) {
  const int32_t rows = lay.rows();
  const int64_t width = static_cast<int64_t>(sh.heads) * sh.head_dim;
  const int64_t q_stride = static_cast<int64_t>(sh.heads + 2 * sh.kv_heads) * sh.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<Bf16> q(static_cast<size_t>(rows) * q_stride);
  for (auto& x : q) x = kk::float_to_bf16(unit(rng));
  const size_t kv_elems = static_cast<size_t>(lay.num_keys) * sh.kv_heads * sh.head_dim;
  std::vector<Bf16> k(kv_elems), v(kv_elems);
  for (auto& x : k) x = kk::float_to_bf16(unit(rng));
  for (auto& x : v) x = kk::float_to_bf16(unit(rng));
  const auto sched = kk::build_prefill_schedule(lay.view());
  Buf<int32_t> d_offsets(lay.offsets), d_tile_offsets(sched.tile_offsets), d_tiles(sched.tiles);
  Buf<KeyRange> d_spans(lay.spans);
  Buf<Bf16> d_q(q), d_out(std::vector<Bf16>(static_cast<size_t>(rows) * width));
  Buf<Bf16> d_k(k), d_v(v);
  Buf<float> d_lse(std::vector<float>(static_cast<size_t>(rows) * sh.heads));
  const AttentionRows d_rows{d_offsets.dev(), d_spans.dev(), rows, lay.num_keys};
  const kk::PrefillSchedule d_sched{d_tile_offsets.dev(), d_tiles.dev(),
                                    sched.sanitize_v || force_sanitize};
  const auto workspace = split_workspace(splits, rows, sh.heads, sh.head_dim);
  Buf<unsigned char> d_split(workspace);
  const kk::PrefillSplit split{splits == 1 ? nullptr : d_split.dev(), workspace.size(), splits};
  auto call = [&] {
    return kk::attention_prefill(d_out.dev(), width, d_lse.dev(), d_q.dev(), q_stride, d_k.dev(),
                                 d_v.dev(), d_rows, d_sched, sh.heads, sh.kv_heads, sh.head_dim,
                                 scale, nullptr, kernel, split);
  };
  // 10 launches back to back a sample, as a model's layers issue them: the host's work before a
  // launch (the wide kernel encodes three tensor maps) then overlaps the GPU's, which a single
  // launch between two events would add to the kernel's time.
  const keep::gputest::LaunchTimes times = keep::gputest::time_launches(call, 20, 10, 3);
  const double median = times.median_ms;
  const double flops = 4.0 * static_cast<double>(lay.visible()) * sh.head_dim * sh.heads;
  std::printf(
      "  timing %-5s%s: %d rows %s%s over %d keys, %d/%d hd%d kv bf16: %.3f ms median of 20 x "
      "10 (min %.3f), %.1f TFLOP/s\n",
      kk::prefill_kernel_name(kernel),
      splits == 1 ? "" : (splits == 0 ? " split auto" : " split " + std::to_string(splits)).c_str(),
      rows, label, d_sched.sanitize_v ? " (V cleaned)" : "", lay.num_keys, sh.heads, sh.kv_heads,
      sh.head_dim, median, times.min_ms, flops / (median * 1e-3) / 1e12);

  // A sample of rows against the reference: a sub-layout of those rows with their Q.
  const auto got = d_out.host();
  const auto got_lse = d_lse.host();
  std::vector<int32_t> pick;
  for (int32_t r = 0; r < rows; r += 97) pick.push_back(r);
  pick.push_back(rows - 1);
  Layout sub;
  sub.num_keys = lay.num_keys;
  std::vector<Bf16> sub_q;
  for (int32_t r : pick) {
    sub.add_row(std::vector<KeyRange>(lay.spans.begin() + lay.offsets[r],
                                      lay.spans.begin() + lay.offsets[r + 1]));
    sub_q.insert(sub_q.end(), q.begin() + r * q_stride, q.begin() + (r + 1) * q_stride);
  }
  std::vector<Bf16> want(pick.size() * width);
  std::vector<float> want_lse(pick.size() * sh.heads);
  reference_parallel(want, width, want_lse, sub_q, q_stride, k, v, sub, sh, scale);
  int64_t bad = 0;
  for (size_t i = 0; i < pick.size(); ++i) {
    for (int64_t c = 0; c < width; ++c) {
      const float g = kk::bf16_to_float(got[pick[i] * width + c]);
      const float w = kk::bf16_to_float(want[i * width + c]);
      if (std::isnan(g) || std::fabs(g - w) > 2e-2f + 2e-2f * std::fabs(w)) ++bad;
    }
    const double tol = 1e-3;
    for (int h = 0; h < sh.heads; ++h) {
      const float g = got_lse[pick[i] * sh.heads + h];
      const float w = want_lse[i * sh.heads + h];
      if (!(std::fabs(g - w) <= tol * std::max(1.0f, std::fabs(w)))) ++bad;
    }
  }
  ++g_checks;
  if (bad > 0) {
    ++g_failures;
    std::fprintf(stderr, "FAIL timing case %s %d rows %d/%d hd%d: %lld sampled values off\n",
                 kk::prefill_kernel_name(kernel), rows, sh.heads, sh.kv_heads, sh.head_dim,
                 static_cast<long long>(bad));
  }
}

void run_all(std::mt19937& rng, kk::PrefillKernel kernel) {
  std::printf("%s kernel\n", kk::prefill_kernel_name(kernel));
  Options base;
  base.kernel = kernel;
  const Shape shapes[] = {kSmol, kQwen7, kQwen14};
  // Causal chunks, with and without a past (rows then start mid-view, not on a tile boundary).
  int si = 0;
  for (int32_t n : {1, 3, 7, 19, 64, 65, 733}) {
    for (int32_t past : {0, 37}) {
      const Shape& sh = n == 733 ? (past == 0 ? kQwen7 : kSmol) : shapes[si++ % 3];
      run_case("causal past=" + std::to_string(past), rng, causal(n, past), sh, base);
    }
  }
  run_case("causal past=128", rng, causal(200, 128), kQwen14, base);
  {
    Options o = base;
    o.q_amplitude = 8.0f;  // peaky softmax: the running max moves by a lot
    run_case("causal peaky", rng, causal(300, 20), kQwen7, o);
    // Scores rising along the keys (up to 7x): a row's max keeps passing the reference max by
    // more than the slack, so O is rescaled mid-row, after tiles that kept it (a build that
    // never rescaled there failed this case and "causal peaky").
    o.q_amplitude = 4.0f;
    o.k_ramp = 6.0f;
    run_case("causal rising", rng, causal(300, 20), kQwen14, o);
  }
  // Recompute subsets.
  run_case("recompute", rng, recompute(rng, 300, 0.4, true), kSmol, base);
  run_case("recompute", rng, recompute(rng, 1000, 0.15, true), kQwen7, base);
  run_case("recompute sparse", rng, recompute(rng, 700, 0.03, true), kQwen14, base);
  run_case("keep layer", rng, keep_layer(rng, 2000, 128, 0.1), kQwen14, base);
  // Blocks after a prefix (adjacent spans when a block starts at the prefix; gaps unseen = NaN).
  run_case("blocks", rng, blocks(50, {{50, 120}, {120, 300}, {300, 301}, {301, 420}}), kSmol, base);
  run_case("blocks gaps", rng, blocks(64, {{100, 228}, {300, 301}, {320, 512}}), kQwen7, base);
  run_case("blocks no prefix", rng, blocks(0, {{0, 90}, {90, 91}, {91, 200}}), kQwen14, base);
  // Many spans per row, rows with none.
  run_case("random spans", rng, random_spans(rng, 150, 500, 8, false), kSmol, base);
  run_case("random spans", rng, random_spans(rng, 97, 1300, 20, false), kQwen7, base);
  run_case("random spans few keys", rng, random_spans(rng, 70, 9, 3, false), kQwen14, base);
  {
    Layout l;  // zero-key rows among others, and a whole row tile of them
    l.num_keys = 40;
    l.add_row({});
    l.add_row({{0, 5}});
    l.add_row({});
    l.add_row({{3, 4}, {10, 40}});
    for (int i = 0; i < 130; ++i) l.add_row({});
    l.add_row({{39, 40}});
    run_case("zero-key rows", rng, l, kSmol, base);
    Layout none;  // no keys at all
    for (int i = 0; i < 5; ++i) none.add_row({});
    run_case("no keys", rng, none, kQwen7, base);
  }
  // Strides: plain Q, odd out stride (scalar stores), everything misaligned (scalar loads), no
  // lse.
  {
    Options o = base;
    o.fused_q = false;
    o.out_extra = 0;
    run_case("packed strides", rng, causal(130, 5), kQwen7, o);
    o.out_extra = 3;
    run_case("odd out stride", rng, causal(77, 3), kSmol, o);
    o.fused_q = true;
    o.misalign = true;
    run_case("misaligned", rng, blocks(30, {{40, 100}, {100, 190}}), kQwen7, o);
    run_case("misaligned", rng, random_spans(rng, 66, 300, 4, false), kSmol, o);
    Options n = base;
    n.with_lse = false;
    run_case("no lse", rng, causal(70, 0), kQwen14, n);
  }
  // Split-key runs (any kernel but the wide one): a query over a long memory, runs with no key
  // tile (short row tiles, 7 runs of a few tiles), rows with no key, the combine kernel's scalar
  // stores (odd stride, misaligned), no lse, head_dim 64.
  if (kernel != kk::PrefillKernel::kWgmmaWide) {
    Options o = base;
    o.splits = 3;
    run_case("query over memory", rng, causal(128, 2000), kQwen14, o);
    o.splits = 7;
    run_case("recompute sparse", rng, recompute(rng, 700, 0.03, true), kQwen14, o);
    run_case("causal", rng, causal(200, 0), kQwen7, o);
    o.splits = 2;
    run_case("random spans", rng, random_spans(rng, 97, 1300, 20, false), kSmol, o);
    Layout l;  // rows with no key, and one with a key in the last run only
    l.num_keys = 600;
    l.add_row({});
    l.add_row({{0, 5}});
    l.add_row({{590, 600}});
    for (int i = 0; i < 70; ++i) l.add_row({});
    run_case("zero-key rows", rng, l, kQwen7, o);
    o.splits = 4;
    o.fused_q = false;
    o.out_extra = 3;
    run_case("odd out stride", rng, causal(77, 900), kSmol, o);
    o.fused_q = true;
    o.misalign = true;
    run_case("misaligned", rng, blocks(30, {{40, 600}, {600, 900}}), kQwen7, o);
    Options n = base;
    n.splits = 5;
    n.with_lse = false;
    run_case("no lse", rng, causal(70, 1500), kQwen14, n);
  }
  if (!keep::gputest::quick()) {  // KEEP_GPU_TEST_QUICK: set under compute-sanitizer
    bench(rng, causal(4096, 0), kQwen7, kernel);
    bench(rng, causal(2048, 0), kQwen7, kernel);
    bench(rng, causal(1024, 0), kQwen7, kernel);
    bench(rng, causal(1024, 0), kQwen14, kernel);
    bench(rng, causal(512, 3584), kQwen7, kernel);  // a recompute's few rows, long view
    // A KEEP layer at 14B over 40 segments: the query and ~8 % of the memory's runs recomputed,
    // V cleaned or not; dense rows of the same count; an odd row-tile count (the wide kernel's
    // block of one tile).
    const Layout keep_rows = keep_layer(rng, 4108, 128, 0.08);
    bench(rng, keep_rows, kQwen14, kernel, 1, "keep layer");
    bench(rng, keep_rows, kQwen14, kernel, 1, "keep layer", true);
    bench(rng, causal(keep_rows.rows(), 4236 - keep_rows.rows()), kQwen14, kernel);
    bench(rng, causal(320, 3916), kQwen14, kernel);
    bench(rng, causal(384, 3852), kQwen14, kernel);
    bench(rng, causal(4096, 0), kSmol, kernel);
    // Few rows over a long view (decode steps, short recomputes): against the split-key kernel's
    // timings in test_attention_decode, these set CudaBackendOptions::decode_rows.
    for (int32_t rows : {2, 4, 8, 16}) {
      bench(rng, causal(rows, 4096 - rows), kQwen7, kernel);
      bench(rng, causal(rows, 32768 - rows), kQwen7, kernel);
    }
  }
}

void test_invalid_arguments() {
  ++g_checks;
  // Fake device pointers, never dereferenced: each call below must refuse (or, for no rows, do
  // nothing) before launching.
  auto* fake = reinterpret_cast<__nv_bfloat16*>(uintptr_t{256});
  const auto* ints = reinterpret_cast<const int32_t*>(uintptr_t{256});
  const AttentionRows rows{ints, reinterpret_cast<const KeyRange*>(ints), 3, 10};
  const kk::PrefillSchedule sched{ints, ints};
  auto call = [&](__nv_bfloat16* out, int64_t out_stride, const AttentionRows& r, int heads,
                  int kv_heads, int head_dim, const __nv_bfloat16* k) {
    return kk::attention_prefill(out, out_stride, nullptr, fake, 512, k, fake, r, sched, heads,
                                 kv_heads, head_dim, 0.1f, nullptr);
  };
  AttentionRows empty = rows;
  empty.rows = 0;
  AttentionRows negative = rows;
  negative.num_keys = -1;
  const bool ok = call(fake, 512, rows, 4, 2, 96, fake) == cudaErrorInvalidValue &&    // head_dim
                  call(fake, 512, rows, 4, 3, 128, fake) == cudaErrorInvalidValue &&   // 4 % 3
                  call(fake, 511, rows, 4, 2, 128, fake) == cudaErrorInvalidValue &&   // out stride
                  call(fake, 1024, rows, 8, 2, 128, fake) == cudaErrorInvalidValue &&  // q stride
                  call(nullptr, 512, rows, 4, 2, 128, fake) == cudaErrorInvalidValue &&
                  call(fake, 512, rows, 4, 2, 128, nullptr) == cudaErrorInvalidValue &&
                  call(fake, 512, negative, 4, 2, 128, fake) == cudaErrorInvalidValue &&
                  call(nullptr, 512, empty, 4, 2, 128, nullptr) == cudaSuccess;
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "FAIL launcher argument checks\n");
  }
  if (!kk::wgmma_available()) {  // asking for wgmma where it cannot run is refused, not ignored
    ++g_checks;
    for (const auto k : {kk::PrefillKernel::kWgmma, kk::PrefillKernel::kWgmmaWide,
                         kk::PrefillKernel::kWgmmaOneK}) {
      if (kk::attention_prefill(fake, 512, nullptr, fake, 512, fake, fake, rows, sched, 4, 2, 128,
                                0.1f, nullptr, k) != cudaErrorNotSupported) {
        ++g_failures;
        std::fprintf(stderr, "FAIL %s without wgmma not refused\n", kk::prefill_kernel_name(k));
      }
    }
  }
}

}  // namespace

int main() {
  if (!keep::gputest::print_device()) return 2;
  std::mt19937 rng(4321);
  test_invalid_arguments();
  for (const auto kernel : kernels_here()) {
    run_all(rng, kernel);
  }
  // kAuto with a split workspace: the choice of prefill_key_splits (a KEEP request's query-only
  // layer: 128 rows over ~4.2k keys), checked, then timed against the unsplit call.
  {
    std::printf("auto kernel, split-key workspace\n");
    Options o;
    o.kernel = kk::PrefillKernel::kAuto;
    o.splits = 0;
    run_case("query over memory", rng, causal(128, 4108), kQwen14, o);
    run_case("recompute", rng, recompute(rng, 1000, 0.15, true), kQwen7, o);
    if (!keep::gputest::quick()) {
      for (const Shape& sh : {kQwen14, kQwen7}) {
        for (int32_t rows : {64, 128, 320}) {
          for (int splits : {1, 0}) {
            bench(rng, causal(rows, 4236 - rows), sh, kk::PrefillKernel::kAuto, splits);
          }
        }
      }
    }
  }
  std::printf("test_attention: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
