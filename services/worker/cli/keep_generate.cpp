// keep-generate: runs the engine on one prompt from the command line, on the CPU or CUDA backend
// (--device auto|cpu|cuda; auto takes the GPU when this build has CUDA and a GPU answers).
//
//   keep-generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --chat --prompt "Hi"   # text
//   keep-generate --model DIR --prompt-ids 1,2,3 --ids --max-tokens 8                   # ids
//   keep-generate --prompt "The cup is in the" --candidates " sink| fridge| moon"       # scores
//   keep-generate --model models/qwen2.5-tokenizer --chat --prompt "Hi" --tokenize      # ids
//
// Text streams to stdout as tokens are decoded (an incomplete UTF-8 tail is held back), then a
// newline. Every failure is one line "keep-generate: <what>" on stderr: exit 2 for usage errors
// (bad flags, bad prompt ids, empty prompt, a request the model cannot take), 1 for runtime errors
// (the model cannot be loaded: missing path, unsupported architecture or dtype, ...).
// `keep-generate --help` lists every option with its default.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "services/worker/engine/core/engine.h"
#include "services/worker/engine/core/sampling.h"
#include "services/worker/engine/open_model.h"
#include "shared/common/log.h"
#include "shared/common/options.h"
#include "shared/model/hf_loader.h"
#include "shared/model/model_identity.h"
#include "shared/model/model_weights.h"
#include "shared/tokenizer/bpe_tokenizer.h"
#include "shared/tokenizer/chat_template.h"

namespace {

using keep::Result;
using keep::Status;
using Clock = std::chrono::steady_clock;
namespace eng = keep::engine;

constexpr const char* kProgram = "keep-generate";
constexpr int kExitRuntime = 1;
constexpr int kExitUsage = 2;

// A failure and the exit code it maps to; main prints it as one line.
struct Failure {
  int exit_code;
  std::string message;
};
Failure usage(std::string msg) { return Failure{kExitUsage, std::move(msg)}; }
Failure runtime(std::string msg) { return Failure{kExitRuntime, std::move(msg)}; }

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Declares every option; returns their names (for the unknown-flag check).
std::vector<std::string> declare_options(keep::Options* opts) {
  std::vector<std::string> names = {"config"};
  auto add = [&](const char* name, const char* def, const char* help) {
    opts->add(name, def, help);
    names.emplace_back(name);
  };
  add("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf",
      "Hugging Face model directory (config.json + safetensors) or .gguf file");
  add("prompt", "", "prompt text (tokenized with the model's tokenizer)");
  add("prompt-ids", "", "prompt as comma-separated token ids, instead of --prompt");
  add("chat", "false", "apply the model's chat template with --prompt as the user message");
  add("system", "", "system message for --chat (empty: the template's default)");
  add("max-tokens", "64", "maximum number of tokens to generate (>= 1)");
  add("temperature", "0", "sampling temperature; 0 = greedy (argmax)");
  add("top-p", "1", "nucleus sampling: keep the most likely tokens with this mass, (0, 1]");
  add("top-k", "0", "keep at most the K most likely tokens; 0 = no limit");
  add("seed", "0", "random seed for sampling (the same seed reproduces a continuation)");
  add("ignore-eos", "false", "do not stop at the model's end-of-sequence tokens");
  add("special", "false", "print special tokens (e.g. <|im_end|>) in text output");
  add("ids", "false", "print the generated token ids (one line, comma-separated), not text");
  add("candidates", "",
      "score continuations instead of generating: 'a|b|c' (repeatable); prints sum log-prob, "
      "mean log-prob, tokens, text per candidate, best first");
  add("candidate-ids", "",
      "candidates as token ids: '1,2|3,4' (repeatable), for token-level scoring");
  add("json", "false", "print the result as one JSON object (no streaming)");
  add("threads", "0", "CPU threads for loading, attention and BLAS; 0 = all cores");
  add("device", "auto", "cpu, cuda, or auto (cuda when built with CUDA and a GPU is usable)");
  add("stats", "false", "print load time and prefill / decode tokens per second to stderr");
  add("log-level", "warn", "debug, info, warn, error or off");
  add("tokenize", "false",
      "print the prompt's token ids (comma-separated; with --json an object) and exit; reads "
      "only the tokenizer: a directory holding just tokenizer.json is enough");
  return names;
}

// Takes every occurrence of the repeatable flags out of argv (keep::Options keeps only the last
// value of a flag). `--name=value` and `--name value` are both accepted.
std::optional<Failure> take_repeated(std::vector<char*>* args,
                                     const std::vector<std::string>& names,
                                     std::vector<std::vector<std::string>>* values) {
  std::vector<char*> rest;
  values->assign(names.size(), {});
  for (size_t i = 0; i < args->size(); ++i) {
    const std::string a = (*args)[i];
    if (a == "--help" || a == "-h") return std::nullopt;  // leave --help to Options
    bool taken = false;
    for (size_t n = 0; n < names.size() && !taken; ++n) {
      const std::string flag = "--" + names[n];
      if (a == flag) {
        if (i + 1 >= args->size() || std::string((*args)[i + 1]).rfind("--", 0) == 0) {
          return usage("option " + flag + " needs a value");
        }
        (*values)[n].push_back((*args)[++i]);
        taken = true;
      } else if (a.rfind(flag + "=", 0) == 0) {
        (*values)[n].push_back(a.substr(flag.size() + 1));
        taken = true;
      }
    }
    if (!taken) rest.push_back((*args)[i]);
  }
  *args = std::move(rest);
  return std::nullopt;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t at = s.find(sep, start);
    out.push_back(s.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) break;
    start = at + 1;
  }
  return out;
}

