// all_reduce on GPU buffers through ringzero::nccl, timed the way nccl-tests times it (enqueue
// `iters` calls, synchronize, divide), next to the same NCCL call made directly and a
// device-to-device cudaMemcpy of the same size, so the table shows what the ringzero layer costs
// and what the memory system allows.
//
//   ringzero-bench-nccl [-b 8] [-e 1G] [-f 2] [-n 20] [-w 5] [-d float] [-o sum]
//   ringzero-run -n 8 ringzero-bench-nccl ...      (one rank per GPU; rank 0 prints)
//
// Columns, per message size (B = bytes of one buffer, GB = 1e9 bytes):
//   out-of-place, in-place  ringzero::all_reduce with options::async, per call; algbw = B/time,
//                           busbw = algbw * 2(n-1)/n (0 on one rank: nothing crosses a link);
//                           #wrong = elements differing from the host reference afterwards
//   blocking                the default call (returns with the result in place), host clock
//   raw nccl                ncclAllReduce out of place on the same communicator and stream
//   memcpy                  cudaMemcpyAsync device to device; it reads B and writes B bytes
#include <cuda_runtime.h>
#include <fmt/core.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "ringzero/ringzero.hpp"
#include "ringzero/transport/nccl.hpp"

namespace {

using ringzero::nccl::detail::check_cuda;

struct settings {
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{1} << 30;
  double factor = 2;
  int iters = 20;
  int warmup = 5;
  ringzero::dtype type = ringzero::dtype::float32;
  ringzero::op reduction = ringzero::op::sum;
};

std::size_t parse_size(std::string_view s) {
  std::size_t mult = 1;
  if (!s.empty()) {
    switch (s.back()) {
      case 'K':
      case 'k':
        mult = std::size_t{1} << 10;
        break;
      case 'M':
      case 'm':
        mult = std::size_t{1} << 20;
        break;
      case 'G':
      case 'g':
        mult = std::size_t{1} << 30;
        break;
      default:
        break;
    }
    if (mult != 1) s.remove_suffix(1);
  }
  char* end = nullptr;
  const std::string str(s);
  const unsigned long long v = std::strtoull(str.c_str(), &end, 10);
  if (str.empty() || *end != '\0')
    throw ringzero::invalid_argument(fmt::format("'{}' is not a size (e.g. 8, 64K, 1G)", s));
  return static_cast<std::size_t>(v) * mult;
}

settings parse(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (i + 1 >= argc) throw ringzero::invalid_argument(fmt::format("{} needs a value", flag));
    const std::string_view v = argv[++i];
    if (flag == "-b")
      s.min_bytes = parse_size(v);
    else if (flag == "-e")
      s.max_bytes = parse_size(v);
    else if (flag == "-f")
      s.factor = std::stod(std::string(v));
    else if (flag == "-n")
      s.iters = std::stoi(std::string(v));
    else if (flag == "-w")
      s.warmup = std::stoi(std::string(v));
    else if (flag == "-d")
      s.type = ringzero::parse_dtype(v);
    else if (flag == "-o")
      s.reduction = ringzero::parse_op(v);
    else
      throw ringzero::invalid_argument(fmt::format("unknown flag {} (-b -e -f -n -w -d -o)", flag));
  }
  if (s.factor <= 1 || s.iters < 1 || s.warmup < 0 || s.min_bytes > s.max_bytes)
    throw ringzero::invalid_argument("need -f > 1, -n >= 1, -w >= 0 and -b <= -e");
  return s;
}

/// Mean time per repetition of `body` (which enqueues on `stream`), by CUDA events.
template <class F>
double time_us(cudaStream_t stream, int warmup, int iters, F&& body) {
  for (int i = 0; i < warmup; ++i) body();
  // `stream` and the legacy default stream, not just `stream`: a copy still running there would
  // hold the start event back and hide the calls being timed. Each wait has RINGZERO_TIMEOUT's
  // deadline: a peer that died leaves NCCL's stream running for good.
  const auto limit = ringzero::detail::env_timeout();
  ringzero::detail::wait_stream(stream, limit, "ringzero-bench-nccl: warm-up");
  ringzero::detail::wait_stream(nullptr, limit, "ringzero-bench-nccl: the default stream");
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) body();
  check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
  ringzero::detail::wait_stream(stream, limit, "ringzero-bench-nccl: the timed calls");
  float ms = 0;
  check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  static_cast<void>(cudaEventDestroy(start));
  static_cast<void>(cudaEventDestroy(stop));
  return 1e3 * static_cast<double>(ms) / iters;
}

