// GGUF: dequantisation of every supported ggml type on handcrafted blocks (expected values worked
// out by hand from the block formats), the reader on crafted files (all metadata types, arrays,
// alignment; every truncation and inconsistency refused with file and tensor named), the loader on
// a crafted llama file (Q/K un-permutation, tied embeddings, tokenizer), and the real SmolLM2 file
// against what HF transformers loads from it (tests/fixtures/engine/smollm2_gguf_reference.json,
// written by scripts/make_engine_fixtures.py gguf-ref).
#include <doctest/doctest.h>

#include <unistd.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shared/model/gguf_dequant.h"
#include "shared/model/gguf_loader.h"
#include "shared/model/gguf_reader.h"
#include "shared/model/model_weights.h"

using keep::Code;
using keep::Result;
using namespace keep::engine;
using nlohmann::json;

namespace {

constexpr const char* kSmolPath = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

// ---- byte builders ----------------------------------------------------------------------------
struct Bytes {
  std::vector<uint8_t> b;
  template <typename T>
  Bytes& put(T v) {
    uint8_t tmp[sizeof(T)];
    std::memcpy(tmp, &v, sizeof(T));
    b.insert(b.end(), tmp, tmp + sizeof(T));
    return *this;
  }
  Bytes& u8(uint8_t v) { return put(v); }
  Bytes& u16(uint16_t v) { return put(v); }
  Bytes& u32(uint32_t v) { return put(v); }
  Bytes& u64(uint64_t v) { return put(v); }
  Bytes& str(const std::string& s) {
    u64(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  void pad_to(size_t align) {
    while (b.size() % align != 0) b.push_back(0);
  }
};

// A GGUF file under construction: metadata entries and tensors (raw bytes of any ggml type).
struct GgufBuilder {
  struct T {
    std::string name;
    uint32_t type;
    std::vector<uint64_t> ne;
    std::vector<uint8_t> data;
    int64_t offset_override = -1;
  };
  Bytes kv;
  uint64_t n_kv = 0;
  std::vector<T> tensors;
  uint64_t alignment = 32;
  uint32_t version = 3;

  void kv_u32(const std::string& k, uint32_t v) { kv.str(k).u32(4).u32(v), ++n_kv; }
  void kv_f32(const std::string& k, float v) { kv.str(k).u32(6).put(v), ++n_kv; }
  void kv_str(const std::string& k, const std::string& v) { kv.str(k).u32(8).str(v), ++n_kv; }
  void kv_bool(const std::string& k, bool v) { kv.str(k).u32(7).u8(v ? 1 : 0), ++n_kv; }
  void kv_str_array(const std::string& k, const std::vector<std::string>& v) {
    kv.str(k).u32(9).u32(8).u64(v.size());
    for (const auto& s : v) kv.str(s);
    ++n_kv;
  }
  void kv_i32_array(const std::string& k, const std::vector<int32_t>& v) {
    kv.str(k).u32(9).u32(5).u64(v.size());
    for (int32_t x : v) kv.put(x);
    ++n_kv;
  }
  void tensor_f32(const std::string& name, std::vector<uint64_t> ne, const std::vector<float>& v) {
    T t{name, 0, std::move(ne), {}};
    t.data.resize(v.size() * 4);
    std::memcpy(t.data.data(), v.data(), t.data.size());
    tensors.push_back(std::move(t));
  }

  std::vector<uint8_t> build() const {
    Bytes out;
    out.u32(0x46554747).u32(version).u64(tensors.size()).u64(n_kv);
    out.b.insert(out.b.end(), kv.b.begin(), kv.b.end());
    // Data is laid out at the natural (aligned, consecutive) offsets; offset_override only
    // changes what the tensor info claims.
    uint64_t off = 0;
    std::vector<uint64_t> offsets;
    for (const T& t : tensors) {
      offsets.push_back(off);
      off += t.data.size();
      off = (off + alignment - 1) / alignment * alignment;
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      const T& t = tensors[i];
      out.str(t.name).u32(static_cast<uint32_t>(t.ne.size()));
      for (uint64_t d : t.ne) out.u64(d);
      out.u32(t.type).u64(t.offset_override >= 0 ? static_cast<uint64_t>(t.offset_override)
                                                 : offsets[i]);
    }
    out.pad_to(alignment);
    const size_t data_start = out.b.size();
    for (size_t i = 0; i < tensors.size(); ++i) {
      out.b.resize(data_start + offsets[i], 0);
      out.b.insert(out.b.end(), tensors[i].data.begin(), tensors[i].data.end());
    }
    return out.b;
  }
};

Result<std::unique_ptr<GgufFile>> parse_bytes(const std::vector<uint8_t>& b) {
  return GgufFile::parse(b.data(), b.size(), "crafted.gguf");
}

std::string write_temp(const std::vector<uint8_t>& b, const std::string& stem) {
  const std::string path =
      "/tmp/keep_test_gguf_" + std::to_string(::getpid()) + "_" + stem + ".gguf";
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  return path;
}

void check_error(const keep::Status& st, std::initializer_list<const char*> needles) {
  REQUIRE_FALSE(st.is_ok());
  for (const char* n : needles) {
    CHECK_MESSAGE(st.message().find(n) != std::string::npos, st.to_string() << " lacks " << n);
  }
}

// check_error with the caller's line in the failure report.
#define CHECK_ERROR(st, ...)              \
  do {                                    \
    INFO("checked at line " << __LINE__); \
    check_error((st), __VA_ARGS__);       \
  } while (0)

std::vector<float> dq(uint32_t type, const std::vector<uint8_t>& block, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n), NAN);
  keep::Status st = dequantize(type, block.data(), block.size(), out.data(), n);
  REQUIRE_MESSAGE(st.is_ok(), st.to_string());
  return out;
}

}  // namespace

