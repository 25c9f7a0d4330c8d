// libFuzzer target: arbitrary bytes as a keep-manager snapshot, the way recovery reads one: the
// file layer (decode_snapshot: header, checksums, LSN) and then its payload into an empty store
// (MemoryStore::deserialize, which runs the record codec's structural decoder and then the
// store's own consistency checks). The input is also fed to the store directly as a payload,
// since the checksums stop mutated files before the payload.
// Checks: a payload the store accepts serializes to bytes that a fresh store accepts again and
// serializes identically.
// Seeds: tests/fuzz/corpus/fuzz_snapshot_reader/ (README.md there says how they were made).
#include <string>

#include "services/manager/durability/snapshot_file.h"
#include "services/manager/durability/wal_format.h"
#include "services/manager/store/record_codec.h"
#include "shared/common/log.h"
#include "tests/fuzz/fuzz_common.h"
#include "tests/fuzz/fuzz_store.h"

namespace {

void restore(std::string_view payload) {
  using keep::manager::MemoryStore;
  keep::fuzz::FuzzEmbedder embedder;
  keep::fuzz::FuzzCounter counter;
  (void)keep::manager::decode_snapshot(payload);
  MemoryStore store(keep::manager::StoreOptions{}, &embedder, &counter);
  if (!store.deserialize(payload).is_ok()) return;
  const std::string again = store.serialize();
  MemoryStore second(keep::manager::StoreOptions{}, &embedder, &counter);
  KEEP_FUZZ_ASSERT(second.deserialize(again).is_ok());
  KEEP_FUZZ_ASSERT(second.serialize() == again);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  keep::log::set_level(keep::log::Level::kOff);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace wal = keep::manager::wal;
  const std::string_view bytes = keep::fuzz::as_text(data, size);
  // The LSN a file of these bytes would be named after: the header's.
  const uint64_t name_lsn =
      size >= wal::kSnapshotHeaderBytes ? wal::get_u64(bytes.data() + wal::kSnapshotLsnOffset) : 0;
  auto file = keep::manager::decode_snapshot(bytes, name_lsn);
  if (file.is_ok()) {
    KEEP_FUZZ_ASSERT(file->last_lsn == name_lsn);
    restore(file->payload);
  }
  restore(bytes);
  return 0;
}
