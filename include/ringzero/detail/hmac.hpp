// HMAC-SHA-256 (FIPS 180-4, RFC 2104) and random bytes from the kernel: what the socket
// transport's handshake proves a connection's job membership with (transport/socket/
// handshake.hpp). Written out here because the core depends on nothing but a C++20 compiler and
// fmt; tests/transport/socket_handshake_test.cpp checks it against RFC 4231's test vectors.
#pragma once

#include <sys/random.h>
#include <sys/types.h>

#include <fmt/core.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>

#include "ringzero/error.hpp"

namespace ringzero::detail {

using digest = std::array<std::byte, 32>;

/// SHA-256, fed in pieces.
class sha256 {
 public:
  void update(std::span<const std::byte> data) noexcept {
    for (const std::byte b : data) {
      block_[fill_++] = static_cast<std::uint8_t>(b);
      if (fill_ == block_.size()) {
        compress();
        fill_ = 0;
      }
    }
    bytes_ += data.size();
  }

  [[nodiscard]] digest finish() noexcept {
    const std::uint64_t bits = bytes_ * 8;
    block_[fill_++] = 0x80;
    if (fill_ > 56) {
      while (fill_ < 64) block_[fill_++] = 0;
      compress();
      fill_ = 0;
    }
    while (fill_ < 56) block_[fill_++] = 0;
    for (int i = 7; i >= 0; --i) block_[fill_++] = static_cast<std::uint8_t>(bits >> (8 * i));
    compress();
    digest out{};
    for (std::size_t i = 0; i < 8; ++i)
      for (std::size_t k = 0; k < 4; ++k)
        out[4 * i + k] = static_cast<std::byte>(h_[i] >> (24 - 8 * k));
    return out;
  }

 private:
  void compress() noexcept {
    static constexpr std::array<std::uint32_t, 64> k = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2};
    std::array<std::uint32_t, 64> w{};
    for (std::size_t i = 0; i < 16; ++i)
      w[i] = std::uint32_t{block_[4 * i]} << 24 | std::uint32_t{block_[4 * i + 1]} << 16 |
             std::uint32_t{block_[4 * i + 2]} << 8 | std::uint32_t{block_[4 * i + 3]};
    for (std::size_t i = 16; i < 64; ++i) {
      const std::uint32_t s0 =
          std::rotr(w[i - 15], 7) ^ std::rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const std::uint32_t s1 = std::rotr(w[i - 2], 17) ^ std::rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::array<std::uint32_t, 8> v = h_;
    for (std::size_t i = 0; i < 64; ++i) {
      const std::uint32_t s1 = std::rotr(v[4], 6) ^ std::rotr(v[4], 11) ^ std::rotr(v[4], 25);
      const std::uint32_t ch = (v[4] & v[5]) ^ (~v[4] & v[6]);
      const std::uint32_t t1 = v[7] + s1 + ch + k[i] + w[i];
      const std::uint32_t s0 = std::rotr(v[0], 2) ^ std::rotr(v[0], 13) ^ std::rotr(v[0], 22);
      const std::uint32_t maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
      const std::uint32_t t2 = s0 + maj;
      v = {t1 + t2, v[0], v[1], v[2], v[3] + t1, v[4], v[5], v[6]};
    }
    for (std::size_t i = 0; i < 8; ++i) h_[i] += v[i];
  }

  std::array<std::uint32_t, 8> h_ = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::array<std::uint8_t, 64> block_{};
  std::size_t fill_ = 0;
  std::uint64_t bytes_ = 0;
};

/// HMAC-SHA-256 of the concatenation of `parts` under `key`.
[[nodiscard]] inline digest hmac_sha256(std::span<const std::byte> key,
                                        std::initializer_list<std::span<const std::byte>> parts) {
  std::array<std::byte, 64> k{};
  if (key.size() > k.size()) {
    sha256 h;
    h.update(key);
    const digest d = h.finish();
    std::memcpy(k.data(), d.data(), d.size());
  } else if (!key.empty()) {
    std::memcpy(k.data(), key.data(), key.size());
  }
  std::array<std::byte, 64> pad{};
  for (std::size_t i = 0; i < k.size(); ++i) pad[i] = k[i] ^ std::byte{0x36};
  sha256 inner;
  inner.update(pad);
  for (const auto& p : parts) inner.update(p);
  const digest in = inner.finish();
  for (std::size_t i = 0; i < k.size(); ++i) pad[i] = k[i] ^ std::byte{0x5c};
  sha256 outer;
  outer.update(pad);
  outer.update(in);
  return outer.finish();
}

/// Whether two byte strings are equal, in time that depends only on their lengths (a MAC
/// compared byte by byte with an early exit tells a guesser how much of it was right).
[[nodiscard]] inline bool same_bytes(std::span<const std::byte> a,
                                     std::span<const std::byte> b) noexcept {
  if (a.size() != b.size()) return false;
  std::byte diff{0};
  for (std::size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == std::byte{0};
}

/// Fills `out` from the kernel's random number generator (getrandom(2)): secrets and nonces
/// nobody may predict. Throws transport_error if the kernel cannot give any.
inline void random_bytes(std::span<std::byte> out) {
  std::size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::getrandom(out.data() + got, out.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw transport_error(fmt::format("getrandom failed: {}", std::strerror(errno)));
    }
    got += static_cast<std::size_t>(n);
  }
}

}  // namespace ringzero::detail
