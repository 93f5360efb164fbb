// What a rank holds of the weights: the parameters in their training type (all of them, or in
// stage 3 only its shard) and the fp32 optimizer state of the elements it updates (its shard, or
// in stage 0 everything), each addressed per segment as the stage lays the buffers out. Setting
// parameters, the optimizer update, the post-step all_gather, full_parameters() and checkpoints
// all reach the weights through this one place, so a stage changes where an element lives, never
// how it is updated.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/zero/device_space.hpp"
#include "ringzero/zero/memory_space.hpp"
#include "ringzero/zero/optimizer.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/plan.hpp"
#include "ringzero/zero/stage.hpp"

namespace ringzero::zero {

/// On a device space (device_space.hpp) every array lives in device memory and every access below
/// is enqueued on the space's communication stream; the methods that hand values to or from the
/// host (set, full_parameters, own_array, restore) copy through the space.
template <class P, memory_space Space = host_space>
class model_state {
 public:
  static constexpr bool device = on_device<Space>;
  using optimizer_type = std::conditional_t<device, device_optimizer<P, Space>, shard_optimizer<P>>;

  /// The state of rank `rank` under `plan` (which must outlive it), laid out for `stage`, with
  /// every parameter and all optimizer state zero. The parameters, which collectives read and
  /// write, are allocated in `space` (one allocation); the optimizer state in host memory, or on
  /// a device space in its memory.
  model_state(const partition_plan& plan, const stage_layout& stage, int rank,
              const optimizer_options& optimizer, const Space& space = Space{})
      : plan_(plan),
        stage_(stage),
        rank_(rank),
        own_(plan.segments(rank)),
        local_(stage.sharded_optimizer ? own_ : plan.all_segments()),
        space_(space),
        params_(space.template allocate<P>(stage.sharded_parameters ? plan.shard_size()
                                                                    : plan.padded_size())),
        optimizer_(make_optimizer(
            optimizer, stage.sharded_optimizer ? plan.shard_size() : plan.padded_size(), space)) {}

  // The parameter cache keeps a view of the parameter buffer: it must never move.
  model_state(const model_state&) = delete;
  model_state& operator=(const model_state&) = delete;

