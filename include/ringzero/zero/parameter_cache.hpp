// The stage-3 parameter cache: each rank keeps only its shard of the parameters, and the cache
// all_gathers a bucket's full parameters when a layer in it is used, prefetches the next buckets
// in the pass's direction within a byte bound, and frees what the pass has left behind. Gathers
// run on the communication thread, so gathering bucket k+1 overlaps computing with bucket k.
//
// A bucket stays while a handle holds it. After the optimizer updated the shard, refresh() drops
// every unheld bucket and gathers every held one again in place: no gathered copy outlives a step
// with stale values. A gathered_parameters handle holds its bucket for as long as it lives.
//
// With hpZ (config::zero_hpz_partition_size, zero/zeropp.hpp) every gather of the whole shard
// group also keeps this rank's piece of the bucket in the secondary shard, and a backward or
// recompute gather of a bucket whose pieces are fresh gathers them inside the hpZ group instead.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/trace.hpp"
#include "ringzero/zero/detail/buffer_meter.hpp"
#include "ringzero/zero/detail/worker.hpp"
#include "ringzero/zero/device_space.hpp"
#include "ringzero/zero/memory_space.hpp"
#include "ringzero/zero/plan.hpp"
#include "ringzero/zero/zeropp.hpp"

namespace ringzero::zero {

/// Which way a pass walks the layers. forward and backward prefetch the next buckets in their
/// direction and free the buckets behind them; recompute (a forward made again inside backward,
/// for activation recomputation) neither prefetches nor frees, so what backward has prefetched
/// stays.
enum class pass : std::uint8_t { forward, backward, recompute };

[[nodiscard]] constexpr std::string_view pass_name(pass p) noexcept {
  switch (p) {
    case pass::forward:
      return "forward";
    case pass::backward:
      return "backward";
    case pass::recompute:
      return "recompute";
  }
  return "unknown";
}

// On a device space (device_space.hpp) gathered buckets are device memory, freed in
// compute-stream order; a gather is enqueued on the communication stream behind the compute
// stream's current point (a bucket gathered again in place may still be read there), and acquire
// makes the compute stream wait for it instead of the host.
template <class Comm, class P, memory_space Space = host_space>
class parameter_cache {
 public:
  static constexpr bool device = on_device<Space>;

  /// `shard` is this rank's parameter shard (plan.shard_size() elements). max_bytes = 0: two of
  /// the largest bucket. `comm`, `plan`, `shard`'s storage, `work` and `meter` must outlive the
  /// cache; `work` may be constructed after it. `hpz` > 1: a secondary shard over groups of that
  /// many ranks (collective over `comm`: it splits it).
  parameter_cache(Comm& comm, const partition_plan& plan, std::span<const P> shard,
                  const ringzero::options& all_gather, std::size_t max_bytes, detail::worker& work,
                  detail::buffer_meter& meter, const Space& space = Space{}, int hpz = 0)
      : secondary_(make_secondary(comm, plan, hpz, all_gather)),
        comm_(comm),
        plan_(plan),
        shard_(shard),
        all_gather_(all_gather),
        max_bytes_(max_bytes ? max_bytes : 2 * plan.max_bucket() * sizeof(P)),
        work_(work),
        meter_(meter),
        space_(space),
        buckets_(plan.buckets().size()) {}

  parameter_cache(const parameter_cache&) = delete;
  parameter_cache& operator=(const parameter_cache&) = delete;

  /// Makes bucket b present, and the buckets `with` too (those of parameters the layer shares
  /// with others), takes a reference on each, and returns bucket b's full parameters (its padded
  /// extent of the flat buffer; data() gives the others'). Every rank must make the same calls.
  [[nodiscard]] const P* acquire(int b, pass direction, std::span<const int> with = {}) {
    const int nb = static_cast<int>(buckets_.size());
    const auto needed = [&](int c) {
      return c == b || std::find(with.begin(), with.end(), c) != with.end();
    };
    if (direction != pass::recompute) {
      const int dir = direction == pass::forward ? 1 : -1;
      for (int c = 0; c < nb; ++c) {
        auto& g = buckets_[static_cast<std::size_t>(c)];
        if (g.resident && g.refs == 0 && !needed(c) && (dir > 0 ? c < b : c > b)) evict(c);
      }
      start(b, direction);
      for (int c : with) start(c, direction);
      for (int c = b + dir; c >= 0 && c < nb; c += dir) {
        if (buckets_[static_cast<std::size_t>(c)].resident) continue;
        if (bytes_ + bucket_bytes(c) > max_bytes_) break;
        start(c, direction);
      }
    } else {
      start(b, direction);
      for (int c : with) start(c, direction);
    }
    auto& g = buckets_[static_cast<std::size_t>(b)];
    if constexpr (device) {
      space_.wait(space_.compute_stream(), g.ready);
      for (int c : with)
        space_.wait(space_.compute_stream(), buckets_[static_cast<std::size_t>(c)].ready);
    } else {
      const trace::scope phase(comm_, "gather", bucket_bytes(b));
      work_.wait(g.ticket);
      for (int c : with) work_.wait(buckets_[static_cast<std::size_t>(c)].ticket);
    }
    ++g.refs;
    for (int c : with) ++buckets_[static_cast<std::size_t>(c)].refs;
    return data(b);
  }

