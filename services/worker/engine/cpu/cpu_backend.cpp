#include "services/worker/engine/cpu/cpu_backend.h"

#include <cblas.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "shared/blas/gemm.h"

namespace keep::engine {

namespace {

class CpuPlan final : public AttentionPlan {
 public:
  explicit CpuPlan(AttentionLayout layout) : layout_(std::move(layout)) {}
  const AttentionLayout& layout() const override { return layout_; }

 private:
  AttentionLayout layout_;
};

constexpr int32_t kGemmAttentionRows = 16;  // rows from which attention runs as tiled sgemm
constexpr int32_t kAttentionTile = 64;      // rows per tile

void free_floats(float* p) { std::free(p); }

// Cores this process may run on (its affinity mask, so `taskset -c 0,1` counts 2).
int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// Dot product with independent accumulators so the compiler vectorises without -ffast-math.
inline float dot(const float* a, const float* b, int32_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y (C) = x / rms(x) * w for one row; HF's LlamaRMSNorm in fp32.
void rms_norm_row(float* y, const float* x, const float* w, int64_t c, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < c; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(c)) + eps);
  for (int64_t i = 0; i < c; ++i) y[i] = w[i] * (x[i] * inv);
}

// y (n, C) = rms_norm(x) per row.
void rms_norm(ThreadPool& pool, float* y, const float* x, const float* w, int64_t n, int64_t c,
              float eps) {
  pool.parallel_for(n, [&](int64_t r, int) { rms_norm_row(y + r * c, x + r * c, w, c, eps); });
}

}  // namespace

CpuBackend::CpuBackend(std::shared_ptr<const ModelWeights> weights,
                       const CpuBackendOptions& options)
    : weights_(std::move(weights)) {
  const ModelConfig& cfg = weights_->config;
  const int64_t max_pos = std::clamp<int64_t>(cfg.max_position_embeddings, 4096, 32768);
  rope_ = RopeTable(rope_inv_freq(cfg), static_cast<int32_t>(max_pos));
  threads_ = options.attention_threads > 0 ? options.attention_threads : usable_cores();
  pool_ = std::make_unique<ThreadPool>(threads_);
  if (options.blas_threads > 0) openblas_set_num_threads(options.blas_threads);
  hrow_.resize(static_cast<size_t>(cfg.hidden_size));
}

Result<std::unique_ptr<CpuBackend>> CpuBackend::create(std::shared_ptr<const ModelWeights> weights,
                                                       const CpuBackendOptions& options) {
  if (!weights) return Status(Code::kInvalidArgument, "cpu backend: no weights");
  KEEP_RETURN_IF_ERROR(weights->config.validate().with_context("cpu backend: config"));
  KEEP_RETURN_IF_ERROR(weights->validate().with_context("cpu backend: weights"));
  return std::unique_ptr<CpuBackend>(new CpuBackend(std::move(weights), options));
}

std::string CpuBackend::name() const {
  return "cpu fp32 (openblas " + std::to_string(blas::num_threads()) + " threads, " +
         std::to_string(threads_) + " attention threads)";
}

Result<DeviceBuffer> CpuBackend::allocate(size_t floats) {
  if (floats == 0) return DeviceBuffer();
  if (floats > (size_t{1} << 40)) {
    return Status(Code::kResourceExhausted,
                  "cpu backend: allocation of " + std::to_string(floats) + " floats refused");
  }
  const size_t bytes = ((floats * sizeof(float) + 63) / 64) * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) {
    return Status(Code::kResourceExhausted,
                  "cpu backend: out of memory allocating " + std::to_string(bytes) + " bytes");
  }
  std::memset(p, 0, bytes);
  return DeviceBuffer(static_cast<float*>(p), floats, DeviceKind::kCpu, &free_floats);
}

void CpuBackend::copy_to_device(float* dst, const float* src_host, size_t floats) {
  std::memcpy(dst, src_host, floats * sizeof(float));
}
void CpuBackend::copy_to_host(float* dst_host, const float* src, size_t floats) {
  std::memcpy(dst_host, src, floats * sizeof(float));
}
void CpuBackend::copy_on_device(float* dst, const float* src, size_t floats) {
  std::memmove(dst, src, floats * sizeof(float));
}

