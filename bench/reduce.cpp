// Speed of the host reduction loop (reduction::combine, out = a (op) b) on each code path this
// CPU runs, beside memcpy over the same bytes. Bandwidth counts as STREAM does: the bytes read
// plus the bytes written (3 S for combine over S-byte arrays, 2 S for memcpy). Each figure is
// the median of `rounds` measurements, the paths taking turns, so that load from other
// processes on a shared machine falls on all of them alike.
//
//   reduce [op, default sum] [rounds, default 3]
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/reduce/simd.hpp"
#include "ringzero/types.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
namespace reduction = ringzero::reduction;

/// Seconds of one call of f: timed in batches of at least 100 us (so that reading the clock does
/// not count at cache sizes), the best batch of as many as fit in about 50 ms (at least 3).
template <class F>
double best_seconds(F f) {
  const auto call = [&] {
    f();
    asm volatile("" ::: "memory");  // the results count: the calls cannot be merged or dropped
  };
  auto t0 = clock_type::now();
  call();
  const double once = std::chrono::duration<double>(clock_type::now() - t0).count();
  const int batch = static_cast<int>(std::clamp(1e-4 / std::max(once, 1e-9), 1.0, 1e6));
  double best = 1e30;
  const auto start = clock_type::now();
  for (int i = 0; i < 3 || clock_type::now() - start < std::chrono::milliseconds(50); ++i) {
    t0 = clock_type::now();
    for (int k = 0; k < batch; ++k) call();
    best = std::min(best, std::chrono::duration<double>(clock_type::now() - t0).count() / batch);
  }
  return best;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class T>
void fill(std::vector<T>& v, unsigned seed) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    const float x = static_cast<float>((i * 2654435761u + seed) % 1000) / 1000.0f + 0.5f;
    if constexpr (std::is_integral_v<T>)
      v[i] = static_cast<T>(x * 1000);
    else
      v[i] = T(x);
  }
}

template <class T>
void run_type(std::size_t bytes, ringzero::op o, int rounds,
              const std::vector<reduction::simd>& paths) {
  const std::size_t n = bytes / sizeof(T);
  std::vector<T> a(n), b(n), out(n);
  fill(a, 1);
  fill(b, 2);
  std::vector<std::vector<double>> secs(paths.size());
  for (int r = 0; r < rounds; ++r)
    for (std::size_t p = 0; p < paths.size(); ++p)
      secs[p].push_back(best_seconds(
          [&] { reduction::combine(paths[p], o, a.data(), b.data(), out.data(), n); }));
  const double scalar = median(secs[0]);
  for (std::size_t p = 0; p < paths.size(); ++p) {
    const double s = median(secs[p]);
    fmt::print("{:>9} {:>9} {:>7} {:>9.1f} {:>7.2f}x\n", bytes,
               ringzero::dtype_name(ringzero::dtype_of<T>()), reduction::simd_name(paths[p]),
               3.0 * static_cast<double>(bytes) / s / 1e9, scalar / s);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const ringzero::op o = ringzero::parse_op(argc > 1 ? argv[1] : "sum");
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 3;
  std::vector<reduction::simd> paths;
  for (const auto s : reduction::all_simd)
    if (reduction::simd_supported(s)) paths.push_back(s);
  fmt::print(
      "# reduction::combine, op {}, median of {} rounds; GB/s = (2 reads + 1 write) / time\n",
      ringzero::op_name(o), rounds);
  fmt::print("# {:>7} {:>9} {:>7} {:>9} {:>8}\n", "bytes", "type", "path", "GB/s", "vs scalar");
  for (const std::size_t bytes :
       {std::size_t{4} << 10, std::size_t{1} << 20, std::size_t{64} << 20}) {
    std::vector<std::byte> src(bytes, std::byte{1}), dst(bytes);
    std::vector<double> copy;
    for (int r = 0; r < rounds; ++r)
      copy.push_back(best_seconds([&] { std::memcpy(dst.data(), src.data(), bytes); }));
    fmt::print("{:>9} {:>9} {:>7} {:>9.1f}   (memcpy: 1 read + 1 write)\n", bytes, "bytes",
               "memcpy", 2.0 * static_cast<double>(bytes) / median(copy) / 1e9);
    run_type<float>(bytes, o, rounds, paths);
    run_type<ringzero::bfloat16>(bytes, o, rounds, paths);
    run_type<ringzero::float16>(bytes, o, rounds, paths);
    run_type<std::int32_t>(bytes, o, rounds, paths);
  }
}
