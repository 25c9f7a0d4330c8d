// BpeTokenizer and PreTokenizer against HF `tokenizers`: the fixtures under
// tests/fixtures/tokenizer are written by scripts/make_tokenizer_fixture.py; the Qwen2.5
// tokenizer.json comes from deploy/fetch-models.sh (models/qwen2.5-tokenizer/).
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shared/tokenizer/bpe_tokenizer.h"
#include "shared/tokenizer/pretokenizer.h"

using keep::Code;
using keep::tok::AddedToken;
using keep::tok::BpeOptions;
using keep::tok::BpeTokenizer;
using keep::tok::Normalization;
using keep::tok::PreTokenizer;
using nlohmann::json;

namespace {

constexpr const char* kQwenJson = "models/qwen2.5-tokenizer/tokenizer.json";

json load_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "missing " << path);
  return json::parse(in);
}

const BpeTokenizer& qwen() {
  static BpeTokenizer* tok = [] {
    auto r = BpeTokenizer::from_json_file(kQwenJson);
    REQUIRE_MESSAGE(r.is_ok(), r.status().to_string() << " (run deploy/fetch-models.sh)");
    return new BpeTokenizer(std::move(r).value());
  }();
  return *tok;
}

// A test-only reader of the string / string-array / int-array metadata of a GGUF file (the real
// loader belongs to the model code): enough to build the SmolLM2 tokenizer the way a GGUF loader
// will, through from_vocab_and_merges.
struct GgufVocab {
  std::string model, pre;
  std::vector<std::string> tokens, merges;
  std::vector<int32_t> token_types;
};

bool read_gguf_vocab(const std::string& path, GgufVocab* out) {
  std::ifstream in(path, std::ios::binary);
  const auto u32 = [&] {
    uint32_t v = 0;
    in.read(reinterpret_cast<char*>(&v), 4);
    return v;
  };
  const auto u64 = [&] {
    uint64_t v = 0;
    in.read(reinterpret_cast<char*>(&v), 8);
    return v;
  };
  const auto str = [&] {
    const uint64_t n = u64();
    if (!in || n > (1u << 20)) return std::string();
    std::string v(n, '\0');
    in.read(v.data(), static_cast<std::streamsize>(n));
    return v;
  };
  const auto skip_scalar = [&](uint32_t type) {
    static const int kSizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    if (type == 8) {
      str();
    } else if (type < 13) {
      in.ignore(kSizes[type]);
    } else {
      in.setstate(std::ios::failbit);
    }
  };
  if (u32() != 0x46554747u) return false;  // "GGUF"
  if (u32() < 2) return false;
  u64();  // tensor count
  const uint64_t kv_count = u64();
  for (uint64_t i = 0; i < kv_count && in; ++i) {
    const std::string key = str();
    const uint32_t type = u32();
    if (type == 9) {  // array
      const uint32_t elem = u32();
      const uint64_t n = u64();
      if (!in || n > (1u << 24)) return false;
      for (uint64_t k = 0; k < n && in; ++k) {
        if (key == "tokenizer.ggml.tokens" && elem == 8) {
          out->tokens.push_back(str());
        } else if (key == "tokenizer.ggml.merges" && elem == 8) {
          out->merges.push_back(str());
        } else if (key == "tokenizer.ggml.token_type" && elem == 5) {
          out->token_types.push_back(static_cast<int32_t>(u32()));
        } else {
          skip_scalar(elem);
        }
      }
    } else if (type == 8 && key == "tokenizer.ggml.model") {
      out->model = str();
    } else if (type == 8 && key == "tokenizer.ggml.pre") {
      out->pre = str();
    } else {
      skip_scalar(type);
    }
  }
  return static_cast<bool>(in);
}

std::string show(const std::string& s) { return json(s).dump(); }

// A toy byte-level vocabulary: the 256 byte tokens, then the given merged tokens.
std::vector<std::string> byte_vocab() {
  // The byte-level text of each byte, as HF's bytes_to_unicode writes it.
  std::vector<std::string> v;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : next++;
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    v.push_back(s);
  }
  return v;
}

}  // namespace

