#include "services/worker/keep/prompt_builder.h"

namespace keep::worker {
namespace {

// Markers the rendered conversation is split at; they are never tokenized.
constexpr std::string_view kMemoryMark = "\x01KEEP-MEMORY\x01";
constexpr std::string_view kQueryMark = "\x01KEEP-QUERY\x01";

void append(std::vector<int32_t>* out, const std::vector<int32_t>& more) {
  out->insert(out->end(), more.begin(), more.end());
}

}  // namespace

Result<PromptBuilder> PromptBuilder::create(const tok::BpeTokenizer* tokenizer,
                                            const tok::ChatTemplate& chat, PromptFormat format) {
  if (tokenizer == nullptr) return Status(Code::kInvalidArgument, "prompt builder: no tokenizer");
  std::vector<tok::ChatMessage> messages;
  if (!format.system_prompt.empty()) messages.push_back({"system", format.system_prompt});
  messages.push_back(
      {"user", format.memory_header + std::string(kMemoryMark) + std::string(kQueryMark)});
  KEEP_ASSIGN_OR_RETURN(std::string text, chat.render(messages, /*add_generation_prompt=*/true));
  const size_t m = text.find(kMemoryMark);
  const size_t q = text.find(kQueryMark);
  if (m == std::string::npos || q == std::string::npos || q < m) {
    return Status(Code::kInternal, "prompt builder: the chat template lost the content markers");
  }
  PromptBuilder b;
  b.tok_ = tokenizer;
  b.format_ = std::move(format);
  b.prefix_ = tokenizer->encode(std::string_view(text).substr(0, m));
  b.between_ = text.substr(m + kMemoryMark.size(), q - m - kMemoryMark.size());
  b.suffix_ = text.substr(q + kQueryMark.size());
  if (b.prefix_.empty()) return Status(Code::kInternal, "prompt builder: empty prefix");
  return b;
}

std::vector<int32_t> PromptBuilder::segment(std::string_view text) const {
  std::string line = format_.segment_prefix;
  line += text;
  line += format_.segment_suffix;
  return tok_->encode(line, false, /*parse_special=*/false);
}

std::vector<int32_t> PromptBuilder::query(std::string_view instruction,
                                          std::span<const std::string> history) const {
  std::string text = format_.task_prefix;
  text += instruction;
  if (!history.empty()) {
    text += format_.history_header;
    for (size_t i = 0; i < history.size(); ++i) {
      text += std::to_string(i + 1) + ". " + history[i] + "\n";
    }
  }
  text += format_.next_step;
  std::vector<int32_t> out;
  if (!between_.empty()) append(&out, tok_->encode(between_));
  append(&out, tok_->encode(text, false, /*parse_special=*/false));
  append(&out, tok_->encode(suffix_));
  return out;
}

}  // namespace keep::worker
