#include "shared/tokenizer/pretokenizer.h"

#include <utf8proc.h>

#include <array>

namespace keep::tok {

int decode_utf8(std::string_view text, size_t pos, uint32_t* cp) {
  const size_t n = text.size();
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(text[k]); };
  const uint8_t b0 = byte(pos);
  *cp = kInvalidCodePoint;
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  int len;
  uint32_t v;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte (rejects overlongs/surrogates)
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
    v = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    v = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    v = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 1;
  }
  if (pos + len > n) return 1;
  const uint8_t b1 = byte(pos + 1);
  if (b1 < lo || b1 > hi) return 1;
  v = (v << 6) | (b1 & 0x3F);
  for (int k = 2; k < len; ++k) {
    const uint8_t b = byte(pos + k);
    if ((b & 0xC0) != 0x80) return 1;
    v = (v << 6) | (b & 0x3F);
  }
  *cp = v;
  return len;
}

namespace {

// Character classes of the split patterns. kNewline (\r, \n) is a subset of \s.
enum Cls : uint8_t { kLetter, kNumber, kSpace, kNewline, kOther };

constexpr std::array<uint8_t, 128> make_ascii_classes() {
  std::array<uint8_t, 128> t{};
  for (int c = 0; c < 128; ++c) {
    uint8_t k = kOther;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) k = kLetter;
    if (c >= '0' && c <= '9') k = kNumber;
    if (c == ' ' || (c >= 0x09 && c <= 0x0D)) k = kSpace;
    if (c == '\r' || c == '\n') k = kNewline;
    t[c] = k;
  }
  return t;
}
constexpr std::array<uint8_t, 128> kAsciiClasses = make_ascii_classes();

// The Unicode White_Space property outside ASCII (Oniguruma's \s).
bool is_unicode_space(uint32_t cp) {
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

uint8_t classify(uint32_t cp) {
  if (cp < 128) return kAsciiClasses[cp];
  if (cp == kInvalidCodePoint) return kOther;
  if (is_unicode_space(cp)) return kSpace;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
      return kLetter;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return kNumber;
    default:
      return kOther;
  }
}

struct CodePoint {
  uint32_t cp;
  uint32_t offset;  // byte offset in the text
  uint8_t cls;
};

// The code points of a text, with a sentinel at the end whose offset is text.size().
class CodePoints {
 public:
  explicit CodePoints(std::string_view text) {
    cps_.reserve(text.size() + 1);
    size_t pos = 0;
    while (pos < text.size()) {
      uint32_t cp;
      const int len = decode_utf8(text, pos, &cp);
      cps_.push_back({cp, static_cast<uint32_t>(pos), classify(cp)});
      pos += static_cast<size_t>(len);
    }
    cps_.push_back({0, static_cast<uint32_t>(text.size()), kOther});
  }
  size_t size() const { return cps_.size() - 1; }
  uint32_t cp(size_t i) const { return cps_[i].cp; }
  uint8_t cls(size_t i) const { return cps_[i].cls; }
  bool space(size_t i) const { return cps_[i].cls == kSpace || cps_[i].cls == kNewline; }
  uint32_t offset(size_t i) const { return cps_[i].offset; }

 private:
  std::vector<CodePoint> cps_;
};

uint32_t ascii_lower(uint32_t cp) { return (cp >= 'A' && cp <= 'Z') ? cp + 32 : cp; }