// ---- dequantisation -----------------------------------------------------------------------------

TEST_CASE("F32 / F16 / BF16 convert exactly") {
  Bytes f32;
  f32.put(1.5f).put(-0.0f).put(3.0e38f);
  auto a = dq(0, f32.b, 3);
  CHECK(a[0] == 1.5f);
  CHECK(std::signbit(a[1]));
  CHECK(a[2] == 3.0e38f);
  Bytes f16;  // 1.0, -2.0, 65504 (max), 2^-24 (smallest subnormal)
  f16.u16(0x3C00).u16(0xC000).u16(0x7BFF).u16(0x0001);
  auto h = dq(1, f16.b, 4);
  CHECK(h[0] == 1.0f);
  CHECK(h[1] == -2.0f);
  CHECK(h[2] == 65504.0f);
  CHECK(h[3] == std::ldexp(1.0f, -24));
  Bytes bf;  // 1.0, -3.0, 0x4049 = 3.140625
  bf.u16(0x3F80).u16(0xC040).u16(0x4049);
  auto g = dq(30, bf.b, 3);
  CHECK(g[0] == 1.0f);
  CHECK(g[1] == -3.0f);
  CHECK(g[2] == 3.140625f);
}

TEST_CASE("Q8_0: x = d * int8") {
  Bytes b;
  b.u16(0x3800);  // d = 0.5
  const int8_t qs[32] = {-128, -1, 0,  1,  127, 2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12,
                         13,   14, 15, 16, 17,  18, 19, 20, 21, 22, 23, 24, 25, 26, 27, -7};
  for (int8_t q : qs) b.put(q);
  REQUIRE(b.b.size() == 34);
  auto x = dq(8, b.b, 32);
  CHECK(x[0] == -64.0f);
  CHECK(x[1] == -0.5f);
  CHECK(x[2] == 0.0f);
  CHECK(x[3] == 0.5f);
  CHECK(x[4] == 63.5f);
  CHECK(x[31] == -3.5f);
}

TEST_CASE("Q4_0: low nibbles are elements 0..15, high nibbles 16..31, minus 8, times d") {
  Bytes b;
  b.u16(0x4000);                            // d = 2
  b.u8(0x0F);                               // x0 = (15-8)*2 = 14, x16 = (0-8)*2 = -16
  b.u8(0x81);                               // x1 = (1-8)*2 = -14, x17 = (8-8)*2 = 0
  for (int i = 2; i < 16; ++i) b.u8(0x88);  // zeros
  REQUIRE(b.b.size() == 18);
  auto x = dq(2, b.b, 32);
  CHECK(x[0] == 14.0f);
  CHECK(x[16] == -16.0f);
  CHECK(x[1] == -14.0f);
  CHECK(x[17] == 0.0f);
  for (int i = 2; i < 16; ++i) CHECK(x[static_cast<size_t>(i)] == 0.0f);
}

TEST_CASE("Q4_1: d * nibble + m") {
  Bytes b;
  b.u16(0x3C00).u16(0xBC00);                // d = 1, m = -1
  b.u8(0x3A);                               // x0 = 10 - 1 = 9, x16 = 3 - 1 = 2
  b.u8(0xF0);                               // x1 = 0 - 1 = -1, x17 = 15 - 1 = 14
  for (int i = 2; i < 16; ++i) b.u8(0x11);  // 1 - 1 = 0
  REQUIRE(b.b.size() == 20);
  auto x = dq(3, b.b, 32);
  CHECK(x[0] == 9.0f);
  CHECK(x[16] == 2.0f);
  CHECK(x[1] == -1.0f);
  CHECK(x[17] == 14.0f);
  CHECK(x[5] == 0.0f);
  CHECK(x[20] == 0.0f);
  // Two blocks in a row: the second one is independent.
  Bytes two = b;
  two.u16(0x4200).u16(0x3800);                // d = 3, m = 0.5
  for (int i = 0; i < 16; ++i) two.u8(0x21);  // lo 1 -> 3.5, hi 2 -> 6.5
  auto y = dq(3, two.b, 64);
  CHECK(y[32] == 3.5f);
  CHECK(y[48] == 6.5f);
  CHECK(y[0] == 9.0f);
}

