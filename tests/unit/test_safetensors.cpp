// safetensors reader: the real MiniLM file loads; crafted bad files are refused with a message
// naming the file (and tensor), never a crash; fp16/bf16 conversion; sharded directories.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shared/safetensors/safetensors_reader.h"

namespace fs = std::filesystem;
using keep::Code;
using namespace keep::safetensors;

namespace {

const std::string kModelDir = std::string(KEEP_SOURCE_DIR) + "/models/all-MiniLM-L6-v2";

// A fresh directory under the system temp dir, removed at the end of the test case.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() / ("keep_test_safetensors_" + std::to_string(::getpid()) +
                                        "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

// 8-byte length + header + data.
std::string st_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// Opens `bytes` written as a file and expects a refusal whose message names the file and
// contains `needle`.
void expect_refused(const TempDir& dir, const std::string& bytes, const std::string& needle,
                    Code code = Code::kMalformed) {
  const std::string path = dir.file("bad.safetensors");
  write_bytes(path, bytes);
  auto r = SafetensorsFile::open(path);
  REQUIRE_FALSE(r.is_ok());
  CHECK(r.status().code() == code);
  INFO(r.status().to_string());
  CHECK(r.status().message().find(path) != std::string::npos);
  CHECK(r.status().message().find(needle) != std::string::npos);
}

void require_model() {
  REQUIRE_MESSAGE(
      fs::exists(kModelDir + "/model.safetensors"),
      "model missing: " << kModelDir << " — run deploy/fetch-models.sh (CI fetches models first)");
}

}  // namespace

TEST_CASE("the real all-MiniLM-L6-v2 weights load with the expected shapes") {
  require_model();
  auto r = SafetensorsModel::open_dir(kModelDir);
  REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
  const SafetensorsModel& m = **r;
  CHECK(m.shard_count() == 1);
  CHECK(m.names().size() > 100);

  auto we = m.tensor("embeddings.word_embeddings.weight", {30522, 384});
  REQUIRE_MESSAGE(we.is_ok(), we.status().to_string());
  CHECK(we->dtype == DType::kF32);
  CHECK(we->bytes == 30522u * 384u * 4u);
  auto f = to_fp32(*we);
  REQUIRE(f.is_ok());
  CHECK(f->size() == 30522u * 384u);
  bool finite = true;
  for (float v : *f) finite = finite && std::isfinite(v);
  CHECK(finite);

  auto pos_ids = m.tensor("embeddings.position_ids");
  REQUIRE(pos_ids.is_ok());
  CHECK(pos_ids->dtype == DType::kI64);
  CHECK(pos_ids->shape == std::vector<int64_t>{1, 512});
  auto bad_conv = to_fp32(*pos_ids);
  REQUIRE_FALSE(bad_conv.is_ok());
  CHECK(bad_conv.status().message().find("embeddings.position_ids") != std::string::npos);

  auto missing = m.tensor("no.such.tensor");
  REQUIRE_FALSE(missing.is_ok());
  CHECK(missing.status().code() == Code::kNotFound);
  CHECK(missing.status().message().find("no.such.tensor") != std::string::npos);

  auto wrong = m.tensor("embeddings.word_embeddings.weight", {384, 30522});
  REQUIRE_FALSE(wrong.is_ok());
  CHECK(wrong.status().message().find("[30522, 384]") != std::string::npos);
}

