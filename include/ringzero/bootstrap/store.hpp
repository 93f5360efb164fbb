// The key-value store ranks rendezvous through: endpoint names, NCCL unique ids and
// sub-communicator membership are published with set() and read with get(). Every blocking
// call honours the store's deadline and fails with timeout_error naming the missing key.
// Implementations: tcp_store (tcp_store.hpp), file_store (file_store.hpp); make_store
// (rendezvous.hpp) picks one from the environment.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/core.h>

#include "ringzero/error.hpp"

namespace ringzero::bootstrap {

class store {
 public:
  virtual ~store() = default;
  /// Publishes value under key (overwriting).
  virtual void set(std::string_view key, std::span<const std::byte> value) = 0;
  /// Returns the value under key, waiting until some rank sets it or the deadline passes.
  [[nodiscard]] virtual std::vector<std::byte> get(std::string_view key) = 0;
  /// Atomically adds delta to the integer under key (0 if absent) and returns the new value.
  /// The integer is kept as decimal text, so get() on a counter returns e.g. "3".
  virtual std::int64_t add(std::string_view key, std::int64_t delta) = 0;
  /// Waits until every key exists.
  virtual void wait(std::span<const std::string> keys) = 0;

  /// add(), set() and get() that give up after `limit` where the store's own deadline is
  /// later: for calls made once something failed, which must not wait long on a store that
  /// may be gone with the failed rank. A store whose calls never wait long keeps the defaults.
  virtual std::int64_t add_within(std::string_view key, std::int64_t delta,
                                  std::chrono::nanoseconds /*limit*/) {
    return add(key, delta);
  }
  virtual void set_within(std::string_view key, std::span<const std::byte> value,
                          std::chrono::nanoseconds /*limit*/) {
    set(key, value);
  }
  [[nodiscard]] virtual std::vector<std::byte> get_within(std::string_view key,
                                                          std::chrono::nanoseconds /*limit*/) {
    return get(key);
  }
  /// `ranks` more ranks are known dead and will never close their store: a store that waits
  /// at close for every rank (tcp_store's server) stops waiting for them.
  virtual void excuse(int /*ranks*/) {}
  /// This process ends now without running destructors: what the store's destructor would tell
  /// the others is told now (within `limit`), and a store served here waits for the other
  /// ranks to finish with it for at most `limit`.
  virtual void farewell(std::chrono::nanoseconds /*limit*/) noexcept {}

  void set_string(std::string_view key, std::string_view value) {
    set(key, std::as_bytes(std::span<const char>(value.data(), value.size())));
  }
  [[nodiscard]] std::string get_string(std::string_view key) {
    const std::vector<std::byte> v = get(key);
    return std::string(reinterpret_cast<const char*>(v.data()), v.size());
  }

  /// Returns once `size` callers passed the barrier `name`. The same name may be used again
  /// for the next barrier: arrivals are counted, and every `size` of them open one generation.
  void barrier(std::string_view name, int size) {
    if (size < 1) throw invalid_argument(fmt::format("barrier '{}': size {} < 1", name, size));
    const std::int64_t arrived = add(fmt::format("{}/arrived", name), 1);
    const std::int64_t generation = (arrived - 1) / size;
    const std::string open = fmt::format("{}/open/{}", name, generation);
    if (arrived % size == 0) set_string(open, "1");
    const std::string keys[] = {open};
    wait(keys);
  }
};

}  // namespace ringzero::bootstrap
