#include "shared/tokenizer/chat_template.h"

namespace keep::tok {
namespace {

constexpr std::string_view kQwenSystem =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
constexpr std::string_view kSmolLMSystem =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

void append_turn(std::string* out, std::string_view role, std::string_view content) {
  out->append("<|im_start|>").append(role).append("\n").append(content).append("<|im_end|>\n");
}

}  // namespace

Result<ChatTemplate> ChatTemplate::by_name(std::string_view name) {
  if (name == "qwen2.5" || name == "qwen2") return ChatTemplate(ChatTemplateKind::kQwen25);
  if (name == "smollm2") return ChatTemplate(ChatTemplateKind::kSmolLM2);
  if (name == "chatml") return ChatTemplate(ChatTemplateKind::kChatML);
  return Status(Code::kInvalidArgument, "unknown chat template '" + std::string(name) +
                                            "' (known: qwen2.5, smollm2, chatml)");
}

Result<ChatTemplate> ChatTemplate::from_jinja(std::string_view jinja) {
  if (jinja.find(kQwenSystem) != std::string_view::npos) {
    return ChatTemplate(ChatTemplateKind::kQwen25);
  }
  if (jinja.find(kSmolLMSystem) != std::string_view::npos) {
    return ChatTemplate(ChatTemplateKind::kSmolLM2);
  }
  if (jinja.find("<|im_start|>") != std::string_view::npos) {
    return ChatTemplate(ChatTemplateKind::kChatML);
  }
  return Status(Code::kInvalidArgument,
                "unsupported chat template (not ChatML): " + std::string(jinja.substr(0, 80)));
}

const char* ChatTemplate::name() const {
  switch (kind_) {
    case ChatTemplateKind::kQwen25:
      return "qwen2.5";
    case ChatTemplateKind::kSmolLM2:
      return "smollm2";
    case ChatTemplateKind::kChatML:
      return "chatml";
  }
  return "unknown";
}

std::string_view ChatTemplate::default_system_prompt() const {
  switch (kind_) {
    case ChatTemplateKind::kQwen25:
      return kQwenSystem;
    case ChatTemplateKind::kSmolLM2:
      return kSmolLMSystem;
    case ChatTemplateKind::kChatML:
      break;
  }
  return {};
}

Result<std::string> ChatTemplate::render(std::span<const ChatMessage> messages,
                                         bool add_generation_prompt) const {
  const bool qwen = kind_ == ChatTemplateKind::kQwen25;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant" && !(qwen && role == "tool")) {
      return Status(Code::kInvalidArgument, "chat template " + std::string(name()) + ": message " +
                                                std::to_string(i) + " has role '" + role + "'");
    }
  }
  std::string out;
  const bool has_system = !messages.empty() && messages[0].role == "system";
  if (!has_system && kind_ != ChatTemplateKind::kChatML &&
      (qwen || !messages.empty())) {  // SmolLM2's template adds it inside the message loop
    append_turn(&out, "system", default_system_prompt());
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (qwen && m.role == "tool") {
      // Consecutive tool results share one user turn.
      if (i == 0 || messages[i - 1].role != "tool") out.append("<|im_start|>user");
      out.append("\n<tool_response>\n").append(m.content).append("\n</tool_response>");
      if (i + 1 == messages.size() || messages[i + 1].role != "tool") out.append("<|im_end|>\n");
      continue;
    }
    append_turn(&out, m.role, m.content);
  }
  if (add_generation_prompt) out.append("<|im_start|>assistant\n");
  return out;
}

}  // namespace keep::tok
