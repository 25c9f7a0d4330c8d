// KvRegion / KvRegionView in one process: layout, lifecycle, leases, bounds, validation.
// The cross-process behaviour (concurrent readers, a killed writer, fstat of the mode) is in
// tests/integration/test_kv_region_processes.cpp.
#include <doctest/doctest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/interprocess/shared_memory_object.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "shared/kvregion/kv_format.h"
#include "shared/kvregion/kv_region.h"
#include "shared/kvregion/model_fingerprint.h"

using namespace std::chrono_literals;
using keep::Code;
using keep::kv::EntryDescriptor;
using keep::kv::EntryKey;
using keep::kv::EntryKind;
using keep::kv::EntryState;
using keep::kv::KvRegion;
using keep::kv::KvRegionView;
using keep::kv::ModelFingerprint;
using keep::kv::RegionOptions;

namespace {

ModelFingerprint smol_fingerprint() {
  ModelFingerprint fp;
  fp.num_layers = 30;
  fp.num_kv_heads = 3;
  fp.head_dim = 64;
  fp.dtype = keep::kv::KvDType::kBF16;
  fp.rope_theta = 100000.0;
  fp.tokenizer_hash = keep::kv::fnv1a_64("smollm2 tokenizer");
  fp.set_model_name("SmolLM2-135M-Instruct");
  return fp;
}

// A unique shm name per test, removed again whatever happens.
struct ShmName {
  std::string name;
  ShmName() {
    static int counter = 0;
    name = "keep-test-kvu-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    boost::interprocess::shared_memory_object::remove(name.c_str());
  }
  ~ShmName() { boost::interprocess::shared_memory_object::remove(name.c_str()); }
  bool exists() const {
    struct stat st {};
    return stat(("/dev/shm/" + name).c_str(), &st) == 0;
  }
};

RegionOptions small_options(const std::string& name) {
  RegionOptions o;
  o.name = name;
  o.fingerprint = smol_fingerprint();
  o.block_bytes = 64 * 1024;
  o.num_blocks = 64;
  o.max_entries = 16;
  return o;
}

EntryKey key_of(uint64_t id, uint64_t version = 1) {
  EntryKey k;
  k.agent_hash = keep::kv::fnv1a_64("agent-a");
  k.object_id = id;
  k.object_version = version;
  k.kind = EntryKind::kSegment;
  return k;
}

// A settable clock for lease tests.
struct FakeClock {
  int64_t now = 1'000'000'000;
};

}  // namespace

TEST_CASE("fingerprint geometry and per-entry layout") {
  ModelFingerprint fp = smol_fingerprint();
  CHECK(fp.validate().is_ok());
  CHECK(fp.bytes_per_token() == 2ull * 30 * 3 * 64 * 2);
  // Qwen2.5-7B: 28 layers, 4 KV heads, head_dim 128, bf16 -> 57,344 bytes per token (§7).
  ModelFingerprint qwen;
  qwen.num_layers = 28;
  qwen.num_kv_heads = 4;
  qwen.head_dim = 128;
  qwen.dtype = keep::kv::KvDType::kBF16;
  CHECK(qwen.bytes_per_token() == 57344);
  // For each layer K then V, each [tokens, kv_heads, head_dim].
  const uint32_t tokens = 7;
  const uint64_t plane = 7ull * 3 * 64 * 2;
  CHECK(keep::kv::entry_k_offset(fp, tokens, 0) == 0);
  CHECK(keep::kv::entry_v_offset(fp, tokens, 0) == plane);
  CHECK(keep::kv::entry_k_offset(fp, tokens, 1) == 2 * plane);
  CHECK(keep::kv::entry_v_offset(fp, tokens, 29) + plane == tokens * fp.bytes_per_token());

  ModelFingerprint zero;
  CHECK(zero.validate().code() == Code::kInvalidArgument);
  ModelFingerprint bad = fp;
  bad.dtype = static_cast<keep::kv::KvDType>(77);
  CHECK(bad.validate().code() == Code::kInvalidArgument);
  bad = fp;
  bad.set_model_name(std::string(200, 'x'));  // truncated, still NUL-terminated
  CHECK(bad.validate().is_ok());
  CHECK(bad.model_name_view().size() == 63);
}