Status CpuBackend::reserve(int32_t max_rows, int32_t max_keys) {
  if (max_rows <= 0 || max_keys <= 0) {
    return Status(Code::kInvalidArgument, "cpu backend: reserve needs positive sizes");
  }
  const ModelConfig& c = weights_->config;
  const auto rows = static_cast<size_t>(std::max(max_rows, reserved_rows_));
  const auto keys = static_cast<size_t>(std::max(max_keys, reserved_keys_));
  try {
    xn_.resize(rows * c.hidden_size);
    q_.resize(rows * c.q_dim());
    k_.resize(rows * c.kv_dim());
    v_.resize(rows * c.kv_dim());
    att_.resize(rows * c.q_dim());
    proj_.resize(rows * c.hidden_size);
    gate_.resize(rows * c.intermediate_size);
    up_.resize(rows * c.intermediate_size);
    scores_.resize(static_cast<size_t>(threads_) * keys);
    // A tile's hull lies within the layout's num_keys, which reserve() is called with.
    tile_scores_.resize(static_cast<size_t>(kAttentionTile) * keys);
  } catch (const std::bad_alloc&) {
    return Status(Code::kResourceExhausted, "cpu backend: workspace for " + std::to_string(rows) +
                                                " rows does not fit in memory");
  }
  reserved_rows_ = static_cast<int32_t>(rows);
  reserved_keys_ = static_cast<int32_t>(keys);
  return Status::ok();
}

Result<std::unique_ptr<AttentionPlan>> CpuBackend::plan(const AttentionLayout& layout) {
  return std::unique_ptr<AttentionPlan>(new CpuPlan(layout));
}

void CpuBackend::embed(float* hidden, const int32_t* tokens, int32_t n) {
  const int64_t c = weights_->config.hidden_size;
  const float* e = weights_->embed.ptr();
  for (int32_t i = 0; i < n; ++i) {
    std::memcpy(hidden + i * c, e + static_cast<int64_t>(tokens[i]) * c, c * sizeof(float));
  }
}

void CpuBackend::linear(float* y, const float* x, const float* w, const float* b, int32_t n,
                        int32_t out, int32_t in) const {
  if (n == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.0f, w, in, x, 1, 0.0f, y, 1);
  } else {
    blas::gemm_nt(y, x, w, n, out, in);
  }
  if (b != nullptr) {
    for (int32_t r = 0; r < n; ++r) {
      float* yr = y + static_cast<int64_t>(r) * out;
      for (int32_t i = 0; i < out; ++i) yr[i] += b[i];
    }
  }
}

