#include "shared/kvregion/kv_region.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/permissions.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <cinttypes>
#include <cstring>
#include <limits>

#include "shared/common/log.h"

namespace bip = boost::interprocess;

namespace keep::kv {

// ---- shared-memory access -------------------------------------------------------------------
//
// Memory ordering (the seqlock of docs/shm-format.md):
//   owner (the only writer of the directory):
//     s = seq (even); seq.store(s + 1, relaxed); fence(release);   // odd: "changing"
//     field.store(v, relaxed) ...;
//     seq.store(s + 2, release);                                    // even again: published
//   reader:
//     s1 = seq.load(acquire); odd -> retry; read fields (relaxed loads), and the entry's bytes;
//     fence(acquire); s2 = seq.load(relaxed); valid iff s1 == s2.
// The release fence after the odd store keeps the field stores from becoming visible before it;
// the acquire fence before the second load keeps the field / byte reads from moving after it.
// Writers of entry BYTES (workers) finish and make them visible (stream sync) before asking the
// owner to commit; the commit's release store of `seq` then orders them before every reader that
// sees the entry committed (the request/response through the socket orders worker -> owner).

namespace {

template <typename T>
T load_relaxed(const T& field) {
  return std::atomic_ref<T>(const_cast<T&>(field)).load(std::memory_order_relaxed);
}
template <typename T>
void store_relaxed(T& field, T value) {
  std::atomic_ref<T>(field).store(value, std::memory_order_relaxed);
}
std::atomic_ref<uint64_t> seq_ref(const DirectoryEntry& e) {
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(e.seq));
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

constexpr int kReadSpins = 1 << 12;  // owner write sections are a few stores long

std::string shm_path(const std::string& name) { return "/dev/shm/" + name; }

std::string errno_text(int err) { return std::string(std::strerror(err)); }

Status from_interprocess(const bip::interprocess_exception& e, const std::string& what) {
  const int native = e.get_native_error();
  std::string msg = what + ": " + e.what();
  if (native != 0) msg += " (" + errno_text(native) + ")";
  switch (e.get_error_code()) {
    case bip::already_exists_error:
      return Status(Code::kAlreadyExists, msg);
    case bip::not_found_error:
      return Status(Code::kNotFound, msg);
    case bip::out_of_space_error:
    case bip::out_of_memory_error:
      return Status(Code::kResourceExhausted, msg);
    default:
      return Status(Code::kIoError, msg);
  }
}

int64_t realtime_now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

int64_t add_saturating(int64_t a, int64_t b) {
  if (b > 0 && a > std::numeric_limits<int64_t>::max() - b) {
    return std::numeric_limits<int64_t>::max();
  }
  return a + b;
}

struct Geometry {
  uint64_t arena_offset = 0;
  uint64_t arena_bytes = 0;
  uint64_t region_bytes = 0;
};

Result<Geometry> compute_geometry(uint64_t block_bytes, uint64_t num_blocks, uint32_t max_entries) {
  if (block_bytes == 0 || block_bytes % kBlockAlignment != 0 || block_bytes > kMaxBlockBytes) {
    return Status(Code::kInvalidArgument, "block_bytes " + std::to_string(block_bytes) +
                                              " must be a positive multiple of " +
                                              std::to_string(kBlockAlignment) + " up to " +
                                              std::to_string(kMaxBlockBytes));
  }
  if (num_blocks == 0) return Status(Code::kInvalidArgument, "num_blocks is 0");
  if (max_entries == 0 || max_entries > kMaxEntries) {
    return Status(Code::kInvalidArgument, "max_entries " + std::to_string(max_entries) +
                                              " must be in 1.." + std::to_string(kMaxEntries));
  }
  constexpr uint64_t kMaxRegion = 1ull << 46;  // 64 TiB: far above any host, far below overflow
  if (num_blocks > kMaxRegion / block_bytes) {
    return Status(Code::kInvalidArgument, "arena of " + std::to_string(num_blocks) + " blocks of " +
                                              std::to_string(block_bytes) + " bytes is too large");
  }
  Geometry g;
  g.arena_offset = arena_offset_for(max_entries);
  g.arena_bytes = num_blocks * block_bytes;
  g.region_bytes = g.arena_offset + g.arena_bytes;
  return g;
}

// A private copy of the shared header. init_state is loaded first with acquire (it publishes the
// rest); validating and then using the copy means no other process can change the geometry between
// the check and its use.
RegionHeader copy_header(const std::byte* base) {
  auto* shared = reinterpret_cast<RegionHeader*>(const_cast<std::byte*>(base));
  const uint32_t init =
      std::atomic_ref<uint32_t>(shared->init_state).load(std::memory_order_acquire);
  RegionHeader h;
  std::memcpy(&h, base, sizeof(h));
  h.init_state = init;
  return h;
}

// Checks a header copy (any process). `size` is the shm object's size.
Status validate_header(const RegionHeader& h, uint64_t size) {
  const uint32_t init = h.init_state;
  if (init != kInitReady) {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "region is not initialised (init_state=0x%08x)", init);
    return Status(Code::kUnavailable, buf);
  }
  if (std::memcmp(h.magic, kRegionMagic, sizeof(kRegionMagic)) != 0) {
    std::string seen;
    for (char c : h.magic) seen += (c >= 32 && c < 127) ? c : '?';
    const bool keep_family = std::memcmp(h.magic, kRegionMagic, 6) == 0;
    return Status(keep_family ? Code::kVersionMismatch : Code::kCorrupt,
                  "bad magic '" + seen + "', expected 'KEEPKV01'");
  }
  if (h.format_version != kFormatVersion) {
    return Status(Code::kVersionMismatch,
                  "region format version " + std::to_string(h.format_version) +
                      ", this build reads " + std::to_string(kFormatVersion));
  }
  if (h.header_bytes != sizeof(RegionHeader) || h.entry_bytes != sizeof(DirectoryEntry)) {
    return Status(Code::kVersionMismatch, "header/entry sizes " + std::to_string(h.header_bytes) +
                                              "/" + std::to_string(h.entry_bytes) +
                                              ", this build has " +
                                              std::to_string(sizeof(RegionHeader)) + "/" +
                                              std::to_string(sizeof(DirectoryEntry)));
  }
  auto geo = compute_geometry(h.block_bytes, h.num_blocks, h.max_entries);
  if (!geo.is_ok()) return Status(Code::kCorrupt, "header geometry: " + geo.status().message());
  if (h.directory_offset != kHeaderBytes || h.arena_offset != geo->arena_offset ||
      h.arena_bytes != geo->arena_bytes || h.region_bytes != geo->region_bytes) {
    return Status(
        Code::kCorrupt,
        "header offsets inconsistent: directory " + std::to_string(h.directory_offset) +
            ", arena " + std::to_string(h.arena_offset) + " (+" + std::to_string(h.arena_bytes) +
            "), region " + std::to_string(h.region_bytes) + "; expected arena " +
            std::to_string(geo->arena_offset) + ", region " + std::to_string(geo->region_bytes));
  }
  if (h.region_bytes != size) {
    return Status(Code::kCorrupt, "header says " + std::to_string(h.region_bytes) +
                                      " bytes, the shm object has " + std::to_string(size));
  }
  Status fp = h.fingerprint.validate();
  if (!fp.is_ok()) return Status(Code::kCorrupt, "region " + fp.message());
  return Status::ok();
}

// A consistent copy of a directory entry, or false when it kept changing.
bool read_entry(const DirectoryEntry& e, uint32_t index, uint64_t arena_offset,
                uint64_t block_bytes, EntryInfo* out) {
  for (int spin = 0; spin < kReadSpins; ++spin) {
    const uint64_t s1 = seq_ref(e).load(std::memory_order_acquire);
    if (s1 & 1) {
      cpu_relax();
      continue;
    }
    EntryInfo info;
    info.index = index;
    info.generation = load_relaxed(e.generation);
    info.state = static_cast<EntryState>(load_relaxed(e.state));
    info.tokens = load_relaxed(e.tokens);
    info.key.agent_hash = load_relaxed(e.key.agent_hash);
    info.key.object_id = load_relaxed(e.key.object_id);
    info.key.object_version = load_relaxed(e.key.object_version);
    info.key.group_version = load_relaxed(e.key.group_version);
    info.key.kind = load_relaxed(e.key.kind);
    const uint64_t first_block = load_relaxed(e.first_block);
    info.bytes = load_relaxed(e.bytes);
    info.owner_id = load_relaxed(e.owner_id);
    info.lease_expiry_ns = load_relaxed(e.lease_expiry_ns);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (seq_ref(e).load(std::memory_order_relaxed) != s1) continue;
    info.offset = arena_offset + first_block * block_bytes;
    info.seq = s1;
    *out = info;
    return true;
  }
  return false;
}

}  // namespace

