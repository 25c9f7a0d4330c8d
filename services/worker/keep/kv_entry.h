// The bytes of one KV entry in the shared region (docs/shm-format.md, "Entry content"): for each
// layer l, K then V, each a [tokens, kv_heads, head_dim] plane of the fingerprint's dtype, K before
// RoPE. A static group's entry holds its members one after another, so a member's slice of a
// layer is a contiguous run of rows in each plane.
//
// The engine produces and consumes fp32 rows (k_pre / v of a layer); these functions convert them
// to and from the entry's dtype (bf16: round to nearest even, as the CUDA conversion does; f32:
// as is). Host code over a span of the mapping: the region is ordinary (registered) host memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>

#include "shared/common/status.h"
#include "shared/kvregion/model_fingerprint.h"

namespace keep::worker {

struct EntryGeometry {
  int32_t layers = 0;
  int32_t kv_heads = 0;
  int32_t head_dim = 0;
  kv::KvDType dtype = kv::KvDType::kInvalid;
  int32_t tokens = 0;

  // From a region's fingerprint and an entry's token count; kInvalidArgument for a dtype this
  // worker cannot read or write (bf16 and f32 are supported).
  static Result<EntryGeometry> of(const kv::ModelFingerprint& fp, int32_t tokens);
  size_t row_elems() const { return static_cast<size_t>(kv_heads) * head_dim; }
  size_t elem_bytes() const;
  size_t plane_bytes() const { return static_cast<size_t>(tokens) * row_elems() * elem_bytes(); }
  size_t bytes() const { return 2 * static_cast<size_t>(layers) * plane_bytes(); }
  size_t k_offset(int32_t layer) const { return 2 * static_cast<size_t>(layer) * plane_bytes(); }
  size_t v_offset(int32_t layer) const { return k_offset(layer) + plane_bytes(); }
};

// Writes rows [first, first + rows) of layer `layer`: k_pre and v are (rows, kv_heads, head_dim)
// fp32. kInvalidArgument when the rows or layer fall outside the entry or `entry` is too small.
Status write_entry_layer(std::span<std::byte> entry, const EntryGeometry& g, int32_t layer,
                         int32_t first, int32_t rows, const float* k_pre, const float* v);

// The K and V rows [first, first + rows) of layer `layer` as they lie in a bf16 entry (uint16 bits,
// (rows, kv_heads, head_dim) each, contiguous); nullopt for another dtype or rows outside it.
std::optional<std::pair<const uint16_t*, const uint16_t*>> entry_rows_bf16(
    std::span<const std::byte> entry, const EntryGeometry& g, int32_t layer, int32_t first,
    int32_t rows);

// Reads rows [first, first + rows) of layer `layer` into fp32 (rows, kv_heads, head_dim).
Status read_entry_layer(std::span<const std::byte> entry, const EntryGeometry& g, int32_t layer,
                        int32_t first, int32_t rows, float* k_pre, float* v);

}  // namespace keep::worker
