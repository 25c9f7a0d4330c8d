// Byte format of KEEP's write-ahead log and snapshot files. docs/wal-format.md describes the same
// layout in prose; the static_asserts below pin it. All integers are little-endian.
//
// WAL directory: files named wal-<first LSN, 20 decimal digits>.log. Each file is
//
//   [file header, 32 bytes][record][record]...
//
//   file header:  0 magic u64 ("KEEPWAL1")   8 version u32      12 header bytes u32 (= 32)
//                16 first LSN u64            24 reserved u32 (0) 28 masked crc32c of bytes [0, 28)
//
//   record:       0 masked crc32c u32 of bytes [4, 17 + length)
//                 4 length u32 (payload bytes)   8 type u8 (1 = full)   9 lsn u64
//                17 payload
//
// LSNs are dense and increasing: the first record of a file carries the file's first LSN, each
// next record the previous LSN + 1, and the next file starts at the last LSN + 1.
//
// Snapshot files: snapshot-<last LSN, 20 digits>.snap
//
//   snapshot header: 0 magic u64 ("KEEPSNAP")  8 version u32   12 header bytes u32 (= 48)
//                   16 last LSN u64           24 payload bytes u64
//                   32 masked crc32c u32 of the payload      36 reserved u32 (0)
//                   40 reserved u32 (0)       44 masked crc32c u32 of bytes [0, 44)
//                   48 payload
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "services/manager/durability/crc32c.h"

namespace keep::manager::wal {

// ---- WAL file header ----------------------------------------------------------------------------
inline constexpr uint64_t kFileMagic = 0x314C41575045454Bull;  // bytes "KEEPWAL1"
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr size_t kFileHeaderBytes = 32;
inline constexpr size_t kFileHeaderMagicOffset = 0;
inline constexpr size_t kFileHeaderVersionOffset = 8;
inline constexpr size_t kFileHeaderSizeOffset = 12;
inline constexpr size_t kFileHeaderFirstLsnOffset = 16;
inline constexpr size_t kFileHeaderReservedOffset = 24;
inline constexpr size_t kFileHeaderCrcOffset = 28;
static_assert(kFileHeaderCrcOffset + 4 == kFileHeaderBytes);
static_assert(kFileHeaderFirstLsnOffset % 8 == 0);

// ---- record
// --------------------------------------------------------------------------------------
inline constexpr size_t kRecordCrcOffset = 0;
inline constexpr size_t kRecordLengthOffset = 4;
inline constexpr size_t kRecordTypeOffset = 8;
inline constexpr size_t kRecordLsnOffset = 9;
inline constexpr size_t kRecordHeaderBytes = 17;
static_assert(kRecordLsnOffset + 8 == kRecordHeaderBytes);
static_assert(kRecordLengthOffset == kRecordCrcOffset + 4);

enum class RecordType : uint8_t {
  kZero = 0,  // reserved: zero-filled space is never a record
  kFull = 1,  // one whole payload (records are never fragmented)
};

// Format limit on one payload: a length field above it is corruption. WalOptions may set a lower
// limit for appends (kTooLarge).
inline constexpr uint32_t kMaxPayloadBytes = 64u << 20;
static_assert(kMaxPayloadBytes + kRecordHeaderBytes > kMaxPayloadBytes);  // no u32 overflow

// ---- snapshot header
// -------------------------------------------------------------------------------
inline constexpr uint64_t kSnapshotMagic = 0x50414E535045454Bull;  // bytes "KEEPSNAP"
inline constexpr uint32_t kSnapshotVersion = 1;
inline constexpr size_t kSnapshotHeaderBytes = 48;
inline constexpr size_t kSnapshotLsnOffset = 16;
inline constexpr size_t kSnapshotPayloadBytesOffset = 24;
inline constexpr size_t kSnapshotPayloadCrcOffset = 32;
inline constexpr size_t kSnapshotHeaderCrcOffset = 44;
static_assert(kSnapshotHeaderCrcOffset + 4 == kSnapshotHeaderBytes);

// ---- file names
// -----------------------------------------------------------------------------------
inline constexpr std::string_view kWalPrefix = "wal-";
inline constexpr std::string_view kWalSuffix = ".log";
inline constexpr std::string_view kSnapshotPrefix = "snapshot-";
inline constexpr std::string_view kSnapshotSuffix = ".snap";
inline constexpr size_t kLsnDigits = 20;  // enough for any u64

// ---- little-endian helpers
// ------------------------------------------------------------------------
inline void put_u32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xffu);
}
inline void put_u64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xffu);
}
inline uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
inline uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// "wal-00000000000000000042.log" / "snapshot-00000000000000000042.snap".
std::string wal_file_name(uint64_t first_lsn);
std::string snapshot_file_name(uint64_t last_lsn);
// Parses a name made by the functions above; false for any other name.
bool parse_wal_file_name(std::string_view name, uint64_t* first_lsn);
bool parse_snapshot_file_name(std::string_view name, uint64_t* last_lsn);

// Appends a 32-byte file header for a file whose first record will carry `first_lsn`.
void encode_file_header(uint64_t first_lsn, std::string* out);
// Appends one framed record. The caller has checked payload.size() <= kMaxPayloadBytes.
void encode_record(uint64_t lsn, std::string_view payload, std::string* out);

}  // namespace keep::manager::wal
