// keep-generate, run as a real subprocess: greedy ids equal HF's recorded continuations (SmolLM2
// GGUF and the tiny Qwen2 HF directory), text and chat prompts tokenize to HF's ids, candidate
// scoring ranks the greedy continuation first, and every bad input is one stderr line with the
// right exit code (models with an unsupported architecture / dtype are built here, byte by byte).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "shared/tokenizer/bpe_tokenizer.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kSmol = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
constexpr const char* kTiny = "tests/fixtures/engine/tiny-qwen2";
constexpr const char* kSystem =
    "You are a household robot's planner. Answer with a short numbered plan.";

std::string binary() {
  const char* dir = std::getenv("KEEP_BIN_DIR");
  return std::string(dir != nullptr ? dir : KEEP_BINARY_DIR "/bin") + "/keep-generate";
}

// A fresh directory under /tmp, removed at exit of the test case.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "keep_generate_XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Run {
  int exit_code = -1;
  std::string out, err;
  std::vector<std::string> err_lines() const {
    std::vector<std::string> lines;
    std::istringstream in(err);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    return lines;
  }
};

// Runs keep-generate with `args` (plus --threads 2), stdout and stderr captured through files.
Run run(std::vector<std::string> args) {
  TempDir io;
  const std::string out_path = (io.path / "out").string(), err_path = (io.path / "err").string();
  const std::string bin = binary();
  args.insert(args.begin(), bin);
  args.push_back("--threads");
  args.push_back("2");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, bin.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  REQUIRE_MESSAGE(rc == 0, "cannot spawn " << bin << ": " << std::string(std::strerror(rc)));
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  Run r;
  REQUIRE_MESSAGE(WIFEXITED(status), bin << " died by a signal");
  r.exit_code = WEXITSTATUS(status);
  r.out = read_all(out_path);
  r.err = read_all(err_path);
  return r;
}

std::string join(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

std::vector<int32_t> parse_ids_line(const std::string& out) {
  std::vector<int32_t> ids;
  REQUIRE_MESSAGE(!out.empty(), "no output");
  REQUIRE(out.back() == '\n');
  std::istringstream in(out.substr(0, out.size() - 1));
  for (std::string item; std::getline(in, item, ',');) ids.push_back(std::stoi(item));
  return ids;
}

std::vector<int32_t> head(const std::vector<int32_t>& v, size_t n) {
  return std::vector<int32_t>(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n));
}

json reference(const std::string& name) {
  std::ifstream in("tests/fixtures/engine/" + name + "_reference.json");
  REQUIRE_MESSAGE(in.good(), "missing tests/fixtures/engine/" << name << "_reference.json");
  return json::parse(in);
}

bool have_smollm2() {
  if (fs::exists(kSmol)) return true;
  MESSAGE("skipped: " << kSmol << " missing (deploy/fetch-models.sh)");
  return false;
}

// Exit code `code`, nothing on stdout, exactly one stderr line "keep-generate: ..." holding every
// needle.
void expect_error(const Run& r, int code, std::initializer_list<std::string> needles) {
  CAPTURE(r.err);
  CHECK(r.exit_code == code);
  CHECK(r.out.empty());
  const auto lines = r.err_lines();
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].rfind("keep-generate: ", 0) == 0);
  for (const auto& n : needles) CHECK_MESSAGE(lines[0].find(n) != std::string::npos, n);
}

}  // namespace