TEST_CASE("fingerprint mismatch names both sides and the differing fields") {
  ModelFingerprint a = smol_fingerprint();
  ModelFingerprint b = a;
  CHECK(keep::kv::check_fingerprint(a, b).is_ok());
  b.num_layers = 24;
  b.dtype = keep::kv::KvDType::kF16;
  keep::Status st = keep::kv::check_fingerprint(a, b);
  CHECK(st.code() == Code::kVersionMismatch);
  const std::string& m = st.message();
  CHECK(m.find("model fingerprint mismatch (layers, dtype)") != std::string::npos);
  CHECK(m.find("region has model='SmolLM2-135M-Instruct' layers=30 kv_heads=3") !=
        std::string::npos);
  CHECK(m.find("this process has model='SmolLM2-135M-Instruct' layers=24") != std::string::npos);
  CHECK(m.find("dtype=f16") != std::string::npos);
}

TEST_CASE("create lays out header, directory and an aligned arena; attach sees the same") {
  ShmName n;
  auto region = KvRegion::create(small_options(n.name));
  REQUIRE_MESSAGE(region.is_ok(), region.status().to_string());
  KvRegion& r = **region;
  const auto* h = reinterpret_cast<const keep::kv::RegionHeader*>(r.base());
  CHECK(std::memcmp(h->magic, "KEEPKV01", 8) == 0);
  CHECK(h->format_version == keep::kv::kFormatVersion);
  CHECK(h->directory_offset == keep::kv::kHeaderBytes);
  CHECK(h->arena_offset % keep::kv::kArenaAlignment == 0);
  CHECK(h->arena_offset >= keep::kv::kHeaderBytes + 16 * sizeof(keep::kv::DirectoryEntry));
  CHECK(h->region_bytes == h->arena_offset + 64 * 64 * 1024);
  CHECK(r.size() == h->region_bytes);
  CHECK(h->creator_pid == getpid());
  CHECK(h->fingerprint == smol_fingerprint());
  CHECK(reinterpret_cast<uintptr_t>(r.base()) % 4096 == 0);

  auto view = KvRegionView::attach(n.name, smol_fingerprint());
  REQUIRE_MESSAGE(view.is_ok(), view.status().to_string());
  CHECK((*view)->size() == r.size());
  CHECK((*view)->arena_offset() == h->arena_offset);
  CHECK((*view)->num_blocks() == 64);
  CHECK((*view)->max_entries() == 16);
  CHECK((*view)->fingerprint() == smol_fingerprint());
}

TEST_CASE("create refuses an existing name; replace takes over only an abandoned region") {
  ShmName n;
  {
    auto first = KvRegion::create(small_options(n.name));
    REQUIRE(first.is_ok());
    CHECK(n.exists());
    auto second = KvRegion::create(small_options(n.name));
    REQUIRE_FALSE(second.is_ok());
    CHECK(second.status().code() == Code::kAlreadyExists);
    CHECK(second.status().message().find("/dev/shm/" + n.name + " already exists") !=
          std::string::npos);
    // The owner is alive: replace must neither remove nor overwrite its region.
    RegionOptions o = small_options(n.name);
    o.replace = true;
    auto third = KvRegion::create(o);
    REQUIRE_FALSE(third.is_ok());
    CHECK(third.status().code() == Code::kAlreadyExists);
    CHECK(third.status().message().find("owned by a running process (pid " +
                                        std::to_string(getpid())) != std::string::npos);
    CHECK(KvRegion::adopt(small_options(n.name)).status().code() == Code::kAlreadyExists);
    CHECK((*first)->linked());
    auto v = KvRegionView::attach(n.name, smol_fingerprint());
    CHECK(v.is_ok());
  }
  CHECK_FALSE(n.exists());
  RegionOptions o = small_options(n.name);
  o.keep_on_destroy = true;
  REQUIRE(KvRegion::create(o).is_ok());  // an owner that went away and left its object behind
  CHECK(n.exists());
  o.keep_on_destroy = false;
  o.replace = true;
  auto next = KvRegion::create(o);
  REQUIRE_MESSAGE(next.is_ok(), next.status().to_string());
  CHECK((*next)->linked());
}

