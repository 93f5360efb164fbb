// The ZeRO sharder: data-parallel training where each rank keeps only 1/N of the model state.
//
//   zero::config cfg{.stage = 2, .optimizer = {.lr = 1e-3f}, .max_grad_norm = 1.0f};
//   zero::sharder<comm_t, bfloat16> shd(comm, layout, cfg);     // comm_t: any communicator
//   for (int p = 0; p < n_params; ++p) shd.set_parameter(p, initial_values[p]);
//   for (step...) {
//     for (layer l = 0..L-1) { auto w = shd.gather(l); forward(w.param(...)); }
//     for (layer l = L-1..0) { auto w = shd.gather(l, zero::pass::backward); ...;
//                              shd.add_grad(p, grad_of_p); }
//     shd.end_micro_batch();
//     auto r = shd.step();   // r.skipped, r.grad_norm
//   }
//
// What each rank holds, for Ψ parameters of a 16-bit type trained with AdamW on N ranks:
//
//   stage 0  parameters 2Ψ, gradients 2Ψ, fp32 master + 2 moments 12Ψ      = 16Ψ
//   stage 1  parameters 2Ψ, gradients 2Ψ, optimizer state 12Ψ/N            = 4Ψ + 12Ψ/N
//   stage 2  parameters 2Ψ, gradient shard 2Ψ/N, optimizer state 12Ψ/N     = 2Ψ + 14Ψ/N
//   stage 3  parameter shard 2Ψ/N, gradient shard 2Ψ/N, optimizer 12Ψ/N    = 16Ψ/N
//
// With hybrid sharding (config::shard_group_size = G, shard_group.hpp) the state is sharded over
// the G ranks of a group and replicated across the N / G groups: every N above becomes G.
//
// plus, in stages 2 and 3, `reduce_buffers` gradient buckets and, in stage 3, at most
// `max_gathered_bytes` of gathered parameters. fp32 parameters need no separate master copy
// (the optimizer updates them in place): 4Ψ + 4Ψ + 8Ψ/N in stage 1, and so on.
//
// Collectives per step: stages 0 and 1 all_reduce each gradient bucket (on the last
// micro-batch); stages 2 and 3 reduce_scatter it (every micro-batch); stages 1 and 2 all_gather
// the updated parameters after the step; stage 3 all_gathers a bucket's parameters when a layer
// in it is first used in a pass. All of them run on one communication thread, so reducing bucket
// k overlaps backward computing bucket k-1, and gathering the next bucket overlaps computing
// with this one. The trainer thread must not use the communicator itself while the sharder has
// work queued; run_collective() runs a collective of its own in line with the sharder's.
//
// The sharder is a façade over its parts, each in its own header: the stage table (stage.hpp),
// the partition plan (plan.hpp), this rank's weights and optimizer state (model_state.hpp, over
// the shard optimizer of optimizer.hpp), the gradient reducer (gradient_reducer.hpp), the stage-3
// parameter cache and its handles (parameter_cache.hpp), the optimizer step (step.hpp, with the
// loss scaler of loss_scaler.hpp) and checkpoint I/O (state_checkpoint.hpp over checkpoint.hpp),
// built and wired together in detail/sharder_parts.hpp, which this class derives from. It uses the
// communicator only through the collectives API (ringzero::all_reduce, reduce_scatter, all_gather),
// comm.rank()/size(), for hybrid sharding split(), and for its memory the space the communicator
// chooses (memory_space.hpp).
//
// Memory: the parameters and the gradients live in Space, memory_space_for(comm) unless named:
// host memory on loopback and libfabric, the node's symmetric memory on shm (comm.allocate), so
// the gradients' all_reduce (stages 0-1) reads the peers' buffers in place; with hybrid sharding
// the shard group is split from the world and symmetric memory does not span it, so the buffers
// are host memory. Symmetric allocation is collective over every rank of the transport; the
// constructor makes exactly two, in this order on every rank (hence the same layout and config
// everywhere, and no other thread on the communicator meanwhile): the parameters (the padded
// flat buffer, or the shard in stage 3), then the gradients (the flat buffer in stages 0-1, the
// shard in 2-3 -- reproducible: over the exact accumulators -- of the reduce type). Nothing else
// is collective: bucket buffers and gathered buckets are this rank's own (host memory), as which
// holds what is decided by timing and use, while a collective on symmetric memory finds a peer's
// buffer at the offset of its own. zero::sharder<Comm, P, zero::host_space> is all host memory.
//
// On a world communicator whose transport runs collectives itself (shm: in its segment, and
// all_reduce in place on symmetric buffers), each of config::collectives left at the ring (the
// default) becomes algorithm::automatic, so the transport takes the call: its reductions sum
// every element in rank order, the same order in all_reduce and reduce_scatter, which keeps the
// stages bitwise equal (see docs/zero.md for buckets beyond the transport's segment size).
// RINGZERO_ALGO=ring sends every call back to the ring. On NCCL they become automatic on every
// communicator (NCCL's own collectives; NCCL does not fix its reduction order, so there the
// stages agree to rounding, not bitwise).
//
// Every element is reduced along the same ring path whether its bucket is all_reduced or
// reduce_scattered, and the optimizer arithmetic is element-wise and shared, so with one
// micro-batch per step all four stages produce bitwise identical weights.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/trace.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/types.hpp"
#include "ringzero/zero/checkpoint.hpp"
#include "ringzero/zero/detail/buffer_meter.hpp"
#include "ringzero/zero/detail/sharder_parts.hpp"
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

