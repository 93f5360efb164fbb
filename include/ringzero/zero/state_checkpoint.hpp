// A rank's training state in a checkpoint: what the sharder's save() writes through
// checkpoint.hpp (this rank's shard of the master weights and moments, the step counts, the loss
// scale, each group's learning rate) and how load() puts a checkpoint of any world size and stage
// back into this rank's layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "ringzero/types.hpp"
#include "ringzero/zero/checkpoint.hpp"
#include "ringzero/zero/model_state.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/step.hpp"

namespace ringzero::zero {

/// Collective: writes `state` and `steps` (trained with `cfg`) as a checkpoint into `dir`, and
/// reports the bytes of this rank's shard file to `on_written`. `run(f)` calls f(comm) in line
/// with the caller's other collectives. Raises checkpoint_error on every rank if any rank fails;
/// the checkpoint `dir` held before stays loadable.
template <class P, class Space, class Run, class OnWritten>
void save_state(Run&& run, const config& cfg, const std::filesystem::path& dir,
                model_state<P, Space>& state, const stepper& steps, OnWritten&& on_written) {
  const auto& plan = state.plan();
  save_checkpoint(
      run, cfg.collectives.all_gather, dir, plan, state.rank(), steps.step_count(),
      [&] {
        std::vector<std::vector<float>> arrays;
        for (int a = 0; a <= state.optimizer().moment_count(); ++a)
          arrays.push_back(state.own_array(a));
        return arrays;
      },
      [&](std::span<const std::uint64_t> written) {
        return make_manifest(plan, state.stage().stage, dtype_of<P>(), cfg.optimizer.kind,
                             {steps.step_count(), steps.optimizer_steps(), steps.scaler().scale(),
                              steps.scaler().good_steps()},
                             saved_groups(cfg, steps.group_lr()), written);
      },
      on_written);
}

/// Collective: restores `state` and `steps` from the checkpoint in `dir`, saved at any world size
/// and stage, and returns its manifest. Raises checkpoint_error on every rank of `agree`'s
/// communicator, leaving both as they were, if any of them finds the checkpoint missing,
/// incomplete, corrupt or incompatible with this model. `run` as for save_state, over the ranks
/// `state` is sharded over; `agree` likewise, over every rank that loads (the world, under hybrid
/// sharding, where each group reads the checkpoint on its own).
template <class P, class Space, class Run, class Agree, class Source>
checkpoint_manifest load_state(Run&& run, Agree&& agree, const config& cfg, const Source& dir,
                               model_state<P, Space>& state, stepper& steps) {
  const auto& plan = state.plan();
  // Read into staging arrays laid out as the optimizer state, so a refused checkpoint leaves
  // the current state untouched.
  const std::size_t local_size = state.optimizer().local_size();
  std::vector<float> master(local_size), m1(local_size), m2(state.optimizer().moment_size(2));
  const checkpoint_manifest m = read_checkpoint(
      agree, cfg.collectives.all_gather, dir, plan, cfg.optimizer.kind,
      [&](const checkpoint_manifest& saved) {
        std::vector<checkpoint_reader::request> reqs;
        for (const auto& s : state.local()) {
          const int mp = saved.find(plan.params()[static_cast<std::size_t>(s.param)].name);
          const std::size_t l = state.local_of(s);
          reqs.push_back({mp, s.begin, s.count, 0, master.data() + l});
          reqs.push_back({mp, s.begin, s.count, 1, m1.data() + l});
          if (!m2.empty()) reqs.push_back({mp, s.begin, s.count, 2, m2.data() + l});
        }
        return reqs;
      });
  state.restore(master, m1, m2);
  state.share_updates(run, cfg.collectives.all_gather);
  steps.resume(m.step, m.optimizer_steps);
  if (m.precision == dtype::float16) steps.restore_loss_scale(m.loss_scale, m.good_steps);
  std::vector<float> lr = steps.group_lr();
  restore_groups(m, cfg, lr);
  for (std::size_t g = 0; g < lr.size(); ++g) steps.set_learning_rate(static_cast<int>(g), lr[g]);
  return m;
}

/// load_state with one communicator for reading and agreeing.
template <class P, class Space, class Run, class Source>
checkpoint_manifest load_state(Run&& run, const config& cfg, const Source& dir,
                               model_state<P, Space>& state, stepper& steps) {
  return load_state(run, run, cfg, dir, state, steps);
}

/// Collective: this rank's part of a checkpoint of `state`, in memory: the manifest (every
/// rank's) and this rank's shard file, as save_state would write them. File names carry the
/// step instead of a random save id, so every replica group names a shard alike.
template <class P, class Space, class Run>
[[nodiscard]] checkpoint_image snapshot_state(Run&& run, const config& cfg,
                                              model_state<P, Space>& state, const stepper& steps) {
  const auto& plan = state.plan();
  std::vector<std::vector<float>> arrays;
  for (int a = 0; a <= state.optimizer().moment_count(); ++a) arrays.push_back(state.own_array(a));
  const std::uint64_t step = steps.step_count();
  checkpoint_image img;
  auto bytes =
      detail::shard_image(state.rank(), plan.world_size(), step, arrays, plan.shard_size());
  const std::uint64_t mine[3] = {bytes.size(), detail::crc32c(bytes), step};
  std::vector<std::uint64_t> all(3 * static_cast<std::size_t>(plan.world_size()));
  run([&](auto& c) {
    ringzero::all_gather(c, std::span<const std::uint64_t>(mine), std::span<std::uint64_t>(all),
                         cfg.collectives.all_gather);
  });
  const checkpoint_manifest m = make_manifest(
      plan, state.stage().stage, dtype_of<P>(), cfg.optimizer.kind,
      {step, steps.optimizer_steps(), steps.scaler().scale(), steps.scaler().good_steps()},
      saved_groups(cfg, steps.group_lr()), all);
  img.manifest = m.serialize();
  img.files.emplace(m.shards[static_cast<std::size_t>(state.rank())].file, std::move(bytes));
  return img;
}

}  // namespace ringzero::zero