TEST_CASE("a removed name is noticed; the old owner never removes its successor's object") {
  ShmName n;
  auto first = KvRegion::create(small_options(n.name));
  REQUIRE(first.is_ok());
  REQUIRE(shm_unlink(("/" + n.name).c_str()) == 0);  // an operator's rm /dev/shm/<name>
  CHECK_FALSE((*first)->linked());
  auto second = KvRegion::create(small_options(n.name));
  REQUIRE_MESSAGE(second.is_ok(), second.status().to_string());
  CHECK_FALSE((*first)->linked());
  first.value().reset();
  CHECK(n.exists());
  CHECK((*second)->linked());
  CHECK(KvRegionView::attach(n.name, smol_fingerprint()).is_ok());
}

TEST_CASE("a view notices that a restarted owner made a new region under its name") {
  ShmName n;
  RegionOptions o = small_options(n.name);
  auto first = KvRegion::create(o);
  REQUIRE(first.is_ok());
  auto view = KvRegionView::attach(n.name, smol_fingerprint());
  REQUIRE(view.is_ok());
  CHECK((*view)->linked());
  CHECK((*view)->name() == n.name);
  first.value().reset();  // the owner goes (and removes its name)
  CHECK_FALSE((*view)->linked());
  o.replace = true;
  auto second = KvRegion::create(o);
  REQUIRE(second.is_ok());
  CHECK_FALSE((*view)->linked());  // the name is back, but names another object
  auto again = KvRegionView::attach(n.name, smol_fingerprint());
  REQUIRE(again.is_ok());
  CHECK((*again)->linked());
}

TEST_CASE("bad options are refused with a clear status and leave nothing behind") {
  ShmName n;
  RegionOptions o = small_options(n.name);
  o.block_bytes = 1000;
  CHECK(KvRegion::create(o).status().code() == Code::kInvalidArgument);
  o = small_options(n.name);
  o.num_blocks = 0;
  CHECK(KvRegion::create(o).status().code() == Code::kInvalidArgument);
  o = small_options(n.name);
  o.max_entries = 0;
  CHECK(KvRegion::create(o).status().code() == Code::kInvalidArgument);
  o = small_options(n.name);
  o.fingerprint = ModelFingerprint();
  CHECK(KvRegion::create(o).status().code() == Code::kInvalidArgument);
  for (const char* bad : {"", "a/b", ".hidden", "sp ace"}) {
    o = small_options(bad);
    CHECK(KvRegion::create(o).status().code() == Code::kInvalidArgument);
  }
  CHECK_FALSE(n.exists());
  auto missing = KvRegionView::attach(n.name, smol_fingerprint());
  CHECK(missing.status().code() == Code::kNotFound);
}