// In a CUDA translation unit the device memory space comes along (it launches kernels, so a host
// compiler cannot take it): a sharder over nccl::communicator then keeps its buffers on the GPU.
#if defined(__CUDACC__)
#include "ringzero/zero/cuda_space.cuh"
#endif

namespace ringzero::zero {

template <class P>
concept parameter_type =
    std::is_same_v<P, float> || std::is_same_v<P, bfloat16> || std::is_same_v<P, float16>;

template <class Comm, parameter_type P, memory_space Space = memory_space_t<Comm>>
class sharder : private detail::sharder_parts<Comm, P, Space> {
  using parts = detail::sharder_parts<Comm, P, Space>;
  using parts::cache_, parts::cfg_, parts::comm_, parts::groups_, parts::meter_, parts::plan_,
      parts::rank_, parts::reducer_, parts::space_, parts::stage_, parts::state_, parts::steps_,
      parts::world_, parts::worker_;
  using parts::collective_runner, parts::load_from, parts::micro_batches, parts::param,
      parts::quiesce, parts::replicate_runner, parts::shard_runner;

 public:
  using param_type = P;
  using space_type = Space;
  /// Whether the buffers are device memory, worked on through the space's streams.
  static constexpr bool device = on_device<Space>;

  /// Builds the partition plan and allocates this rank's buffers. Every parameter in `layout`
  /// must have type dtype_of<P>(). Every rank constructs with the same layout and config and
  /// computes the same plan; that is collective only with hybrid sharding, which splits `comm`.
  /// A config that cannot work (an algorithm that does not implement the collective it is
  /// chosen for, a loss scaling that cannot grow, a shard_group_size that does not divide the
  /// world) is an invalid_argument here.
  sharder(Comm& comm, const model_layout& layout, config cfg)
      : parts(comm, layout,
              check_config(std::move(cfg), layout, dtype_of<P>(), ringzero::knows_nodes<Comm>)) {
    log::info("zero: stage {}, {} parameters ({}), sharded over {} of {} ranks, {}", cfg_.stage,
              plan_.numel(), dtype_name(dtype_of<P>()), groups_.size(), world_, memory());
  }

  sharder(const sharder&) = delete;
  sharder& operator=(const sharder&) = delete;

  /// The memory space of the parameters and gradients (a device space's streams among them).
  [[nodiscard]] const Space& space() const noexcept { return space_; }

  /// Device spaces: waits on the host until everything the sharder enqueued on the compute and
  /// communication streams has completed, and raises a failure of either. Host memory: waits
  /// for the communication thread.
  void synchronize() {
    worker_.drain();
    if constexpr (device) space_.synchronize();
  }

