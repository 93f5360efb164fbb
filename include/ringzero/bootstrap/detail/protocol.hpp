// The TCP store's wire format. Every request is one frame, answered by one reply:
//
//   request  [magic "RZS1":4][op:1][0:3][token length:4][key length:4][value length:8]
//            [token][key][value]
//   reply    [magic "RZR1":4][status:1][0:3][payload length:8][payload]
//
// Integers are little-endian. The server checks the fixed header against the limits below before
// it reserves any memory and the token before it reads the key or value, so a stray client, a
// port scanner or another job's rank costs it one rejected connection, never a crash or a
// 4-GiB allocation.
#pragma once

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace ringzero::bootstrap::detail {

inline constexpr std::size_t max_token_bytes = 256;
inline constexpr std::size_t max_key_bytes = 4096;
inline constexpr std::size_t max_value_bytes = std::size_t{64} << 20;

inline constexpr std::uint32_t request_magic = 0x31535a52;  // "RZS1"
inline constexpr std::uint32_t reply_magic = 0x31525a52;    // "RZR1"
inline constexpr std::size_t request_header_bytes = 24;
inline constexpr std::size_t reply_header_bytes = 16;

enum class op : std::uint8_t {
  hello = 1,  ///< value: world size, store generation (int64 each); checks them and the token
  set = 2,
  get = 3,   ///< answered once the key exists
  add = 4,   ///< value: delta (int64); reply: new value (int64)
  wait = 5,  ///< answered (empty) once the key exists
  done = 6,  ///< the client's store is being destroyed
};

[[nodiscard]] constexpr bool valid_op(std::uint8_t o) noexcept {
  return o >= static_cast<std::uint8_t>(op::hello) && o <= static_cast<std::uint8_t>(op::done);
}

[[nodiscard]] constexpr bool op_has_key(op o) noexcept {
  return o == op::set || o == op::get || o == op::add || o == op::wait;
}

[[nodiscard]] constexpr std::string_view op_name(op o) noexcept {
  switch (o) {
    case op::hello:
      return "hello";
    case op::set:
      return "set";
    case op::get:
      return "get";
    case op::add:
      return "add";
    case op::wait:
      return "wait";
    case op::done:
      return "done";
  }
  return "?";
}

/// retry: the server is an earlier generation of the store, still serving stragglers before it
/// closes; the client should reconnect until the next one listens.
enum class status : std::uint8_t { ok = 0, error = 1, retry = 2 };

inline void put_u32(std::byte* p, std::uint32_t v) noexcept {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}
inline void put_u64(std::byte* p, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}
[[nodiscard]] inline std::uint32_t get_u32(const std::byte* p) noexcept {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return v;
}
[[nodiscard]] inline std::uint64_t get_u64(const std::byte* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

struct request_header {
  std::uint32_t magic = request_magic;
  std::uint8_t op = 0;
  std::uint8_t pad[3] = {0, 0, 0};
  std::uint32_t token_len = 0;
  std::uint32_t key_len = 0;
  std::uint64_t value_len = 0;
};

[[nodiscard]] inline std::array<std::byte, request_header_bytes> encode(const request_header& h) {
  std::array<std::byte, request_header_bytes> b{};
  put_u32(b.data(), h.magic);
  b[4] = static_cast<std::byte>(h.op);
  b[5] = static_cast<std::byte>(h.pad[0]);
  b[6] = static_cast<std::byte>(h.pad[1]);
  b[7] = static_cast<std::byte>(h.pad[2]);
  put_u32(b.data() + 8, h.token_len);
  put_u32(b.data() + 12, h.key_len);
  put_u64(b.data() + 16, h.value_len);
  return b;
}

[[nodiscard]] inline request_header decode_request(std::span<const std::byte> b) noexcept {
  request_header h;
  h.magic = get_u32(b.data());
  h.op = static_cast<std::uint8_t>(b[4]);
  h.pad[0] = static_cast<std::uint8_t>(b[5]);
  h.pad[1] = static_cast<std::uint8_t>(b[6]);
  h.pad[2] = static_cast<std::uint8_t>(b[7]);
  h.token_len = get_u32(b.data() + 8);
  h.key_len = get_u32(b.data() + 12);
  h.value_len = get_u64(b.data() + 16);
  return h;
}

/// Why a request header is refused, or nullptr if it is acceptable.
[[nodiscard]] inline const char* check_header(const request_header& h) noexcept {
  if (h.magic != request_magic) return "not a ringzero store request (bad magic)";
  if (!valid_op(h.op)) return "unknown operation";
  if (h.pad[0] != 0 || h.pad[1] != 0 || h.pad[2] != 0) return "malformed header";
  if (h.token_len > max_token_bytes) return "token too long";
  if (h.key_len > max_key_bytes) return "key longer than 4 KiB";
  if (h.value_len > max_value_bytes) return "value larger than 64 MiB";
  const auto o = static_cast<op>(h.op);
  if (op_has_key(o) != (h.key_len > 0)) return "missing or unexpected key";
  if (o == op::hello && h.value_len != 16) return "malformed hello";
  if (o == op::add && h.value_len != 8) return "malformed integer argument";
  if (o != op::hello && o != op::add && o != op::set && h.value_len != 0) return "unexpected value";
  return nullptr;
}

[[nodiscard]] inline std::array<std::byte, reply_header_bytes> encode_reply(status s,
                                                                            std::uint64_t len) {
  std::array<std::byte, reply_header_bytes> b{};
  put_u32(b.data(), reply_magic);
  b[4] = static_cast<std::byte>(s);
  put_u64(b.data() + 8, len);
  return b;
}

/// Compares a presented token with the job's in time that depends only on the job token's
/// length, so response timing does not leak how much of a guess matched, nor how long it was.
[[nodiscard]] inline bool same_token(std::span<const std::byte> a, std::string_view b) noexcept {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < b.size(); ++i) {
    const auto x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ static_cast<unsigned char>(b[i]));
  }
  return diff == 0;
}

