// The gradient reducer: takes each parameter's gradient as backward produces it, packs it into its
// bucket, and queues the bucket's reduction on the communication thread as soon as the bucket is
// complete, so reducing bucket k overlaps backward computing bucket k-1.
//
// Flat gradients (stages 0-1) accumulate micro-batches in place and all_reduce each bucket once,
// on the last micro-batch. Sharded gradients (stages 2-3) fill one of a small pool of bucket
// buffers (`reduce_buffers`), reduce_scatter it and add this rank's slice into the gradient shard,
// every micro-batch; a free buffer is reused, else the one whose reduction finishes first, else
// (gradients arriving out of order) the pool grows.
//
// With hybrid sharding (shard_group.hpp) `comm` is this rank's group and `replicate` the ranks
// holding the same shard in the other groups: a bucket is reduce_scattered within the group and
// its slice all_reduced across groups, in every stage; flat gradients are then all_gathered back
// within the group. Every element is thus summed in the same order in every stage.
//
// The gradients are allocated in the sharder's memory space (memory_space.hpp), in the
// constructor: on symmetric memory the flat gradients' all_reduce (stages 0-1) reads the peers'
// buckets in place. The bucket buffers of stages 2-3 come from allocate_local (host memory on the
// symmetric space): which buffer a bucket fills is this rank's own choice (the first that is
// free, timing and the order gradients arrive in decide), while a collective on symmetric memory
// reads each peer's buffer at the offset of its own.
//
// Reproducible training (config::reproducible), in every stage, collects each micro-batch's
// gradients in the bucket buffers and hands each complete bucket to exact_gradients.hpp, which
// sends every term to the rank that owns it and adds it there exactly; the step's gradients are
// those sums rounded once. A gradient slot is then a place in a bucket buffer, zeroed for every
// micro-batch.
//
// G is the type gradients are reduced and accumulated in: the parameter type, or float for
// 16-bit parameters (config::reduce_dtype). Each gradient is rounded to G as it is packed, after
// multiplying by 1 / config::gradient_predivide.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/trace.hpp"
#include "ringzero/zero/detail/bucket_pool.hpp"
#include "ringzero/zero/detail/buffer_meter.hpp"
#include "ringzero/zero/detail/worker.hpp"
#include "ringzero/zero/device_space.hpp"
#include "ringzero/zero/exact_gradients.hpp"
#include "ringzero/zero/memory_space.hpp"
#include "ringzero/zero/optimizer.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/plan.hpp"
#include "ringzero/zero/stage.hpp"

namespace ringzero::zero {

// On a device space (device_space.hpp) the same happens in stream order, with no host waits:
// gradients are accumulated on the compute stream; a complete bucket's reduction is enqueued on
// the communication stream behind an event of the compute stream (its gradients are in); a bucket
// buffer is reused once the compute stream waited for the event that ends its last reduction.
template <class Comm, class G, memory_space Space = host_space>
class gradient_reducer {
 public:
  static constexpr bool device = on_device<Space>;

  /// `comm`, `plan`, `work`, `meter` and `replicate` must outlive the reducer; `work` may be
  /// constructed after it (only its address is taken here). `replicate`: the inter-group
  /// communicator of hybrid sharding, or null. `space`: where the gradients and bucket buffers
  /// are allocated (collectively, where it is collective()).
  gradient_reducer(Comm& comm, const partition_plan& plan, const stage_layout& stage,
                   const config& cfg, detail::worker& work, detail::buffer_meter& meter,
                   Comm* replicate = nullptr, const Space& space = Space{})
      : comm_(comm),
        replicate_(replicate),
        plan_(plan),
        sharded_(stage.sharded_gradients),
        accumulation_(cfg.accumulation_steps),
        all_reduce_(cfg.collectives.all_reduce),
        reduce_scatter_(cfg.collectives.reduce_scatter),
        all_gather_(cfg.collectives.all_gather),
        rank_(comm.rank()),
        inv_predivide_(1.0f / cfg.gradient_predivide),
        reproducible_(cfg.reproducible),
        work_(work),
        space_(space),
        pool_(work, meter, plan.max_bucket()) {
    // Reproducible stages 2-3 hold their gradient shard over the accumulators' words.
    if (!sharded_ || !reproducible_)
      grads_ = space.template allocate<G>(sharded_ ? plan_.shard_size() : plan_.padded_size());
    if (sharded_ || reproducible_)
      for (int i = 0; i < cfg.reduce_buffers; ++i) pool_.add_buffer(space_);
    const auto nb = plan_.buckets().size();
    missing_.resize(nb);
    bucket_buffer_.assign(nb, -1);
    got_.assign(plan_.params().size(), 0);
    slot_zeroed_.assign(plan_.params().size(), false);
    if (reproducible_)
      exact_.emplace(comm, replicate, plan, sharded_, cfg, work, meter, grads_.data(), space);
    reset_micro_batch();
  }

