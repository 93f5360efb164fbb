// ringzero-perf --tune FILE: measures the cost model's constants on the transport this run uses
// and writes them to FILE, the file RINGZERO_TUNING names (tuning/tuning_file.hpp).
//
//   gamma: seconds per byte of reduction::combine on float sum, with every rank reducing at
//     once (as they do inside a collective), over one chunk (chunk_bytes): the algorithms
//     reduce chunk by chunk, each just received into cache-resident scratch. A 32 MiB buffer,
//     out of cache, is timed too and printed for comparison; using it would price reduction
//     as memory-bound and push the model from recursive doubling (which reduces the whole
//     buffer) to the ring at sizes where doubling is faster.
//   alpha, beta: every all_reduce algorithm of one node (ring, tree, rd, rhd) is timed, forced,
//     from 8 B to 2 MiB, and alpha and beta are the least-squares fit of the model's own
//     prediction for each (algorithm, size) to its time. The model is linear in alpha, beta and
//     gamma (tuning::predict of unit constants gives each one's coefficient), so this is a
//     linear fit, weighted by 1 / t^2 to minimise the relative error (a plain fit would follow
//     the large sizes and leave alpha to chance). Fitting the collectives rather than a bare
//     message exchange makes alpha what one step of a collective costs, its bookkeeping and
//     waits included. Fitted to back-to-back ring steps instead, the model priced the ring's
//     extra steps too cheaply: on 2 ranks over libfabric's shm provider it took the ring from
//     16 to 64 KiB, where recursive doubling was 1.5 to 1.8 times faster.
//
//   one_phase_bytes (the native shm transport): its all_reduce is timed at 1 KiB .. 1 MiB with
//     every size in one phase and then every size in two (communicator::set_tuning), and the
//     limit is the largest size up to which one phase is never more than 2 % slower. Where one
//     phase stops paying is a property of the caches: two machines of this project's measurements
//     put it at 256 KiB and at 8 KiB on 2 ranks (docs/performance.md).
//
// Rank 0 prints each point's time, the fit and its residuals, then writes the file: the section
// of this transport (its tuning_name()) replaces the one already there, others are kept.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/model/cost_model.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/tuning/tuning_file.hpp"
#include "ringzero/version.hpp"

namespace ringzero::perf {

/// alpha + beta * m fitted to (bytes, seconds), and each point's relative residual
/// (fit / measured - 1).
struct line_fit {
  double alpha = 0;
  double beta = 0;
  std::vector<double> residual;
  [[nodiscard]] double rms() const {
    double s = 0;
    for (double r : residual) s += r * r;
    return residual.empty() ? 0.0 : std::sqrt(s / static_cast<double>(residual.size()));
  }
};

/// alpha and beta minimising the sum of ((ca*alpha + cb*beta + c0) / t - 1)^2 over the points:
/// a prediction that is ca*alpha + cb*beta + c0 fitted to measured times t by relative error
/// (weighted least squares, weights 1 / t^2). alpha is kept at zero or above; invalid_argument
/// when the points cannot give a positive beta.
[[nodiscard]] inline line_fit fit_alpha_beta(std::span<const double> ca, std::span<const double> cb,
                                             std::span<const double> c0,
                                             std::span<const double> t) {
  if (ca.size() != t.size() || cb.size() != t.size() || c0.size() != t.size() || t.size() < 2)
    throw invalid_argument("--tune: a fit needs at least two (size, time) points");
  double saa = 0, sab = 0, sbb = 0, say = 0, sby = 0;
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (!(t[i] > 0)) throw invalid_argument("--tune: a measured time is not positive");
    const double w = 1.0 / (t[i] * t[i]);
    const double y = t[i] - c0[i];
    saa += w * ca[i] * ca[i];
    sab += w * ca[i] * cb[i];
    sbb += w * cb[i] * cb[i];
    say += w * ca[i] * y;
    sby += w * cb[i] * y;
  }
  line_fit f;
  const double det = saa * sbb - sab * sab;
  if (det > 0) {
    f.alpha = (sbb * say - sab * sby) / det;
    f.beta = (saa * sby - sab * say) / det;
  }
  if (!(det > 0) || f.alpha < 0) {
    // The best fit with alpha = 0, when the free one went below it.
    f.alpha = 0;
    f.beta = sbb > 0 ? sby / sbb : 0;
  }
  if (!(f.beta > 0) || !std::isfinite(f.beta))
    throw invalid_argument(
        "--tune: the times do not grow with the size; no positive beta fits them");
  for (std::size_t i = 0; i < t.size(); ++i)
    f.residual.push_back((ca[i] * f.alpha + cb[i] * f.beta + c0[i]) / t[i] - 1.0);
  return f;
}

