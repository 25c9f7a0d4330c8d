// ModelFingerprint: the KV geometry of one model, recorded in the shared region's header.
//
// A worker computes its fingerprint from the model it loaded and attaches to the region only when
// the two are identical (KvRegionView::attach); otherwise it would read KV of another shape, dtype
// or tokenizer as garbage. The struct is plain data with a fixed byte layout (it lives in shared
// memory and is documented in docs/shm-format.md); all fields take part in the comparison.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "shared/common/status.h"

namespace keep::kv {

// Element type of the stored K and V. 0 is never valid (a zeroed header fails validation).
enum class KvDType : uint8_t { kInvalid = 0, kF16 = 1, kBF16 = 2, kF32 = 3, kF8E4M3 = 4 };

// RoPE scaling variants as in HF config.json `rope_scaling.rope_type`.
enum class RopeScaling : uint8_t { kNone = 0, kLinear = 1, kDynamic = 2, kYarn = 3, kLlama3 = 4 };

// Bytes of one element; 0 for an unknown dtype.
uint32_t dtype_size(KvDType dtype);
// "f16", "bf16", "f32", "f8e4m3", or "dtype(<n>)" for an unknown value.
std::string dtype_name(KvDType dtype);
// The dtypes a region's KV is written in (--kv-dtype of both services): "bf16" or "f32";
// kInvalidArgument naming what was given otherwise.
Result<KvDType> parse_region_dtype(std::string_view name);
std::string rope_scaling_name(RopeScaling scaling);

inline constexpr size_t kModelNameBytes = 64;  // NUL-padded, at most 63 characters

// 128 bytes, little-endian (the region never leaves the node). Offsets pinned below.
struct ModelFingerprint {
  uint32_t num_layers = 0;                        // 0
  uint32_t num_kv_heads = 0;                      // 4
  uint32_t head_dim = 0;                          // 8
  KvDType dtype = KvDType::kInvalid;              // 12
  RopeScaling rope_scaling = RopeScaling::kNone;  // 13
  uint16_t reserved0 = 0;                         // 14 (zero)
  double rope_theta = 0.0;                        // 16
  double rope_scaling_factor = 0.0;               // 24 (0 when rope_scaling == kNone)
  double rope_low_freq_factor = 0.0;              // 32 (llama3 / yarn beta_slow)
  double rope_high_freq_factor = 0.0;             // 40 (llama3 / yarn beta_fast)
  uint32_t rope_original_max_positions = 0;       // 48
  uint32_t reserved1 = 0;                         // 52 (zero)
  uint64_t tokenizer_hash = 0;                    // 56 BpeTokenizer::fingerprint()
  char model_name[kModelNameBytes] = {};          // 64 informational, but compared too

  // 2 (K and V) * num_layers * num_kv_heads * head_dim * dtype_size(dtype). 0 when invalid.
  uint64_t bytes_per_token() const;
  // Bytes of one [tokens, kv_heads, head_dim] plane (one layer's K, or its V).
  uint64_t plane_bytes(uint32_t tokens) const;

  // Copies `name` (truncated to 63 bytes) and zero-pads the rest.
  void set_model_name(std::string_view name);
  std::string_view model_name_view() const;

  // ok when every geometry field is set, the dtype is known, the name is NUL-terminated and the
  // reserved fields are zero; kInvalidArgument naming the field otherwise.
  Status validate() const;

  // "model=SmolLM2-135M layers=30 kv_heads=3 head_dim=64 dtype=bf16 rope_theta=100000
  //  rope_scaling=none tokenizer=0x1234abcd..." (used in mismatch messages and logs).
  std::string describe() const;

  friend bool operator==(const ModelFingerprint& a, const ModelFingerprint& b);
};

static_assert(std::is_standard_layout_v<ModelFingerprint>);
static_assert(std::is_trivially_copyable_v<ModelFingerprint>);
static_assert(sizeof(ModelFingerprint) == 128);
static_assert(offsetof(ModelFingerprint, num_layers) == 0);
static_assert(offsetof(ModelFingerprint, num_kv_heads) == 4);
static_assert(offsetof(ModelFingerprint, head_dim) == 8);
static_assert(offsetof(ModelFingerprint, dtype) == 12);
static_assert(offsetof(ModelFingerprint, rope_scaling) == 13);
static_assert(offsetof(ModelFingerprint, rope_theta) == 16);
static_assert(offsetof(ModelFingerprint, rope_scaling_factor) == 24);
static_assert(offsetof(ModelFingerprint, rope_low_freq_factor) == 32);
static_assert(offsetof(ModelFingerprint, rope_high_freq_factor) == 40);
static_assert(offsetof(ModelFingerprint, rope_original_max_positions) == 48);
static_assert(offsetof(ModelFingerprint, tokenizer_hash) == 56);
static_assert(offsetof(ModelFingerprint, model_name) == 64);

// kOk when equal; kVersionMismatch otherwise, with a message naming both sides and the fields that
// differ: "model fingerprint mismatch (layers, head_dim): region has model=... layers=30 ...,
// this process has model=... layers=24 ...".
Status check_fingerprint(const ModelFingerprint& region, const ModelFingerprint& mine);

// 64-bit FNV-1a (agent-name hashes in entry keys; the tokenizer's content hash uses it too).
uint64_t fnv1a_64(std::string_view bytes);

// Byte layout of one KV entry of `tokens` tokens: for each layer l, K then V, each a contiguous
// [tokens, kv_heads, head_dim] plane. Offsets are relative to the entry's first byte.
inline uint64_t entry_k_offset(const ModelFingerprint& fp, uint32_t tokens, uint32_t layer) {
  return 2ull * layer * fp.plane_bytes(tokens);
}
inline uint64_t entry_v_offset(const ModelFingerprint& fp, uint32_t tokens, uint32_t layer) {
  return entry_k_offset(fp, tokens, layer) + fp.plane_bytes(tokens);
}

}  // namespace keep::kv