int64_t monotonic_now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

Status validate_region_header(std::span<const std::byte> header, uint64_t region_bytes) {
  if (header.size() < sizeof(RegionHeader)) {
    return Status(Code::kCorrupt, "region header of " + std::to_string(header.size()) +
                                      " bytes, need " + std::to_string(sizeof(RegionHeader)));
  }
  RegionHeader h;
  std::memcpy(&h, header.data(), sizeof(h));
  return validate_header(h, region_bytes);
}

Status validate_region_name(const std::string& name) {
  if (name.empty() || name.size() > 200) {
    return Status(Code::kInvalidArgument,
                  "region name must have 1..200 characters, got " + std::to_string(name.size()));
  }
  if (name[0] == '.') {
    return Status(Code::kInvalidArgument, "region name '" + name + "' starts with '.'");
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return Status(Code::kInvalidArgument,
                    "region name '" + name + "' has a character outside [A-Za-z0-9._-]");
    }
  }
  return Status::ok();
}

namespace detail {
struct Mapping {
  bip::shared_memory_object shm;
  bip::mapped_region region;
  uint64_t size = 0;
  std::byte* base() const { return static_cast<std::byte*>(region.get_address()); }
  int fd() const { return shm.get_mapping_handle().handle; }
};
}  // namespace detail

