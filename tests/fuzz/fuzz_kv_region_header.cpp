// libFuzzer target: arbitrary bytes as the start of a shared KV region (header page, then the
// directory). First validate_region_header(), the check attach() and adopt() make before they use
// anything in the region; when it passes and the region is small, the bytes are written into a
// real shm object of the size the header claims, which a worker attaches to (KvRegionView: every
// directory entry read and its descriptor resolved) and a restarted manager adopts (KvRegion:
// rebuilds its allocator and key index from the directory).
// Checks: a header that validates attaches and adopts with its own fingerprint; every byte range
// handed out lies inside the mapping.
// Seeds: tests/fuzz/corpus/fuzz_kv_region_header/ (README.md there says how they were made).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <span>
#include <string>

#include "shared/common/log.h"
#include "shared/kvregion/kv_region.h"
#include "tests/fuzz/fuzz_common.h"

namespace {

namespace kv = keep::kv;

// Regions above this are only validated (writing them per input would be slow).
constexpr uint64_t kMaxMaterialised = 4ull << 20;

const std::string& shm_name() {
  static const std::string name = "keep-fuzz-kv-" + std::to_string(::getpid());
  return name;
}

// Writes `bytes` (zero-extended to `region_bytes`) into a fresh shm object.
bool materialise(std::span<const std::byte> bytes, uint64_t region_bytes) {
  const std::string path = "/" + shm_name();
  ::shm_unlink(path.c_str());
  const int fd = ::shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return false;
  bool ok = ::ftruncate(fd, static_cast<off_t>(region_bytes)) == 0;
  void* p =
      ok ? ::mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  if (p == MAP_FAILED) return false;
  std::memcpy(p, bytes.data(), std::min<uint64_t>(bytes.size(), region_bytes));
  ::munmap(p, region_bytes);
  return ok;
}

void in_mapping(std::span<const std::byte> s, const std::byte* base, size_t size) {
  KEEP_FUZZ_ASSERT(s.data() >= base && s.size() <= size &&
                   s.data() - base <= static_cast<std::ptrdiff_t>(size - s.size()));
}

void use_view(const kv::KvRegionView& view) {
  for (uint32_t i = 0; i < view.max_entries(); ++i) {
    auto info = view.entry_info(i);
    if (!info.is_ok() || info->state == kv::EntryState::kFree) continue;
    const kv::EntryDescriptor d{i, info->generation, info->offset, info->bytes, info->tokens};
    auto data = view.entry_data(d);
    if (data.is_ok()) in_mapping(*data, view.base(), view.size());
    if (auto seq = view.read_begin(i, info->generation)) (void)view.read_validate(i, *seq);
    (void)view.check_writable(d, 0);
  }
}

void use_owner(kv::KvRegion& region, uint32_t max_entries) {
  const kv::RegionStats st = region.stats();
  KEEP_FUZZ_ASSERT(st.used_blocks + st.free_blocks == st.total_blocks);
  KEEP_FUZZ_ASSERT(st.entries_free + st.entries_reserved + st.entries_committed == max_entries);
  kv::EntryKey key;
  key.object_id = 1;
  auto d = region.reserve(key, 1, 7, std::chrono::milliseconds(1000));
  if (d.is_ok()) {
    auto data = region.entry_data(*d);
    KEEP_FUZZ_ASSERT(data.is_ok());
    in_mapping(*data, region.base(), region.size());
    KEEP_FUZZ_ASSERT(region.commit(d->index, d->generation).is_ok());
    KEEP_FUZZ_ASSERT(region.release(d->index, d->generation).is_ok());
  }
  (void)region.reap_expired(INT64_MAX);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  keep::log::set_level(keep::log::Level::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  if (size < sizeof(kv::RegionHeader)) {
    KEEP_FUZZ_ASSERT(!kv::validate_region_header(bytes, size).is_ok());
    return 0;
  }
  kv::RegionHeader h;
  std::memcpy(&h, data, sizeof(h));
  (void)kv::validate_region_header(bytes, size);
  if (!kv::validate_region_header(bytes, h.region_bytes).is_ok()) return 0;
  KEEP_FUZZ_ASSERT(kv::check_fingerprint(h.fingerprint, h.fingerprint).is_ok());
  if (h.region_bytes > kMaxMaterialised || !materialise(bytes, h.region_bytes)) return 0;

  {
    auto view = kv::KvRegionView::attach(shm_name(), h.fingerprint);
    KEEP_FUZZ_ASSERT(view.is_ok());
    use_view(**view);
  }
  kv::RegionOptions options;
  options.name = shm_name();
  options.fingerprint = h.fingerprint;
  options.block_bytes = h.block_bytes;
  options.num_blocks = h.num_blocks;
  options.max_entries = h.max_entries;
  {
    auto region = kv::KvRegion::adopt(options);  // removes the object when it goes away
    KEEP_FUZZ_ASSERT(region.is_ok());
    use_owner(**region, h.max_entries);
  }
  ::shm_unlink(("/" + shm_name()).c_str());
  return 0;
}