TEST_CASE("Q5_0 and Q5_1: the fifth bit comes from qh (bit j for x[j], bit j+16 for x[j+16])") {
  Bytes a;
  a.u16(0x3C00);                            // d = 1
  a.u32((1u << 0) | (1u << 16));            // x0 and x16 get bit 4
  a.u8(0x21);                               // x0 = (1|16)-16 = 1, x16 = (2|16)-16 = 2
  for (int i = 1; i < 16; ++i) a.u8(0x00);  // x = 0 - 16 = -16
  REQUIRE(a.b.size() == 22);
  auto x = dq(6, a.b, 32);
  CHECK(x[0] == 1.0f);
  CHECK(x[16] == 2.0f);
  CHECK(x[1] == -16.0f);
  CHECK(x[31] == -16.0f);

  Bytes b;
  b.u16(0x3800).u16(0x4000);                // d = 0.5, m = 2
  b.u32((1u << 0) | (1u << 31));            // x0 and x31 get bit 4
  b.u8(0xFF);                               // x0 = 31*0.5+2 = 17.5, x16 = 15*0.5+2 = 9.5
  for (int i = 1; i < 16; ++i) b.u8(0x10);  // lo 0 -> 2, hi 1 -> 2.5; x31 = 17*0.5+2 = 10.5
  REQUIRE(b.b.size() == 24);
  auto y = dq(7, b.b, 32);
  CHECK(y[0] == 17.5f);
  CHECK(y[16] == 9.5f);
  CHECK(y[1] == 2.0f);
  CHECK(y[17] == 2.5f);
  CHECK(y[31] == 10.5f);
}

TEST_CASE("dequantize refuses unsupported types and wrong sizes") {
  std::vector<float> out(256);
  std::vector<uint8_t> src(210);
  CHECK_ERROR(dequantize(14, src.data(), src.size(), out.data(), 256), {"Q6_K"});
  CHECK_ERROR(dequantize(99, src.data(), src.size(), out.data(), 256), {"type#99"});
  CHECK_ERROR(dequantize(3, src.data(), 19, out.data(), 32), {"Q4_1", "20 bytes"});
  CHECK_ERROR(dequantize(3, src.data(), 20, out.data(), 31), {"blocks"});
  CHECK(ggml_row_bytes(3, 64) == 40u);
  CHECK_FALSE(ggml_row_bytes(3, 33).has_value());
  CHECK(std::string(ggml_type_name(8)) == "Q8_0");
}

// ---- reader ----------------------------------------------------------------------------------