  [[nodiscard]] const partition_plan& plan() const noexcept { return plan_; }
  [[nodiscard]] const config& configuration() const noexcept { return cfg_; }
  [[nodiscard]] int stage() const noexcept { return cfg_.stage; }
  [[nodiscard]] const stage_layout& layout_of_stage() const noexcept { return stage_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return world_; }
  /// Whether the parameters and gradients lie in symmetric memory (see the header comment).
  [[nodiscard]] bool symmetric_buffers() const noexcept {
    return state_.symmetric() && std::visit([](const auto& r) { return r.symmetric(); }, reducer_);
  }
  /// Ranks the state is sharded over: world_size(), or config::shard_group_size.
  [[nodiscard]] int shard_group_size() const noexcept { return groups_.size(); }
  /// The ranks of this rank's shard group (the communicator itself without hybrid sharding):
  /// every reduce_scatter and all_gather of the sharder runs on it. For inspection (its trace
  /// counters); the sharder's collectives run on its communication thread.
  [[nodiscard]] Comm& shard_communicator() noexcept { return groups_.shard(); }
  /// With hybrid sharding, the ranks holding this rank's shard in every group, over which the
  /// gradient shards are all_reduced; null otherwise. For inspection, as shard_communicator().
  [[nodiscard]] Comm* replicate_communicator() noexcept { return groups_.replicate(); }
  /// Steps taken, skipped ones included.
  [[nodiscard]] std::uint64_t step_count() const noexcept { return steps_.step_count(); }
  /// Steps that updated the weights.
  [[nodiscard]] std::uint64_t optimizer_steps() const noexcept { return steps_.optimizer_steps(); }
  /// What the trainer multiplies its loss by (1 unless P is float16).
  [[nodiscard]] float loss_scale() const noexcept { return steps_.scaler().scale(); }
  /// false for a parameter of a frozen group (hand it no gradient).
  [[nodiscard]] bool trainable(int id) const { return !frozen(cfg_, param(id, "trainable").group); }

  /// Sets every parameter group's base learning rate (what the schedule multiplies).
  void set_learning_rate(float lr) noexcept { steps_.set_learning_rate(lr); }
  /// Sets one group's base learning rate.
  void set_learning_rate(int group, float lr) { steps_.set_learning_rate(group, lr); }
  /// The learning rate group `group` uses in the next step: its base rate times the schedule at
  /// step_count(). Checkpoints keep the base rates and the step.
  [[nodiscard]] float learning_rate(int group = 0) const { return steps_.learning_rate(group); }

  /// Sets a parameter's value from fp32. Every rank passes the same values (e.g. generated from
  /// the same seed); each keeps the part it needs.
  void set_parameter(int id, std::span<const float> values) {
    const auto& pi = param(id, "set_parameter");
    if (values.size() != pi.numel)
      throw invalid_argument(fmt::format("set_parameter: {} has {} elements, got {}", pi.name,
                                         pi.numel, values.size()));
    quiesce();
    state_.set(id, values);
    if constexpr (device) space_.synchronize();
  }

  /// A parameter's full value in stages 0-2 (stage 3 keeps only shards: use gather()). On a
  /// device space it is device memory, current on the compute stream.
  [[nodiscard]] std::span<const P> parameter(int id) const {
    const auto& pi = param(id, "parameter");
    if (stage_.sharded_parameters)
      throw invalid_argument(fmt::format(
          "parameter({}): stage 3 keeps only this rank's shard; gather() the layer instead",
          pi.name));
    return state_.parameters().subspan(pi.offset, pi.numel);
  }

  /// The parameters of one bucket, present while a handle exists. In stages 0-2 every
  /// parameter is always present and the handle is free. A handle held across step() reads the
  /// updated weights afterwards (stage 3 gathers its bucket again).
  using gathered = gathered_parameters<Comm, P, Space>;

