// keep_fuzz_seeds: writes the seeds that only the project's own writers can make (a snapshot
// file and a store payload, a KV region's header and directory) into tests/fuzz/corpus/.
//   build-fuzz/fuzz/keep_fuzz_seeds <repo>/tests/fuzz/corpus
// The text seeds (GGUF, safetensors, JSON) come from tests/fuzz/make_seeds.py.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "services/manager/durability/snapshot_file.h"
#include "shared/kvregion/kv_region.h"
#include "tests/fuzz/fuzz_store.h"

namespace {

namespace fs = std::filesystem;

void write_file(const fs::path& path, std::string_view bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::printf("%s: %zu bytes\n", path.c_str(), bytes.size());
}

#define CHECK_OK(expr)                                                                  \
  do {                                                                                  \
    if (!(expr).is_ok()) {                                                              \
      std::fprintf(stderr, "keep_fuzz_seeds: %s failed at line %d\n", #expr, __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// Two agents, a few segments of every kind, embedded and grouped, one group static and one
// segment updated after that: a payload that reaches every part of the snapshot format.
std::string store_payload() {
  using namespace keep::manager;
  keep::fuzz::FuzzEmbedder embedder;
  keep::fuzz::FuzzCounter counter;
  MemoryStore store(StoreOptions{}, &embedder, &counter);
  std::string rec;
  for (const char* agent : {"agent-a", "agent-b"}) {
    const char* texts[] = {"apples are red", "apples are green", "the task: buy pears",
                           "plan: first look, then buy"};
    const SegmentKind kinds[] = {SegmentKind::kObjectState, SegmentKind::kObjectState,
                                 SegmentKind::kTaskRecord, SegmentKind::kExamplePlan};
    for (int i = 0; i < 4; ++i) {
      WriteRequest w;
      w.agent = agent;
      w.text = texts[i];
      w.kind = kinds[i];
      CHECK_OK(store.write(w, &rec));
    }
    CHECK_OK(store.retrieve(agent, "apples", 4, &rec));
    CHECK_OK(store.advance_step(agent, 12, &rec));
    UpdateRequest u;
    u.agent = agent;
    u.id = 2;
    u.text = "apples are yellow";
    CHECK_OK(store.update(u, &rec));
  }
  return store.serialize();
}

// A region of 4 entries and 16 blocks of 4 KiB (an entry of one token takes 6) with one committed
// and one reserved entry; the seed is its header page and directory (the arena is zeros, which the
// fuzzer adds back).
std::string region_prefix() {
  namespace kv = keep::kv;
  kv::RegionOptions o;
  o.name = "keep-fuzz-seed-" + std::to_string(::getpid());
  o.fingerprint.num_layers = 30;
  o.fingerprint.num_kv_heads = 3;
  o.fingerprint.head_dim = 64;
  o.fingerprint.dtype = kv::KvDType::kBF16;
  o.fingerprint.rope_theta = 100000.0;
  o.fingerprint.tokenizer_hash = kv::fnv1a_64("smollm2 tokenizer");
  o.fingerprint.set_model_name("SmolLM2-135M-Instruct");
  o.block_bytes = 4096;
  o.num_blocks = 16;
  o.max_entries = 4;
  o.replace = true;
  auto region = kv::KvRegion::create(o);
  CHECK_OK(region);
  kv::EntryKey key;
  key.object_id = 1;
  auto a = (*region)->reserve(key, 1, 7, std::chrono::minutes(10));
  CHECK_OK(a);
  CHECK_OK((*region)->commit(a->index, a->generation));
  key.object_id = 2;
  CHECK_OK((*region)->reserve(key, 1, 7, std::chrono::minutes(10)));
  const auto* base = reinterpret_cast<const char*>((*region)->base());
  return std::string(base, kv::kHeaderBytes + kv::directory_bytes(o.max_entries));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  const fs::path corpus = argv[1];
  const std::string payload = store_payload();
  write_file(corpus / "fuzz_snapshot_reader" / "store-payload", payload);
  write_file(corpus / "fuzz_snapshot_reader" / "snapshot-file",
             keep::manager::encode_snapshot(42, payload));
  write_file(corpus / "fuzz_kv_region_header" / "region-header-and-directory", region_prefix());
  return 0;
}