namespace {
// Opens an existing object and maps it whole.
Result<std::unique_ptr<detail::Mapping>> open_existing(const std::string& name, bool writable) {
  KEEP_RETURN_IF_ERROR(validate_region_name(name));
  auto m = std::make_unique<detail::Mapping>();
  const bip::mode_t mode = writable ? bip::read_write : bip::read_only;
  try {
    m->shm = bip::shared_memory_object(bip::open_only, name.c_str(), mode);
  } catch (const bip::interprocess_exception& e) {
    Status st = from_interprocess(e, "opening shm object '/" + name + "'");
    if (st.code() == Code::kNotFound) {
      return Status(Code::kNotFound,
                    "no KV region named '/" + name + "' (is keep-manager running?)");
    }
    return st;
  }
  bip::offset_t size = 0;
  if (!m->shm.get_size(size)) {
    return Status(Code::kIoError, "fstat of shm object '/" + name + "' failed");
  }
  if (size == 0) {
    return Status(Code::kUnavailable, "region '/" + name + "' is being created (size 0)");
  }
  if (static_cast<uint64_t>(size) < kHeaderBytes) {
    return Status(Code::kCorrupt, "region '/" + name + "' has " + std::to_string(size) +
                                      " bytes, less than its header (" +
                                      std::to_string(kHeaderBytes) + ")");
  }
  try {
    m->region = bip::mapped_region(m->shm, mode);
  } catch (const bip::interprocess_exception& e) {
    return from_interprocess(e, "mapping region '/" + name + "'");
  }
  m->size = static_cast<uint64_t>(size);
  return m;
}

// ---- ownership ---------------------------------------------------------------------------------
// The owner of a region holds an exclusive flock(2) on its shm object for as long as it lives; the
// kernel drops it when the owner dies, kill -9 included. So "is the owner alive?" is answered by
// trying the lock, not by the header's pid (a recycled pid would look alive). The pid is what the
// refusal names.

// True when /dev/shm/<name> is the object open as `fd`.
bool names_object(const std::string& name, int fd) {
  struct stat mine {};
  struct stat named {};
  return fstat(fd, &mine) == 0 && stat(shm_path(name).c_str(), &named) == 0 &&
         mine.st_dev == named.st_dev && mine.st_ino == named.st_ino;
}

// The owner pid recorded in the header of the object open as `fd` (0 when unreadable).
int64_t recorded_owner(int fd) {
  RegionHeader h{};
  if (pread(fd, &h, sizeof(h), 0) != static_cast<ssize_t>(sizeof(h))) return 0;
  return h.owner_pid;  // a private copy: no atomic access needed
}

Status lock_owner(int fd, const std::string& name, const std::string& ctx) {
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) return Status::ok();
  if (errno != EWOULDBLOCK) {
    return Status(Code::kIoError, ctx + ": flock " + shm_path(name) + ": " + errno_text(errno));
  }
  return Status(Code::kAlreadyExists, ctx + ": " + shm_path(name) +
                                          " is owned by a running process (pid " +
                                          std::to_string(recorded_owner(fd)) +
                                          " per its header): another keep-manager uses this "
                                          "--shm-name; stop it or choose another name");
}

// Removes /dev/shm/<name> when no live owner holds it; ok when there is none. kAlreadyExists when
// the owner is alive.
Status remove_if_abandoned(const std::string& name, const std::string& ctx) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int fd = ::open(shm_path(name).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) return Status::ok();
      return Status(Code::kIoError, ctx + ": opening " + shm_path(name) + ": " + errno_text(errno));
    }
    Status st = lock_owner(fd, name, ctx);
    // Holding the dead owner's lock, remove the name only while it still names that object: a
    // contender that held the lock before us may have replaced it with its own, live one.
    const bool same = st.is_ok() && names_object(name, fd);
    if (same) bip::shared_memory_object::remove(name.c_str());
    ::close(fd);
    if (!st.is_ok() || same) return st;
  }
  return Status(Code::kAlreadyExists,
                ctx + ": " + shm_path(name) + " keeps being replaced by another process");
}

}  // namespace

// ---- KvRegion (owner) -----------------------------------------------------------------------

size_t KvRegion::KeyHash::operator()(const EntryKey& k) const {
  uint64_t h = k.agent_hash * 0x9e3779b97f4a7c15ull;
  h ^= k.object_id + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= k.object_version + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= k.group_version + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= static_cast<uint64_t>(k.kind) + (h << 6) + (h >> 2);
  return static_cast<size_t>(h);
}

KvRegion::KvRegion(RegionOptions options, std::unique_ptr<detail::Mapping> mapping)
    : options_(std::move(options)),
      mapping_(std::move(mapping)),
      allocator_(options_.num_blocks, options_.fit),
      slots_(options_.max_entries) {
  counters_.max_entries = options_.max_entries;
}

