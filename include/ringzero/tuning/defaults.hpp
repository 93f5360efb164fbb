// Every transport's built-in tuning, in one place, each with where its figures came from. A
// transport reports one of these from tuning() unless its options or a RINGZERO_TUNING file
// (tuning/tuning_file.hpp, written by `ringzero-perf --tune`) say otherwise; docs/architecture.md
// lists them and a test keeps that list and this one equal.
//
// gamma is the CPU's reduction loop (one core adding floats from memory it just received) where
// the transport reduces on the host; it is a property of the core, not of the network.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

#include "ringzero/tuning/policy.hpp"

namespace ringzero::tuning {

/// A transport's built-in policy and the measurement or hardware figure it stands for.
struct sourced_policy {
  /// The transport, as its tuning_name() spells it where the name is one (a RINGZERO_TUNING
  /// section: "shm", "libfabric:tcp;ofi_rxm").
  std::string_view name;
  policy value;
  std::string_view source;
};

/// A rail's built-in price and where it came from.
struct sourced_rail {
  std::string_view name;
  rail_price value;
  std::string_view source;
};

namespace defaults {

inline constexpr std::size_t KiB = 1024;

/// What a transport that says nothing gets (a test transport, NCCL, which picks its own
/// algorithms and never asks the model).
inline constexpr sourced_policy generic{
    "generic", policy{},
    "nominal: a 5 us, 5 GB/s network; reductions at 10 GB/s. Used where nothing is priced"};

inline constexpr sourced_policy loopback{
    "loopback",
    policy{.alpha = 2e-6, .beta = 1.0 / 8e9, .gamma = 1.0 / 8e9, .chunk_bytes = 256 * KiB},
    "nominal: a message is a mailbox lookup under a mutex and one memcpy at about 8 GB/s"};

inline constexpr sourced_policy shm{
    "shm",
    policy{.alpha = 0.4e-6, .beta = 1.0 / 8e9, .gamma = 1.0 / 12e9, .chunk_bytes = 256 * KiB},
    "set from measurements: a cache line written by one core and polled by another (alpha), "
    "two copies through a cache-resident ring (beta); ringzero-perf --tune fitted 0.344 us and "
    "14 GB/s on 2 ranks (docs/performance.md, Calibrated cost model)"};

/// libfabric, per provider. The smallest chunk sits above each provider's eager protocol (shm
/// injects up to 4 KiB, ofi_rxm sends up to 16 KiB eagerly, efa up to its MTU), so pipelined
/// sends complete only when matched (policy::min_chunk_bytes). Each chunk size keeps alpha a
/// few percent of a chunk's time.
inline constexpr sourced_policy libfabric_shm{
    "libfabric:shm",
    policy{.alpha = 1e-6,
           .beta = 1.0 / 10e9,
           .gamma = 1.0 / 8e9,
           .chunk_bytes = 256 * KiB,
           .min_chunk_bytes = 16 * KiB},
    "measured: fi_pingpong -p shm -e rdm -S all -I 1000 on 2 processes of a 2-core VM "
    "(libfabric 1.17): 8 B 0.25 us, 1 MiB 82 us (12.7 GB/s); ringzero's own isend/irecv 8 B "
    "0.46 us, 1 MiB 123 us (8.5 GB/s)"};

inline constexpr sourced_policy libfabric_tcp{
    "libfabric:tcp;ofi_rxm",
    policy{.alpha = 10e-6,
           .beta = 1.0 / 4.5e9,
           .gamma = 1.0 / 8e9,
           .chunk_bytes = 1024 * KiB,
           .min_chunk_bytes = 64 * KiB},
    "measured on loopback TCP: fi_pingpong -p \"tcp;ofi_rxm\" 8 B 6.9 us, 1 MiB 0.18 ms "
    "(5.8 GB/s); ringzero's own 8 B 7.1 us, 1 MiB 0.23 ms (4.5 GB/s). Between hosts the NIC "
    "sets beta"};

inline constexpr sourced_policy libfabric_efa{
    "libfabric:efa",
    policy{.alpha = 15e-6,
           .beta = 1.0 / 12.5e9,
           .gamma = 1.0 / 8e9,
           .chunk_bytes = 1024 * KiB,
           .min_chunk_bytes = 64 * KiB},
    "nominal, not measured here: EFA's ~15 us and 100 Gb/s per NIC"};

inline constexpr sourced_policy libfabric_verbs{
    "libfabric:verbs",
    policy{.alpha = 2e-6,
           .beta = 1.0 / 25e9,
           .gamma = 1.0 / 8e9,
           .chunk_bytes = 1024 * KiB,
           .min_chunk_bytes = 64 * KiB},
    "nominal, not measured here: InfiniBand HDR's ~2 us and 200 Gb/s"};

inline constexpr sourced_policy libfabric_sockets{
    "libfabric:sockets",
    policy{.alpha = 30e-6,
           .beta = 1.0 / 2e9,
           .gamma = 1.0 / 8e9,
           .chunk_bytes = 512 * KiB,
           .min_chunk_bytes = 64 * KiB},
    "nominal: the sockets provider's single progress thread, a few times slower than "
    "tcp;ofi_rxm on loopback"};

inline constexpr sourced_policy libfabric_other{"libfabric",
                                                policy{.alpha = 10e-6,
                                                       .beta = 1.0 / 5e9,
                                                       .gamma = 1.0 / 8e9,
                                                       .chunk_bytes = 512 * KiB,
                                                       .min_chunk_bytes = 64 * KiB},
                                                "nominal: a provider ringzero has no figures for"};

/// The socket transport: per message, and the price of each of its rails (over_rails()).
inline constexpr sourced_policy socket{
    "socket",
    policy{.alpha = 25e-6,
           .beta = 1.0 / 1.25e9,
           .gamma = 1.0 / 10e9,
           .chunk_bytes = 1024 * KiB,
           .min_chunk_bytes = 128 * KiB},
    "nominal: one 10 Gb/s Ethernet rail, kernel TCP both ends; beta is replaced by the rails' "
    "sum (socket_rail). The smallest chunk sits above the sends that complete once copied "
    "(detail::delivery::limits::copy_bytes, 64 KiB)"};

inline constexpr sourced_rail socket_rail{
    "socket rail", rail_price{.alpha = 25e-6, .beta = 1.0 / 1.25e9},
    "nominal: a 10 Gb/s Ethernet interface (1.25 GB/s) and a kernel TCP one-way message"};

/// Every built-in policy, for listings and the check that docs/architecture.md shows them all.
inline constexpr std::array all{generic,         loopback,          shm,
                                libfabric_shm,   libfabric_tcp,     libfabric_efa,
                                libfabric_verbs, libfabric_sockets, libfabric_other,
                                socket};

}  // namespace defaults

/// The libfabric provider's built-in policy: by exact name, "tcp..." and "verbs..." by prefix
/// (tcp;ofi_rxm, verbs;ofi_rxm), else the nominal figures for an unknown provider.
[[nodiscard]] constexpr const sourced_policy& libfabric_default(std::string_view provider) {
  if (provider == "shm") return defaults::libfabric_shm;
  if (provider.starts_with("tcp")) return defaults::libfabric_tcp;
  if (provider == "efa") return defaults::libfabric_efa;
  if (provider.starts_with("verbs")) return defaults::libfabric_verbs;
  if (provider == "sockets") return defaults::libfabric_sockets;
  return defaults::libfabric_other;
}

}  // namespace ringzero::tuning