void CpuBackend::attention(const LayerOutputs& out, const float* q, const KvView& kv,
                           const AttentionLayout& layout) {
  const ModelConfig& c = weights_->config;
  const int32_t heads = static_cast<int32_t>(c.num_heads);
  const int32_t kv_heads = static_cast<int32_t>(c.num_kv_heads);
  const int32_t hd = static_cast<int32_t>(c.head_dim);
  const int32_t group = heads / kv_heads;
  const int64_t kv_stride = static_cast<int64_t>(kv_heads) * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int32_t rows = layout.num_rows();
  const int32_t groups = layout.num_groups;
  const bool pool = groups > 0 && out.pooled != nullptr;
  const int32_t max_keys = reserved_keys_;
  float* att = att_.data();
  float* scores_base = scores_.data();

  // One (row, head): scores over the row's spans, softmax, weighted sum of V.
  auto one = [&](int32_t r, int32_t h, float* s) {
    const float* qr = q + (static_cast<int64_t>(r) * heads + h) * hd;
    const int32_t kh = h / group;
    const int32_t b0 = layout.span_offsets[r], b1 = layout.span_offsets[r + 1];
    float mx = -INFINITY;
    int32_t j = 0;
    for (int32_t b = b0; b < b1; ++b) {
      for (int32_t t = layout.spans[b].begin; t < layout.spans[b].end; ++t) {
        const float v = dot(qr, kv.k_f32() + t * kv_stride + kh * hd, hd) * scale;
        s[j++] = v;
        mx = std::max(mx, v);
      }
    }
    float sum = 0.0f;
    for (int32_t i = 0; i < j; ++i) {
      s[i] = std::exp(s[i] - mx);
      sum += s[i];
    }
    const float inv = 1.0f / sum;
    float* o = att + (static_cast<int64_t>(r) * heads + h) * hd;
    std::fill(o, o + hd, 0.0f);
    j = 0;
    for (int32_t b = b0; b < b1; ++b) {
      for (int32_t t = layout.spans[b].begin; t < layout.spans[b].end; ++t) {
        const float p = s[j++] * inv;
        const float* vt = kv.v_f32() + t * kv_stride + kh * hd;
        for (int32_t d = 0; d < hd; ++d) o[d] += p * vt[d];
        if (pool) {
          const int32_t g = layout.key_group[t];
          if (g >= 0) out.pooled[static_cast<int64_t>(r) * groups + g] += p;
        }
      }
    }
    if (out.lse != nullptr) out.lse[static_cast<int64_t>(r) * heads + h] = mx + std::log(sum);
  };

  if (pool) std::fill(out.pooled, out.pooled + static_cast<int64_t>(rows) * groups, 0.0f);
  if (rows >= kGemmAttentionRows) {
    attention_tiled(out, q, kv, layout);
    return;
  }
  if (pool) {
    // Rows own their pooled entries: parallel over rows only.
    pool_->parallel_for(rows, [&](int64_t r, int tid) {
      float* s = scores_base + static_cast<int64_t>(tid) * max_keys;
      for (int32_t h = 0; h < heads; ++h) one(static_cast<int32_t>(r), h, s);
    });
  } else {
    pool_->parallel_for(static_cast<int64_t>(rows) * heads, [&](int64_t i, int tid) {
      float* s = scores_base + static_cast<int64_t>(tid) * max_keys;
      one(static_cast<int32_t>(i / heads), static_cast<int32_t>(i % heads), s);
    });
  }
}

// Many rows: per head and tile of rows, S = Q K^T over the hull of the tile's spans (one sgemm),
// mask what the spans exclude, softmax per row, O = P V (one sgemm).
void CpuBackend::attention_tiled(const LayerOutputs& out, const float* q, const KvView& kv,
                                 const AttentionLayout& layout) {
  const ModelConfig& c = weights_->config;
  const auto heads = static_cast<int32_t>(c.num_heads);
  const auto kv_heads = static_cast<int32_t>(c.num_kv_heads);
  const auto hd = static_cast<int32_t>(c.head_dim);
  const int32_t group = heads / kv_heads;
  const int32_t kv_stride = kv_heads * hd;
  const int32_t q_stride = heads * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int32_t rows = layout.num_rows();
  const int32_t groups = layout.num_groups;
  const bool pool = groups > 0 && out.pooled != nullptr;
  for (int32_t r0 = 0; r0 < rows; r0 += kAttentionTile) {
    const int32_t m = std::min(kAttentionTile, rows - r0);
    int32_t lo = INT32_MAX, hi = 0;
    for (int32_t r = r0; r < r0 + m; ++r) {
      lo = std::min(lo, layout.spans[layout.span_offsets[r]].begin);
      hi = std::max(hi, layout.spans[layout.span_offsets[r + 1] - 1].end);
    }
    const int32_t w = hi - lo;
    float* S = tile_scores_.data();  // (m, w)
    for (int32_t h = 0; h < heads; ++h) {
      const int32_t kh = h / group;
      blas::gemm_nt_strided(S, w, q + static_cast<int64_t>(r0) * q_stride + h * hd, q_stride,
                            kv.k_f32() + static_cast<int64_t>(lo) * kv_stride + kh * hd, kv_stride,
                            m, w, hd, scale, 0.0f);
      pool_->parallel_for(m, [&](int64_t i, int) {
        const int32_t r = r0 + static_cast<int32_t>(i);
        float* srow = S + i * w;
        int32_t t = lo;
        float mx = -INFINITY;
        for (int32_t b = layout.span_offsets[r]; b < layout.span_offsets[r + 1]; ++b) {
          for (; t < layout.spans[b].begin; ++t) srow[t - lo] = -INFINITY;
          for (; t < layout.spans[b].end; ++t) mx = std::max(mx, srow[t - lo]);
        }
        for (; t < hi; ++t) srow[t - lo] = -INFINITY;
        float sum = 0.0f;
        for (int32_t j = 0; j < w; ++j) {
          const float e = std::exp(srow[j] - mx);  // exp(-inf) = 0 for masked keys
          srow[j] = e;
          sum += e;
        }
        const float inv = 1.0f / sum;
        for (int32_t j = 0; j < w; ++j) srow[j] *= inv;
        if (out.lse != nullptr) out.lse[static_cast<int64_t>(r) * heads + h] = mx + std::log(sum);
        if (pool) {
          float* pr = out.pooled + static_cast<int64_t>(r) * groups;
          for (int32_t j = 0; j < w; ++j) {
            const int32_t g = layout.key_group[lo + j];
            if (g >= 0) pr[g] += srow[j];
          }
        }
      });
      blas::gemm_nn_strided(att_.data() + static_cast<int64_t>(r0) * q_stride + h * hd, q_stride, S,
                            w, kv.v_f32() + static_cast<int64_t>(lo) * kv_stride + kh * hd,
                            kv_stride, m, hd, w, 1.0f, 0.0f);
    }
  }
}