TEST_CASE("reader: every metadata type, nested arrays, alignment and tensor data") {
  GgufBuilder g;
  g.kv.str("a.u8").u32(0).u8(200), ++g.n_kv;
  g.kv.str("a.i8").u32(1).put<int8_t>(-5), ++g.n_kv;
  g.kv.str("a.u16").u32(2).u16(65000), ++g.n_kv;
  g.kv.str("a.i16").u32(3).put<int16_t>(-300), ++g.n_kv;
  g.kv_u32("a.u32", 4000000000u);
  g.kv.str("a.i32").u32(5).put<int32_t>(-70000), ++g.n_kv;
  g.kv_f32("a.f32", 0.25f);
  g.kv_bool("a.bool", true);
  g.kv_str("a.str", "héllo");
  g.kv.str("a.u64").u32(10).u64(1ull << 40), ++g.n_kv;
  g.kv.str("a.i64").u32(11).put<int64_t>(-(1ll << 40)), ++g.n_kv;
  g.kv.str("a.f64").u32(12).put(2.5), ++g.n_kv;
  g.kv_str_array("a.strs", {"x", "", "yz"});
  g.kv_i32_array("a.ints", {1, -2, 3});
  g.kv.str("a.nested").u32(9).u32(9).u64(2);  // array of 2 arrays of f32
  g.kv.u32(6).u64(1).put(1.5f);
  g.kv.u32(6).u64(2).put(2.5f).put(3.5f);
  ++g.n_kv;
  g.kv_u32("general.alignment", 64);
  g.alignment = 64;
  g.tensor_f32("t.a", {3}, {1, 2, 3});
  g.tensor_f32("t.b", {2, 2}, {4, 5, 6, 7});
  const auto bytes = g.build();
  auto f = parse_bytes(bytes);
  REQUIRE_MESSAGE(f.is_ok(), f.status().to_string());
  CHECK((*f)->version() == 3);
  CHECK((*f)->alignment() == 64);
  CHECK((*f)->get_int("a.u8").value() == 200);
  CHECK((*f)->get_int("a.i8").value() == -5);
  CHECK((*f)->get_int("a.u16").value() == 65000);
  CHECK((*f)->get_int("a.i16").value() == -300);
  CHECK((*f)->get_int("a.u32").value() == 4000000000ll);
  CHECK((*f)->get_int("a.i32").value() == -70000);
  CHECK((*f)->get_float("a.f32").value() == 0.25);
  CHECK((*f)->get_bool("a.bool").value());
  CHECK((*f)->get_string("a.str").value() == "héllo");
  CHECK((*f)->get_int("a.u64").value() == (1ll << 40));
  CHECK((*f)->get_int("a.i64").value() == -(1ll << 40));
  CHECK((*f)->get_float("a.f64").value() == 2.5);
  CHECK((*f)->find("a.strs")->str_array == std::vector<std::string>{"x", "", "yz"});
  CHECK((*f)->find("a.ints")->int_array == std::vector<int64_t>{1, -2, 3});
  const GgufValue* nested = (*f)->find("a.nested");
  REQUIRE(nested != nullptr);
  REQUIRE(nested->arr_array.size() == 2);
  CHECK(nested->arr_array[1].float_array == std::vector<double>{2.5, 3.5});
  CHECK_ERROR((*f)->get_string("a.u32").status(), {"crafted.gguf", "a.u32", "expected a string"});
  CHECK((*f)->get_int("nope").status().code() == Code::kNotFound);

  REQUIRE((*f)->tensors().size() == 2);
  const GgufTensorInfo* tb = (*f)->find_tensor("t.b");
  REQUIRE(tb != nullptr);
  CHECK(tb->offset == 64);  // 12 bytes of t.a rounded up to the alignment
  CHECK(tb->shape() == std::vector<int64_t>{2, 2});
  std::vector<float> out(4);
  REQUIRE((*f)->tensor_to_fp32(*tb, out.data(), out.size()).is_ok());
  CHECK(out == std::vector<float>{4, 5, 6, 7});
}

TEST_CASE("reader: every truncation of a valid file is refused, never read past the end") {
  GgufBuilder g;
  g.kv_str("general.architecture", "llama");
  g.kv_str_array("tokenizer.ggml.tokens", {"a", "b"});
  g.tensor_f32("blk.0.attn_norm.weight", {4}, {1, 2, 3, 4});
  g.tensor_f32("output_norm.weight", {4}, {1, 2, 3, 4});
  const auto full = g.build();
  REQUIRE(parse_bytes(full).is_ok());
  for (size_t cut = 0; cut < full.size(); ++cut) {
    // A fresh heap copy of exactly `cut` bytes, so that ASan would catch any read past it.
    std::vector<uint8_t> part(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(cut));
    auto r = GgufFile::parse(part.data(), part.size(), "cut.gguf");
    REQUIRE_MESSAGE(!r.is_ok(), "a file cut to " << cut << " bytes was accepted");
    CHECK(r.status().message().find("cut.gguf") == 0);
  }
  // The last tensor's data is cut: the message names the tensor and says truncated.
  std::vector<uint8_t> part(full.begin(), full.end() - 4);
  CHECK_ERROR(GgufFile::parse(part.data(), part.size(), "cut.gguf").status(),
              {"cut.gguf", "output_norm.weight", "truncated"});
  // The same through a real file on disk.
  const std::string path = write_temp(part, "trunc");
  CHECK_ERROR(GgufFile::open(path).status(), {path.c_str(), "output_norm.weight"});
  std::remove(path.c_str());
}

