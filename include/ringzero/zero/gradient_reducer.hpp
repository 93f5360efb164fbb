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
// Reproducible training (config::reproducible) keeps, per bucket, an exact accumulator of every
// gradient handed over this step (reduce/reproducible_accumulator.hpp) instead of a G sum, and
// reduces each bucket once, on the last micro-batch, with the exact combine: all_reduce (stages
// 0-1), reduce_scatter into the shard (2-3), or reduce_scatter in the group and all_reduce across
// the groups (hybrid sharding), rounded once into the gradients. A gradient slot is then zeroed
// at its first use in every micro-batch, and its content is added when its bucket completes.
//
// On a device space reproducible mode keeps the accumulators in host memory: each gradient is
// read back once its stream wrote it and added on the host, and the combine's collectives copy
// their integer vectors through device memory of the space (staged_collectives), which is what a
// device communicator moves. The rounded sum is copied into the device gradients. That costs a
// host wait per gradient and a copy each way of the bucket's digits per step, where the plain
// device path has none; the bits are those of host memory at every world size.
//
// G is the type gradients are reduced and accumulated in: the parameter type, or float for
// 16-bit parameters (config::reduce_dtype). Each gradient is rounded to G as it is packed, after
// multiplying by 1 / config::gradient_predivide.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/detail/reproducible_combine.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/reproducible_accumulator.hpp"
#include "ringzero/trace.hpp"
#include "ringzero/zero/detail/buffer_meter.hpp"
#include "ringzero/zero/detail/exact_sumsq.hpp"
#include "ringzero/zero/detail/worker.hpp"
#include "ringzero/zero/device_space.hpp"
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
        meter_(meter),
        space_(space) {
    grads_ = space.template allocate<G>(sharded_ ? plan_.shard_size() : plan_.padded_size());
    if (sharded_)
      for (int i = 0; i < cfg.reduce_buffers; ++i)
        add_buffer(space_.template allocate_local<G>(plan_.max_bucket()));
    const auto nb = plan_.buckets().size();
    missing_.resize(nb);
    bucket_buffer_.assign(nb, -1);
    got_.assign(plan_.params().size(), 0);
    slot_zeroed_.assign(plan_.params().size(), false);
    if (reproducible_) {
      accs_.reserve(nb);
      for (const auto& bk : plan_.buckets()) accs_.emplace_back(bk.padded);
      pending_.assign(plan_.params().size(), false);
    }
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
  /// agree_stats in reproducible mode: the exact sum of squares (zero/detail/exact_sumsq.hpp)
  /// of the segments' gradients, read back to the host, agreed over this reducer's communicator
  /// (the shard group, what the stepper's runner hands out) through staged collectives, which
  /// keep the communication stream's order themselves.
  [[nodiscard]] gradient_stats agree_exact_stats(const std::vector<segment>& segs, float scale,
                                                 const ringzero::options& o) requires device {
    detail::exact_sumsq sq;
    for (const auto& s : segs) {
      host_out_.resize(s.count);
      space_.download(space_.comm_stream(), host_out_.data(), gradient(s), s.count);
      sq.add(host_out_.data(), s.count);
    }
    const auto [sum, bad] = sq.agree(comm_, o, staged_collectives(*this));
    gradient_stats stats;
    stats.sumsq = sum * static_cast<double>(scale) * static_cast<double>(scale);
    stats.nonfinite = bad;
    return stats;
  }
  /// Whether the gradients lie in symmetric memory.
  [[nodiscard]] bool symmetric() const noexcept { return grads_.symmetric(); }
  /// The gradients' bytes, and in reproducible mode the accumulators' (at their largest yet),
  /// and on a device space the device memory their collectives pass through.
  [[nodiscard]] std::size_t gradient_bytes() const noexcept {
    std::size_t b = grads_.bytes() + staging_.bytes();
    for (const auto& a : accs_) b += a.bytes();
    return b;
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
    G* dst = reproducible_ ? slot_at(pi) : destination(pi);
    const bool in_place = static_cast<const void*>(g.data()) == static_cast<const void*>(dst);
    if (in_place && (!std::is_same_v<S, G> || inv_predivide_ != 1.0f))
      throw invalid_argument(fmt::format(
          "add_grad({}): the gradient lies in its own slot but as another type or with a "
          "gradient_predivide",
          pi.name));
    if (reproducible_) {
      if (in_place)
        pending_[static_cast<std::size_t>(id)] = true;
      else
        add_terms(pi, g.data());
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
    G* dst = destination(pi);
    auto zeroed = slot_zeroed_[static_cast<std::size_t>(id)];
    // Reproducible mode adds a slot to the accumulator every micro-batch: it starts from zero.
    const bool zero_now = reproducible_ || (!sharded_ && micro_ == 0);
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
    if (reproducible_) std::fill(slot_zeroed_.begin(), slot_zeroed_.end(), false);
    reset_micro_batch();
  }

 private:
  struct pool_entry {
    buffer<G> data;
    detail::worker::ticket busy = 0;  ///< free once this ticket completed
    int bucket = -1;                  ///< the bucket filling it, or -1
    /// Device spaces: the point of the communication stream after its last reduction.
    typename device_traits<Space>::event done{};
  };

  /// dst = src / predivide (first) or dst += that: on the caller's thread, or on a device space
  /// enqueued on the compute stream, where the trainer's backward wrote `src`.
  template <class S>
  void add_into(G* dst, const S* src, std::size_t n, bool first) {
    if constexpr (device)
      space_.accumulate(space_.compute_stream(), dst, src, n, first, inv_predivide_);
    else
      accumulate(dst, src, n, first, inv_predivide_);
  }

  /// Reproducible mode: adds a gradient (numel elements) to its bucket's accumulator, each
  /// element rounded to G after the predivide as add_into would.
  template <class S>
  void add_terms(const param_info& pi, const S* src) {
    if constexpr (device) {
      // The accumulator is host memory: the gradient comes over once the compute stream, where
      // backward wrote it, got there.
      host_in_.resize((pi.numel * sizeof(S) + sizeof(std::uint64_t) - 1) / sizeof(std::uint64_t));
      auto* h = reinterpret_cast<S*>(host_in_.data());
      space_.download(space_.compute_stream(), h, src, pi.numel);
      src = h;
    }
    auto& acc = accs_[static_cast<std::size_t>(pi.bucket)];
    const std::size_t at = pi.offset - plan_.buckets()[static_cast<std::size_t>(pi.bucket)].offset;
    if constexpr (std::is_same_v<S, G>) {
      if (inv_predivide_ == 1.0f) {
        acc.add(std::span<const G>(src, pi.numel), at);
        return;
      }
    }
    scratch_.resize(pi.numel);
    accumulate(scratch_.data(), src, pi.numel, true, inv_predivide_);
    acc.add(std::span<const G>(scratch_), at);
  }

  /// Reproducible mode: where `pi`'s gradient slot lies, or null while it has none.
  [[nodiscard]] G* slot_at(const param_info& pi) {
    if (!sharded_) return grads_.data() + pi.offset;
    const int k = bucket_buffer_[static_cast<std::size_t>(pi.bucket)];
    if (k < 0) return nullptr;
    return pool_[static_cast<std::size_t>(k)].data.data() +
           (pi.offset - plan_.buckets()[static_cast<std::size_t>(pi.bucket)].offset);
  }

  /// Reproducible mode: bucket b is complete for this micro-batch. Its slots' gradients join
  /// the accumulator (and a bucket buffer holding them is free again); on the last micro-batch
  /// the bucket's exact sum is reduced and rounded once into the gradients.
  void submit_exact(int b) {
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
    for (int p = bk.first_param; p < bk.first_param + bk.param_count; ++p)
      if (pending_[static_cast<std::size_t>(p)]) {
        const auto& pi = plan_.params()[static_cast<std::size_t>(p)];
        add_terms(pi, static_cast<const G*>(slot_at(pi)));
        pending_[static_cast<std::size_t>(p)] = false;
      }
    if (sharded_ && bucket_buffer_[static_cast<std::size_t>(b)] >= 0) {
      pool_[static_cast<std::size_t>(bucket_buffer_[static_cast<std::size_t>(b)])].bucket = -1;
      bucket_buffer_[static_cast<std::size_t>(b)] = -1;
    }
    if (micro_ + 1 < accumulation_) return;
    if constexpr (device) {
      reduce_exact_device(b);
      return;
    }
    work_.submit([this, b] {
      const auto& bucket = plan_.buckets()[static_cast<std::size_t>(b)];
      const trace::scope phase(comm_, "reduce", bucket.padded * sizeof(G));
      auto& acc = accs_[static_cast<std::size_t>(b)];
      std::span<G> flat(grads_.data() + bucket.offset, sharded_ ? 0 : bucket.padded);
      if (!sharded_ && replicate_ == nullptr) {
        ringzero::detail::combine_accumulators(comm_, acc, flat, 1, all_reduce_);
      } else {
        std::span<G> own =
            sharded_ ? std::span<G>(grads_.data() + bucket.shard_offset, bucket.slice)
                     : flat.subspan(static_cast<std::size_t>(rank_) * bucket.slice, bucket.slice);
        ringzero::detail::combine_accumulators(comm_, replicate_, acc, own, 1, reduce_scatter_);
        if (!sharded_) ringzero::all_gather(comm_, std::span<const G>(own), flat, all_gather_);
      }
      acc.clear();
    });
  }

  /// The collectives of the exact combine and norm on a device space: host vectors copied
  /// through device memory of the space, in the communication stream's order, since a device
  /// communicator (NCCL) moves nothing else. Each call is complete when it returns.
  class staged_collectives {
   public:
    explicit staged_collectives(gradient_reducer& r) : r_(r) {}
    template <class C, class T>
    void all_reduce(C& comm, std::span<T> values, op o, const ringzero::options& opt) const {
      const auto st = r_.space_.comm_stream();
      T* d = r_.template staging<T>(values.size());
      r_.space_.upload(st, d, values.data(), values.size());
      r_.space_.run_sync(
          st, [&] { ringzero::all_reduce(comm, std::span<T>(d, values.size()), o, opt); });
      r_.space_.download(st, values.data(), d, values.size());
    }
    template <class C, class T>
    void reduce_scatter(C& comm, std::span<const T> in, std::span<T> out, op o,
                        const ringzero::options& opt) const {
      const auto st = r_.space_.comm_stream();
      T* d = r_.template staging<T>(in.size() + out.size());
      r_.space_.upload(st, d, in.data(), in.size());
      r_.space_.run_sync(st, [&] {
        ringzero::reduce_scatter(comm, std::span<const T>(d, in.size()),
                                 std::span<T>(d + in.size(), out.size()), o, opt);
      });
      r_.space_.download(st, out.data(), d + in.size(), out.size());
    }

   private:
    gradient_reducer& r_;
  };

  /// Device memory for n elements of T, kept and grown for the staged collectives.
  template <class T>
  [[nodiscard]] T* staging(std::size_t n) {
    static_assert(alignof(T) <= alignof(std::int64_t));
    const std::size_t words = std::max<std::size_t>(1, (n * sizeof(T) + 7) / 8);
    if (staging_.size() < words) {
      space_.synchronize();  // the old buffer may still be read by a stream
      // With room to spare: the digits' length follows the data's windows from step to step.
      staging_ = space_.template allocate<std::int64_t>(words + words / 2);
    }
    return reinterpret_cast<T*>(staging_.data());
  }

  /// Reproducible mode on a device space, bucket b's last micro-batch: the exact combine on this
  /// thread through staged collectives, rounded on the host and copied into the gradients.
  void reduce_exact_device(int b) requires device {
    const auto& bucket = plan_.buckets()[static_cast<std::size_t>(b)];
    const trace::scope phase(comm_, "reduce", bucket.padded * sizeof(G));
    auto& acc = accs_[static_cast<std::size_t>(b)];
    const auto st = space_.comm_stream();
    const staged_collectives via(*this);
    if (!sharded_ && replicate_ == nullptr) {
      host_out_.resize(bucket.padded);
      ringzero::detail::combine_accumulators(comm_, acc, std::span<G>(host_out_), 1, all_reduce_,
                                             via);
      space_.upload(st, grads_.data() + bucket.offset, host_out_.data(), bucket.padded);
    } else {
      host_out_.resize(bucket.slice);
      ringzero::detail::combine_accumulators(comm_, replicate_, acc, std::span<G>(host_out_), 1,
                                             reduce_scatter_, via);
      G* own = grads_.data() +
               (sharded_ ? bucket.shard_offset
                         : bucket.offset + static_cast<std::size_t>(rank_) * bucket.slice);
      space_.upload(st, own, host_out_.data(), bucket.slice);
      if (!sharded_)
        space_.run_sync(st, [&] {
          ringzero::all_gather(comm_, std::span<const G>(own, bucket.slice),
                               std::span<G>(grads_.data() + bucket.offset, bucket.padded),
                               all_gather_);
        });
    }
    acc.clear();
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
    if (!sharded_) return grads_.data() + pi.offset;
    const auto b = static_cast<std::size_t>(pi.bucket);
    if (bucket_buffer_[b] < 0) acquire_buffer(pi.bucket);
    return pool_[static_cast<std::size_t>(bucket_buffer_[b])].data.data() +
           (pi.offset - plan_.buckets()[b].offset);
  }

  void reset_micro_batch() {
    std::fill(got_.begin(), got_.end(), 0);
    std::fill(missing_.begin(), missing_.end(), 0);
    for (const auto& pi : plan_.params()) missing_[static_cast<std::size_t>(pi.bucket)] += pi.uses;
    next_bucket_ = static_cast<int>(plan_.buckets().size()) - 1;
  }

  void add_buffer(buffer<G> b) {
    meter_.add(b.bytes());
    pool_.push_back({std::move(b), 0, -1});
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
    if constexpr (device) {
      // Every buffer is reusable in stream order: take the next one round the pool (the one
      // whose reduction was enqueued longest ago) and make the compute stream wait for it.
      int pick = -1;
      for (std::size_t i = 0; i < pool_.size() && pick < 0; ++i) {
        const std::size_t j = (next_pool_ + i) % pool_.size();
        if (pool_[j].bucket < 0) pick = static_cast<int>(j);
      }
      if (pick < 0) {
        log::warn(
            "zero: gradients arrive for {} buckets at once; adding a gradient buffer "
            "(hand gradients over in backward order, or raise reduce_buffers)",
            pool_.size() + 1);
        add_buffer(space_.template allocate_local<G>(plan_.max_bucket()));
        pick = static_cast<int>(pool_.size()) - 1;
      }
      next_pool_ = (static_cast<std::size_t>(pick) + 1) % pool_.size();
      auto& e = pool_[static_cast<std::size_t>(pick)];
      const auto compute = space_.compute_stream();
      space_.wait(compute, e.done);
      space_.zero(compute, e.data.data(), e.data.size());
      e.bucket = b;
      bucket_buffer_[static_cast<std::size_t>(b)] = pick;
      return;
    }
    int pick = -1;
    for (std::size_t i = 0; i < pool_.size() && pick < 0; ++i)
      if (pool_[i].bucket < 0 && work_.done(pool_[i].busy)) pick = static_cast<int>(i);
    if (pick < 0) {
      for (std::size_t i = 0; i < pool_.size(); ++i)
        if (pool_[i].bucket < 0 &&
            (pick < 0 || pool_[i].busy < pool_[static_cast<std::size_t>(pick)].busy))
          pick = static_cast<int>(i);
      if (pick >= 0) work_.wait(pool_[static_cast<std::size_t>(pick)].busy);
    }
    if (pick < 0) {
      log::warn(
          "zero: gradients arrive for {} buckets at once; adding a gradient buffer "
          "(hand gradients over in backward order, or raise reduce_buffers)",
          pool_.size() + 1);
      add_buffer(space_.template allocate_local<G>(plan_.max_bucket()));
      pick = static_cast<int>(pool_.size()) - 1;
    }
    auto& e = pool_[static_cast<std::size_t>(pick)];
    std::fill_n(e.data.data(), e.data.size(), G{});
    e.bucket = b;
    bucket_buffer_[static_cast<std::size_t>(b)] = pick;
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
  detail::buffer_meter& meter_;
  Space space_;      // the gradients' and bucket buffers' memory
  buffer<G> grads_;  // flat (padded_size) or this rank's shard (shard_size)
  std::vector<pool_entry> pool_;
  std::vector<int> bucket_buffer_;
  std::vector<int> missing_;  // gradients (one per use of each parameter) a bucket still awaits
  std::vector<int> got_;      // gradients of each parameter handed over this micro-batch
  std::vector<bool> slot_zeroed_;    // slot() zeroed the parameter's flat gradient this step
  std::vector<device_run<G>> runs_;  // device spaces: the step's segments for the statistics
  // Reproducible mode: each bucket's exact sum of the step's gradients, a gradient converted to G
  // on its way there, and which parameters' slots are still to be added.
  std::vector<reproducible::accumulator<G>> accs_;
  // Reproducible mode on a device space: host copies of gradients coming in (any type, so
  // int64-aligned words) and of results going out, and the staged collectives' device memory.
  std::vector<std::uint64_t> host_in_;
  std::vector<G> host_out_;
  buffer<std::int64_t> staging_;
  std::vector<G> scratch_;
  std::vector<bool> pending_;
  int next_bucket_ = -1;
  int micro_ = 0;
  std::size_t next_pool_ = 0;  // device spaces: the buffer to try first
};

}  // namespace ringzero::zero