// "1, 2,3" -> {1, 2, 3}. `what` names the flag in errors.
Result<std::vector<int32_t>> parse_ids(const std::string& text, const std::string& what) {
  std::vector<int32_t> ids;
  for (std::string item : split(text, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty() && text.find_first_not_of(" \t") == std::string::npos) break;  // all blank
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos ||
        item.size() > 10 || std::stoll(item) > INT32_MAX) {
      return Status(keep::Code::kInvalidArgument,
                    what + ": '" + item + "' is not a token id (a non-negative integer)");
    }
    ids.push_back(static_cast<int32_t>(std::stoll(item)));
  }
  return ids;
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(ids[i]);
  }
  return s;
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\r', ' ');
  return s;
}

std::string json_dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Every setting, validated, before the model is touched.
struct Request {
  std::string model;
  std::string prompt;
  std::optional<std::vector<int32_t>> prompt_ids;
  bool chat = false;
  std::string system;
  int32_t max_tokens = 64;
  eng::SamplingParams sampling;
  bool ignore_eos = false;
  bool special = false;
  bool print_ids = false;
  std::vector<std::string> candidates;              // text
  std::vector<std::vector<int32_t>> candidate_ids;  // token ids
  bool json = false;
  int threads = 0;
  std::string device = "auto";
  bool stats = false;
  bool tokenize = false;
};

