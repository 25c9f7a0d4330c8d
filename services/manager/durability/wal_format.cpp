#include "services/manager/durability/wal_format.h"

#include <cinttypes>
#include <cstdio>

namespace keep::manager::wal {
namespace {

std::string lsn_name(std::string_view prefix, uint64_t lsn, std::string_view suffix) {
  char digits[32];
  std::snprintf(digits, sizeof digits, "%020" PRIu64, lsn);
  std::string s(prefix);
  s += digits;
  s += suffix;
  return s;
}

bool parse_lsn_name(std::string_view name, std::string_view prefix, std::string_view suffix,
                    uint64_t* lsn) {
  if (name.size() != prefix.size() + kLsnDigits + suffix.size()) return false;
  if (name.substr(0, prefix.size()) != prefix) return false;
  if (name.substr(prefix.size() + kLsnDigits) != suffix) return false;
  uint64_t v = 0;
  for (char c : name.substr(prefix.size(), kLsnDigits)) {
    if (c < '0' || c > '9') return false;
    uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  *lsn = v;
  return true;
}

}  // namespace

std::string wal_file_name(uint64_t first_lsn) {
  return lsn_name(kWalPrefix, first_lsn, kWalSuffix);
}
std::string snapshot_file_name(uint64_t last_lsn) {
  return lsn_name(kSnapshotPrefix, last_lsn, kSnapshotSuffix);
}
bool parse_wal_file_name(std::string_view name, uint64_t* first_lsn) {
  return parse_lsn_name(name, kWalPrefix, kWalSuffix, first_lsn);
}
bool parse_snapshot_file_name(std::string_view name, uint64_t* last_lsn) {
  return parse_lsn_name(name, kSnapshotPrefix, kSnapshotSuffix, last_lsn);
}

void encode_file_header(uint64_t first_lsn, std::string* out) {
  char h[kFileHeaderBytes] = {};
  put_u64(h + kFileHeaderMagicOffset, kFileMagic);
  put_u32(h + kFileHeaderVersionOffset, kFormatVersion);
  put_u32(h + kFileHeaderSizeOffset, static_cast<uint32_t>(kFileHeaderBytes));
  put_u64(h + kFileHeaderFirstLsnOffset, first_lsn);
  put_u32(h + kFileHeaderReservedOffset, 0);
  put_u32(h + kFileHeaderCrcOffset, crc32c_mask(crc32c(h, kFileHeaderCrcOffset)));
  out->append(h, kFileHeaderBytes);
}

void encode_record(uint64_t lsn, std::string_view payload, std::string* out) {
  char h[kRecordHeaderBytes];
  put_u32(h + kRecordLengthOffset, static_cast<uint32_t>(payload.size()));
  h[kRecordTypeOffset] = static_cast<char>(RecordType::kFull);
  put_u64(h + kRecordLsnOffset, lsn);
  uint32_t crc =
      crc32c_extend(0, h + kRecordLengthOffset, kRecordHeaderBytes - kRecordLengthOffset);
  crc = crc32c_extend(crc, payload.data(), payload.size());
  put_u32(h + kRecordCrcOffset, crc32c_mask(crc));
  out->append(h, kRecordHeaderBytes);
  out->append(payload.data(), payload.size());
}

}  // namespace keep::manager::wal