  /// Makes layer `layer`'s parameters present and returns a handle to them. Stage 3: all_gathers
  /// the layer's bucket unless it is still present; forward and backward passes free buckets the
  /// pass has left behind and prefetch the following buckets (in their direction) while the
  /// gathered bytes stay within max_gathered_bytes; pass::recompute (activation recomputation
  /// inside backward) does neither. Parameters the layer share()s are present too (their
  /// buckets are held by the handle; one still present is not gathered again). Every rank must
  /// make the same sequence of gather calls; with RINGZERO_CHECK=1 every rank compares each
  /// stage-3 gather (layer, pass, sequence number) first and raises mismatch_error if they differ.
  [[nodiscard]] gathered gather(int layer, pass direction = pass::forward) {
    if (layer < 0 || static_cast<std::size_t>(layer) >= plan_.layers().size())
      throw invalid_argument(fmt::format("gather: layer {} of {}", layer, plan_.layers().size()));
    if (!stage_.sharded_parameters)
      return gathered(plan_, nullptr, -1, state_.parameters().data(), 0);
    const auto& li = plan_.layers()[static_cast<std::size_t>(layer)];
    cache_.check_agreement(layer, direction);
    const P* base = cache_.acquire(li.bucket, direction, li.shared_buckets);
    return gathered(plan_, &cache_, li.bucket, base,
                    plan_.buckets()[static_cast<std::size_t>(li.bucket)].offset, li.shared_buckets);
  }

  /// Hands over parameter `id`'s gradient for this micro-batch (each parameter at most once per
  /// micro-batch, or once per use for a parameter layers share(): those are summed; one never
  /// handed over counts as zero). A bucket whose gradients are all in is
  /// queued for reduction at once, in descending bucket order, so handing gradients over in
  /// backward order overlaps reduction with the rest of backward.
  void add_grad(int id, std::span<const P> g) {
    check_trainable(cfg_, param(id, "add_grad"));
    std::visit([&](auto& r) { r.add(id, g); }, reducer_);
  }

  /// The same from fp32 gradients, rounded to P (or to the reduce_dtype) first.
  void add_grad(int id, std::span<const float> g) requires(!std::is_same_v<P, float>) {
    check_trainable(cfg_, param(id, "add_grad"));
    std::visit([&](auto& r) { r.add(id, g); }, reducer_);
  }

  /// Where parameter `id`'s gradient is summed, for backward to write into instead of handing
  /// over a copy (what DDP and FSDP do with gradient buckets): the span holds the sum of what
  /// this step handed over for `id` so far (zero at its first use of the step, in stages 2-3 of
  /// the micro-batch). Add the gradient into it, then call add_grad(id, span) with this span,
  /// which counts it without copying. G must be the type gradients are reduced in (P, or float
  /// with reduce_dtype float32), and gradient_predivide 1. On a device space the span is device
  /// memory, current on the compute stream.
  template <class G>
  [[nodiscard]] std::span<G> gradient_slot(int id) {
    check_trainable(cfg_, param(id, "gradient_slot"));
    return std::visit(
        [&](auto& r) -> std::span<G> {
          using R = std::remove_cvref_t<decltype(r)>;
          if constexpr (std::is_same_v<R, gradient_reducer<Comm, G, Space>>) {
            return r.slot(id);
          } else {
            // this->: GCC 12 does not find a base's member named by a using-declaration here.
            throw invalid_argument(fmt::format(
                "gradient_slot<{}>: this sharder reduces gradients in {} (config::reduce_dtype)",
                dtype_name(dtype_of<G>()),
                dtype_name(this->cfg_.reduce_dtype.value_or(dtype_of<P>()))));
          }
        },
        reducer_);
  }

  /// Hands over a gradient written into gradient_slot(id): `g` must be that span.
  template <class G>
  void add_grad(int id, std::span<G> g) requires(!std::is_const_v<G>) {
    add_grad(id, std::span<const G>(g));
  }

  /// Ends a micro-batch: queues the buckets still waiting (missing gradients are zero).
  void end_micro_batch() {
    std::visit([](auto& r) { r.end_micro_batch(); }, reducer_);
    if (stage_.sharded_parameters) cache_.evict_unreferenced();
  }

  /// The optimizer step, after accumulation_steps micro-batches: waits for the reductions,
  /// checks every rank's gradients for inf/NaN (all skip together), clips to the global norm,
  /// updates this rank's shard, all_gathers the new parameters (stages 1, 2) or refreshes the
  /// gathered buckets (stage 3). Collective.
  step_result step() {
    if (micro_batches() != cfg_.accumulation_steps)
      throw invalid_argument(
          fmt::format("step() after {} of {} micro-batches: call end_micro_batch() after each",
                      micro_batches(), cfg_.accumulation_steps));
    const trace::scope phase(comm_, "step", state_.optimizer_bytes());
    worker_.drain();
    // Device spaces: the step runs on the communication stream once the compute stream is done
    // with this step's parameters; the next forward on the compute stream waits for the step.
    if constexpr (device) space_.wait(space_.comm_stream(), space_.record(space_.compute_stream()));
    const step_result res =
        std::visit([&](auto& r) { return steps_.take(state_, r, shard_runner()); }, reducer_);
    if (!res.skipped && stage_.sharded_parameters) cache_.refresh();
    if constexpr (device) space_.wait(space_.compute_stream(), space_.record(space_.comm_stream()));
    return res;
  }

