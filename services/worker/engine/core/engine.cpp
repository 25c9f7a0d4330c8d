#include "services/worker/engine/core/engine.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

namespace keep::engine {

namespace {

constexpr int32_t kLogitRows = 16;  // rows of logits computed per backend call

Status invalid(const std::string& msg) { return Status(Code::kInvalidArgument, msg); }

Status check_buffer(const DeviceBuffer* b, size_t need, const char* what) {
  if (b == nullptr) return Status::ok();
  if (b->size() < need) {
    return invalid(std::string(what) + " buffer holds " + std::to_string(b->size()) +
                   " floats, needs " + std::to_string(need));
  }
  return Status::ok();
}

}  // namespace

const char* device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

void Backend::argmax(int32_t* out_host, const float* logits, int32_t rows) {
  const auto vocab = static_cast<size_t>(config().vocab_size);
  std::vector<float> host(static_cast<size_t>(rows) * vocab);
  copy_to_host(host.data(), logits, host.size());
  for (int32_t r = 0; r < rows; ++r) {
    out_host[r] = engine::argmax(std::span<const float>(host.data() + r * vocab, vocab));
  }
}

void Backend::gather_rows(float* dst, const float* src, const int32_t* rows, int32_t n,
                          size_t cols) {
  for (int32_t i = 0; i < n; ++i) {
    copy_on_device(dst + static_cast<size_t>(i) * cols, src + static_cast<size_t>(rows[i]) * cols,
                   cols);
  }
}

void Backend::load_kv_bf16_runs(std::span<const KvRun> runs) {
  std::vector<int32_t> positions;
  for (const KvRun& r : runs) {
    positions.resize(static_cast<size_t>(r.n));
    for (int32_t k = 0; k < r.n; ++k) positions[k] = r.first_slot + k;
    load_kv_bf16(r.kv, r.first_slot, r.k_pre, r.v, positions.data(), r.n);
  }
}

void Backend::load_kv_bf16(const KvView& kv, int32_t first_slot, const uint16_t* k_pre,
                           const uint16_t* v, const int32_t* positions, int32_t n) {
  // bf16 is the top half of an fp32: widening is a shift.
  const size_t elems = static_cast<size_t>(n) * static_cast<size_t>(config().kv_dim());
  std::vector<float> k32(elems), v32(elems);
  for (size_t i = 0; i < elems; ++i) {
    const uint32_t kb = static_cast<uint32_t>(k_pre[i]) << 16;
    const uint32_t vb = static_cast<uint32_t>(v[i]) << 16;
    std::memcpy(&k32[i], &kb, 4);
    std::memcpy(&v32[i], &vb, 4);
  }
  load_kv(kv, first_slot, k32.data(), v32.data(), positions, n);
}

void Backend::final_logits_to_host(float* logits_host, float* logits, const float* hidden,
                                   const int32_t* rows, int32_t n) {
  final_logits(logits, hidden, rows, n);
  copy_to_host(logits_host, logits,
               static_cast<size_t>(n) * static_cast<size_t>(config().vocab_size));
}

void Backend::token_logprob(float* out_host, const float* logits, const int32_t* tokens_host,
                            int32_t rows) {
  const auto vocab = static_cast<size_t>(config().vocab_size);
  std::vector<float> host(static_cast<size_t>(rows) * vocab);
  copy_to_host(host.data(), logits, host.size());
  for (int32_t r = 0; r < rows; ++r) {
    out_host[r] = static_cast<float>(
        log_prob(std::span<const float>(host.data() + r * vocab, vocab), tokens_host[r]));
  }
}

float* KvView::k_f32() const {
  KEEP_CHECK(type == KvType::kF32);
  return static_cast<float*>(k);
}
float* KvView::v_f32() const {
  KEEP_CHECK(type == KvType::kF32);
  return static_cast<float*>(v);
}

Result<KvCache> KvCache::create(Backend& backend, int32_t capacity) {
  if (capacity <= 0) return invalid("kv cache: capacity must be positive");
  const ModelConfig& c = backend.config();
  static std::atomic<uint64_t> next_id{0};
  KvCache cache;
  cache.id_ = ++next_id;
  cache.capacity_ = capacity;
  cache.type_ = backend.kv_type();
  // DeviceBuffers count floats: a bf16 view takes half as many.
  const size_t elems = static_cast<size_t>(capacity) * static_cast<size_t>(c.kv_dim());
  const size_t n = (elems * kv_type_size(cache.type_) + sizeof(float) - 1) / sizeof(float);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    KEEP_ASSIGN_OR_RETURN(DeviceBuffer k, backend.allocate(n));
    KEEP_ASSIGN_OR_RETURN(DeviceBuffer v, backend.allocate(n));
    cache.k_.push_back(std::move(k));
    cache.v_.push_back(std::move(v));
  }
  return cache;
}

