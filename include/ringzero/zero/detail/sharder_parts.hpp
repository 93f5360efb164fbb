// The sharder's parts (zero/sharder.hpp) built and wired together: the order they are
// constructed in, the configuration's collectives resolved for the shard communicator, the
// buffers' memory space, where the parts' collectives run (the communication thread, or a device
// space's communication stream) and the teardown that waits for them. zero::sharder derives from
// it and keeps only its public calls, each forwarded to the parts; apart from sharder.hpp so that
// the façade reads as the API it is.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/trace.hpp"
#include "ringzero/types.hpp"
#include "ringzero/zero/checkpoint.hpp"
#include "ringzero/zero/detail/buffer_meter.hpp"
#include "ringzero/zero/detail/worker.hpp"
#include "ringzero/zero/device_space.hpp"
#include "ringzero/zero/gradient_reducer.hpp"
#include "ringzero/zero/memory_space.hpp"
#include "ringzero/zero/model_state.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/parameter_cache.hpp"
#include "ringzero/zero/plan.hpp"
#include "ringzero/zero/shard_group.hpp"
#include "ringzero/zero/stage.hpp"
#include "ringzero/zero/state_checkpoint.hpp"
#include "ringzero/zero/step.hpp"
#include "ringzero/zero/zeropp.hpp"

namespace ringzero::zero::detail {

template <class Comm, class P, memory_space Space>
class sharder_parts {
 protected:
  static constexpr bool device = on_device<Space>;

 private:
  [[nodiscard]] static constexpr bool transport_needs_device_memory() noexcept {
    if constexpr (requires { Comm::transport_type::device_memory_only; })
      return Comm::transport_type::device_memory_only;
    else
      return false;
  }

 protected:
  static_assert(device || !transport_needs_device_memory(),
                "this communicator's collectives take GPU memory only (NCCL): compile the "
                "translation unit that creates the sharder with nvcc, which brings the device "
                "space (ringzero/zero/cuda_space.cuh), or name a device space as Space");

  template <class Source>
  void load_from(const Source& source, const std::string& what) {
    if (micro_batches() != 0)
      throw invalid_argument("load: a step is in progress; call it after step()");
    const trace::scope phase(comm_, "checkpoint", state_.optimizer_bytes());
    quiesce();
    const checkpoint_manifest m =
        load_state(shard_runner(), collective_runner(), cfg_, source, state_, steps_);
    if constexpr (device) space_.synchronize();
    log::info("zero: loaded step {} from {} (saved by {} ranks at stage {})", steps_.step_count(),
              what, m.world_size, m.stage);
  }

  /// `cfg` passed check_config. The shard groups come before the configuration's collectives
  /// are resolved: their algorithms are the shard communicator's fixed-order ones.
  sharder_parts(Comm& comm, const model_layout& layout, config cfg)
      : comm_(comm),
        // A device space's streams order the collectives; the host thread only enqueues them.
        worker_(!device && cfg.comm_thread),
        groups_(comm, cfg.shard_group_size),
        cfg_(with_collectives_resolved(std::move(cfg), groups_.shard())),
        stage_(stage_of(cfg_.stage)),
        rank_(comm.rank()),
        world_(comm.size()),
        plan_(layout, groups_.size(), bucket_elements(cfg_), cfg_.alignment),
        space_(memory_of(groups_.shard())),
        state_(plan_, stage_, groups_.shard().rank(), cfg_.optimizer, space_),
        steps_(cfg_, std::is_same_v<P, float16>, groups_.groups()),
        reducer_(make_reducer()),
        cache_(groups_.shard(), plan_, state_.parameters(), weight_gather_options(cfg_),
               cfg_.max_gathered_bytes, worker_, meter_, space_, cfg_.zero_hpz_partition_size) {}

  sharder_parts(const sharder_parts&) = delete;
  sharder_parts& operator=(const sharder_parts&) = delete;

  /// Joins the communication thread first (its queued collectives finish; while unwinding an
  /// exception they are dropped), and on a device space waits for both streams: the queued
  /// work of either uses the buffers the members below hold. A synchronization that fails (a
  /// communicator aborted after a dead peer refuses to wait) still drains both streams before
  /// any buffer is freed: kernels queued on the compute stream would otherwise read memory
  /// handed back to the driver.
  ~sharder_parts() {
    worker_.join();
    if constexpr (device) {
      try {
        space_.synchronize();
      } catch (const std::exception& e) {
        log::warn("zero: the device reported a failure while the sharder closed: {}", e.what());
        space_.drain();
      }
    }
  }

  /// Runs f(comm) on the communication thread, after everything already queued, and returns its
  /// result: how a trainer issues collectives of its own (a loss all_reduce) safely.
  template <class F>
  decltype(auto) run_collective(F&& f) {
    using R = std::invoke_result_t<F&, Comm&>;
    if constexpr (device) {
      // On the communication stream, after everything enqueued there; its collectives run with
      // their own options, which on a stream-ordered backend means the communicator's own
      // stream: the space's communication stream is that stream.
      return space_.run_sync(space_.comm_stream(), [&]() -> R { return f(comm_); });
    } else if constexpr (std::is_void_v<R>) {
      worker_.wait(worker_.submit([&] { f(comm_); }));
    } else {
      std::optional<R> r;
      worker_.wait(worker_.submit([&] { r.emplace(f(comm_)); }));
      return R(std::move(*r));
    }
  }