TEST_CASE("reserve, commit, lookup, release; generations move on and stale handles fail") {
  ShmName n;
  auto region = KvRegion::create(small_options(n.name));
  REQUIRE(region.is_ok());
  KvRegion& r = **region;
  auto view = KvRegionView::attach(n.name, smol_fingerprint());
  REQUIRE(view.is_ok());
  KvRegionView& v = **view;
  const uint64_t bpt = smol_fingerprint().bytes_per_token();

  auto d = r.reserve(key_of(1), 5, /*owner_id=*/42, 10s);
  REQUIRE_MESSAGE(d.is_ok(), d.status().to_string());
  CHECK(d->tokens == 5);
  CHECK(d->bytes == 5 * bpt);
  CHECK(d->generation == 1);
  CHECK(d->offset >= v.arena_offset());
  CHECK((d->offset - v.arena_offset()) % (64 * 1024) == 0);
  // Reserved: not readable, but writable by its writer.
  CHECK_FALSE(v.read_begin(d->index, d->generation).has_value());
  CHECK(v.check_writable(*d, keep::kv::monotonic_now_ns()).is_ok());
  auto info = v.entry_info(d->index);
  REQUIRE(info.is_ok());
  CHECK(info->state == EntryState::kReserved);
  CHECK(info->owner_id == 42);
  CHECK(info->key == key_of(1));
  CHECK_FALSE(r.lookup(key_of(1)).has_value());

  auto span = v.entry_data(*d);
  REQUIRE(span.is_ok());
  std::memset(span->data(), 0xab, span->size());
  REQUIRE(r.commit(d->index, d->generation).is_ok());
  CHECK(r.commit(d->index, d->generation).code() == Code::kStale);  // already committed
  CHECK(v.check_writable(*d, keep::kv::monotonic_now_ns()).code() == Code::kStale);
  auto found = r.lookup(key_of(1));
  REQUIRE(found.has_value());
  CHECK(*found == *d);

  auto seq = v.read_begin(d->index, d->generation);
  REQUIRE(seq.has_value());
  CHECK(static_cast<unsigned char>((*span)[span->size() - 1]) == 0xab);
  CHECK(v.read_validate(d->index, *seq));
  CHECK_FALSE(v.read_begin(d->index, d->generation + 1).has_value());
  CHECK_FALSE(v.read_begin(9999, d->generation).has_value());

  // Release while a reader is "in flight": its validation fails.
  CHECK(r.revoke(d->index, d->generation).code() == Code::kStale);  // committed, not reserved
  REQUIRE(r.release(d->index, d->generation).is_ok());
  CHECK_FALSE(v.read_validate(d->index, *seq));
  CHECK_FALSE(v.read_begin(d->index, d->generation).has_value());
  CHECK(v.entry_data(*d).status().code() == Code::kStale);
  CHECK(r.release(d->index, d->generation).code() == Code::kStale);
  CHECK_FALSE(r.lookup(key_of(1)).has_value());
  CHECK(r.commit(12345, 1).code() == Code::kNotFound);

  // Reuse of every slot bumps its generation: an old descriptor never matches again.
  for (int i = 0; i < 16; ++i) {
    auto e = r.reserve(key_of(100 + i), 1, 1, 10s);
    REQUIRE(e.is_ok());
    if (e->index == d->index) CHECK(e->generation == d->generation + 1);
  }
  CHECK(r.commit(d->index, d->generation).code() == Code::kStale);
}

