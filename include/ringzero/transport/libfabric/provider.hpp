// Which provider a communicator uses. The choice is made on rank 0 and published through the
// store, so every rank opens the same provider and reports the same constants
// (tuning::libfabric_default: the cost model must pick the same algorithm on every rank without
// talking).
#pragma once

#include <string>
#include <string_view>

#include "ringzero/detail/env.hpp"
#include "ringzero/transport/libfabric/rail.hpp"

namespace ringzero::libfabric::detail {

/// FI_PROVIDER when it names one provider ("shm", "tcp;ofi_rxm"); empty for lists and
/// exclusions ("tcp,shm", "^psm3"), which libfabric applies by itself.
[[nodiscard]] inline std::string env_provider() {
  auto v = ringzero::detail::getenv_str("FI_PROVIDER");
  if (!v || v->find_first_of(",^") != std::string::npos) return {};
  return *v;
}

[[nodiscard]] inline bool provider_available(const char* name) {
  return static_cast<bool>(query(name));
}

/// The requested provider, else FI_PROVIDER, else efa where present, else shm when every rank
/// runs on this host, else tcp;ofi_rxm. Empty: let libfabric choose under FI_PROVIDER's list.
[[nodiscard]] inline std::string choose_provider(std::string_view requested, bool one_host) {
  if (!requested.empty()) return std::string(requested);
  if (ringzero::detail::getenv_str("FI_PROVIDER")) return env_provider();
  if (provider_available("efa")) return "efa";
  if (one_host && provider_available("shm")) return "shm";
  return "tcp;ofi_rxm";
}

}  // namespace ringzero::libfabric::detail