  /// Runs f(comm) on the communication thread, after everything already queued, and returns its
  /// result: how a trainer issues collectives of its own (a loss all_reduce) safely.
  using parts::run_collective;

  /// Bytes this rank holds now, by category.
  [[nodiscard]] memory_report memory() const {
    memory_report m;
    m.rank = rank_;
    m.stage = cfg_.stage;
    m.parameters = state_.parameter_bytes();
    m.gradients = std::visit([](const auto& r) { return r.gradient_bytes(); }, reducer_);
    m.accumulator = std::visit([](const auto& r) { return r.accumulator_bytes(); }, reducer_);
    m.optimizer = state_.optimizer().bytes();
    m.buffers = meter_.now;
    m.peak_buffers = meter_.peak;
    m.secondary = cache_.secondary_bytes();
    return m;
  }

  /// Every parameter's fp32 master value, concatenated in registration order, on every rank.
  /// Collective (an all_gather per bucket, except in stage 0).
  [[nodiscard]] std::vector<float> full_parameters() {
    quiesce();
    return state_.full_parameters(shard_runner(), cfg_.collectives.all_gather);
  }

  /// Writes a checkpoint of the whole training state into `dir` (see checkpoint.hpp).
  /// Collective; call between steps. Raises checkpoint_error on every rank if any rank fails;
  /// whatever fails, the checkpoint `dir` held before stays loadable. With hybrid sharding only
  /// group 0 writes (a checkpoint of shard_group_size() ranks); the other groups hold the same
  /// state and learn group 0's outcome.
  void save(const std::filesystem::path& dir) {
    if (micro_batches() != 0)
      throw invalid_argument("save: a step is in progress; call it after step()");
    trace::scope phase(comm_, "checkpoint");
    quiesce();
    auto write = [&] {
      save_state(shard_runner(), cfg_, dir, state_, steps_,
                 [&](std::uint64_t bytes) { phase.set_bytes(bytes); });
    };
    if (!groups_.hybrid()) {
      write();
    } else {
      std::string failure;
      if (groups_.group() == 0) {
        try {
          write();
        } catch (const checkpoint_error& e) {
          failure = e.what();
        }
      }
      auto across = replicate_runner();
      detail::raise_if_any_failed(across, cfg_.collectives.all_gather, failure);
    }
    log::info("zero: saved step {} to {}", steps_.step_count(), dir.string());
  }

  /// Restores a checkpoint written by save() at any world size and stage: weights, optimizer
  /// moments, step counts and (for float16) the loss scaler. Collective; every rank raises
  /// checkpoint_error if any rank finds the checkpoint missing, incomplete, corrupt or
  /// incompatible with this model.
  void load(const std::filesystem::path& dir) { load_from(dir, dir.string()); }

  /// As load(dir), from a checkpoint held in memory (snapshot(), or one gathered from peers by
  /// zero::gather_snapshot after a rank was lost).
  void load(const checkpoint_image& image) { load_from(image, "an in-memory snapshot"); }

  /// Collective: the training state as save() would write it, kept in memory instead: the
  /// manifest and this rank's shard (its bytes are what keeping it costs). Hand it to
  /// zero::keep_with_peer so that a copy survives this rank, and to load() to go back to it.
  [[nodiscard]] checkpoint_image snapshot() {
    if (micro_batches() != 0)
      throw invalid_argument("snapshot: a step is in progress; call it after step()");
    const trace::scope phase(comm_, "checkpoint", state_.optimizer_bytes());
    quiesce();
    return snapshot_state(shard_runner(), cfg_, state_, steps_);
  }
};

}  // namespace ringzero::zero