  gradient_reducer(const gradient_reducer&) = delete;
  gradient_reducer& operator=(const gradient_reducer&) = delete;

  /// Micro-batches ended since the last step.
  [[nodiscard]] int micro_batches() const noexcept { return micro_; }
  /// After step(): the next micro-batch starts a new accumulation.
  void start_step() noexcept {
    micro_ = 0;
    std::fill(slot_zeroed_.begin(), slot_zeroed_.end(), false);
  }

  /// The reduced gradient of a segment this rank updates (flat or shard position).
  [[nodiscard]] const G* gradient(const segment& s) const noexcept {
    if (sharded_ && reproducible_) return exact_->gradient(s);
    return grads_.data() + (sharded_ ? s.shard_offset : s.flat_offset);
  }
  /// Adds the sum of squares of `segs`' gradients times `scale` to `sumsq`, and sets
  /// `nonfinite` if any is inf or NaN: this rank's share of the step's global norm and overflow
  /// check.
  void add_stats(const std::vector<segment>& segs, float scale, double& sumsq,
                 bool& nonfinite) const noexcept requires(!device) {
    for (const auto& s : segs) grad_stats(gradient(s), s.count, scale, sumsq, nonfinite);
  }
  /// Device spaces: add_stats and agree_gradient_stats in one, on the communication stream (the
  /// statistics are computed and all_reduced where they lie), then read back: the global result.
  /// `run(f)` calls f(comm) in line with the other collectives; `o` is the all_reduce's options.
  template <class Run>
  [[nodiscard]] gradient_stats agree_stats(const std::vector<segment>& segs, float scale, Run&& run,
                                           const ringzero::options& o) requires device {
    const auto st = space_.comm_stream();
    space_.stats_reset(st);
    // Every segment in one launch: a shard of many tensors would otherwise cost a launch each.
    runs_.clear();
    for (const auto& s : segs) runs_.push_back({gradient(s), s.count});
    space_.stats_add(st, std::span<const device_run<G>>(runs_), scale);
    const device_stats d = space_.stats();
    run([&](auto& c) {
      space_.enqueue(st, [c = &c, d, o](auto on) {
        // The host's order: the overflow flag, then the sum of squares.
        ringzero::all_reduce(*c, std::span<std::int32_t>(d.nonfinite, 1), op::max, on(o));
        ringzero::all_reduce(*c, std::span<double>(d.sumsq, 1), op::sum, on(o));
      });
    });
    // The step's one host wait: the verdict (skip or apply, the clipping factor) is the host's.
    return space_.read_stats(st);
  }
  /// agree_stats in reproducible mode (exact_gradients::agree_stats): the exact sum of squares.
  [[nodiscard]] gradient_stats agree_exact_stats(float scale,
                                                 const ringzero::options& o) requires device {
    return exact_->agree_stats(scale, o);
  }
  /// Whether the gradients lie in symmetric memory.
  [[nodiscard]] bool symmetric() const noexcept { return grads_.symmetric(); }
  /// The gradients' bytes, the accumulators' included (reproducible mode).
  [[nodiscard]] std::size_t gradient_bytes() const noexcept {
    return grads_.bytes() + accumulator_bytes();
  }
  /// Reproducible mode: the exact accumulators' bytes (a shard in every stage; in stages 2-3 the
  /// gradient shard lies over them).
  [[nodiscard]] std::size_t accumulator_bytes() const noexcept {
    return exact_ ? exact_->bytes() : 0;
  }