  // Gradients reduced in the parameter type, or in float (config::reduce_dtype).
  using reducer_type =
      std::variant<gradient_reducer<Comm, P, Space>, gradient_reducer<Comm, float, Space>>;

  [[nodiscard]] reducer_type make_reducer() {
    const config g = gradient_config(cfg_);  // qgZ's wire format on the buckets' collectives
    if (cfg_.reduce_dtype == dtype::float32)
      return reducer_type(std::in_place_index<1>, groups_.shard(), plan_, stage_, g, worker_,
                          meter_, groups_.replicate(), space_);
    return reducer_type(std::in_place_index<0>, groups_.shard(), plan_, stage_, g, worker_, meter_,
                        groups_.replicate(), space_);
  }

  /// cfg with the collectives left automatic (collective_options) resolved to the shard
  /// communicator's fixed-order algorithm; one the caller named is kept.
  [[nodiscard]] static config with_collectives_resolved(config cfg, const Comm& shard) {
    check_zeropp_placement(cfg, device, shard.size());
    const std::pair<collective, ringzero::options*> kinds[] = {
        {collective::all_reduce, &cfg.collectives.all_reduce},
        {collective::reduce_scatter, &cfg.collectives.reduce_scatter},
        {collective::all_gather, &cfg.collectives.all_gather}};
    for (const auto& kind : kinds) {
      const collective c = kind.first;  // a name, not a binding: lambdas (requires) may use it
      ringzero::options* o = kind.second;
      if (o->algorithm != algorithm::automatic) continue;
      if constexpr (requires { shard.fixed_order_algorithm(c); })
        o->algorithm = shard.fixed_order_algorithm(c);
      else
        o->algorithm = algorithm::ring;
    }
    return cfg;
  }

  /// The buffers' space: the communicator's choice where Space is the one it chooses, else a
  /// Space of its own.
  [[nodiscard]] static Space memory_of(Comm& shard) {
    if constexpr (std::is_same_v<Space, memory_space_t<Comm>>)
      return memory_space_for(shard);
    else
      return Space{};
  }

  [[nodiscard]] int micro_batches() const {
    return std::visit([](const auto& r) { return r.micro_batches(); }, reducer_);
  }

  static std::size_t bucket_elements(const config& cfg) noexcept {
    return cfg.bucket_bytes == 0 ? 0 : std::max<std::size_t>(1, cfg.bucket_bytes / sizeof(P));
  }

  [[nodiscard]] const param_info& param(int id, const char* what) const {
    if (id < 0 || static_cast<std::size_t>(id) >= plan_.params().size())
      throw invalid_argument(
          fmt::format("{}: parameter id {} of {}", what, id, plan_.params().size()));
    return plan_.params()[static_cast<std::size_t>(id)];
  }

  /// Waits for queued work and drops gathered buckets, before touching the weights directly.
  void quiesce() {
    worker_.drain();
    if constexpr (device) space_.synchronize();
    if (stage_.sharded_parameters) {
      if (cache_.any_held())
        throw invalid_argument("zero: a gathered handle is still alive; release it first");
      cache_.evict_unreferenced();
    }
  }

  /// run_collective as a callable, for the checkpoint steps that take one.
  [[nodiscard]] auto collective_runner() {
    // this-> spelled out: Clang takes an unqualified call in a generic lambda for one that does
    // not use the capture.
    return [this](auto&& f) -> decltype(auto) {
      return this->run_collective(std::forward<decltype(f)>(f));
    };
  }

  /// The same over the shard group, for everything that is collective over the ranks the state
  /// is sharded over.
  [[nodiscard]] auto shard_runner() {
    return [this](auto&& f) -> decltype(auto) {
      return run_collective([&](Comm&) -> decltype(auto) { return f(groups_.shard()); });
    };
  }

  /// The same over the replicate communicator (hybrid sharding only).
  [[nodiscard]] auto replicate_runner() {
    return [this](auto&& f) -> decltype(auto) {
      return run_collective([&](Comm&) -> decltype(auto) { return f(*groups_.replicate()); });
    };
  }

  // Construction order: the worker first, so that everything handed its address finds it
  // built; ~sharder_parts joins it before any member goes. The shard groups before the
  // configuration, whose collectives they resolve; the plan before everything sized by it.
  Comm& comm_;
  detail::worker worker_;
  shard_groups<Comm> groups_;
  config cfg_;
  const stage_layout& stage_;
  int rank_;
  int world_;
  partition_plan plan_;
  Space space_;
  model_state<P, Space> state_;
  stepper steps_;
  detail::buffer_meter meter_;
  reducer_type reducer_;
  parameter_cache<Comm, P, Space> cache_;
};

}  // namespace ringzero::zero::detail