/// The plain line t = alpha + beta * bytes.
[[nodiscard]] inline line_fit fit_alpha_beta(std::span<const double> bytes,
                                             std::span<const double> seconds) {
  const std::vector<double> ones(bytes.size(), 1.0), zeros(bytes.size(), 0.0);
  return fit_alpha_beta(ones, bytes, zeros, seconds);
}

namespace detail {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Seconds per all_reduce call on this rank of each (size, setting), at [size * settings +
/// setting]: the median over rounds of the mean over a round's calls. `setting(j)` prepares the
/// j-th setting and returns the call's options; `calls(bytes)` is how many calls a point times.
/// Each round visits every point, so a stretch of time when other work holds the cores slows
/// every point a little rather than a few a lot. Every rank makes the same calls.
template <class Comm, class Setting, class Calls>
std::vector<double> all_reduce_seconds_each(Comm& comm, std::span<const std::size_t> sizes,
                                            std::size_t settings, Setting setting, Calls calls,
                                            int rounds) {
  const std::size_t most = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
  std::vector<float> in(most / sizeof(float), 1.0f), out(in.size());
  std::vector<std::vector<double>> per_round(sizes.size() * settings);
  for (int round = -1; round < rounds; ++round) {  // one round of warm-up
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::size_t count = sizes[i] / sizeof(float);
      const int n = calls(sizes[i]);
      for (std::size_t j = 0; j < settings; ++j) {
        const ringzero::options opt = setting(j);
        const auto t0 = std::chrono::steady_clock::now();
        for (int c = 0; c < n; ++c)
          ringzero::all_reduce(comm, std::span<const float>(in.data(), count),
                               std::span<float>(out.data(), count), op::sum, opt);
        const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
        if (round >= 0) per_round[i * settings + j].push_back(dt.count() / n);
      }
    }
  }
  std::vector<double> t;
  for (auto& r : per_round) t.push_back(median(r));
  return t;
}

/// all_reduce_seconds_each over forced algorithms: enough calls that a round takes a
/// measurable time, few enough that 2 MiB stays quick.
template <class Comm>
std::vector<double> all_reduce_seconds(Comm& comm, std::span<const std::size_t> sizes,
                                       std::span<const algorithm> algos, int rounds) {
  return all_reduce_seconds_each(
      comm, sizes, algos.size(),
      [&](std::size_t j) {
        ringzero::options opt;
        opt.algorithm = algos[j];
        return opt;
      },
      [](std::size_t bytes) {
        return static_cast<int>(std::clamp<std::size_t>(
            (std::size_t{1} << 20) / std::max<std::size_t>(bytes, 1), 3, 50));
      },
      rounds);
}

/// all_reduce_seconds_each over tuning policies (communicator::set_tuning), the algorithm left
/// automatic so that a transport with a segment runs the calls there; about a millisecond a
/// point, since a 1 KiB call in a segment takes well under a microsecond. The communicator's
/// own policy is restored afterwards.
template <class Comm>
std::vector<double> all_reduce_seconds_under(Comm& comm, std::span<const std::size_t> sizes,
                                             std::span<const tuning::policy> policies, int rounds) {
  const tuning::policy own = comm.tuning();
  std::vector<double> t = all_reduce_seconds_each(
      comm, sizes, policies.size(),
      [&](std::size_t j) {
        comm.set_tuning(policies[j]);
        return ringzero::options{};
      },
      [](std::size_t bytes) {
        return static_cast<int>(std::clamp<std::size_t>(
            (std::size_t{8} << 20) / std::max<std::size_t>(bytes, 1), 20, 2000));
      },
      rounds);
  comm.set_tuning(own);
  return t;
}

/// Lines the ranks up (a small all_reduce), so that what follows starts together.
template <class Comm>
void align(Comm& comm) {
  float x = 0;
  ringzero::options opt;
  opt.algorithm = algorithm::ring;
  ringzero::all_reduce(comm, std::span<float>(&x, 1), op::sum, opt);
}

/// Seconds per byte of a float sum of two `bytes`-byte operands, median of `reps` passes.
inline double combine_seconds_per_byte(std::size_t bytes, int reps) {
  const std::size_t n = bytes / sizeof(float);
  std::vector<float> a(n, 1.0f), b(n, 2.0f), out(n);
  std::vector<double> t;
  for (int r = -1; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    reduction::combine(op::sum, a.data(), b.data(), out.data(), n);
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    if (r >= 0) t.push_back(dt.count() / static_cast<double>(n * sizeof(float)));
    a[r & 7] = out[static_cast<std::size_t>(r) % n];  // keeps the passes from being folded
  }
  return median(t);
}

[[nodiscard]] inline std::string size_text(std::size_t b) {
  if (b >= (std::size_t{1} << 20)) return fmt::format("{} MiB", b >> 20);
  if (b >= 1024) return fmt::format("{} KiB", b >> 10);
  return fmt::format("{} B", b);
}

}  // namespace detail