Status CpuBackend::layer_forward(const LayerOutputs& out, const float* hidden_in, int32_t layer,
                                 const KvView& kv, const AttentionPlan& plan) {
  const ModelConfig& c = weights_->config;
  const AttentionLayout& layout = plan.layout();
  const int32_t n = layout.num_rows();
  KEEP_CHECK(layer >= 0 && layer < c.num_layers);
  KEEP_CHECK(n <= reserved_rows_ && layout.num_keys <= reserved_keys_);
  KEEP_CHECK(layout.num_keys <= kv.capacity);
  const LayerWeights& w = weights_->layers[layer];
  const auto C = static_cast<int32_t>(c.hidden_size);
  const auto qd = static_cast<int32_t>(c.q_dim());
  const auto kvd = static_cast<int32_t>(c.kv_dim());
  const auto I = static_cast<int32_t>(c.intermediate_size);
  const auto eps = static_cast<float>(c.rms_norm_eps);
  auto bias = [](const Tensor& t) { return t.empty() ? nullptr : t.ptr(); };

  // Attention block.
  rms_norm(*pool_, xn_.data(), hidden_in, w.attn_norm.ptr(), n, C, eps);
  linear(q_.data(), xn_.data(), w.wq.ptr(), bias(w.bq), n, qd, C);
  linear(k_.data(), xn_.data(), w.wk.ptr(), bias(w.bk), n, kvd, C);
  linear(v_.data(), xn_.data(), w.wv.ptr(), bias(w.bv), n, kvd, C);
  if (out.k_pre != nullptr) std::memcpy(out.k_pre, k_.data(), sizeof(float) * n * kvd);
  if (out.v != nullptr) std::memcpy(out.v, v_.data(), sizeof(float) * n * kvd);
  const int32_t* pos = layout.row_position.data();
  rope_.apply(q_.data(), pos, n, c.num_heads);
  for (int32_t r = 0; r < n; ++r) {
    const int64_t slot = layout.row_slot[r];
    rope_.apply_strided(kv.k_f32() + slot * kvd, kvd, k_.data() + static_cast<int64_t>(r) * kvd,
                        kvd, pos + r, 1, c.num_kv_heads);
    std::memcpy(kv.v_f32() + slot * kvd, v_.data() + static_cast<int64_t>(r) * kvd,
                sizeof(float) * kvd);
  }
  // Rows [first, n) produce hidden output (out_rows); attention runs for all rows when lse or
  // pooled are wanted, else only when some row's output is.
  int32_t keep = out.out_rows < 0 ? n : std::min(out.out_rows, n);
  const int32_t first = n - keep;
  if (keep == 0 && out.lse == nullptr && out.pooled == nullptr) return Status::ok();
  attention(out, q_.data(), kv, layout);
  if (keep == 0) return Status::ok();
  const int64_t off = static_cast<int64_t>(first) * C;
  float* hid = out.hidden + off;
  linear(proj_.data(), att_.data() + static_cast<int64_t>(first) * qd, w.wo.ptr(), bias(w.bo), keep,
         C, qd);
  int64_t nc = static_cast<int64_t>(keep) * C;
  for (int64_t i = 0; i < nc; ++i) hid[i] = hidden_in[off + i] + proj_[i];
  if (out.choose_rows != nullptr) {  // only the chosen rows go on, packed into chosen_hidden
    KEEP_ASSIGN_OR_RETURN(const std::vector<int32_t> chosen, (*out.choose_rows)());
    gather_rows(out.chosen_hidden, hid, chosen.data(), static_cast<int32_t>(chosen.size()),
                static_cast<size_t>(C));
    hid = out.chosen_hidden;
    keep = static_cast<int32_t>(chosen.size());
    nc = static_cast<int64_t>(keep) * C;
    if (keep == 0) return Status::ok();
  }

  // MLP block: down(silu(gate(x)) * up(x)).
  rms_norm(*pool_, xn_.data(), hid, w.ffn_norm.ptr(), keep, C, eps);
  linear(gate_.data(), xn_.data(), w.w_gate.ptr(), nullptr, keep, I, C);
  linear(up_.data(), xn_.data(), w.w_up.ptr(), nullptr, keep, I, C);
  const int64_t ni = static_cast<int64_t>(keep) * I;
  float* g = gate_.data();
  const float* u = up_.data();
  constexpr int64_t kChunk = 16384;
  pool_->parallel_for((ni + kChunk - 1) / kChunk, [&](int64_t b, int) {
    const int64_t end = std::min(ni, (b + 1) * kChunk);
    for (int64_t i = b * kChunk; i < end; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  });
  linear(proj_.data(), g, w.w_down.ptr(), nullptr, keep, C, I);
  for (int64_t i = 0; i < nc; ++i) hid[i] += proj_[i];
  return Status::ok();
}

void CpuBackend::load_kv(const KvView& kv, int32_t first_slot, const float* k_pre, const float* v,
                         const int32_t* positions, int32_t n) {
  const int64_t kvd = weights_->config.kv_dim();
  float* k_out = kv.k_f32() + first_slot * kvd;
  std::memcpy(kv.v_f32() + first_slot * kvd, v, sizeof(float) * static_cast<size_t>(n * kvd));
  const int64_t heads = weights_->config.num_kv_heads;
  constexpr int64_t kChunk = 64;
  pool_->parallel_for((n + kChunk - 1) / kChunk, [&](int64_t b, int) {
    const int64_t first = b * kChunk, m = std::min<int64_t>(kChunk, n - first);
    rope_.apply_strided(k_out + first * kvd, kvd, k_pre + first * kvd, kvd, positions + first, m,
                        heads);
  });
}

void CpuBackend::final_logits(float* logits, const float* hidden, const int32_t* rows, int32_t n) {
  const ModelConfig& c = weights_->config;
  const int64_t C = c.hidden_size;
  const auto eps = static_cast<float>(c.rms_norm_eps);
  const Tensor& out_w = weights_->output_weight();
  const auto V = static_cast<int32_t>(c.vocab_size);
  // Chunks of up to reserved_rows_ rows through the xn_ workspace.
  const int32_t chunk = std::max<int32_t>(1, std::min<int32_t>(reserved_rows_, 64));
  for (int32_t a = 0; a < n; a += chunk) {
    const int32_t m = std::min(chunk, n - a);
    float* xn = reserved_rows_ > 0 ? xn_.data() : hrow_.data();
    for (int32_t i = 0; i < m; ++i) {
      rms_norm_row(xn + i * C, hidden + static_cast<int64_t>(rows[a + i]) * C,
                   weights_->final_norm.ptr(), C, eps);
    }
    linear(logits + static_cast<int64_t>(a) * V, xn, out_w.ptr(), nullptr, m, V,
           static_cast<int32_t>(C));
  }
}

}  // namespace keep::engine
