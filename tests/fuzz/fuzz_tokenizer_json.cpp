// libFuzzer target: arbitrary bytes as a tokenizer.json, through both loaders of one: the
// byte-level BPE tokenizer (BpeTokenizer::from_json_string: the worker's and the manager's token
// counts) and the BERT WordPiece tokenizer (WordPieceTokenizer::from_tokenizer_json_text: the
// encoder). A tokenizer that loads encodes and decodes a fixed text plus the input's first bytes.
// Checks: every id encode() returns is inside the vocabulary.
// Seeds: tests/fuzz/corpus/fuzz_tokenizer_json/ (README.md there says how they were made).
#include <algorithm>
#include <string>
#include <vector>

#include "services/manager/encoder/wordpiece_tokenizer.h"
#include "shared/common/log.h"
#include "shared/tokenizer/bpe_tokenizer.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  keep::log::set_level(keep::log::Level::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = keep::fuzz::as_text(data, size);
  std::string sample = "Hello, world! <|im_start|>user [CLS] 12345 ünïcode 日本語\r\n\t  [SEP] ";
  sample.append(text.substr(0, std::min<size_t>(text.size(), 64)));

  auto bpe = keep::tok::BpeTokenizer::from_json_string(text);
  if (bpe.is_ok()) {
    for (bool special : {false, true}) {
      const std::vector<int32_t> ids = bpe->encode(sample, special, special);
      for (int32_t id : ids) KEEP_FUZZ_ASSERT(id >= 0 && id < bpe->vocab_size());
      (void)bpe->decode(ids, special);
    }
    (void)bpe->fingerprint();
  }

  auto wp = keep::manager::WordPieceTokenizer::from_tokenizer_json_text(text, "tokenizer.json");
  if (wp.is_ok()) {
    const std::vector<int32_t> ids = (*wp)->encode(sample, 64);
    KEEP_FUZZ_ASSERT(ids.size() <= 64);
    for (int32_t id : ids) {
      KEEP_FUZZ_ASSERT(id >= 0 && static_cast<size_t>(id) < (*wp)->vocab_size());
    }
  }
  return 0;
}