Result<std::unique_ptr<KvRegion>> KvRegion::create(RegionOptions options) {
  const std::string ctx = "creating KV region '/" + options.name + "'";
  Status st = validate_region_name(options.name);
  if (!st.is_ok()) return st.with_context(ctx);
  st = options.fingerprint.validate();
  if (!st.is_ok()) return st.with_context(ctx);
  auto geo = compute_geometry(options.block_bytes, options.num_blocks, options.max_entries);
  if (!geo.is_ok()) return geo.status().with_context(ctx);
  if ((options.mode & ~static_cast<mode_t>(0777)) != 0) {
    return Status(Code::kInvalidArgument, ctx + ": mode must be within 0777");
  }

  if (options.replace) KEEP_RETURN_IF_ERROR(remove_if_abandoned(options.name, ctx));

  auto m = std::make_unique<detail::Mapping>();
  try {
    bip::permissions perm(static_cast<unsigned>(options.mode));
    m->shm =
        bip::shared_memory_object(bip::create_only, options.name.c_str(), bip::read_write, perm);
  } catch (const bip::interprocess_exception& e) {
    Status err = from_interprocess(e, ctx);
    if (err.code() == Code::kAlreadyExists) {
      return Status(Code::kAlreadyExists,
                    ctx + ": " + shm_path(options.name) +
                        " already exists (another keep-manager, or a stale one: set replace "
                        "to overwrite it)");
    }
    return err;
  }
  // From here on the object is ours: remove it again on any failure.
  struct RemoveOnFailure {
    const std::string& name;
    bool armed = true;
    ~RemoveOnFailure() {
      if (armed) bip::shared_memory_object::remove(name.c_str());
    }
  } guard{options.name};

  try {
    m->shm.truncate(static_cast<bip::offset_t>(geo->region_bytes));
  } catch (const bip::interprocess_exception& e) {
    return from_interprocess(e, ctx + ": ftruncate to " + std::to_string(geo->region_bytes));
  }
  if (options.preallocate) {
    const int rc = posix_fallocate(m->fd(), 0, static_cast<off_t>(geo->region_bytes));
    if (rc == ENOSPC || rc == ENOMEM) {
      return Status(Code::kResourceExhausted,
                    ctx + ": /dev/shm cannot hold " + std::to_string(geo->region_bytes) +
                        " bytes (" + errno_text(rc) + "); shrink the arena or grow /dev/shm");
    }
    if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
      return Status(Code::kIoError, ctx + ": posix_fallocate: " + errno_text(rc));
    }
  }
  try {
    m->region = bip::mapped_region(m->shm, bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    return from_interprocess(e, ctx + ": mmap");
  }
  m->size = geo->region_bytes;
  // Owned from here on. A contender that opened the object between our create and this lock
  // found it unlocked and may have removed its name: then it is no longer ours to serve.
  st = lock_owner(m->fd(), options.name, ctx);
  if (!st.is_ok()) {
    guard.armed = false;  // whatever the name refers to now is not ours to remove
    return st;
  }
  if (!names_object(options.name, m->fd())) {
    guard.armed = false;
    return Status(Code::kAlreadyExists,
                  ctx + ": another process replaced " + shm_path(options.name) +
                      " while it was being created (two keep-managers starting on one name?)");
  }

  // The object is zero-filled by ftruncate: every directory entry is free, generation 0, seq 0.
  auto* h = reinterpret_cast<RegionHeader*>(m->base());
  std::memcpy(h->magic, kRegionMagic, sizeof(kRegionMagic));
  h->format_version = kFormatVersion;
  h->header_bytes = sizeof(RegionHeader);
  h->region_bytes = geo->region_bytes;
  h->block_bytes = options.block_bytes;
  h->num_blocks = options.num_blocks;
  h->max_entries = options.max_entries;
  h->entry_bytes = sizeof(DirectoryEntry);
  h->directory_offset = kHeaderBytes;
  h->arena_offset = geo->arena_offset;
  h->arena_bytes = geo->arena_bytes;
  h->creator_pid = static_cast<int64_t>(getpid());
  h->created_unix_ns = realtime_now_ns();
  h->fingerprint = options.fingerprint;
  std::atomic_ref<int64_t>(h->owner_pid).store(getpid(), std::memory_order_relaxed);
  std::atomic_ref<uint32_t>(h->init_state).store(kInitReady, std::memory_order_release);

  guard.armed = false;
  std::unique_ptr<KvRegion> region(new KvRegion(std::move(options), std::move(m)));
  for (uint32_t i = 0; i < region->options_.max_entries; ++i) region->free_slots_.push_back(i);
  KEEP_LOG_INFO("kvregion",
                "created %s: %" PRIu64 " MiB, %" PRIu64 " blocks of %" PRIu64
                " bytes, %u entries, arena at %" PRIu64 ", %s",
                shm_path(region->name()).c_str(), region->size() >> 20, region->options_.num_blocks,
                region->options_.block_bytes, region->options_.max_entries, h->arena_offset,
                region->options_.fingerprint.describe().c_str());
  return region;
}