TEST_CASE("exhaustion: directory full, arena full, too large") {
  ShmName n;
  RegionOptions o = small_options(n.name);
  o.num_blocks = 8;
  o.max_entries = 4;
  auto region = KvRegion::create(o);
  REQUIRE(region.is_ok());
  KvRegion& r = **region;
  const uint64_t bpt = smol_fingerprint().bytes_per_token();
  const uint32_t tokens_per_block = static_cast<uint32_t>(64 * 1024 / bpt);  // 2
  REQUIRE(tokens_per_block == 2);

  CHECK(r.reserve(key_of(1), 0, 1, 1s).status().code() == Code::kInvalidArgument);
  CHECK(r.reserve(key_of(1), 1, 1, 0ms).status().code() == Code::kInvalidArgument);
  CHECK(r.reserve(key_of(1), 1000, 1, 1s).status().code() == Code::kTooLarge);

  // 3 tokens = 69,120 bytes -> 2 blocks; 15 tokens = 345,600 bytes -> 6 blocks.
  auto a = r.reserve(key_of(1), 3, 1, 1s);
  REQUIRE(a.is_ok());
  CHECK(r.stats().used_blocks == 2);
  auto b = r.reserve(key_of(2), 15, 1, 1s);
  REQUIRE(b.is_ok());
  CHECK(r.stats().used_blocks == 8);
  auto c = r.reserve(key_of(3), 1, 1, 1s);
  CHECK(c.status().code() == Code::kResourceExhausted);
  CHECK(c.status().message().find("arena full") != std::string::npos);
  REQUIRE(r.revoke(a->index, a->generation).is_ok());
  auto s1 = r.reserve(key_of(3), 1, 1, 1s);
  auto s2 = r.reserve(key_of(4), 1, 1, 1s);
  REQUIRE(s1.is_ok());
  REQUIRE(s2.is_ok());
  CHECK(r.reserve(key_of(5), 1, 1, 1s).status().code() == Code::kResourceExhausted);
  REQUIRE(r.revoke(b->index, b->generation).is_ok());
  auto t1 = r.reserve(key_of(6), 1, 1, 1s);
  auto t2 = r.reserve(key_of(7), 1, 1, 1s);
  REQUIRE(t1.is_ok());
  REQUIRE(t2.is_ok());
  auto t3 = r.reserve(key_of(8), 1, 1, 1s);  // 4 live entries: the directory is full
  CHECK(t3.status().code() == Code::kResourceExhausted);
  CHECK(t3.status().message().find("directory full") != std::string::npos);

  auto st = r.stats();
  CHECK(st.entries_reserved == 4);
  CHECK(st.entries_free == 0);
  CHECK(st.used_blocks == 4);
  CHECK(st.bytes_free == 4 * 64 * 1024);
  CHECK(st.reserve_failures == 4);
}

TEST_CASE("leases: commit after expiry fails and frees; reap honours the grace; renew extends") {
  ShmName n;
  FakeClock clock;
  RegionOptions o = small_options(n.name);
  o.clock = [&clock] { return clock.now; };
  o.reap_grace = 100ms;
  auto region = KvRegion::create(o);
  REQUIRE(region.is_ok());
  KvRegion& r = **region;

  auto a = r.reserve(key_of(1), 4, 7, 50ms);
  auto b = r.reserve(key_of(2), 4, 8, 50ms);
  auto c = r.reserve(key_of(3), 4, 9, 50ms);
  REQUIRE(a.is_ok());
  REQUIRE(b.is_ok());
  REQUIRE(c.is_ok());
  const uint64_t used = r.stats().used_blocks;

  clock.now += 40'000'000;  // 40 ms: all alive
  CHECK(r.reap_expired(clock.now) == 0);
  REQUIRE(r.renew_lease(c->index, c->generation, 1000ms).is_ok());

  clock.now += 20'000'000;  // 60 ms: a and b expired, c renewed
  keep::Status st = r.commit(a->index, a->generation);
  CHECK(st.code() == Code::kLeaseExpired);
  CHECK(st.message().find("entry freed") != std::string::npos);
  CHECK(r.commit(a->index, a->generation).code() == Code::kStale);
  CHECK(r.renew_lease(b->index, b->generation, 10ms).code() == Code::kLeaseExpired);
  CHECK(r.reap_expired(clock.now) == 0);  // b is within the grace

  clock.now += 100'000'000;  // 160 ms: b is past lease + grace
  CHECK(r.reap_expired(clock.now) == 1);
  CHECK(r.commit(b->index, b->generation).code() == Code::kStale);
  REQUIRE(r.commit(c->index, c->generation).is_ok());
  auto stats = r.stats();
  CHECK(stats.used_blocks == used / 3);
  CHECK(stats.reaped == 1);
  CHECK(stats.commits == 1);
  CHECK(stats.entries_committed == 1);
  CHECK(stats.commit_failures == 3);
  CHECK(stats.payload_bytes_committed == 4 * smol_fingerprint().bytes_per_token());
}