  /// Hands over parameter `id`'s gradient for this micro-batch: at most once per use (a shared
  /// parameter has one per layer using it; the gradients of its uses are summed).
  /// A gradient that is the span slot(id) returned is already in place: it is counted, not
  /// copied.
  template <class S>
  void add(int id, std::span<const S> g) {
    const auto& pi = plan_.params()[static_cast<std::size_t>(id)];
    if (g.size() != pi.numel)
      throw invalid_argument(fmt::format("add_grad: {} has {} elements, the gradient {}", pi.name,
                                         pi.numel, g.size()));
    check_open("add_grad", id, pi);
    auto& got = got_[static_cast<std::size_t>(id)];
    const bool first_use = got++ == 0;
    const auto b = static_cast<std::size_t>(pi.bucket);
    G* dst = reproducible_ ? exact_->given_slot(id, destination(pi)) : destination(pi);
    const bool in_place = static_cast<const void*>(g.data()) == static_cast<const void*>(dst);
    if (in_place && (!std::is_same_v<S, G> || inv_predivide_ != 1.0f))
      throw invalid_argument(fmt::format(
          "add_grad({}): the gradient lies in its own slot but as another type or with a "
          "gradient_predivide",
          pi.name));
    if (reproducible_) {
      // Each arrival is a term of its own: a layer of the bucket, converted as add_into would.
      if (!in_place) add_into(exact_->copy_target(id, destination(pi)), g.data(), pi.numel, true);
    } else if (!in_place) {
      add_into(dst, g.data(), pi.numel,
               (!sharded_ && micro_ == 0 && first_use) || (sharded_ && first_use));
    }
    if (--missing_[b] == 0)
      while (next_bucket_ >= 0 && missing_[static_cast<std::size_t>(next_bucket_)] == 0)
        submit_bucket(next_bucket_--);
  }

  /// Where parameter `id`'s gradient of this micro-batch is summed, for backward to write into
  /// instead of handing over a copy: the span holds the sum of what this step has handed over
  /// for `id` so far (zero at its first use in the step, or in stages 2-3 in the micro-batch).
  /// Add the gradient into it, then call add(id, span) with this span. On a device space it is
  /// device memory, current on the compute stream. Needs gradient_predivide = 1 (the copy is what
  /// applies it).
  [[nodiscard]] std::span<G> slot(int id) {
    const auto& pi = plan_.params()[static_cast<std::size_t>(id)];
    check_open("gradient_slot", id, pi);
    if (inv_predivide_ != 1.0f)
      throw invalid_argument(fmt::format(
          "gradient_slot({}): gradient_predivide is {}; a gradient written in place cannot be "
          "divided on the way in (hand it over with add_grad)",
          pi.name, 1.0f / inv_predivide_));
    // Reproducible mode: a layer of the bucket, zeroed for each micro-batch.
    if (reproducible_) return {exact_->slot(id, destination(pi)), pi.numel};
    G* dst = destination(pi);
    auto zeroed = slot_zeroed_[static_cast<std::size_t>(id)];
    const bool zero_now = !sharded_ && micro_ == 0;
    if (zero_now && got_[static_cast<std::size_t>(id)] == 0 && !zeroed) {
      if constexpr (device)
        space_.zero(space_.compute_stream(), dst, pi.numel);
      else
        std::fill_n(dst, pi.numel, G{});
    }
    zeroed = true;
    return {dst, pi.numel};
  }

  /// Ends a micro-batch: queues the buckets still waiting (missing gradients are zero).
  void end_micro_batch() {
    if (micro_ >= accumulation_)
      throw invalid_argument(
          fmt::format("end_micro_batch: all {} micro-batches of this step are done; call step()",
                      accumulation_));
    for (int b = next_bucket_; b >= 0; --b) {
      const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
      if (!sharded_ && micro_ == 0 && !reproducible_)
        for (int p = bk.first_param; p < bk.first_param + bk.param_count; ++p)
          if (!got_[static_cast<std::size_t>(p)]) {
            const auto& pi = plan_.params()[static_cast<std::size_t>(p)];
            if constexpr (device)
              space_.zero(space_.compute_stream(), grads_.data() + pi.offset, pi.numel);
            else
              std::fill_n(grads_.data() + pi.offset, pi.numel, G{});
          }
      submit_bucket(b);
    }
    ++micro_;
    reset_micro_batch();
  }

 private:
  /// dst = src / predivide (first) or dst += that: on the caller's thread, or on a device space
  /// enqueued on the compute stream, where the trainer's backward wrote `src`.
  template <class S>
  void add_into(G* dst, const S* src, std::size_t n, bool first) {
    if constexpr (device)
      space_.accumulate(space_.compute_stream(), dst, src, n, first, inv_predivide_);
    else
      accumulate(dst, src, n, first, inv_predivide_);
  }

