// The store a job's ranks meet in, chosen from the environment. Communicators built "from the
// environment" call this after detect_launch():
//
//   auto info = ringzero::bootstrap::detect_launch();
//   std::shared_ptr<ringzero::bootstrap::store> store = ringzero::bootstrap::make_store(info);
//
// RINGZERO_STORE selects the kind:
//   unset or "tcp"     a tcp_store at info.master_addr:info.master_port, served by rank 0; the
//                      server listens on RINGZERO_SOCKET_IFNAME (an interface name or address)
//                      if set, else as tcp_store decides. Stores opened one after another on
//                      the same address get generations 0, 1, 2, ... so that every rank must
//                      open them in the same order (as it builds its communicators);
//                      RINGZERO_STORE_MAX_* and RINGZERO_STORE_*_TIMEOUT bound what the server
//                      spends on clients (store_limits.hpp);
//   "file:DIRECTORY"   a file_store in DIRECTORY/job-<hash of the job token>, so one shared
//                      directory serves many jobs without them seeing each other's keys.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/file_store.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/bootstrap/tcp_store.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"

namespace ringzero::bootstrap {

namespace detail {

// How many TCP stores this process opened before at that address for that job.
[[nodiscard]] inline std::uint64_t next_generation(const launch_info& info) {
  static std::mutex mutex;
  static std::map<std::string, std::uint64_t> opened;
  std::lock_guard lock(mutex);
  return opened[fmt::format("{}|{}|{}", info.master_addr, info.master_port, info.token)]++;
}

}  // namespace detail

/// Opens this rank's store as RINGZERO_STORE says (see above). Blocks until the store is
/// reachable (at most `timeout`); rank 0 starts the TCP server.
[[nodiscard]] inline std::unique_ptr<store> make_store(
    const launch_info& info, std::chrono::nanoseconds timeout = ringzero::detail::env_timeout()) {
  const std::string kind = ringzero::detail::getenv_str("RINGZERO_STORE").value_or("tcp");
  if (kind == "tcp") {
    const std::string bind = ringzero::detail::getenv_str("RINGZERO_SOCKET_IFNAME").value_or("");
    return std::make_unique<tcp_store>(info.master_addr, info.master_port, info.rank == 0,
                                       info.world_size, info.token, timeout, bind,
                                       detail::next_generation(info), tcp_store_limits::from_env());
  }
  if (kind.starts_with("file:") && kind.size() > 5) {
    const std::filesystem::path dir(kind.substr(5));
    return std::make_unique<file_store>(dir / fmt::format("job-{:016x}", detail::fnv1a(info.token)),
                                        timeout);
  }
  throw invalid_argument(
      fmt::format("RINGZERO_STORE='{}' is neither 'tcp' nor 'file:DIRECTORY'", kind));
}

}  // namespace ringzero::bootstrap
