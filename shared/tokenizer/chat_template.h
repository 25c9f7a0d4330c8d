// ChatTemplate: renders a conversation into the prompt text of a chat model, byte-exact with the
// Jinja templates the models ship (tokenizer_config.json `chat_template` / GGUF
// `tokenizer.chat_template`) for the message shapes we use (no tool calls).
//
// Kinds:
//   kQwen25   Qwen2.5: ChatML; a system turn "You are Qwen, created by Alibaba Cloud. You are a
//             helpful assistant." when the first message is not a system one (also for an empty
//             conversation, where the Jinja template fails); later system turns are rendered in
//             place; role "tool" turns become <tool_response> blocks inside a user turn.
//   kSmolLM2  SmolLM2-Instruct: ChatML; a system turn "You are a helpful AI assistant named SmolLM,
//             trained by Hugging Face" when the first message is not a system one; every
//             message rendered as <|im_start|>role\ncontent<|im_end|>\n.
//   kChatML   plain ChatML, no default system turn.
// add_generation_prompt appends "<|im_start|>assistant\n".
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "shared/common/status.h"

namespace keep::tok {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" ("tool" for kQwen25)
  std::string content;
};

enum class ChatTemplateKind : uint8_t { kQwen25, kSmolLM2, kChatML };

class ChatTemplate {
 public:
  explicit ChatTemplate(ChatTemplateKind kind) : kind_(kind) {}

  // "qwen2.5" (alias "qwen2"), "smollm2", "chatml"; kInvalidArgument otherwise.
  static Result<ChatTemplate> by_name(std::string_view name);
  // Recognizes a model's Jinja template text (from tokenizer_config.json or GGUF metadata):
  // Qwen2.5's and SmolLM2's by their default system prompts, other ChatML ones by <|im_start|>.
  // kInvalidArgument for templates we cannot render.
  static Result<ChatTemplate> from_jinja(std::string_view jinja);

  ChatTemplateKind kind() const { return kind_; }
  const char* name() const;
  // The system prompt used when the conversation has none ("" for kChatML).
  std::string_view default_system_prompt() const;

  // kInvalidArgument for a role the template cannot render (roles other than system, user,
  // assistant and, for kQwen25, tool), naming the message.
  Result<std::string> render(std::span<const ChatMessage> messages,
                             bool add_generation_prompt) const;

 private:
  ChatTemplateKind kind_;
};

}  // namespace keep::tok
