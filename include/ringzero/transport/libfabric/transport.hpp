// The libfabric transport itself (ringzero/transport/libfabric.hpp says what it does and gives its
// communicator): setup, messaging, rails and the engine they share.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/bootstrap/tcp_store.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/interfaces.hpp"
#include "ringzero/transport/detail/pci_topology.hpp"
#include "ringzero/transport/detail/request.hpp"
#include "ringzero/transport/libfabric/engine.hpp"
#include "ringzero/transport/libfabric/provider.hpp"
#include "ringzero/transport/libfabric/rendezvous.hpp"
#include "ringzero/transport/libfabric/signals.hpp"
#include "ringzero/transport/shm/transport.hpp"
#include "ringzero/tuning/defaults.hpp"

namespace ringzero::libfabric {

struct options {
  /// A provider name as fi_info prints it ("shm", "tcp;ofi_rxm", "efa"); empty: see above.
  std::string provider{};
  /// 0: RINGZERO_TIMEOUT (default 300 s). Bounds every collective and the rendezvous.
  std::chrono::nanoseconds timeout{0};
  /// The cost model's constants; unset: the provider's (tuning::libfabric_default), over as many
  /// rails as are open (tuning::over_rails). Must be the
  /// same on every rank.
  std::optional<ringzero::tuning::policy> tuning{};
  /// Register buffers and pass descriptors even where the provider does not ask for them
  /// (FI_MR_LOCAL unset).
  bool register_memory = false;
  /// Messages will also come from and go to CUDA device memory: the provider must report
  /// FI_HMEM (fi_getinfo is asked for it, with FI_MR_HMEM), else opening fails with unsupported
  /// naming the provider. A field rather than an environment variable, because only a program
  /// written for device buffers can use it, and asking for FI_HMEM rules out
  /// providers (tcp, sockets) a host-memory program runs on. Must be the same on every rank.
  bool device_memory = false;
  /// One rail per entry: the NICs, as the provider names its domains (`fi_info -p tcp` prints
  /// interfaces, `fi_info -p efa` devices); messages spread over them by tag. Empty:
  /// RINGZERO_RAILS (ignored with shm, which uses no NIC), else one rail on the provider's best
  /// candidate. {"auto"} (or RINGZERO_RAILS=auto): every NIC the provider lists that every rank
  /// can use (detail::discover_rails). Must name as many rails on every rank.
  std::vector<std::string> rails{};
  /// With several rails, a message of at least this many bytes is cut into one piece per rail
  /// instead of travelling whole on its tag's rail, so that one large message (a ring step of
  /// two ranks, a broadcast) uses every NIC. Below it, a piece's own cost (a post and a
  /// completion per rail) outweighs the bandwidth it adds. RINGZERO_STRIPE_BYTES, when set,
  /// replaces it. Must be the same on every rank.
  std::size_t stripe_bytes = std::size_t{128} << 10;
  /// Pieces in proportion to the rails' link speeds (the provider's or the kernel's figure,
  /// the lower of the two ends'); false, RINGZERO_RAIL_SHARES=equal, or a speed unknown at
  /// either end: equal pieces.
  bool weigh_rails = true;
  /// The PCI address of the GPU this rank's device buffers are on, as cudaDeviceGetPCIBusId or
  /// `nvidia-smi --query-gpu=pci.bus_id` print it ("0000:53:00.0"). With rails {"auto"}, each
  /// rank then drives the NICs nearest that GPU in the host's PCIe tree (sysfs), as NCCL does:
  /// on p4d the one EFA device behind the GPU's PCIe switch, on p5 its four. Every rank drives
  /// as many (the fewest any rank has nearest); where a rank names no GPU, sysfs places none, or
  /// the rails are interfaces a subnet each, every rank drives every NIC found. Empty:
  /// RINGZERO_GPU_BUS_ID, else no GPU.
  std::string gpu_bus_id{};
};

using from_env_options = options;

/// Messaging over FI_EP_RDM endpoints, one per rail. Peers are job ranks; the engine is shared by
/// every communicator split from the world, each under its own id in the tag's top bits.
class transport {
 public:
  using from_env_options = libfabric::options;
  /// The ranks of one host also share memory: the hierarchical algorithm runs its node level
  /// over the native shm transport, set up over this one (RINGZERO_NODE_SHM=0 keeps it here).
  using node_transport = ringzero::shm::transport;

  /// Handle to one posted send or receive. Destroying it before completion cancels the
  /// operation and waits for the provider to release the buffer.
  using request =
      ringzero::detail::transport_request<transport, detail::engine, detail::op_context*>;