  /// Reproducible mode: bucket b is complete for this micro-batch; exact_gradients takes it
  /// from its buffer (zeroed now if no gradient came), which is free again once that is done.
  void submit_exact(int b) {
    const auto ub = static_cast<std::size_t>(b);
    if (bucket_buffer_[ub] < 0) acquire_buffer(b);
    auto& entry = pool_[static_cast<std::size_t>(bucket_buffer_[ub])];
    const auto done =
        exact_->submit(b, entry.data.data(), micro_ == 0, micro_ + 1 == accumulation_);
    if constexpr (device)
      entry.done = done;
    else
      entry.busy = done;
    entry.bucket = -1;
    bucket_buffer_[ub] = -1;
  }

  /// Refuses a gradient for `pi` once the step's micro-batches are done or it has them all.
  void check_open(std::string_view what, int id, const param_info& pi) const {
    if (micro_ >= accumulation_)
      throw invalid_argument(
          fmt::format("{}({}): all {} micro-batches of this step are done; call step()", what,
                      pi.name, accumulation_));
    const int got = got_[static_cast<std::size_t>(id)];
    if (got >= pi.uses)
      throw invalid_argument(
          pi.uses == 1 ? fmt::format("{}: {} was already added in this micro-batch", what, pi.name)
                       : fmt::format("{}: {} was already added {} times in this micro-batch, once "
                                     "per layer using it",
                                     what, pi.name, got));
  }

  /// Where `pi`'s gradient is summed: the flat gradients, or its bucket's buffer (taken now).
  [[nodiscard]] G* destination(const param_info& pi) {
    if (!sharded_ && !reproducible_) return grads_.data() + pi.offset;
    const auto b = static_cast<std::size_t>(pi.bucket);
    if (bucket_buffer_[b] < 0) acquire_buffer(pi.bucket);
    return pool_[static_cast<std::size_t>(bucket_buffer_[b])].data.data() +
           (pi.offset - plan_.buckets()[b].offset);
  }

  void reset_micro_batch() {
    if (exact_) exact_->start_micro_batch();
    std::fill(got_.begin(), got_.end(), 0);
    std::fill(missing_.begin(), missing_.end(), 0);
    for (const auto& pi : plan_.params()) missing_[static_cast<std::size_t>(pi.bucket)] += pi.uses;
    next_bucket_ = static_cast<int>(plan_.buckets().size()) - 1;
  }

  /// Queues bucket b's reduction: all_reduce in place (flat, last micro-batch only) or
  /// reduce_scatter of its filled buffer, added into the gradient shard.
  void submit_bucket(int b) {
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
    if (reproducible_) {
      submit_exact(b);
      return;
    }
    if constexpr (device) {
      submit_device(b);
      return;
    }
    if (!sharded_) {
      if (micro_ + 1 < accumulation_) return;
      std::span<G> grads(grads_.data() + bk.offset, bk.padded);
      const std::size_t slice = bk.slice;
      work_.submit([this, grads, slice] {
        // On the collectives' thread, so the span encloses its all_reduce on one track.
        const trace::scope phase(comm_, "reduce", grads.size_bytes());
        if (replicate_ == nullptr) {
          ringzero::all_reduce(comm_, grads, op::sum, all_reduce_);
          return;
        }
        std::span<G> own = grads.subspan(static_cast<std::size_t>(rank_) * slice, slice);
        ringzero::reduce_scatter(comm_, grads, own, op::sum, reduce_scatter_);
        ringzero::all_reduce(*replicate_, own, op::sum, all_reduce_);
        ringzero::all_gather(comm_, std::span<const G>(own), grads, all_gather_);
      });
      return;
    }
    if (bucket_buffer_[static_cast<std::size_t>(b)] < 0) acquire_buffer(b);
    const int k = bucket_buffer_[static_cast<std::size_t>(b)];
    auto& entry = pool_[static_cast<std::size_t>(k)];
    G* buf = entry.data.data();
    const bool first = micro_ == 0;
    entry.busy = work_.submit([this, buf, b, first] {
      const auto& bucket = plan_.buckets()[static_cast<std::size_t>(b)];
      const trace::scope phase(comm_, "reduce", bucket.padded * sizeof(G));
      std::span<G> own(buf + static_cast<std::size_t>(rank_) * bucket.slice, bucket.slice);
      ringzero::reduce_scatter(comm_, std::span<G>(buf, bucket.padded), own, op::sum,
                               reduce_scatter_);
      if (replicate_ != nullptr) ringzero::all_reduce(*replicate_, own, op::sum, all_reduce_);
      accumulate(grads_.data() + bucket.shard_offset, own.data(), bucket.slice, first);
    });
    entry.bucket = -1;
    bucket_buffer_[static_cast<std::size_t>(b)] = -1;
  }

