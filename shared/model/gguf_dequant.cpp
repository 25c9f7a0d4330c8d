#include "shared/model/gguf_dequant.h"

#include <cstring>
#include <limits>
#include <string>

#include "shared/safetensors/safetensors_reader.h"

namespace keep::engine {

namespace {

uint16_t load_u16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
}
uint32_t load_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
float load_f16(const uint8_t* p) { return safetensors::fp16_to_fp32(load_u16(p)); }

constexpr int64_t kQK = 32;  // elements per block of the *_0 / *_1 types

void dq_q8_0(const uint8_t* src, float* dst, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 34, dst += kQK) {
    const float d = load_f16(src);
    for (int j = 0; j < kQK; ++j) dst[j] = static_cast<float>(static_cast<int8_t>(src[2 + j])) * d;
  }
}

void dq_q4_0(const uint8_t* src, float* dst, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 18, dst += kQK) {
    const float d = load_f16(src);
    const uint8_t* qs = src + 2;
    for (int j = 0; j < kQK / 2; ++j) {
      const int x0 = (qs[j] & 0x0F) - 8;
      const int x1 = (qs[j] >> 4) - 8;
      dst[j] = static_cast<float>(x0) * d;
      dst[j + kQK / 2] = static_cast<float>(x1) * d;
    }
  }
}

void dq_q4_1(const uint8_t* src, float* dst, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 20, dst += kQK) {
    const float d = load_f16(src);
    const float m = load_f16(src + 2);
    const uint8_t* qs = src + 4;
    for (int j = 0; j < kQK / 2; ++j) {
      const int x0 = qs[j] & 0x0F;
      const int x1 = qs[j] >> 4;
      // Two roundings, as ggml's scalar reference (no fused multiply-add).
      const float p0 = static_cast<float>(x0) * d;
      const float p1 = static_cast<float>(x1) * d;
      dst[j] = p0 + m;
      dst[j + kQK / 2] = p1 + m;
    }
  }
}

void dq_q5_0(const uint8_t* src, float* dst, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 22, dst += kQK) {
    const float d = load_f16(src);
    const uint32_t qh = load_u32(src + 2);
    const uint8_t* qs = src + 6;
    for (int j = 0; j < kQK / 2; ++j) {
      const uint8_t xh0 = static_cast<uint8_t>(((qh >> j) << 4) & 0x10);
      const uint8_t xh1 = static_cast<uint8_t>((qh >> (j + 12)) & 0x10);
      const int x0 = ((qs[j] & 0x0F) | xh0) - 16;
      const int x1 = ((qs[j] >> 4) | xh1) - 16;
      dst[j] = static_cast<float>(x0) * d;
      dst[j + kQK / 2] = static_cast<float>(x1) * d;
    }
  }
}

void dq_q5_1(const uint8_t* src, float* dst, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 24, dst += kQK) {
    const float d = load_f16(src);
    const float m = load_f16(src + 2);
    const uint32_t qh = load_u32(src + 4);
    const uint8_t* qs = src + 8;
    for (int j = 0; j < kQK / 2; ++j) {
      const uint8_t xh0 = static_cast<uint8_t>(((qh >> j) << 4) & 0x10);
      const uint8_t xh1 = static_cast<uint8_t>((qh >> (j + 12)) & 0x10);
      const int x0 = (qs[j] & 0x0F) | xh0;
      const int x1 = (qs[j] >> 4) | xh1;
      const float p0 = static_cast<float>(x0) * d;
      const float p1 = static_cast<float>(x1) * d;
      dst[j] = p0 + m;
      dst[j + kQK / 2] = p1 + m;
    }
  }
}

}  // namespace

