// Which provider a communicator uses, and the cost-model constants that go with it. The
// choice is made on rank 0 and published through the store, so every rank opens the same
// provider and reports the same constants (the cost model must pick the same algorithm on
// every rank without talking).
#pragma once

#include <string>
#include <string_view>

#include "ringzero/detail/env.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/libfabric/endpoint.hpp"

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

/// alpha (s per message), beta (s per byte), gamma (s per byte reduced) and the pipeline chunk
/// per provider. gamma is the CPU reduction loop, the same for all.
///
/// shm and tcp;ofi_rxm: half round trips between two processes on a 2-core Debian 12 VM
/// (libfabric 1.17, load average 1.5), from
///   fi_pingpong -p shm -e rdm -S all -I 1000 &  fi_pingpong -p shm -e rdm -S all -I 1000 localhost
///   fi_pingpong -p "tcp;ofi_rxm" -e rdm -S all -I 1000 &  (the same) localhost
/// and from a ping-pong of this transport's isend/irecv/test:
///   shm  fi_pingpong 8 B 0.25 us, 4 KiB 0.58 us, 64 KiB 6.5 us, 256 KiB 21 us (12.7 GB/s),
///        1 MiB 82 us (12.7 GB/s), 4 MiB 0.65 ms (6.4 GB/s); ringzero 8 B 0.46 us,
///        1 MiB 123 us (8.5 GB/s)                                -> alpha 1 us, beta 1 / 10 GB/s
///   tcp  fi_pingpong 8 B 6.9 us, 4 KiB 9.2 us, 64 KiB 48 us, 256 KiB 62 us (4.3 GB/s),
///        1 MiB 0.18 ms (5.8 GB/s), 4 MiB 0.87 ms (4.8 GB/s); ringzero 8 B 7.1 us,
///        64 KiB 53 us, 1 MiB 0.23 ms (4.5 GB/s)                 -> alpha 10 us, beta 1 / 4.5 GB/s
/// (Loopback TCP: across hosts the NIC sets beta.) With other jobs on the cores every figure
/// was 2-10 times worse.
/// Each chunk size keeps alpha a few percent of a chunk's time. efa and verbs are nominal
/// figures for their hardware (EFA: ~15 us, 100 Gb/s per NIC; InfiniBand HDR: ~2 us,
/// 200 Gb/s), not measured here.
///
/// The smallest chunk sits above each provider's eager protocol (shm injects up to 4 KiB,
/// ofi_rxm sends up to 16 KiB eagerly, efa up to its MTU), so pipelined sends complete only
/// when matched (see cost_params::min_chunk_bytes).
[[nodiscard]] inline cost_params provider_cost(std::string_view provider) {
  constexpr double gamma = 1.0 / 8e9;
  constexpr std::size_t KiB = 1024;
  if (provider == "shm") return {1e-6, 1.0 / 10e9, gamma, 256 * KiB, 16 * KiB};
  if (provider.starts_with("tcp")) return {10e-6, 1.0 / 4.5e9, gamma, 1024 * KiB, 64 * KiB};
  if (provider == "efa") return {15e-6, 1.0 / 12.5e9, gamma, 1024 * KiB, 64 * KiB};
  if (provider.starts_with("verbs")) return {2e-6, 1.0 / 25e9, gamma, 1024 * KiB, 64 * KiB};
  if (provider == "sockets") return {30e-6, 1.0 / 2e9, gamma, 512 * KiB, 64 * KiB};
  return {10e-6, 1.0 / 5e9, gamma, 512 * KiB, 64 * KiB};
}

}  // namespace ringzero::libfabric::detail