  /// RINGZERO_CHECK=1: before a gather, every rank compares what it is about to gather (the
  /// gather's sequence number, layer, bucket and pass) with every other rank's, so a rank that
  /// gathers another layer, or skips one, raises mismatch_error on every rank instead of
  /// pairing its all_gathers with the wrong ones. A rank in another collective meanwhile meets
  /// this exchange in that collective's own check. Costs one small all_gather per gather.
  void check_agreement(int layer, pass direction) {
    const std::uint64_t seq = sequence_++;
    if (comm_.size() == 1 || !ringzero::detail::check_enabled()) return;
    const auto& layers = plan_.layers();
    const auto n = static_cast<std::size_t>(comm_.size());
    const std::array<std::uint64_t, 4> mine{
        seq, static_cast<std::uint64_t>(layer),
        static_cast<std::uint64_t>(layers[static_cast<std::size_t>(layer)].bucket),
        static_cast<std::uint64_t>(direction)};
    std::vector<std::uint64_t> all(mine.size() * n);
    const ringzero::options opt{.timeout = all_gather_.timeout};
    const auto describe = [&](std::size_t r) {
      const std::uint64_t* e = all.data() + r * mine.size();  // as `mine` is laid out
      const std::string_view name =
          e[1] < layers.size() ? std::string_view(layers[e[1]].name) : std::string_view("?");
      return fmt::format("layer {} '{}' (bucket {}, {} pass, gather #{})", e[1], name, e[2],
                         pass_name(static_cast<pass>(e[3])), e[0]);
    };
    const auto exchange = [&] {
      try {
        ringzero::all_gather(comm_, std::span<const std::uint64_t>(mine),
                             std::span<std::uint64_t>(all), opt);
      } catch (const mismatch_error& e) {
        // The collective's message, without the prefix the new error adds again.
        throw mismatch_error(fmt::format("{} (rank {} was gathering layer '{}')",
                                         std::string_view(e.what()).substr(sizeof "ringzero: " - 1),
                                         comm_.rank(),
                                         layers[static_cast<std::size_t>(layer)].name));
      }
      const auto entry = [&](std::size_t r) {
        return std::span<const std::uint64_t>(all).subspan(r * mine.size(), mine.size());
      };
      for (std::size_t r = 1; r < n; ++r)
        if (!std::ranges::equal(entry(r), entry(0)))
          throw mismatch_error(fmt::format(
              "RINGZERO_CHECK: zero stage-3 gather: rank 0 gathers {} but rank {} gathers {}",
              describe(0), r, describe(r)));
    };
    // In line with the gathers: on the communication thread, or a device's communication stream.
    if constexpr (device)
      space_.run_sync(space_.comm_stream(), exchange);
    else
      work_.wait(work_.submit(exchange));
  }

  void release(int b) noexcept { --buckets_[static_cast<std::size_t>(b)].refs; }

  [[nodiscard]] bool resident(int b) const noexcept {
    return buckets_[static_cast<std::size_t>(b)].resident;
  }
  /// Bucket b's full parameters while it is resident.
  [[nodiscard]] const P* data(int b) const noexcept {
    if constexpr (device)
      return buckets_[static_cast<std::size_t>(b)].dev.data();
    else
      return buckets_[static_cast<std::size_t>(b)].data.data();
  }
  [[nodiscard]] int references(int b) const noexcept {
    return buckets_[static_cast<std::size_t>(b)].refs;
  }
  [[nodiscard]] bool any_held() const noexcept {
    for (const auto& g : buckets_)
      if (g.refs != 0) return true;
    return false;
  }
  /// Bytes of gathered parameters now.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::size_t max_bytes() const noexcept { return max_bytes_; }