Result<std::unique_ptr<KvRegion>> KvRegion::adopt(RegionOptions options) {
  const std::string ctx = "adopting KV region '/" + options.name + "'";
  KEEP_ASSIGN_OR_RETURN(auto m, open_existing(options.name, /*writable=*/true));
  auto* h = reinterpret_cast<RegionHeader*>(m->base());
  const RegionHeader hc = copy_header(m->base());
  Status st = validate_header(hc, m->size);
  if (!st.is_ok()) return st.with_context(ctx);
  KEEP_RETURN_IF_ERROR(lock_owner(m->fd(), options.name, ctx));
  st = check_fingerprint(hc.fingerprint, options.fingerprint);
  if (!st.is_ok()) return st.with_context(ctx);
  if (hc.block_bytes != options.block_bytes || hc.num_blocks != options.num_blocks ||
      hc.max_entries != options.max_entries) {
    return Status(
        Code::kVersionMismatch,
        ctx + ": geometry differs: region has " + std::to_string(hc.num_blocks) + " blocks of " +
            std::to_string(hc.block_bytes) + " and " + std::to_string(hc.max_entries) +
            " entries; options ask for " + std::to_string(options.num_blocks) + " of " +
            std::to_string(options.block_bytes) + " and " + std::to_string(options.max_entries));
  }
  std::atomic_ref<int64_t>(h->owner_pid).store(getpid(), std::memory_order_relaxed);
  const uint64_t bpt = options.fingerprint.bytes_per_token();
  std::unique_ptr<KvRegion> region(new KvRegion(std::move(options), std::move(m)));
  size_t dropped = 0;
  for (uint32_t i = 0; i < region->options_.max_entries; ++i) {
    DirectoryEntry* e = region->dir(i);
    Slot& s = region->slots_[i];
    s.generation = load_relaxed(e->generation);
    const uint64_t seq = load_relaxed(e->seq);
    const auto state = static_cast<EntryState>(load_relaxed(e->state));
    if (seq & 1) {  // the previous owner died inside a write section: make the count even
      seq_ref(*e).store(seq + 1, std::memory_order_release);
    }
    bool live = !(seq & 1) && (state == EntryState::kReserved || state == EntryState::kCommitted);
    if (live) {
      s.state = state;
      s.key.agent_hash = e->key.agent_hash;
      s.key.object_id = e->key.object_id;
      s.key.object_version = e->key.object_version;
      s.key.group_version = e->key.group_version;
      s.key.kind = e->key.kind;
      s.tokens = e->tokens;
      s.first_block = e->first_block;
      s.block_count = e->block_count;
      s.bytes = e->bytes;
      s.owner_id = e->owner_id;
      s.lease_expiry_ns = e->lease_expiry_ns;
      const uint64_t bb = region->options_.block_bytes;
      live = s.tokens > 0 && s.bytes == s.tokens * bpt &&
             s.block_count == (s.bytes + bb - 1) / bb &&
             region->allocator_.mark_used(s.first_block, s.block_count).is_ok();
    }
    if (live) {
      if (s.state == EntryState::kReserved) region->reserved_.insert(i);
      if (s.state == EntryState::kCommitted) {
        region->committed_by_key_[s.key] = i;
        ++region->committed_count_;
        region->committed_payload_ += s.bytes;
      }
    } else {
      if (state != EntryState::kFree) ++dropped;
      const uint64_t gen = s.generation;
      s = Slot();
      s.generation = gen;
      region->publish(i, 0);
      region->free_slots_.push_back(i);
    }
  }
  if (dropped > 0) {
    KEEP_LOG_WARN("kvregion", "%s: dropped %zu inconsistent directory entries", ctx.c_str(),
                  dropped);
  }
  KEEP_LOG_INFO("kvregion", "adopted %s: %zu reserved, %zu committed, %" PRIu64 " blocks used",
                shm_path(region->name()).c_str(), region->reserved_.size(),
                static_cast<size_t>(region->committed_count_), region->allocator_.used_blocks());
  return region;
}

KvRegion::~KvRegion() {
  if (!mapping_ || options_.keep_on_destroy) return;
  // Remove the name only if it still refers to our object (a successor may have replaced it).
  if (names_object(options_.name, mapping_->fd())) {
    bip::shared_memory_object::remove(options_.name.c_str());
  }
}

bool KvRegion::linked() const { return names_object(options_.name, mapping_->fd()); }

bool KvRegionView::linked() const { return names_object(name_, mapping_->fd()); }

int64_t KvRegion::now() const { return options_.clock ? options_.clock() : monotonic_now_ns(); }

RegionHeader* KvRegion::header() const { return reinterpret_cast<RegionHeader*>(mapping_->base()); }

DirectoryEntry* KvRegion::dir(uint32_t index) const {
  return reinterpret_cast<DirectoryEntry*>(mapping_->base() + kHeaderBytes) + index;
}

std::byte* KvRegion::base() const { return mapping_->base(); }
size_t KvRegion::size() const { return static_cast<size_t>(mapping_->size); }

EntryDescriptor KvRegion::descriptor(uint32_t index) const {
  const Slot& s = slots_[index];
  EntryDescriptor d;
  d.index = index;
  d.generation = s.generation;
  d.offset = header()->arena_offset + s.first_block * options_.block_bytes;
  d.bytes = s.bytes;
  d.tokens = s.tokens;
  return d;
}