TEST_CASE("qwen2.5: every fixture string encodes to HF's ids and decodes back") {
  const BpeTokenizer& tok = qwen();
  const json fixture = load_json("tests/fixtures/tokenizer/qwen2_encode.json");
  REQUIRE(fixture.at("strings").size() >= 200);
  int checked = 0;
  for (const json& row : fixture.at("strings")) {
    const std::string text = row.at("text");
    const std::vector<int32_t> want = row.at("ids");
    const std::vector<int32_t> got = tok.encode(text);
    CHECK_MESSAGE(got == want, "text " << show(text));
    CHECK(tok.count_tokens(text) == want.size());
    const std::string decoded = tok.decode(got);
    CHECK_MESSAGE(decoded == row.at("decoded").get<std::string>(), "text " << show(text));
    if (row.at("nfc").get<bool>()) CHECK_MESSAGE(decoded == text, "text " << show(text));
    ++checked;
  }
  CHECK(checked >= 200);
}

TEST_CASE("smollm2 from GGUF vocabulary lists (from_vocab_and_merges) encodes like HF") {
  GgufVocab v;
  REQUIRE_MESSAGE(read_gguf_vocab("models/SmolLM2-135M-Instruct.Q4_1.gguf", &v),
                  "cannot read models/SmolLM2-135M-Instruct.Q4_1.gguf (deploy/fetch-models.sh)");
  CHECK(v.model == "gpt2");
  CHECK(v.pre == "smollm");
  REQUIRE(v.tokens.size() == v.token_types.size());
  std::vector<AddedToken> added;
  for (size_t id = 0; id < v.tokens.size(); ++id) {
    if (v.token_types[id] == 3) added.push_back({static_cast<int32_t>(id), v.tokens[id], true});
  }
  std::vector<std::pair<std::string, std::string>> merges;
  for (const std::string& m : v.merges) {
    const size_t space = m.find(' ');
    if (space == std::string::npos) FAIL("GGUF merge without a space: " << m);
    merges.emplace_back(m.substr(0, space), m.substr(space + 1));
  }
  BpeOptions opts;
  opts.pre_tokenizer = v.pre;
  opts.normalization = Normalization::kNone;
  auto tok = BpeTokenizer::from_vocab_and_merges(v.tokens, merges, added, opts);
  REQUIRE_MESSAGE(tok.is_ok(), tok.status().to_string());
  CHECK(tok->vocab_size() == 49152);
  CHECK(tok->token_to_id("<|im_start|>") == 1);
  CHECK(tok->is_special(2));
  const json fixture = load_json("tests/fixtures/tokenizer/smollm2_encode.json");
  REQUIRE(fixture.at("strings").size() >= 200);
  for (const json& row : fixture.at("strings")) {
    const std::string text = row.at("text");
    const std::vector<int32_t> got = tok->encode(text);
    CHECK_MESSAGE(got == row.at("ids").get<std::vector<int32_t>>(), "text " << show(text));
    CHECK_MESSAGE(tok->decode(got) == text, "text " << show(text));  // no normalizer: exact
  }
}

TEST_CASE("pre-tokenizers split like HF (qwen2, llama3, gpt2, smollm)") {
  const json fixture = load_json("tests/fixtures/tokenizer/pretokenize.json");
  for (const json& name_json : fixture.at("names")) {
    const std::string name = name_json;
    auto pre = PreTokenizer::by_name(name);
    REQUIRE(pre.is_ok());
    CHECK(std::string(pre->name()) == name);
    for (const json& row : fixture.at("strings")) {
      const std::string text = row.at("text");
      std::vector<std::string_view> pieces;
      pre->split(text, &pieces);
      const std::vector<std::string> got(pieces.begin(), pieces.end());
      const std::vector<std::string> want = row.at(name);
      CHECK_MESSAGE(got == want, name << " on " << show(text));
    }
  }
  CHECK(PreTokenizer::by_name("llama-bpe")->kind() == keep::tok::PreTokenizerKind::kLlama3);
  CHECK(PreTokenizer::by_name("bert").status().code() == Code::kInvalidArgument);
}