std::optional<Failure> read_request(const keep::Options& o,
                                    const std::vector<std::vector<std::string>>& repeated,
                                    Request* r) {
  auto fail = [](const Status& st) { return usage(st.message()); };
  r->model = o.str("model");
  if (r->model.empty()) return usage("--model: empty path");
  r->prompt = o.str("prompt");
  const std::string ids_text = o.str("prompt-ids");
  if (!r->prompt.empty() && !ids_text.empty()) {
    return usage("give either --prompt or --prompt-ids, not both");
  }
  if (!ids_text.empty()) {
    auto ids = parse_ids(ids_text, "--prompt-ids");
    if (!ids.is_ok()) return fail(ids.status());
    r->prompt_ids = std::move(ids).value();
  }
  if (r->prompt.empty() && (!r->prompt_ids || r->prompt_ids->empty())) {
    return usage("empty prompt (give --prompt TEXT or --prompt-ids 1,2,3)");
  }
  auto b = o.boolean("chat");
  if (!b.is_ok()) return fail(b.status());
  r->chat = *b;
  r->system = o.str("system");
  if (r->chat && r->prompt_ids) return usage("--chat needs --prompt TEXT, not --prompt-ids");
  if (!r->system.empty() && !r->chat) return usage("--system needs --chat");

  auto mt = o.int64("max-tokens");
  if (!mt.is_ok()) return fail(mt.status());
  if (*mt <= 0 || *mt > 1'000'000) {
    return usage("--max-tokens: must be between 1 and 1000000, got " + std::to_string(*mt));
  }
  r->max_tokens = static_cast<int32_t>(*mt);
  auto temp = o.number("temperature");
  if (!temp.is_ok()) return fail(temp.status());
  if (!(*temp >= 0.0) || !std::isfinite(*temp)) {
    return usage("--temperature: must be >= 0, got " + o.str("temperature"));
  }
  auto top_p = o.number("top-p");
  if (!top_p.is_ok()) return fail(top_p.status());
  if (!(*top_p > 0.0 && *top_p <= 1.0)) {
    return usage("--top-p: must be in (0, 1], got " + o.str("top-p"));
  }
  auto top_k = o.int64("top-k");
  if (!top_k.is_ok()) return fail(top_k.status());
  if (*top_k < 0 || *top_k > INT32_MAX)
    return usage("--top-k: must be >= 0, got " + o.str("top-k"));
  auto seed = o.uint64("seed");
  if (!seed.is_ok()) return fail(seed.status());
  r->sampling.temperature = static_cast<float>(*temp);
  r->sampling.top_p = static_cast<float>(*top_p);
  r->sampling.top_k = static_cast<int32_t>(*top_k);
  r->sampling.seed = *seed;

  for (const auto& [name, dst] : {std::pair<const char*, bool*>{"ignore-eos", &r->ignore_eos},
                                  {"special", &r->special},
                                  {"ids", &r->print_ids},
                                  {"json", &r->json},
                                  {"stats", &r->stats},
                                  {"tokenize", &r->tokenize}}) {
    auto v = o.boolean(name);
    if (!v.is_ok()) return fail(v.status());
    *dst = *v;
  }
  auto threads = o.int64("threads");
  if (!threads.is_ok()) return fail(threads.status());
  if (*threads < 0 || *threads > 4096)
    return usage("--threads: must be >= 0, got " + o.str("threads"));
  r->threads = static_cast<int>(*threads);
  r->device = o.str("device");
  if (r->device != "auto" && r->device != "cpu" && r->device != "cuda") {
    return usage("--device: must be auto, cpu or cuda, got '" + r->device + "'");
  }

  // Candidates: every occurrence on the command line, else the (config file) value.
  std::vector<std::string> text_lists = repeated[0], id_lists = repeated[1];
  if (text_lists.empty() && !o.str("candidates").empty()) text_lists.push_back(o.str("candidates"));
  if (id_lists.empty() && !o.str("candidate-ids").empty())
    id_lists.push_back(o.str("candidate-ids"));
  for (const std::string& list : text_lists) {
    for (const std::string& c : split(list, '|')) {
      if (c.empty()) return usage("--candidates: empty candidate in '" + list + "'");
      r->candidates.push_back(c);
    }
  }
  for (const std::string& list : id_lists) {
    for (const std::string& c : split(list, '|')) {
      auto ids = parse_ids(c, "--candidate-ids");
      if (!ids.is_ok()) return fail(ids.status());
      if (ids->empty()) return usage("--candidate-ids: empty candidate in '" + list + "'");
      r->candidate_ids.push_back(std::move(ids).value());
    }
  }
  return std::nullopt;
}

