#include "services/worker/keep/kv_entry.h"

#include <cstring>
#include <string>

#include "services/worker/kernels/bf16.h"

namespace keep::worker {
namespace {

Status check_rows(size_t entry_bytes, const EntryGeometry& g, int32_t layer, int32_t first,
                  int32_t rows) {
  if (layer < 0 || layer >= g.layers || first < 0 || rows < 0 || first > g.tokens - rows) {
    return Status(Code::kInvalidArgument,
                  "KV entry: layer " + std::to_string(layer) + " rows [" + std::to_string(first) +
                      ", " + std::to_string(static_cast<int64_t>(first) + rows) +
                      ") outside an entry of " + std::to_string(g.layers) + " layers and " +
                      std::to_string(g.tokens) + " tokens");
  }
  if (entry_bytes < g.bytes()) {
    return Status(Code::kInvalidArgument, "KV entry: " + std::to_string(entry_bytes) +
                                              " bytes, its geometry needs " +
                                              std::to_string(g.bytes()));
  }
  return Status::ok();
}

void encode(std::byte* dst, const float* src, size_t n, kv::KvDType dtype) {
  if (dtype == kv::KvDType::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const kernels::Bf16 b = kernels::float_to_bf16(src[i]);
    std::memcpy(dst + 2 * i, &b.bits, 2);
  }
}

void decode(float* dst, const std::byte* src, size_t n, kv::KvDType dtype) {
  if (dtype == kv::KvDType::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    kernels::Bf16 b;
    std::memcpy(&b.bits, src + 2 * i, 2);
    dst[i] = kernels::bf16_to_float(b);
  }
}

}  // namespace

Result<EntryGeometry> EntryGeometry::of(const kv::ModelFingerprint& fp, int32_t tokens) {
  if (fp.dtype != kv::KvDType::kBF16 && fp.dtype != kv::KvDType::kF32) {
    return Status(Code::kInvalidArgument, "KV entries of dtype " + kv::dtype_name(fp.dtype) +
                                              " are not supported (bf16, f32 are)");
  }
  if (tokens < 0) return Status(Code::kInvalidArgument, "KV entry: negative token count");
  EntryGeometry g;
  g.layers = static_cast<int32_t>(fp.num_layers);
  g.kv_heads = static_cast<int32_t>(fp.num_kv_heads);
  g.head_dim = static_cast<int32_t>(fp.head_dim);
  g.dtype = fp.dtype;
  g.tokens = tokens;
  return g;
}

size_t EntryGeometry::elem_bytes() const { return dtype == kv::KvDType::kF32 ? 4 : 2; }

Status write_entry_layer(std::span<std::byte> entry, const EntryGeometry& g, int32_t layer,
                         int32_t first, int32_t rows, const float* k_pre, const float* v) {
  KEEP_RETURN_IF_ERROR(check_rows(entry.size(), g, layer, first, rows));
  const size_t row_bytes = g.row_elems() * g.elem_bytes();
  const size_t n = static_cast<size_t>(rows) * g.row_elems();
  encode(entry.data() + g.k_offset(layer) + first * row_bytes, k_pre, n, g.dtype);
  encode(entry.data() + g.v_offset(layer) + first * row_bytes, v, n, g.dtype);
  return Status::ok();
}

Status read_entry_layer(std::span<const std::byte> entry, const EntryGeometry& g, int32_t layer,
                        int32_t first, int32_t rows, float* k_pre, float* v) {
  KEEP_RETURN_IF_ERROR(check_rows(entry.size(), g, layer, first, rows));
  const size_t row_bytes = g.row_elems() * g.elem_bytes();
  const size_t n = static_cast<size_t>(rows) * g.row_elems();
  decode(k_pre, entry.data() + g.k_offset(layer) + first * row_bytes, n, g.dtype);
  decode(v, entry.data() + g.v_offset(layer) + first * row_bytes, n, g.dtype);
  return Status::ok();
}

std::optional<std::pair<const uint16_t*, const uint16_t*>> entry_rows_bf16(
    std::span<const std::byte> entry, const EntryGeometry& g, int32_t layer, int32_t first,
    int32_t rows) {
  if (g.dtype != kv::KvDType::kBF16 || layer < 0 || layer >= g.layers || first < 0 || rows < 0 ||
      first + rows > g.tokens || entry.size() < g.bytes()) {
    return std::nullopt;
  }
  const size_t at = static_cast<size_t>(first) * g.row_elems() * sizeof(uint16_t);
  const auto* k = reinterpret_cast<const uint16_t*>(entry.data() + g.k_offset(layer) + at);
  const auto* v = reinterpret_cast<const uint16_t*>(entry.data() + g.v_offset(layer) + at);
  return std::make_pair(k, v);
}

}  // namespace keep::worker
