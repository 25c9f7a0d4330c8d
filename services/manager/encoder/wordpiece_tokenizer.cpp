#include "services/manager/encoder/wordpiece_tokenizer.h"

#include <utf8proc.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "shared/common/json_limits.h"

namespace keep::manager {

namespace {

using nlohmann::json;

// ---- UTF-8
// ----------------------------------------------------------------------------------------

// Decodes UTF-8; each invalid byte becomes U+FFFD (dropped later by clean_text).
std::u32string decode_utf8(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t left = static_cast<utf8proc_ssize_t>(s.size());
  while (left > 0) {
    utf8proc_int32_t cp = 0;
    utf8proc_ssize_t n = utf8proc_iterate(p, left, &cp);
    if (n <= 0) {  // invalid sequence: consume one byte
      cp = 0xFFFD;
      n = 1;
    }
    out.push_back(static_cast<char32_t>(cp));
    p += n;
    left -= n;
  }
  return out;
}

void append_utf8(char32_t cp, std::string* out) {
  utf8proc_uint8_t buf[4];
  const utf8proc_ssize_t n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
  out->append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

std::string encode_utf8(const std::u32string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t cp : s) append_utf8(cp, &out);
  return out;
}

// ---- character classes (as HF tokenizers / Rust define them)
// --------------------------------------

// Rust char::is_whitespace (the Unicode White_Space property).
bool is_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

utf8proc_category_t category(char32_t c) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(c));
}

// BertNormalizer's is_control: categories Cc, Cf, Cs, Co, Cn, except \t \n \r.
bool is_control(char32_t c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  switch (category(c)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
      return true;
    default:
      return false;
  }
}

// The CJK Unified Ideograph blocks BERT spaces out (not Hangul, Hiragana or Katakana).
bool is_chinese_char(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

// BertPreTokenizer's punctuation: ASCII punctuation (which includes $ + < = > ^ ` | ~) or any
// Unicode P* category.
bool is_punctuation(char32_t c) {
  if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
      (c >= 123 && c <= 126)) {
    return true;
  }
  switch (category(c)) {
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO:
      return true;
    default:
      return false;
  }
}

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(Code::kIoError, "cannot open '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status(Code::kIoError, "cannot read '" + path + "'");
  return ss.str();
}

}  // namespace

// ---- construction
// ---------------------------------------------------------------------------------

Status WordPieceTokenizer::finish_setup(const std::string& where) {
  auto need = [&](const std::string& tok, int32_t* id) -> Status {
    *id = token_id(tok);
    if (*id < 0) return Status(Code::kInvalidArgument, where + ": vocabulary lacks '" + tok + "'");
    return Status::ok();
  };
  KEEP_RETURN_IF_ERROR(need(config_.unk_token, &unk_id_));
  KEEP_RETURN_IF_ERROR(need("[CLS]", &cls_id_));
  KEEP_RETURN_IF_ERROR(need("[SEP]", &sep_id_));
  KEEP_RETURN_IF_ERROR(need("[PAD]", &pad_id_));
  for (const auto& [content, id] : added_tokens_) {
    if (content.empty()) return Status(Code::kInvalidArgument, where + ": empty added token");
    // encode() emits these ids as they are; the encoder indexes its embedding table with them.
    if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) {
      return Status(Code::kInvalidArgument, where + ": added token '" + content + "' has id " +
                                                std::to_string(id) + " outside the vocabulary");
    }
  }
  return Status::ok();
}

Result<std::unique_ptr<WordPieceTokenizer>> WordPieceTokenizer::from_tokenizer_json(
    const std::string& path) {
  KEEP_ASSIGN_OR_RETURN(std::string text, read_file(path));
  return from_tokenizer_json_text(text, path);
}

