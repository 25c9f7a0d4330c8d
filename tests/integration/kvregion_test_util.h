// Helpers shared by test_kv_region_processes.cpp and its helper process kvregion_probe.cpp:
// the test fingerprint, its hex form for the command line, and the content pattern of an entry.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "shared/kvregion/kv_format.h"
#include "shared/kvregion/model_fingerprint.h"

namespace keep::kv::testutil {

inline ModelFingerprint smol_fingerprint() {
  ModelFingerprint fp;
  fp.num_layers = 30;
  fp.num_kv_heads = 3;
  fp.head_dim = 64;
  fp.dtype = KvDType::kBF16;
  fp.rope_theta = 100000.0;
  fp.tokenizer_hash = fnv1a_64("smollm2 tokenizer");
  fp.set_model_name("SmolLM2-135M-Instruct");
  return fp;
}

inline std::string to_hex(const ModelFingerprint& fp) {
  static const char* kDigits = "0123456789abcdef";
  unsigned char bytes[sizeof(ModelFingerprint)];
  std::memcpy(bytes, &fp, sizeof(fp));
  std::string out;
  for (unsigned char b : bytes) {
    out += kDigits[b >> 4];
    out += kDigits[b & 15];
  }
  return out;
}

inline std::optional<ModelFingerprint> from_hex(const std::string& hex) {
  if (hex.size() != 2 * sizeof(ModelFingerprint)) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  unsigned char bytes[sizeof(ModelFingerprint)];
  for (size_t i = 0; i < sizeof(bytes); ++i) {
    const int hi = nibble(hex[2 * i]);
    const int lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    bytes[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  ModelFingerprint fp;
  std::memcpy(&fp, bytes, sizeof(fp));
  return fp;
}

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Word i of an entry's content: a function of (object id, generation, i), so a torn read (words
// of two different fills) or a read of a reused slot cannot pass verification.
inline uint64_t pattern_word(uint64_t object_id, uint64_t generation, uint64_t i) {
  return splitmix64(object_id * 0x100000001b3ull ^ (generation << 40) ^ i);
}

// Fills words [from, to) of `data` (bytes are a multiple of 8 for our fingerprints).
inline void fill_pattern(unsigned char* data, uint64_t from, uint64_t to, uint64_t object_id,
                         uint64_t generation) {
  for (uint64_t i = from; i < to; ++i) {
    const uint64_t w = pattern_word(object_id, generation, i);
    std::memcpy(data + 8 * i, &w, 8);
  }
}

// The index of the first wrong word, or -1 when all `words` match.
inline int64_t first_mismatch(const unsigned char* data, uint64_t words, uint64_t object_id,
                              uint64_t generation) {
  for (uint64_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, data + 8 * i, 8);
    if (w != pattern_word(object_id, generation, i)) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace keep::kv::testutil