  /// Joins the job the environment describes (torchrun, Slurm, Open MPI or ringzero-run
  /// variables, see bootstrap/environment.hpp): opens the store (rank 0 serves the TCP store),
  /// picks the provider, opens the rails, exchanges addresses, and tags this process's log
  /// lines with its rank. The store stays open while the transport lives (bootstrap::
  /// shared_store): when a rank dies, the survivors agree through it on which one died first,
  /// so that every error names the same culprit. Rank 0's transport, which serves it, closes
  /// once every other rank closed theirs (or the timeout passed; ranks known dead excepted).
  [[nodiscard]] static transport from_env(const from_env_options& opt = {}) {
    const bootstrap::launch_info info = bootstrap::detect_launch();
    log::detail::process_rank().store(info.rank);
    const auto timeout = opt.timeout.count() > 0 ? opt.timeout : ringzero::detail::env_timeout();
    return transport(bootstrap::shared_store(info, timeout), info.rank, info.world_size, opt);
  }

  /// Collective over `size` processes that share `store`: rank r of size. The store is only
  /// used while constructing; it must be the same logical store on every rank.
  transport(bootstrap::store& store, int rank, int size, const options& opt = {})
      : transport(store, nullptr, rank, size, opt) {}

  /// As above, and the transport keeps `store` open for the ranks to agree on which rank failed
  /// first (see from_env()).
  transport(std::shared_ptr<bootstrap::store> store, int rank, int size, const options& opt = {})
      : transport(*store, store, rank, size, opt) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }

  [[nodiscard]] int size() const noexcept { return static_cast<int>(hosts_.size()); }
  [[nodiscard]] const ringzero::tuning::policy& tuning() const noexcept { return tuning_; }
  /// The section of a RINGZERO_TUNING file that applies here: "libfabric:" and the provider.
  [[nodiscard]] std::string tuning_name() const { return "libfabric:" + provider(); }
  [[nodiscard]] std::chrono::nanoseconds default_timeout() const noexcept { return timeout_; }
  [[nodiscard]] const std::string& host_of(int r) const noexcept {
    return hosts_[static_cast<std::size_t>(r)];
  }
  [[nodiscard]] int comm_id_bits() const noexcept { return engine_->comm_id_bits(); }
  /// The provider every rank uses, as fi_info names it.
  [[nodiscard]] const std::string& provider() const noexcept { return engine_->provider(); }
  /// The shared engine, for diagnostics (rails, registrations, provider limits).
  [[nodiscard]] const detail::engine& engine() const noexcept { return *engine_; }
  /// For tests, with several rails: gives rail `r` up toward every rank, as a link found down
  /// would; its messages move to the rails left (the peers learn it and do the same).
  void fail_rail(std::size_t r, const std::string& why) { engine_->fail_rail(r, why); }

  /// Drops cached registrations of [p, p+n): call before unmapping memory that collectives
  /// used, when the provider registers memory (FI_MR_LOCAL, or options::register_memory), and
  /// before freeing a device buffer given to register_device_buffer.
  void forget_memory(const void* p, std::size_t n) { engine_->forget_memory(p, n); }

  /// Declares [p, p+n) CUDA memory of device `device` (its ordinal) and registers it with the
  /// provider (fi_mr_regattr, FI_HMEM_CUDA): messages from and into it then move without a
  /// host copy. The caller declares it because telling device from host pointers needs the CUDA
  /// runtime, which this header does not include (it must compile and link without CUDA);
  /// the collectives, given device buffers, call this for them (they ask the CUDA runtime through
  /// kernels/device_runtime.hpp).
  /// Registering pins the memory, tens of microseconds or more: register an allocation once,
  /// and call forget_memory(p, n) before freeing it. `id`, the allocation's
  /// (kernels::device_allocation; 0 where unknown), tells a new allocation at a freed one's
  /// addresses from the old: it is registered anew, never through the old registration. Throws
  /// unsupported when the transport was opened without options::device_memory or the provider
  /// cannot register CUDA memory.
  void register_device_buffer(const void* p, std::size_t n, int device, std::uint64_t id = 0) {
    engine_->register_device(p, n, device, id);
  }
  /// Opened with options::device_memory, on a provider that reports FI_HMEM.
  [[nodiscard]] bool device_memory() const noexcept { return engine_->hmem(); }
  /// Why device buffers are refused when device_memory() is false, naming the provider.
  [[nodiscard]] std::string device_memory_refusal() const {
    return fmt::format(
        "libfabric provider '{}' was opened for host memory only: set "
        "libfabric::options::device_memory to pass CUDA device buffers",
        provider());
  }

  [[nodiscard]] request isend(int peer, tag_t tag, std::span<const std::byte> data) {
    request r;
    r.eng_ = engine_;
    r.op_ = engine_->send(peer, peer, tag, data);
    r.done_ = r.op_ == nullptr;
    return r;
  }

  [[nodiscard]] request irecv(int peer, tag_t tag, std::span<std::byte> data) {
    request r;
    r.eng_ = engine_;
    r.op_ = engine_->recv(peer, peer, tag, data);
    return r;
  }

  /// Reads completions; true once r finished. Throws peer_error if the peer is gone or the
  /// operation failed, transport_error on a size mismatch or a provider failure.
  [[nodiscard]] bool test(request& r) {
    if (r.done_) return true;
    if (!r.op_) throw invalid_argument("test() on an empty request");
    // Once the endpoint reports an outcome, finished or thrown, it has taken the context back.
    auto* c = std::exchange(r.op_, nullptr);
    if (!engine_->test(c)) {
      r.op_ = c;
      return false;
    }
    r.done_ = true;
    return true;
  }