void KvRegion::publish(uint32_t index, int64_t committed_ns) {
  DirectoryEntry& e = *dir(index);
  const Slot& s = slots_[index];
  auto seq = seq_ref(e);
  uint64_t v = seq.load(std::memory_order_relaxed);
  if (v & 1) ++v;  // never happens for our own entries; keeps the protocol even if scribbled on
  seq.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  store_relaxed(e.generation, s.generation);
  store_relaxed(e.state, static_cast<uint32_t>(s.state));
  store_relaxed(e.tokens, s.tokens);
  store_relaxed(e.key.agent_hash, s.key.agent_hash);
  store_relaxed(e.key.object_id, s.key.object_id);
  store_relaxed(e.key.object_version, s.key.object_version);
  store_relaxed(e.key.group_version, s.key.group_version);
  store_relaxed(e.key.kind, s.key.kind);
  store_relaxed(e.first_block, s.first_block);
  store_relaxed(e.block_count, s.block_count);
  store_relaxed(e.bytes, s.bytes);
  store_relaxed(e.owner_id, s.owner_id);
  store_relaxed(e.lease_expiry_ns, s.lease_expiry_ns);
  store_relaxed(e.committed_ns, committed_ns);
  seq.store(v + 2, std::memory_order_release);
}

Status KvRegion::check_slot(uint32_t index, uint64_t generation, EntryState state,
                            const char* op) const {
  if (index >= slots_.size()) {
    return Status(Code::kNotFound, std::string(op) + ": entry index " + std::to_string(index) +
                                       " out of range (" + std::to_string(slots_.size()) +
                                       " entries)");
  }
  const Slot& s = slots_[index];
  if (s.generation != generation || s.state != state) {
    static const char* kNames[] = {"free", "reserved", "committed"};
    return Status(Code::kStale, std::string(op) + ": entry " + std::to_string(index) +
                                    " generation " + std::to_string(generation) + " is gone (now " +
                                    kNames[static_cast<int>(s.state)] + " at generation " +
                                    std::to_string(s.generation) + ")");
  }
  return Status::ok();
}

void KvRegion::free_slot(uint32_t index) {
  Slot& s = slots_[index];
  KEEP_CHECK(s.state != EntryState::kFree);
  Status st = allocator_.free(s.first_block, s.block_count);
  KEEP_CHECK_MSG(st.is_ok(), st.message().c_str());
  if (s.state == EntryState::kCommitted) {
    --committed_count_;
    committed_payload_ -= s.bytes;
    auto it = committed_by_key_.find(s.key);
    if (it != committed_by_key_.end() && it->second == index) committed_by_key_.erase(it);
  }
  reserved_.erase(index);
  const uint64_t gen = s.generation;
  s = Slot();
  s.generation = gen;
  publish(index, 0);
  free_slots_.push_back(index);
}

Result<EntryDescriptor> KvRegion::reserve(const EntryKey& key, uint32_t tokens, uint64_t owner_id,
                                          std::chrono::milliseconds lease) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tokens == 0) return Status(Code::kInvalidArgument, "reserve: tokens is 0");
  if (lease.count() <= 0) return Status(Code::kInvalidArgument, "reserve: lease must be > 0");
  const uint64_t bpt = options_.fingerprint.bytes_per_token();
  const uint64_t arena_bytes = options_.num_blocks * options_.block_bytes;
  if (tokens > arena_bytes / bpt) {
    ++counters_.reserve_failures;
    return Status(Code::kTooLarge, "reserve: " + std::to_string(tokens) + " tokens need " +
                                       std::to_string(static_cast<uint64_t>(tokens) * bpt) +
                                       " bytes, the arena has " + std::to_string(arena_bytes));
  }
  const uint64_t bytes = static_cast<uint64_t>(tokens) * bpt;
  const uint64_t blocks = (bytes + options_.block_bytes - 1) / options_.block_bytes;
  if (free_slots_.empty()) {
    ++counters_.reserve_failures;
    return Status(Code::kResourceExhausted,
                  "reserve: directory full (all " + std::to_string(slots_.size()) +
                      " entries in use, " + std::to_string(reserved_.size()) + " reserved)");
  }
  auto first = allocator_.allocate(blocks);
  if (!first.is_ok()) {
    ++counters_.reserve_failures;
    return first.status().with_context("reserve " + std::to_string(tokens) + " tokens");
  }
  const uint32_t index = free_slots_.front();
  free_slots_.pop_front();
  Slot& s = slots_[index];
  KEEP_CHECK(s.state == EntryState::kFree);
  s.state = EntryState::kReserved;
  ++s.generation;
  s.key = key;
  s.tokens = tokens;
  s.first_block = *first;
  s.block_count = blocks;
  s.bytes = bytes;
  s.owner_id = owner_id;
  const int64_t lease_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(lease).count();
  s.lease_expiry_ns = add_saturating(now(), lease_ns);
  reserved_.insert(index);
  publish(index, 0);
  ++counters_.reserves;
  return descriptor(index);
}