bool GenerateOptions::stops_at(int32_t token, std::span<const int32_t> eos) const {
  return (stop_at_eos && std::find(eos.begin(), eos.end(), token) != eos.end()) ||
         std::find(stop_tokens.begin(), stop_tokens.end(), token) != stop_tokens.end();
}

Result<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<Backend> backend, int32_t max_rows) {
  if (!backend) return invalid("engine: no backend");
  if (max_rows <= 0) return invalid("engine: max_rows must be positive");
  std::unique_ptr<Engine> e(new Engine(std::move(backend)));
  KEEP_RETURN_IF_ERROR(e->ensure_rows(max_rows));
  KEEP_ASSIGN_OR_RETURN(
      e->logits_, e->backend_->allocate(static_cast<size_t>(kLogitRows) * e->config().vocab_size));
  return e;
}

Status Engine::ensure_rows(int32_t rows) {
  if (rows <= max_rows_) return Status::ok();
  KEEP_RETURN_IF_ERROR(backend_->reserve(rows, std::max(rows, backend_->reserved_keys())));
  KEEP_ASSIGN_OR_RETURN(hidden_,
                        backend_->allocate(static_cast<size_t>(rows) * config().hidden_size));
  max_rows_ = rows;
  return Status::ok();
}

Result<DeviceBuffer> Engine::allocate_hidden(int32_t rows) {
  if (rows <= 0) return invalid("allocate_hidden: rows must be positive");
  return backend_->allocate(static_cast<size_t>(rows) * config().hidden_size);
}

Status Engine::embed(DeviceBuffer& hidden, std::span<const int32_t> tokens) {
  const int64_t c = config().hidden_size;
  if (tokens.empty()) return invalid("embed: no tokens");
  KEEP_RETURN_IF_ERROR(check_buffer(&hidden, tokens.size() * c, "embed: hidden"));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= config().vocab_size) {
      return invalid("embed: token " + std::to_string(i) + " = " + std::to_string(tokens[i]) +
                     " outside the vocabulary [0, " + std::to_string(config().vocab_size) + ")");
    }
  }
  backend_->embed(hidden.data(), tokens.data(), static_cast<int32_t>(tokens.size()));
  return Status::ok();
}

Result<std::unique_ptr<AttentionPlan>> Engine::plan(const AttentionLayout& layout) {
  KEEP_RETURN_IF_ERROR(layout.validate().with_context("attention layout"));
  // Keys workspace: the whole view (tiled attention scores a tile against the hull of its spans).
  const int64_t keys = layout.num_keys;
  if (keys > INT32_MAX / 2) return invalid("attention layout: too many keys");
  KEEP_RETURN_IF_ERROR(
      backend_->reserve(std::max(layout.num_rows(), backend_->reserved_rows()),
                        std::max(static_cast<int32_t>(keys), backend_->reserved_keys())));
  return backend_->plan(layout);
}