struct Runtime {
  eng::LoadedModel model;  // weights moved out into the backend; tokenizer, template, source stay
  std::unique_ptr<eng::Engine> engine;
};

std::optional<Failure> load(const Request& r, Runtime* rt) {
  const auto t0 = Clock::now();
  eng::OpenOptions oo;
  oo.device = r.device;
  oo.threads = r.threads;
  auto opened = eng::open_model(r.model, oo);
  if (!opened.is_ok()) {
    const bool gpu = opened.status().message().find("--device cuda") != std::string::npos;
    return runtime((gpu ? "cannot use the GPU: " : "cannot load model: ") +
                   opened.status().message());
  }
  rt->model.tokenizer = std::move(opened->tokenizer);
  rt->model.chat_template = std::move(opened->chat_template);
  rt->model.format = opened->format;
  rt->model.source = r.model;
  std::unique_ptr<eng::Backend> backend = std::move(opened->backend);
  rt->model.weights.config = backend->config();
  const std::string backend_name = backend->name();
  auto engine = eng::Engine::create(std::move(backend));
  if (!engine.is_ok()) return runtime(engine.status().message());
  rt->engine = std::move(engine).value();
  if (r.stats) {
    std::fprintf(stderr, "%s: load: %.2f s (%s, %s) on %s\n", kProgram, seconds_since(t0),
                 rt->model.format.c_str(), rt->model.weights.config.to_string().c_str(),
                 backend_name.c_str());
  }
  return std::nullopt;
}

// For --tokenize: the tokenizer and chat template alone (tokenizer.json of a directory, which
// needs no config.json or weights; or a GGUF file's metadata).
std::optional<Failure> load_tokenizer(const Request& r, Runtime* rt) {
  std::error_code ec;
  rt->model.source = r.model;
  if (std::filesystem::is_directory(r.model, ec)) {
    Status st = eng::read_hf_tokenizer(r.model, &rt->model.tokenizer, &rt->model.chat_template);
    if (!st.is_ok()) return runtime("cannot load tokenizer: " + st.message());
    if (!rt->model.tokenizer) return runtime(r.model + " has no tokenizer.json");
    return std::nullopt;
  }
  auto id = eng::read_model_identity(r.model);
  if (!id.is_ok()) return runtime("cannot read model: " + id.status().message());
  if (!id->tokenizer) return runtime(r.model + " has no tokenizer");
  rt->model.tokenizer.emplace(std::move(*id->tokenizer));
  rt->model.chat_template = std::move(id->chat_template);
  return std::nullopt;
}

// The prompt's token ids: --prompt-ids as given, or --prompt (chat-templated with --chat).
// Checked against the vocabulary when the model is loaded (not for --tokenize).
std::optional<Failure> prompt_tokens(const Request& r, const Runtime& rt,
                                     std::vector<int32_t>* out) {
  const int64_t vocab = rt.engine ? rt.engine->config().vocab_size : INT32_MAX;
  if (r.prompt_ids) {
    for (size_t i = 0; i < r.prompt_ids->size(); ++i) {
      const int32_t id = (*r.prompt_ids)[i];
      if (id >= vocab) {
        return usage("--prompt-ids: token " + std::to_string(i) + " = " + std::to_string(id) +
                     " is out of range (vocabulary size " + std::to_string(vocab) + ")");
      }
    }
    *out = *r.prompt_ids;
    return std::nullopt;
  }
  if (!rt.model.tokenizer) {
    return runtime(rt.model.source + " has no tokenizer; give the prompt as --prompt-ids");
  }
  std::string text = r.prompt;
  bool add_special = true;  // as HF's tokenizer(text); a chat template carries its own specials
  if (r.chat) {
    if (rt.model.chat_template.empty()) {
      return runtime(rt.model.source + " has no chat template; drop --chat");
    }
    auto tmpl = keep::tok::ChatTemplate::from_jinja(rt.model.chat_template);
    if (!tmpl.is_ok())
      return runtime("chat template of " + rt.model.source + ": " + tmpl.status().message());
    std::vector<keep::tok::ChatMessage> messages;
    if (!r.system.empty()) messages.push_back({"system", r.system});
    messages.push_back({"user", r.prompt});
    auto rendered = tmpl->render(messages, /*add_generation_prompt=*/true);
    if (!rendered.is_ok()) return runtime(rendered.status().message());
    text = std::move(rendered).value();
    add_special = false;
  }
  *out = rt.model.tokenizer->encode(text, add_special);
  if (out->empty()) return usage("empty prompt: --prompt tokenizes to no tokens");
  for (int32_t id : *out) {
    if (id < 0 || id >= vocab) {
      return runtime("the tokenizer of " + rt.model.source + " gives token " + std::to_string(id) +
                     ", beyond the model's vocabulary of " + std::to_string(vocab));
    }
  }
  return std::nullopt;
}