Result<std::unique_ptr<WordPieceTokenizer>> WordPieceTokenizer::from_tokenizer_json_text(
    std::string_view text, const std::string& where) {
  auto bad = [&](const std::string& what) {
    return Status(Code::kInvalidArgument, "tokenizer '" + where + "': " + what);
  };
  if (json_nesting_exceeds(text)) {
    return Status(Code::kMalformed, "tokenizer '" + where + "': JSON nested deeper than " +
                                        std::to_string(kMaxJsonDepth) + " levels");
  }
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  auto tok = std::unique_ptr<WordPieceTokenizer>(new WordPieceTokenizer());
  WordPieceConfig& c = tok->config_;

  try {
    const json& model = j.at("model");
    if (model.value("type", "") != "WordPiece") {
      return bad("model type '" + model.value("type", "") + "' is not WordPiece");
    }
    c.unk_token = model.value("unk_token", c.unk_token);
    c.continuing_subword_prefix =
        model.value("continuing_subword_prefix", c.continuing_subword_prefix);
    if (model.contains("max_input_chars_per_word")) {
      const std::optional<int64_t> n = json_int64(model.at("max_input_chars_per_word"));
      if (!n || *n < 0) return bad("max_input_chars_per_word is not a natural number");
      c.max_input_chars_per_word = static_cast<size_t>(*n);
    }

    const json& norm = j.at("normalizer");
    if (norm.is_null()) {
      c.clean_text = c.handle_chinese_chars = c.strip_accents = c.lowercase = false;
    } else if (norm.value("type", "") == "BertNormalizer") {
      c.clean_text = norm.value("clean_text", true);
      c.handle_chinese_chars = norm.value("handle_chinese_chars", true);
      c.lowercase = norm.value("lowercase", true);
      const json& sa = norm.contains("strip_accents") ? norm["strip_accents"] : json();
      c.strip_accents = sa.is_boolean() ? sa.get<bool>() : c.lowercase;
    } else {
      return bad("normalizer '" + norm.value("type", "?") + "' is not supported (BertNormalizer)");
    }
    const json& pre = j.at("pre_tokenizer");
    if (!pre.is_object() || pre.value("type", "") != "BertPreTokenizer") {
      return bad("pre_tokenizer is not BertPreTokenizer");
    }

    const json& vocab = model.at("vocab");
    if (!vocab.is_object() || vocab.empty()) return bad("model.vocab is not a non-empty object");
    tok->id_to_token_.resize(vocab.size());
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() >= vocab.size()) {
        return bad("token '" + it.key() + "' has an id outside [0, vocab size)");
      }
      const auto id = static_cast<int32_t>(it.value().get<uint64_t>());
      if (!tok->id_to_token_[id].empty())
        return bad("id " + std::to_string(id) + " is taken twice");
      tok->id_to_token_[id] = it.key();
      tok->vocab_.emplace(it.key(), id);
    }
    if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
      for (const json& a : j["added_tokens"]) {
        // Normalized added tokens would have to be matched after normalisation: not in BERT.
        if (a.value("normalized", false)) {
          return bad("normalized added token '" + a.value("content", "") + "' is not supported");
        }
        // finish_setup() checks the id against the vocabulary; -1 stands for "not an int32".
        const int64_t id = json_int64(a.at("id")).value_or(-1);
        tok->added_tokens_.emplace_back(a.at("content").get<std::string>(),
                                        id > INT32_MAX ? -1 : static_cast<int32_t>(id));
      }
    }
  } catch (const json::exception& e) {
    return bad(std::string("unexpected structure: ") + e.what());
  }
  KEEP_RETURN_IF_ERROR(tok->finish_setup("tokenizer '" + where + "'"));
  return tok;
}

Result<std::unique_ptr<WordPieceTokenizer>> WordPieceTokenizer::from_vocab_txt(
    const std::string& path, const WordPieceConfig& config) {
  KEEP_ASSIGN_OR_RETURN(std::string text, read_file(path));
  auto tok = std::unique_ptr<WordPieceTokenizer>(new WordPieceTokenizer());
  tok->config_ = config;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const auto id = static_cast<int32_t>(tok->id_to_token_.size());
    tok->vocab_.emplace(line, id);  // the first occurrence wins, as in HF
    tok->id_to_token_.push_back(line);
  }
  if (tok->id_to_token_.empty()) {
    return Status(Code::kInvalidArgument, "vocabulary '" + path + "' is empty");
  }
  for (const char* s : {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}) {
    const int32_t id = tok->token_id(s);
    if (id >= 0) tok->added_tokens_.emplace_back(s, id);
  }
  KEEP_RETURN_IF_ERROR(tok->finish_setup("vocabulary '" + path + "'"));
  return tok;
}