// The checks of every load_kv form: sources set, slots [first_slot, first_slot + n) inside the
// view, the view this backend's. (Explicit positions are checked by check_positions.)
Status Engine::check_load(const KvView& kv, int32_t first_slot, int64_t n, const void* k_pre,
                          const void* v) const {
  if (k_pre == nullptr || v == nullptr) return invalid("load_kv: null source");
  if (first_slot < 0 || first_slot + n > kv.capacity) {
    return invalid("load_kv: slots [" + std::to_string(first_slot) + ", " +
                   std::to_string(first_slot + n) + ") outside the view's " +
                   std::to_string(kv.capacity));
  }
  if (kv.type != backend_->kv_type() || kv.k == nullptr || kv.v == nullptr) {
    return invalid("load_kv: the view is not one of this backend's");
  }
  return Status::ok();
}

namespace {
Status check_positions(std::span<const int32_t> positions) {
  for (int32_t p : positions) {
    if (p < 0) return invalid("load_kv: negative position");
  }
  return Status::ok();
}
}  // namespace

Status Engine::load_kv(const KvView& kv, int32_t first_slot, std::span<const int32_t> positions,
                       const float* k_pre, const float* v) {
  if (positions.empty()) return Status::ok();
  KEEP_RETURN_IF_ERROR(
      check_load(kv, first_slot, static_cast<int64_t>(positions.size()), k_pre, v));
  KEEP_RETURN_IF_ERROR(check_positions(positions));
  backend_->load_kv(kv, first_slot, k_pre, v, positions.data(),
                    static_cast<int32_t>(positions.size()));
  return Status::ok();
}

Status Engine::check_runs(std::span<const Backend::KvRun> runs) const {
  for (const auto& r : runs) {
    if (r.n <= 0) return invalid("load_kv: an empty run");
    if (r.layer < 0 || r.layer >= config().num_layers) {
      return invalid("load_kv: layer " + std::to_string(r.layer) + " outside the model");
    }
    // Positions are the slots: in range once the slots are.
    KEEP_RETURN_IF_ERROR(check_load(r.kv, r.first_slot, r.n, r.k_pre, r.v));
  }
  return Status::ok();
}

Status Engine::load_kv_bf16_runs(std::span<const Backend::KvRun> runs) {
  KEEP_RETURN_IF_ERROR(check_runs(runs));
  if (!runs.empty()) backend_->load_kv_bf16_runs(runs);
  return Status::ok();
}

Status Engine::queue_kv_bf16_runs(std::span<const Backend::KvRun> runs) {
  KEEP_RETURN_IF_ERROR(check_runs(runs));
  if (!runs.empty()) backend_->queue_kv_bf16_runs(runs);
  return Status::ok();
}

Status Engine::load_kv_bf16(const KvView& kv, int32_t first_slot,
                            std::span<const int32_t> positions, const uint16_t* k_pre,
                            const uint16_t* v) {
  if (positions.empty()) return Status::ok();
  KEEP_RETURN_IF_ERROR(
      check_load(kv, first_slot, static_cast<int64_t>(positions.size()), k_pre, v));
  KEEP_RETURN_IF_ERROR(check_positions(positions));
  backend_->load_kv_bf16(kv, first_slot, k_pre, v, positions.data(),
                         static_cast<int32_t>(positions.size()));
  return Status::ok();
}

Status Engine::read_pooled(float* dst, const DeviceBuffer& pooled, size_t floats) {
  if (dst == nullptr && floats > 0) return invalid("read_pooled: null destination");
  if (floats > pooled.size()) {
    return invalid("read_pooled: " + std::to_string(floats) + " floats from a buffer of " +
                   std::to_string(pooled.size()));
  }
  if (floats > 0) backend_->read_pooled(dst, pooled.data(), floats);
  return Status::ok();
}