std::optional<Failure> check_context(const eng::ModelConfig& c, size_t prompt, size_t extra,
                                     const char* what) {
  const int64_t need = static_cast<int64_t>(prompt) + static_cast<int64_t>(extra);
  if (c.max_position_embeddings > 0 && need > c.max_position_embeddings) {
    return usage("prompt (" + std::to_string(prompt) + " tokens) + " + what + " (" +
                 std::to_string(extra) + ") exceeds the model's context of " +
                 std::to_string(c.max_position_embeddings) + " tokens");
  }
  return std::nullopt;
}

// Prefill, then decode token by token, streaming text (or collecting ids) as it goes.
std::optional<Failure> generate(const Request& r, Runtime& rt, const std::vector<int32_t>& prompt) {
  eng::Engine& e = *rt.engine;
  const eng::ModelConfig& c = e.config();
  if (auto f = check_context(c, prompt.size(), static_cast<size_t>(r.max_tokens), "--max-tokens")) {
    return f;
  }
  const bool text_out = !r.print_ids && !r.json;
  const bool want_text = !r.print_ids || r.json;
  if (want_text && !rt.model.tokenizer) {
    return runtime(rt.model.source + " has no tokenizer to decode with; use --ids");
  }
  auto cache =
      eng::KvCache::create(e.backend(), static_cast<int32_t>(prompt.size()) + r.max_tokens);
  if (!cache.is_ok()) return runtime(cache.status().message());

  const auto t_prefill = Clock::now();
  auto logits = e.prefill(*cache, prompt);
  if (!logits.is_ok()) return runtime("prefill: " + logits.status().message());
  const double prefill_s = seconds_since(t_prefill);

  eng::Sampler sampler(r.sampling);
  std::vector<int32_t> out;
  std::string text, pending;  // pending: bytes not yet printed (an incomplete UTF-8 tail)
  bool stopped_at_eos = false;
  const auto t_decode = Clock::now();
  int32_t decode_steps = 0;
  for (int32_t i = 0; i < r.max_tokens; ++i) {
    const int32_t tok = sampler.sample(*logits);
    out.push_back(tok);
    const bool is_eos =
        std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), tok) != c.eos_token_ids.end();
    if (want_text && (r.special || !rt.model.tokenizer->is_special(tok))) {
      const std::string_view bytes = rt.model.tokenizer->token_bytes(tok);
      text.append(bytes);
      if (text_out) {
        pending.append(bytes);
        const size_t n = keep::tok::utf8_complete_prefix(pending);
        if (n > 0) {
          std::fwrite(pending.data(), 1, n, stdout);
          std::fflush(stdout);
          pending.erase(0, n);
        }
      }
    }
    if ((is_eos && !r.ignore_eos) || i + 1 == r.max_tokens) {
      stopped_at_eos = is_eos && !r.ignore_eos;
      break;
    }
    logits = e.decode_step(*cache, tok);
    if (!logits.is_ok()) {
      if (text_out) std::fputc('\n', stdout);
      return runtime("decode: " + logits.status().message());
    }
    ++decode_steps;
  }
  const double decode_s = seconds_since(t_decode);

  if (r.json) {
    nlohmann::json j = {{"text", text},
                        {"ids", out},
                        {"prompt_tokens", prompt.size()},
                        {"generated_tokens", out.size()},
                        {"finish_reason", stopped_at_eos ? "stop" : "length"}};
    std::printf("%s\n", json_dump(j).c_str());
  } else if (r.print_ids) {
    std::printf("%s\n", join_ids(out).c_str());
  } else {
    std::fwrite(pending.data(), 1, pending.size(), stdout);
    std::fputc('\n', stdout);
  }
  std::fflush(stdout);
  if (r.stats) {
    std::fprintf(stderr, "%s: prefill: %zu tokens in %.3f s (%.1f tokens/s)\n", kProgram,
                 prompt.size(), prefill_s, static_cast<double>(prompt.size()) / prefill_s);
    std::fprintf(stderr, "%s: decode: %d steps in %.3f s (%.1f tokens/s), %zu tokens generated\n",
                 kProgram, decode_steps, decode_s, decode_steps > 0 ? decode_steps / decode_s : 0.0,
                 out.size());
  }
  return std::nullopt;
}