TEST_CASE("reader: inconsistent files are refused with the key or tensor named") {
  auto base = [] {
    GgufBuilder g;
    g.kv_str("general.architecture", "llama");
    g.tensor_f32("w", {32, 2}, std::vector<float>(64, 1.0f));
    return g;
  };
  {
    auto b = base().build();
    b[0] = 'X';
    CHECK_ERROR(parse_bytes(b).status(), {"bad magic"});
  }
  {
    GgufBuilder g = base();
    g.version = 1;
    CHECK(parse_bytes(g.build()).status().code() == Code::kVersionMismatch);
  }
  {
    GgufBuilder g = base();
    g.tensors[0].offset_override = 4096;  // past the end
    CHECK_ERROR(parse_bytes(g.build()).status(), {"\"w\"", "past the end"});
  }
  {
    GgufBuilder g = base();
    g.tensors[0].offset_override = 8;  // not aligned
    CHECK_ERROR(parse_bytes(g.build()).status(), {"\"w\"", "alignment"});
  }
  {
    GgufBuilder g = base();
    g.tensor_f32("w2", {4}, {1, 2, 3, 4});
    g.tensors[1].offset_override = 128;  // inside w (256 bytes)
    CHECK_ERROR(parse_bytes(g.build()).status(), {"overlaps"});
  }
  {
    GgufBuilder g = base();
    g.tensors[0].type = 77;
    CHECK_ERROR(parse_bytes(g.build()).status(), {"\"w\"", "unknown ggml type 77"});
  }
  {
    GgufBuilder g = base();
    g.tensors[0].type = 3;  // Q4_1 needs rows of 32k elements
    g.tensors[0].ne = {30, 2};
    CHECK_ERROR(parse_bytes(g.build()).status(), {"\"w\"", "block size"});
  }
  {
    GgufBuilder g = base();
    g.tensors[0].ne = {2, 2, 2, 2, 2};
    CHECK_ERROR(parse_bytes(g.build()).status(), {"\"w\"", "n_dims"});
  }
  {
    GgufBuilder g = base();
    g.tensors[0].ne = {0, 2};
    CHECK_ERROR(parse_bytes(g.build()).status(), {"\"w\"", "dimension"});
  }
  {
    GgufBuilder g = base();
    g.tensor_f32("w", {4}, {1, 2, 3, 4});
    CHECK_ERROR(parse_bytes(g.build()).status(), {"\"w\"", "twice"});
  }
  {
    GgufBuilder g = base();
    g.kv_str("general.architecture", "qwen2");
    CHECK_ERROR(parse_bytes(g.build()).status(), {"general.architecture", "twice"});
  }
  {
    GgufBuilder g = base();
    g.kv.str("huge").u32(9).u32(4).u64(1ull << 60);  // an array that cannot fit
    ++g.n_kv;
    CHECK_ERROR(parse_bytes(g.build()).status(), {"huge", "array count"});
  }
  {
    GgufBuilder g = base();
    g.kv.str("s").u32(8).u64(1ull << 50);  // a string longer than the file
    ++g.n_kv;
    CHECK_ERROR(parse_bytes(g.build()).status(), {"\"s\"", "string"});
  }
  {
    GgufBuilder g = base();
    g.kv.str("t").u32(13).u32(0);
    ++g.n_kv;
    CHECK_ERROR(parse_bytes(g.build()).status(), {"\"t\"", "unknown value type"});
  }
  {
    GgufBuilder g = base();
    g.kv.str("b").u32(7).u8(2);
    ++g.n_kv;
    CHECK_ERROR(parse_bytes(g.build()).status(), {"\"b\"", "bool"});
  }
  {
    GgufBuilder g = base();
    g.kv_u32("general.alignment", 48);
    CHECK_ERROR(parse_bytes(g.build()).status(), {"general.alignment"});
  }
  {
    GgufBuilder g;  // tensor count larger than the file could hold
    Bytes b;
    b.u32(0x46554747).u32(3).u64(1ull << 40).u64(0);
    CHECK_ERROR(parse_bytes(b.b).status(), {"tensor count"});
  }
  CHECK(GgufFile::open("/nonexistent.gguf").status().code() == Code::kIoError);
}

// ---- loader on a crafted llama file ----------------------------------------------------------

