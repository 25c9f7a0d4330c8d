// CRC-32C: both implementations against published vectors (RFC 3720 B.4, the "123456789" check
// value) and against each other on random, unaligned inputs.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "services/manager/durability/crc32c.h"

using keep::manager::crc32c;
using keep::manager::crc32c_extend;
using keep::manager::crc32c_extend_hw;
using keep::manager::crc32c_extend_portable;
using keep::manager::crc32c_hw_available;
using keep::manager::crc32c_mask;
using keep::manager::crc32c_unmask;

namespace {

struct Vector {
  std::vector<uint8_t> bytes;
  uint32_t crc;
};

std::vector<Vector> known_vectors() {
  std::vector<Vector> v;
  auto str = [](const char* s) { return std::vector<uint8_t>(s, s + std::string(s).size()); };
  v.push_back({{}, 0x00000000u});
  v.push_back({str("a"), 0xC1D04330u});
  v.push_back({str("123456789"), 0xE3069283u});
  v.push_back({std::vector<uint8_t>(32, 0x00), 0x8A9136AAu});
  v.push_back({std::vector<uint8_t>(32, 0xFF), 0x62A8AB43u});
  std::vector<uint8_t> up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<uint8_t>(i);
    down[i] = static_cast<uint8_t>(31 - i);
  }
  v.push_back({up, 0x46DD794Eu});
  v.push_back({down, 0x113FDB5Cu});
  // RFC 3720 B.4: an iSCSI SCSI Read (10) command PDU.
  std::vector<uint8_t> pdu = {0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                              0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00,
                              0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00,
                              0x00, 0x18, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                              0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
  v.push_back({pdu, 0xD9963A56u});
  return v;
}

}  // namespace

TEST_CASE("crc32c portable table matches known vectors") {
  for (const auto& v : known_vectors()) {
    CAPTURE(v.bytes.size());
    CHECK(crc32c_extend_portable(0, v.bytes.data(), v.bytes.size()) == v.crc);
  }
}

TEST_CASE("crc32c SSE4.2 instruction matches known vectors") {
  if (!crc32c_hw_available()) {
    MESSAGE("SSE4.2 not available on this CPU: hardware path not tested");
    return;
  }
  for (const auto& v : known_vectors()) {
    CAPTURE(v.bytes.size());
    CHECK(crc32c_extend_hw(0, v.bytes.data(), v.bytes.size()) == v.crc);
  }
}

TEST_CASE("crc32c dispatcher matches known vectors") {
  for (const auto& v : known_vectors()) CHECK(crc32c(v.bytes.data(), v.bytes.size()) == v.crc);
  CHECK(crc32c(std::string_view("123456789")) == 0xE3069283u);
}

TEST_CASE("crc32c hardware and portable agree on random unaligned inputs; extend composes") {
  std::mt19937 rng(7);
  std::vector<uint8_t> buf(5000);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (size_t len : {0u, 1u, 3u, 7u, 8u, 9u, 15u, 19u, 64u, 733u, 4093u}) {
    for (size_t off : {0u, 1u, 3u, 5u}) {
      CAPTURE(len);
      CAPTURE(off);
      uint32_t p = crc32c_extend_portable(0, buf.data() + off, len);
      if (crc32c_hw_available()) CHECK(crc32c_extend_hw(0, buf.data() + off, len) == p);
      // Splitting the input anywhere gives the same CRC.
      size_t cut = len / 3;
      uint32_t a = crc32c_extend(0, buf.data() + off, cut);
      CHECK(crc32c_extend(a, buf.data() + off + cut, len - cut) == p);
      CHECK(crc32c_extend_portable(crc32c_extend_portable(0, buf.data() + off, cut),
                                   buf.data() + off + cut, len - cut) == p);
    }
  }
}

TEST_CASE("crc32c mask is invertible and changes the value") {
  for (uint32_t c : {0u, 1u, 0xE3069283u, 0xFFFFFFFFu, 0x80000000u}) {
    CHECK(crc32c_unmask(crc32c_mask(c)) == c);
    CHECK(crc32c_mask(c) != c);
  }
  CHECK(crc32c_mask(crc32c_mask(0x12345678u)) != crc32c_mask(0x12345678u));
}
