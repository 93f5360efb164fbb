// The passes over the data that options::reproducible adds to a sum, per element, on one rank:
// windows (each block's highest and lowest bit), digits (each term as an int64 in its block's
// units) and rounding (the summed digits back to the element type), beside a plain add of two
// vectors (reduction::combine) over the same elements, and accumulating (the training step's pass:
// one micro-batch's terms added to reproducible::accumulator, on each path of the host loops that
// this CPU runs; "-" where it runs none). Rounding is timed twice: as a call runs
// it under the default rounding mode (the hardware's int64 conversion where the result is a
// normal number) and under FE_UPWARD, where that conversion is refused and every element takes
// the integer path. Then the compact accumulator of reproducible training's owners (one
// micro-batch's terms added to reproducible::compact_accumulator on each path, and its rounding),
// and the gathered float sums of the large float calls.
//
// The inputs are ringzero-perf --reproducible's kind: random signs and significands over 16
// binades, so each block takes one digit; the digits rounded are two such ranks' sums. Each
// figure is the minimum over `rounds` runs of the calling thread's CPU time
// (CLOCK_THREAD_CPUTIME_ID), so load from other processes on a shared machine inflates it
// little; the passes take turns within a round.
//
//   reproducible_passes [elements, default 4194304] [rounds, default 7]
#include <fmt/core.h>

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ringzero/detail/reproducible_call.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/reduce/reproducible_accumulator.hpp"
#include "ringzero/reduce/reproducible_compact.hpp"
#include "ringzero/types.hpp"

namespace {

namespace rd = ringzero::detail;

double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

template <class T>
std::vector<T> inputs(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> v(n);
  for (auto& x : v) {
    const double m = std::ldexp(static_cast<double>(rng() >> 11), -53) + 0.5;  // [0.5, 1.5)
    const int e = static_cast<int>(rng() % 16);
    x = static_cast<T>(std::ldexp((rng() & 1) != 0 ? -m : m, e));
  }
  return v;
}

template <class T>
void run(const char* name, std::size_t n, int rounds) {
  const std::vector<T> a = inputs<T>(n, 1), b = inputs<T>(n, 2);
  std::vector<std::int32_t> wa, wb, win;
  rd::local_windows(std::span<const T>(a), wa);
  rd::local_windows(std::span<const T>(b), wb);
  // The window all_reduce: an element-wise max of the ranks' windows.
  win.resize(wa.size());
  for (std::size_t i = 0; i < win.size(); ++i) win[i] = std::max(wa[i], wb[i]);
  const std::size_t digits = rd::digits_between(win, 0, n);
  std::vector<std::int64_t> qa(digits), qb(digits), q(digits);
  rd::write_digits(std::span<const T>(a), win, 0, n, qa.data());
  rd::write_digits(std::span<const T>(b), win, 0, n, qb.data());
  for (std::size_t i = 0; i < digits; ++i) q[i] = qa[i] + qb[i];
  std::vector<T> out(n), out_int(n), sum(n);

  constexpr double inf = std::numeric_limits<double>::infinity();
  double t_win = inf, t_dig = inf, t_round = inf, t_round_int = inf, t_add = inf;
  const auto timed = [](double& best, auto&& f) {
    const double t0 = thread_seconds();
    f();
    best = std::min(best, thread_seconds() - t0);
  };
  std::vector<std::int32_t> w2;
  for (int r = 0; r < rounds; ++r) {
    timed(t_win, [&] { rd::local_windows(std::span<const T>(a), w2); });
    timed(t_dig, [&] { rd::write_digits(std::span<const T>(a), win, 0, n, qa.data()); });
    timed(t_round, [&] { rd::read_digits(q.data(), win, 0, n, 1, out.data()); });
    const int mode = std::fegetround();
    std::fesetround(FE_UPWARD);
    timed(t_round_int, [&] { rd::read_digits(q.data(), win, 0, n, 1, out_int.data()); });
    std::fesetround(mode);
    timed(t_add, [&] {
      ringzero::reduction::combine(ringzero::op::sum, a.data(), b.data(), sum.data(), n);
    });
  }
  // Accumulating: a's terms added once first (the blocks' digits grow), then b's, timed.
  using ringzero::reduction::simd;
  std::string acc_cols;
  std::vector<std::int64_t> words_of[std::size(ringzero::reduction::all_simd)];
  for (const simd path : ringzero::reduction::all_simd) {
    if (!ringzero::reduction::simd_supported(path)) {
      acc_cols += fmt::format(" {:>9}", "-");
      continue;
    }
    double t_acc = inf;
    for (int r = 0; r < rounds; ++r) {
      ringzero::reproducible::accumulator<T> acc(n);
      acc.add(path, std::span<const T>(a));
      timed(t_acc, [&] { acc.add(path, std::span<const T>(b)); });
      if (r + 1 == rounds) {
        std::vector<std::int32_t> aw;
        acc.windows(aw);
        auto& w = words_of[static_cast<std::size_t>(path)];
        w.assign(rd::digits_between(aw, 0, n), 0);
        acc.write(aw, 0, n, w.data());
      }
    }
    acc_cols += fmt::format(" {:>9.2f}", t_acc * 1e9 / static_cast<double>(n));
  }
  std::size_t differ = 0;
  for (std::size_t i = 0; i < n; ++i)
    differ +=
        ringzero::reproducible::bits_of(out[i]) != ringzero::reproducible::bits_of(out_int[i]);
  // Every path's words against the scalar one's.
  for (const auto& w : words_of)
    if (!w.empty() && w != words_of[0]) ++differ;
  const double per = 1e9 / static_cast<double>(n);
  fmt::print("{:<7} {:>9} {:>7.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>12.2f} {:>9.2f}{} {:>8}\n", name,
             n, static_cast<double>(digits) * per * 1e-9, t_win * per, t_dig * per, t_round * per,
             t_round_int * per, t_add * per, acc_cols, differ);
}

/// The one pass of a large float call and of the shm segment's reproducible sums
/// (detail::gathered_float_sums): each rank's block of n elements with `ranks` terms apiece,
/// summed exactly, on each host path, beside the plain sum of the same terms (ranks - 1 vector
/// adds). Two ranks take the pair loop, with no exponent test. ns per term.
void gathered(std::size_t n, int rounds) {
  using ringzero::reduction::simd;
  constexpr double inf = std::numeric_limits<double>::infinity();
  fmt::print("\n# the gathered float sum: ns of thread CPU time per term, minimum of {} rounds\n",
             rounds);
  fmt::print("{:<7} {:>9} {:>9} {:>9} {:>9} {:>9}\n", "ranks", "elements", "scalar", "avx2",
             "avx512", "plain add");
  for (const std::size_t ranks : {2u, 4u, 8u}) {
    const std::size_t elems = n / ranks;
    std::vector<float> t(elems * ranks), out(elems), sum(elems);
    for (std::size_t r = 0; r < ranks; ++r) {
      const std::vector<float> part = inputs<float>(elems, 10 + r);
      std::copy(part.begin(), part.end(), t.begin() + static_cast<std::ptrdiff_t>(r * elems));
    }
    const auto timed = [&](auto&& f) {
      double best = inf;
      for (int k = 0; k < rounds; ++k) {
        const double t0 = thread_seconds();
        f();
        best = std::min(best, thread_seconds() - t0);
      }
      return best * 1e9 / static_cast<double>(elems * ranks);
    };
    std::string cols;
    for (const simd path : ringzero::reduction::all_simd) {
      if (!ringzero::reduction::simd_supported(path)) {
        cols += fmt::format(" {:>9}", "-");
        continue;
      }
      cols +=
          fmt::format(" {:>9.2f}", timed([&] {
                        rd::gathered_float_sums(path, t.data(), elems, ranks, elems, 1, out.data());
                      }));
    }
    const double add = timed([&] {
      ringzero::reduction::combine(ringzero::op::sum, t.data(), t.data() + elems, sum.data(),
                                   elems);
      for (std::size_t r = 2; r < ranks; ++r)
        ringzero::reduction::combine(ringzero::op::sum, sum.data(), t.data() + r * elems,
                                     sum.data(), elems);
    });
    fmt::print("{:<7} {:>9}{} {:>9.2f}\n", ranks, elems, cols, add);
  }
}

}  // namespace

