// The libfabric transport's engine, shared by a communicator and every sub-communicator split
// from it: the transport kit's rail engine (transport/detail/rail_engine.hpp: operations, flow
// control, striping, reliable delivery and failover over several rails) over libfabric rails
// (rail.hpp, one per NIC), and what only libfabric adds: the provider every rail shares and its
// limits, and device memory registered on every rail. The rails are opened and connected by the
// rendezvous (rendezvous.hpp), the transport's handshake.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/delivery.hpp"
#include "ringzero/transport/detail/rail_engine.hpp"
#include "ringzero/transport/libfabric/rail.hpp"

namespace ringzero::libfabric::detail {

namespace delivery = ringzero::detail::delivery;

/// What the rails of one engine share, read once they are open (rendezvous.hpp, open_rails).
struct fabric_facts {
  std::string provider;
  std::uint64_t mr_mode = 0;
  std::size_t inject_size = 0;
  bool registers = false;
  /// Every rail reports FI_HMEM (and device memory was asked for).
  bool hmem = false;
  /// The fewest tag bits any rail's provider matches.
  int tag_width = 64;
  /// Several rails: pieces are numbered in tag bits, so communicator ids get fewer.
  bool pieces_in_tag = false;
};

class engine : public ringzero::detail::rail_engine<rail> {
 public:
  using base = ringzero::detail::rail_engine<rail>;

  engine(ringzero::detail::rail_engine_config cfg, std::vector<std::unique_ptr<rail>> rails,
         fabric_facts facts)
      : base(std::move(cfg), std::move(rails)), facts_(std::move(facts)) {}

  [[nodiscard]] const std::string& provider() const noexcept { return facts_.provider; }
  /// Tag bits above the algorithm's that every rail's provider matches: room for communicator
  /// ids.
  [[nodiscard]] int comm_id_bits() const noexcept {
    return std::min(
        facts_.tag_width - tag_bits - (facts_.pieces_in_tag ? delivery::limits::piece_bits : 0),
        tag_layout::comm_id_bits);
  }
  [[nodiscard]] int tag_width() const noexcept { return facts_.tag_width; }
  [[nodiscard]] std::uint64_t mr_mode() const noexcept { return facts_.mr_mode; }
  [[nodiscard]] std::size_t inject_size() const noexcept { return facts_.inject_size; }
  [[nodiscard]] bool registers() const noexcept { return facts_.registers; }
  /// Opened for device memory on a provider that reports FI_HMEM. Whether it can register CUDA
  /// memory in particular is known only once it tried: libfabric has no query for the HMEM
  /// interfaces it was built with.
  [[nodiscard]] bool hmem() const noexcept { return facts_.hmem; }
  /// The provider registered CUDA memory at least once (register_device succeeded).
  [[nodiscard]] bool registered_cuda() const {
    return with_rails([&](const auto&) { return registered_cuda_; });
  }
  /// Device ranges declared (each rail registers every one in its own domain).
  [[nodiscard]] std::size_t device_ranges() const {
    return with_rails([](const auto& rails) { return rails.front()->memory().device_ranges(); });
  }
  [[nodiscard]] std::size_t registrations() const {
    return with_rails([](const auto& rails) {
      std::size_t n = 0;
      for (const auto& r : rails) n += r->memory().size();
      return n;
    });
  }

  /// Registers [p, p+n) as memory of CUDA device `device`, in allocation `id` (0: unknown), with
  /// fi_mr_regattr and FI_HMEM_CUDA on every rail (mr_cache::register_device): sends and
  /// receives inside it then pass that registration to the provider.
  /// Throws unsupported when the engine was not opened for device memory or the provider
  /// refuses.
  void register_device(const void* p, std::size_t n, int device, std::uint64_t id = 0) {
    if (n == 0) return;
    if (device < 0)
      throw invalid_argument(fmt::format("CUDA device ordinal {} is negative", device));
    if (!hmem())
      throw unsupported(
          fmt::format("libfabric provider '{}' was opened for host memory only: set "
                      "libfabric::options::device_memory to pass CUDA device buffers",
                      provider()));
    with_rails([&](auto& rails) {
      for (std::size_t i = 0; i < rails.size(); ++i) {
        try {
          rails[i]->memory().register_device(p, n, device, id);
        } catch (...) {
          // All rails or none: a message placed on a rail without it would be refused later.
          for (std::size_t j = 0; j < i; ++j) rails[j]->memory().forget(p, n);
          throw;
        }
      }
      registered_cuda_ = true;
    });
  }
  void forget_memory(const void* p, std::size_t n) {
    with_rails([&](auto& rails) {
      for (auto& r : rails) r->memory().forget(p, n);
    });
  }

 private:
  fabric_facts facts_;
  bool registered_cuda_ = false;  ///< under the engine's lock (with_rails)
};

}  // namespace ringzero::libfabric::detail