TEST_CASE("SmolLM2 GGUF: greedy --prompt-ids gives HF's continuation, stops at EOS") {
  if (!have_smollm2()) return;
  const json ref = reference("smollm2");
  const auto& p = ref["prompts"][0];
  const auto want = p["greedy"].get<std::vector<int32_t>>();
  const std::string ids = join(p["ids"].get<std::vector<int32_t>>());

  Run r = run({"--model", kSmol, "--prompt-ids", ids, "--max-tokens", "8", "--ids"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(parse_ids_line(r.out) == head(want, 8));

  // HF's 8th token is <|im_end|> (an EOS): with room for more, generation stops there; with
  // --ignore-eos it goes on exactly as HF's greedy run did.
  const auto& eos = ref["prompts"][0]["greedy"][7];
  REQUIRE(eos.get<int32_t>() == 2);
  r = run({"--model", kSmol, "--prompt-ids", ids, "--max-tokens", "12", "--ids"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(parse_ids_line(r.out) == head(want, 8));
  r = run({"--model", kSmol, "--prompt-ids", ids, "--max-tokens", "10", "--ids", "--ignore-eos"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(parse_ids_line(r.out) == head(want, 10));
}

TEST_CASE("SmolLM2 GGUF: --chat --prompt text tokenizes to HF's ids; text streams and matches") {
  if (!have_smollm2()) return;
  const json ref = reference("smollm2");
  const auto& p = ref["prompts"][0];
  const auto want = p["greedy"].get<std::vector<int32_t>>();
  const std::string text = p["text"].get<std::string>();

  // JSON: the same greedy ids as --prompt-ids, so the chat-templated prompt is HF's token for
  // token.
  Run r = run({"--model", kSmol, "--chat", "--system", kSystem, "--prompt", text, "--max-tokens",
               "8", "--json", "--stats"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const json j = json::parse(r.out);
  CHECK(j["ids"].get<std::vector<int32_t>>() == head(want, 8));
  CHECK(j["prompt_tokens"].get<size_t>() == p["ids"].size());
  CHECK(j["finish_reason"] == "stop");
  const std::string completion = j["text"].get<std::string>();
  CHECK(!completion.empty());
  CHECK(completion.find("<|im_end|>") == std::string::npos);  // specials are not printed
  CHECK(r.err.find("prefill:") != std::string::npos);         // --stats
  CHECK(r.err.find("tokens/s") != std::string::npos);

  // Plain text mode prints the same completion and a newline.
  r = run({"--model", kSmol, "--chat", "--system", kSystem, "--prompt", text, "--max-tokens", "8"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out == completion + "\n");
  CHECK(r.err.empty());
}

TEST_CASE("SmolLM2 GGUF: raw --prompt text equals --prompt-ids of HF's tokenization") {
  if (!have_smollm2()) return;
  const json ref = reference("smollm2_gguf");
  const json* entry = nullptr;
  for (const auto& t : ref["tokenizer"]) {
    if (t["text"] == "Pick up the apple and put it in the fridge.") entry = &t;
  }
  REQUIRE(entry != nullptr);
  Run by_text = run({"--model", kSmol, "--prompt", (*entry)["text"].get<std::string>(),
                     "--max-tokens", "4", "--ids"});
  Run by_ids =
      run({"--model", kSmol, "--prompt-ids", join((*entry)["ids"].get<std::vector<int32_t>>()),
           "--max-tokens", "4", "--ids"});
  REQUIRE_MESSAGE(by_text.exit_code == 0, by_text.err);
  REQUIRE_MESSAGE(by_ids.exit_code == 0, by_ids.err);
  CHECK(parse_ids_line(by_text.out).size() == 4);
  CHECK(by_text.out == by_ids.out);
}

TEST_CASE("--tokenize: a prompt's ids from a tokenizer-only directory or a GGUF's metadata") {
  // models/qwen2.5-tokenizer holds tokenizer.json and tokenizer_config.json: no config, no weights.
  const std::string dir = "models/qwen2.5-tokenizer";
  auto qwen = keep::tok::BpeTokenizer::from_json_file(dir + "/tokenizer.json");
  REQUIRE(qwen.is_ok());
  const std::string text = "Put the red mug in the sink.";
  Run r = run({"--model", dir, "--prompt", text, "--tokenize"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(parse_ids_line(r.out) == qwen->encode(text, true));
  r = run({"--model", dir, "--chat", "--prompt", text, "--tokenize", "--json"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const json j = json::parse(r.out);
  const auto ids = j["ids"].get<std::vector<int32_t>>();
  CHECK(j["tokens"].get<size_t>() == ids.size());
  CHECK(qwen->decode(ids).starts_with("<|im_start|>system\nYou are Qwen"));
  CHECK(qwen->decode(ids).ends_with("<|im_start|>assistant\n"));

  if (have_smollm2()) {  // HF's tokenization of the same text, read from the GGUF alone
    const json ref = reference("smollm2_gguf");
    for (const auto& t : ref["tokenizer"]) {
      if (t["text"] != "Pick up the apple and put it in the fridge.") continue;
      r = run({"--model", kSmol, "--prompt", t["text"].get<std::string>(), "--tokenize"});
      REQUIRE_MESSAGE(r.exit_code == 0, r.err);
      CHECK(parse_ids_line(r.out) == t["ids"].get<std::vector<int32_t>>());
    }
  }
  r = run({"--model", dir, "--prompt-ids", "1,2", "--tokenize"});
  CHECK(r.exit_code == 2);
  CHECK(r.err_lines().size() == 1);
  r = run({"--model", "tests/fixtures", "--prompt", text, "--tokenize"});
  CHECK(r.exit_code == 1);
  CHECK(r.err_lines().size() == 1);
  CHECK(r.err.find("no tokenizer.json") != std::string::npos);
}

TEST_CASE("SmolLM2 GGUF: --candidates ranks the greedy continuation first, scores <= 0") {
  if (!have_smollm2()) return;
  const json ref = reference("smollm2");
  const auto& p = ref["prompts"][0];
  const auto greedy = head(p["greedy"].get<std::vector<int32_t>>(), 7);  // before <|im_end|>
  const std::string ids = join(p["ids"].get<std::vector<int32_t>>());

  // Text lines: sum, mean, tokens, text; best first.
  Run gen = run({"--model", kSmol, "--prompt-ids", ids, "--max-tokens", "7"});
  REQUIRE_MESSAGE(gen.exit_code == 0, gen.err);
  const std::string best = gen.out.substr(0, gen.out.size() - 1);
  REQUIRE(!best.empty());
  Run r = run({"--model", kSmol, "--prompt-ids", ids, "--candidates",
               "Purple elephants sing opera.|zebra zebra zebra zebra", "--candidates", best,
               "--candidates", "Banana."});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  std::istringstream in(r.out);
  std::vector<std::string> texts;
  double prev = 0.0;
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    double sum = 1, mean = 1;
    int tokens = 0;
    std::string tab_text;
    ls >> sum >> mean >> tokens;
    std::getline(ls, tab_text);
    CHECK(sum <= 0.0);
    CHECK(tokens > 0);
    CHECK(mean == doctest::Approx(sum / tokens).epsilon(1e-4));
    if (!texts.empty()) CHECK(sum <= prev);
    prev = sum;
    REQUIRE(!tab_text.empty());
    texts.push_back(tab_text.substr(1));
  }
  REQUIRE(texts.size() == 4);
  CHECK(texts[0] == best);

  // JSON with token-level candidates: the greedy ids themselves win, and the text candidate that
  // tokenizes to them scores the same.
  r = run({"--model", kSmol, "--prompt-ids", ids, "--json", "--candidates", best, "--candidate-ids",
           join(greedy) + "|" + join({greedy[1], greedy[0], greedy[2]}), "--candidate-ids",
           "9902,9902,9902"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const json j = json::parse(r.out);
  const auto& c = j["candidates"];
  REQUIRE(c.size() == 4);
  CHECK(c[0]["ids"].get<std::vector<int32_t>>() == greedy);
  CHECK(c[1]["ids"].get<std::vector<int32_t>>() == greedy);
  CHECK(c[0]["log_prob"].get<double>() == doctest::Approx(c[1]["log_prob"].get<double>()));
  CHECK(c[0]["log_prob"].get<double>() > c[2]["log_prob"].get<double>() + 1.0);
  for (const auto& e : c) CHECK(e["log_prob"].get<double>() <= 0.0);
}

TEST_CASE("tiny Qwen2 (HF directory): greedy ids and the chat prompt match HF") {
  const json ref = reference("tiny_qwen2");
  const auto& p = ref["prompts"][0];
  const auto want = p["greedy"].get<std::vector<int32_t>>();
  Run r = run({"--model", kTiny, "--prompt-ids", join(p["ids"].get<std::vector<int32_t>>()),
               "--max-tokens", "8", "--ids", "--ignore-eos"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(parse_ids_line(r.out) == head(want, 8));
  r = run({"--model", kTiny, "--chat", "--system", kSystem, "--prompt",
           p["text"].get<std::string>(), "--max-tokens", "8", "--ids", "--ignore-eos"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(parse_ids_line(r.out) == head(want, 8));
  // Sampling with a seed is reproducible.
  const std::vector<std::string> sample = {"--model",       kTiny, "--prompt", "The red cup",
                                           "--max-tokens",  "12",  "--ids",    "--ignore-eos",
                                           "--temperature", "1.0", "--seed",   "7"};
  Run a = run(sample), b = run(sample);
  REQUIRE_MESSAGE(a.exit_code == 0, a.err);
  CHECK(parse_ids_line(a.out).size() == 12);
  CHECK(a.out == b.out);
}

TEST_CASE("usage errors: one line, exit 2") {
  const json ref = reference("tiny_qwen2");
  expect_error(run({"--model", kTiny, "--prompt-ids", "1,x,3"}), 2, {"--prompt-ids", "'x'"});
  expect_error(run({"--model", kTiny, "--prompt-ids", "-4"}), 2, {"--prompt-ids"});
  expect_error(run({"--model", kTiny, "--prompt-ids", "1,512"}), 2,
               {"--prompt-ids", "512", "out of range", "512"});
  expect_error(run({"--model", kTiny}), 2, {"empty prompt"});
  expect_error(run({"--model", kTiny, "--prompt-ids", "1", "--device", "gpu"}), 2, {"--device"});
  expect_error(run({"--model", kTiny, "--prompt", ""}), 2, {"empty prompt"});
  expect_error(run({"--model", kTiny, "--prompt", "hi", "--max-tokens", "0"}), 2, {"--max-tokens"});
  expect_error(run({"--model", kTiny, "--prompt", "hi", "--max-tokens", "-5"}), 2,
               {"--max-tokens", "-5"});
  expect_error(run({"--model", kTiny, "--prompt", "hi", "--max-tokens", "many"}), 2,
               {"--max-tokens", "many"});
  expect_error(run({"--model", kTiny, "--prompt", "hi", "--bogus"}), 2, {"unknown option --bogus"});
  expect_error(run({"--model", kTiny, "--prompt", "hi", "--frobnicate=3"}), 2,
               {"unknown option --frobnicate"});
  expect_error(run({"--model", kTiny, "--prompt", "hi", "--candidates"}), 2, {"--candidates"});
  expect_error(run({"--model", kTiny, "--prompt", "hi", "--candidates", "a||b"}), 2,
               {"--candidates", "empty candidate"});
  expect_error(run({"--model", kTiny, "--prompt", "hi", "--top-p", "0"}), 2, {"--top-p"});
  expect_error(run({"--model", kTiny, "--prompt", "hi", "--max-tokens", "300"}), 2,
               {"context", "256"});
  expect_error(run({"--model", kTiny, "--prompt", "a", "--prompt-ids", "1"}), 2,
               {"--prompt", "--prompt-ids"});

  Run help = run({"--help"});
  CHECK(help.exit_code == 0);
  for (const char* flag :
       {"--model", "--prompt-ids", "--chat", "--max-tokens", "--temperature", "--top-p", "--top-k",
        "--seed", "--ids", "--candidates", "--json", "--threads", "--stats"}) {
    CHECK_MESSAGE(help.out.find(flag) != std::string::npos, flag);
  }
  CHECK(help.out.find("default: 64") != std::string::npos);
}

namespace {

// A safetensors file: 8-byte little-endian header length, the JSON header, then the data.
// Tensors are zero-filled; `dtypes` overrides F32 for some names.
void write_safetensors(const fs::path& path,
                       const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
                       const std::map<std::string, std::pair<std::string, int>>& dtypes) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& [name, shape] : tensors) {
    std::string dtype = "F32";
    int size = 4;
    if (auto it = dtypes.find(name); it != dtypes.end()) std::tie(dtype, size) = it->second;
    uint64_t n = static_cast<uint64_t>(size);
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';
  const uint64_t len = text.size();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&len), 8);  // little-endian host
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  const std::string zeros(static_cast<size_t>(offset), '\0');
  out.write(zeros.data(), static_cast<std::streamsize>(zeros.size()));
}

// Every tensor of the tiny Qwen2 config (vocab 512, hidden 64, 2 layers, 4/2 heads, ffn 128).
std::vector<std::pair<std::string, std::vector<int64_t>>> tiny_qwen2_tensors() {
  std::vector<std::pair<std::string, std::vector<int64_t>>> t = {
      {"model.embed_tokens.weight", {512, 64}},
      {"model.norm.weight", {64}},
      {"lm_head.weight", {512, 64}}};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {64}});
    t.push_back({p + "self_attn.q_proj.weight", {64, 64}});
    t.push_back({p + "self_attn.k_proj.weight", {32, 64}});
    t.push_back({p + "self_attn.v_proj.weight", {32, 64}});
    t.push_back({p + "self_attn.q_proj.bias", {64}});
    t.push_back({p + "self_attn.k_proj.bias", {32}});
    t.push_back({p + "self_attn.v_proj.bias", {32}});
    t.push_back({p + "self_attn.o_proj.weight", {64, 64}});
    t.push_back({p + "post_attention_layernorm.weight", {64}});
    t.push_back({p + "mlp.gate_proj.weight", {128, 64}});
    t.push_back({p + "mlp.up_proj.weight", {128, 64}});
    t.push_back({p + "mlp.down_proj.weight", {64, 128}});
  }
  return t;
}

// GGUF v3 byte builder (little-endian host).
struct Gguf {
  std::string kv;
  uint64_t n_kv = 0;
  struct T {
    std::string name;
    uint32_t type;
    std::vector<uint64_t> ne;
    size_t bytes;
  };
  std::vector<T> tensors;

  template <typename V>
  static void put(std::string& s, V v) {
    s.append(reinterpret_cast<const char*>(&v), sizeof(V));
  }
  static void str(std::string& s, const std::string& v) {
    put<uint64_t>(s, v.size());
    s += v;
  }
  void u32(const std::string& k, uint32_t v) {
    str(kv, k), put<uint32_t>(kv, 4), put(kv, v), ++n_kv;
  }
  void f32(const std::string& k, float v) { str(kv, k), put<uint32_t>(kv, 6), put(kv, v), ++n_kv; }
  void s(const std::string& k, const std::string& v) {
    str(kv, k), put<uint32_t>(kv, 8), str(kv, v), ++n_kv;
  }
  void strs(const std::string& k, const std::vector<std::string>& v) {
    str(kv, k), put<uint32_t>(kv, 9), put<uint32_t>(kv, 8), put<uint64_t>(kv, v.size());
    for (const auto& x : v) str(kv, x);
    ++n_kv;
  }
  std::string build() const {
    std::string out;
    put<uint32_t>(out, 0x46554747), put<uint32_t>(out, 3), put<uint64_t>(out, tensors.size());
    put<uint64_t>(out, n_kv);
    out += kv;
    uint64_t off = 0;
    std::vector<uint64_t> offsets;
    for (const T& t : tensors) {
      offsets.push_back(off);
      off = (off + t.bytes + 31) / 32 * 32;
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      str(out, tensors[i].name);
      put<uint32_t>(out, static_cast<uint32_t>(tensors[i].ne.size()));
      for (uint64_t d : tensors[i].ne) put<uint64_t>(out, d);
      put<uint32_t>(out, tensors[i].type);
      put<uint64_t>(out, offsets[i]);
    }
    out.resize((out.size() + 31) / 32 * 32, '\0');
    out.resize(out.size() + off, '\0');  // zero data
    return out;
  }
};

}  // namespace

TEST_CASE("runtime errors: bad paths, unsupported architecture and dtypes, one line, exit 1") {
  TempDir dir;
  expect_error(run({"--model", (dir.path / "nope.gguf").string(), "--prompt", "hi"}), 1,
               {"nope.gguf"});
  expect_error(run({"--model", dir.path.string(), "--prompt", "hi"}), 1,
               {dir.path.string(), "config.json"});

  // config.json of an architecture the engine does not run.
  const fs::path gpt2 = dir.path / "gpt2";
  fs::create_directories(gpt2);
  std::ofstream(gpt2 / "config.json")
      << R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 512,
            "n_embd": 64, "n_layer": 2, "n_head": 4})";
  expect_error(run({"--model", gpt2.string(), "--prompt", "hi"}), 1, {"GPT2LMHeadModel"});

  // A complete tiny Qwen2 whose tensors are F32 but for one in I8 / F64.
  for (const auto& [name, dtype, size] :
       {std::tuple<std::string, std::string, int>{"model.layers.1.mlp.up_proj.weight", "I8", 1},
        {"model.norm.weight", "F64", 8}}) {
    CAPTURE(dtype);
    const fs::path m = dir.path / ("qwen2_" + dtype);
    fs::create_directories(m);
    fs::copy_file(fs::path(kTiny) / "config.json", m / "config.json");
    write_safetensors(m / "model.safetensors", tiny_qwen2_tensors(), {{name, {dtype, size}}});
    expect_error(run({"--model", m.string(), "--prompt-ids", "1,2,3"}), 1, {name, dtype});
  }
  // The same model all F32 loads and runs (so the failures above are the dtype's alone).
  {
    const fs::path m = dir.path / "qwen2_f32";
    fs::create_directories(m);
    fs::copy_file(fs::path(kTiny) / "config.json", m / "config.json");
    write_safetensors(m / "model.safetensors", tiny_qwen2_tensors(), {});
    Run ok = run({"--model", m.string(), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--ids"});
    CHECK_MESSAGE(ok.exit_code == 0, ok.err);
    // No tokenizer.json: text in or out is refused with a hint.
    expect_error(run({"--model", m.string(), "--prompt", "hi"}), 1, {"no tokenizer"});
  }

  // --device cuda for a model the GPU cannot take: no GPU on this machine (CI), or on a GPU machine
  // the tiny model's head_dim 16 the CUDA kernels do not support. Either way one line, exit 1;
  // --device auto runs it on the CPU instead.
  expect_error(run({"--model", kTiny, "--prompt-ids", "1,2,3", "--device", "cuda"}), 1,
               {"cannot use the GPU"});
  {
    Run ok = run({"--model", kTiny, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--ids"});
    CHECK_MESSAGE(ok.exit_code == 0, ok.err);
    CHECK(ok.err.empty());
  }

  // A GGUF llama whose ffn_down is Q4_K (a K-quant the loader cannot dequantise).
  Gguf g;
  g.s("general.architecture", "llama");
  g.u32("llama.embedding_length", 8);
  g.u32("llama.block_count", 1);
  g.u32("llama.feed_forward_length", 256);
  g.u32("llama.attention.head_count", 2);
  g.u32("llama.attention.head_count_kv", 1);
  g.f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  g.u32("llama.context_length", 128);
  g.s("tokenizer.ggml.model", "gpt2");
  g.s("tokenizer.ggml.pre", "smollm");
  g.strs("tokenizer.ggml.tokens", {"a", "b", "c", "ab", "abc", "<s>", "</s>", "Ġ"});
  g.strs("tokenizer.ggml.merges", {"a b", "ab c"});
  auto f32 = [&](const std::string& name, std::vector<uint64_t> ne) {
    size_t n = 4;
    for (uint64_t d : ne) n *= d;
    g.tensors.push_back({name, 0, std::move(ne), n});
  };
  f32("token_embd.weight", {8, 8});
  f32("output_norm.weight", {8});
  f32("blk.0.attn_norm.weight", {8});
  f32("blk.0.attn_q.weight", {8, 8});
  f32("blk.0.attn_k.weight", {8, 4});
  f32("blk.0.attn_v.weight", {8, 4});
  f32("blk.0.attn_output.weight", {8, 8});
  f32("blk.0.ffn_norm.weight", {8});
  f32("blk.0.ffn_gate.weight", {8, 256});
  f32("blk.0.ffn_up.weight", {8, 256});
  g.tensors.push_back({"blk.0.ffn_down.weight", 12, {256, 8}, 8 * 144});  // Q4_K: 144 B / 256
  const fs::path gguf = dir.path / "kquant.gguf";
  {
    const std::string bytes = g.build();
    std::ofstream(gguf, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  expect_error(run({"--model", gguf.string(), "--prompt-ids", "1,2"}), 1,
               {"kquant.gguf", "blk.0.ffn_down.weight", "Q4_K"});
}