Status Engine::prefill_layer(int32_t layer, DeviceBuffer& hidden, const KvView& kv,
                             const AttentionPlan& plan, const LayerExtras& extras) {
  const ModelConfig& c = config();
  const AttentionLayout& layout = plan.layout();
  const size_t rows = static_cast<size_t>(layout.num_rows());
  if (layer < 0 || layer >= c.num_layers) {
    return invalid("prefill_layer: layer " + std::to_string(layer) + " outside [0, " +
                   std::to_string(c.num_layers) + ")");
  }
  if (kv.type != backend_->kv_type()) {
    return invalid("prefill_layer: the view is not one of this backend's");
  }
  if (layout.num_keys > kv.capacity || kv.k == nullptr || kv.v == nullptr) {
    return invalid("prefill_layer: the layout references " + std::to_string(layout.num_keys) +
                   " slots, the view has " + std::to_string(kv.capacity));
  }
  KEEP_RETURN_IF_ERROR(check_buffer(&hidden, rows * c.hidden_size, "prefill_layer: hidden"));
  KEEP_RETURN_IF_ERROR(check_buffer(extras.k_pre, rows * c.kv_dim(), "prefill_layer: k_pre"));
  KEEP_RETURN_IF_ERROR(check_buffer(extras.v, rows * c.kv_dim(), "prefill_layer: v"));
  KEEP_RETURN_IF_ERROR(check_buffer(extras.lse, rows * c.num_heads, "prefill_layer: lse"));
  if (extras.pooled != nullptr && layout.num_groups == 0) {
    return invalid("prefill_layer: pooled output requested but the layout has no groups");
  }
  KEEP_RETURN_IF_ERROR(check_buffer(extras.pooled, rows * static_cast<size_t>(layout.num_groups),
                                    "prefill_layer: pooled"));
  if (extras.out_rows < -1 || extras.out_rows > layout.num_rows()) {
    return invalid("prefill_layer: out_rows " + std::to_string(extras.out_rows) + " outside [-1, " +
                   std::to_string(layout.num_rows()) + "]");
  }
  if (layout.num_rows() > backend_->reserved_rows() ||
      layout.num_keys > backend_->reserved_keys()) {
    return invalid("prefill_layer: the plan was not made by this engine");
  }
  LayerOutputs out;
  out.hidden = hidden.data();
  out.k_pre = extras.k_pre ? extras.k_pre->data() : nullptr;
  out.v = extras.v ? extras.v->data() : nullptr;
  out.lse = extras.lse ? extras.lse->data() : nullptr;
  out.pooled = extras.pooled ? extras.pooled->data() : nullptr;
  out.out_rows = extras.out_rows;
  out.pooled_to_host = extras.pooled_to_host && extras.pooled != nullptr;
  if (!extras.choose_rows) {
    if (extras.chosen_hidden != nullptr) {
      return invalid("prefill_layer: chosen_hidden without choose_rows");
    }
    return backend_->layer_forward(out, hidden.data(), layer, kv, plan);
  }
  if (extras.out_rows != -1) return invalid("prefill_layer: choose_rows with out_rows set");
  if (extras.chosen_hidden == nullptr || extras.chosen_hidden == &hidden ||
      extras.chosen_hidden->data() == hidden.data()) {
    return invalid("prefill_layer: choose_rows needs a chosen_hidden buffer apart from hidden");
  }
  KEEP_RETURN_IF_ERROR(
      check_buffer(extras.chosen_hidden, rows * c.hidden_size, "prefill_layer: chosen_hidden"));
  // The chooser's rows are checked here, inside the layer, before the backend uses them.
  const std::function<Result<std::vector<int32_t>>()> checked =
      [&]() -> Result<std::vector<int32_t>> {
    KEEP_ASSIGN_OR_RETURN(std::vector<int32_t> chosen, extras.choose_rows());
    for (size_t i = 0; i < chosen.size(); ++i) {
      if (chosen[i] < 0 || static_cast<size_t>(chosen[i]) >= rows ||
          (i > 0 && chosen[i] <= chosen[i - 1])) {
        return invalid("prefill_layer: choose_rows gave row " + std::to_string(chosen[i]) + " at " +
                       std::to_string(i) + ": rows must ascend within [0, " + std::to_string(rows) +
                       ")");
      }
    }
    return chosen;
  };
  out.choose_rows = &checked;
  out.chosen_hidden = extras.chosen_hidden->data();
  return backend_->layer_forward(out, hidden.data(), layer, kv, plan);
}

