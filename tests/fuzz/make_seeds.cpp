// keep_fuzz_seeds: writes the seeds that only the project's own writers can make (a snapshot
// file and a store payload, a KV region's header and directory, request frames of both
// protocols) into tests/fuzz/corpus/.
//   build-fuzz/fuzz/keep_fuzz_seeds <repo>/tests/fuzz/corpus
// The text seeds (GGUF, safetensors, JSON) come from tests/fuzz/make_seeds.py.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <capnp/message.h>

#include "services/manager/durability/snapshot_file.h"
#include "shared/client/protocols.h"
#include "shared/kvregion/kv_region.h"
#include "shared/rpc/wire_codec.h"
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

// A request frame of protocol P whose union member `fill` sets.
template <typename P, typename Fill>
std::string frame(Fill&& fill) {
  capnp::MallocMessageBuilder message;
  auto request = message.initRoot<typename P::Request>();
  request.setProtocolVersion(P::kVersion);
  request.setRequestId(7);
  request.setTimeoutMs(5000);
  fill(request);
  return keep::wire::encode(message);
}

void write_wire_seeds(const fs::path& corpus) {
  using MP = keep::client::ManagerProtocol;
  using WP = keep::client::WorkerProtocol;
  const fs::path m = corpus / "fuzz_wire_decode";
  write_file(m / "ping", frame<MP>([](auto r) { r.initPing(); }));
  write_file(m / "write", frame<MP>([](auto r) {
               auto w = r.initWriteMemory();
               w.setAgent("robot");
               w.setText("The milk is in the fridge.");
               w.setKind(keep::proto::SegmentKind::OBJECT_STATE);
             }));
  write_file(m / "retrieve", frame<MP>([](auto r) {
               auto q = r.initRetrieve();
               q.setAgent("robot");
               q.setQuery("milk");
               q.setK(4);
             }));
  write_file(m / "advance-step", frame<MP>([](auto r) {
               auto a = r.initAdvanceStep();
               a.setAgent("robot");
               a.setBy(3);
             }));
  const fs::path w = corpus / "fuzz_worker_decode";
  write_file(w / "ping", frame<WP>([](auto r) { r.setPing(); }));
  write_file(w / "complete", frame<WP>([](auto r) {
               auto c = r.initComplete();
               c.setAgent("robot");
               c.setInstruction("Bring me a glass of milk.");
               auto h = c.initHistory(1);
               h.set(0, "walk to the kitchen");
               c.setK(8);
               c.setMethod(keep::proto::worker::Method::KEEP);
               auto k = c.initKnobs();
               k.setHasDecay(true);
               k.setDecay(0.9);
               k.setHasMaxHops(true);
               k.setMaxHops(4);
               c.setMaxTokens(16);
             }));
  write_file(w / "score", frame<WP>([](auto r) {
               auto c = r.initComplete();
               c.setAgent("robot");
               c.setInstruction("Bring me a glass of milk.");
               c.setMethod(keep::proto::worker::Method::CACHEBLEND);
               auto cands = c.initCandidates(2);
               cands.set(0, "open the fridge");
               cands.set(1, "go to the bathroom");
             }));
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
  write_wire_seeds(corpus);
  return 0;
}
