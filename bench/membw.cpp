// This machine's memory bandwidth, measured the way STREAM counts it (bytes the kernel reads plus
// bytes it writes, no write-allocate traffic), with 1 thread and with every core. bench/compare
// runs it in the same sweep as the collectives: on one host a collective cannot move data faster
// than memory does, so this is the ceiling the busbw figures are compared with.
//
//   membw [MiB per array, default 256]    prints "# membw <kernel> <threads> <GB/s>" lines
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
  return 0;
}