Result<std::vector<float>> Engine::logits(const DeviceBuffer& hidden,
                                          std::span<const int32_t> rows) {
  const int64_t c = config().hidden_size;
  const int64_t vocab = config().vocab_size;
  const int64_t have = static_cast<int64_t>(hidden.size()) / c;
  for (int32_t r : rows) {
    if (r < 0 || r >= have) {
      return invalid("logits: row " + std::to_string(r) + " outside the hidden buffer's " +
                     std::to_string(have) + " rows");
    }
  }
  std::vector<float> out(rows.size() * static_cast<size_t>(vocab));
  for (size_t a = 0; a < rows.size(); a += kLogitRows) {
    const auto m = static_cast<int32_t>(std::min<size_t>(kLogitRows, rows.size() - a));
    backend_->final_logits_to_host(out.data() + a * vocab, logits_.data(), hidden.data(),
                                   rows.data() + a, m);
  }
  return out;
}

Result<int32_t> Engine::run_prefill(KvCache& cache, std::span<const int32_t> tokens) {
  if (tokens.empty()) return invalid("prefill: no tokens");
  if (cache.num_layers() != config().num_layers) return invalid("prefill: cache of another model");
  if (cache.size() + static_cast<int64_t>(tokens.size()) > cache.capacity()) {
    return invalid("prefill: " + std::to_string(tokens.size()) + " tokens after " +
                   std::to_string(cache.size()) + " exceed the cache's " +
                   std::to_string(cache.capacity()));
  }
  int32_t last_row = 0;
  for (size_t a = 0; a < tokens.size(); a += static_cast<size_t>(max_rows_)) {
    const auto n = static_cast<int32_t>(std::min<size_t>(max_rows_, tokens.size() - a));
    const bool last_chunk = a + static_cast<size_t>(n) == tokens.size();
    KEEP_RETURN_IF_ERROR(embed(hidden_, tokens.subspan(a, n)));
    KEEP_RETURN_IF_ERROR(prefill_chunk(cache, n, last_chunk));
    cache.set_size(cache.size() + n);
    last_row = n - 1;
  }
  return last_row;
}

Status Engine::prefill_chunk(KvCache& cache, int32_t n, bool last_chunk) {
  const ReplayCache::Key key{cache.id(), cache.size(), n, last_chunk, hidden_.data()};
  // Long chunks: replayed where recorded, recorded when seen before (replay_cache.h); everything
  // else runs launch by launch. One layer: nothing to record past the first.
  ReplayCache::Decision decision;
  if (n >= ReplayCache::kMinRows && config().num_layers > 1) {
    decision = replay_cache_.find(*backend_, key);
  }
  const bool record = decision.action == ReplayCache::Action::kRecord;
  const bool replay = decision.action == ReplayCache::Action::kReplay;
  std::unique_ptr<AttentionPlan> fresh;
  if (!replay) {
    KEEP_ASSIGN_OR_RETURN(fresh, plan(AttentionLayout::causal(n, key.past)));
  }
  const AttentionPlan& p = replay ? *decision.plan : *fresh;
  // The last layer's output matters for the last token only: earlier chunks need just its K/V.
  LayerExtras last_layer;
  last_layer.out_rows = last_chunk ? 1 : 0;
  const int32_t layers = config().num_layers;
  auto run_layers = [&](int32_t from, int32_t to) -> Status {
    for (int32_t l = from; l < to; ++l) {
      KEEP_RETURN_IF_ERROR(prefill_layer(l, hidden_, cache.layer(l), p,
                                         l + 1 == layers ? last_layer : LayerExtras{}));
      if (record && l + 1 == ReplayCache::kSplitLayer) backend_->capture_split();
    }
    return Status::ok();
  };
  if (!replay && !record) return run_layers(0, layers);  // launch by launch
  // A recorded chunk: the first layer launch by launch, the others as the recording, in two parts
  // (layers 1 to kSplitLayer - 1, then the rest). A graph's launch costs the host time per node:
  // the GPU starts on the first layer at once, and runs it and the small first part while the host
  // submits the large one (benchmarks/RESULTS.md run 23).
  KEEP_RETURN_IF_ERROR(run_layers(0, 1));
  if (replay) {
    backend_->replay(decision.handle);
    return Status::ok();
  }
  KEEP_RETURN_IF_ERROR(backend_->prepare(p));  // no planning inside the capture
  Backend::Capture capture(*backend_);  // layers 1.. as CUDA graphs where the backend records them
  KEEP_RETURN_IF_ERROR(run_layers(1, layers));
  const uint64_t handle = capture.finish_for_replay();
  if (handle == 0) return Status::ok();  // the backend records nothing (graphs off): it ran
  replay_cache_.add(*backend_, key, std::move(fresh), handle);
  return Status::ok();
}

