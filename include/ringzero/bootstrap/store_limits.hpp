// What the TCP store's server spends on its clients, at most. The store listens on a TCP port
// that anything on the network can reach, so a port scanner, another job's rank or a hostile
// peer must cost it a bounded number of connections, bounded memory and bounded time, and must
// never hold up the job's own ranks.
//
//   RINGZERO_STORE_MAX_CONNECTIONS   connections served at once (default max(1024, 2·world+64))
//   RINGZERO_STORE_MAX_MEMORY        bytes of keys and values held, requests included (1 GiB)
//   RINGZERO_STORE_IDLE_TIMEOUT      seconds a new connection has to present the job token (10)
//   RINGZERO_STORE_REQUEST_TIMEOUT   seconds a started request has to arrive whole, and a reply
//                                    to be taken whole (30)
//
// Both timeouts are capped at the store's own timeout (RINGZERO_TIMEOUT). Ranks present the
// token within microseconds of connecting and send each request in one go, so the defaults are
// far above what a healthy job needs. The wire format's own limits (token 256 B, key 4 KiB,
// value 64 MiB) are fixed, since both ends must agree on them.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <optional>

#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"

namespace ringzero::bootstrap {

struct tcp_store_limits {
  static constexpr std::size_t default_max_memory_bytes = std::size_t{1} << 30;
  static constexpr std::chrono::seconds default_idle_timeout{10};
  static constexpr std::chrono::seconds default_request_timeout{30};

  /// Connections served at once; 0: max(1024, 2·world_size + 64). Beyond it, a new connection
  /// replaces the oldest one that has not yet presented the token, or is refused if none has.
  std::size_t max_connections = 0;
  /// Keys and values stored plus requests being received; a request that would pass it is
  /// refused (the store keeps serving everything else).
  std::size_t max_memory_bytes = default_max_memory_bytes;
  /// A new connection that has not presented the job token by then is dropped.
  std::chrono::nanoseconds idle_timeout = default_idle_timeout;
  /// A request whose first byte arrived must be complete by then, and a reply must be taken by
  /// the client by then; otherwise the connection is dropped (a slow-loris peer).
  std::chrono::nanoseconds request_timeout = default_request_timeout;

  /// The defaults, overridden by the RINGZERO_STORE_* variables above. Throws invalid_argument
  /// naming a malformed or non-positive variable.
  [[nodiscard]] static tcp_store_limits from_env() {
    tcp_store_limits l;
    const auto positive = [](const char* name) -> std::optional<long long> {
      const auto v = ringzero::detail::getenv_int(name);
      if (v && *v <= 0)
        throw invalid_argument(fmt::format("{}={} must be a positive integer", name, *v));
      return v;
    };
    if (const auto v = positive("RINGZERO_STORE_MAX_CONNECTIONS"))
      l.max_connections = static_cast<std::size_t>(*v);
    if (const auto v = positive("RINGZERO_STORE_MAX_MEMORY"))
      l.max_memory_bytes = static_cast<std::size_t>(*v);
    if (const auto v = positive("RINGZERO_STORE_IDLE_TIMEOUT"))
      l.idle_timeout = std::chrono::seconds(std::min<long long>(*v, 1LL << 31));
    if (const auto v = positive("RINGZERO_STORE_REQUEST_TIMEOUT"))
      l.request_timeout = std::chrono::seconds(std::min<long long>(*v, 1LL << 31));
    return l;
  }

  /// The limits a server for `world_size` ranks with timeout `timeout` applies: automatic values
  /// filled in, timeouts capped. Throws invalid_argument for non-positive values.
  [[nodiscard]] tcp_store_limits resolved(int world_size, std::chrono::nanoseconds timeout) const {
    if (max_memory_bytes == 0)
      throw invalid_argument("tcp_store_limits: max_memory_bytes must be positive");
    if (idle_timeout <= std::chrono::nanoseconds::zero() ||
        request_timeout <= std::chrono::nanoseconds::zero())
      throw invalid_argument("tcp_store_limits: timeouts must be positive");
    tcp_store_limits r = *this;
    if (r.max_connections == 0)
      r.max_connections =
          std::max<std::size_t>(1024, 2 * static_cast<std::size_t>(world_size) + 64);
    r.idle_timeout = std::min(r.idle_timeout, timeout);
    r.request_timeout = std::min(r.request_timeout, timeout);
    return r;
  }
};

}  // namespace ringzero::bootstrap
