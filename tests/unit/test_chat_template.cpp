// ChatTemplate against jinja2 renderings of the models' own templates
// (tests/fixtures/tokenizer/chat_templates.json, from scripts/make_tokenizer_fixture.py).
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shared/tokenizer/bpe_tokenizer.h"
#include "shared/tokenizer/chat_template.h"

using keep::Code;
using keep::tok::ChatMessage;
using keep::tok::ChatTemplate;
using keep::tok::ChatTemplateKind;
using nlohmann::json;

namespace {

json load_fixture() {
  std::ifstream in("tests/fixtures/tokenizer/chat_templates.json");
  REQUIRE(in.good());
  return json::parse(in);
}

std::vector<ChatMessage> messages_of(const json& row) {
  std::vector<ChatMessage> out;
  for (const json& m : row.at("messages")) out.push_back({m.at("role"), m.at("content")});
  return out;
}

}  // namespace

TEST_CASE("renderings equal the models' Jinja templates") {
  const json fixture = load_fixture();
  for (const auto& [name, rows] : fixture.at("renderings").items()) {
    auto tmpl = ChatTemplate::by_name(name);
    REQUIRE(tmpl.is_ok());
    CHECK(std::string(tmpl->name()) == name);
    REQUIRE(rows.size() >= 10);
    for (const json& row : rows) {
      const auto rendered = tmpl->render(messages_of(row), row.at("add_generation_prompt"));
      REQUIRE(rendered.is_ok());
      CHECK_MESSAGE(*rendered == row.at("rendered").get<std::string>(),
                    name << ": " << row.at("messages").dump());
    }
  }
}

TEST_CASE("templates are recognized from the Jinja text") {
  const json fixture = load_fixture();
  CHECK(ChatTemplate::from_jinja(fixture.at("jinja").at("qwen2.5").get<std::string>())->kind() ==
        ChatTemplateKind::kQwen25);
  CHECK(ChatTemplate::from_jinja(fixture.at("jinja").at("smollm2").get<std::string>())->kind() ==
        ChatTemplateKind::kSmolLM2);
  CHECK(ChatTemplate::from_jinja("{{ '<|im_start|>' + m }}")->kind() == ChatTemplateKind::kChatML);
  CHECK(ChatTemplate::from_jinja("[INST] {{ m }} [/INST]").status().code() ==
        Code::kInvalidArgument);
  CHECK(ChatTemplate::by_name("llama2").status().code() == Code::kInvalidArgument);
}

TEST_CASE("default system prompts, empty conversations and bad roles") {
  const ChatTemplate qwen(ChatTemplateKind::kQwen25);
  const ChatTemplate smol(ChatTemplateKind::kSmolLM2);
  const ChatTemplate chatml(ChatTemplateKind::kChatML);
  CHECK(qwen.default_system_prompt() ==
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  // Qwen's Jinja fails on an empty list; we still give the default system turn.
  CHECK(*qwen.render({}, true) ==
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>assistant\n");
  CHECK(*smol.render({}, true) == "<|im_start|>assistant\n");  // as its Jinja renders
  const std::vector<ChatMessage> msgs = {{"user", "hi"}};
  CHECK(*chatml.render(msgs, false) == "<|im_start|>user\nhi<|im_end|>\n");
  const std::vector<ChatMessage> bad = {{"user", "hi"}, {"robot", "beep"}};
  auto r = qwen.render(bad, false);
  CHECK(r.status().code() == Code::kInvalidArgument);
  CHECK(r.status().message().find("message 1") != std::string::npos);
  CHECK(smol.render(std::vector<ChatMessage>{{"tool", "x"}}, false).status().code() ==
        Code::kInvalidArgument);
}

TEST_CASE("qwen2.5 prompts tokenize to HF's ids") {
  auto tok = keep::tok::BpeTokenizer::from_json_file("models/qwen2.5-tokenizer/tokenizer.json");
  REQUIRE_MESSAGE(tok.is_ok(), tok.status().to_string());
  const json fixture = load_fixture();
  const ChatTemplate qwen(ChatTemplateKind::kQwen25);
  for (const json& row : fixture.at("renderings").at("qwen2.5")) {
    const auto rendered = qwen.render(messages_of(row), row.at("add_generation_prompt"));
    REQUIRE(rendered.is_ok());
    CHECK(tok->encode(*rendered) == row.at("ids").get<std::vector<int32_t>>());
  }
}