Result<std::vector<float>> Engine::prefill(KvCache& cache, std::span<const int32_t> tokens) {
  KEEP_ASSIGN_OR_RETURN(int32_t last_row, run_prefill(cache, tokens));
  return logits(hidden_, std::span<const int32_t>(&last_row, 1));
}

Result<std::vector<float>> Engine::decode_step(KvCache& cache, int32_t token) {
  return prefill(cache, std::span<const int32_t>(&token, 1));
}

Result<int32_t> Engine::prefill_greedy(KvCache& cache, std::span<const int32_t> tokens) {
  KEEP_ASSIGN_OR_RETURN(int32_t last_row, run_prefill(cache, tokens));
  backend_->final_logits(logits_.data(), hidden_.data(), &last_row, 1);
  int32_t token = 0;
  backend_->argmax(&token, logits_.data(), 1);
  return token;
}

Result<std::vector<int32_t>> Engine::generate(std::span<const int32_t> prompt,
                                              const GenerateOptions& options) {
  if (options.max_tokens < 0) return invalid("generate: negative max_tokens");
  KEEP_ASSIGN_OR_RETURN(KvCache cache,
                        KvCache::create(*backend_, static_cast<int32_t>(prompt.size()) +
                                                       std::max(options.max_tokens, 1)));
  // Greedy picks on the backend (a GPU copies back one int per token); sampling draws on the host
  // from the copied logits with the seeded Sampler, so a seed gives the same draws on any backend.
  const bool greedy = options.sampling.temperature <= 0.0f;
  std::vector<float> logits_host;
  int32_t next = 0;
  if (greedy) {
    KEEP_ASSIGN_OR_RETURN(next, prefill_greedy(cache, prompt));
  } else {
    KEEP_ASSIGN_OR_RETURN(logits_host, prefill(cache, prompt));
  }
  Sampler sampler(options.sampling);
  std::vector<int32_t> out;
  const auto& eos = config().eos_token_ids;
  for (int32_t i = 0; i < options.max_tokens; ++i) {
    const int32_t tok = greedy ? next : sampler.sample(logits_host);
    out.push_back(tok);
    if (options.stops_at(tok, eos) || i + 1 == options.max_tokens) break;
    if (greedy) {
      KEEP_ASSIGN_OR_RETURN(next, prefill_greedy(cache, std::span<const int32_t>(&tok, 1)));
    } else {
      KEEP_ASSIGN_OR_RETURN(logits_host, decode_step(cache, tok));
    }
  }
  return out;
}

Result<std::vector<CandidateScore>> Engine::score_candidates(
    std::span<const int32_t> prompt, const std::vector<std::vector<int32_t>>& candidates) {
  if (prompt.empty()) return invalid("score_candidates: empty prompt");
  const auto p = static_cast<int32_t>(prompt.size());
  int64_t total_rows = 0;
  for (const auto& c : candidates) total_rows += static_cast<int64_t>(c.size());
  if (p + total_rows > INT32_MAX / 4) return invalid("score_candidates: too many tokens");
  const auto rows = static_cast<int32_t>(total_rows);
  KEEP_ASSIGN_OR_RETURN(KvCache cache, KvCache::create(*backend_, p + std::max(rows, 1)));
  KEEP_ASSIGN_OR_RETURN(std::vector<float> last, prefill(cache, prompt));
  return score_after(cache, last, candidates);
}