TEST_CASE("special tokens: split out, optionally treated as text, skipped on request") {
  const BpeTokenizer& tok = qwen();
  const int32_t im_start = *tok.token_to_id("<|im_start|>");
  const int32_t im_end = *tok.token_to_id("<|im_end|>");
  CHECK(im_start == 151644);
  CHECK(im_end == 151645);
  CHECK(tok.is_special(im_start));
  CHECK_FALSE(tok.is_special(*tok.token_to_id("<tool_call>")));  // added, not special

  const std::string text = "<|im_start|>user\nhi<|im_end|>";
  const auto ids = tok.encode(text);
  REQUIRE(ids.size() >= 3);
  CHECK(ids.front() == im_start);
  CHECK(ids.back() == im_end);
  CHECK(tok.decode(ids, /*skip_special=*/true) == "user\nhi");

  // parse_special=false: the markers are plain text (no control-token injection from content).
  const auto plain = tok.encode(text, false, /*parse_special=*/false);
  for (int32_t id : plain) CHECK_FALSE(tok.is_special(id));
  CHECK(tok.decode(plain) == text);
  // Non-special added tokens are still matched.
  CHECK(tok.encode("<tool_call>", false, false) ==
        std::vector<int32_t>{*tok.token_to_id("<tool_call>")});
  // Qwen2.5 has no BOS/EOS post-processing.
  CHECK(tok.encode("hi", /*add_special=*/true) == tok.encode("hi"));
}

TEST_CASE("vocabulary queries and bad ids") {
  const BpeTokenizer& tok = qwen();
  CHECK(tok.vocab_size() == 151665);
  CHECK(tok.token_to_id("Ġthe").has_value());
  CHECK(tok.id_to_token(*tok.token_to_id("Ġthe")) == "Ġthe");
  CHECK(tok.token_bytes(*tok.token_to_id("Ġthe")) == " the");
  CHECK_FALSE(tok.token_to_id("no such token").has_value());
  CHECK_FALSE(tok.id_to_token(-1).has_value());
  CHECK_FALSE(tok.id_to_token(tok.vocab_size()).has_value());
  CHECK(tok.token_bytes(1 << 30).empty());
  // Unknown ids (e.g. the model's padded logits rows) are skipped, as HF does.
  CHECK(tok.decode({-5, *tok.token_to_id("hi"), 152000, 1 << 30}) == "hi");
  CHECK(tok.encode("").empty());
  CHECK(tok.count_tokens("") == 0);
  CHECK(tok.fingerprint() != 0);
}

TEST_CASE("invalid UTF-8 never fails and round-trips as raw bytes") {
  const BpeTokenizer& tok = qwen();
  const std::vector<std::string> cases = {"\xff\xfe",
                                          "abc\x80"
                                          "def",
                                          "\xe4\xbd",
                                          "x\xe4\xbd",
                                          "\xc0\xaf overlong",
                                          "\xed\xa0\x80 surrogate",
                                          "\xf4\x90\x80\x80 too big",
                                          std::string("nul\0inside", 10),
                                          "caf\xc3",
                                          "'\xff'\xffS"};
  for (const std::string& s : cases) {
    const auto ids = tok.encode(s);
    CHECK_MESSAGE(tok.decode(ids) == s, show(s));
    CHECK(tok.count_tokens(s) == ids.size());
  }
  // Random ASCII mixed with bytes that can never be valid UTF-8 (continuation bytes alone, F8-FF).
  std::mt19937 rng(7);
  for (int round = 0; round < 300; ++round) {
    std::string s;
    const int len = static_cast<int>(rng() % 64);
    for (int i = 0; i < len; ++i) {
      const uint32_t r = rng() % 3;
      if (r == 0)
        s.push_back(static_cast<char>(0x80 + rng() % 0x40));
      else if (r == 1)
        s.push_back(static_cast<char>(0xF8 + rng() % 8));
      else
        s.push_back(static_cast<char>(0x09 + rng() % 0x76));
    }
    CHECK(tok.decode(tok.encode(s)) == s);
  }
}

TEST_CASE("NFC normalization applies before pre-tokenization") {
  const BpeTokenizer& tok = qwen();
  CHECK(tok.encode("cafe\xcc\x81") == tok.encode("caf\xc3\xa9"));  // e + U+0301 == é
  CHECK(tok.decode(tok.encode("cafe\xcc\x81")) == "caf\xc3\xa9");
}

