// BERT WordPiece tokenizer, matching Hugging Face `tokenizers` (BertNormalizer + BertPreTokenizer
// + WordPiece + [CLS]/[SEP] template) id for id.
//
// Pipeline for one text:
//   1. added tokens: exact occurrences of the special tokens ("[CLS]", "[SEP]", "[MASK]", ...) in
//      the raw text become their ids (HF matches non-normalized added tokens before normalising);
//   2. BertNormalizer on the rest: clean_text (drop NUL, U+FFFD and control characters, map every
//      whitespace to ' '), CJK ideographs surrounded by spaces, strip accents (NFD, drop Mn marks;
//      on when lowercasing unless configured otherwise), lowercase;
//   3. BertPreTokenizer: split on whitespace, and isolate every punctuation character (ASCII
//      punctuation or Unicode P*);
//   4. WordPiece: greedy longest-match-first with the "##" continuation prefix; a word longer than
//      max_input_chars_per_word (100) characters, or one that cannot be covered, is one [UNK];
//   5. [CLS] pieces [SEP], truncated so that the whole sequence has at most max_len ids.
// Invalid UTF-8 bytes are read as U+FFFD, which clean_text drops: bad input never fails.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shared/common/status.h"

namespace keep::manager {

struct WordPieceConfig {
  bool clean_text = true;
  bool handle_chinese_chars = true;
  bool strip_accents = true;  // HF: null means "same as lowercase"
  bool lowercase = true;
  std::string unk_token = "[UNK]";
  std::string continuing_subword_prefix = "##";
  size_t max_input_chars_per_word = 100;
};

class WordPieceTokenizer {
 public:
  // tokenizer.json of a BERT model (model.type "WordPiece", BertNormalizer, BertPreTokenizer).
  // Refuses other pipelines with kInvalidArgument naming the unsupported part.
  static Result<std::unique_ptr<WordPieceTokenizer>> from_tokenizer_json(const std::string& path);
  // The same from the file's text; `where` names it in messages.
  static Result<std::unique_ptr<WordPieceTokenizer>> from_tokenizer_json_text(
      std::string_view text, const std::string& where);
  // vocab.txt: one token a line, id = line number.
  static Result<std::unique_ptr<WordPieceTokenizer>> from_vocab_txt(const std::string& path,
                                                                    const WordPieceConfig& config);
  // A model directory: tokenizer.json when present, else vocab.txt (+ tokenizer_config.json's
  // do_lower_case / strip_accents / tokenize_chinese_chars).
  static Result<std::unique_ptr<WordPieceTokenizer>> from_dir(const std::string& dir);

  // [CLS] pieces [SEP] with at most max_len ids in total (max_len >= 2).
  std::vector<int32_t> encode(std::string_view text, size_t max_len) const;
  // The pieces only (no [CLS]/[SEP]); stops after max_tokens pieces.
  std::vector<int32_t> tokenize(std::string_view text, size_t max_tokens = SIZE_MAX) const;

  // The stages, exposed for tests.
  std::string normalize(std::string_view text) const;
  std::vector<std::string> pre_tokenize(std::string_view normalized) const;

  const WordPieceConfig& config() const { return config_; }
  // Forces lowercasing on (sentence-transformers' do_lower_case).
  void set_lowercase(bool on) { config_.lowercase = on; }
  size_t vocab_size() const { return id_to_token_.size(); }
  int32_t token_id(std::string_view token) const;  // -1 when absent
  const std::string& token(int32_t id) const;      // "" when out of range
  int32_t cls_id() const { return cls_id_; }
  int32_t sep_id() const { return sep_id_; }
  int32_t pad_id() const { return pad_id_; }
  int32_t unk_id() const { return unk_id_; }

 private:
  WordPieceTokenizer() = default;
  Status finish_setup(const std::string& where);
  // Appends the wordpieces of one pre-token; false once max_tokens is reached.
  bool word_pieces(std::string_view word, std::vector<int32_t>* out, size_t max_tokens) const;
  // Normalise + pre-tokenize + wordpiece one stretch of text without added tokens.
  bool tokenize_plain(std::string_view text, std::vector<int32_t>* out, size_t max_tokens) const;

  WordPieceConfig config_;
  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<std::pair<std::string, int32_t>> added_tokens_;  // matched in the raw text
  int32_t cls_id_ = -1, sep_id_ = -1, pad_id_ = -1, unk_id_ = -1;
};

}  // namespace keep::manager