std::optional<GgmlTypeInfo> ggml_type_info(uint32_t type) {
  switch (type) {
    case 0:
      return GgmlTypeInfo{"F32", 1, 4, true};
    case 1:
      return GgmlTypeInfo{"F16", 1, 2, true};
    case 2:
      return GgmlTypeInfo{"Q4_0", 32, 18, true};
    case 3:
      return GgmlTypeInfo{"Q4_1", 32, 20, true};
    case 6:
      return GgmlTypeInfo{"Q5_0", 32, 22, true};
    case 7:
      return GgmlTypeInfo{"Q5_1", 32, 24, true};
    case 8:
      return GgmlTypeInfo{"Q8_0", 32, 34, true};
    case 9:
      return GgmlTypeInfo{"Q8_1", 32, 36, false};
    case 10:
      return GgmlTypeInfo{"Q2_K", 256, 84, false};
    case 11:
      return GgmlTypeInfo{"Q3_K", 256, 110, false};
    case 12:
      return GgmlTypeInfo{"Q4_K", 256, 144, false};
    case 13:
      return GgmlTypeInfo{"Q5_K", 256, 176, false};
    case 14:
      return GgmlTypeInfo{"Q6_K", 256, 210, false};
    case 15:
      return GgmlTypeInfo{"Q8_K", 256, 292, false};
    case 16:
      return GgmlTypeInfo{"IQ2_XXS", 256, 66, false};
    case 17:
      return GgmlTypeInfo{"IQ2_XS", 256, 74, false};
    case 18:
      return GgmlTypeInfo{"IQ3_XXS", 256, 98, false};
    case 19:
      return GgmlTypeInfo{"IQ1_S", 256, 50, false};
    case 20:
      return GgmlTypeInfo{"IQ4_NL", 32, 18, false};
    case 21:
      return GgmlTypeInfo{"IQ3_S", 256, 110, false};
    case 22:
      return GgmlTypeInfo{"IQ2_S", 256, 82, false};
    case 23:
      return GgmlTypeInfo{"IQ4_XS", 256, 136, false};
    case 24:
      return GgmlTypeInfo{"I8", 1, 1, false};
    case 25:
      return GgmlTypeInfo{"I16", 1, 2, false};
    case 26:
      return GgmlTypeInfo{"I32", 1, 4, false};
    case 27:
      return GgmlTypeInfo{"I64", 1, 8, false};
    case 28:
      return GgmlTypeInfo{"F64", 1, 8, false};
    case 29:
      return GgmlTypeInfo{"IQ1_M", 256, 56, false};
    case 30:
      return GgmlTypeInfo{"BF16", 1, 2, true};
    case 34:
      return GgmlTypeInfo{"TQ1_0", 256, 54, false};
    case 35:
      return GgmlTypeInfo{"TQ2_0", 256, 66, false};
    default:
      return std::nullopt;
  }
}

const char* ggml_type_name(uint32_t type) {
  auto info = ggml_type_info(type);
  if (info) return info->name;
  static thread_local std::string buf;
  buf = "type#" + std::to_string(type);
  return buf.c_str();
}

std::optional<uint64_t> ggml_row_bytes(uint32_t type, int64_t n) {
  auto info = ggml_type_info(type);
  if (!info || n < 0 || n % info->block_elems != 0) return std::nullopt;
  const uint64_t blocks = static_cast<uint64_t>(n / info->block_elems);
  const uint64_t bb = static_cast<uint64_t>(info->block_bytes);
  if (blocks != 0 && bb > std::numeric_limits<uint64_t>::max() / blocks) return std::nullopt;
  return blocks * bb;
}

Status dequantize(uint32_t type, const uint8_t* src, size_t src_bytes, float* dst, int64_t n) {
  auto info = ggml_type_info(type);
  if (!info || !info->dequantizable) {
    return Status(Code::kInvalidArgument,
                  std::string("cannot dequantise ggml type ") + ggml_type_name(type) +
                      " (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)");
  }
  auto need = ggml_row_bytes(type, n);
  if (!need) {
    return Status(Code::kInvalidArgument,
                  std::to_string(n) + " elements of " + info->name + " are not a whole number of " +
                      std::to_string(info->block_elems) + "-element blocks");
  }
  if (*need != src_bytes) {
    return Status(Code::kInvalidArgument, std::string(info->name) + ": " + std::to_string(n) +
                                              " elements need " + std::to_string(*need) +
                                              " bytes, got " + std::to_string(src_bytes));
  }
  const int64_t blocks = n / info->block_elems;
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      break;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = load_f16(src + 2 * i);
      break;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = safetensors::bf16_to_fp32(load_u16(src + 2 * i));
      break;
    case GgmlType::kQ8_0:
      dq_q8_0(src, dst, blocks);
      break;
    case GgmlType::kQ4_0:
      dq_q4_0(src, dst, blocks);
      break;
    case GgmlType::kQ4_1:
      dq_q4_1(src, dst, blocks);
      break;
    case GgmlType::kQ5_0:
      dq_q5_0(src, dst, blocks);
      break;
    case GgmlType::kQ5_1:
      dq_q5_1(src, dst, blocks);
      break;
    default:
      return Status(Code::kInternal, "dequantize: unhandled type");
  }
  return Status::ok();
}

}  // namespace keep::engine
