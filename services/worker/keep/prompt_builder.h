// PromptBuilder: the token ids of a planning prompt, in the pieces KV reuse needs.
//
//   [prefix]            the chat template's system turn, the start of the user turn and the memory
//                       header: the same for every request (its KV stays on the device)
//   [segment] ...       one memory line per retrieved segment ("- <text>\n")
//   [query]             the task, the steps done so far, the end of the user turn and the
//                       assistant header
//
// The pieces are tokenized separately, so a segment's tokens are the same in every prompt and in
// the KV entry computed for it ([prefix][segment] or [prefix][members...]). Text from agents and
// planners (segments, instruction, history) is tokenized with parse_special = false: it can never
// inject control tokens; only the template's own glue is parsed for special tokens.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shared/common/status.h"
#include "shared/tokenizer/bpe_tokenizer.h"
#include "shared/tokenizer/chat_template.h"

namespace keep::worker {

struct PromptFormat {
  // The planner's system turn; empty: the template's default.
  std::string system_prompt =
      "You are the task planner of a household robot. Using what the robot remembers, answer "
      "with the next step of the task: one short action.";
  std::string memory_header = "What I remember:\n";
  std::string segment_prefix = "- ";
  std::string segment_suffix = "\n";
  std::string task_prefix = "\nTask: ";
  std::string history_header = "\nSteps done so far:\n";
  std::string next_step = "\nNext step:";
};

class PromptBuilder {
 public:
  // `tokenizer` must outlive the builder.
  static Result<PromptBuilder> create(const tok::BpeTokenizer* tokenizer,
                                      const tok::ChatTemplate& chat, PromptFormat format = {});

  const std::vector<int32_t>& prefix() const { return prefix_; }
  std::vector<int32_t> segment(std::string_view text) const;
  std::vector<int32_t> query(std::string_view instruction,
                             std::span<const std::string> history) const;
  const PromptFormat& format() const { return format_; }

 private:
  PromptBuilder() = default;
  const tok::BpeTokenizer* tok_ = nullptr;
  PromptFormat format_;
  std::vector<int32_t> prefix_;
  std::string between_;  // template text between the memory and the query (usually empty)
  std::string suffix_;   // template text after the query: end of turn, assistant header
};

}  // namespace keep::worker
