// CRC-32C (Castagnoli), the checksum that guards checkpoint files. Slicing-by-8 over tables
// built at compile time: portable, no dependency, about 1-2 GB/s, which keeps verification well
// below the cost of reading the file.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace ringzero::zero::detail {

inline constexpr std::uint32_t crc32c_poly = 0x82f63b78u;  // reflected Castagnoli polynomial

using crc32c_tables = std::array<std::array<std::uint32_t, 256>, 8>;

[[nodiscard]] consteval crc32c_tables make_crc32c_tables() {
  crc32c_tables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ crc32c_poly : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t s = 1; s < 8; ++s)
    for (std::size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
  return t;
}

inline constexpr crc32c_tables crc32c_table = make_crc32c_tables();

/// Continues a CRC-32C: start with crc32c_update(0, ...) and feed the pieces in order.
[[nodiscard]] inline std::uint32_t crc32c_update(std::uint32_t crc,
                                                 std::span<const std::byte> data) noexcept {
  const auto& t = crc32c_table;
  std::uint32_t c = ~crc;
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  std::size_t n = data.size();
  while (n >= 8) {
    const std::uint32_t lo =
        c ^ (static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
             static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24);
    c = t[7][lo & 0xffu] ^ t[6][(lo >> 8) & 0xffu] ^ t[5][(lo >> 16) & 0xffu] ^ t[4][lo >> 24] ^
        t[3][p[4]] ^ t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xffu];
  return ~c;
}

[[nodiscard]] inline std::uint32_t crc32c(std::span<const std::byte> data) noexcept {
  return crc32c_update(0, data);
}

}  // namespace ringzero::zero::detail
