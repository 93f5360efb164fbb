// A small synthetic training loop shared by the sharder and checkpoint tests. The "model" is a
// list of layers; the gradient of every element is the mean over a batch of samples of (w - target)
// plus a per-sample perturbation, read from the gathered parameters, so the trajectory depends on
// every update being applied correctly; the global batch is split over ranks and micro-batches, so
// the gradient is the same for every world size up to rounding.
#pragma once

#include <ringzero/transport/loopback.hpp>
#include <ringzero/zero/peer_snapshot.hpp>
#include <ringzero/zero/sharder.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace zt {

using ringzero::loopback::communicator;
namespace zero = ringzero::zero;

/// `group_of(layer, param)`, when given, puts each parameter in a group.
template <class P>
zero::model_layout make_layout(const std::vector<std::vector<std::size_t>>& layer_sizes,
                               const std::function<int(int, int)>& group_of = {}) {
  zero::model_layout l;
  int li = 0;
  for (const auto& layer : layer_sizes) {
    l.add_layer("layer" + std::to_string(li));
    int pi = 0;
    for (std::size_t n : layer) {
      // Every other parameter is exempt from weight decay, as biases are.
      const bool decay = pi % 2 == 0;
      l.add({.name = "l" + std::to_string(li) + ".p" + std::to_string(pi),
             .shape = {n},
             .type = ringzero::dtype_of<P>(),
             .weight_decay = decay,
             .group = group_of ? group_of(li, pi) : 0});
      ++pi;
    }
    ++li;
  }
  return l;
}

/// Deterministic value in [-1, 1) from a few integers.
inline float noise(std::uint64_t a, std::uint64_t b, std::uint64_t c, std::uint64_t d) {
  std::uint64_t x = a * 0x9e3779b97f4a7c15ull ^
                    (b + 0x632be59bd9b4e019ull) * 0xbf58476d1ce4e5b9ull ^
                    (c + 17) * 0x94d049bb133111ebull ^ (d + 3) * 0x2545f4914f6cdd1dull;
  x ^= x >> 31;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<double>(x >> 40) / static_cast<double>(1ull << 23)) - 1.0f;
}

inline float initial_value(int param, std::size_t i) {
  return 0.5f * noise(1, static_cast<std::uint64_t>(param), i, 0);
}

struct run_options {
  int world = 2;
  int stage = 2;
  int steps = 3;
  int accumulation = 1;
  float clip = 0.0f;
  zero::optimizer_kind optimizer = zero::optimizer_kind::adamw;
  std::size_t bucket_bytes = 256;
  bool comm_thread = true;
  float grad_multiplier = 1.0f;
  /// Called with (rank, step, param, gradient) before the gradient is handed over.
  std::function<void(int, int, int, std::vector<float>&)> poison;
  std::function<void(zero::config&)> configure;  ///< adjusts the configuration
  std::filesystem::path save_dir;                ///< save after the last step
  std::filesystem::path load_dir;  ///< load before the first step (steps count from there)
  /// If set: after the last step every rank takes a snapshot, keeps it with its ring peer
  /// (zero::keep_with_peer) and stores it here at its rank.
  std::vector<zero::checkpoint_image>* snapshots = nullptr;
  /// If set: before the first step the ranks gather the snapshot these images (one per rank)
  /// hold between them (zero::gather_snapshot) and load it; checkpoint_error if they cannot.
  const std::vector<zero::checkpoint_image>* load_snapshots = nullptr;
  /// Reads layer 0 between the last end_micro_batch() and step(), as logging or evaluation
  /// would; with hold_across_step the handle lives through step() and its values are recorded.
  bool gather_before_step = false;
  bool hold_across_step = false;
  int ranks_per_node = 0;  ///< loopback's simulated nodes (0: one node)
  /// Writes each gradient into gradient_slot<float>(p) and hands the slot over, instead of
  /// add_grad with a copy (needs gradients reduced in fp32).
  bool use_slots = false;
  /// The global batch as world * accumulation micro-batches of which each rank takes a
  /// contiguous run (reproducible training), instead of micro-batch m's samples spread over
  /// the ranks.
  bool contiguous = false;
  /// Device spaces: called on every rank after each step with the space's counters at the
  /// step's start (before its first micro-batch), just before step() and just after it.
  std::function<void(int rank, int step, const zero::device_counters& start,
                     const zero::device_counters& before, const zero::device_counters& after)>
      on_counters;
  /// Device spaces: memory of n floats, allocated on the trainer's thread, that each gradient is
  /// written into (as a trainer's kernel would) and handed over from; kept until the compute
  /// stream consumed it. Empty: gradients are handed over from host memory.
  std::function<std::shared_ptr<float[]>(std::size_t n)> device_gradient;
};