// 's|'t|'re|'ve|'m|'ll|'d at i (ASCII case folded when fold_case); returns the end or i.
size_t match_contraction(const CodePoints& c, size_t i, size_t end, bool fold_case) {
  if (c.cp(i) != '\'' || i + 1 >= end) return i;
  const auto at = [&](size_t k) { return fold_case ? ascii_lower(c.cp(k)) : c.cp(k); };
  const uint32_t a = at(i + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
  if (i + 2 < end) {
    const uint32_t b = at(i + 2);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
  }
  return i;
}

size_t run_of(const CodePoints& c, size_t i, size_t end, uint8_t cls) {
  while (i < end && c.cls(i) == cls) ++i;
  return i;
}

// The whitespace alternatives at the start of a whitespace run at i: `\s+(?!\S)|\s+`.
size_t match_trailing_space(const CodePoints& c, size_t i, size_t end) {
  size_t j = i;
  while (j < end && c.space(j)) ++j;
  if (j == end) return j;             // \s+ up to the end: (?!\S) holds
  return j - i >= 2 ? j - 1 : i + 1;  // leave the last space to the next word, else \s+
}

// One match of the qwen2 / llama3 pattern starting at i (always > i).
size_t match_qwen2(const CodePoints& c, size_t i, size_t end, size_t max_digits) {
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)
  if (size_t j = match_contraction(c, i, end, /*fold_case=*/true); j != i) return j;
  const uint8_t k = c.cls(i);
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (k != kNewline && k != kLetter && k != kNumber && i + 1 < end && c.cls(i + 1) == kLetter) {
    return run_of(c, i + 1, end, kLetter);
  }
  if (k == kLetter) return run_of(c, i, end, kLetter);
  // \p{N} or \p{N}{1,3}
  if (k == kNumber) {
    size_t j = i + 1;
    while (j < end && j - i < max_digits && c.cls(j) == kNumber) ++j;
    return j;
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  size_t s = i;
  if (c.cp(i) == ' ' && i + 1 < end && c.cls(i + 1) == kOther) s = i + 1;
  if (c.cls(s) == kOther) return run_of(c, run_of(c, s, end, kOther), end, kNewline);
  // Here c[i] is whitespace. \s*[\r\n]+ : up to the last newline of the whitespace run.
  size_t j = i;
  size_t after_newline = i;
  while (j < end && c.space(j)) {
    if (c.cls(j) == kNewline) after_newline = j + 1;
    ++j;
  }
  if (after_newline != i) return after_newline;
  // \s+(?!\S)|\s+
  return match_trailing_space(c, i, end);
}

// One match of the GPT-2 pattern starting at i (always > i).
size_t match_gpt2(const CodePoints& c, size_t i, size_t end) {
  // 's|'t|'re|'ve|'m|'ll|'d
  if (size_t j = match_contraction(c, i, end, /*fold_case=*/false); j != i) return j;
  //  ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+
  size_t s = i;
  if (c.cp(i) == ' ' && i + 1 < end && !c.space(i + 1)) s = i + 1;
  const uint8_t k = c.cls(s);
  if (k == kLetter || k == kNumber || k == kOther) return run_of(c, s, end, k);
  // \s+(?!\S)|\s+
  return match_trailing_space(c, i, end);
}

}  // namespace

Result<PreTokenizer> PreTokenizer::by_name(std::string_view name) {
  if (name == "qwen2") return PreTokenizer(PreTokenizerKind::kQwen2);
  if (name == "llama3" || name == "llama-bpe") return PreTokenizer(PreTokenizerKind::kLlama3);
  if (name == "gpt2") return PreTokenizer(PreTokenizerKind::kGpt2);
  if (name == "smollm") return PreTokenizer(PreTokenizerKind::kSmolLM);
  return Status(Code::kInvalidArgument, "unknown pre-tokenizer '" + std::string(name) +
                                            "' (known: qwen2, llama3, llama-bpe, gpt2, smollm)");
}

const char* PreTokenizer::name() const {
  switch (kind_) {
    case PreTokenizerKind::kQwen2:
      return "qwen2";
    case PreTokenizerKind::kLlama3:
      return "llama3";
    case PreTokenizerKind::kGpt2:
      return "gpt2";
    case PreTokenizerKind::kSmolLM:
      return "smollm";
  }
  return "unknown";
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>* pieces) const {
  if (text.empty()) return;
  const CodePoints c(text);
  const auto emit = [&](size_t a, size_t b) {
    pieces->push_back(text.substr(c.offset(a), c.offset(b) - c.offset(a)));
  };
  const size_t n = c.size();
  switch (kind_) {
    case PreTokenizerKind::kQwen2:
    case PreTokenizerKind::kLlama3: {
      const size_t max_digits = kind_ == PreTokenizerKind::kQwen2 ? 1 : 3;
      for (size_t i = 0; i < n;) {
        const size_t j = match_qwen2(c, i, n, max_digits);
        emit(i, j);
        i = j;
      }
      break;
    }
    case PreTokenizerKind::kGpt2:
      for (size_t i = 0; i < n;) {
        const size_t j = match_gpt2(c, i, n);
        emit(i, j);
        i = j;
      }
      break;
    case PreTokenizerKind::kSmolLM:
      // Digits(individual_digits=true) first: every \p{N} is a piece; the runs between them are
      // split by the GPT-2 pattern with the run's end as the end of the text.
      for (size_t i = 0; i < n;) {
        if (c.cls(i) == kNumber) {
          emit(i, i + 1);
          ++i;
          continue;
        }
        size_t run_end = i;
        while (run_end < n && c.cls(run_end) != kNumber) ++run_end;
        while (i < run_end) {
          const size_t j = match_gpt2(c, i, run_end);
          emit(i, j);
          i = j;
        }
      }
      break;
  }
}

}  // namespace keep::tok