Result<std::unique_ptr<WordPieceTokenizer>> WordPieceTokenizer::from_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path tj = fs::path(dir) / "tokenizer.json";
  if (fs::exists(tj, ec)) return from_tokenizer_json(tj.string());
  const fs::path vt = fs::path(dir) / "vocab.txt";
  if (!fs::exists(vt, ec)) {
    return Status(Code::kNotFound,
                  "model directory '" + dir + "': neither tokenizer.json nor vocab.txt exists");
  }
  WordPieceConfig config;
  const fs::path tc = fs::path(dir) / "tokenizer_config.json";
  if (fs::exists(tc, ec)) {
    KEEP_ASSIGN_OR_RETURN(std::string text, read_file(tc.string()));
    const json j = json_nesting_exceeds(text)
                       ? json()
                       : json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) {
      const json lc = j.value("do_lower_case", json(true));
      const json sa = j.value("strip_accents", json());
      const json cjk = j.value("tokenize_chinese_chars", json(true));
      config.lowercase = lc.is_boolean() ? lc.get<bool>() : true;
      config.strip_accents = sa.is_boolean() ? sa.get<bool>() : config.lowercase;
      config.handle_chinese_chars = cjk.is_boolean() ? cjk.get<bool>() : true;
    }
  }
  return from_vocab_txt(vt.string(), config);
}

// ---- lookups
// --------------------------------------------------------------------------------------

int32_t WordPieceTokenizer::token_id(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  return it == vocab_.end() ? -1 : it->second;
}

const std::string& WordPieceTokenizer::token(int32_t id) const {
  static const std::string kEmpty;
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) return kEmpty;
  return id_to_token_[static_cast<size_t>(id)];
}

// ---- the pipeline
// ---------------------------------------------------------------------------------

std::string WordPieceTokenizer::normalize(std::string_view text) const {
  // clean_text + CJK spacing.
  std::u32string s;
  s.reserve(text.size());
  for (char32_t c : decode_utf8(text)) {
    if (config_.clean_text) {
      if (c == 0 || c == 0xFFFD || is_control(c)) continue;
      if (is_whitespace(c)) c = ' ';
    }
    if (config_.handle_chinese_chars && is_chinese_char(c)) {
      s.push_back(' ');
      s.push_back(c);
      s.push_back(' ');
    } else {
      s.push_back(c);
    }
  }
  // Strip accents: NFD (with canonical ordering), then drop nonspacing marks (Mn).
  if (config_.strip_accents && !s.empty()) {
    const std::string utf8 = encode_utf8(s);
    utf8proc_uint8_t* nfd = nullptr;
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(utf8.data()),
                     static_cast<utf8proc_ssize_t>(utf8.size()), &nfd,
                     static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE));
    if (n >= 0 && nfd != nullptr) {  // the input is valid UTF-8 here, so this always succeeds
      s.clear();
      for (char32_t c : decode_utf8(
               std::string_view(reinterpret_cast<const char*>(nfd), static_cast<size_t>(n)))) {
        if (category(c) != UTF8PROC_CATEGORY_MN) s.push_back(c);
      }
    }
    std::free(nfd);
  }
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) {
    if (config_.lowercase) {
      if (c == 0x130) {  // 'İ': the one unconditional multi-character lowercase mapping
        out += "i\xCC\x87";
        continue;
      }
      c = static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c)));
    }
    append_utf8(c, &out);
  }
  return out;
}