std::optional<Failure> score(const Request& r, Runtime& rt, const std::vector<int32_t>& prompt) {
  const eng::ModelConfig& c = rt.engine->config();
  struct Candidate {
    std::string text;  // as given (text candidates) or decoded (id candidates)
    std::vector<int32_t> ids;
    eng::CandidateScore score;
  };
  std::vector<Candidate> cands;
  if (!r.candidates.empty() && !rt.model.tokenizer) {
    return runtime(rt.model.source + " has no tokenizer; give candidates as --candidate-ids");
  }
  for (const std::string& t : r.candidates) {
    Candidate cand{t, rt.model.tokenizer->encode(t, /*add_special=*/false), {}};
    if (cand.ids.empty()) return usage("--candidates: '" + t + "' tokenizes to no tokens");
    cands.push_back(std::move(cand));
  }
  for (size_t i = 0; i < r.candidate_ids.size(); ++i) {
    for (int32_t id : r.candidate_ids[i]) {
      if (id >= c.vocab_size) {
        return usage("--candidate-ids: token " + std::to_string(id) +
                     " is out of range (vocabulary size " + std::to_string(c.vocab_size) + ")");
      }
    }
    const std::vector<int32_t>& ids = r.candidate_ids[i];
    cands.push_back(
        {rt.model.tokenizer ? rt.model.tokenizer->decode(ids) : join_ids(ids), ids, {}});
  }
  size_t longest = 0;
  std::vector<std::vector<int32_t>> batch;
  for (const Candidate& cand : cands) {
    batch.push_back(cand.ids);
    longest = std::max(longest, cand.ids.size());
  }
  if (auto f = check_context(c, prompt.size(), longest, "the longest candidate")) return f;

  const auto t0 = Clock::now();
  auto scores = rt.engine->score_candidates(prompt, batch);
  if (!scores.is_ok()) return runtime("scoring: " + scores.status().message());
  const double secs = seconds_since(t0);
  for (size_t i = 0; i < cands.size(); ++i) cands[i].score = (*scores)[i];
  std::stable_sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) {
    return a.score.log_prob > b.score.log_prob;
  });

  auto mean = [](const Candidate& cand) {
    return cand.score.tokens > 0 ? cand.score.log_prob / cand.score.tokens : 0.0;
  };
  if (r.json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const Candidate& cand : cands) {
      arr.push_back({{"text", cand.text},
                     {"ids", cand.ids},
                     {"log_prob", cand.score.log_prob},
                     {"mean_log_prob", mean(cand)},
                     {"tokens", cand.score.tokens}});
    }
    std::printf(
        "%s\n",
        json_dump(nlohmann::json{{"prompt_tokens", prompt.size()}, {"candidates", arr}}).c_str());
  } else {
    for (const Candidate& cand : cands) {
      std::printf("%.6f\t%.6f\t%d\t%s\n", cand.score.log_prob, mean(cand), cand.score.tokens,
                  one_line(cand.text).c_str());
    }
  }
  std::fflush(stdout);
  if (r.stats) {
    size_t tokens = 0;
    for (const Candidate& cand : cands) tokens += cand.ids.size();
    std::fprintf(stderr, "%s: score: prompt %zu + %zu candidate tokens in %.3f s (%.1f tokens/s)\n",
                 kProgram, prompt.size(), tokens, secs,
                 static_cast<double>(prompt.size() + tokens) / secs);
  }
  return std::nullopt;
}

