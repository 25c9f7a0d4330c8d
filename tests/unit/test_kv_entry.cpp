// services/worker/keep/kv_entry: a KV entry's per-layer K/V planes, written from and read into
// fp32 rows, in bf16 (rounded as CUDA rounds) and f32.
#include "services/worker/keep/kv_entry.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "services/worker/kernels/bf16.h"

using namespace keep::worker;
using keep::Code;
namespace kv = keep::kv;

namespace {

kv::ModelFingerprint fingerprint(kv::KvDType dtype) {
  kv::ModelFingerprint fp;
  fp.num_layers = 3;
  fp.num_kv_heads = 2;
  fp.head_dim = 4;
  fp.dtype = dtype;
  return fp;
}

std::vector<float> random_rows(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

}  // namespace

TEST_CASE("geometry follows docs/shm-format.md: per layer K then V planes") {
  auto g = EntryGeometry::of(fingerprint(kv::KvDType::kBF16), 5);
  REQUIRE(g.is_ok());
  CHECK(g->plane_bytes() == 5 * 2 * 4 * 2);
  CHECK(g->bytes() == 2 * 3 * g->plane_bytes());
  CHECK(g->bytes() == fingerprint(kv::KvDType::kBF16).bytes_per_token() * 5);
  CHECK(g->k_offset(1) == 2 * g->plane_bytes());
  CHECK(g->v_offset(2) == 5 * g->plane_bytes());
  CHECK(EntryGeometry::of(fingerprint(kv::KvDType::kF8E4M3), 5).status().code() ==
        Code::kInvalidArgument);
}

TEST_CASE("rows round-trip: f32 exactly, bf16 as round-to-nearest-even; slices land in place") {
  for (kv::KvDType dtype : {kv::KvDType::kF32, kv::KvDType::kBF16}) {
    INFO(kv::dtype_name(dtype));
    auto g = *EntryGeometry::of(fingerprint(dtype), 7);
    std::vector<std::byte> entry(g.bytes());
    const size_t re = g.row_elems();
    // Layer 1 in two slices (a group's members): rows [0, 3) and [3, 7).
    auto k = random_rows(7 * re, 1), v = random_rows(7 * re, 2);
    v[5] = NAN;
    REQUIRE(write_entry_layer(entry, g, 1, 0, 3, k.data(), v.data()).is_ok());
    REQUIRE(write_entry_layer(entry, g, 1, 3, 4, k.data() + 3 * re, v.data() + 3 * re).is_ok());
    std::vector<float> k2(4 * re), v2(4 * re);
    REQUIRE(read_entry_layer(entry, g, 1, 2, 4, k2.data(), v2.data()).is_ok());
    for (size_t i = 0; i < 4 * re; ++i) {
      const float want_k = k[2 * re + i], want_v = v[2 * re + i];
      if (dtype == kv::KvDType::kF32) {
        CHECK(k2[i] == want_k);
      } else {
        CHECK(k2[i] == keep::kernels::bf16_to_float(keep::kernels::float_to_bf16(want_k)));
        CHECK(std::fabs(k2[i] - want_k) <= std::fabs(want_k) / 256.0f);
      }
      if (std::isnan(want_v)) {
        CHECK(std::isnan(v2[i]));
      } else if (dtype == kv::KvDType::kF32) {
        CHECK(v2[i] == want_v);
      }
    }
    // Other layers were not touched.
    const auto* k0 = entry.data() + g.k_offset(0);
    CHECK(std::all_of(k0, k0 + 2 * g.plane_bytes(), [](std::byte b) { return b == std::byte{0}; }));
    // Bounds.
    CHECK(write_entry_layer(entry, g, 3, 0, 1, k.data(), v.data()).code() ==
          Code::kInvalidArgument);
    CHECK(write_entry_layer(entry, g, 0, 5, 3, k.data(), v.data()).code() ==
          Code::kInvalidArgument);
    CHECK(read_entry_layer(std::span<const std::byte>(entry).first(g.bytes() - 1), g, 0, 0, 1,
                           k2.data(), v2.data())
              .code() == Code::kInvalidArgument);
  }
}

TEST_CASE("a bf16 entry's rows are handed out in place; they read as read_entry_layer's") {
  auto g = EntryGeometry::of(fingerprint(kv::KvDType::kBF16), 5);
  REQUIRE(g.is_ok());
  std::vector<std::byte> entry(g->bytes());
  std::vector<float> k(5 * g->row_elems()), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = 0.25f * static_cast<float>(i) - 3.0f;
    v[i] = 1.0f / (1.0f + static_cast<float>(i));
  }
  for (int32_t l = 0; l < g->layers; ++l) {
    REQUIRE(write_entry_layer(entry, *g, l, 0, 5, k.data(), v.data()).is_ok());
  }
  auto rows = entry_rows_bf16(entry, *g, 2, 1, 3);
  REQUIRE(rows.has_value());
  std::vector<float> want_k(3 * g->row_elems()), want_v(want_k.size());
  REQUIRE(read_entry_layer(entry, *g, 2, 1, 3, want_k.data(), want_v.data()).is_ok());
  for (size_t i = 0; i < want_k.size(); ++i) {
    const uint32_t kb = static_cast<uint32_t>(rows->first[i]) << 16;
    const uint32_t vb = static_cast<uint32_t>(rows->second[i]) << 16;
    float kf, vf;
    std::memcpy(&kf, &kb, 4);
    std::memcpy(&vf, &vb, 4);
    CHECK(kf == want_k[i]);
    CHECK(vf == want_v[i]);
  }
  CHECK_FALSE(entry_rows_bf16(entry, *g, 2, 3, 3).has_value());  // past the entry's tokens
  CHECK_FALSE(entry_rows_bf16(entry, *g, 3, 0, 1).has_value());  // no such layer
  CHECK_FALSE(entry_rows_bf16(std::span(entry).first(entry.size() - 1), *g, 0, 0, 1).has_value());
  auto f32 = EntryGeometry::of(fingerprint(kv::KvDType::kF32), 5);
  REQUIRE(f32.is_ok());
  std::vector<std::byte> e32(f32->bytes());
  CHECK_FALSE(entry_rows_bf16(e32, *f32, 0, 0, 1).has_value());  // f32 entries: read_entry_layer
}