namespace {

// The permutation convert_hf_to_gguf.py applies to llama Q/K rows (reshape(n_head, 2, hd/2, ...)
// .swapaxes(1, 2)): GGUF row h*hd + 2i + s = HF row h*hd + s*hd/2 + i.
std::vector<float> permute_like_llama_cpp(const std::vector<float>& hf, int64_t n_head, int64_t hd,
                                          int64_t cols) {
  std::vector<float> out(hf.size());
  for (int64_t h = 0; h < n_head; ++h) {
    for (int64_t i = 0; i < hd / 2; ++i) {
      for (int64_t s = 0; s < 2; ++s) {
        for (int64_t c = 0; c < cols; ++c) {
          out[static_cast<size_t>((h * hd + 2 * i + s) * cols + c)] =
              hf[static_cast<size_t>((h * hd + s * hd / 2 + i) * cols + c)];
        }
      }
    }
  }
  return out;
}

std::vector<float> iota_values(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>(i) + 0.5f;
  return v;
}

// A tiny llama: vocab 8, hidden 8, 1 layer, 2 heads (hd 4), 1 kv head, ffn 32, tied.
GgufBuilder tiny_llama(const std::vector<float>& wq_hf, const std::vector<float>& wk_hf) {
  GgufBuilder g;
  g.kv_str("general.architecture", "llama");
  g.kv_u32("llama.embedding_length", 8);
  g.kv_u32("llama.block_count", 1);
  g.kv_u32("llama.feed_forward_length", 32);
  g.kv_u32("llama.attention.head_count", 2);
  g.kv_u32("llama.attention.head_count_kv", 1);
  g.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  g.kv_f32("llama.rope.freq_base", 50000.0f);
  g.kv_u32("llama.context_length", 128);
  g.kv_str("tokenizer.ggml.model", "gpt2");
  g.kv_str("tokenizer.ggml.pre", "smollm");
  g.kv_str_array("tokenizer.ggml.tokens", {"a", "b", "c", "ab", "abc", "<s>", "</s>", "Ġ"});
  g.kv_i32_array("tokenizer.ggml.token_type", {1, 1, 1, 1, 1, 3, 3, 1});
  g.kv_str_array("tokenizer.ggml.merges", {"a b", "ab c"});
  g.kv_u32("tokenizer.ggml.bos_token_id", 5);
  g.kv_u32("tokenizer.ggml.eos_token_id", 6);
  g.kv_str("tokenizer.chat_template", "{{ messages }}");
  g.tensor_f32("token_embd.weight", {8, 8}, iota_values(64, 0.01f));
  g.tensor_f32("output_norm.weight", {8}, iota_values(8, 1.0f));
  g.tensor_f32("blk.0.attn_norm.weight", {8}, iota_values(8, 2.0f));
  g.tensor_f32("blk.0.attn_q.weight", {8, 8}, permute_like_llama_cpp(wq_hf, 2, 4, 8));
  g.tensor_f32("blk.0.attn_k.weight", {8, 4}, permute_like_llama_cpp(wk_hf, 1, 4, 8));
  g.tensor_f32("blk.0.attn_v.weight", {8, 4}, iota_values(32, 0.3f));
  g.tensor_f32("blk.0.attn_output.weight", {8, 8}, iota_values(64, 0.4f));
  g.tensor_f32("blk.0.ffn_norm.weight", {8}, iota_values(8, 0.5f));
  g.tensor_f32("blk.0.ffn_gate.weight", {8, 32}, iota_values(256, 0.6f));
  g.tensor_f32("blk.0.ffn_up.weight", {8, 32}, iota_values(256, 0.7f));
  g.tensor_f32("blk.0.ffn_down.weight", {32, 8}, iota_values(256, 0.8f));
  return g;
}

}  // namespace

TEST_CASE("loader: crafted llama file maps config, un-permutes Q/K, builds the tokenizer") {
  const auto wq = iota_values(64, 1.0f);
  const auto wk = iota_values(32, -1.0f);
  const std::string path = write_temp(tiny_llama(wq, wk).build(), "tiny");
  auto m = load_model(path);
  REQUIRE_MESSAGE(m.is_ok(), m.status().to_string());
  const ModelConfig& c = m->weights.config;
  CHECK(m->format == "gguf");
  CHECK(c.arch == Arch::kLlama);
  CHECK(c.vocab_size == 8);
  CHECK(c.hidden_size == 8);
  CHECK(c.num_heads == 2);
  CHECK(c.num_kv_heads == 1);
  CHECK(c.head_dim == 4);
  CHECK(c.intermediate_size == 32);
  CHECK(c.rope_theta == 50000.0);
  CHECK(c.rms_norm_eps == doctest::Approx(1e-5));
  CHECK(c.max_position_embeddings == 128);
  CHECK(c.tie_word_embeddings);
  CHECK(c.bos_token_id == 5);
  CHECK(c.eos_token_ids == std::vector<int32_t>{6});
  CHECK(m->weights.lm_head.empty());
  CHECK(&m->weights.output_weight() == &m->weights.embed);
  const LayerWeights& l = m->weights.layers.at(0);
  CHECK(l.wq.shape == std::vector<int64_t>{8, 8});
  CHECK(l.wq.data == wq);  // back in HF's half-split layout
  CHECK(l.wk.data == wk);
  CHECK(l.wv.shape == std::vector<int64_t>{4, 8});
  CHECK(l.w_down.shape == std::vector<int64_t>{8, 32});
  CHECK(l.bq.empty());
  CHECK(m->chat_template == "{{ messages }}");
  REQUIRE(m->tokenizer.has_value());
  CHECK(m->tokenizer->encode("abc") == std::vector<int32_t>{4});
  CHECK(m->tokenizer->encode("<s>ab") == std::vector<int32_t>{5, 3});
  CHECK(m->tokenizer->is_special(6));
  std::remove(path.c_str());
}

