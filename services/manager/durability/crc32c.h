// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of the WAL and snapshots.
//
// crc32c_extend() picks the SSE4.2 `crc32` instruction when the CPU has it (checked once at run
// time) and a portable slicing-by-8 table otherwise. Both paths are exported so tests can compare
// them on the same inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace keep::manager {

// Extends `crc` (the value returned for the bytes so far; 0 to start) with `n` bytes of `data`.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }
inline uint32_t crc32c(std::string_view s) { return crc32c_extend(0, s.data(), s.size()); }

// The two implementations behind crc32c_extend().
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);
// Only call when crc32c_hw_available() is true.
uint32_t crc32c_extend_hw(uint32_t crc, const void* data, size_t n);
bool crc32c_hw_available();

// LevelDB-style masking: a CRC stored next to the data it covers is rotated and offset, so that
// the CRC of a buffer that itself contains CRCs does not degenerate.
inline constexpr uint32_t kCrcMaskDelta = 0xa282ead8u;
inline uint32_t crc32c_mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + kCrcMaskDelta; }
inline uint32_t crc32c_unmask(uint32_t masked) {
  uint32_t rot = masked - kCrcMaskDelta;
  return (rot >> 17) | (rot << 15);
}

}  // namespace keep::manager