std::optional<Failure> run(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  std::vector<std::vector<std::string>> repeated;
  if (auto f = take_repeated(&args, {"candidates", "candidate-ids"}, &repeated)) return f;

  keep::Options opts(kProgram,
                     "generate a completion, token ids or candidate scores with the KEEP engine "
                     "(CPU backend)");
  const std::vector<std::string> names = declare_options(&opts);
  // keep::Options reports "--bogus needs a value" for an unknown last flag; name it as unknown.
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string a = args[i];
    if (a.rfind("--", 0) != 0 || a.size() == 2 || a == "--help") continue;
    const std::string name =
        a.substr(2, a.find('=') == std::string::npos ? std::string::npos : a.find('=') - 2);
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      return usage("unknown option --" + name + " (see --help)");
    }
  }
  Status st = opts.parse(static_cast<int>(args.size()), args.data());
  if (!st.is_ok()) return usage(st.message());
  if (opts.help_requested()) {
    std::fputs(opts.help_text().c_str(), stdout);
    return std::nullopt;
  }
  if (!opts.positional().empty()) {
    return usage("unexpected argument '" + opts.positional()[0] + "' (see --help)");
  }
  keep::log::Level level;
  if (!keep::log::parse_level(opts.str("log-level"), &level)) {
    return usage("--log-level: unknown level '" + opts.str("log-level") + "'");
  }
  keep::log::set_level(level);

  Request r;
  if (auto f = read_request(opts, repeated, &r)) return f;
  Runtime rt;
  std::vector<int32_t> prompt;
  if (r.tokenize) {
    if (r.prompt_ids) return usage("--tokenize needs --prompt TEXT, not --prompt-ids");
    if (auto f = load_tokenizer(r, &rt)) return f;
    if (auto f = prompt_tokens(r, rt, &prompt)) return f;
    if (r.json) {
      std::printf("%s\n",
                  nlohmann::json{{"ids", prompt}, {"tokens", prompt.size()}}.dump().c_str());
    } else {
      std::string line;
      for (size_t i = 0; i < prompt.size(); ++i) line += (i ? "," : "") + std::to_string(prompt[i]);
      std::printf("%s\n", line.c_str());
    }
    return std::nullopt;
  }
  if (auto f = load(r, &rt)) return f;
  if (auto f = prompt_tokens(r, rt, &prompt)) return f;
  if (!r.candidates.empty() || !r.candidate_ids.empty()) return score(r, rt, prompt);
  return generate(r, rt, prompt);
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<Failure> f;
  try {
    f = run(argc, argv);
  } catch (const std::exception& e) {
    f = runtime(std::string("internal error: ") + e.what());
  }
  if (!f) return 0;
  std::fflush(stdout);
  std::fprintf(stderr, "%s: %s\n", kProgram, one_line(f->message).c_str());
  return f->exit_code;
}