TEST_CASE("loader: missing / misshapen / unsupported tensors and bad metadata name the culprit") {
  const auto wq = iota_values(64, 1.0f);
  const auto wk = iota_values(32, -1.0f);
  {
    GgufBuilder g = tiny_llama(wq, wk);
    g.tensors.erase(g.tensors.begin() + 5);  // blk.0.attn_v.weight
    const std::string path = write_temp(g.build(), "missing");
    CHECK_ERROR(load_model(path).status(), {path.c_str(), "blk.0.attn_v.weight", "missing"});
    std::remove(path.c_str());
  }
  {
    GgufBuilder g = tiny_llama(wq, wk);
    g.tensors[9].ne = {8, 16};  // ffn_up: 16 rows instead of 32
    g.tensors[9].data.resize(16 * 8 * 4);
    const std::string path = write_temp(g.build(), "shape");
    CHECK_ERROR(load_model(path).status(), {path.c_str(), "blk.0.ffn_up.weight", "shape"});
    std::remove(path.c_str());
  }
  {
    GgufBuilder g = tiny_llama(wq, wk);
    g.tensors[0].type = 14;  // token_embd as Q6_K: 256-element rows needed -> reader refuses
    CHECK_ERROR(parse_bytes(g.build()).status(), {"token_embd.weight"});
  }
  {
    GgufBuilder g = tiny_llama(wq, wk);
    g.kv_u32("llama.vocab_size", 9);  // disagrees with token_embd rows
    const std::string path = write_temp(g.build(), "vocab");
    CHECK_ERROR(load_model(path).status(), {path.c_str(), "vocab_size", "inconsistent"});
    std::remove(path.c_str());
  }
  {
    GgufBuilder g = tiny_llama(wq, wk);
    g.kv_str("general.architecture", "gpt2");  // duplicate key -> reader refuses
    CHECK_FALSE(parse_bytes(g.build()).is_ok());
  }
  {
    GgufBuilder g = tiny_llama(wq, wk);
    g.kv_str_array("tokenizer.ggml.merges", {"a b", "abc"});  // duplicate key as well
    CHECK_FALSE(parse_bytes(g.build()).is_ok());
  }
}

TEST_CASE("unpermute_rope_rows inverts llama.cpp's permutation for odd shapes") {
  for (int64_t heads : {1, 3, 9}) {
    for (int64_t hd : {2, 8, 64}) {
      const int64_t cols = 3;
      const auto hf = iota_values(static_cast<size_t>(heads * hd * cols), 1.0f);
      auto w = permute_like_llama_cpp(hf, heads, hd, cols);
      if (hd > 2) CHECK(w != hf);
      unpermute_rope_rows(w.data(), heads, hd, cols);
      CHECK(w == hf);
    }
  }
}

// ---- the real SmolLM2 file --------------------------------------------------------------------

namespace {

const LoadedModel& smol() {
  static LoadedModel* m = [] {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = load_model(kSmolPath);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    REQUIRE_MESSAGE(r.is_ok(), r.status().to_string() << " (run deploy/fetch-models.sh)");
    MESSAGE("SmolLM2-135M Q4_1 GGUF load (parse + dequantise + tokenizer): " << s << " s");
    return new LoadedModel(std::move(r).value());
  }();
  return *m;
}

const Tensor& by_hf_name(const ModelWeights& w, const std::string& name) {
  if (name == "model.embed_tokens.weight") return w.embed;
  if (name == "model.norm.weight") return w.final_norm;
  const std::string p = "model.layers.";
  REQUIRE(name.rfind(p, 0) == 0);
  const size_t dot = name.find('.', p.size());
  const LayerWeights& l = w.layers.at(std::stoul(name.substr(p.size(), dot - p.size())));
  const std::string rest = name.substr(dot + 1);
  if (rest == "self_attn.q_proj.weight") return l.wq;
  if (rest == "self_attn.k_proj.weight") return l.wk;
  if (rest == "self_attn.v_proj.weight") return l.wv;
  if (rest == "self_attn.o_proj.weight") return l.wo;
  if (rest == "mlp.gate_proj.weight") return l.w_gate;
  if (rest == "mlp.up_proj.weight") return l.w_up;
  if (rest == "mlp.down_proj.weight") return l.w_down;
  if (rest == "input_layernorm.weight") return l.attn_norm;
  if (rest == "post_attention_layernorm.weight") return l.ffn_norm;
  FAIL("unmapped tensor " << name);
  static Tensor none;
  return none;
}

json load_reference() {
  std::ifstream in("tests/fixtures/engine/smollm2_gguf_reference.json");
  REQUIRE_MESSAGE(in.good(), "missing tests/fixtures/engine/smollm2_gguf_reference.json");
  return json::parse(in);
}

}  // namespace

