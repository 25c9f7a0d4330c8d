// BpeTokenizer: byte-level BPE (GPT-2 / Qwen2 / Llama-3 / SmolLM2 family), bit-exact with HF
// `tokenizers` for the tokenizer.json files we serve.
//
// Encoding, in HF's order:
//   1. Added tokens (special or not) whose `normalized` is false are split out of the raw text,
//      leftmost-longest (lstrip/rstrip/single_word honoured). They are never merged across.
//   2. Each remaining span is normalized (NFC, NFKC, NFD, NFKD or none, via utf8proc); added tokens
//      with `normalized` true are then split out of the normalized span.
//   3. The pre-tokenizer (pretokenizer.h) splits the span into pieces.
//   4. Each piece's bytes map to the byte-level alphabet (0x21 '!' -> "!", 0x20 ' ' -> "Ġ", ...)
//      and BPE merges adjacent symbols by merge rank, lowest first, leftmost on ties. Results of
//      pieces are cached (bounded, thread-safe).
//   5. With add_special, the post-processor's prefix/suffix ids (BOS/EOS of a TemplateProcessing)
//      are added. Qwen2.5 and SmolLM2 add none.
//
// Invalid UTF-8 (we get bytes, HF gets a Python str): encode never fails. A byte that does not
// start a well-formed sequence is left out of normalization, acts as one "other" (punctuation-like)
// character in the pre-tokenizer, and is encoded as its own byte through the byte-level alphabet.
// So decode(encode(b)) == b for any bytes b whose valid parts are already normalized; HF would see
// U+FFFD instead (its Python callers decode with errors="replace").
//
// Decoding concatenates the bytes of each token: byte-level tokens are mapped back to bytes, added
// tokens give their content. Unknown ids are skipped (as HF does). The result is raw bytes, which
// may end in the middle of a UTF-8 sequence when the ids do; streaming callers should hold back an
// incomplete tail (see utf8_complete_prefix).
//
// Thread safety: all const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shared/common/status.h"
#include "shared/tokenizer/pretokenizer.h"

namespace keep::tok {

// A token matched verbatim in the text before BPE (HF "added_tokens"; GGUF token types
// CONTROL = special, USER_DEFINED = not special).
struct AddedToken {
  int32_t id = -1;
  std::string content;       // UTF-8, as written in the text
  bool special = true;       // skipped by decode(skip_special=true)
  bool lstrip = false;       // also swallows whitespace on its left
  bool rstrip = false;       // also swallows whitespace on its right
  bool single_word = false;  // only matches when not inside a word
  bool normalized = false;   // matched in the normalized text instead of the raw text
};

enum class Normalization : uint8_t { kNone, kNfc, kNfkc, kNfd, kNfkd };

struct BpeOptions {
  std::string pre_tokenizer = "qwen2";  // a PreTokenizer::by_name name
  Normalization normalization = Normalization::kNfc;
  bool ignore_merges = false;       // a piece that is itself in the vocabulary is one token
  std::vector<int32_t> prefix_ids;  // added in front by encode(add_special=true)
  std::vector<int32_t> suffix_ids;  // added at the end by encode(add_special=true)
  std::optional<int32_t> bos_id, eos_id, pad_id;  // informational (engine stop tokens etc.)
};

// Token ids (vocabulary and added tokens) must lie below this: the ids size the lookup tables, so
// a hostile id would otherwise allocate gigabytes. The largest real vocabularies have ~262k.
inline constexpr int32_t kMaxTokenIds = 1 << 21;

class BpeTokenizer {
 public:
  // Loads a HF tokenizer.json: model BPE (merges as "a b" strings or [a, b] pairs), byte-level
  // pre-tokenizer/decoder, normalizer NFC/NFKC/NFD/NFKD/none, added_tokens, post_processor
  // ByteLevel or TemplateProcessing (prefix/suffix specials). Anything else is kInvalidArgument
  // naming the unsupported part; kIoError / kMalformed for unreadable or invalid files.
  static Result<BpeTokenizer> from_json_file(const std::string& path);
  static Result<BpeTokenizer> from_json_string(std::string_view json);

  // Builds from raw lists (what a GGUF "gpt2" vocabulary holds: tokenizer.ggml.tokens,
  // tokenizer.ggml.merges, token types). tokens[id] is the byte-level token text ("Ġthe"); an
  // added token may reuse a vocabulary id (its text then must equal the token) or extend the ids.
  // Every merge "a b" needs a, b and ab in the vocabulary.
  static Result<BpeTokenizer> from_vocab_and_merges(
      std::vector<std::string> tokens,
      const std::vector<std::pair<std::string, std::string>>& merges,
      std::vector<AddedToken> added_tokens, BpeOptions options);

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  // Text (bytes, normally UTF-8) to ids. parse_special=false treats special added tokens in the
  // text as plain text (for untrusted content that must not inject control tokens).
  std::vector<int32_t> encode(std::string_view text, bool add_special = false,
                              bool parse_special = true) const;
  // encode(text, add_special).size(): the manager's per-segment token count.
  size_t count_tokens(std::string_view text, bool add_special = false) const;

  // Ids to bytes (see above). skip_special drops special added tokens.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  // The bytes one token decodes to; empty for an unknown id.
  std::string_view token_bytes(int32_t id) const;

  // The token text as the vocabulary writes it ("Ġthe", "<|im_end|>"); nullopt when unknown.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;

  // One past the largest id (HF get_vocab_size(with_added_tokens=True)).
  int32_t vocab_size() const;
  const BpeOptions& options() const;
  const std::vector<AddedToken>& added_tokens() const;
  // FNV-1a 64 over vocabulary, merges, added tokens and options: part of the model fingerprint.
  uint64_t fingerprint() const;

 private:
  struct Impl;
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The length of the longest prefix of `bytes` that does not end inside an incomplete (but so far
// valid) UTF-8 sequence. Invalid bytes count as complete. For streaming decode.
size_t utf8_complete_prefix(std::string_view bytes);

}  // namespace keep::tok
