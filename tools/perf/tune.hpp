// ringzero-perf --tune FILE: measures the cost model's constants on the transport this run uses
// and writes them to FILE, the file RINGZERO_TUNING names (tuning/tuning_file.hpp).
//
//   alpha, beta: a least-squares fit of t(m) = alpha + beta * m to the time of one ring step
//     (every rank sends m bytes to its right and receives m bytes from its left, as each step of
//     the ring, recursive doubling and halving does), over m = 8 B up to the transport's
//     chunk_bytes, the largest message the pipelined algorithms send. The fit weighs
//     each size by 1 / t^2, so that it minimises the relative error: a plain fit would follow
//     the large sizes and leave alpha to chance.
//   gamma: seconds per byte of reduction::combine on float sum, with every rank reducing at
//     once (as they do inside a collective), over one chunk (chunk_bytes): the algorithms
//     reduce chunk by chunk, each just received into cache-resident scratch. A 32 MiB buffer,
//     out of cache, is timed too and printed for comparison; using it would price reduction
//     as memory-bound and push the model from recursive doubling (which reduces the whole
//     buffer) to the ring at sizes where doubling is faster.
//
// Rank 0 prints each size's time, the fit and its residuals, then writes the file: the section
// of this transport (its tuning_name()) replaces the one already there, others are kept.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "ringzero/detail/exchange.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
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

/// Weighted least squares (weights 1 / t^2: the relative error is minimised). alpha is kept
/// at zero or above; invalid_argument when the points cannot give a positive beta.
[[nodiscard]] inline line_fit fit_alpha_beta(std::span<const double> bytes,
                                             std::span<const double> seconds) {
  if (bytes.size() != seconds.size() || bytes.size() < 2)
    throw invalid_argument("--tune: a fit needs at least two (size, time) points");
  double sw = 0, sm = 0, smm = 0, st = 0, smt = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (!(seconds[i] > 0)) throw invalid_argument("--tune: a measured time is not positive");
    const double w = 1.0 / (seconds[i] * seconds[i]);
    sw += w;
    sm += w * bytes[i];
    smm += w * bytes[i] * bytes[i];
    st += w * seconds[i];
    smt += w * bytes[i] * seconds[i];
  }
  line_fit f;
  const double det = sw * smm - sm * sm;
  if (det > 0) {
    f.alpha = (smm * st - sm * smt) / det;
    f.beta = (sw * smt - sm * st) / det;
  }
  if (!(det > 0) || f.alpha < 0) {
    // Through the origin: the best fit with alpha >= 0 when the free one went below it.
    f.alpha = 0;
    f.beta = smm > 0 ? smt / smm : 0;
  }
  if (!(f.beta > 0) || !std::isfinite(f.beta))
    throw invalid_argument(
        "--tune: the step times do not grow with the size; no positive beta fits them");
  for (std::size_t i = 0; i < bytes.size(); ++i)
    f.residual.push_back((f.alpha + f.beta * bytes[i]) / seconds[i] - 1.0);
  return f;
}

namespace detail {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Seconds of one ring step of each of `sizes` on this rank: per size, the median over rounds
/// of the mean over a round's steps. Each round visits every size, so a stretch of time when
/// other work holds the cores slows every size a little rather than a few sizes a lot. Every
/// rank runs the same steps, so none waits for a step that never comes.
template <class Comm>
std::vector<double> ring_step_seconds(Comm& comm, std::span<const std::size_t> sizes, int rounds) {
  const int n = comm.size();
  const int right = (comm.rank() + 1) % n;
  const int left = (comm.rank() + n - 1) % n;
  const std::size_t most = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
  std::vector<std::byte> out(most, std::byte{1}), in(most);
  std::vector<std::vector<double>> per_round(sizes.size());
  for (int round = -2; round < rounds; ++round) {  // two rounds of warm-up
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::size_t bytes = sizes[i];
      // Enough steps that a round takes a measurable time, few enough that large sizes stay
      // quick.
      const int steps = static_cast<int>(std::clamp<std::size_t>(
          (std::size_t{4} << 20) / std::max<std::size_t>(bytes, 1), 8, 400));
      ringzero::detail::exchange<Comm> ex(comm, "tune", "ring step");
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < steps; ++s)
        ex.sendrecv(right, std::span(out).first(bytes), left, std::span(in).first(bytes), s);
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      if (round >= 0) per_round[i].push_back(dt.count() / steps);
    }
  }
  std::vector<double> t;
  for (auto& r : per_round) t.push_back(median(r));
  return t;
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