TEST_CASE("a truncated copy of the real file is refused") {
  require_model();
  TempDir dir;
  std::ifstream in(kModelDir + "/model.safetensors", std::ios::binary);
  std::string head(1 << 20, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  REQUIRE(in.gcount() == static_cast<std::streamsize>(head.size()));
  expect_refused(dir, head, "run past the data buffer");
  expect_refused(dir, head.substr(0, 100), "runs past the end of the file");
}

TEST_CASE("F16 and BF16 convert to fp32, from unaligned data") {
  TempDir dir;
  // F16: 1, -2, 0.5, 65504, smallest subnormal, -0, +inf. BF16: 1, -3.
  const uint16_t f16[] = {0x3C00, 0xC000, 0x3800, 0x7BFF, 0x0001, 0x8000, 0x7C00};
  const uint16_t bf16[] = {0x3F80, 0xC040};
  std::string data(reinterpret_cast<const char*>(f16), sizeof f16);
  data.append(reinterpret_cast<const char*>(bf16), sizeof bf16);
  nlohmann::json h;
  h["half"] = {{"dtype", "F16"}, {"shape", {7}}, {"data_offsets", {0, 14}}};
  h["brain"] = {{"dtype", "BF16"}, {"shape", {2}}, {"data_offsets", {14, 18}}};
  h["__metadata__"] = {{"format", "pt"}};
  std::string header = h.dump();
  if (header.size() % 2 == 0) header += ' ';  // odd length: the data starts unaligned
  write_bytes(dir.file("ok.safetensors"), st_file(header, data));

  auto r = SafetensorsFile::open(dir.file("ok.safetensors"));
  REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
  CHECK((*r)->metadata().at("format") == "pt");
  CHECK((*r)->names() == std::vector<std::string>{"half", "brain"});
  auto half = (*r)->tensor("half");
  REQUIRE(half.is_ok());
  auto hf = to_fp32(*half);
  REQUIRE(hf.is_ok());
  CHECK((*hf)[0] == 1.0f);
  CHECK((*hf)[1] == -2.0f);
  CHECK((*hf)[2] == 0.5f);
  CHECK((*hf)[3] == 65504.0f);
  CHECK((*hf)[4] == doctest::Approx(5.9604645e-8f).epsilon(1e-6));
  CHECK((*hf)[5] == 0.0f);
  CHECK(std::signbit((*hf)[5]));
  CHECK(std::isinf((*hf)[6]));
  auto brain = (*r)->tensor("brain");
  REQUIRE(brain.is_ok());
  auto bf = to_fp32(*brain);
  REQUIRE(bf.is_ok());
  CHECK((*bf)[0] == 1.0f);
  CHECK((*bf)[1] == -3.0f);
  float small[1];
  CHECK_FALSE(to_fp32(*half, small, 1).is_ok());  // output too small: refused, no overflow
}

TEST_CASE("inconsistent or truncated files are refused with a message") {
  TempDir dir;
  const std::string data16(16, '\0');
  auto one = [](const std::string& dtype, const nlohmann::json& shape, const nlohmann::json& off) {
    nlohmann::json h;
    h["t"] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", off}};
    return h.dump();
  };
  expect_refused(dir, "", "shorter than the 8-byte header length");
  expect_refused(dir, "\x05\x00\x00", "shorter than the 8-byte header length");
  expect_refused(dir, le64(1ull << 60) + "{}", "exceeds the limit");
  expect_refused(dir, le64(1000) + "{\"a\":1}", "runs past the end of the file");
  expect_refused(dir, st_file("{not json", ""), "not valid JSON");
  expect_refused(dir, st_file("[1,2,3]", ""), "not a JSON object");
  expect_refused(dir, st_file(one("F17", {4}, {0, 16}), data16), "unknown dtype 'F17'");
  expect_refused(dir, st_file(one("F32", {3}, {0, 16}), data16), "tensor 't': shape [3] x F32");
  expect_refused(dir, st_file(one("F32", {8}, {0, 32}), data16), "run past the data buffer");
  expect_refused(dir, st_file(one("F32", {0}, {16, 8}), data16), "begin > end");
  expect_refused(dir, st_file(one("F32", {-4}, {0, 16}), data16), "non-natural dim");
  expect_refused(dir, st_file(one("F32", {2.5}, {0, 16}), data16), "non-natural dim");
  expect_refused(dir, st_file(one("F32", {1ull << 40, 1ull << 40}, {0, 16}), data16), "overflows");
  expect_refused(dir, st_file(one("F32", {4}, {0}), data16), "data_offsets");
  expect_refused(dir, st_file(one("F32", {4}, {-1, 15}), data16), "not natural numbers");
  expect_refused(dir, st_file("{\"t\": 5}", data16), "entry is not an object");
  expect_refused(dir, st_file("{\"t\": {\"shape\": [4], \"data_offsets\": [0, 16]}}", data16),
                 "dtype");
  expect_refused(dir, st_file("{\"__metadata__\": {\"a\": 1}}", ""), "__metadata__");
  {
    nlohmann::json h;
    h["a"] = {{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {0, 12}}};
    h["b"] = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {8, 16}}};
    expect_refused(dir, st_file(h.dump(), data16), "overlap");
  }
  // Not a file / no file.
  auto d = SafetensorsFile::open(dir.path.string());
  REQUIRE_FALSE(d.is_ok());
  CHECK(d.status().code() == Code::kIoError);
  auto n = SafetensorsFile::open(dir.file("absent.safetensors"));
  REQUIRE_FALSE(n.is_ok());
  CHECK(n.status().code() == Code::kIoError);
  CHECK(n.status().message().find("absent.safetensors") != std::string::npos);
}

TEST_CASE("zero-sized tensors, gaps and an empty header are accepted") {
  TempDir dir;
  nlohmann::json h;
  h["empty"] = {{"dtype", "F32"}, {"shape", {0, 3}}, {"data_offsets", {4, 4}}};
  h["scalar"] = {{"dtype", "I32"}, {"shape", nlohmann::json::array()}, {"data_offsets", {8, 12}}};
  write_bytes(dir.file("ok.safetensors"), st_file(h.dump(), std::string(16, '\x01')));
  auto r = SafetensorsFile::open(dir.file("ok.safetensors"));
  REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
  CHECK((*r)->tensor("empty")->numel() == 0);
  CHECK((*r)->tensor("scalar")->numel() == 1);

  write_bytes(dir.file("none.safetensors"), st_file("{}", ""));
  auto e = SafetensorsFile::open(dir.file("none.safetensors"));
  REQUIRE(e.is_ok());
  CHECK((*e)->size() == 0);
}

