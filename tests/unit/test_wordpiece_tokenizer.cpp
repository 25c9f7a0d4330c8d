// WordPiece tokenizer: ids identical to Hugging Face's (as sentence-transformers feeds them) for
// every fixture sentence, from tokenizer.json and from vocab.txt; the normaliser and
// pre-tokenizer stages; [UNK] for over-long words; truncation; bad input never crashes.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "services/manager/encoder/wordpiece_tokenizer.h"

namespace fs = std::filesystem;
using keep::manager::WordPieceConfig;
using keep::manager::WordPieceTokenizer;

namespace {

const std::string kModelDir = std::string(KEEP_SOURCE_DIR) + "/models/all-MiniLM-L6-v2";
const std::string kFixture =
    std::string(KEEP_SOURCE_DIR) + "/tests/fixtures/encoder/minilm_reference.json";

void require_model() {
  REQUIRE_MESSAGE(
      fs::exists(kModelDir + "/tokenizer.json"),
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

std::string pieces(const WordPieceTokenizer& tok, const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += tok.token(id) + " ";
  return s;
}

// Every fixture sentence: ids equal HF's exactly.
void check_fixture_ids(const WordPieceTokenizer& tok) {
  const nlohmann::json fx = load_fixture();
  const size_t max_len = fx.at("max_seq_length").get<size_t>();
  const auto& sentences = fx.at("sentences");
  REQUIRE(sentences.size() >= 24);
  int mismatches = 0;
  for (const auto& s : sentences) {
    const std::string text = s.at("text").get<std::string>();
    const auto expected = s.at("ids").get<std::vector<int32_t>>();
    const auto got = tok.encode(text, max_len);
    if (got != expected) {
      ++mismatches;
      MESSAGE("text: " << text << "\n  HF:   " << pieces(tok, expected)
                       << "\n  ours: " << pieces(tok, got));
    }
  }
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("ids match Hugging Face for every fixture sentence (tokenizer.json)") {
  require_model();
  auto tok = WordPieceTokenizer::from_tokenizer_json(kModelDir + "/tokenizer.json");
  REQUIRE_MESSAGE(tok.is_ok(), tok.status().to_string());
  CHECK((*tok)->vocab_size() == 30522);
  CHECK((*tok)->cls_id() == 101);
  CHECK((*tok)->sep_id() == 102);
  CHECK((*tok)->unk_id() == 100);
  CHECK((*tok)->pad_id() == 0);
  check_fixture_ids(**tok);
}

TEST_CASE("ids match Hugging Face for every fixture sentence (vocab.txt)") {
  require_model();
  WordPieceConfig config;  // BERT uncased defaults
  auto tok = WordPieceTokenizer::from_vocab_txt(kModelDir + "/vocab.txt", config);
  REQUIRE_MESSAGE(tok.is_ok(), tok.status().to_string());
  CHECK((*tok)->vocab_size() == 30522);
  check_fixture_ids(**tok);
}

TEST_CASE("normaliser, pre-tokenizer and wordpiece stages") {
  require_model();
  auto r = WordPieceTokenizer::from_dir(kModelDir);
  REQUIRE(r.is_ok());
  const WordPieceTokenizer& tok = **r;

  // Lowercase + accents stripped (NFD, Mn dropped); controls dropped; whitespace unified.
  CHECK(tok.normalize("Crème BRÛLÉE") == "creme brulee");
  CHECK(tok.normalize("a\tb\nc\x01\xE2\x80\x8B"
                      "d") == "a b cd");  // \x01 and U+200B (Cf) removed
  CHECK(tok.normalize("冰箱") == " 冰  箱 ");
  CHECK(tok.pre_tokenize("it's 3.5$, ok") ==
        std::vector<std::string>{"it", "'", "s", "3", ".", "5", "$", ",", "ok"});

  // Greedy longest match with "##".
  const auto ids = tok.tokenize("unaffordable");
  REQUIRE(!ids.empty());
  std::string joined;
  for (int32_t id : ids) joined += tok.token(id) + "|";
  CHECK(joined == "una|##ff|##ord|##able|");

  // A word of more than 100 characters is one [UNK]; exactly 100 is wordpieced.
  CHECK(tok.tokenize(std::string(101, 'a')) == std::vector<int32_t>{tok.unk_id()});
  CHECK(tok.tokenize(std::string(100, 'a')).size() > 1);

  // Special tokens in the raw text are matched as such.
  CHECK(tok.encode("[MASK]", 16) == std::vector<int32_t>{101, 103, 102});
}

TEST_CASE("truncation keeps [CLS] and [SEP] within max_len") {
  require_model();
  auto r = WordPieceTokenizer::from_dir(kModelDir);
  REQUIRE(r.is_ok());
  const WordPieceTokenizer& tok = **r;
  std::string long_text;
  for (int i = 0; i < 500; ++i) long_text += "apple ";
  for (size_t max_len : {2, 3, 10, 256}) {
    const auto ids = tok.encode(long_text, max_len);
    REQUIRE(ids.size() == max_len);
    CHECK(ids.front() == tok.cls_id());
    CHECK(ids.back() == tok.sep_id());
  }
  CHECK(tok.encode("", 256) == std::vector<int32_t>{101, 102});
  CHECK(tok.tokenize("apple apple", 0).empty());
  CHECK(tok.tokenize("apple apple apple", 2).size() == 2);
}

TEST_CASE("invalid UTF-8 and odd bytes never crash") {
  require_model();
  auto r = WordPieceTokenizer::from_dir(kModelDir);
  REQUIRE(r.is_ok());
  const WordPieceTokenizer& tok = **r;
  const std::string bad[] = {std::string("\xFF\xFE\xC3", 3), std::string("ab\0cd", 5),
                             std::string("\xE2\x82", 2), std::string("x\xF4\x90\x80\x80y", 6)};
  for (const std::string& s : bad) {
    const auto ids = tok.encode(s, 64);
    CHECK(ids.size() >= 2);
    for (int32_t id : ids) CHECK(id < static_cast<int32_t>(tok.vocab_size()));
  }
  CHECK(tok.encode(std::string("ab\0cd", 5), 64) == tok.encode("abcd", 64));
}

TEST_CASE("missing or malformed tokenizer files give a clear error") {
  auto none = WordPieceTokenizer::from_dir("/nonexistent/keep-model");
  REQUIRE_FALSE(none.is_ok());
  CHECK(none.status().message().find("/nonexistent/keep-model") != std::string::npos);

  const fs::path dir = fs::temp_directory_path() / "keep_test_wordpiece_bad";
  fs::create_directories(dir);
  { std::ofstream(dir / "tokenizer.json") << R"({"model": {"type": "BPE", "vocab": {}}})"; }
  auto bpe = WordPieceTokenizer::from_tokenizer_json((dir / "tokenizer.json").string());
  REQUIRE_FALSE(bpe.is_ok());
  CHECK(bpe.status().message().find("not WordPiece") != std::string::npos);
  { std::ofstream(dir / "vocab.txt") << "a\nb\n"; }
  auto no_specials = WordPieceTokenizer::from_vocab_txt((dir / "vocab.txt").string(), {});
  REQUIRE_FALSE(no_specials.is_ok());
  CHECK(no_specials.status().message().find("[UNK]") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("tokenizer.json text: added token ids outside the vocabulary, deep nesting") {
  nlohmann::json j = {
      {"model",
       {{"type", "WordPiece"},
        {"vocab", {{"[PAD]", 0}, {"[UNK]", 1}, {"[CLS]", 2}, {"[SEP]", 3}, {"a", 4}}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "BertPreTokenizer"}}},
      {"added_tokens", nlohmann::json::array({{{"id", 2}, {"content", "[CLS]"}}})}};
  auto ok = WordPieceTokenizer::from_tokenizer_json_text(j.dump(), "mem.json");
  REQUIRE_MESSAGE(ok.is_ok(), ok.status().to_string());
  CHECK((*ok)->encode("a [CLS]", 8) == std::vector<int32_t>{2, 4, 2, 3});
  // encode() handed such an id to the encoder as it was.
  for (const nlohmann::json& id : {nlohmann::json(5), nlohmann::json(-1), nlohmann::json(INT32_MAX),
                                   nlohmann::json(1e40), nlohmann::json(1ull << 40)}) {
    j["added_tokens"][0]["id"] = id;
    auto bad = WordPieceTokenizer::from_tokenizer_json_text(j.dump(), "mem.json");
    REQUIRE_FALSE(bad.is_ok());
    CHECK(bad.status().message().find("outside the vocabulary") != std::string::npos);
  }
  j["added_tokens"][0]["id"] = 2;
  j["model"]["max_input_chars_per_word"] = 1e40;  // was converted to size_t unchecked
  CHECK_FALSE(WordPieceTokenizer::from_tokenizer_json_text(j.dump(), "mem.json").is_ok());
  const std::string deep =
      R"({"model":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  auto d = WordPieceTokenizer::from_tokenizer_json_text(deep, "deep.json");
  CHECK(d.status().code() == keep::Code::kMalformed);
}