TEST_CASE("concurrent encodes agree (shared piece cache)") {
  const BpeTokenizer& tok = qwen();
  const json fixture = load_json("tests/fixtures/tokenizer/qwen2_encode.json");
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 3; ++rep) {
        for (const json& row : fixture.at("strings")) {
          if (tok.encode(row.at("text").get<std::string>()) != row.at("ids")) ++mismatches[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int m : mismatches) CHECK(m == 0);
}

TEST_CASE("from_vocab_and_merges: merge ranks decide the order") {
  auto build = [](std::vector<std::pair<std::string, std::string>> merges) {
    std::vector<std::string> vocab = byte_vocab();
    for (const char* t : {"ab", "bc", "abc", "Ġab"}) vocab.push_back(t);
    BpeOptions opts;
    opts.pre_tokenizer = "gpt2";
    opts.normalization = Normalization::kNone;
    std::vector<AddedToken> added = {{300, "<eos>", true}, {301, "<u>", false}};
    return BpeTokenizer::from_vocab_and_merges(std::move(vocab), merges, std::move(added), opts);
  };
  const int32_t a = 'a', b = 'b';
  const int32_t ab = 256, bc = 257, abc = 258;
  {
    auto tok = build({{"a", "b"}, {"b", "c"}, {"ab", "c"}});
    REQUIRE(tok.is_ok());
    CHECK(tok->encode("abc") == std::vector<int32_t>{abc});
    // One piece "abcab": a+b (rank 0, leftmost) twice, then ab+c.
    CHECK(tok->encode("abcab<eos>") == std::vector<int32_t>{abc, ab, 300});
    CHECK(tok->vocab_size() == 302);
    CHECK(tok->decode({abc, 300, 301}, true) == "abc<u>");
  }
  {
    auto tok = build({{"b", "c"}, {"a", "b"}, {"ab", "c"}});
    REQUIRE(tok.is_ok());
    CHECK(tok->encode("abc") == std::vector<int32_t>{a, bc});
    CHECK(tok->encode("bab") == std::vector<int32_t>{b, ab});
  }
  {
    // Long pieces take the heap path; it must give the scan's answer: "ab" * 100 -> 100 x ab.
    auto tok = build({{"a", "b"}, {"b", "c"}, {"ab", "c"}});
    std::string s;
    for (int i = 0; i < 100; ++i) s += "ab";
    CHECK(tok->encode(s) == std::vector<int32_t>(100, ab));
    CHECK(tok->encode(s + "c") == [&] {
      std::vector<int32_t> v(99, ab);
      v.push_back(abc);
      return v;
    }());
  }
  auto bad = build({{"a", "x"}});  // "ax" is not in the vocabulary
  CHECK(bad.status().code() == Code::kInvalidArgument);
  CHECK(build({{"a", "b"}})->fingerprint() != build({{"b", "c"}})->fingerprint());
  auto bad_pre = BpeTokenizer::from_vocab_and_merges(byte_vocab(), {}, {}, BpeOptions{"nope"});
  CHECK(bad_pre.status().code() == Code::kInvalidArgument);
}

TEST_CASE("tokenizer.json variants and errors") {
  // Merges as [a, b] pairs, a TemplateProcessing BOS, ignore_merges.
  json vocab = json::object();
  const auto bytes = byte_vocab();
  for (size_t i = 0; i < bytes.size(); ++i) vocab[bytes[i]] = i;
  vocab["hi"] = 256;
  json root = {
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({json::array({"h", "i"})})}}},
      {"added_tokens", json::array({{{"id", 257}, {"content", "<s>"}, {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {257}}, {"tokens", {"<s>"}}}}}}}}};
  auto tok = BpeTokenizer::from_json_string(root.dump());
  REQUIRE_MESSAGE(tok.is_ok(), tok.status().to_string());
  CHECK(tok->encode("hi") == std::vector<int32_t>{256});
  CHECK(tok->encode("hi", /*add_special=*/true) == std::vector<int32_t>{257, 256});
  CHECK(tok->options().pre_tokenizer == "gpt2");

  CHECK(BpeTokenizer::from_json_string("{not json").status().code() == Code::kMalformed);
  CHECK(BpeTokenizer::from_json_string("[]").status().code() == Code::kMalformed);
  CHECK(BpeTokenizer::from_json_string(R"({"model": 3})").status().code() == Code::kMalformed);
  CHECK(BpeTokenizer::from_json_file("no/such/tokenizer.json").status().code() == Code::kIoError);
  // A WordPiece tokenizer (all-MiniLM) is refused with the reason.
  json wp = root;
  wp["model"]["type"] = "WordPiece";
  auto r = BpeTokenizer::from_json_string(wp.dump());
  CHECK(r.status().code() == Code::kInvalidArgument);
  CHECK(r.status().message().find("model") != std::string::npos);
  json odd = root;
  odd["pre_tokenizer"] = {{"type", "Whitespace"}};
  CHECK(BpeTokenizer::from_json_string(odd.dump()).status().code() == Code::kInvalidArgument);
  json bad_merge = root;
  bad_merge["model"]["merges"] = json::array({"h i j"});
  CHECK(BpeTokenizer::from_json_string(bad_merge.dump()).status().code() == Code::kMalformed);
}