  /// hpZ's secondary copy, in bytes (0 without hpZ).
  [[nodiscard]] std::size_t secondary_bytes() const noexcept {
    return secondary_ ? secondary_->bytes() : 0;
  }

  /// Frees every bucket no handle holds. Called where the shard may change next (set_parameter,
  /// load), so hpZ's pieces are stale from here.
  void evict_unreferenced() {
    if (secondary_) secondary_->invalidate();
    for (int b = 0; b < static_cast<int>(buckets_.size()); ++b)
      if (buckets_[static_cast<std::size_t>(b)].refs == 0) evict(b);
  }

  /// Waits for every gather in flight. A prefetch reads the shard, so call this (the sharder
  /// drains its worker instead) before the optimizer writes to the shard.
  void settle() {
    if constexpr (device) return;  // the optimizer runs behind the gathers on their stream
    for (const auto& g : buckets_)
      if (g.resident) work_.wait(g.ticket);
  }

  /// After the shard changed: unheld buckets are freed (the next acquire gathers anew), held ones
  /// are gathered again in place, so their handles see the new values. Every rank holds the same
  /// buckets (it made the same calls), so the gathers meet.
  void refresh() {
    if (secondary_) secondary_->invalidate();
    for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
      auto& g = buckets_[static_cast<std::size_t>(b)];
      if (!g.resident) continue;
      if (g.refs == 0) {
        evict(b);
        continue;
      }
      work_.wait(g.ticket);
      submit_gather(b, pass::forward);
    }
    work_.drain();
  }

 private:
  struct bucket_state {
    std::vector<P> data;  // host memory
    buffer<P> dev;        // device spaces
    detail::worker::ticket ticket = 0;
    typename device_traits<Space>::event ready{};  // device spaces: the gather's end
    int refs = 0;
    bool resident = false;
  };

  [[nodiscard]] std::size_t bucket_bytes(int b) const noexcept {
    return plan_.buckets()[static_cast<std::size_t>(b)].padded * sizeof(P);
  }

  void submit_gather(int b, pass direction) {
    auto& g = buckets_[static_cast<std::size_t>(b)];
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
    std::span<const P> in = shard_.subspan(bk.shard_offset, bk.slice);
    if constexpr (device) {
      const auto comm_stream = space_.comm_stream();
      space_.wait(comm_stream, space_.record(space_.compute_stream()));
      space_.enqueue(comm_stream, [this, in, out = g.dev.span()](auto on) {
        ringzero::all_gather(comm_, in, out, on(all_gather_));
      });
      g.ready = space_.record(comm_stream);
      return;
    }
    std::span<P> out(g.data);
    const bool from_group = direction != pass::forward;
    g.ticket = work_.submit([this, b, in, out, from_group] {
      if (from_group && secondary_ && secondary_->gather(b, out)) return;
      ringzero::all_gather(comm_, in, out, all_gather_);
      if (secondary_) secondary_->keep(b, out);
    });
  }

  [[nodiscard]] static std::optional<secondary_shard<Comm, P>> make_secondary(
      Comm& comm, const partition_plan& plan, int hpz, const ringzero::options& all_gather) {
    if (hpz <= 1) return std::nullopt;
    return std::optional<secondary_shard<Comm, P>>(std::in_place, comm, plan, hpz, all_gather);
  }

  void start(int b, pass direction) {
    auto& g = buckets_[static_cast<std::size_t>(b)];
    if (g.resident) return;
    // The all_gather writes every element of the padded bucket: nothing to zero first.
    if constexpr (device)
      g.dev = space_.template allocate_ordered<P>(
          plan_.buckets()[static_cast<std::size_t>(b)].padded, fill::uninitialized);
    else
      g.data.resize(plan_.buckets()[static_cast<std::size_t>(b)].padded);
    g.resident = true;
    bytes_ += bucket_bytes(b);
    meter_.add(bucket_bytes(b));
    submit_gather(b, direction);
  }

