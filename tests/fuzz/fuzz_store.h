// A MemoryStore for the fuzz targets: a deterministic 8-dimensional embedder (one-hot on the first
// byte) and a token counter of one token per four bytes, so no model is needed.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "services/manager/store/embedder.h"
#include "services/manager/store/memory_store.h"

namespace keep::fuzz {

class FuzzEmbedder : public keep::manager::Embedder {
 public:
  static constexpr int kDim = 8;
  int dim() const override { return kDim; }
  keep::Result<std::vector<std::vector<float>>> embed(
      const std::vector<std::string>& texts) override {
    std::vector<std::vector<float>> out;
    for (const auto& t : texts) {
      std::vector<float> v(kDim, 0.0f);
      v[t.empty() ? 0 : static_cast<unsigned char>(t[0]) % kDim] = 1.0f;
      out.push_back(std::move(v));
    }
    return out;
  }
};

class FuzzCounter : public keep::manager::TokenCounter {
 public:
  uint32_t count_tokens(std::string_view text) const override {
    return static_cast<uint32_t>(text.size() / 4 + 1);
  }
};

}  // namespace keep::fuzz
