#include "shared/kvregion/kv_tier_directory.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cstring>

namespace keep::kv {

namespace bip = boost::interprocess;

namespace {

constexpr uint64_t kTierMagic = 0x5245495450454b4bULL;  // "KKEPTIER" little-endian
constexpr uint32_t kTierVersion = 1;

// The shared layout: a header, then `slots` slots. Fields other processes read concurrently are
// accessed through std::atomic_ref only.
struct TierHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint64_t slot_bytes;
  int32_t device;
  int32_t owner_pid;
  uint8_t ipc_handle[kTierIpcHandleBytes];
  uint64_t ready;  // 1 once the owner has written the header (release)
  uint64_t clock;  // last-use stamps
  uint64_t admits;
  uint64_t evictions;
};

struct alignas(64) TierSlot {
  uint64_t seq;       // seqlock: odd while the owner changes the slot
  uint64_t key_hash;  // 0: free
  uint64_t key[5];    // EntryKey's 40 bytes
  uint64_t bytes;
  uint64_t last_use;
};
static_assert(sizeof(EntryKey) == 5 * sizeof(uint64_t));

std::atomic_ref<uint64_t> at(uint64_t& x) { return std::atomic_ref<uint64_t>(x); }
uint64_t load(const uint64_t& x) {
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(x)).load(std::memory_order_relaxed);
}

uint64_t key_hash(const EntryKey& k) {
  uint64_t words[5];
  std::memcpy(words, &k, sizeof(words));
  uint64_t h = 1469598103934665603ULL;
  for (uint64_t w : words) {
    h ^= w;
    h *= 1099511628211ULL;
    h ^= h >> 29;
  }
  return h == 0 ? 1 : h;
}

Status check_name(const std::string& name) {
  if (name.empty() || name.size() > 200 || name[0] == '.') {
    return Status(Code::kInvalidArgument,
                  "tier name '" + name + "': 1..200 characters, no '.' first");
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return Status(Code::kInvalidArgument, "tier name '" + name + "': [A-Za-z0-9._-] only");
  }
  return Status::ok();
}

size_t layout_bytes(uint32_t slots) { return sizeof(TierHeader) + slots * sizeof(TierSlot); }

}  // namespace

namespace detail {
struct TierMapping {
  bip::shared_memory_object shm;
  bip::mapped_region region;
  TierHeader* header() const { return static_cast<TierHeader*>(region.get_address()); }
  TierSlot* slot(uint32_t i) const {
    return reinterpret_cast<TierSlot*>(static_cast<char*>(region.get_address()) +
                                       sizeof(TierHeader)) +
           i;
  }
};
}  // namespace detail