  void progress() { engine_->progress(); }

  /// The rank the watchdog found dead, or -1 (see communicator::failed_rank()).
  [[nodiscard]] int failed_rank() const noexcept { return engine_->failed_rank(); }
  /// The ranks on this host the watchdog finds stopped (SIGSTOP, a debugger): alive, so not
  /// failed, but a wait on them can only time out (see communicator::stopped_rank()).
  [[nodiscard]] std::vector<int> stopped_ranks() const { return engine_->stopped_ranks(); }

  /// Fails every wait on this transport, and so on every communicator over it (the world and
  /// those split from it), with peer_error carrying `why`: now, including waits blocked in
  /// another thread, and every call after. Thread-safe.
  void abort(const std::string& why) { engine_->abort(why); }
  /// Why abort() was called, once it was: communicator::check_usable refuses every call then,
  /// even one with nothing to send, which never reaches a wait.
  [[nodiscard]] std::optional<std::string> abort_reason() const {
    if (!engine_->aborted()) return std::nullopt;
    return engine_->abort_reason();
  }

 private:
  transport(bootstrap::store& store, std::shared_ptr<bootstrap::store> kept, int rank, int size,
            const options& opt)
      : rank_(rank),
        timeout_(opt.timeout.count() > 0 ? opt.timeout : ringzero::detail::env_timeout()) {
    if (size < 1 || rank < 0 || rank >= size)
      throw invalid_argument(
          fmt::format("libfabric communicator: rank {} is not in [0, {})", rank, size));
    const bool served_by_rank0 = dynamic_cast<const bootstrap::tcp_store*>(kept.get()) != nullptr;
    std::optional<std::vector<std::string>> env_rails;
    if (opt.rails.empty()) env_rails = ringzero::detail::getenv_list("RINGZERO_RAILS");
    auto world = detail::rendezvous(
        store, rank, size, opt.provider,
        {.provider = {},  // the rendezvous agrees on it
         .rails = env_rails ? *env_rails : opt.rails,
         .near = near_address(),
         .register_always = opt.register_memory,
         .one_host = true,  // the rendezvous finds out
         .timeout = timeout_,
         .device_memory = opt.device_memory,
         .stripe_bytes = ringzero::detail::stripe_bytes_from_env(opt.stripe_bytes),
         .weigh_rails = opt.weigh_rails && ringzero::detail::weigh_rails_from_env(),
         .gpu_bus_id = gpu_bus_id(opt)},
        env_rails.has_value(), std::move(kept), served_by_rank0);
    engine_ = std::move(world.eng);
    hosts_ = std::move(world.hosts);
    if (opt.tuning) {
      tuning_ = *opt.tuning;
    } else {
      // Several rails carry a striped message at their summed rate: priced as the socket
      // transport prices its rails, each rail at the provider's own figures.
      const auto base = ringzero::tuning::libfabric_default(engine_->provider()).value;
      const std::vector<ringzero::tuning::rail_price> prices(
          engine_->rails(), {.alpha = base.alpha, .beta = base.beta});
      tuning_ = ringzero::tuning::over_rails(base, prices);
    }
    log::info("libfabric: rank {} of {} on {} ({})", rank, size, engine_->provider(),
              hosts_[static_cast<std::size_t>(rank)]);
  }

  /// The address this rank rendezvouses from (the route to MASTER_ADDR, 127.0.0.1 without
  /// one), where its endpoint should be too unless FI_TCP_IFACE or the rails name the NIC.
  [[nodiscard]] static std::optional<in_addr> near_address() {
    if (ringzero::detail::getenv_str("FI_TCP_IFACE")) return std::nullopt;
    return ringzero::detail::route_source(
        ringzero::detail::getenv_str("MASTER_ADDR").value_or("127.0.0.1"));
  }

  /// options::gpu_bus_id, else RINGZERO_GPU_BUS_ID, checked here so that a misspelt one is an
  /// error on every rank before the rendezvous, not on some ranks within it.
  [[nodiscard]] static std::string gpu_bus_id(const options& opt) {
    const bool from_env = opt.gpu_bus_id.empty();
    const std::string id = from_env
                               ? ringzero::detail::getenv_str("RINGZERO_GPU_BUS_ID").value_or("")
                               : opt.gpu_bus_id;
    if (id.empty()) return id;
    return ringzero::detail::normalize_bus_id(
        id, from_env ? "RINGZERO_GPU_BUS_ID" : "libfabric::options::gpu_bus_id");
  }

  std::shared_ptr<detail::engine> engine_;
  std::vector<std::string> hosts_;  ///< host name of every rank
  int rank_ = 0;
  ringzero::tuning::policy tuning_{};
  std::chrono::nanoseconds timeout_{0};
};

}  // namespace ringzero::libfabric