std::vector<std::string> WordPieceTokenizer::pre_tokenize(std::string_view normalized) const {
  std::vector<std::string> words;
  std::string cur;
  for (char32_t c : decode_utf8(normalized)) {
    if (is_whitespace(c)) {
      if (!cur.empty()) words.push_back(std::move(cur));
      cur.clear();
    } else if (is_punctuation(c)) {
      if (!cur.empty()) words.push_back(std::move(cur));
      cur.clear();
      std::string p;
      append_utf8(c, &p);
      words.push_back(std::move(p));
    } else {
      append_utf8(c, &cur);
    }
  }
  if (!cur.empty()) words.push_back(std::move(cur));
  return words;
}

bool WordPieceTokenizer::word_pieces(std::string_view word, std::vector<int32_t>* out,
                                     size_t max_tokens) const {
  // Byte offsets of the character boundaries of `word` (valid UTF-8: it came from normalize()).
  std::vector<size_t> bounds;
  for (size_t i = 0; i < word.size(); ++i) {
    if ((static_cast<unsigned char>(word[i]) & 0xC0) != 0x80) bounds.push_back(i);
  }
  const size_t nchars = bounds.size();
  bounds.push_back(word.size());
  if (nchars > config_.max_input_chars_per_word) {
    out->push_back(unk_id_);
    return out->size() < max_tokens;
  }
  std::vector<int32_t> pieces;
  size_t start = 0;  // index into bounds
  std::string candidate;
  while (start < nchars) {
    int32_t found = -1;
    size_t end = nchars;
    for (; end > start; --end) {  // longest match first
      candidate.assign(start > 0 ? config_.continuing_subword_prefix : std::string());
      candidate.append(word.substr(bounds[start], bounds[end] - bounds[start]));
      auto it = vocab_.find(candidate);
      if (it != vocab_.end()) {
        found = it->second;
        break;
      }
    }
    if (found < 0) {  // no piece covers this position: the whole word is unknown
      pieces.assign(1, unk_id_);
      break;
    }
    pieces.push_back(found);
    start = end;
  }
  for (int32_t id : pieces) {
    if (out->size() >= max_tokens) return false;
    out->push_back(id);
  }
  return out->size() < max_tokens;
}

bool WordPieceTokenizer::tokenize_plain(std::string_view text, std::vector<int32_t>* out,
                                        size_t max_tokens) const {
  for (const std::string& w : pre_tokenize(normalize(text))) {
    if (!word_pieces(w, out, max_tokens)) return false;
  }
  return out->size() < max_tokens;
}

std::vector<int32_t> WordPieceTokenizer::tokenize(std::string_view text, size_t max_tokens) const {
  std::vector<int32_t> out;
  if (max_tokens == 0) return out;
  // Split the raw text around added (special) tokens, leftmost then longest match.
  size_t plain_begin = 0;
  size_t i = 0;
  while (i < text.size()) {
    size_t best_len = 0;
    int32_t best_id = -1;
    for (const auto& [content, id] : added_tokens_) {
      if (content.size() > best_len && text.compare(i, content.size(), content) == 0) {
        best_len = content.size();
        best_id = id;
      }
    }
    if (best_len == 0) {
      ++i;
      continue;
    }
    if (!tokenize_plain(text.substr(plain_begin, i - plain_begin), &out, max_tokens)) return out;
    out.push_back(best_id);
    if (out.size() >= max_tokens) return out;
    i += best_len;
    plain_begin = i;
  }
  tokenize_plain(text.substr(plain_begin), &out, max_tokens);
  return out;
}

std::vector<int32_t> WordPieceTokenizer::encode(std::string_view text, size_t max_len) const {
  KEEP_CHECK_MSG(max_len >= 2, "max_len must leave room for [CLS] and [SEP]");
  std::vector<int32_t> ids;
  ids.reserve(64);
  ids.push_back(cls_id_);
  std::vector<int32_t> pieces = tokenize(text, max_len - 2);
  ids.insert(ids.end(), pieces.begin(), pieces.end());
  ids.push_back(sep_id_);
  return ids;
}

}  // namespace keep::manager