Result<std::unique_ptr<KvTierDirectory>> KvTierDirectory::create(const std::string& name,
                                                                 const TierGeometry& geometry) {
  KEEP_RETURN_IF_ERROR(check_name(name));
  if (geometry.slots == 0 || geometry.slot_bytes == 0) {
    return Status(Code::kInvalidArgument, "tier '" + name + "': no slots");
  }
  // An object left by a dead owner is replaced; a live owner keeps it.
  if (auto old = open(name); old.is_ok()) {
    const int pid = (*old)->map_->header()->owner_pid;
    if (pid > 0 && pid != ::getpid() && (::kill(pid, 0) == 0 || errno == EPERM)) {
      return Status(Code::kAlreadyExists,
                    "tier '" + name + "' is owned by the live process " + std::to_string(pid));
    }
    bip::shared_memory_object::remove(name.c_str());
  } else if (old.status().code() != Code::kNotFound) {
    bip::shared_memory_object::remove(name.c_str());  // not ours, or half-made: replaced
  }
  auto d = std::unique_ptr<KvTierDirectory>(new KvTierDirectory());
  d->map_ = std::make_unique<detail::TierMapping>();
  try {
    d->map_->shm = bip::shared_memory_object(bip::create_only, name.c_str(), bip::read_write);
    d->map_->shm.truncate(static_cast<bip::offset_t>(layout_bytes(geometry.slots)));
    d->map_->region = bip::mapped_region(d->map_->shm, bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    bip::shared_memory_object::remove(name.c_str());
    return Status(Code::kIoError, "tier '" + name + "': " + e.what());
  }
  TierHeader* h = d->map_->header();  // zero-filled by truncate: every slot free, seq 0
  h->magic = kTierMagic;
  h->version = kTierVersion;
  h->slots = geometry.slots;
  h->slot_bytes = geometry.slot_bytes;
  h->device = geometry.device;
  h->owner_pid = ::getpid();
  std::memcpy(h->ipc_handle, geometry.ipc_handle, kTierIpcHandleBytes);
  at(h->ready).store(1, std::memory_order_release);
  d->name_ = name;
  d->geometry_ = geometry;
  d->owner_ = true;
  return d;
}

Result<std::unique_ptr<KvTierDirectory>> KvTierDirectory::open(const std::string& name) {
  KEEP_RETURN_IF_ERROR(check_name(name));
  auto d = std::unique_ptr<KvTierDirectory>(new KvTierDirectory());
  d->map_ = std::make_unique<detail::TierMapping>();
  try {
    d->map_->shm = bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    if (e.get_error_code() == bip::not_found_error) {
      return Status(Code::kNotFound, "no device KV tier named '" + name + "'");
    }
    return Status(Code::kIoError, "tier '" + name + "': " + e.what());
  }
  bip::offset_t size = 0;
  if (!d->map_->shm.get_size(size) || static_cast<uint64_t>(size) < sizeof(TierHeader)) {
    return Status(Code::kCorrupt, "tier '" + name + "': shorter than its header");
  }
  try {
    d->map_->region = bip::mapped_region(d->map_->shm, bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    return Status(Code::kIoError, "tier '" + name + "': " + e.what());
  }
  TierHeader* h = d->map_->header();
  if (at(h->ready).load(std::memory_order_acquire) != 1) {
    return Status(Code::kUnavailable, "tier '" + name + "' is being created");
  }
  if (h->magic != kTierMagic) return Status(Code::kCorrupt, "tier '" + name + "': bad magic");
  if (h->version != kTierVersion) {
    return Status(Code::kVersionMismatch, "tier '" + name + "': format version " +
                                              std::to_string(h->version) + ", expected " +
                                              std::to_string(kTierVersion));
  }
  if (static_cast<uint64_t>(size) < layout_bytes(h->slots) || h->slot_bytes == 0) {
    return Status(Code::kCorrupt, "tier '" + name + "': size does not match its slots");
  }
  d->name_ = name;
  d->geometry_.slots = h->slots;
  d->geometry_.slot_bytes = h->slot_bytes;
  d->geometry_.device = h->device;
  std::memcpy(d->geometry_.ipc_handle, h->ipc_handle, kTierIpcHandleBytes);
  return d;
}

KvTierDirectory::~KvTierDirectory() {
  if (owner_ && map_) bip::shared_memory_object::remove(name_.c_str());
}

std::optional<TierHit> KvTierDirectory::find(const EntryKey& key) const {
  const uint64_t h = key_hash(key);
  uint64_t words[5];
  std::memcpy(words, &key, sizeof(words));
  for (uint32_t i = 0; i < geometry_.slots; ++i) {
    TierSlot& s = *map_->slot(i);
    if (load(s.key_hash) != h) continue;
    const uint64_t s1 = at(s.seq).load(std::memory_order_acquire);
    if (s1 & 1) continue;
    bool same = load(s.key_hash) == h;
    for (int w = 0; w < 5 && same; ++w) same = load(s.key[w]) == words[w];
    const uint64_t bytes = load(s.bytes);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (!same || at(s.seq).load(std::memory_order_relaxed) != s1) continue;
    at(s.last_use)
        .store(at(map_->header()->clock).fetch_add(1, std::memory_order_relaxed) + 1,
               std::memory_order_relaxed);
    return TierHit{i, s1, bytes};
  }
  return std::nullopt;
}

bool KvTierDirectory::validate(const TierHit& hit) const {
  if (hit.slot >= geometry_.slots) return false;
  std::atomic_thread_fence(std::memory_order_acquire);
  return at(map_->slot(hit.slot)->seq).load(std::memory_order_relaxed) == hit.seq;
}

TierStats KvTierDirectory::stats() const {
  TierStats st;
  st.slots = geometry_.slots;
  for (uint32_t i = 0; i < geometry_.slots; ++i) {
    if (load(map_->slot(i)->key_hash) != 0) ++st.used;
  }
  st.admits = load(map_->header()->admits);
  st.evictions = load(map_->header()->evictions);
  return st;
}

Result<uint32_t> KvTierDirectory::begin_admit(const EntryKey& key, uint64_t bytes) {
  if (!owner_) return Status(Code::kInvalidArgument, "tier '" + name_ + "': not the owner");
  if (bytes == 0 || bytes > geometry_.slot_bytes) {
    return Status(Code::kInvalidArgument, "tier '" + name_ + "': an entry of " +
                                              std::to_string(bytes) + " bytes, slots hold " +
                                              std::to_string(geometry_.slot_bytes));
  }
  if (const auto hit = find(key)) {
    return Status(Code::kAlreadyExists,
                  "tier '" + name_ + "': the entry is in slot " + std::to_string(hit->slot));
  }
  // A free slot, else the least recently used one.
  uint32_t pick = geometry_.slots;
  uint64_t oldest = UINT64_MAX;
  for (uint32_t i = 0; i < geometry_.slots; ++i) {
    const TierSlot& s = *map_->slot(i);
    if (load(s.key_hash) == 0) {
      pick = i;
      break;
    }
    if (load(s.last_use) < oldest) {
      oldest = load(s.last_use);
      pick = i;
    }
  }
  TierSlot& s = *map_->slot(pick);
  TierHeader* h = map_->header();
  const uint64_t seq = load(s.seq);
  at(s.seq).store(seq + 1, std::memory_order_relaxed);  // odd: changing
  std::atomic_thread_fence(std::memory_order_release);
  if (load(s.key_hash) != 0) at(h->evictions).fetch_add(1, std::memory_order_relaxed);
  uint64_t words[5];
  std::memcpy(words, &key, sizeof(words));
  at(s.key_hash).store(key_hash(key), std::memory_order_relaxed);
  for (int w = 0; w < 5; ++w) at(s.key[w]).store(words[w], std::memory_order_relaxed);
  at(s.bytes).store(bytes, std::memory_order_relaxed);
  at(s.last_use)
      .store(at(h->clock).fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  return pick;
}

void KvTierDirectory::commit(uint32_t slot) {
  if (!owner_ || slot >= geometry_.slots) return;
  TierSlot& s = *map_->slot(slot);
  const uint64_t seq = load(s.seq);
  if (!(seq & 1)) return;
  at(map_->header()->admits).fetch_add(1, std::memory_order_relaxed);
  at(s.seq).store(seq + 1, std::memory_order_release);  // even: published
}

void KvTierDirectory::abort(uint32_t slot) {
  if (!owner_ || slot >= geometry_.slots) return;
  TierSlot& s = *map_->slot(slot);
  const uint64_t seq = load(s.seq);
  if (!(seq & 1)) return;
  at(s.key_hash).store(0, std::memory_order_relaxed);
  at(s.seq).store(seq + 1, std::memory_order_release);
}

bool KvTierDirectory::evict(const EntryKey& key) {
  if (!owner_) return false;
  const auto hit = find(key);
  if (!hit) return false;
  TierSlot& s = *map_->slot(hit->slot);
  const uint64_t seq = load(s.seq);
  at(s.seq).store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  at(s.key_hash).store(0, std::memory_order_relaxed);
  at(map_->header()->evictions).fetch_add(1, std::memory_order_relaxed);
  at(s.seq).store(seq + 2, std::memory_order_release);
  return true;
}

}  // namespace keep::kv
