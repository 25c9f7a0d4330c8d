// PreTokenizer: splits text into the pieces that byte-level BPE then encodes one by one.
//
// The split patterns of the tokenizers we serve are hand-written matchers over code points (no
// std::regex: it has no Unicode classes and backtracks exponentially). Character classes come from
// utf8proc: \p{L} = general category L*, \p{N} = N*, \s = the Unicode White_Space property (what
// Oniguruma, the regex engine of HF `tokenizers`, uses).
//
// Patterns, selectable by name (llama.cpp's `tokenizer.ggml.pre` names where they exist):
//   "qwen2"  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//            \s*[\r\n]+|\s+(?!\S)|\s+
//   "llama3" (alias "llama-bpe") the same with \p{N}{1,3} instead of \p{N}
//   "gpt2"   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//            (HF ByteLevel with use_regex=true)
//   "smollm" every \p{N} isolated first (HF Digits(individual_digits=true)), then "gpt2" on the
//            rest: SmolLM2, StarCoder and relatives
// The case-insensitive contractions fold ASCII letters only (as Oniguruma does for these letters).
//
// Invalid UTF-8: every byte that does not start a well-formed sequence is a code point of its own
// in the "other" class (neither letter, number nor space), so it groups like punctuation. The
// pieces are byte ranges of the input, so such bytes reach the byte-level BPE unchanged.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"

namespace keep::tok {

// Decodes one code point at text[pos]. Returns its length in bytes (1..4) and stores the code
// point in *cp; for an invalid or truncated sequence returns 1 and stores kInvalidCodePoint.
inline constexpr uint32_t kInvalidCodePoint = 0xFFFFFFFFu;
int decode_utf8(std::string_view text, size_t pos, uint32_t* cp);

enum class PreTokenizerKind : uint8_t { kQwen2, kLlama3, kGpt2, kSmolLM };

class PreTokenizer {
 public:
  explicit PreTokenizer(PreTokenizerKind kind = PreTokenizerKind::kQwen2) : kind_(kind) {}

  // "qwen2", "llama3" / "llama-bpe", "gpt2", "smollm"; kInvalidArgument otherwise.
  static Result<PreTokenizer> by_name(std::string_view name);

  PreTokenizerKind kind() const { return kind_; }
  // The canonical name ("qwen2", "llama3", "gpt2", "smollm").
  const char* name() const;

  // Appends the pieces of `text` to `pieces` (views into `text`, in order, covering it exactly;
  // none empty).
  void split(std::string_view text, std::vector<std::string_view>* pieces) const;

 private:
  PreTokenizerKind kind_;
};

}  // namespace keep::tok