  void evict(int b) {
    auto& g = buckets_[static_cast<std::size_t>(b)];
    if (!g.resident) return;
    if constexpr (device) {
      // Freed in compute-stream order, once the compute stream has the gather behind it.
      space_.wait(space_.compute_stream(), g.ready);
      g.dev = buffer<P>{};
    } else {
      work_.wait(g.ticket);
      std::vector<P>().swap(g.data);
    }
    g.resident = false;
    bytes_ -= bucket_bytes(b);
    meter_.remove(bucket_bytes(b));
  }

  std::optional<secondary_shard<Comm, P>> secondary_;  // hpZ; first: the split is collective
  Comm& comm_;
  const partition_plan& plan_;
  std::span<const P> shard_;
  ringzero::options all_gather_;
  std::size_t max_bytes_;
  detail::worker& work_;
  detail::buffer_meter& meter_;
  Space space_;
  std::vector<bucket_state> buckets_;
  std::size_t bytes_ = 0;
  std::uint64_t sequence_ = 0;  // gathers so far: what RINGZERO_CHECK compares them by
};

/// The parameters of one bucket, present while the handle exists: what the sharder's gather()
/// returns. A handle of bucket -1 views the whole flat buffer (stages 0-2, where every parameter
/// is always present) and holds nothing.
template <class Comm, class P, class Space = host_space>
class gathered_parameters {
 public:
  /// Holds bucket `bucket` of `cache` (acquired, released when the handle goes), whose full
  /// parameters start at `base`, flat position `base_offset`, and the buckets `shared` (acquired
  /// with it: those of parameters the layer shares); with bucket -1, no bucket. `plan` and
  /// `cache` must outlive the handle.
  gathered_parameters(const partition_plan& plan, parameter_cache<Comm, P, Space>* cache,
                      int bucket, const P* base, std::size_t base_offset,
                      std::span<const int> shared = {}) noexcept
      : plan_(&plan),
        cache_(cache),
        bucket_(bucket),
        base_(base),
        base_offset_(base_offset),
        shared_(shared) {}
  gathered_parameters(gathered_parameters&& o) noexcept
      : plan_(std::exchange(o.plan_, nullptr)),
        cache_(o.cache_),
        bucket_(o.bucket_),
        base_(o.base_),
        base_offset_(o.base_offset_),
        shared_(o.shared_) {}
  gathered_parameters& operator=(gathered_parameters&& o) noexcept {
    if (this != &o) {
      release();
      plan_ = std::exchange(o.plan_, nullptr);
      cache_ = o.cache_;
      bucket_ = o.bucket_;
      base_ = o.base_;
      base_offset_ = o.base_offset_;
      shared_ = o.shared_;
    }
    return *this;
  }
  gathered_parameters(const gathered_parameters&) = delete;
  gathered_parameters& operator=(const gathered_parameters&) = delete;
  ~gathered_parameters() { release(); }

  /// The full value of parameter `id`, which must lie in a bucket the handle holds.
  [[nodiscard]] std::span<const P> param(int id) const {
    if (plan_ == nullptr) throw invalid_argument("gathered::param on a released handle");
    if (id < 0 || static_cast<std::size_t>(id) >= plan_->params().size())
      throw invalid_argument(
          fmt::format("gathered::param: parameter id {} of {}", id, plan_->params().size()));
    const auto& pi = plan_->params()[static_cast<std::size_t>(id)];
    if (bucket_ >= 0 && pi.bucket != bucket_ &&
        std::find(shared_.begin(), shared_.end(), pi.bucket) != shared_.end())
      return {cache_->data(pi.bucket) +
                  (pi.offset - plan_->buckets()[static_cast<std::size_t>(pi.bucket)].offset),
              pi.numel};
    if (bucket_ >= 0 && pi.bucket != bucket_)
      throw invalid_argument(
          fmt::format("gathered::param: {} lives in bucket {}, this handle holds bucket {}",
                      pi.name, pi.bucket, bucket_));
    return {base_ + (pi.offset - base_offset_), pi.numel};
  }

 private:
  void release() noexcept {
    if (plan_ != nullptr && bucket_ >= 0) {
      cache_->release(bucket_);
      for (int b : shared_) cache_->release(b);
    }
    plan_ = nullptr;
  }

  const partition_plan* plan_;  // null once released
  parameter_cache<Comm, P, Space>* cache_;
  int bucket_;
  const P* base_;
  std::size_t base_offset_;
  std::span<const int> shared_;  // the layer's shared_buckets, in the plan
};

}  // namespace ringzero::zero