inline constexpr const char* wrong_token_text =
    "wrong job token (this rank's RINGZERO_TOKEN differs from rank 0's: is another job using "
    "this port?)";

/// A whole request, as views into the buffer it was parsed from.
struct request {
  op o = op::hello;
  std::string_view key;
  std::span<const std::byte> value;
};

enum class parse_status { need_more, ok, refused };

struct parse_result {
  parse_status status = parse_status::need_more;
  std::size_t consumed = 0;   ///< the frame's bytes, when ok
  const char* why = nullptr;  ///< when refused
  request req;
};

/// Parses the request at the start of `bytes` with the server's checks, in the server's order
/// (header limits, then the token, then the body), for callers holding a buffer rather than a
/// socket: the fuzz target, and tests. Nothing in the frame is trusted before it is checked.
[[nodiscard]] inline parse_result parse_request(std::span<const std::byte> bytes,
                                                std::string_view token) noexcept {
  parse_result r;
  if (bytes.size() < request_header_bytes) return r;
  const request_header h = decode_request(bytes.first(request_header_bytes));
  if (const char* why = check_header(h)) {
    r.status = parse_status::refused;
    r.why = why;
    return r;
  }
  const std::span<const std::byte> rest = bytes.subspan(request_header_bytes);
  if (rest.size() < h.token_len) return r;
  if (!same_token(rest.first(h.token_len), token)) {
    r.status = parse_status::refused;
    r.why = wrong_token_text;
    return r;
  }
  // check_header bounded every length, so this sum cannot overflow.
  const std::size_t body = std::size_t{h.key_len} + static_cast<std::size_t>(h.value_len);
  if (rest.size() - h.token_len < body) return r;
  const std::span<const std::byte> b = rest.subspan(h.token_len, body);
  r.status = parse_status::ok;
  r.consumed = request_header_bytes + h.token_len + body;
  r.req.o = static_cast<op>(h.op);
  r.req.key = std::string_view(reinterpret_cast<const char*>(b.data()), h.key_len);
  r.req.value = b.subspan(h.key_len);
  return r;
}

/// hello's arguments; check_header guarantees the 16 bytes.
struct hello_args {
  std::int64_t world_size = 0;
  std::uint64_t generation = 0;
};
[[nodiscard]] inline hello_args decode_hello(std::span<const std::byte, 16> v) noexcept {
  return {static_cast<std::int64_t>(get_u64(v.data())), get_u64(v.data() + 8)};
}

/// A reply header, checked: its status and payload length, or why it is not a store's reply.
struct reply_header {
  status st = status::ok;
  std::uint64_t len = 0;
  const char* why = nullptr;
};
[[nodiscard]] inline reply_header decode_reply(
    std::span<const std::byte, reply_header_bytes> b) noexcept {
  reply_header r;
  r.len = get_u64(b.data() + 8);
  const auto raw = static_cast<std::uint8_t>(b[4]);
  if (get_u32(b.data()) != reply_magic)
    r.why = "bad magic";
  else if (raw > static_cast<std::uint8_t>(status::retry))
    r.why = "unknown status";
  else if (r.len > max_value_bytes)
    r.why = "payload larger than 64 MiB";
  else
    r.st = static_cast<status>(raw);
  return r;
}

/// The integer a counter key holds: add() keeps it as decimal text.
[[nodiscard]] inline bool parse_counter(std::span<const std::byte> v, std::int64_t& out) noexcept {
  const auto* b = reinterpret_cast<const char*>(v.data());
  auto [p, ec] = std::from_chars(b, b + v.size(), out);
  return ec == std::errc{} && p == b + v.size() && !v.empty();
}

[[nodiscard]] inline std::vector<std::byte> counter_bytes(std::int64_t v) {
  const std::string s = std::to_string(v);
  const auto* b = reinterpret_cast<const std::byte*>(s.data());
  return {b, b + s.size()};
}

}  // namespace ringzero::bootstrap::detail