template <class T>
T value_at(std::size_t i) {
  const auto v = static_cast<int>(i % 7) + 1;  // exact in every type, even summed over ranks
  if constexpr (std::is_same_v<T, ringzero::float16> || std::is_same_v<T, ringzero::bfloat16>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

/// Elements of out (after one all_reduce of the value_at pattern) that differ from the host
/// reference, which is exact for sum, min, max and prod on a single rank and for min and max on
/// any number.
template <class T>
std::size_t count_wrong(const void* out, std::size_t count, int ranks, ringzero::op o) {
  std::vector<T> host(count);
  check_cuda(cudaMemcpy(host.data(), out, count * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const double x = static_cast<double>(static_cast<float>(value_at<T>(i)));
    double want = x;
    if (o == ringzero::op::sum)
      want = x * ranks;
    else if (o == ringzero::op::prod)
      want = std::pow(x, ranks);
    const double got = static_cast<double>(static_cast<float>(host[i]));
    if (std::fabs(got - want) > 1e-2 * std::fabs(want)) ++wrong;
  }
  return wrong;
}

template <class T>
void run(ringzero::nccl::communicator& comm, const settings& s) {
  const std::size_t max_count = s.max_bytes / sizeof(T);
  void* in = nullptr;
  void* out = nullptr;
  check_cuda(cudaMalloc(&in, max_count * sizeof(T)), "cudaMalloc");
  check_cuda(cudaMalloc(&out, max_count * sizeof(T)), "cudaMalloc");
  {
    std::vector<T> pattern(max_count);
    for (std::size_t i = 0; i < max_count; ++i) pattern[i] = value_at<T>(i);
    check_cuda(cudaMemcpy(in, pattern.data(), max_count * sizeof(T), cudaMemcpyHostToDevice),
               "cudaMemcpy");
  }
  const int n = comm.size();
  const cudaStream_t stream = comm.transport().stream();
  const ringzero::options async{.async = true};
  const double bus_factor = 2.0 * (n - 1) / n;
  const std::string type(ringzero::dtype_name(s.type));
  const std::string redop(ringzero::op_name(s.reduction));
  double busbw_sum = 0;
  int rows = 0;

  if (comm.rank() == 0) {
    std::printf("#%75s%35s%11s%11s%19s\n", "out-of-place", "in-place", "blocking", "raw nccl",
                "memcpy D2D");
    std::printf("#%11s %12s %8s %6s %9s %8s %8s %6s %9s %8s %8s %6s %10s %10s %9s %8s\n", "size",
                "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "time", "algbw",
                "busbw", "#wrong", "time", "time", "time", "algbw");
    std::printf("#%11s %12s %8s %6s %9s %8s %8s %6s %9s %8s %8s %6s %10s %10s %9s %8s\n", "(B)",
                "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
                "", "(us)", "(us)", "(us)", "(GB/s)");
  }
  for (double b = static_cast<double>(s.min_bytes);
       b <= static_cast<double>(s.max_bytes) * 1.0000001; b *= s.factor) {
    const std::size_t count = std::max<std::size_t>(static_cast<std::size_t>(b) / sizeof(T), 1);
    const std::size_t bytes = count * sizeof(T);
    const std::span<const T> src(static_cast<const T*>(in), count);
    const std::span<T> dst(static_cast<T*>(out), count);

    const double oop = time_us(stream, s.warmup, s.iters,
                               [&] { ringzero::all_reduce(comm, src, dst, s.reduction, async); });
    check_cuda(cudaMemcpy(out, in, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    const double ip = time_us(stream, s.warmup, s.iters,
                              [&] { ringzero::all_reduce(comm, dst, s.reduction, async); });
    const double raw = time_us(stream, s.warmup, s.iters, [&] {
      ringzero::nccl::detail::check_nccl(
          ncclAllReduce(in, out, count, ringzero::nccl::detail::nccl_type_v<T>,
                        ringzero::nccl::detail::to_nccl(s.reduction),
                        comm.transport().native_handle(), stream),
          "ncclAllReduce");
    });
    const double copy = time_us(stream, s.warmup, s.iters, [&] {
      check_cuda(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync");
    });
    for (int i = 0; i < s.warmup; ++i) ringzero::all_reduce(comm, src, dst, s.reduction);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < s.iters; ++i) ringzero::all_reduce(comm, src, dst, s.reduction);
    const double blocking =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        s.iters;

    // Correctness after the timing: one fresh call per placement on the known input.
    ringzero::all_reduce(comm, src, dst, s.reduction);
    const std::size_t wrong_oop = count_wrong<T>(out, count, n, s.reduction);
    check_cuda(cudaMemcpy(out, in, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    ringzero::all_reduce(comm, dst, s.reduction);
    const std::size_t wrong_ip = count_wrong<T>(out, count, n, s.reduction);

    const auto gbs = [&](double us) { return static_cast<double>(bytes) / (us * 1e3); };
    busbw_sum += gbs(oop) * bus_factor;
    ++rows;
    if (comm.rank() == 0)
      std::printf(
          " %11zu %12zu %8s %6s %9.2f %8.2f %8.2f %6zu %9.2f %8.2f %8.2f %6zu %10.2f %10.2f "
          "%9.2f %8.2f\n",
          bytes, count, type.c_str(), redop.c_str(), oop, gbs(oop), gbs(oop) * bus_factor,
          wrong_oop, ip, gbs(ip), gbs(ip) * bus_factor, wrong_ip, blocking, raw, copy, gbs(copy));
    std::fflush(stdout);
  }
  if (comm.rank() == 0) {
    std::printf("# Avg bus bandwidth    : %g\n", rows ? busbw_sum / rows : 0.0);
    if (n == 1)
      std::printf(
          "# One rank: bus bandwidth is 0 by definition; compare algbw with memcpy. In\n"
          "# place, sum/prod/min/max leave NCCL nothing to do, so those times are the\n"
          "# cost of the call alone.\n");
  }
  static_cast<void>(cudaFree(in));
  static_cast<void>(cudaFree(out));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const settings s = parse(argc, argv);
    if (ringzero::nccl::device_count() == 0) {
      std::fprintf(stderr, "ringzero-bench-nccl: no CUDA device is visible; nothing to measure\n");
      return 77;
    }
    // One rank per process and GPU as the launcher placed them (ringzero-run, torchrun, mpirun,
    // srun); started by hand, a single rank.
    auto comm = ringzero::nccl::communicator::from_env();
    int nccl_version = 0;
    ringzero::nccl::detail::check_nccl(ncclGetVersion(&nccl_version), "ncclGetVersion");
    int runtime = 0;
    int driver = 0;
    check_cuda(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion");
    check_cuda(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, comm.transport().device()),
               "cudaGetDeviceProperties");
    if (comm.rank() == 0) {
      std::printf(
          "# ringzero-bench-nccl: all_reduce, %d rank(s); device %d: %s; NCCL %d; CUDA "
          "runtime %d, driver %d\n",
          comm.size(), comm.transport().device(), prop.name, nccl_version, runtime, driver);
      std::printf("# -b %zu -e %zu -f %g -n %d -w %d -d %s -o %s\n", s.min_bytes, s.max_bytes,
                  s.factor, s.iters, s.warmup, std::string(ringzero::dtype_name(s.type)).c_str(),
                  std::string(ringzero::op_name(s.reduction)).c_str());
    }
    ringzero::visit_dtype(s.type, [&](auto zero) { run<decltype(zero)>(comm, s); });
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringzero-bench-nccl: %s\n", e.what());
    return 1;
  }
}
