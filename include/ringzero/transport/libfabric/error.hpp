// libfabric return codes as ringzero errors. Every message carries libfabric's own text
// (fi_strerror) so a user can search for it, plus the provider that produced it.
#pragma once

#include <fmt/core.h>
#include <rdma/fabric.h>
#include <rdma/fi_errno.h>

#include <cerrno>
#include <string>
#include <string_view>

#include "ringzero/error.hpp"

namespace ringzero::libfabric::detail {

/// "Connection refused (-111)" for a negative libfabric return code.
[[nodiscard]] inline std::string fi_text(long long rc) {
  return fmt::format("{} ({})", fi_strerror(static_cast<int>(rc < 0 ? -rc : rc)), rc);
}

/// Throws transport_error unless rc is 0 (or positive, as some calls return counts).
inline void check(long long rc, std::string_view call, std::string_view provider) {
  if (rc >= 0) return;
  throw transport_error(fmt::format("libfabric {} failed{}{}: {}", call,
                                    provider.empty() ? "" : " on provider ", provider,
                                    fi_text(rc)));
}

/// Completion errors that mean the peer (or the path to it) is gone rather than that this
/// process misused the interface.
[[nodiscard]] constexpr bool is_peer_loss(int err) noexcept {
  // libfabric's FI_E* codes are the errno values; not every one is defined in fi_errno.h.
  switch (err) {
    case ECONNREFUSED:
    case ECONNRESET:
    case ECONNABORTED:
    case ENOTCONN:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ENETDOWN:
    case EPIPE:
    case EIO:
    case ESHUTDOWN:
    case ETIMEDOUT:
    case EREMOTEIO:
    case EADDRNOTAVAIL:
      return true;
    default:
      return false;
  }
}

}  // namespace ringzero::libfabric::detail
