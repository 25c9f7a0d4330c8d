// Test helpers that write Hugging Face model directories: safetensors files from raw tensors,
// dtype conversions of a tensor view, and whole random-weight checkpoints in the HF layout
// (config.json, shards, model.safetensors.index.json) for any Qwen2/Llama config.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shared/model/hf_loader.h"
#include "shared/model/model_config.h"
#include "shared/safetensors/safetensors_reader.h"

namespace keep::testing {

struct RawTensor {
  std::string dtype;  // "F32", "F16", "BF16"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline void write_safetensors(const std::string& path, const std::map<std::string, RawTensor>& ts) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t off = 0;
  for (const auto& [name, t] : ts) {
    header[name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  const std::string h = header.dump();
  const uint64_t n = h.size();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& [name, t] : ts) {
    out.write(reinterpret_cast<const char*>(t.bytes.data()),
              static_cast<std::streamsize>(t.bytes.size()));
  }
}

// fp32 -> fp16 bits for values that are exactly representable as normal halves (checked).
inline uint16_t exact_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  const uint16_t h =
      static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((u >> 13) & 0x3FFu));
  REQUIRE(exp > 0);
  REQUIRE(exp < 31);
  REQUIRE(keep::safetensors::fp16_to_fp32(h) == f);
  return h;
}

// bf16 values (uint16 bits) as a tensor of `dtype`: BF16 as is, F32 widened, F16 exactly (values
// must be representable: exact_half checks).
inline RawTensor from_bf16(const std::vector<uint16_t>& bits, std::vector<int64_t> shape,
                           const std::string& dtype) {
  RawTensor r{dtype, std::move(shape), {}};
  for (uint16_t b : bits) {
    if (dtype == "BF16") {
      r.bytes.push_back(static_cast<uint8_t>(b & 0xFF));
      r.bytes.push_back(static_cast<uint8_t>(b >> 8));
      continue;
    }
    const float f = keep::safetensors::bf16_to_fp32(b);
    if (dtype == "F32") {
      uint8_t x[4];
      std::memcpy(x, &f, 4);
      r.bytes.insert(r.bytes.end(), x, x + 4);
    } else {
      const uint16_t h = exact_half(f);
      r.bytes.push_back(static_cast<uint8_t>(h & 0xFF));
      r.bytes.push_back(static_cast<uint8_t>(h >> 8));
    }
  }
  return r;
}

inline RawTensor as_dtype(const keep::safetensors::TensorView& v, const std::string& dtype) {
  REQUIRE(v.dtype == keep::safetensors::DType::kBF16);
  std::vector<uint16_t> bits(v.bytes / 2);
  std::memcpy(bits.data(), v.data, v.bytes);
  return from_bf16(bits, v.shape, dtype);
}

class TempDir {
 public:
  explicit TempDir(const std::string& stem)
      : path_("/tmp/keep_test_hf_" + std::to_string(::getpid()) + "_" + stem) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A Qwen2 config.json of the given sizes (untied, q/k/v biases: Qwen2's).
inline nlohmann::json qwen2_config(int64_t hidden, int64_t intermediate, int64_t layers,
                                   int64_t heads, int64_t kv_heads, int64_t vocab) {
  return {{"architectures", {"Qwen2ForCausalLM"}},
          {"model_type", "qwen2"},
          {"hidden_size", hidden},
          {"intermediate_size", intermediate},
          {"num_hidden_layers", layers},
          {"num_attention_heads", heads},
          {"num_key_value_heads", kv_heads},
          {"vocab_size", vocab},
          {"max_position_embeddings", 4096},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 10000.0},
          {"tie_word_embeddings", false},
          {"bos_token_id", 0},
          {"eos_token_id", 1},
          {"hidden_act", "silu"}};
}

// Writes `config` and random weights for it in the HF layout, split over `shards` files of about
// equal size (the index lists them); dtype_of(name) picks each tensor's dtype ("BF16" when
// empty). Values are bf16 numbers exactly representable in fp16 (norm weights near 1, others
// small), so every dtype holds the same values. Deterministic in `seed`.
inline void write_random_hf_dir(const std::string& dir, const nlohmann::json& config, int shards,
                                const std::function<std::string(const std::string&)>& dtype_of,
                                uint32_t seed) {
  std::ofstream(dir + "/config.json") << config.dump(2);
  auto cfg = keep::engine::load_hf_config(dir + "/config.json");
  REQUIRE_MESSAGE(cfg.is_ok(), cfg.status().to_string());
  const auto table = keep::engine::hf_weight_table(*cfg);
  uint64_t total = 0;
  for (const auto& w : table) {
    int64_t n = 1;
    for (int64_t d : w.shape) n *= d;
    total += static_cast<uint64_t>(n) * 2;
  }
  const uint64_t per_shard = total / static_cast<uint64_t>(shards) + 1;
  uint32_t state = seed * 2654435761u + 12345u;
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return state >> 8;  // 24 bits
  };
  std::vector<std::map<std::string, RawTensor>> files(static_cast<size_t>(shards));
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t written = 0;
  for (const auto& w : table) {
    int64_t n = 1;
    for (int64_t d : w.shape) n *= d;
    const bool norm = w.name.find("norm") != std::string::npos;
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    for (auto& b : bits) {
      // Sign, exponent 2^-6..2^-3 (norms: 1 + small), 4 mantissa bits: fp16-exact bf16 values.
      const uint32_t r = next();
      const float mant = 1.0f + static_cast<float>(r & 0xF) / 16.0f;
      const float mag = std::ldexp(mant, -6 + static_cast<int>((r >> 4) & 3));
      float f = norm ? 1.0f + mag / 4 : ((r >> 6) & 1 ? -mag : mag);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      b = static_cast<uint16_t>(u >> 16);
    }
    const size_t shard = std::min<size_t>(written / per_shard, static_cast<size_t>(shards - 1));
    written += static_cast<uint64_t>(n) * 2;
    const std::string dtype = dtype_of ? dtype_of(w.name) : "";
    files[shard][w.name] = from_bf16(bits, w.shape, dtype.empty() ? "BF16" : dtype);
    char file[64];
    std::snprintf(file, sizeof file, "model-%05zu-of-%05d.safetensors", shard + 1, shards);
    weight_map[w.name] = file;
  }
  for (int s = 0; s < shards; ++s) {
    char file[64];
    std::snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, shards);
    write_safetensors(dir + "/" + file, files[static_cast<size_t>(s)]);
  }
  std::ofstream(dir + "/model.safetensors.index.json")
      << nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump();
}

}  // namespace keep::testing
