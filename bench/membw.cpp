// This machine's memory bandwidth, measured the way STREAM counts it (bytes the kernel reads plus
// bytes it writes, no write-allocate traffic), with 1 thread and with every core. bench/compare
// runs it in the same sweep as the collectives: on one host a collective cannot move data faster
// than memory does, so this is the ceiling the busbw figures are compared with.
//
// It also times the all_reduce memory floor: n threads stand for n ranks whose buffers every rank
// addresses (symmetric memory); thread r reads block r of every rank's input and writes the sum
// into block r of every rank's output with streaming stores, so each "rank" reads S bytes and
// writes S bytes, 2·S of memory traffic, the least any all_reduce of S bytes per rank can move.
// Its reduction and its stores are ringzero's own (reduction::combine, the shm transport's
// stream_copy), so a symmetric all_reduce that reaches this figure loses nothing but its
// synchronisation.
//
//   membw [MiB per array, default 256]    prints "# membw <kernel> <threads> <GB/s>" lines and
//                                         "# floor <ranks> <busbw GB/s>" for 2 and 4 ranks
#include <fmt/core.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/transport/shm/detail/collectives.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

struct arrays {
  std::vector<double> a, b, c;
};

// Runs kernel(begin, end) on `threads` threads, each over its own slice, `reps` times; returns
// the best wall time of one pass.
template <class Kernel>
double best_pass(std::size_t n, int threads, int reps, Kernel kernel) {
  double best = 1e30;
  std::barrier sync(threads + 1);
  std::vector<std::jthread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const std::size_t lo = n * static_cast<std::size_t>(t) / static_cast<std::size_t>(threads);
      const std::size_t hi =
          n * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(threads);
      for (int r = 0; r < reps; ++r) {
        sync.arrive_and_wait();
        kernel(lo, hi);
        sync.arrive_and_wait();
      }
    });
  for (int r = 0; r < reps; ++r) {
    sync.arrive_and_wait();
    const auto t0 = clock_type::now();
    sync.arrive_and_wait();
    best = std::min(best, std::chrono::duration<double>(clock_type::now() - t0).count());
  }
  return best;
}

// busbw (nccl-tests' definition, S/t · 2(n-1)/n) of the fastest pass of the all_reduce floor
// over `ranks` float arrays of `bytes` each.
double floor_busbw(std::size_t bytes, int ranks) {
  const std::size_t count = bytes / sizeof(float);
  std::vector<std::vector<float>> in, out;
  for (int q = 0; q < ranks; ++q) {
    in.emplace_back(count, static_cast<float>(q + 1));
    out.emplace_back(count, 0.0f);
  }
  // Pieces small enough to stay in L1 between the reduction and the stores, as the shm
  // transport's symmetric all_reduce reduces them.
  constexpr std::size_t piece = (16 << 10) / sizeof(float);
  const double t = best_pass(count, ranks, 5, [&](std::size_t lo, std::size_t hi) {
    alignas(64) static thread_local float tmp[piece];
    for (std::size_t first = lo; first < hi; first += piece) {
      const std::size_t len = std::min(piece, hi - first);
      ringzero::reduction::combine(ringzero::op::sum, in[0].data() + first, in[1].data() + first,
                                   tmp, len);
      for (std::size_t q = 2; q < in.size(); ++q)
        ringzero::reduction::combine(ringzero::op::sum, tmp, in[q].data() + first, tmp, len);
      for (auto& o : out)
        ringzero::shm::detail::stream_copy(reinterpret_cast<std::byte*>(o.data() + first),
                                           reinterpret_cast<const std::byte*>(tmp),
                                           len * sizeof(float));
    }
  });
  const double sum = static_cast<double>(ranks) * (ranks + 1) / 2;
  for (const auto& o : out)
    if (o.front() != sum || o.back() != sum) {
      fmt::print(stderr, "membw: the floor loop computed {} instead of {}\n", o.back(), sum);
      std::exit(1);
    }
  return static_cast<double>(bytes) / t * 2.0 * (ranks - 1) / ranks / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256;
  const std::size_t n = mib * (std::size_t{1} << 20) / sizeof(double);
  arrays x{std::vector<double>(n, 1.0), std::vector<double>(n, 2.0), std::vector<double>(n, 0.0)};
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const double bytes = static_cast<double>(n * sizeof(double));
  std::vector<int> counts{1};
  if (cores > 1) counts.push_back(cores);
  fmt::print("# membw: {} MiB per array, STREAM byte counting (reads + writes)\n", mib);
  for (int threads : counts) {
    const double copy = best_pass(n, threads, 5, [&](std::size_t lo, std::size_t hi) {
      std::memcpy(x.c.data() + lo, x.a.data() + lo, (hi - lo) * sizeof(double));
    });
    const double triad = best_pass(n, threads, 5, [&](std::size_t lo, std::size_t hi) {
      const double s = 3.0;
      for (std::size_t i = lo; i < hi; ++i) x.a[i] = x.b[i] + s * x.c[i];
    });
    fmt::print("# membw copy {} {:.2f}\n", threads, 2 * bytes / copy / 1e9);
    fmt::print("# membw triad {} {:.2f}\n", threads, 3 * bytes / triad / 1e9);
  }
  x = {};
  for (int ranks : {2, 4}) fmt::print("# floor {} {:.2f}\n", ranks, floor_busbw(mib << 20, ranks));
  return 0;
}
