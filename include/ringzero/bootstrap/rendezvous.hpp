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
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

namespace detail {

[[nodiscard]] inline std::unique_ptr<store> open_store(const launch_info& info,
                                                       std::chrono::nanoseconds timeout) {
  const std::string kind = ringzero::detail::getenv_str("RINGZERO_STORE").value_or("tcp");
  if (kind == "tcp") {
    const std::string bind = ringzero::detail::getenv_str("RINGZERO_SOCKET_IFNAME").value_or("");
    const std::uint64_t generation = detail::next_generation(info);
    auto s = std::make_unique<tcp_store>(info.master_addr, info.master_port, info.rank == 0,
                                         info.world_size, info.token, timeout, bind, generation,
                                         tcp_store_limits::from_env());
    // Each rank claims its number: two processes given the same RANK would otherwise both wait
    // for the rank nobody was given, and time out naming a key instead of the mistake.
    if (const std::int64_t claims =
            s->add(fmt::format("ringzero/rank-claim/{}/{}", generation, info.rank), 1);
        claims > 1)
      throw bootstrap_error(fmt::format(
          "{} processes of this job were given rank {} (RANK, or its launcher's variable): each "
          "rank of the {} must be started once",
          claims, info.rank, info.world_size));
    return s;
  }
  if (kind.starts_with("file:") && kind.size() > 5) {
    const std::filesystem::path dir(kind.substr(5));
    return std::make_unique<file_store>(dir / fmt::format("job-{:016x}", detail::fnv1a(info.token)),
                                        timeout);
  }
  throw invalid_argument(
      fmt::format("RINGZERO_STORE='{}' is neither 'tcp' nor 'file:DIRECTORY'", kind));
}

// Stores that communicators keep open for their lifetime (shared_store), by job and address.
struct shared_stores {
  std::mutex mutex;
  std::map<std::string, std::weak_ptr<store>> open;

  [[nodiscard]] static shared_stores& get() {
    static shared_stores s;
    return s;
  }
  [[nodiscard]] static std::string key(const launch_info& info) {
    return fmt::format("{}|{}|{}|{}",
                       ringzero::detail::getenv_str("RINGZERO_STORE").value_or("tcp"),
                       info.master_addr, info.master_port, info.token);
  }
};

// Forwards to a store that a communicator keeps open.
class borrowed_store final : public store {
 public:
  explicit borrowed_store(std::shared_ptr<store> s) : s_(std::move(s)) {}
  void set(std::string_view key, std::span<const std::byte> value) override { s_->set(key, value); }
  [[nodiscard]] std::vector<std::byte> get(std::string_view key) override { return s_->get(key); }
  std::int64_t add(std::string_view key, std::int64_t delta) override {
    return s_->add(key, delta);
  }
  void wait(std::span<const std::string> keys) override { s_->wait(keys); }
  std::int64_t add_within(std::string_view key, std::int64_t delta,
                          std::chrono::nanoseconds limit) override {
    return s_->add_within(key, delta, limit);
  }
  void set_within(std::string_view key, std::span<const std::byte> value,
                  std::chrono::nanoseconds limit) override {
    s_->set_within(key, value, limit);
  }
  [[nodiscard]] std::vector<std::byte> get_within(std::string_view key,
                                                  std::chrono::nanoseconds limit) override {
    return s_->get_within(key, limit);
  }
  void excuse(int ranks) override { s_->excuse(ranks); }
  void farewell(std::chrono::nanoseconds limit) noexcept override { s_->farewell(limit); }

 private:
  std::shared_ptr<store> s_;
};

}  // namespace detail

/// Opens this rank's store as RINGZERO_STORE says (see above). Blocks until the store is
/// reachable (at most `timeout`); rank 0 starts the TCP server. While a communicator keeps
/// the job's store open (shared_store), this returns a handle to that one: rank 0 could not
/// serve a second store on the same port.
[[nodiscard]] inline std::unique_ptr<store> make_store(
    const launch_info& info, std::chrono::nanoseconds timeout = ringzero::detail::env_timeout()) {
  {
    auto& reg = detail::shared_stores::get();
    std::lock_guard lock(reg.mutex);
    if (auto it = reg.open.find(detail::shared_stores::key(info)); it != reg.open.end())
      if (auto live = it->second.lock()) return std::make_unique<detail::borrowed_store>(live);
  }
  return detail::open_store(info, timeout);
}

/// The job's store for a communicator that keeps it open for its lifetime (the libfabric
/// transport does, so that ranks can agree on which rank failed first): one store per job
/// and address while any holder lives, so every rank must keep its holders alive alike.
[[nodiscard]] inline std::shared_ptr<store> shared_store(
    const launch_info& info, std::chrono::nanoseconds timeout = ringzero::detail::env_timeout()) {
  auto& reg = detail::shared_stores::get();
  std::lock_guard lock(reg.mutex);
  auto& slot = reg.open[detail::shared_stores::key(info)];
  if (auto live = slot.lock()) return live;
  std::shared_ptr<store> s = detail::open_store(info, timeout);
  slot = s;
  return s;
}

}  // namespace ringzero::bootstrap