TEST_CASE("entry_data bounds checks refuse forged descriptors") {
  ShmName n;
  auto region = KvRegion::create(small_options(n.name));
  REQUIRE(region.is_ok());
  auto view = KvRegionView::attach(n.name, smol_fingerprint());
  REQUIRE(view.is_ok());
  KvRegionView& v = **view;
  auto d = (*region)->reserve(key_of(1), 3, 1, 10s);
  REQUIRE(d.is_ok());
  REQUIRE(v.entry_data(*d).is_ok());

  EntryDescriptor f = *d;
  f.offset = 0;  // the header
  CHECK(v.entry_data(f).status().code() == Code::kInvalidArgument);
  f = *d;
  f.offset += 17;  // not block aligned
  CHECK(v.entry_data(f).status().code() == Code::kInvalidArgument);
  f = *d;
  f.bytes = v.size();  // past the end
  CHECK(v.entry_data(f).status().code() == Code::kInvalidArgument);
  f = *d;
  f.offset = UINT64_MAX - 10;
  CHECK(v.entry_data(f).status().code() == Code::kInvalidArgument);
  f = *d;
  f.index = 1u << 30;
  CHECK(v.entry_data(f).status().code() == Code::kInvalidArgument);
  f = *d;
  f.bytes -= 1;  // inside the arena but not what the directory says
  CHECK(v.entry_data(f).status().code() == Code::kInvalidArgument);
  f = *d;
  f.generation += 1;
  CHECK(v.entry_data(f).status().code() == Code::kStale);
  CHECK((*region)->entry_data(f).status().code() == Code::kStale);
}

TEST_CASE("attach refuses a damaged or foreign header with a clear status") {
  ShmName n;
  auto region = KvRegion::create(small_options(n.name));
  REQUIRE(region.is_ok());
  auto* h = reinterpret_cast<keep::kv::RegionHeader*>((*region)->base());
  const keep::kv::RegionHeader saved = *h;

  std::memcpy(h->magic, "NOTKEEP!", 8);
  auto a = KvRegionView::attach(n.name, smol_fingerprint());
  CHECK(a.status().code() == Code::kCorrupt);
  CHECK(a.status().message().find("bad magic") != std::string::npos);
  *h = saved;

  h->format_version = 99;
  a = KvRegionView::attach(n.name, smol_fingerprint());
  CHECK(a.status().code() == Code::kVersionMismatch);
  CHECK(a.status().message().find("format version 99") != std::string::npos);
  *h = saved;

  h->num_blocks += 1;  // disagrees with the object's size
  CHECK(KvRegionView::attach(n.name, smol_fingerprint()).status().code() == Code::kCorrupt);
  *h = saved;

  h->block_bytes = 0;
  CHECK(KvRegionView::attach(n.name, smol_fingerprint()).status().code() == Code::kCorrupt);
  *h = saved;

  h->init_state = 0;
  CHECK(KvRegionView::attach(n.name, smol_fingerprint()).status().code() == Code::kUnavailable);
  *h = saved;

  ModelFingerprint other = smol_fingerprint();
  other.head_dim = 128;
  a = KvRegionView::attach(n.name, other);
  CHECK(a.status().code() == Code::kVersionMismatch);
  CHECK(a.status().message().find("model fingerprint mismatch (head_dim)") != std::string::npos);

  CHECK(KvRegionView::attach(n.name, smol_fingerprint()).is_ok());
}