  [[nodiscard]] const partition_plan& plan() const noexcept { return plan_; }
  [[nodiscard]] const stage_layout& stage() const noexcept { return stage_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// What this rank owns, in shard order.
  [[nodiscard]] const std::vector<segment>& own() const noexcept { return own_; }
  /// What this rank's optimizer updates: own(), or every segment (stage 0).
  [[nodiscard]] const std::vector<segment>& local() const noexcept { return local_; }
  /// The parameters: the full flat buffer (stages 0-2, padded_size()) or this rank's shard
  /// (stage 3, shard_size()).
  [[nodiscard]] std::span<const P> parameters() const noexcept { return params_.span(); }
  /// Whether the parameters lie in symmetric memory.
  [[nodiscard]] bool symmetric() const noexcept { return params_.symmetric(); }
  [[nodiscard]] const optimizer_type& optimizer() const noexcept { return optimizer_; }

  /// Sets parameter `id` from its plan.params()[id].numel fp32 values: its parameters where this
  /// rank holds them whole, and its master weights wherever this rank updates it.
  void set(int id, std::span<const float> values) noexcept(!device) {
    const auto& pi = plan_.params()[static_cast<std::size_t>(id)];
    if constexpr (device) {
      const auto s = space_.comm_stream();
      if (!stage_.sharded_parameters)
        space_.set_values(s, params_.data() + pi.offset, nullptr, values.data(), pi.numel);
      for (const auto& g : local_)
        if (g.param == id)
          space_.set_values(s, param_ptr(g), optimizer_type::has_master ? master_ptr(g) : nullptr,
                            values.data() + g.begin, g.count);
    } else {
      if (!stage_.sharded_parameters)
        for (std::size_t i = 0; i < pi.numel; ++i) params_[pi.offset + i] = to_param<P>(values[i]);
      for (const auto& s : local_)
        if (s.param == id)
          optimizer_.set(local_of(s), param_ptr(s), values.data() + s.begin, s.count);
    }
  }

  /// One optimizer step over segment `s` (one of local()) with its gradients `grad`.
  template <class G>
  void update(const segment& s, const G* grad, const step_constants& k, bool decay) noexcept
      requires(!device) {
    optimizer_.update(grad, local_of(s), param_ptr(s), s.count, k, decay);
  }

  /// One optimizer step over every segment of local() that `skip(s)` does not exclude, with the
  /// gradients `grad_of(s)` and the constants `ks[group(s)]`. On a device space each group's
  /// segments are one multi-tensor launch on the communication stream.
  template <class GradOf, class Skip>
  void update_all(GradOf&& grad_of, const std::vector<step_constants>& ks, Skip&& skip) {
    if constexpr (!device) {
      for (const auto& s : local_) {
        if (skip(s)) continue;
        const auto& pi = plan_.params()[static_cast<std::size_t>(s.param)];
        update(s, grad_of(s), ks[static_cast<std::size_t>(pi.group)], pi.weight_decay);
      }
    } else {
      using G = std::remove_cv_t<std::remove_pointer_t<decltype(grad_of(local_.front()))>>;
      std::vector<std::vector<device_segment<P, G>>> per_group(ks.size());
      for (const auto& s : local_) {
        if (skip(s)) continue;
        const auto& pi = plan_.params()[static_cast<std::size_t>(s.param)];
        per_group[static_cast<std::size_t>(pi.group)].push_back(
            {grad_of(s), master_ptr(s), optimizer_.moment(1, local_of(s)),
             optimizer_.moment_count() > 1 ? optimizer_.moment(2, local_of(s)) : nullptr,
             param_ptr(s), s.count, pi.weight_decay});
      }
      for (std::size_t g = 0; g < per_group.size(); ++g)
        space_.optimizer_step(space_.comm_stream(), optimizer_.kind(),
                              std::span<const device_segment<P, G>>(per_group[g]), ks[g]);
    }
  }

  /// Stages 1-2, after every rank updated its slice of the full parameters: shares the slices
  /// (an all_gather per bucket). Nothing to do in stages 0 and 3. `run(f)` calls f(comm) in line
  /// with the caller's other collectives; `gather` is the all_gather's options.
  template <class Run>
  void share_updates(Run&& run, const ringzero::options& gather) {
    if (!stage_.gather_after_step) return;
    if constexpr (device) {
      // Enqueued behind the update on the communication stream; nothing waits on the host.
      run([&](auto& c) {
        for (const auto& b : plan_.buckets()) {
          std::span<P> all(params_.data() + b.offset, b.padded);
          std::span<const P> mine = all.subspan(static_cast<std::size_t>(rank_) * b.slice, b.slice);
          space_.enqueue(space_.comm_stream(), [c = &c, mine, all, gather](auto on) {
            ringzero::all_gather(*c, mine, all, on(gather));
          });
        }
      });
    } else {
      run([&](auto& c) {
        for (const auto& b : plan_.buckets()) {
          std::span<P> all(params_.data() + b.offset, b.padded);
          ringzero::all_gather(
              c,
              std::span<const P>(all.subspan(static_cast<std::size_t>(rank_) * b.slice, b.slice)),
              all, gather);
        }
      });
    }
  }

  /// Every parameter's fp32 master value, concatenated in registration order. Collective where
  /// the optimizer state is sharded (an all_gather per bucket, through `run` as for
  /// share_updates); stage 0 holds it all.
  template <class Run>
  [[nodiscard]] std::vector<float> full_parameters(Run&& run, const ringzero::options& gather) {
    std::vector<float> flat(plan_.padded_size());
    if constexpr (device) {
      const std::vector<float> local = local_array(0);
      if (!stage_.sharded_optimizer) {
        for (const auto& s : local_)
          std::copy_n(local.begin() + static_cast<std::ptrdiff_t>(local_of(s)), s.count,
                      flat.begin() + static_cast<std::ptrdiff_t>(s.flat_offset));
        return plan_.unpadded(flat);
      }
      // The shards are all_gathered on the device (a collective may need device buffers, as
      // NCCL does), then the whole copied back once.
      const std::vector<float> mine = own_array(0);
      const auto st = space_.comm_stream();
      buffer<float> dmine = space_.template allocate_local<float>(mine.size());
      buffer<float> dflat = space_.template allocate_local<float>(flat.size());
      space_.upload(st, dmine.data(), mine.data(), mine.size());
      run([&](auto& c) {
        for (const auto& b : plan_.buckets()) {
          std::span<const float> in(dmine.data() + b.shard_offset, b.slice);
          std::span<float> out(dflat.data() + b.offset, b.padded);
          space_.enqueue(st, [c = &c, in, out, gather](auto on) {
            ringzero::all_gather(*c, in, out, on(gather));
          });
        }
      });
      space_.download(st, flat.data(), dflat.data(), flat.size());
    } else {
      if (!stage_.sharded_optimizer) {
        for (const auto& s : local_)
          std::copy_n(master_ptr(s), s.count,
                      flat.begin() + static_cast<std::ptrdiff_t>(s.flat_offset));
        return plan_.unpadded(flat);
      }
      const std::vector<float> mine = own_array(0);
      run([&](auto& c) {
        for (const auto& b : plan_.buckets())
          ringzero::all_gather(c, std::span<const float>(mine.data() + b.shard_offset, b.slice),
                               std::span<float>(flat.data() + b.offset, b.padded), gather);
      });
    }
    return plan_.unpadded(flat);
  }

  /// This rank's shard of the master weights (which = 0) or of optimizer moment 1 or 2, in the
  /// checkpoint layout (plan.shard_size() elements, padding zero).
  [[nodiscard]] std::vector<float> own_array(int which) {
    std::vector<float> out(plan_.shard_size(), 0.0f);
    if constexpr (device) {
      const std::vector<float> local = local_array(which);
      for (const auto& s : own_)
        std::copy_n(local.begin() + static_cast<std::ptrdiff_t>(local_of(s)), s.count,
                    out.begin() + static_cast<std::ptrdiff_t>(s.shard_offset));
    } else {
      for (const auto& s : own_) {
        const float* src = which == 0 ? master_ptr(s) : optimizer_.moment(which, local_of(s));
        std::copy_n(src, s.count, out.begin() + static_cast<std::ptrdiff_t>(s.shard_offset));
      }
    }
    return out;
  }

  /// Replaces the fp32 state with arrays staged at local positions (a checkpoint load that passed
  /// every check): the master weights (the parameters become them rounded to P) and the moments,
  /// which are taken over (`m2` empty for SGD).
  void restore(const std::vector<float>& master, std::vector<float>& m1,
               std::vector<float>& m2) noexcept(!device) {
    if constexpr (device) {
      const auto st = space_.comm_stream();
      for (const auto& s : local_)
        space_.set_values(st, param_ptr(s), optimizer_type::has_master ? master_ptr(s) : nullptr,
                          master.data() + local_of(s), s.count);
      space_.upload(st, optimizer_.moment(1, 0), m1.data(),
                    std::min(m1.size(), optimizer_.local_size()));
      if (optimizer_.moment_count() > 1)
        space_.upload(st, optimizer_.moment(2, 0), m2.data(),
                      std::min(m2.size(), optimizer_.local_size()));
    } else {
      for (const auto& s : local_)
        optimizer_.set(local_of(s), param_ptr(s), master.data() + local_of(s), s.count);
      optimizer_.replace_moments(m1, m2);
    }
  }

  /// Where a segment's optimizer state lives: its local position.
  [[nodiscard]] std::size_t local_of(const segment& s) const noexcept {
    return stage_.sharded_optimizer ? s.shard_offset : s.flat_offset;
  }

  [[nodiscard]] const Space& space() const noexcept { return space_; }

  /// Bytes of the parameter buffer.
  [[nodiscard]] std::size_t parameter_bytes() const noexcept { return params_.bytes(); }
  /// The fp32 optimizer state (master weights where P is 16-bit, and the moments): what a step
  /// or a checkpoint of it touches, for the trace.
  [[nodiscard]] std::size_t optimizer_bytes() const noexcept {
    const std::size_t arrays = static_cast<std::size_t>(optimizer_.moment_count()) +
                               (shard_optimizer<P>::has_master ? 1 : 0);
    return optimizer_.local_size() * arrays * sizeof(float);
  }

 private:
  static optimizer_type make_optimizer(const optimizer_options& o, std::size_t n,
                                       const Space& space) {
    if constexpr (device)
      return optimizer_type(o, n, space);
    else
      return optimizer_type(o, n);
  }

  /// Device spaces: the master weights (which = 0) or a moment, copied to the host whole and
  /// indexed by local position (an fp32 parameter is its own master: the parameters at the
  /// positions param_ptr gives are moved to local positions).
  [[nodiscard]] std::vector<float> local_array(int which) requires device {
    const auto st = space_.comm_stream();
    std::vector<float> local(optimizer_.local_size(), 0.0f);
    if (which != 0 || optimizer_type::has_master) {
      space_.download(st, local.data(),
                      which == 0 ? optimizer_.master(0, nullptr) : optimizer_.moment(which, 0),
                      local.size());
      return local;
    }
    std::vector<P> params(params_.size());
    space_.download(st, params.data(), params_.data(), params.size());
    for (const auto& s : local_)
      for (std::size_t k = 0; k < s.count; ++k)
        local[local_of(s) + k] =
            static_cast<float>(params[static_cast<std::size_t>(param_ptr(s) - params_.data()) + k]);
    return local;
  }

  [[nodiscard]] P* param_ptr(const segment& s) noexcept {
    return params_.data() + (stage_.sharded_parameters ? s.shard_offset : s.flat_offset);
  }
  [[nodiscard]] float* master_ptr(const segment& s) noexcept {
    return optimizer_.master(local_of(s), param_ptr(s));
  }

  const partition_plan& plan_;
  stage_layout stage_;
  int rank_;
  std::vector<segment> own_;
  std::vector<segment> local_;
  Space space_;
  buffer<P> params_;
  optimizer_type optimizer_;
};

}  // namespace ringzero::zero