TEST_CASE("parse() reads a file held in memory like open() (what the fuzzer drives)") {
  nlohmann::json h;
  h["t"] = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}};
  const std::string bytes = st_file(h.dump(), std::string(8, '\0'));
  auto r = SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                  "in-memory");
  REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
  CHECK((*r)->file_size() == bytes.size());
  CHECK((*r)->tensor("t", {2}).is_ok());
  auto bad = SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), 7, "cut");
  REQUIRE_FALSE(bad.is_ok());
  CHECK(bad.status().message().find("'cut'") != std::string::npos);
}

// Found by fuzz_safetensors_reader (tests/fuzz/corpus/fuzz_safetensors_reader/crash-*).
TEST_CASE("hostile headers: empty tensors of huge dims, brackets nested 100000 deep") {
  TempDir dir;
  // numel is 0, but TensorView::numel() multiplied 2^62 * 2 in int64 before reaching the 0.
  nlohmann::json h;
  h["t"] = {{"dtype", "F32"}, {"shape", {1ull << 62, 2, 0}}, {"data_offsets", {0, 0}}};
  expect_refused(dir, st_file(h.dump(), ""), "overflows");
  // An empty F32 tensor converted into an empty vector passed its nullptr data() to memcpy.
  nlohmann::json e;
  e["t"] = {{"dtype", "F32"}, {"shape", {2, 0}}, {"data_offsets", {0, 0}}};
  const std::string empty = st_file(e.dump(), "");
  auto f =
      SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(empty.data()), empty.size(), "e");
  REQUIRE(f.is_ok());
  auto v = keep::safetensors::to_fp32(*(*f)->tensor("t"));
  REQUIRE(v.is_ok());
  CHECK(v->empty());
  // The error message dump()ed the shape recursively and overflowed the stack.
  const std::string deep = "{\"t\":{\"dtype\":\"F32\",\"shape\":[" + std::string(100000, '[') +
                           std::string(100000, ']') + "],\"data_offsets\":[0,0]}}";
  expect_refused(dir, st_file(deep, ""), "nests deeper than 64 levels");
}

TEST_CASE("a sharded directory resolves tensors through the index") {
  TempDir dir;
  const float a[] = {1, 2, 3, 4};
  const float b[] = {5, 6};
  nlohmann::json ha, hb;
  ha["w.a"] = {{"dtype", "F32"}, {"shape", {2, 2}}, {"data_offsets", {0, 16}}};
  hb["w.b"] = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}};
  write_bytes(dir.file("model-00001-of-00002.safetensors"),
              st_file(ha.dump(), std::string(reinterpret_cast<const char*>(a), sizeof a)));
  write_bytes(dir.file("model-00002-of-00002.safetensors"),
              st_file(hb.dump(), std::string(reinterpret_cast<const char*>(b), sizeof b)));
  nlohmann::json index;
  index["metadata"] = {{"total_size", 24}};
  index["weight_map"] = {{"w.a", "model-00001-of-00002.safetensors"},
                         {"w.b", "model-00002-of-00002.safetensors"}};
  write_bytes(dir.file("model.safetensors.index.json"), index.dump());

  auto m = SafetensorsModel::open_dir(dir.path.string());
  REQUIRE_MESSAGE(m.is_ok(), m.status().to_string());
  CHECK((*m)->shard_count() == 2);
  CHECK((*m)->names() == std::vector<std::string>{"w.a", "w.b"});
  auto tb = (*m)->tensor("w.b", {2});
  REQUIRE(tb.is_ok());
  CHECK(to_fp32(*tb).value() == std::vector<float>{5, 6});

  // The index names a tensor its shard does not hold.
  index["weight_map"]["w.c"] = "model-00002-of-00002.safetensors";
  write_bytes(dir.file("model.safetensors.index.json"), index.dump());
  auto bad = SafetensorsModel::open_dir(dir.path.string());
  REQUIRE_FALSE(bad.is_ok());
  CHECK(bad.status().code() == Code::kCorrupt);
  CHECK(bad.status().message().find("w.c") != std::string::npos);

  // A shard path that leaves the directory.
  index["weight_map"] = {{"w.a", "../model-00001-of-00002.safetensors"}};
  write_bytes(dir.file("model.safetensors.index.json"), index.dump());
  auto escape = SafetensorsModel::open_dir(dir.path.string());
  REQUIRE_FALSE(escape.is_ok());
  CHECK(escape.status().message().find("invalid shard") != std::string::npos);

  // Neither file.
  TempDir empty;
  auto none = SafetensorsModel::open_dir(empty.path.string());
  REQUIRE_FALSE(none.is_ok());
  CHECK(none.status().code() == Code::kNotFound);
}