TEST_CASE("validate_region_header checks header bytes as attach does, without a mapping") {
  ShmName n;
  auto region = KvRegion::create(small_options(n.name));
  REQUIRE(region.is_ok());
  const std::span<const std::byte> page((*region)->base(), keep::kv::kHeaderBytes);
  const uint64_t size = (*region)->size();
  CHECK(keep::kv::validate_region_header(page, size).is_ok());
  CHECK(keep::kv::validate_region_header(page, size + 4096).code() == Code::kCorrupt);
  CHECK(keep::kv::validate_region_header(page.first(100), size).code() == Code::kCorrupt);
  // Any alignment: the header is copied before it is read.
  std::vector<std::byte> shifted(page.size() + 1);
  std::memcpy(shifted.data() + 1, page.data(), page.size());
  CHECK(keep::kv::validate_region_header(std::span(shifted).subspan(1), size).is_ok());
}

// Found by fuzz_kv_region_header (tests/fuzz/corpus/fuzz_kv_region_header/crash-*).
TEST_CASE("a fingerprint with a NaN or infinite RoPE parameter is invalid") {
  // NaN never compares equal: a region recording one could never be attached or adopted, and
  // the mismatch message would print the same values on both sides.
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(), -1.0}) {
    ModelFingerprint fp = smol_fingerprint();
    fp.rope_scaling_factor = bad;
    CHECK_FALSE(fp.validate().is_ok());
    fp = smol_fingerprint();
    fp.rope_high_freq_factor = bad;
    CHECK_FALSE(fp.validate().is_ok());
  }
  ModelFingerprint fp = smol_fingerprint();
  fp.rope_theta = std::numeric_limits<double>::infinity();
  CHECK_FALSE(fp.validate().is_ok());

  ShmName n;
  auto region = KvRegion::create(small_options(n.name));
  REQUIRE(region.is_ok());
  auto* h = reinterpret_cast<keep::kv::RegionHeader*>((*region)->base());
  h->fingerprint.rope_scaling_factor = std::nan("");
  auto a = KvRegionView::attach(n.name, smol_fingerprint());
  CHECK(a.status().code() == Code::kCorrupt);
  CHECK(a.status().message().find("rope scaling parameters") != std::string::npos);
}

TEST_CASE("adopt rebuilds the allocator and index from the directory") {
  ShmName n;
  RegionOptions o = small_options(n.name);
  o.keep_on_destroy = true;
  EntryDescriptor committed, reserved;
  {
    auto region = KvRegion::create(o);
    REQUIRE(region.is_ok());
    auto a = (*region)->reserve(key_of(1), 10, 1, 60s);
    auto b = (*region)->reserve(key_of(2), 20, 1, 60s);
    auto c = (*region)->reserve(key_of(3), 5, 1, 60s);
    REQUIRE((a.is_ok() && b.is_ok() && c.is_ok()));
    REQUIRE((*region)->commit(b->index, b->generation).is_ok());
    REQUIRE((*region)->revoke(a->index, a->generation).is_ok());
    committed = *b;
    reserved = *c;
  }
  RegionOptions other = o;
  other.num_blocks = 65;
  CHECK(KvRegion::adopt(other).status().code() == Code::kVersionMismatch);
  o.keep_on_destroy = false;
  auto region = KvRegion::adopt(o);
  REQUIRE_MESSAGE(region.is_ok(), region.status().to_string());
  KvRegion& r = **region;
  auto st = r.stats();
  CHECK(st.entries_committed == 1);
  CHECK(st.entries_reserved == 1);
  const uint64_t bpt = smol_fingerprint().bytes_per_token();
  CHECK(st.used_blocks == (20 * bpt + 65535) / 65536 + (5 * bpt + 65535) / 65536);
  auto found = r.lookup(key_of(2));
  REQUIRE(found.has_value());
  CHECK(*found == committed);
  REQUIRE(r.commit(reserved.index, reserved.generation).is_ok());
  REQUIRE(r.release(committed.index, committed.generation).is_ok());
  // A fresh reserve never overlaps a live entry.
  auto d = r.reserve(key_of(4), 40, 1, 1s);
  REQUIRE(d.is_ok());
  CHECK((d->offset + d->bytes <= reserved.offset || d->offset >= reserved.offset + reserved.bytes));
}