/// reproducible::compact_accumulator<T>: one micro-batch's terms added (after a first one, so
/// the blocks hold words), on each path, and the rounding of every element once; the rounded
/// sums of every path against the scalar one's (#differ). ns per element.
template <class T>
void compact(const char* name, std::size_t n, int rounds) {
  using ringzero::reduction::simd;
  constexpr double inf = std::numeric_limits<double>::infinity();
  const auto timed = [](double& best, auto&& f) {
    const double t0 = thread_seconds();
    f();
    best = std::min(best, thread_seconds() - t0);
  };
  std::vector<T> a, b;
  for (const float x : inputs<float>(n, 11)) a.push_back(T(x));
  for (const float x : inputs<float>(n, 12)) b.push_back(T(x));
  std::string cols;
  std::vector<T> out(n), first;
  double t_round = inf;
  std::size_t differ = 0;
  for (const simd path : ringzero::reduction::all_simd) {
    if (!ringzero::reduction::simd_supported(path)) {
      cols += fmt::format(" {:>9}", "-");
      continue;
    }
    double t = inf;
    for (int r = 0; r < rounds; ++r) {
      ringzero::reproducible::compact_accumulator<T> acc(n);
      acc.add(path, std::span<const T>(a));
      timed(t, [&] { acc.add(path, std::span<const T>(b)); });
      timed(t_round, [&] { acc.round(0, std::span<T>(out)); });
    }
    cols += fmt::format(" {:>9.2f}", t * 1e9 / static_cast<double>(n));
    if (first.empty())
      first = out;
    else
      for (std::size_t i = 0; i < n; ++i)
        differ +=
            ringzero::reproducible::bits_of(out[i]) != ringzero::reproducible::bits_of(first[i]);
  }
  fmt::print("{:<7} {:>9}{} {:>9.2f} {:>8}\n", name, n, cols,
             t_round * 1e9 / static_cast<double>(n), differ);
}

int main(int argc, char** argv) {
  const auto n = static_cast<std::size_t>(argc > 1 ? std::atoll(argv[1]) : 4194304);
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 7;
  fmt::print("# ns of thread CPU time per element, minimum of {} rounds\n", rounds);
  fmt::print("{:<7} {:>9} {:>7} {:>9} {:>9} {:>9} {:>12} {:>9} {:>9} {:>9} {:>9} {:>8}\n", "type",
             "elements", "digits", "windows", "digits", "round", "round (int)", "plain add",
             "acc:scal", "acc:avx2", "acc:avx512", "#differ");
  run<float>("float", n, rounds);
  run<double>("double", n, rounds);
  fmt::print(
      "\n# the compact accumulator: ns of thread CPU time per element, minimum of {} rounds\n",
      rounds);
  fmt::print("{:<7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}\n", "type", "elements", "add:scal",
             "add:avx2", "add:avx512", "round", "#differ");
  compact<float>("float", n, rounds);
  compact<ringzero::bfloat16>("bf16", n, rounds);
  gathered(n, rounds);
}