Status KvRegion::commit(uint32_t index, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  Status st = check_slot(index, generation, EntryState::kReserved, "commit");
  if (!st.is_ok()) {
    ++counters_.commit_failures;
    return st;
  }
  Slot& s = slots_[index];
  const int64_t t = now();
  if (t >= s.lease_expiry_ns) {
    const int64_t late_ms = (t - s.lease_expiry_ns) / 1'000'000;
    free_slot(index);
    ++counters_.commit_failures;
    return Status(Code::kLeaseExpired, "commit: entry " + std::to_string(index) + " generation " +
                                           std::to_string(generation) + ": lease ran out " +
                                           std::to_string(late_ms) + " ms ago; entry freed");
  }
  s.state = EntryState::kCommitted;
  s.lease_expiry_ns = 0;
  reserved_.erase(index);
  committed_by_key_[s.key] = index;
  ++committed_count_;
  committed_payload_ += s.bytes;
  publish(index, t);
  ++counters_.commits;
  return Status::ok();
}

Status KvRegion::revoke(uint32_t index, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  KEEP_RETURN_IF_ERROR(check_slot(index, generation, EntryState::kReserved, "revoke"));
  free_slot(index);
  ++counters_.revokes;
  return Status::ok();
}

Status KvRegion::release(uint32_t index, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  KEEP_RETURN_IF_ERROR(check_slot(index, generation, EntryState::kCommitted, "release"));
  free_slot(index);
  ++counters_.releases;
  return Status::ok();
}

Status KvRegion::renew_lease(uint32_t index, uint64_t generation, std::chrono::milliseconds lease) {
  std::lock_guard<std::mutex> lock(mu_);
  if (lease.count() <= 0) return Status(Code::kInvalidArgument, "renew_lease: lease must be > 0");
  KEEP_RETURN_IF_ERROR(check_slot(index, generation, EntryState::kReserved, "renew_lease"));
  Slot& s = slots_[index];
  const int64_t t = now();
  if (t >= s.lease_expiry_ns) {
    return Status(Code::kLeaseExpired, "renew_lease: entry " + std::to_string(index) +
                                           " generation " + std::to_string(generation) +
                                           ": lease already ran out");
  }
  s.lease_expiry_ns =
      add_saturating(t, std::chrono::duration_cast<std::chrono::nanoseconds>(lease).count());
  publish(index, 0);
  return Status::ok();
}

size_t KvRegion::reap_expired(int64_t now_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t grace_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(options_.reap_grace).count();
  std::vector<uint32_t> expired;
  for (uint32_t index : reserved_) {
    if (add_saturating(slots_[index].lease_expiry_ns, grace_ns) <= now_ns) {
      expired.push_back(index);
    }
  }
  for (uint32_t index : expired) {
    KEEP_LOG_WARN("kvregion",
                  "reaping entry %u generation %" PRIu64 " of owner %" PRIu64
                  ": lease expired (%" PRIu64 " blocks freed)",
                  index, slots_[index].generation, slots_[index].owner_id,
                  slots_[index].block_count);
    free_slot(index);
  }
  counters_.reaped += expired.size();
  return expired.size();
}

std::optional<EntryDescriptor> KvRegion::lookup(const EntryKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = committed_by_key_.find(key);
  if (it == committed_by_key_.end()) return std::nullopt;
  return descriptor(it->second);
}

RegionStats KvRegion::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  RegionStats st = counters_;
  st.region_bytes = mapping_->size;
  st.block_bytes = options_.block_bytes;
  st.total_blocks = allocator_.num_blocks();
  st.used_blocks = allocator_.used_blocks();
  st.free_blocks = allocator_.free_blocks();
  st.largest_free_run_blocks = allocator_.largest_free_run();
  st.bytes_used = st.used_blocks * st.block_bytes;
  st.bytes_free = st.free_blocks * st.block_bytes;
  st.max_entries = options_.max_entries;
  st.entries_reserved = static_cast<uint32_t>(reserved_.size());
  st.entries_committed = committed_count_;
  st.entries_free = options_.max_entries - st.entries_reserved - committed_count_;
  st.payload_bytes_committed = committed_payload_;
  return st;
}

Result<std::span<std::byte>> KvRegion::entry_data(const EntryDescriptor& d) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (d.index >= slots_.size()) {
    return Status(Code::kNotFound, "entry index " + std::to_string(d.index) + " out of range");
  }
  const Slot& s = slots_[d.index];
  if (s.state == EntryState::kFree || s.generation != d.generation) {
    return Status(Code::kStale, "entry " + std::to_string(d.index) + " generation " +
                                    std::to_string(d.generation) + " is gone");
  }
  const EntryDescriptor cur = descriptor(d.index);
  if (cur.offset != d.offset || cur.bytes != d.bytes) {
    return Status(Code::kInvalidArgument, "descriptor of entry " + std::to_string(d.index) +
                                              " does not match the directory");
  }
  return std::span<std::byte>(mapping_->base() + cur.offset, cur.bytes);
}

// ---- KvRegionView (any process) -------------------------------------------------------------