// Found by fuzz_tokenizer_json or while writing it (tests/fuzz/corpus/fuzz_tokenizer_json/).
TEST_CASE("tokenizer.json: hostile ids and nesting are refused before allocating") {
  json vocab = json::object();
  const auto bytes = byte_vocab();
  for (size_t i = 0; i < bytes.size(); ++i) vocab[bytes[i]] = i;
  json root = {
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
  };
  auto refused = [](const json& j, const std::string& what) {
    auto r = BpeTokenizer::from_json_string(j.dump());
    REQUIRE_FALSE(r.is_ok());
    CHECK_MESSAGE(r.status().message().find(what) != std::string::npos, r.status().to_string());
  };
  // INT32_MAX overflowed `id + 1`; 300M sized the tables at 9.6 GB; a vocabulary id of 16M at 1.2.
  for (int32_t id : {INT32_MAX, 300'000'000, keep::tok::kMaxTokenIds}) {
    json j = root;
    j["added_tokens"] = json::array({{{"id", id}, {"content", "<x>"}, {"special", true}}});
    refused(j, "outside [0, 2097152)");
  }
  json big = root;
  big["model"]["vocab"]["far"] = 16'000'000;
  refused(big, "vocab id out of range");
  // get<int64_t>() of a float id converted 2.2e40 to an integer (undefined behaviour).
  json fl = root;
  fl["model"]["vocab"]["far"] = 2.25556e40;
  refused(fl, "vocab id out of range");
  json fl_added = root;
  fl_added["added_tokens"] = json::array({{{"id", 1.5}, {"content", "<x>"}}});
  refused(fl_added, "added token id 1.5");
  auto r = BpeTokenizer::from_vocab_and_merges({"a"}, {}, {{INT32_MAX, "<x>"}}, BpeOptions{});
  CHECK(r.status().code() == Code::kInvalidArgument);
  // Error messages dump() the offending part, which recursed once per level.
  const std::string deep =
      R"({"model":{"type":"X","a":)" + std::string(100000, '[') + std::string(100000, ']') + "}}";
  auto d = BpeTokenizer::from_json_string(deep);
  CHECK(d.status().code() == Code::kMalformed);
  CHECK(d.status().message().find("nested deeper than 64") != std::string::npos);
  // Brackets inside strings do not count.
  json strings = root;
  strings["model"]["vocab"][std::string(100, '[')] = 256;
  CHECK(BpeTokenizer::from_json_string(strings.dump()).is_ok());
}

TEST_CASE("utf8_complete_prefix holds back a cut-off character") {
  using keep::tok::utf8_complete_prefix;
  CHECK(utf8_complete_prefix("abc") == 3);
  CHECK(utf8_complete_prefix("a\xe4\xbd") == 1);      // 3-byte sequence cut after 2
  CHECK(utf8_complete_prefix("a\xe4\xbd\xa0") == 4);  // complete
  CHECK(utf8_complete_prefix("\xf0\x9f\x98") == 0);   // 4-byte emoji cut after 3
  CHECK(utf8_complete_prefix("a\xff") == 2);          // invalid: nothing to wait for
  CHECK(utf8_complete_prefix("a\xe0\x80") == 3);      // overlong start: invalid already
  CHECK(utf8_complete_prefix("") == 0);
}
