// The TCP store's wire format as the server and the client read it: a stream of requests
// parsed with the server's checks (header limits, token, body), each request's arguments
// decoded, counters parsed, and a reply header checked as the client checks it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string_view>

#include "ringzero/bootstrap/detail/protocol.hpp"

namespace rd = ringzero::bootstrap::detail;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> all(reinterpret_cast<const std::byte*>(data), size);
  constexpr std::string_view token = "job-token-1";  // the seed corpus's token

  if (all.size() >= rd::reply_header_bytes)
    static_cast<void>(rd::decode_reply(all.first<rd::reply_header_bytes>()));

  std::span<const std::byte> rest = all;
  for (;;) {
    const rd::parse_result r = rd::parse_request(rest, token);
    if (r.status != rd::parse_status::ok) break;
    if (r.consumed == 0 || r.consumed > rest.size() || r.req.key.size() > rd::max_key_bytes ||
        r.req.value.size() > rd::max_value_bytes)
      std::abort();
    switch (r.req.o) {
      case rd::op::hello: {
        const rd::hello_args h = rd::decode_hello(r.req.value.first<16>());
        static_cast<void>(h);
        break;
      }
      case rd::op::add:
        if (r.req.value.size() != 8) std::abort();
        break;
      case rd::op::set: {
        std::int64_t n = 0;
        if (rd::parse_counter(r.req.value, n) && rd::counter_bytes(n).empty()) std::abort();
        break;
      }
      default:
        break;
    }
    rest = rest.subspan(r.consumed);
  }
  return 0;
}