/// The whole of --tune on one rank of `comm`; rank 0 prints to `out` and writes `file`.
/// Returns the exit status.
template <class Comm>
int run_tune(Comm& comm, const std::string& file, const std::string& what, std::FILE* out) {
  const int n = comm.size();
  if (n < 2)
    throw invalid_argument("--tune: alpha and beta are measured between ranks; run 2 or more");
  const std::string section = comm.transport().tuning_name();
  const bool prints = comm.rank() == 0;
  if (prints)
    fmt::print(out,
               "# ringzero-perf --tune: {} ({}), {} ranks; section [{}] of {}\n"
               "# ring steps: every rank sends to its right and receives from its left\n"
               "#  {:>9}  {:>12}  {:>12}  {:>9}\n",
               what, section, n, section, file, "size", "step (us)", "fit (us)", "residual");
  // The algorithms cut messages into chunks of at most chunk_bytes, so larger messages are
  // never sent: fitting them would price a protocol the collectives do not use.
  const std::size_t largest =
      std::clamp<std::size_t>(comm.cost().chunk_bytes, std::size_t{64} << 10, std::size_t{4} << 20);
  std::vector<std::size_t> steps;
  for (std::size_t b = 8; b <= largest; b *= 2) steps.push_back(b);
  const std::vector<double> times = detail::ring_step_seconds(comm, steps, 15);
  const std::vector<double> sizes(steps.begin(), steps.end());
  // Every rank reduces at once, as inside a collective; a step aligns the ranks first.
  const std::size_t align[] = {8};
  (void)detail::ring_step_seconds(comm, align, 1);
  const std::size_t small_bytes = largest, large_bytes = std::size_t{32} << 20;
  const double gamma_small = detail::combine_seconds_per_byte(small_bytes, 101);
  const double gamma_large = detail::combine_seconds_per_byte(large_bytes, 7);
  (void)detail::ring_step_seconds(comm, align, 1);
  if (!prints) return 0;

  const line_fit f = fit_alpha_beta(sizes, times);
  for (std::size_t i = 0; i < sizes.size(); ++i)
    fmt::print(out, "   {:>9}  {:>12.3f}  {:>12.3f}  {:>+8.1f}%\n",
               detail::size_text(static_cast<std::size_t>(sizes[i])), times[i] * 1e6,
               (f.alpha + f.beta * sizes[i]) * 1e6, f.residual[i] * 100);
  fmt::print(out,
             "# alpha = {:.4g} s ({:.3f} us), beta = {:.4g} s/B ({:.2f} GB/s); rms residual "
             "{:.1f}%\n"
             "# reduction (float sum, {} ranks at once): {} {:.4g} s/B ({:.2f} GB/s), {} "
             "{:.4g} s/B ({:.2f} GB/s) -> gamma = {:.4g}\n",
             f.alpha, f.alpha * 1e6, f.beta, 1e-9 / f.beta, f.rms() * 100, n,
             detail::size_text(small_bytes), gamma_small, 1e-9 / gamma_small,
             detail::size_text(large_bytes), gamma_large, 1e-9 / gamma_large, gamma_small);

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
  s.measured = fmt::format("{} ranks on {}, {}, ringzero {}, ringzero-perf --tune", n,
                           log::detail::host_name(), when, version_string);
  tf.put(s);
  tuning::write_tuning(file, tf);
  fmt::print(out, "# wrote [{}] to {}; use it with RINGZERO_TUNING={}\n", section, file, file);
  return 0;
}

}  // namespace ringzero::perf
