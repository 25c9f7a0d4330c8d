// BertEncoder against sentence-transformers: cosine >= 0.999 for every fixture sentence, batch
// and single give the same embeddings, bad model directories give clear errors. Also the gemm
// wrappers against a naive loop (the encoder's only products).
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "services/manager/encoder/bert_encoder.h"
#include "shared/blas/gemm.h"

namespace fs = std::filesystem;
using keep::Code;
using keep::manager::BertEncoder;
using keep::manager::EncoderOptions;
using keep::manager::PoolingMode;

namespace {

const std::string kModelDir = std::string(KEEP_SOURCE_DIR) + "/models/all-MiniLM-L6-v2";
const std::string kFixture =
    std::string(KEEP_SOURCE_DIR) + "/tests/fixtures/encoder/minilm_reference.json";

void require_model() {
  REQUIRE_MESSAGE(
      fs::exists(kModelDir + "/model.safetensors"),
      "model missing: " << kModelDir << " — run deploy/fetch-models.sh (CI fetches models first)");
}

nlohmann::json load_fixture() {
  std::ifstream in(kFixture);
  REQUIRE_MESSAGE(
      in.good(), "fixture missing: " << kFixture << " (scripts/make_encoder_fixture.py writes it)");
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

// One encoder for the whole test binary (loading takes ~0.3 s).
const BertEncoder& encoder() {
  static std::unique_ptr<BertEncoder> enc = [] {
    auto r = BertEncoder::load(kModelDir);
    REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
    return std::move(r).value();
  }();
  return *enc;
}

// A model directory made of symlinks to the real files, with some files replaced.
struct PatchedModelDir {
  fs::path path;
  PatchedModelDir() {
    path = fs::temp_directory_path() / ("keep_test_bert_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path / "1_Pooling");
    for (const auto& e : fs::recursive_directory_iterator(kModelDir)) {
      if (!e.is_regular_file()) continue;
      const fs::path rel = fs::relative(e.path(), kModelDir);
      fs::create_directories((path / rel).parent_path());
      fs::create_symlink(e.path(), path / rel);
    }
  }
  ~PatchedModelDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  // Replaces `rel` with the real file's JSON after `edit`.
  template <typename F>
  void patch_json(const std::string& rel, F edit) {
    std::ifstream in(fs::path(kModelDir) / rel);
    nlohmann::json j = nlohmann::json::parse(in);
    edit(j);
    fs::remove(path / rel);
    std::ofstream(path / rel) << j.dump();
  }
  keep::Status load_status() const {
    auto r = BertEncoder::load(path.string());
    return r.status();
  }
};

}  // namespace

TEST_CASE("embeddings match sentence-transformers (cosine >= 0.999 for every sentence)") {
  require_model();
  const nlohmann::json fx = load_fixture();
  const BertEncoder& enc = encoder();
  CHECK(enc.dim() == 384);
  CHECK(enc.max_seq_length() == fx.at("max_seq_length").get<size_t>());
  CHECK(enc.pooling() == PoolingMode::kMean);
  CHECK(enc.normalizes());

  std::vector<std::string> texts;
  std::vector<std::vector<float>> expected;
  for (const auto& s : fx.at("sentences")) {
    texts.push_back(s.at("text").get<std::string>());
    expected.push_back(s.at("embedding").get<std::vector<float>>());
  }
  REQUIRE(texts.size() >= 24);
  auto got = enc.encode(texts);
  REQUIRE_MESSAGE(got.is_ok(), got.status().to_string());
  REQUIRE(got->size() == texts.size());
  double min_cos = 1.0;
  float max_diff = 0.0f;  // element-wise, the stricter check (the fixture has 6 digits)
  for (size_t i = 0; i < texts.size(); ++i) {
    REQUIRE((*got)[i].size() == 384);
    const double c = cosine((*got)[i], expected[i]);
    if (c < min_cos) min_cos = c;
    if (c < 0.999) MESSAGE("sentence " << i << " '" << texts[i] << "': cosine " << c);
    max_diff = std::max(max_diff, max_abs_diff((*got)[i], expected[i]));
    double norm = 0;
    for (float f : (*got)[i]) norm += static_cast<double>(f) * f;
    CHECK(std::sqrt(norm) == doctest::Approx(1.0).epsilon(1e-5));
  }
  MESSAGE("minimum cosine vs sentence-transformers over "
          << texts.size() << " sentences: " << std::setprecision(12) << min_cos
          << " (1 - min = " << 1.0 - min_cos << ")");
  CHECK(min_cos >= 0.999);
  MESSAGE("max |ours - sentence-transformers| = " << max_diff);
  CHECK(max_diff <= 1e-4f);

  // Semantics survive: a paraphrase is closer than an unrelated sentence.
  auto e = enc.encode({"The apple is in the fridge.", "An apple is stored in the refrigerator.",
                       "The bedroom window is open."});
  REQUIRE(e.is_ok());
  CHECK(cosine((*e)[0], (*e)[1]) > cosine((*e)[0], (*e)[2]) + 0.2);
}

TEST_CASE("batch, single and chunked encodes give the same embeddings") {
  require_model();
  const nlohmann::json fx = load_fixture();
  std::vector<std::string> texts;
  for (const auto& s : fx.at("sentences")) texts.push_back(s.at("text").get<std::string>());
  const BertEncoder& enc = encoder();
  auto batch = enc.encode(texts);
  REQUIRE(batch.is_ok());

  float worst = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    auto single = enc.encode({texts[i]});
    REQUIRE(single.is_ok());
    worst = std::max(worst, max_abs_diff((*single)[0], (*batch)[i]));
  }
  MESSAGE("max |batch - single| = " << worst);
  CHECK(worst <= 1e-5f);

  // Small token budget: many chunks, same result.
  EncoderOptions small;
  small.max_batch_tokens = 40;
  auto chunked_enc = BertEncoder::load(kModelDir, small);
  REQUIRE(chunked_enc.is_ok());
  auto chunked = (*chunked_enc)->encode(texts);
  REQUIRE(chunked.is_ok());
  for (size_t i = 0; i < texts.size(); ++i)
    CHECK(max_abs_diff((*chunked)[i], (*batch)[i]) <= 1e-5f);

  // Ids route: the fixture's HF ids give the same embeddings as the texts.
  std::vector<std::vector<int32_t>> ids;
  for (const auto& s : fx.at("sentences")) ids.push_back(s.at("ids").get<std::vector<int32_t>>());
  auto from_ids = enc.encode_ids(ids);
  REQUIRE(from_ids.is_ok());
  for (size_t i = 0; i < texts.size(); ++i)
    CHECK(max_abs_diff((*from_ids)[i], (*batch)[i]) == 0.0f);

  auto empty = enc.encode({});
  REQUIRE(empty.is_ok());
  CHECK(empty->empty());
}

TEST_CASE("invalid ids are refused, not read out of bounds") {
  require_model();
  const BertEncoder& enc = encoder();
  auto bad_id = enc.encode_ids({{101, 30522, 102}});
  REQUIRE_FALSE(bad_id.is_ok());
  CHECK(bad_id.status().code() == Code::kInvalidArgument);
  CHECK_FALSE(enc.encode_ids({{101, -1, 102}}).is_ok());
  CHECK_FALSE(enc.encode_ids({{}}).is_ok());
  CHECK_FALSE(enc.encode_ids({std::vector<int32_t>(513, 1000)}).is_ok());
  CHECK(enc.encode_ids({std::vector<int32_t>(512, 1000)}).is_ok());  // the position table's size
}

TEST_CASE("parse_bert_config: mistyped and out-of-range fields are errors, not exceptions") {
  const nlohmann::json base = {
      {"model_type", "bert"},          {"vocab_size", 30522},       {"hidden_size", 384},
      {"num_hidden_layers", 6},        {"num_attention_heads", 12}, {"intermediate_size", 1536},
      {"max_position_embeddings", 512}};
  auto ok = keep::manager::parse_bert_config(base.dump(), "config.json");
  REQUIRE_MESSAGE(ok.is_ok(), ok.status().to_string());
  CHECK(ok->hidden == 384);
  CHECK(ok->type_vocab_size == 2);
  auto refused = [&](const char* key, const nlohmann::json& value, const char* needle) {
    nlohmann::json j = base;
    j[key] = value;
    auto r = keep::manager::parse_bert_config(j.dump(), "config.json");
    REQUIRE_FALSE(r.is_ok());
    CHECK(r.status().code() == Code::kInvalidArgument);
    CHECK_MESSAGE(r.status().message().find(needle) != std::string::npos, r.status().to_string());
  };
  // A non-string model_type / hidden_act threw out of BertEncoder::load (std::terminate); a
  // float or huge size was converted to int unchecked (undefined behaviour).
  refused("model_type", 5, "mistyped field");
  refused("hidden_act", nlohmann::json::array(), "mistyped field");
  refused("vocab_size", 1e20, "'vocab_size'");
  refused("hidden_size", 384.5, "'hidden_size'");
  refused("num_hidden_layers", 1ull << 40, "'num_hidden_layers'");
  refused("layer_norm_eps", 1e300, "layer_norm_eps");
  auto deep = keep::manager::parse_bert_config(
      R"({"a":)" + std::string(100000, '[') + std::string(100000, ']') + "}", "config.json");
  CHECK(deep.status().code() == Code::kMalformed);
}

TEST_CASE("bad model directories give a clear error") {
  auto missing = BertEncoder::load("/nonexistent/all-MiniLM-L6-v2");
  REQUIRE_FALSE(missing.is_ok());
  CHECK(missing.status().code() == Code::kNotFound);
  CHECK(missing.status().message().find("/nonexistent/all-MiniLM-L6-v2") != std::string::npos);
  CHECK(missing.status().message().find("deploy/fetch-models.sh") != std::string::npos);

  require_model();
  auto expect = [](const keep::Status& st, const std::string& needle) {
    INFO(st.to_string());
    CHECK_FALSE(st.is_ok());
    CHECK(st.message().find(needle) != std::string::npos);
  };
  {
    PatchedModelDir d;
    d.patch_json("config.json", [](nlohmann::json& j) { j["model_type"] = "roberta"; });
    expect(d.load_status(), "model_type 'roberta' is not supported");
  }
  {
    PatchedModelDir d;
    d.patch_json("config.json", [](nlohmann::json& j) { j["hidden_act"] = "relu"; });
    expect(d.load_status(), "hidden_act 'relu'");
  }
  {
    PatchedModelDir d;  // the shape no longer matches the weights
    d.patch_json("config.json", [](nlohmann::json& j) { j["intermediate_size"] = 1024; });
    expect(d.load_status(),
           "intermediate.dense.weight' has shape [1536, 384], expected [1024, 384]");
  }
  {
    PatchedModelDir d;
    d.patch_json("1_Pooling/config.json",
                 [](nlohmann::json& j) { j["pooling_mode_cls_token"] = true; });
    expect(d.load_status(), "concatenated modes are not supported");
  }
  {
    PatchedModelDir d;
    d.patch_json("1_Pooling/config.json",
                 [](nlohmann::json& j) { j["pooling_mode_weightedmean_tokens"] = true; });
    expect(d.load_status(), "pooling_mode_weightedmean_tokens is not supported");
  }
  {
    PatchedModelDir d;
    d.patch_json("modules.json", [](nlohmann::json& j) {
      j.push_back({{"idx", 3},
                   {"name", "3"},
                   {"path", "3_Dense"},
                   {"type", "sentence_transformers.models.Dense"}});
    });
    expect(d.load_status(), "models.Dense' is not supported");
  }
  {
    PatchedModelDir d;
    fs::remove(d.path / "model.safetensors");
    expect(d.load_status(), "neither model.safetensors nor model.safetensors.index.json");
  }
  {
    PatchedModelDir d;
    fs::remove(d.path / "config.json");
    std::ofstream(d.path / "config.json") << "{ truncated";
    expect(d.load_status(), "config.json' is not JSON");
  }
  {
    PatchedModelDir d;  // CLS pooling alone is supported and gives a different embedding
    d.patch_json("1_Pooling/config.json", [](nlohmann::json& j) {
      j["pooling_mode_cls_token"] = true;
      j["pooling_mode_mean_tokens"] = false;
    });
    auto r = BertEncoder::load(d.path.string());
    REQUIRE_MESSAGE(r.is_ok(), r.status().to_string());
    CHECK((*r)->pooling() == PoolingMode::kCls);
  }
}

TEST_CASE("gemm wrappers match a naive loop on odd sizes") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int M : {1, 3, 19}) {
    for (int N : {1, 7, 33}) {
      for (int K : {1, 5, 67}) {
        std::vector<float> A(static_cast<size_t>(M * K)), B(static_cast<size_t>(N * K));
        for (float& f : A) f = u(rng);
        for (float& f : B) f = u(rng);
        std::vector<float> C0(static_cast<size_t>(M * N), 0.5f), C(C0), ref(C0);
        // nt: C (M,N) = 2 * A (M,K) · B (N,K)^T + 0.5 * C
        keep::blas::gemm_nt(C.data(), A.data(), B.data(), M, N, K, 2.0f, 0.5f);
        for (int m = 0; m < M; ++m) {
          for (int n = 0; n < N; ++n) {
            double s = 0;
            for (int k = 0; k < K; ++k) s += static_cast<double>(A[m * K + k]) * B[n * K + k];
            ref[m * N + n] = static_cast<float>(2.0 * s + 0.5 * C0[m * N + n]);
          }
        }
        CHECK(max_abs_diff(C, ref) <= 1e-4f);
        // nn: C (M,N) = A (M,K) · B' (K,N), with B' = the same buffer read as (K, N).
        keep::blas::gemm_nn(C.data(), A.data(), B.data(), M, N, K);
        for (int m = 0; m < M; ++m) {
          for (int n = 0; n < N; ++n) {
            double s = 0;
            for (int k = 0; k < K; ++k) s += static_cast<double>(A[m * K + k]) * B[k * N + n];
            ref[m * N + n] = static_cast<float>(s);
          }
        }
        CHECK(max_abs_diff(C, ref) <= 1e-4f);
        // tn: C (M,N) = A' (K,M)^T · B' (K,N), A' = A read as (K, M).
        keep::blas::gemm_tn(C.data(), A.data(), B.data(), M, N, K);
        for (int m = 0; m < M; ++m) {
          for (int n = 0; n < N; ++n) {
            double s = 0;
            for (int k = 0; k < K; ++k) s += static_cast<double>(A[k * M + m]) * B[k * N + n];
            ref[m * N + n] = static_cast<float>(s);
          }
        }
        CHECK(max_abs_diff(C, ref) <= 1e-4f);
      }
    }
  }
  CHECK(keep::blas::num_threads() >= 1);
}