Result<std::vector<CandidateScore>> Engine::score_after(
    KvCache& cache, std::span<const float> last,
    const std::vector<std::vector<int32_t>>& candidates) {
  const int32_t p = cache.size();
  if (p == 0) return invalid("score_candidates: empty prompt");
  if (last.size() != static_cast<size_t>(config().vocab_size)) {
    return invalid("score_candidates: the prompt's last logits are not one row of the vocabulary");
  }
  int64_t total_rows = 0;
  for (const auto& c : candidates) total_rows += static_cast<int64_t>(c.size());
  if (p + total_rows > cache.capacity()) {
    return invalid("score_candidates: " + std::to_string(total_rows) +
                   " candidate tokens after the prompt's " + std::to_string(p) +
                   " exceed the cache's " + std::to_string(cache.capacity()));
  }
  const auto rows = static_cast<int32_t>(total_rows);
  std::vector<CandidateScore> scores(candidates.size());
  if (rows == 0) return scores;

  // One block per candidate after the prompt; every candidate starts at position p.
  std::vector<int32_t> tokens;
  std::vector<KeySpan> blocks;
  int32_t slot = p;
  for (const auto& c : candidates) {
    if (c.empty()) continue;
    blocks.push_back({slot, slot + static_cast<int32_t>(c.size())});
    tokens.insert(tokens.end(), c.begin(), c.end());
    slot += static_cast<int32_t>(c.size());
  }
  AttentionLayout layout = AttentionLayout::blocks(p, blocks);
  for (size_t r = 0; r < layout.row_slot.size(); ++r) {
    for (const KeySpan& b : blocks) {
      if (layout.row_slot[r] >= b.begin && layout.row_slot[r] < b.end) {
        layout.row_position[r] = p + (layout.row_slot[r] - b.begin);
      }
    }
  }
  KEEP_RETURN_IF_ERROR(ensure_rows(rows));
  KEEP_RETURN_IF_ERROR(embed(hidden_, tokens));
  KEEP_ASSIGN_OR_RETURN(auto pl, plan(layout));
  for (int32_t l = 0; l < config().num_layers; ++l) {
    KEEP_RETURN_IF_ERROR(prefill_layer(l, hidden_, cache.layer(l), *pl));
  }
  // Rows predicting candidate tokens 1..len-1 are the rows of tokens 0..len-2; their log-probs are
  // taken on the backend, kLogitRows rows at a time.
  for (const auto& c : candidates) {
    for (int32_t t : c) {
      if (t < 0 || t >= config().vocab_size) return invalid("score_candidates: bad token id");
    }
  }
  std::vector<int32_t> need, target;
  for (size_t ci = 0, bi = 0; ci < candidates.size(); ++ci) {
    const auto& c = candidates[ci];
    if (c.empty()) continue;
    const KeySpan& b = blocks[bi++];
    for (int32_t s = b.begin; s + 1 < b.end; ++s) {
      need.push_back(s - p);
      target.push_back(c[static_cast<size_t>(s - b.begin + 1)]);
    }
  }
  std::vector<float> lp(need.size());
  for (size_t a = 0; a < need.size(); a += kLogitRows) {
    const auto m = static_cast<int32_t>(std::min<size_t>(kLogitRows, need.size() - a));
    backend_->final_logits(logits_.data(), hidden_.data(), need.data() + a, m);
    backend_->token_logprob(lp.data() + a, logits_.data(), target.data() + a, m);
  }
  size_t at = 0;
  for (size_t ci = 0; ci < candidates.size(); ++ci) {
    const auto& c = candidates[ci];
    scores[ci].tokens = static_cast<int32_t>(c.size());
    if (c.empty()) continue;
    double s = log_prob(last, c[0]);
    for (size_t i = 1; i < c.size(); ++i) s += lp[at++];
    scores[ci].log_prob = s;
  }
  return scores;
}

}  // namespace keep::engine
