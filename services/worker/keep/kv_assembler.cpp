#include "services/worker/keep/kv_assembler.h"

#include <algorithm>
#include <chrono>
#include <iterator>
#include <numeric>
#include <string>

#include "services/worker/keep/load_schedule.h"

namespace keep::worker {
namespace {

Status invalid(const std::string& msg) {
  return Status(Code::kInvalidArgument, "kv assembly: " + msg);
}

// A run of consecutive loaded slots inside one segment.
struct LoadRun {
  int32_t slot = 0;
  int32_t count = 0;
  int32_t segment = 0;
};

std::vector<LoadRun> load_runs(const std::vector<int32_t>& slots, const PromptShape& shape) {
  std::vector<LoadRun> runs;
  size_t seg = 0;
  for (int32_t slot : slots) {
    while (shape.segments[seg].end <= slot) ++seg;
    if (!runs.empty() && runs.back().segment == static_cast<int32_t>(seg) &&
        runs.back().slot + runs.back().count == slot) {
      ++runs.back().count;
    } else {
      runs.push_back({slot, 1, static_cast<int32_t>(seg)});
    }
  }
  return runs;
}

// Where each of `now`'s slots is in `rows` (both ascending). The computed rows only shrink from
// layer to layer (RecomputePlan); a slot of `now` missing from `rows` is the plan's bug, reported.
Result<std::vector<int32_t>> positions_in(const std::vector<int32_t>& rows,
                                          const std::vector<int32_t>& now) {
  std::vector<int32_t> at(now.size());
  size_t i = 0;
  for (size_t k = 0; k < now.size(); ++k) {
    while (i < rows.size() && rows[i] < now[k]) ++i;
    if (i == rows.size() || rows[i] != now[k]) {
      return Status(Code::kInternal, "kv assembly: slot " + std::to_string(now[k]) +
                                         " is computed at a layer after one that did not");
    }
    at[k] = static_cast<int32_t>(i);
  }
  return at;
}

}  // namespace

Result<std::unique_ptr<KvAssembler>> KvAssembler::create(engine::Engine& engine,
                                                         std::vector<int32_t> prefix,
                                                         int32_t capacity) {
  if (prefix.empty()) return invalid("the system prefix is empty");
  if (capacity <= static_cast<int32_t>(prefix.size())) {
    return invalid("capacity " + std::to_string(capacity) + " leaves no room after the prefix of " +
                   std::to_string(prefix.size()) + " tokens");
  }
  KEEP_ASSIGN_OR_RETURN(engine::KvCache cache, engine::KvCache::create(engine.backend(), capacity));
  KEEP_RETURN_IF_ERROR(engine.prefill(cache, prefix).status().with_context("system prefix"));
  std::unique_ptr<KvAssembler> a(new KvAssembler(engine, std::move(cache), std::move(prefix)));
  a->exact_ = a->prefix_;
  KEEP_RETURN_IF_ERROR(a->ensure_buffers());
  return a;
}

Status KvAssembler::ensure_buffers() {
  if (!hidden_[0].empty()) return Status::ok();
  const auto& cfg = engine_.config();
  const size_t n = static_cast<size_t>(cache_.capacity());
  for (auto& h : hidden_) {
    KEEP_ASSIGN_OR_RETURN(h, engine_.backend().allocate(n * cfg.hidden_size));
  }
  KEEP_ASSIGN_OR_RETURN(k_pre_, engine_.backend().allocate(n * cfg.kv_dim()));
  KEEP_ASSIGN_OR_RETURN(v_, engine_.backend().allocate(n * cfg.kv_dim()));
  return Status::ok();
}

Result<Prefilled> KvAssembler::prefill(const AssembleRequest& req) {
  production_.reset();  // the working cache is about to be overwritten
  const auto& cfg = engine_.config();
  const int32_t layers = static_cast<int32_t>(cfg.num_layers);
  const size_t kvd = static_cast<size_t>(cfg.kv_dim());
  const size_t hid = static_cast<size_t>(cfg.hidden_size);
  engine::Backend& be = engine_.backend();

  // ---- the prompt and its shape ----
  std::vector<int32_t> tokens = prefix_;
  PromptShape shape;
  Prefilled out;
  AssembleStats& st = out.stats;
  for (size_t i = 0; i < req.segments.size(); ++i) {
    const PromptSegment& s = req.segments[i];
    if (s.tokens.empty()) return invalid("segment " + std::to_string(i) + " has no tokens");
    SegmentSlots slots;
    slots.begin = static_cast<int32_t>(tokens.size());
    tokens.insert(tokens.end(), s.tokens.begin(), s.tokens.end());
    slots.end = static_cast<int32_t>(tokens.size());
    slots.loadable = !s.kv.bytes.empty();
    if (slots.loadable) {
      const EntryGeometry& g = s.kv.geometry;
      if (g.layers != layers || g.row_elems() != kvd || s.kv.first_row < 0 ||
          s.kv.first_row > g.tokens - slots.tokens() || s.kv.bytes.size() < g.bytes()) {
        return invalid("segment " + std::to_string(i) + ": its KV entry does not match the model " +
                       "or the segment's " + std::to_string(slots.tokens()) + " tokens");
      }
      ++st.segments_loadable;
    }
    shape.segments.push_back(slots);
  }
  if (req.query.empty()) return invalid("the prompt needs query tokens after the memory");
  tokens.insert(tokens.end(), req.query.begin(), req.query.end());
  shape.total = static_cast<int32_t>(tokens.size());
  if (shape.total > cache_.capacity()) {
    return Status(Code::kResourceExhausted,
                  "kv assembly: the prompt has " + std::to_string(shape.total) +
                      " tokens, the working cache " + std::to_string(cache_.capacity()));
  }
  shape.cached_prefix = static_cast<int32_t>(prefix_.size());
  if (req.method == Method::kPrefix) {
    // The longest exactly computed prefix of the last prompt; the last token is always computed.
    const size_t n = std::min(exact_.size(), tokens.size() - 1);
    size_t lcp = 0;
    while (lcp < n && exact_[lcp] == tokens[lcp]) ++lcp;
    shape.cached_prefix = static_cast<int32_t>(std::max(lcp, prefix_.size()));
  }
  st.prompt_tokens = shape.total;
  st.memory_tokens = shape.memory_tokens();
  // `prefix` reuses slots whatever they hold, segments included: no segment is memory to it.
  int32_t memory_reused = 0;
  if (req.method == Method::kPrefix) {
    for (const auto& s : shape.segments) {
      memory_reused += std::clamp(shape.cached_prefix - s.begin, 0, s.tokens());
    }
    shape.segments.clear();
  }
  KEEP_ASSIGN_OR_RETURN(RecomputePlan plan,
                        RecomputePlan::create(req.method, shape, layers, req.knobs));
  st.cached_prefix = req.method == Method::kFull ? 0 : shape.cached_prefix;

  const int32_t groups = static_cast<int32_t>(shape.segments.size());
  std::vector<int32_t> key_group;
  if (req.method == Method::kKeep && groups > 0) {
    key_group.assign(static_cast<size_t>(shape.total), -1);
    for (int32_t g = 0; g < groups; ++g) {
      std::fill(key_group.begin() + shape.segments[g].begin,
                key_group.begin() + shape.segments[g].end, g);
    }
    if (pooled_columns_ < static_cast<size_t>(groups)) {
      KEEP_ASSIGN_OR_RETURN(pooled_, be.allocate(static_cast<size_t>(cache_.capacity()) * groups));
      pooled_columns_ = static_cast<size_t>(groups);
    }
  }
  const int32_t memory_end = groups > 0 ? shape.segments.back().end : shape.cached_prefix;

  // ---- layer by layer ----
  int cur = 0;
  std::vector<int32_t> rows = plan.rows();
  {
    std::vector<int32_t> row_tokens(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) row_tokens[r] = tokens[rows[r]];
    KEEP_RETURN_IF_ERROR(engine_.embed(hidden_[cur], row_tokens));
  }
  std::unique_ptr<engine::AttentionPlan> attn;
  // keep: the segment of each pooled column under the current layout (its candidates).
  std::vector<int32_t> columns;
  int32_t first_loaded = shape.total;  // the earliest slot ever loaded: exactness ends there
  std::vector<float> k_host, v_host, k_new;
  // Layer-balanced loading: a slot loaded at layer l is loaded at every later layer (the
  // recomputed set only shrinks), so each layer's newly loaded slots form a cohort whose
  // layers LoadSchedule queues beside the compute. Entries not stored as bf16 load layer by
  // layer on the compute stream.
  LoadSchedule schedule(layers, load_options_.queue ? load_options_.prefetch_bytes : 0);
  std::vector<std::vector<LoadRun>> cohorts;
  std::vector<LoadRun> f32_runs;
  std::vector<int32_t> loaded_before;
  std::vector<engine::Backend::KvRun> batch;
  std::vector<LoadRun> batch_runs;  // what each run of `batch` loads
  engine_.fence_queue();
  // Loads may still be in flight when a layer fails: let them land before the cache is reused.
  struct SyncOnExit {
    engine::Backend& be;
    bool armed = true;
    ~SyncOnExit() {
      if (armed) be.synchronize();
    }
  } sync_on_error{be};
  for (int32_t l = 0; l < layers; ++l) {
    const std::vector<int32_t>& now = plan.rows();
    if (now != rows) {  // a subset: move the surviving rows' hidden states down
      const int next = 1 - cur;
      KEEP_ASSIGN_OR_RETURN(const std::vector<int32_t> keep_rows, positions_in(rows, now));
      be.gather_rows(hidden_[next].data(), hidden_[cur].data(), keep_rows.data(),
                     static_cast<int32_t>(keep_rows.size()), hid);
      cur = next;
      rows = now;
      attn.reset();
    }
    if (!attn) {
      engine::AttentionLayout layout = engine::AttentionLayout::recompute(rows, shape.total);
      if (!key_group.empty()) {
        // A column only for each segment computed here: importance reads no other, and as the
        // selection shrinks fewer columns keep the pooling inside the attention pass (at most
        // kernels::kPoolFusedMaxGroups on CUDA) and the copy to the host small.
        if (pool_every_segment_) {
          columns.resize(static_cast<size_t>(groups));
          std::iota(columns.begin(), columns.end(), 0);
        } else {
          columns = plan.segments_computed();
        }
        std::vector<int32_t> column_of(static_cast<size_t>(groups), -1);
        for (size_t c = 0; c < columns.size(); ++c) column_of[columns[c]] = static_cast<int32_t>(c);
        std::vector<int32_t> key_column(key_group.size(), -1);
        for (size_t t = 0; t < key_group.size(); ++t) {
          if (key_group[t] >= 0) key_column[t] = column_of[key_group[t]];
        }
        if (!columns.empty()) {
          layout.set_groups(std::move(key_column), static_cast<int32_t>(columns.size()));
        }
      }
      KEEP_ASSIGN_OR_RETURN(attn, engine_.plan(layout));
    }
    const engine::KvView view = cache_.layer(l);

    // This layer's newly loaded slots: a cohort (bf16 entries) or layer-by-layer runs (fp32).
    const std::vector<int32_t> loaded = plan.loaded_memory_slots();
    if (!std::includes(loaded.begin(), loaded.end(), loaded_before.begin(), loaded_before.end())) {
      return Status(Code::kInternal, "kv assembly: a slot loaded at layer " +
                                         std::to_string(l - 1) + " is computed again at layer " +
                                         std::to_string(l));
    }
    std::vector<int32_t> fresh;
    std::set_difference(loaded.begin(), loaded.end(), loaded_before.begin(), loaded_before.end(),
                        std::back_inserter(fresh));
    loaded_before = loaded;
    if (!fresh.empty()) {
      std::vector<LoadRun> cohort;
      uint64_t cohort_bytes = 0;
      for (const LoadRun& run : load_runs(fresh, shape)) {
        const SegmentKv& kv = req.segments[run.segment].kv;
        const int32_t row = kv.first_row + (run.slot - shape.segments[run.segment].begin);
        first_loaded = std::min(first_loaded, run.slot);
        if (entry_rows_bf16(kv.bytes, kv.geometry, l, row, run.count)) {
          cohort.push_back(run);
          cohort_bytes += 2 * static_cast<uint64_t>(run.count) * kvd * kv.geometry.elem_bytes();
        } else {
          f32_runs.push_back(run);
        }
      }
      if (!cohort.empty()) {
        schedule.add_cohort(l, cohort_bytes);
        cohorts.push_back(std::move(cohort));
      }
    }
    batch.clear();
    batch_runs.clear();
    // A layer recomputing memory rows may let queued loads run further ahead; else the
    // schedule's own budget (prefetch_bytes, or none for loads not queued).
    const bool recomputing_memory =
        std::any_of(rows.begin(), rows.end(), [&](int32_t r) { return r < memory_end; });
    const std::vector<LoadSchedule::Item> items =
        load_options_.queue && recomputing_memory
            ? schedule.before_layer(l, load_options_.prefetch_bytes_recomputing)
            : schedule.before_layer(l);
    for (const LoadSchedule::Item& item : items) {
      const engine::KvView target = cache_.layer(item.layer);
      for (const LoadRun& run : cohorts[static_cast<size_t>(item.cohort)]) {
        const SegmentKv& kv = req.segments[run.segment].kv;
        const int32_t row = kv.first_row + (run.slot - shape.segments[run.segment].begin);
        const auto planes = entry_rows_bf16(kv.device.empty() ? kv.bytes : kv.device, kv.geometry,
                                            item.layer, row, run.count);
        if (!planes) return Status(Code::kInternal, "kv assembly: a bf16 entry lost its planes");
        batch.push_back({target, item.layer, run.slot, run.count, planes->first, planes->second});
        batch_runs.push_back(run);
        st.bytes_loaded += 2 * static_cast<uint64_t>(run.count) * kvd * kv.geometry.elem_bytes();
      }
    }
    if (!load_options_.position_correction) {
      // Ablation: each row rotated to where it was produced, [prefix][entry rows], not to its
      // slot in this prompt.
      for (size_t b = 0; b < batch.size(); ++b) {
        const LoadRun& run = batch_runs[b];
        const SegmentKv& kv = req.segments[run.segment].kv;
        const int32_t row = kv.first_row + (run.slot - shape.segments[run.segment].begin);
        std::vector<int32_t> positions(static_cast<size_t>(run.count));
        for (int32_t k = 0; k < run.count; ++k) {
          positions[k] = static_cast<int32_t>(prefix_.size()) + row + k;
        }
        KEEP_RETURN_IF_ERROR(engine_.load_kv_bf16(batch[b].kv, batch[b].first_slot, positions,
                                                  batch[b].k_pre, batch[b].v));
      }
    } else if (load_options_.queue) {
      KEEP_RETURN_IF_ERROR(engine_.queue_kv_bf16_runs(batch));
      engine_.wait_queued(l);
    } else {
      KEEP_RETURN_IF_ERROR(engine_.load_kv_bf16_runs(batch));
    }
    for (const LoadRun& run : f32_runs) {
      const SegmentKv& kv = req.segments[run.segment].kv;
      const size_t n = static_cast<size_t>(run.count) * kvd;
      const int32_t row = kv.first_row + (run.slot - shape.segments[run.segment].begin);
      std::vector<int32_t> positions(static_cast<size_t>(run.count));
      for (int32_t k = 0; k < run.count; ++k) positions[k] = run.slot + k;
      k_host.resize(n);
      v_host.resize(n);
      KEEP_RETURN_IF_ERROR(
          read_entry_layer(kv.bytes, kv.geometry, l, row, run.count, k_host.data(), v_host.data()));
      KEEP_RETURN_IF_ERROR(
          engine_.load_kv(view, run.slot, positions, k_host.data(), v_host.data()));
      st.bytes_loaded += 2 * n * kv.geometry.elem_bytes();
    }

    const RecomputePlan::Check check = plan.check();
    // keep's importance: the pooled attention of this layer decides the segments computed at the
    // next one (RecomputePlan::next).
    auto decide = [&]() -> Status {
      // The pooled columns as the backend made them (importance reads them in place).
      const size_t ncol = columns.size();
      // What does not need the pooled columns is made before waiting for them (the host is
      // usually ahead of the GPU here), so that less is left between their arrival and the choice.
      const std::vector<int32_t> row_segment = plan.row_segments();
      std::vector<int32_t> query_rows;
      for (size_t r = 0; r < rows.size(); ++r) {
        if (rows[r] >= memory_end) query_rows.push_back(static_cast<int32_t>(r));
      }
      // Kept across checks and requests: a fresh vector would fault its pages in at each check,
      // inside the layer's path when the rows are chosen early.
      pooled_host_.resize(std::max(pooled_host_.size(), rows.size() * ncol));
      const std::span<float> pooled(pooled_host_.data(), rows.size() * ncol);
      const auto t0 = std::chrono::steady_clock::now();
      KEEP_RETURN_IF_ERROR(engine_.read_pooled(pooled.data(), pooled_, pooled.size()));
      const auto t1 = std::chrono::steady_clock::now();
      ImportanceInput in{
          groups, static_cast<int32_t>(cfg.num_heads), pooled, row_segment, query_rows, columns};
      st.check_layers.push_back(l);
      st.pooled_columns.push_back(static_cast<int32_t>(ncol));
      KEEP_RETURN_IF_ERROR(plan.next(&in));
      const auto us = [](auto a, auto b) {
        return std::chrono::duration<double, std::micro>(b - a).count();
      };
      st.check_wait_us.push_back(us(t0, t1));
      st.check_decide_us.push_back(us(t1, std::chrono::steady_clock::now()));
      return Status::ok();
    };
    engine::LayerExtras extras;
    bool chosen = false;
    // Chosen inside the layer: the MLP runs only for the rows that go on to the next layer.
    const bool choose =
        check == RecomputePlan::Check::kImportance && choose_early_ && l + 1 < layers;
    if (check == RecomputePlan::Check::kImportance) {
      extras.pooled = &pooled_;
      // Decided on the host while the GPU runs the layer's o_proj (choose) or its MLP.
      extras.pooled_to_host = true;
    }
    if (choose) {
      extras.choose_rows = [&]() -> Result<std::vector<int32_t>> {
        KEEP_RETURN_IF_ERROR(decide());
        chosen = true;
        return positions_in(rows, plan.rows());
      };
      extras.chosen_hidden = &hidden_[1 - cur];
    }
    if (check == RecomputePlan::Check::kDeviation) extras.k_pre = &k_pre_;
    if (l + 1 == layers) extras.out_rows = 1;  // only the last token's output is wanted
    KEEP_RETURN_IF_ERROR(engine_.prefill_layer(l, hidden_[cur], view, *attn, extras));

    if (choose) {  // the next layer's rows are packed in the other buffer already
      if (!chosen) {
        return Status(Code::kInternal,
                      "kv assembly: layer " + std::to_string(l) + " ran without choosing its rows");
      }
      cur = 1 - cur;
      st.mlp_rows_skipped += static_cast<int64_t>(rows.size() - plan.rows().size());
      rows = plan.rows();
      attn.reset();
    } else if (check == RecomputePlan::Check::kImportance) {
      KEEP_RETURN_IF_ERROR(decide());
    } else if (check == RecomputePlan::Check::kDeviation) {
      // Σ (K_new − K_cached)² per loadable memory row, against the entry's K of this layer.
      k_new.resize(rows.size() * kvd);
      be.copy_to_host(k_new.data(), k_pre_.data(), k_new.size());
      std::vector<float> deviation(rows.size(), 0.0f);
      const std::vector<int32_t> row_segment = plan.row_segments();
      k_host.resize(kvd);
      v_host.resize(kvd);
      for (size_t r = 0; r < rows.size(); ++r) {
        if (row_segment[r] < 0 || !shape.segments[row_segment[r]].loadable) continue;
        const SegmentKv& kv = req.segments[row_segment[r]].kv;
        const int32_t row = kv.first_row + (rows[r] - shape.segments[row_segment[r]].begin);
        KEEP_RETURN_IF_ERROR(
            read_entry_layer(kv.bytes, kv.geometry, l, row, 1, k_host.data(), v_host.data()));
        double d = 0;
        for (size_t e = 0; e < kvd; ++e) {
          const double diff = static_cast<double>(k_new[r * kvd + e]) - k_host[e];
          d += diff * diff;
        }
        deviation[r] = static_cast<float>(d);
      }
      st.check_layers.push_back(l);
      KEEP_RETURN_IF_ERROR(plan.next(nullptr, deviation));
    } else {
      KEEP_RETURN_IF_ERROR(plan.next());
    }
  }

  const int32_t last = static_cast<int32_t>(rows.size()) - 1;
  KEEP_ASSIGN_OR_RETURN(out.last_logits,
                        engine_.logits(hidden_[cur], std::span<const int32_t>(&last, 1)));
  sync_on_error.armed = false;  // every load was waited for by its layer, the logits after them
  cache_.set_size(shape.total);
  exact_.assign(tokens.begin(), tokens.begin() + first_loaded);
  st.recomputed_per_layer = plan.memory_rows_per_layer();
  st.recompute_ratio = plan.recompute_ratio();
  if (req.method == Method::kPrefix) {
    st.recomputed_per_layer.assign(static_cast<size_t>(layers), st.memory_tokens - memory_reused);
    st.recompute_ratio =
        st.memory_tokens == 0 ? 1.0 : 1.0 - static_cast<double>(memory_reused) / st.memory_tokens;
  }
  st.hops = plan.hops();
  return out;
}

Result<std::vector<int32_t>> KvAssembler::generate(const Prefilled& prefilled,
                                                   const engine::GenerateOptions& options) {
  if (options.max_tokens < 0) return invalid("negative max_tokens");
  if (cache_.size() + options.max_tokens > cache_.capacity()) {
    return Status(Code::kResourceExhausted,
                  "kv assembly: " + std::to_string(options.max_tokens) +
                      " new tokens after the prompt's " + std::to_string(cache_.size()) +
                      " exceed the working cache's " + std::to_string(cache_.capacity()));
  }
  const auto& eos = engine_.config().eos_token_ids;
  const bool greedy = options.sampling.temperature <= 0.0f;
  engine::Sampler sampler(options.sampling);
  std::vector<float> logits = prefilled.last_logits;
  std::vector<int32_t> out;
  for (int32_t i = 0; i < options.max_tokens; ++i) {
    const int32_t tok = greedy ? engine::argmax(logits) : sampler.sample(logits);
    out.push_back(tok);
    if (options.stops_at(tok, eos) || i + 1 == options.max_tokens) break;
    KEEP_ASSIGN_OR_RETURN(logits, engine_.decode_step(cache_, tok));
  }
  return out;
}

Result<std::vector<engine::CandidateScore>> KvAssembler::score(
    const Prefilled& prefilled, const std::vector<std::vector<int32_t>>& candidates) {
  return engine_.score_after(cache_, prefilled.last_logits, candidates);
}

Status KvAssembler::produce(std::span<const int32_t> tokens, const LayerSink& sink) {
  KEEP_RETURN_IF_ERROR(begin_produce(tokens));
  KEEP_ASSIGN_OR_RETURN(bool done, produce_layers(engine_.config().num_layers, sink));
  (void)done;
  return Status::ok();
}

KvAssembler::LayerSink KvAssembler::entry_writer(std::span<std::byte> entry,
                                                 const EntryGeometry& g) {
  return [entry, g](int32_t layer, const float* k, const float* v) {
    return write_entry_layer(entry, g, layer, 0, g.tokens, k, v);
  };
}

Status KvAssembler::begin_produce(std::span<const int32_t> tokens) {
  production_.reset();
  const auto p = static_cast<int32_t>(prefix_.size());
  const auto n = static_cast<int32_t>(tokens.size());
  if (n == 0) return invalid("nothing to produce");
  if (p + n > cache_.capacity()) {
    return Status(Code::kResourceExhausted, "kv production: " + std::to_string(n) +
                                                " tokens after the prefix exceed the cache's " +
                                                std::to_string(cache_.capacity()));
  }
  // The slots after the prefix are overwritten: only the prefix stays exact.
  exact_ = prefix_;
  cache_.set_size(p);
  KEEP_RETURN_IF_ERROR(engine_.embed(hidden_[0], tokens));
  Production prod;
  prod.tokens = n;
  if (produce_options_.with_prefix) {
    KEEP_ASSIGN_OR_RETURN(prod.plan, engine_.plan(engine::AttentionLayout::causal(n, p)));
  } else {  // ablation: the tokens see only each other, at the same positions
    engine::AttentionLayout l;
    l.num_keys = p + n;
    for (int32_t i = 0; i < n; ++i) {
      l.row_slot.push_back(p + i);
      l.row_position.push_back(p + i);
      l.span_offsets.push_back(i);
      l.spans.push_back({p, p + i + 1});
    }
    l.span_offsets.push_back(n);
    KEEP_ASSIGN_OR_RETURN(prod.plan, engine_.plan(l));
  }
  production_ = std::move(prod);
  return Status::ok();
}

Result<bool> KvAssembler::produce_layers(int32_t layers, const LayerSink& sink) {
  if (!production_) return invalid("no production under way (begin_produce)");
  Production& prod = *production_;
  const auto& cfg = engine_.config();
  const size_t floats = static_cast<size_t>(prod.tokens) * cfg.kv_dim();
  std::vector<float> k(floats), v(floats);
  for (int32_t i = 0; i < layers && prod.next_layer < cfg.num_layers; ++i) {
    const int32_t l = prod.next_layer;
    engine::LayerExtras extras;
    extras.k_pre = &k_pre_;
    extras.v = &v_;
    if (l + 1 == cfg.num_layers) extras.out_rows = 0;  // K and V only
    Status st = engine_.prefill_layer(l, hidden_[0], cache_.layer(l), *prod.plan, extras);
    if (st.is_ok()) {
      engine_.backend().copy_to_host(k.data(), k_pre_.data(), floats);
      engine_.backend().copy_to_host(v.data(), v_.data(), floats);
      st = sink(l, k.data(), v.data());
    }
    if (!st.is_ok()) {
      production_.reset();
      return st;
    }
    ++prod.next_layer;
  }
  if (prod.next_layer < cfg.num_layers) return false;
  production_.reset();
  return true;
}

}  // namespace keep::worker