TEST_CASE("SmolLM2 GGUF: config matches what HF transformers reads") {
  const ModelConfig& c = smol().weights.config;
  const json ref = load_reference().at("config");
  CHECK(c.arch == Arch::kLlama);
  CHECK(c.num_layers == 30);
  CHECK(c.hidden_size == 576);
  CHECK(c.num_heads == 9);
  CHECK(c.num_kv_heads == 3);
  CHECK(c.head_dim == 64);
  CHECK(c.vocab_size == ref.at("vocab_size").get<int64_t>());
  CHECK(c.hidden_size == ref.at("hidden_size").get<int64_t>());
  CHECK(c.num_layers == ref.at("num_hidden_layers").get<int64_t>());
  CHECK(c.num_heads == ref.at("num_attention_heads").get<int64_t>());
  CHECK(c.num_kv_heads == ref.at("num_key_value_heads").get<int64_t>());
  CHECK(c.intermediate_size == ref.at("intermediate_size").get<int64_t>());
  CHECK(c.rms_norm_eps == doctest::Approx(ref.at("rms_norm_eps").get<double>()).epsilon(1e-6));
  CHECK(c.rope_theta == ref.at("rope_theta").get<double>());
  CHECK(c.max_position_embeddings == ref.at("max_position_embeddings").get<int64_t>());
  CHECK(c.tie_word_embeddings == ref.at("tie_word_embeddings").get<bool>());
  CHECK(c.bos_token_id == ref.at("bos_token_id").get<int32_t>());
  CHECK(c.eos_token_ids.at(0) == ref.at("eos_token_id").get<int32_t>());
  CHECK_FALSE(c.attention_bias);
  CHECK(smol().weights.validate().is_ok());
  CHECK(smol().chat_template.find("<|im_start|>") != std::string::npos);
}

TEST_CASE("SmolLM2 GGUF: dequantised tensors equal HF transformers' (Q8_0, Q4_1, F32; Q/K order)") {
  const json ref = load_reference().at("tensors");
  REQUIRE(ref.size() >= 10);
  for (const auto& [name, e] : ref.items()) {
    const Tensor& t = by_hf_name(smol().weights, name);
    CHECK_MESSAGE(t.shape == e.at("shape").get<std::vector<int64_t>>(), name);
    double sum = 0, abs_sum = 0, wsum = 0;
    for (size_t i = 0; i < t.data.size(); ++i) {
      const double x = t.data[i];
      sum += x;
      abs_sum += std::fabs(x);
      wsum += x * static_cast<double>(i % 97 + 1);
    }
    const double scale = e.at("abs_sum").get<double>();
    CHECK_MESSAGE(std::fabs(abs_sum - scale) <= 1e-9 * scale + 1e-9, name);
    CHECK_MESSAGE(std::fabs(sum - e.at("sum").get<double>()) <= 1e-9 * scale + 1e-9, name);
    CHECK_MESSAGE(std::fabs(wsum - e.at("weighted_sum").get<double>()) <= 1e-9 * 97 * scale, name);
    const int64_t cols = t.shape.size() == 2 ? t.shape[1] : 0;
    for (const auto& [row, vals] : e.at("slices").items()) {
      const int64_t r = std::stoll(row);
      for (size_t j = 0; j < vals.size(); ++j) {
        const float want = vals[j].get<float>();
        const float got = t.data[static_cast<size_t>(r * cols) + j];
        CHECK_MESSAGE(got == want, name << " row " << r << " col " << j);  // bit-exact
      }
    }
  }
}

TEST_CASE("SmolLM2 GGUF: the embedded tokenizer gives HF's ids") {
  REQUIRE(smol().tokenizer.has_value());
  const auto& tok = *smol().tokenizer;
  CHECK(tok.vocab_size() == 49152);
  for (const json& row : load_reference().at("tokenizer")) {
    const std::string text = row.at("text");
    CHECK_MESSAGE(tok.encode(text) == row.at("ids").get<std::vector<int32_t>>(), text);
  }
  std::ifstream in("tests/fixtures/tokenizer/smollm2_encode.json");
  REQUIRE(in.good());
  const json fixture = json::parse(in);
  int n = 0;
  for (const json& row : fixture.at("strings")) {
    const std::string text = row.at("text");
    CHECK_MESSAGE(tok.encode(text) == row.at("ids").get<std::vector<int32_t>>(), text);
    ++n;
  }
  CHECK(n >= 200);
}
