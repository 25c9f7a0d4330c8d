// bench_tokenizer: single-thread encode throughput of keep_tokenizer on a few MB of mixed text
// (English memory lines, code, numbers, CJK, Arabic, emoji), generated from a fixed seed.
//
//   build/bin/bench_tokenizer [--tokenizer models/qwen2.5-tokenizer/tokenizer.json] [--mb 4]
//                             [--dump-corpus PATH]   (to time another tokenizer on the same text)
//
// Prints one line per pass: the first pass starts with an empty piece cache, the later ones reuse
// it (the steady state of a long-running manager).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "shared/tokenizer/bpe_tokenizer.h"

namespace {

std::string make_corpus(size_t bytes) {
  static const std::vector<std::string> kWords = {
      "the",       "robot",   "picked", "up",    "red",          "mug",          "from",
      "kitchen",   "counter", "fridge", "apple", "washed",       "drawer",       "knife",
      "opened",    "closed",  "living", "room",  "sofa",         "keys",         "battery",
      "dock",      "towel",   "shelf",  "step",  "task",         "plan",         "agent",
      "can't",     "it's",    "Object", "State", "GoToLocation", "PickupObject", "ToggleObjectOn",
      "microwave", "sink"};
  static const std::vector<std::string> kOther = {"机器人",
                                                  "苹果在冰箱里",
                                                  "厨房",
                                                  "مرحبا",
                                                  "بالعالم",
                                                  "नमस्ते",
                                                  "🤖",
                                                  "👨‍👩‍👧",
                                                  "café",
                                                  "for (int i = 0; i < n; ++i) {",
                                                  "return x * 2;",
                                                  "    ",
                                                  "\n",
                                                  "\t",
                                                  ", ",
                                                  ". ",
                                                  "; ",
                                                  "()",
                                                  "{\"id\": 7}",
                                                  "-->",
                                                  "==",
                                                  "\r\n"};
  std::mt19937 rng(12345);
  std::string out;
  out.reserve(bytes + 64);
  while (out.size() < bytes) {
    const uint32_t r = rng() % 100;
    if (r < 70) {
      out += " " + kWords[rng() % kWords.size()];
    } else if (r < 85) {
      out += kOther[rng() % kOther.size()];
    } else {
      out += " " + std::to_string(rng() % 100000);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string path = "models/qwen2.5-tokenizer/tokenizer.json";
  double mb = 4;
  std::string dump_path;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--tokenizer" && i + 1 < argc) {
      path = argv[++i];
    } else if (a == "--mb" && i + 1 < argc) {
      mb = std::atof(argv[++i]);
    } else if (a == "--dump-corpus" && i + 1 < argc) {
      dump_path = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: %s [--tokenizer PATH (default %s)] [--mb MB of text (default 4)] "
                   "[--dump-corpus PATH]\n",
                   argv[0], path.c_str());
      return a == "--help" ? 0 : 2;
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  auto tok = keep::tok::BpeTokenizer::from_json_file(path);
  if (!tok.is_ok()) {
    std::fprintf(stderr, "bench_tokenizer: %s\n", tok.status().to_string().c_str());
    return 1;
  }
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string corpus = make_corpus(static_cast<size_t>(mb * 1024 * 1024));
  if (!dump_path.empty()) std::ofstream(dump_path, std::ios::binary) << corpus;
  std::printf("tokenizer %s: vocab %d, loaded in %.2f s\n", path.c_str(), tok->vocab_size(),
              load_s);

  // Encode in memory-segment-sized chunks (~2 KB, cut at spaces), as the manager does.
  std::vector<std::string_view> chunks;
  for (size_t pos = 0; pos < corpus.size();) {
    size_t end = std::min(corpus.size(), pos + 2048);
    while (end < corpus.size() && corpus[end] != ' ') ++end;
    chunks.push_back(std::string_view(corpus).substr(pos, end - pos));
    pos = end;
  }
  for (int pass = 0; pass < 3; ++pass) {
    size_t tokens = 0;
    t0 = std::chrono::steady_clock::now();
    for (std::string_view c : chunks) tokens += tok->encode(c).size();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf(
        "encode pass %d (%s cache): %.1f MB, %zu tokens in %.3f s: %.2f M tokens/s, "
        "%.1f MB/s\n",
        pass, pass == 0 ? "cold" : "warm", corpus.size() / 1048576.0, tokens, s, tokens / s / 1e6,
        corpus.size() / s / 1048576.0);
  }
  size_t counted = 0;
  t0 = std::chrono::steady_clock::now();
  for (std::string_view c : chunks) counted += tok->count_tokens(c);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("count_tokens: %zu tokens in %.3f s: %.2f M tokens/s\n", counted, s,
              counted / s / 1e6);
  return 0;
}