Result<std::unique_ptr<KvRegionView>> KvRegionView::attach(const std::string& name,
                                                           const ModelFingerprint& expected,
                                                           Access access) {
  const std::string ctx = "attaching KV region '/" + name + "'";
  auto m = open_existing(name, access == Access::kReadWrite);
  if (!m.is_ok()) return m.status().with_context(ctx);
  // Geometry is validated and kept from one copy: later writes to the shared header cannot move
  // our bounds.
  const RegionHeader h = copy_header((*m)->base());
  Status st = validate_header(h, (*m)->size);
  if (!st.is_ok()) return st.with_context(ctx);
  st = check_fingerprint(h.fingerprint, expected);
  if (!st.is_ok()) return st.with_context(ctx);
  std::unique_ptr<KvRegionView> view(new KvRegionView());
  view->fingerprint_ = h.fingerprint;
  view->block_bytes_ = h.block_bytes;
  view->num_blocks_ = h.num_blocks;
  view->max_entries_ = h.max_entries;
  view->directory_offset_ = h.directory_offset;
  view->arena_offset_ = h.arena_offset;
  view->mapping_ = std::move(m).value();
  view->name_ = name;
  return view;
}

KvRegionView::~KvRegionView() = default;

std::byte* KvRegionView::base() const { return mapping_->base(); }
size_t KvRegionView::size() const { return static_cast<size_t>(mapping_->size); }

const DirectoryEntry* KvRegionView::dir(uint32_t index) const {
  return reinterpret_cast<const DirectoryEntry*>(mapping_->base() + directory_offset_) + index;
}

std::optional<uint64_t> KvRegionView::read_begin(uint32_t index, uint64_t generation) const {
  if (index >= max_entries_) return std::nullopt;
  const DirectoryEntry& e = *dir(index);
  for (int spin = 0; spin < kReadSpins; ++spin) {
    const uint64_t s1 = seq_ref(e).load(std::memory_order_acquire);
    if (s1 & 1) {
      cpu_relax();
      continue;
    }
    const uint32_t state = load_relaxed(e.state);
    const uint64_t gen = load_relaxed(e.generation);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (seq_ref(e).load(std::memory_order_relaxed) != s1) continue;
    if (state != static_cast<uint32_t>(EntryState::kCommitted) || gen != generation) {
      return std::nullopt;
    }
    return s1;
  }
  return std::nullopt;
}

bool KvRegionView::read_validate(uint32_t index, uint64_t seq) const {
  if (index >= max_entries_) return false;
  std::atomic_thread_fence(std::memory_order_acquire);
  return seq_ref(*dir(index)).load(std::memory_order_relaxed) == seq;
}

Result<EntryInfo> KvRegionView::entry_info(uint32_t index) const {
  if (index >= max_entries_) {
    return Status(Code::kNotFound, "entry index " + std::to_string(index) + " out of range (" +
                                       std::to_string(max_entries_) + " entries)");
  }
  EntryInfo info;
  if (!read_entry(*dir(index), index, arena_offset_, block_bytes_, &info)) {
    return Status(Code::kUnavailable, "entry " + std::to_string(index) + " kept changing");
  }
  return info;
}

Result<std::span<std::byte>> KvRegionView::entry_data(const EntryDescriptor& d) const {
  const std::string ctx =
      "entry " + std::to_string(d.index) + " gen " + std::to_string(d.generation);
  if (d.index >= max_entries_) {
    return Status(Code::kInvalidArgument,
                  ctx + ": index out of range (" + std::to_string(max_entries_) + " entries)");
  }
  if (d.bytes == 0 || d.offset < arena_offset_ || d.offset > mapping_->size ||
      d.bytes > mapping_->size - d.offset || (d.offset - arena_offset_) % block_bytes_ != 0) {
    return Status(Code::kInvalidArgument,
                  ctx + ": [" + std::to_string(d.offset) + ", +" + std::to_string(d.bytes) +
                      ") is not a block-aligned range inside the arena [" +
                      std::to_string(arena_offset_) + ", " + std::to_string(mapping_->size) + ")");
  }
  KEEP_ASSIGN_OR_RETURN(EntryInfo info, entry_info(d.index));
  if (info.state == EntryState::kFree || info.generation != d.generation) {
    return Status(Code::kStale, ctx + ": gone (directory has generation " +
                                    std::to_string(info.generation) + ")");
  }
  if (info.offset != d.offset || info.bytes != d.bytes || info.tokens != d.tokens) {
    return Status(Code::kInvalidArgument, ctx + ": descriptor does not match the directory");
  }
  return std::span<std::byte>(mapping_->base() + d.offset, d.bytes);
}

Status KvRegionView::check_writable(const EntryDescriptor& d, int64_t now_ns) const {
  KEEP_ASSIGN_OR_RETURN(EntryInfo info, entry_info(d.index));
  if (info.state != EntryState::kReserved || info.generation != d.generation) {
    return Status(Code::kStale, "entry " + std::to_string(d.index) + " generation " +
                                    std::to_string(d.generation) + " is no longer reserved");
  }
  if (now_ns >= info.lease_expiry_ns) {
    return Status(Code::kLeaseExpired, "entry " + std::to_string(d.index) + " generation " +
                                           std::to_string(d.generation) + ": lease ran out");
  }
  return Status::ok();
}

}  // namespace keep::kv
