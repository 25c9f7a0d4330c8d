#include "shared/kvregion/model_fingerprint.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace keep::kv {

uint32_t dtype_size(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF16:
      return 2;
    case KvDType::kBF16:
      return 2;
    case KvDType::kF32:
      return 4;
    case KvDType::kF8E4M3:
      return 1;
    case KvDType::kInvalid:
      return 0;
  }
  return 0;
}

Result<KvDType> parse_region_dtype(std::string_view name) {
  if (name == "bf16") return KvDType::kBF16;
  if (name == "f32") return KvDType::kF32;
  return Status(Code::kInvalidArgument, "expected bf16 or f32, got '" + std::string(name) + "'");
}

std::string dtype_name(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF16:
      return "f16";
    case KvDType::kBF16:
      return "bf16";
    case KvDType::kF32:
      return "f32";
    case KvDType::kF8E4M3:
      return "f8e4m3";
    case KvDType::kInvalid:
      break;
  }
  return "dtype(" + std::to_string(static_cast<unsigned>(dtype)) + ")";
}

std::string rope_scaling_name(RopeScaling scaling) {
  switch (scaling) {
    case RopeScaling::kNone:
      return "none";
    case RopeScaling::kLinear:
      return "linear";
    case RopeScaling::kDynamic:
      return "dynamic";
    case RopeScaling::kYarn:
      return "yarn";
    case RopeScaling::kLlama3:
      return "llama3";
  }
  return "rope_scaling(" + std::to_string(static_cast<unsigned>(scaling)) + ")";
}

uint64_t ModelFingerprint::bytes_per_token() const {
  uint64_t v = 2;
  for (uint64_t f : {uint64_t{num_layers}, uint64_t{num_kv_heads}, uint64_t{head_dim},
                     uint64_t{dtype_size(dtype)}}) {
    if (__builtin_mul_overflow(v, f, &v)) return 0;
  }
  return v;
}

uint64_t ModelFingerprint::plane_bytes(uint32_t tokens) const {
  return static_cast<uint64_t>(tokens) * num_kv_heads * head_dim * dtype_size(dtype);
}

void ModelFingerprint::set_model_name(std::string_view name) {
  std::memset(model_name, 0, sizeof(model_name));
  const size_t n = name.size() < kModelNameBytes - 1 ? name.size() : kModelNameBytes - 1;
  std::memcpy(model_name, name.data(), n);
}

std::string_view ModelFingerprint::model_name_view() const {
  return std::string_view(model_name, strnlen(model_name, kModelNameBytes));
}

Status ModelFingerprint::validate() const {
  auto bad = [](const char* what) {
    return Status(Code::kInvalidArgument, std::string("model fingerprint: ") + what);
  };
  if (num_layers == 0) return bad("num_layers is 0");
  if (num_kv_heads == 0) return bad("num_kv_heads is 0");
  if (head_dim == 0) return bad("head_dim is 0");
  if (dtype_size(dtype) == 0) return bad(("unknown dtype " + dtype_name(dtype)).c_str());
  if (static_cast<unsigned>(rope_scaling) > static_cast<unsigned>(RopeScaling::kLlama3)) {
    return bad("unknown rope_scaling");
  }
  if (!(rope_theta > 0.0) || !std::isfinite(rope_theta)) {
    return bad("rope_theta must be finite and > 0");
  }
  // NaN never compares equal, so a region recording one could never be attached or adopted.
  for (double v : {rope_scaling_factor, rope_low_freq_factor, rope_high_freq_factor}) {
    if (!std::isfinite(v) || v < 0.0) return bad("rope scaling parameters must be finite and >= 0");
  }
  if (reserved0 != 0 || reserved1 != 0) return bad("reserved fields are not zero");
  if (strnlen(model_name, kModelNameBytes) == kModelNameBytes) {
    return bad("model_name is not NUL-terminated");
  }
  if (bytes_per_token() == 0) return bad("bytes_per_token overflows");
  return Status::ok();
}

std::string ModelFingerprint::describe() const {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "model='%.*s' layers=%u kv_heads=%u head_dim=%u dtype=%s rope_theta=%g "
                "rope_scaling=%s(factor=%g low=%g high=%g orig_max=%u) tokenizer=0x%016" PRIx64,
                static_cast<int>(model_name_view().size()), model_name_view().data(), num_layers,
                num_kv_heads, head_dim, dtype_name(dtype).c_str(), rope_theta,
                rope_scaling_name(rope_scaling).c_str(), rope_scaling_factor, rope_low_freq_factor,
                rope_high_freq_factor, rope_original_max_positions, tokenizer_hash);
  return buf;
}

namespace {
// Names of the fields that differ, comma separated.
std::string diff_fields(const ModelFingerprint& a, const ModelFingerprint& b) {
  std::string out;
  auto add = [&out](bool differs, const char* name) {
    if (!differs) return;
    if (!out.empty()) out += ", ";
    out += name;
  };
  add(a.num_layers != b.num_layers, "layers");
  add(a.num_kv_heads != b.num_kv_heads, "kv_heads");
  add(a.head_dim != b.head_dim, "head_dim");
  add(a.dtype != b.dtype, "dtype");
  add(a.rope_scaling != b.rope_scaling, "rope_scaling");
  add(a.rope_theta != b.rope_theta, "rope_theta");
  add(a.rope_scaling_factor != b.rope_scaling_factor ||
          a.rope_low_freq_factor != b.rope_low_freq_factor ||
          a.rope_high_freq_factor != b.rope_high_freq_factor ||
          a.rope_original_max_positions != b.rope_original_max_positions,
      "rope_scaling_params");
  add(a.tokenizer_hash != b.tokenizer_hash, "tokenizer_hash");
  add(a.model_name_view() != b.model_name_view(), "model_name");
  add(a.reserved0 != b.reserved0 || a.reserved1 != b.reserved1, "reserved");
  return out;
}
}  // namespace

bool operator==(const ModelFingerprint& a, const ModelFingerprint& b) {
  return diff_fields(a, b).empty();
}

Status check_fingerprint(const ModelFingerprint& region, const ModelFingerprint& mine) {
  const std::string diff = diff_fields(region, mine);
  if (diff.empty()) return Status::ok();
  return Status(Code::kVersionMismatch, "model fingerprint mismatch (" + diff + "): region has " +
                                            region.describe() + "; this process has " +
                                            mine.describe());
}

uint64_t fnv1a_64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace keep::kv
