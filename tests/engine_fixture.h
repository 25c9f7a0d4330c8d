// The engine's reference fixtures (scripts/make_engine_reference.py): per model, a JSON file of
// prompts with HF's top logits and greedy continuations, and every prompt's full logits as float16.
// Shared by the CPU test against HF (tests/integration/test_engine_vs_hf.cpp) and the CUDA test
// (tests/gpu/test_cuda_engine.cpp). Test-only: aborts the test through doctest on a bad fixture.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace keep::testing {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct EngineFixture {
  nlohmann::json ref;  // <name>_reference.json
  int64_t vocab = 0;
  std::vector<uint16_t> f16;  // (prompts, vocab) float16 logits
  const nlohmann::json& prompts() const { return ref["prompts"]; }
  float logit(size_t prompt, int64_t v) const { return half_to_float(f16[prompt * vocab + v]); }
};

// Reads tests/fixtures/engine/<name>_reference.json and its logits file (cwd: the repo root).
inline EngineFixture load_engine_fixture(const std::string& name) {
  const std::string fix = "tests/fixtures/engine/";
  EngineFixture f;
  std::ifstream jf(fix + name + "_reference.json");
  REQUIRE_MESSAGE(jf.good(), "missing " << fix << name << "_reference.json");
  f.ref = nlohmann::json::parse(jf);
  f.vocab = f.ref["vocab_size"].get<int64_t>();
  std::ifstream lf(fix + f.ref["logits_file"].get<std::string>(), std::ios::binary);
  f.f16.resize(static_cast<size_t>(f.vocab) * f.ref["prompts"].size());
  lf.read(reinterpret_cast<char*>(f.f16.data()), static_cast<std::streamsize>(f.f16.size() * 2));
  REQUIRE(lf.gcount() == static_cast<std::streamsize>(f.f16.size() * 2));
  return f;
}

}  // namespace keep::testing