  /// submit_bucket on a device space: everything enqueued on the communication stream behind the
  /// compute stream's current point (the bucket's gradients), in the order of the host path.
  void submit_device(int b) requires device {
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
    const auto comm_stream = space_.comm_stream();
    if (!sharded_) {
      if (micro_ + 1 < accumulation_) return;
      space_.wait(comm_stream, space_.record(space_.compute_stream()));
      std::span<G> grads(grads_.data() + bk.offset, bk.padded);
      const std::size_t slice = bk.slice;
      space_.enqueue(comm_stream, [this, grads, slice](auto on) {
        if (replicate_ == nullptr) {
          ringzero::all_reduce(comm_, grads, op::sum, on(all_reduce_));
          return;
        }
        std::span<G> own = grads.subspan(static_cast<std::size_t>(rank_) * slice, slice);
        ringzero::reduce_scatter(comm_, grads, own, op::sum, on(reduce_scatter_));
        ringzero::all_reduce(*replicate_, own, op::sum, on(all_reduce_));
        ringzero::all_gather(comm_, std::span<const G>(own), grads, on(all_gather_));
      });
      return;
    }
    if (bucket_buffer_[static_cast<std::size_t>(b)] < 0) acquire_buffer(b);
    const int k = bucket_buffer_[static_cast<std::size_t>(b)];
    auto& entry = pool_[static_cast<std::size_t>(k)];
    space_.wait(comm_stream, space_.record(space_.compute_stream()));
    G* buf = entry.data.data();
    std::span<G> own(buf + static_cast<std::size_t>(rank_) * bk.slice, bk.slice);
    space_.enqueue(comm_stream, [this, buf, own, padded = bk.padded](auto on) {
      ringzero::reduce_scatter(comm_, std::span<G>(buf, padded), own, op::sum, on(reduce_scatter_));
      if (replicate_ != nullptr) ringzero::all_reduce(*replicate_, own, op::sum, on(all_reduce_));
    });
    space_.accumulate(comm_stream, grads_.data() + bk.shard_offset, own.data(), bk.slice,
                      micro_ == 0, 1.0f);
    entry.done = space_.record(comm_stream);
    entry.bucket = -1;
    bucket_buffer_[static_cast<std::size_t>(b)] = -1;
  }

  /// A zeroed buffer for bucket b.
  void acquire_buffer(int b) {
    // Reproducible mode zeroes only what no gradient overwrites (exact_gradients::submit).
    bucket_buffer_[static_cast<std::size_t>(b)] = pool_.acquire(b, space_, !reproducible_);
  }

  Comm& comm_;
  Comm* replicate_;
  const partition_plan& plan_;
  bool sharded_;
  int accumulation_;
  ringzero::options all_reduce_;
  ringzero::options reduce_scatter_;
  ringzero::options all_gather_;
  int rank_;
  float inv_predivide_;
  bool reproducible_;
  detail::worker& work_;
  Space space_;                         // the gradients' and bucket buffers' memory
  buffer<G> grads_;                     // flat (padded_size) or this rank's shard (shard_size)
  detail::bucket_pool<G, Space> pool_;  // stages 2-3 and reproducible mode: bucket buffers
  std::vector<int> bucket_buffer_;
  std::vector<int> missing_;  // gradients (one per use of each parameter) a bucket still awaits
  std::vector<int> got_;      // gradients of each parameter handed over this micro-batch
  std::vector<bool> slot_zeroed_;    // slot() zeroed the parameter's flat gradient this step
  std::vector<device_run<G>> runs_;  // device spaces: the step's segments for the statistics
  std::optional<exact_gradients<Comm, G, Space>> exact_;  // reproducible mode
  int next_bucket_ = -1;
  int micro_ = 0;
};

}  // namespace ringzero::zero