TEST_CASE("a configured mode is applied regardless of the umask") {
  ShmName n;
  RegionOptions o = small_options(n.name);
  o.mode = 0640;
  const mode_t old = umask(0077);
  auto region = KvRegion::create(o);
  umask(old);
  REQUIRE(region.is_ok());
  struct stat st {};
  REQUIRE(stat(("/dev/shm/" + n.name).c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0640);
}

TEST_CASE("adopt drops entries torn by a dead owner or inconsistent, and reclaims their blocks") {
  ShmName n;
  RegionOptions o = small_options(n.name);
  o.keep_on_destroy = true;
  EntryDescriptor good, torn, bad;
  {
    auto region = KvRegion::create(o);
    REQUIRE(region.is_ok());
    KvRegion& r = **region;
    good = *r.reserve(key_of(1), 4, 1, 60s);
    torn = *r.reserve(key_of(2), 4, 1, 60s);
    bad = *r.reserve(key_of(3), 4, 1, 60s);
    for (const auto& d : {good, torn, bad}) REQUIRE(r.commit(d.index, d.generation).is_ok());
    auto* dir = reinterpret_cast<keep::kv::DirectoryEntry*>(r.base() + keep::kv::kHeaderBytes);
    dir[torn.index].seq += 1;           // the owner died inside a write section
    dir[bad.index].block_count = 1000;  // does not match bytes / block_bytes
  }
  o.keep_on_destroy = false;
  auto region = KvRegion::adopt(o);
  REQUIRE_MESSAGE(region.is_ok(), region.status().to_string());
  auto st = (*region)->stats();
  CHECK(st.entries_committed == 1);
  CHECK(st.used_blocks == 2);  // 4 tokens = 92,160 bytes = 2 blocks: only `good` survives
  CHECK((*region)->lookup(key_of(1)).has_value());
  CHECK_FALSE((*region)->lookup(key_of(2)).has_value());
  auto view = KvRegionView::attach(n.name, smol_fingerprint());
  REQUIRE(view.is_ok());
  CHECK((*view)->read_begin(good.index, good.generation).has_value());
  CHECK_FALSE((*view)->read_begin(torn.index, torn.generation).has_value());
  auto info = (*view)->entry_info(torn.index);  // even again, and free
  REQUIRE(info.is_ok());
  CHECK(info->seq % 2 == 0);
  CHECK(info->state == EntryState::kFree);
}

TEST_CASE("the owner trusts its own state, not a directory scribbled on by another process") {
  ShmName n;
  auto region = KvRegion::create(small_options(n.name));
  REQUIRE(region.is_ok());
  KvRegion& r = **region;
  auto d = r.reserve(key_of(1), 4, 1, 60s);
  REQUIRE(d.is_ok());
  auto* dir = reinterpret_cast<keep::kv::DirectoryEntry*>(r.base() + keep::kv::kHeaderBytes);
  dir[d->index].state = static_cast<uint32_t>(EntryState::kCommitted);  // a buggy worker
  dir[d->index].generation = 999;
  dir[d->index].first_block = 1u << 30;
  auto view = KvRegionView::attach(n.name, smol_fingerprint());
  REQUIRE(view.is_ok());
  EntryDescriptor forged = *d;
  forged.generation = 999;
  CHECK((*view)->entry_data(forged).status().code() == Code::kInvalidArgument);  // bounds
  CHECK(r.commit(d->index, 999).code() == Code::kStale);
  REQUIRE(r.commit(d->index, d->generation).is_ok());  // republishes the true entry
  auto info = (*view)->entry_info(d->index);
  REQUIRE(info.is_ok());
  CHECK(info->generation == d->generation);
  CHECK(info->offset == d->offset);
  CHECK((*view)->entry_data(*d).is_ok());
}