struct run_result {
  std::vector<std::vector<float>> params;   ///< full_parameters() of every rank at the end
  std::vector<zero::step_result> steps;     ///< rank 0's
  std::vector<zero::memory_report> memory;  ///< every rank's, at the end
  std::uint64_t step_count = 0;
  /// Every rank's layer-0 first parameter as a handle held across the last step() saw it.
  std::vector<std::vector<float>> held;
};

inline zero::config make_config(const run_options& o) {
  zero::config cfg;
  cfg.stage = o.stage;
  cfg.optimizer.kind = o.optimizer;
  cfg.optimizer.lr = o.optimizer == zero::optimizer_kind::adamw ? 0.05f : 0.1f;
  cfg.optimizer.weight_decay = 0.01f;
  cfg.bucket_bytes = o.bucket_bytes;
  cfg.accumulation_steps = o.accumulation;
  cfg.max_grad_norm = o.clip;
  cfg.comm_thread = o.comm_thread;
  cfg.scaling.initial = 1024.0f;
  cfg.scaling.growth_interval = 2;
  cfg.average_gradients = false;
  if (o.configure) o.configure(cfg);
  return cfg;
}

/// Samples per step; divisible by every world size times accumulation the tests use.
inline constexpr int batch = 24;

/// One rank's part of train(): trains a Sharder (a zero::sharder over `comm`, of o.world ranks)
/// and records this rank's outcome in `res` (sized for o.world ranks). `inspect(shd)` is called
/// once the sharder is constructed.
template <class Sharder, class Comm, class Inspect>
void train_rank(Comm& comm, const zero::model_layout& layout, const run_options& o, run_result& res,
                Inspect&& inspect) {
  Sharder shd(comm, layout, make_config(o));
  inspect(shd);
  const auto& plan = shd.plan();
  for (std::size_t p = 0; p < plan.params().size(); ++p) {
    std::vector<float> v(plan.params()[p].numel);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = initial_value(static_cast<int>(p), i);
    shd.set_parameter(static_cast<int>(p), v);
  }
  if (!o.load_dir.empty()) shd.load(o.load_dir);
  if (o.load_snapshots != nullptr) {
    zero::checkpoint_image img = (*o.load_snapshots)[static_cast<std::size_t>(comm.rank())];
    const bool whole = shd.run_collective([&](Comm& c) { return zero::gather_snapshot(c, img); });
    if (!whole) throw ringzero::checkpoint_error("the survivors' snapshots do not cover one");
    shd.load(img);
  }
  const int first = static_cast<int>(shd.step_count());
  const int nl = static_cast<int>(plan.layers().size());
  // On a device space the trainer's "kernels" are this thread's loops: it waits for the compute
  // stream before reading parameters, and keeps each gradient alive until the compute stream
  // has consumed it, as a trainer on a GPU orders its own work on that stream.
  std::vector<std::shared_ptr<void>> in_flight;
  const auto sync_compute = [&] {
    if constexpr (Sharder::device) shd.space().synchronize(shd.space().compute_stream());
  };
  const auto counters = [&] {
    if constexpr (Sharder::device)
      return shd.space().counters();
    else
      return zero::device_counters{};
  };
  for (int s = first; s < first + o.steps; ++s) {
    const zero::device_counters at_start = counters();
    for (int m = 0; m < o.accumulation; ++m) {
      for (int l = 0; l < nl; ++l) (void)shd.gather(l);
      for (int l = nl - 1; l >= 0; --l) {
        auto g = shd.gather(l, zero::pass::backward);
        const auto& li = plan.layers()[static_cast<std::size_t>(l)];
        for (int p = li.first_param + li.param_count - 1; p >= li.first_param; --p) {
          if (!shd.trainable(p)) continue;
          sync_compute();
          auto wv = g.param(p);
          std::vector<float> grad(wv.size());
          // A global batch of `batch` samples split over micro-batches and ranks: the sum of
          // the contributions is the batch mean whatever the world size.
          const int parts = o.world * o.accumulation;
          const int per = batch / parts;
          const int first_sample = o.contiguous ? (comm.rank() * o.accumulation + m) * per
                                                : (m * o.world + comm.rank()) * per;
          for (std::size_t i = 0; i < wv.size(); ++i) {
            const float target = initial_value(p + 100, i);
            float sum = 0.0f;
            for (int k = first_sample; k < first_sample + per; ++k)
              sum +=
                  static_cast<float>(wv[i]) - target +
                  0.1f * noise(2, static_cast<std::uint64_t>(k), static_cast<std::uint64_t>(s), i);
            // As a trainer would by scaling its loss (loss_scale() is 1 unless P is fp16).
            grad[i] = o.grad_multiplier * sum / static_cast<float>(batch) * shd.loss_scale();
          }
          if (o.poison) o.poison(comm.rank(), s, p, grad);
          if (o.use_slots) {
            const std::span<float> slot = shd.template gradient_slot<float>(p);
            sync_compute();  // the slot is ready (zeroed, its bucket free) on the compute stream
            for (std::size_t i = 0; i < slot.size(); ++i) slot[i] += grad[i];
            shd.add_grad(p, slot);
            continue;
          }
          if (o.device_gradient) {
            std::shared_ptr<float[]> d = o.device_gradient(grad.size());
            std::copy(grad.begin(), grad.end(), d.get());
            shd.add_grad(p, std::span<const float>(d.get(), grad.size()));
            in_flight.push_back(std::move(d));
            continue;
          }
          shd.add_grad(p, std::span<const float>(grad));
          if constexpr (Sharder::device)
            in_flight.push_back(std::make_shared<std::vector<float>>(std::move(grad)));
        }
      }
      shd.end_micro_batch();
      sync_compute();
      in_flight.clear();
    }
    std::optional<typename Sharder::gathered> held;
    if (o.gather_before_step) held.emplace(shd.gather(0));
    if (!o.hold_across_step) held.reset();
    const zero::device_counters before_step = counters();
    const auto r = shd.step();
    if (o.on_counters) o.on_counters(comm.rank(), s, at_start, before_step, counters());
    if (held) {
      sync_compute();
      const auto v = held->param(0);
      res.held[static_cast<std::size_t>(comm.rank())].assign(v.begin(), v.end());
      held.reset();
    }
    if (comm.rank() == 0) res.steps.push_back(r);
  }
  if (!o.save_dir.empty()) shd.save(o.save_dir);
  if (o.snapshots != nullptr) {
    zero::checkpoint_image img = shd.snapshot();
    shd.run_collective([&](Comm& c) { zero::keep_with_peer(c, img); });
    (*o.snapshots)[static_cast<std::size_t>(comm.rank())] = std::move(img);
  }
  res.params[static_cast<std::size_t>(comm.rank())] = shd.full_parameters();
  res.memory[static_cast<std::size_t>(comm.rank())] = shd.memory();
  if (comm.rank() == 0) res.step_count = shd.step_count();
}

/// train() with the buffers in Space (default: the one the loopback communicator chooses, host
/// memory); zero::emulated_device_space runs the sharder's device paths.
template <class P, class Space = zero::memory_space_t<communicator>>
run_result train(const zero::model_layout& layout, const run_options& o) {
  run_result res;
  res.params.resize(static_cast<std::size_t>(o.world));
  res.memory.resize(static_cast<std::size_t>(o.world));
  res.held.resize(static_cast<std::size_t>(o.world));
  ringzero::loopback::world w(o.world, {.ranks_per_node = o.ranks_per_node});
  w.run([&](communicator& comm) {
    train_rank<zero::sharder<communicator, P, Space>>(comm, layout, o, res, [](auto&) {});
  });
  return res;
}

/// Largest |a-b| / max(1, |a|).
inline double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i)
    m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]) /
                        std::max(1.0, std::abs(static_cast<double>(a[i]))));
  return a.size() == b.size() ? m : INFINITY;
}

}  // namespace zt
