#include "benchmarks/manager/preload_snapshot.h"

#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>

#include "benchmarks/manager/bench_support.h"
#include "services/manager/durability/snapshot_file.h"
#include "services/manager/store/memory_store.h"
#include "shared/tokenizer/bpe_tokenizer.h"

namespace keep::bench {
namespace {

// Sum of one pseudo-random vector per (lower-cased) word: texts that share words are close.
class HashedBowEmbedder final : public manager::Embedder {
 public:
  explicit HashedBowEmbedder(int dim) : dim_(dim) {}
  int dim() const override { return dim_; }
  Result<std::vector<std::vector<float>>> embed(const std::vector<std::string>& texts) override {
    std::vector<std::vector<float>> out;
    out.reserve(texts.size());
    for (const auto& t : texts) {
      std::vector<float> v(static_cast<size_t>(dim_), 0.0f);
      size_t i = 0;
      while (i < t.size()) {
        while (i < t.size() && !std::isalnum(static_cast<unsigned char>(t[i]))) ++i;
        uint64_t h = 1469598103934665603ull;
        size_t start = i;
        while (i < t.size() && std::isalnum(static_cast<unsigned char>(t[i]))) {
          h = (h ^ static_cast<uint64_t>(std::tolower(static_cast<unsigned char>(t[i])))) *
              1099511628211ull;
          ++i;
        }
        if (i == start) continue;
        for (int d = 0; d < dim_; ++d) {
          h ^= h >> 33;
          h *= 0xff51afd7ed558ccdull;
          h ^= h >> 33;
          v[static_cast<size_t>(d)] +=
              static_cast<float>(static_cast<int64_t>(h >> 11) - (int64_t{1} << 52)) *
              (1.0f / static_cast<float>(int64_t{1} << 52));
        }
      }
      out.push_back(std::move(v));
    }
    return out;
  }

 private:
  int dim_;
};

class Counter final : public manager::TokenCounter {
 public:
  explicit Counter(tok::BpeTokenizer t) : t_(std::move(t)) {}
  uint32_t count_tokens(std::string_view text) const override {
    return static_cast<uint32_t>(t_.count_tokens(text));
  }

 private:
  tok::BpeTokenizer t_;
};

}  // namespace

struct PreloadedStore::Impl {
  Impl(tok::BpeTokenizer t, int dim)
      : counter(std::move(t)), embedder(dim), store(manager::StoreOptions{}, &embedder, &counter) {}
  Counter counter;
  HashedBowEmbedder embedder;
  manager::MemoryStore store;  // the manager's defaults (tau, token budget, t)
  double build_s = 0;
  uint64_t groups = 0;
};

PreloadedStore::PreloadedStore() = default;
PreloadedStore::~PreloadedStore() = default;
manager::MemoryStore& PreloadedStore::store() { return impl_->store; }
double PreloadedStore::build_s() const { return impl_->build_s; }
uint64_t PreloadedStore::groups() const { return impl_->groups; }

Result<std::unique_ptr<PreloadedStore>> build_store(const PreloadOptions& o) {
  using C = std::chrono::steady_clock;
  auto t0 = C::now();
  KEEP_ASSIGN_OR_RETURN(auto tok, tok::BpeTokenizer::from_json_file(o.tokenizer_path));
  std::unique_ptr<PreloadedStore> pre(new PreloadedStore());
  pre->impl_ = std::make_unique<PreloadedStore::Impl>(std::move(tok), o.dim);
  manager::MemoryStore& store = pre->impl_->store;
  HashedBowEmbedder& embedder = pre->impl_->embedder;
  TextGenerator gen(12345);
  std::string rec;
  for (uint64_t i = 0; i < o.memories; ++i) {
    manager::WriteRequest w;
    w.agent = o.agent;
    client::SegmentKind kind;
    w.text = gen.next(&kind);
    w.kind = kind == client::SegmentKind::kTaskRecord ? manager::SegmentKind::kTaskRecord
                                                      : manager::SegmentKind::kObjectState;
    KEEP_RETURN_IF_ERROR(store.write(w, &rec).status());
    if ((i + 1) % 1024 == 0 || i + 1 == o.memories) {
      auto pending = store.pending_embeddings(2048);
      std::vector<std::string> texts;
      for (const auto& p : pending) texts.push_back(p.text);
      KEEP_ASSIGN_OR_RETURN(auto vecs, embedder.embed(texts));
      std::vector<manager::SegmentEmbedding> embs;
      for (size_t j = 0; j < pending.size(); ++j) {
        embs.push_back({pending[j].agent, pending[j].id, pending[j].version, std::move(vecs[j])});
      }
      KEEP_RETURN_IF_ERROR(store.apply_embeddings(embs, &rec).status());
    }
  }
  if (o.advance_steps > 0)
    KEEP_RETURN_IF_ERROR(store.advance_step(o.agent, o.advance_steps, &rec).status());
  auto st = store.stats();
  if (st.pending_embeddings != 0) {
    return Status(Code::kInternal, std::to_string(st.pending_embeddings) + " embeddings left");
  }
  pre->impl_->groups = st.groups_static + st.groups_dynamic;
  pre->impl_->build_s = std::chrono::duration<double>(C::now() - t0).count();
  return pre;
}

Result<PreloadInfo> preload_snapshot(const std::string& data_dir, const PreloadOptions& o) {
  using C = std::chrono::steady_clock;
  KEEP_ASSIGN_OR_RETURN(auto pre, build_store(o));
  PreloadInfo info;
  info.groups = pre->groups();
  info.build_s = pre->build_s();
  auto t1 = C::now();
  const std::string payload = pre->store().serialize();
  const std::string dir = data_dir + "/snapshots";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status(Code::kIoError, "create " + dir + ": " + ec.message());
  KEEP_ASSIGN_OR_RETURN(auto w, manager::write_snapshot(dir, 0, payload, false));
  info.bytes = w.bytes;
  info.snapshot_s = std::chrono::duration<double>(C::now() - t1).count();
  return info;
}

}  // namespace keep::bench