/// The one-phase limit from all_reduce times in one phase and in two at ascending `sizes`: the
/// largest size up to which one phase is at most 2 % slower than two at every size (the margin
/// keeps noise from ending the run early), half the smallest size where it already loses there.
[[nodiscard]] inline std::size_t choose_one_phase_limit(std::span<const std::size_t> sizes,
                                                        std::span<const double> one,
                                                        std::span<const double> two) {
  if (sizes.empty() || one.size() != sizes.size() || two.size() != sizes.size())
    throw invalid_argument("--tune: one-phase and two-phase times for every size are needed");
  std::size_t limit = std::max<std::size_t>(sizes[0] / 2, 1);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (one[i] > two[i] * 1.02) break;
    limit = sizes[i];
  }
  return limit;
}

/// The whole of --tune on one rank of `comm`; rank 0 prints to `out` and writes `file`.
/// Returns the exit status.
template <class Comm>
int run_tune(Comm& comm, const std::string& file, const std::string& what, std::FILE* out) {
  const int n = comm.size();
  if (n < 2)
    throw invalid_argument("--tune: alpha and beta are measured between ranks; run 2 or more");
  const std::string section = comm.transport().tuning_name();
  const bool prints = comm.rank() == 0;
  // gamma first, every rank reducing at once, as inside a collective.
  const std::size_t small_bytes = std::clamp<std::size_t>(
      comm.tuning().chunk_bytes, std::size_t{64} << 10, std::size_t{4} << 20);
  const std::size_t large_bytes = std::size_t{32} << 20;
  detail::align(comm);
  const double gamma_small = detail::combine_seconds_per_byte(small_bytes, 101);
  const double gamma_large = detail::combine_seconds_per_byte(large_bytes, 7);
  detail::align(comm);

  const std::vector<algorithm> algos = tuning::candidates(collective::all_reduce, false);
  std::vector<std::size_t> sizes;
  for (std::size_t b = 8; b <= (std::size_t{2} << 20); b *= 4) sizes.push_back(b);
  const std::vector<double> t = detail::all_reduce_seconds(comm, sizes, algos, 5);

  // The segment's one-phase limit, where the transport reduces in a shared segment.
  std::vector<std::size_t> phase_sizes;
  std::vector<double> one, two;
  std::size_t one_phase = 0;
  if (section == "shm") {
    for (std::size_t b = 1024; b <= (std::size_t{1} << 20); b *= 2) phase_sizes.push_back(b);
    tuning::policy in_one = comm.tuning(), in_two = comm.tuning();
    in_one.one_phase_bytes = std::size_t{1} << 40;  // every size in one phase
    in_two.one_phase_bytes = 1;                     // every size in two
    in_one.one_phase_ranks = in_two.one_phase_ranks = 0;
    const std::array<tuning::policy, 2> both{in_one, in_two};
    detail::align(comm);
    const std::vector<double> tp = detail::all_reduce_seconds_under(comm, phase_sizes, both, 7);
    for (std::size_t i = 0; i < phase_sizes.size(); ++i) {
      one.push_back(tp[2 * i]);
      two.push_back(tp[2 * i + 1]);
    }
    one_phase = choose_one_phase_limit(phase_sizes, one, two);
  }
  if (!prints) return 0;

  // Each point's prediction is ca*alpha + cb*beta + cg*gamma: the coefficients are the
  // predictions for unit constants (the chunking and flow-control limits stay the transport's).
  std::vector<double> ca, cb, c0;
  const auto unit = [&](double a, double b, double g) {
    tuning::policy p = comm.tuning();
    p.alpha = a;
    p.beta = b;
    p.gamma = g;
    return p;
  };
  for (std::size_t s : sizes)
    for (algorithm a : algos) {
      const double bytes = static_cast<double>(s);
      ca.push_back(tuning::predict(collective::all_reduce, a, bytes, n, unit(1, 0, 0)));
      cb.push_back(tuning::predict(collective::all_reduce, a, bytes, n, unit(0, 1, 0)));
      c0.push_back(tuning::predict(collective::all_reduce, a, bytes, n, unit(0, 0, 1)) *
                   gamma_small);
    }
  const line_fit f = fit_alpha_beta(ca, cb, c0, t);

  fmt::print(out,
             "# ringzero-perf --tune: {} ({}), {} ranks; section [{}] of {}\n"
             "# all_reduce float sum, each algorithm forced: measured us / the fitted model's us\n"
             "#  {:>9}",
             what, section, n, section, file, "size");
  for (algorithm a : algos) fmt::print(out, "  {:>17}", algorithm_name(a));
  fmt::print(out, "\n");
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    fmt::print(out, "   {:>9}", detail::size_text(sizes[i]));
    for (std::size_t j = 0; j < algos.size(); ++j) {
      const std::size_t k = i * algos.size() + j;
      fmt::print(out, "  {:>8.1f} /{:>8.1f}", t[k] * 1e6, t[k] * (1 + f.residual[k]) * 1e6);
    }
    fmt::print(out, "\n");
  }
  fmt::print(out,
             "# alpha = {:.4g} s ({:.3f} us), beta = {:.4g} s/B ({:.2f} GB/s); rms residual "
             "{:.1f}%\n"
             "# reduction (float sum, {} ranks at once): {} {:.4g} s/B ({:.2f} GB/s), {} "
             "{:.4g} s/B ({:.2f} GB/s) -> gamma = {:.4g}\n",
             f.alpha, f.alpha * 1e6, f.beta, 1e-9 / f.beta, f.rms() * 100, n,
             detail::size_text(small_bytes), gamma_small, 1e-9 / gamma_small,
             detail::size_text(large_bytes), gamma_large, 1e-9 / gamma_large, gamma_small);

  if (one_phase != 0) {
    fmt::print(out, "# segment all_reduce, float sum: us per call in one phase / in two\n");
    for (std::size_t i = 0; i < phase_sizes.size(); ++i)
      fmt::print(out, "   {:>9}  {:>8.2f} /{:>8.2f}\n", detail::size_text(phase_sizes[i]),
                 one[i] * 1e6, two[i] * 1e6);
    fmt::print(out, "# one phase up to {} on {} ranks (one_phase_bytes = {})\n",
               detail::size_text(one_phase), n, one_phase);
  }

  tuning::tuning_file tf;
  if (std::filesystem::exists(file)) tf = tuning::read_tuning(file);
  const std::time_t now = std::time(nullptr);
  char when[32] = {};
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  tuning::tuning_section s;
  s.name = section;
  s.alpha = f.alpha;
  s.beta = f.beta;
  s.gamma = gamma_small;
  if (one_phase != 0) {
    s.one_phase_bytes = one_phase;
    s.one_phase_ranks = n;
  }
  s.measured = fmt::format("{} ranks on {}, {}, ringzero {}, ringzero-perf --tune", n,
                           log::detail::host_name(), when, version_string);
  tf.put(s);
  tuning::write_tuning(file, tf);
  fmt::print(out, "# wrote [{}] to {}; use it with RINGZERO_TUNING={}\n", section, file, file);
  return 0;
}

}  // namespace ringzero::perf
