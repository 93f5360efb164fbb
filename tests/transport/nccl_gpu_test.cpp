// The NCCL backend on real GPUs: one rank per visible device, as threads of this process (one
// rank on a single-GPU machine, since NCCL refuses two ranks of a communicator on one GPU; a
// test below checks that refusal arrives as a ringzero error). Without a GPU every case prints
// the skip line CTest's SKIP_REGULAR_EXPRESSION looks for, and passes as skipped.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <nccl.h>
#include "stream_gate.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "ringzero/algorithms/schedule.hpp"
#include "ringzero/algorithms/schedule/host_executor.hpp"
#include "ringzero/bootstrap/file_store.hpp"
#include "ringzero/elastic.hpp"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/kernels/device_reproducible.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/nccl.hpp"

using namespace std::chrono_literals;
using ringzero::op;
namespace nccl = ringzero::nccl;

using test_support::stream_gate;

namespace {

void nd_check(const void* p, std::size_t bytes, int device) {
  ringzero::nccl::detail::check_device_buffer("all_reduce", "input", p, bytes, device);
}

bool have_gpu() {
  if (nccl::device_count() > 0) return true;
  MESSAGE("no CUDA device is visible; skipping");
  return false;
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    FAIL(fmt::format("{}: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

/// Rendezvous for ranks that are threads of this process.
class memory_store : public ringzero::bootstrap::store {
 public:
  void set(std::string_view key, std::span<const std::byte> value) override {
    std::lock_guard lock(m_);
    data_[std::string(key)].assign(value.begin(), value.end());
    cv_.notify_all();
  }
  std::vector<std::byte> get(std::string_view key) override {
    std::unique_lock lock(m_);
    const std::string k(key);
    if (!cv_.wait_for(lock, 60s, [&] { return data_.count(k) != 0; }))
      throw ringzero::timeout_error("memory_store: key '" + k + "' never set", -1);
    return data_[k];
  }
  std::int64_t add(std::string_view key, std::int64_t delta) override {
    std::lock_guard lock(m_);
    return counters_[std::string(key)] += delta;
  }
  void wait(std::span<const std::string> keys) override {
    for (const auto& k : keys) static_cast<void>(get(k));
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<std::byte>> data_;
  std::map<std::string, std::int64_t> counters_;
};

/// Runs f(comm) on `n` ranks, one thread and one device each; rethrows the first failure.
template <class F>
void run_world(int n, F&& f, nccl::config cfg = {}) {
  memory_store store;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        nccl::config c = cfg;
        c.device = r;
        nccl::communicator comm(nccl::transport(store, r, n, c));
        f(comm);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

template <class T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t n) : n_(n) {
    cuda_ok(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  }
  ~device_buffer() { static_cast<void>(cudaFree(p_)); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  std::span<T> span() { return {static_cast<T*>(p_), n_}; }
  void upload(const std::vector<T>& v) {
    cuda_ok(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
    // From pageable memory the copy may land after cudaMemcpy returns, ordered only with the
    // legacy stream; calls on other streams must find the data in place.
    cuda_ok(cudaDeviceSynchronize(), "upload");
  }
  std::vector<T> download() {
    std::vector<T> v(n_);
    cuda_ok(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return v;
  }
  /// A byte pattern no reduction of the inputs produces, so an element NCCL never wrote shows.
  void poison() {
    cuda_ok(cudaMemset(p_, 0xa5, std::max<std::size_t>(n_, 1) * sizeof(T)), "poison");
    cuda_ok(cudaDeviceSynchronize(), "poison");
  }

 private:
  void* p_ = nullptr;
  std::size_t n_;
};

// Inputs are small integers (quarters for floating types): every sum, min, max and product of
// them is exact in every element type, so the only inexact result is avg on floating types,
// which NCCL computes by scaling each input by 1/n.
double input_value(ringzero::dtype t, op o, int rank, std::size_t i) {
  const bool is_unsigned =
      t == ringzero::dtype::uint8 || t == ringzero::dtype::uint32 || t == ringzero::dtype::uint64;
  const bool floating = t == ringzero::dtype::float16 || t == ringzero::dtype::float32 ||
                        t == ringzero::dtype::float64 || t == ringzero::dtype::bfloat16;
  const auto k = static_cast<long long>((i * 7 + static_cast<std::size_t>(rank) * 13) % 11);
  double v = 0;
  if (o == op::prod)  // |product| <= 3 on any number of ranks
    v = rank == 0 ? static_cast<double>(i % 3 + 1) : (is_unsigned || (i + rank) % 2 ? 1.0 : -1.0);
  else
    v = is_unsigned ? static_cast<double>(k) : static_cast<double>(k - 5);
  return floating && o != op::prod ? v / 4 : v;
}

double reduce_reference(op o, const std::vector<double>& xs, bool integral) {
  double acc = xs[0];
  for (std::size_t r = 1; r < xs.size(); ++r) {
    switch (o) {
      case op::sum:
      case op::avg:
        acc += xs[r];
        break;
      case op::prod:
        acc *= xs[r];
        break;
      case op::min:
        acc = std::min(acc, xs[r]);
        break;
      case op::max:
        acc = std::max(acc, xs[r]);
        break;
    }
  }
  if (o == op::avg) {
    acc /= static_cast<double>(xs.size());
    if (integral) acc = std::trunc(acc);
  }
  return acc;
}

template <class T>
double as_double(T v) {
  if constexpr (std::is_same_v<T, ringzero::float16> || std::is_same_v<T, ringzero::bfloat16>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}

template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, ringzero::float16> || std::is_same_v<T, ringzero::bfloat16>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <class T>
double tolerance(op o, double ref) {
  if (o != op::avg || !ringzero::is_floating_element_v<T>) return 0;
  const double eps = std::is_same_v<T, double>              ? 1e-15
                     : std::is_same_v<T, float>             ? 1e-6
                     : std::is_same_v<T, ringzero::float16> ? 1e-3
                                                            : 1e-2;
  return 4 * eps * std::max(1.0, std::fabs(ref));
}

/// Counts elements of `got` that differ from `want` (beyond the tolerance of `o`) and describes
/// the first one.
template <class T>
void expect_equal(const std::vector<T>& got, const std::vector<double>& want, op o,
                  const std::string& what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0;
  std::string first;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = as_double(got[i]);
    if (std::fabs(g - want[i]) <= tolerance<T>(o, want[i])) continue;
    if (bad++ == 0) first = fmt::format("element {} is {} but should be {}", i, g, want[i]);
  }
  CHECK_MESSAGE(bad == 0, what, ": ", bad, " of ", got.size(), " elements wrong; ", first);
}

template <class T>
std::vector<T> make_input(int rank, op o, std::size_t count) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i)
    v[i] = from_double<T>(input_value(ringzero::dtype_of<T>(), o, rank, i));
  return v;
}

template <class T>
void check_type(nccl::communicator& comm) {
  const int n = comm.size();
  const int me = comm.rank();
  const int root = n - 1;
  const auto nn = static_cast<std::size_t>(n);
  constexpr std::size_t count = 1031;  // not a multiple of anything NCCL chunks by
  const std::string type(ringzero::dtype_name(ringzero::dtype_of<T>()));
  const bool integral = !ringzero::is_floating_element_v<T>;

  for (op o : ringzero::all_ops) {
    // Reference: element i reduced over every rank's input.
    std::vector<std::vector<double>> inputs(nn, std::vector<double>(count * nn));
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count * nn; ++i)
        inputs[static_cast<std::size_t>(r)][i] =
            as_double(from_double<T>(input_value(ringzero::dtype_of<T>(), o, r, i)));
    std::vector<double> reduced(count * nn);
    for (std::size_t i = 0; i < count * nn; ++i) {
      std::vector<double> xs(nn);
      for (std::size_t r = 0; r < nn; ++r) xs[r] = inputs[r][i];
      reduced[i] = reduce_reference(o, xs, integral);
    }
    const std::vector<T> mine = make_input<T>(me, o, count * nn);
    const std::vector<double> reduced_first(reduced.begin(), reduced.begin() + count);
    const std::vector<double> my_block(
        reduced.begin() + static_cast<std::ptrdiff_t>(count * me),
        reduced.begin() + static_cast<std::ptrdiff_t>(count * (me + 1)));
    const std::string tag =
        fmt::format("{} {} on rank {} of {}", type, ringzero::op_name(o), me, n);

    for (bool in_place : {false, true}) {
      const std::string where = in_place ? " (in place)" : " (out of place)";
      device_buffer<T> in(count * nn), out(count * nn);
      const std::vector<T> first(mine.begin(), mine.begin() + count);

      in.upload(first);
      out.poison();
      if (in_place)
        ringzero::all_reduce(comm, in.span().first(count), o);
      else
        ringzero::all_reduce(comm, in.span().first(count), out.span().first(count), o);
      expect_equal((in_place ? in : out).download(), reduced_first, o, "all_reduce " + tag + where);
      if (!in_place) {
        std::vector<T> after = in.download();
        after.resize(count);
        const auto& own_input = inputs[static_cast<std::size_t>(me)];
        expect_equal(after, std::vector<double>(own_input.begin(), own_input.begin() + count),
                     op::sum, "all_reduce input untouched " + tag);
      }

      in.upload(mine);
      out.poison();
      const auto own = in.span().subspan(count * static_cast<std::size_t>(me), count);
      ringzero::reduce_scatter(comm, in.span(), in_place ? own : out.span().first(count), o);
      std::vector<T> rs = (in_place ? in : out).download();
      if (in_place)
        rs = std::vector<T>(rs.begin() + static_cast<std::ptrdiff_t>(count * me),
                            rs.begin() + static_cast<std::ptrdiff_t>(count * (me + 1)));
      else
        rs.resize(count);
      expect_equal(rs, my_block, o, "reduce_scatter " + tag + where);

      in.upload(first);
      out.poison();
      if (in_place)
        ringzero::reduce(comm, in.span().first(count), o, root);
      else
        ringzero::reduce(comm, in.span().first(count), out.span().first(count), o, root);
      if (me == root)
        expect_equal((in_place ? in : out).download(), reduced_first, o,
                     fmt::format("reduce to root {} {}{}", root, tag, where));
    }
  }

  // Data movement without reduction: one pass per placement is enough for each type.
  for (bool in_place : {false, true}) {
    const std::string tag = fmt::format("{} on rank {} of {}{}", type, me, n,
                                        in_place ? " (in place)" : " (out of place)");
    device_buffer<T> in(count), out(count * nn);
    const std::vector<T> mine = make_input<T>(me, op::sum, count);
    std::vector<double> gathered;
    for (int r = 0; r < n; ++r)
      for (const T& x : make_input<T>(r, op::sum, count)) gathered.push_back(as_double(x));

    out.poison();
    if (in_place) {
      auto own = out.span().subspan(count * static_cast<std::size_t>(me), count);
      cuda_ok(cudaMemcpy(own.data(), mine.data(), count * sizeof(T), cudaMemcpyHostToDevice),
              "upload");
      ringzero::all_gather(comm, own, out.span());
    } else {
      in.upload(mine);
      ringzero::all_gather(comm, in.span(), out.span());
    }
    expect_equal(out.download(), gathered, op::sum, "all_gather " + tag);

    const std::vector<T> root_data = make_input<T>(root, op::sum, count);
    std::vector<double> want;
    for (const T& x : root_data) want.push_back(as_double(x));
    in.upload(mine);
    out.poison();
    if (in_place)
      ringzero::broadcast(comm, in.span(), root);
    else
      ringzero::broadcast(comm, in.span(), out.span().first(count), root);
    std::vector<T> got = (in_place ? in : out).download();
    got.resize(count);
    expect_equal(got, want, op::sum, fmt::format("broadcast from root {} {}", root, tag));

    // all_to_all: block j of this rank's output is block me of rank j's input.
    device_buffer<T> many(count * nn);
    const std::vector<T> blocks = make_input<T>(me, op::sum, count * nn);
    std::vector<double> exchanged;
    for (int r = 0; r < n; ++r) {
      const std::vector<T> theirs = make_input<T>(r, op::sum, count * nn);
      for (std::size_t i = 0; i < count; ++i)
        exchanged.push_back(as_double(theirs[count * static_cast<std::size_t>(me) + i]));
    }
    many.upload(blocks);
    out.poison();
    if (in_place)
      ringzero::all_to_all(comm, many.span());
    else
      ringzero::all_to_all(comm, many.span(), out.span());
    expect_equal((in_place ? many : out).download(), exchanged, op::sum, "all_to_all " + tag);

    // gather to the root, then scatter the gathered buffer back from it.
    in.upload(mine);
    out.poison();
    if (in_place && me == root) {
      auto own = out.span().subspan(count * static_cast<std::size_t>(me), count);
      cuda_ok(cudaMemcpy(own.data(), mine.data(), count * sizeof(T), cudaMemcpyHostToDevice),
              "upload");
      ringzero::gather(comm, own, out.span(), root);
    } else {
      ringzero::gather(comm, in.span(), out.span(), root);
    }
    if (me == root)
      expect_equal(out.download(), gathered, op::sum,
                   fmt::format("gather to root {} {}", root, tag));
    many.upload(make_input<T>(me, op::sum, count * nn));
    in.poison();
    std::vector<double> scattered;
    const std::vector<T> root_blocks = make_input<T>(root, op::sum, count * nn);
    for (std::size_t i = 0; i < count; ++i)
      scattered.push_back(as_double(root_blocks[count * static_cast<std::size_t>(me) + i]));
    if (in_place && me == root) {
      auto own = many.span().subspan(count * static_cast<std::size_t>(me), count);
      ringzero::scatter(comm, many.span(), own, root);
      std::vector<T> all = many.download();
      got.assign(
          all.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(me)),
          all.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(me + 1)));
    } else {
      ringzero::scatter(comm, many.span(), in.span(), root);
      got = in.download();
    }
    expect_equal(got, scattered, op::sum, fmt::format("scatter from root {} {}", root, tag));
  }

  if (n >= 2) {
    // A ring: everyone sends to the next rank and receives from the previous one.
    const int next = (me + 1) % n;
    const int prev = (me + n - 1) % n;
    device_buffer<T> in(count), out(count);
    const std::vector<T> mine = make_input<T>(me, op::sum, count);
    std::vector<double> want;
    for (const T& x : make_input<T>(prev, op::sum, count)) want.push_back(as_double(x));
    in.upload(mine);
    out.poison();
    ringzero::send_recv(comm, std::span<const T>(in.span()), next, out.span(), prev);
    expect_equal(out.download(), want, op::sum, fmt::format("send_recv {} rank {}", type, me));
    out.poison();
    if (me % 2 == 0 && me + 1 < n) ringzero::send(comm, in.span(), me + 1);
    if (me % 2 == 1) {
      ringzero::recv(comm, out.span(), me - 1);
      want.clear();
      for (const T& x : make_input<T>(me - 1, op::sum, count)) want.push_back(as_double(x));
      expect_equal(out.download(), want, op::sum, fmt::format("send/recv {} rank {}", type, me));
    }
  }
}

// --- ringzero's schedules on GPU buffers --------------------------------------------------------

namespace sched = ringzero::algorithms::schedule;

/// One forced-algorithm call: the algorithm, the collective, the op and the count (native_call's:
/// reduce_scatter's output block, all_gather's input block).
struct schedule_case {
  ringzero::algorithm algo;
  ringzero::collective kind;
  op reduction;
  std::size_t count;
};

std::vector<schedule_case> schedule_cases() {
  std::vector<schedule_case> cases;
  for (const auto& e : sched::schedules)
    for (ringzero::collective k :
         {ringzero::collective::all_reduce, ringzero::collective::reduce_scatter,
          ringzero::collective::all_gather, ringzero::collective::broadcast,
          ringzero::collective::reduce}) {
      if (!e.implements.contains(k)) continue;
      for (op o : ringzero::all_ops) {
        if (!sched::reduces(k) && o != op::sum) continue;
        for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{1031}})
          cases.push_back({e.id, k, o, count});
      }
    }
  return cases;
}

std::string case_name(ringzero::dtype t, const schedule_case& c) {
  return fmt::format("{} {} {} {} count {}", ringzero::algorithm_name(c.algo),
                     ringzero::collective_name(c.kind), ringzero::dtype_name(t),
                     ringzero::op_name(c.reduction), c.count);
}

/// (input elements, output elements) of a case on n ranks.
std::pair<std::size_t, std::size_t> case_sizes(const schedule_case& c, int n) {
  const auto nn = static_cast<std::size_t>(n);
  if (c.kind == ringzero::collective::reduce_scatter) return {c.count * nn, c.count};
  if (c.kind == ringzero::collective::all_gather) return {c.count, c.count * nn};
  return {c.count, c.count};
}

/// The bits each rank must end with: the same schedule run by the host executor over loopback
/// ranks on the same inputs. The CUDA kernels run the per-element code the host executor runs, so
/// the device must match them bit for bit. Keyed by case_name; reduce's non-roots hold nothing.
using host_bits = std::map<std::string, std::vector<std::vector<std::byte>>>;

template <class T>
void add_host_bits(host_bits& into, int n) {
  const int root = n - 1;
  for (const schedule_case& c : schedule_cases()) {
    auto& per_rank = into[case_name(ringzero::dtype_of<T>(), c)];
    per_rank.assign(static_cast<std::size_t>(n), {});
    ringzero::loopback::world(n).run([&](ringzero::loopback::communicator& comm) {
      const auto [in_len, out_len] = case_sizes(c, n);
      const std::vector<T> in = make_input<T>(comm.rank(), c.reduction, in_len);
      std::vector<T> out(out_len);
      sched::run_on_host(comm, c.algo,
                         ringzero::algorithms::call<T>{c.kind, in, out, c.reduction, root});
      if (c.kind != ringzero::collective::reduce || comm.rank() == root) {
        const auto bytes = std::as_bytes(std::span<const T>(out));
        per_rank[static_cast<std::size_t>(comm.rank())].assign(bytes.begin(), bytes.end());
      }
    });
  }
}

/// Runs every schedule case of type T on the GPU, in place and out of place, twice each; compares
/// each result with the host executor's bits (and, for the rank's own view, with the plain
/// reference of the native tests).
template <class T>
void check_schedules(nccl::communicator& comm, const host_bits& want) {
  const int n = comm.size();
  const int me = comm.rank();
  const int root = n - 1;
  const bool have_kernels = ringzero::kernels::registered_device_reduction() != nullptr;
  for (const schedule_case& c : schedule_cases()) {
    const std::string name = case_name(ringzero::dtype_of<T>(), c);
    const auto [in_len, out_len] = case_sizes(c, n);
    const std::vector<T> mine = make_input<T>(me, c.reduction, in_len);
    const ringzero::options opt{.algorithm = c.algo};
    if (sched::reduces(c.kind) && !have_kernels) {
      device_buffer<T> d(in_len);
      d.upload(mine);
      try {
        ringzero::all_reduce(comm, d.span().first(c.count), c.reduction, opt);
        FAIL("expected unsupported without ringzero's CUDA kernels: ", name);
      } catch (const ringzero::unsupported& e) {
        CHECK_MESSAGE(std::string(e.what()).find("device_reduction.cuh") != std::string::npos,
                      e.what());
      }
      continue;
    }
    const std::vector<std::byte>& expected = want.at(name)[static_cast<std::size_t>(me)];
    for (bool in_place : {false, true}) {
      std::vector<std::byte> first;
      for (int run = 0; run < 2; ++run) {
        device_buffer<T> in(in_len), out(std::max(in_len, out_len));
        in.upload(mine);
        out.poison();
        const auto own = [&](device_buffer<T>& b, std::size_t len) {
          return b.span().subspan(len * static_cast<std::size_t>(me), len);
        };
        std::vector<T> got;
        switch (c.kind) {
          case ringzero::collective::all_reduce:
            if (in_place)
              ringzero::all_reduce(comm, in.span(), c.reduction, opt);
            else
              ringzero::all_reduce(comm, in.span(), out.span().first(c.count), c.reduction, opt);
            got = (in_place ? in : out).download();
            break;
          case ringzero::collective::reduce_scatter: {
            const auto dst = in_place ? own(in, c.count) : out.span().first(c.count);
            ringzero::reduce_scatter(comm, in.span(), dst, c.reduction, opt);
            got.resize(c.count);
            cuda_ok(cudaMemcpy(got.data(), dst.data(), c.count * sizeof(T), cudaMemcpyDeviceToHost),
                    "download");
            break;
          }
          case ringzero::collective::all_gather:
            if (in_place) {
              cuda_ok(cudaMemcpy(own(out, c.count).data(), mine.data(), c.count * sizeof(T),
                                 cudaMemcpyHostToDevice),
                      "upload");
              ringzero::all_gather(comm, own(out, c.count), out.span().first(out_len), opt);
            } else {
              ringzero::all_gather(comm, in.span(), out.span().first(out_len), opt);
            }
            got = out.download();
            break;
          case ringzero::collective::broadcast:
            if (in_place)
              ringzero::broadcast(comm, in.span(), root, opt);
            else
              ringzero::broadcast(comm, in.span(), out.span().first(c.count), root, opt);
            got = (in_place ? in : out).download();
            break;
          default:
            if (in_place)
              ringzero::reduce(comm, in.span(), c.reduction, root, opt);
            else
              ringzero::reduce(comm, in.span(), out.span().first(c.count), c.reduction, root, opt);
            got = (in_place ? in : out).download();
            break;
        }
        if (c.kind == ringzero::collective::reduce && me != root) continue;
        got.resize(out_len);
        const auto bytes = std::as_bytes(std::span<const T>(got));
        std::vector<std::byte> now(bytes.begin(), bytes.end());
        const std::string what =
            fmt::format("{} on rank {} of {}{}", name, me, n, in_place ? " (in place)" : "");
        CHECK_MESSAGE(now == expected, what, ": not the host executor's bits");
        if (run == 0)
          first = std::move(now);
        else
          CHECK_MESSAGE(now == first, what, ": a second run gave other bits");
      }
    }
  }
}

}  // namespace

TEST_CASE("every collective, element type and op matches a host reference") {
  if (!have_gpu()) return;
  const int n = nccl::device_count();
  MESSAGE("world of ", n, " rank(s), one per visible GPU");
  run_world(n, [](nccl::communicator& comm) {
    REQUIRE(comm.transport().device() == comm.rank());
    // The contract the buffers below rely on: the rank's device is current from construction.
    int current = -1;
    cuda_ok(cudaGetDevice(&current), "cudaGetDevice");
    REQUIRE(current == comm.transport().device());
    for (ringzero::dtype t : ringzero::all_dtypes)
      ringzero::visit_dtype(t, [&](auto zero) { check_type<decltype(zero)>(comm); });
    ringzero::barrier(comm);
  });
}

TEST_CASE("ringzero's ring and tree on GPU buffers give the host executor's bits") {
  if (!have_gpu()) return;
  const int n = nccl::device_count();
  MESSAGE(
      "world of ", n, " rank(s), one per visible GPU; CUDA reductions ",
      ringzero::kernels::registered_device_reduction() != nullptr ? "registered" : "not linked in");
  host_bits want;
  for (ringzero::dtype t : ringzero::all_dtypes)
    ringzero::visit_dtype(t, [&](auto zero) { add_host_bits<decltype(zero)>(want, n); });
  run_world(n, [&](nccl::communicator& comm) {
    for (ringzero::dtype t : ringzero::all_dtypes)
      ringzero::visit_dtype(t, [&](auto zero) { check_schedules<decltype(zero)>(comm, want); });
    ringzero::barrier(comm);
  });
}

TEST_CASE("a forced ring all_reduce runs async on a caller's stream") {
  if (!have_gpu()) return;
  if (ringzero::kernels::registered_device_reduction() == nullptr) {
    MESSAGE("ringzero's CUDA reductions are not linked into this build; nothing to run");
    return;
  }
  const int n = nccl::device_count();
  run_world(n, [&](nccl::communicator& comm) {
    cudaStream_t s = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    constexpr std::size_t count = (1 << 20) + 3;
    device_buffer<float> a(count);
    std::vector<float> host(count);
    for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i % 1000);
    a.upload(host);
    // docs-begin: nccl-schedules
    // ringzero's ring and tree instead of NCCL's own collectives: a fixed reduction order.
    const ringzero::options ring{
        .algorithm = ringzero::algorithm::ring, .stream = s, .async = true};
    for (int i = 0; i < 4; ++i) ringzero::all_reduce(comm, a.span(), op::max, ring);
    ringzero::all_reduce(comm, a.span(), op::avg,
                         {.algorithm = ringzero::algorithm::tree, .stream = s, .async = true});
    comm.transport().synchronize(s);
    // docs-end: nccl-schedules
    CHECK(a.download() == host);
    cuda_ok(cudaStreamDestroy(s), "cudaStreamDestroy");
  });
}

TEST_CASE("a communicator made by single() is a world of one on the chosen device") {
  if (!have_gpu()) return;
  auto comm = nccl::communicator(nccl::transport::single({.device = 0}));
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  CHECK(comm.transport().device() == 0);
  CHECK(comm.transport().native_handle() != nullptr);
  CHECK(comm.transport().stream() != nullptr);
  CHECK_FALSE(comm.transport().aborted());
  ringzero::barrier(comm);
}

TEST_CASE("split() makes an NCCL communicator of its own through ncclCommSplit") {
  if (!have_gpu()) return;
  auto world = nccl::communicator(nccl::transport::single({.device = 0}));
  CHECK_FALSE(world.split(-1, 0));  // takes part, gets nothing
  std::optional<nccl::communicator> sub = world.split(3, 0);
  REQUIRE(sub);
  CHECK(sub->size() == 1);
  CHECK(sub->timeout() == world.timeout());
  CHECK(sub->transport().native_handle() != world.transport().native_handle());
  float* d = nullptr;
  cuda_ok(cudaMalloc(&d, 4 * sizeof(float)), "cudaMalloc");
  const float h[4] = {1, 2, 3, 4};
  cuda_ok(cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice), "cudaMemcpy");
  ringzero::all_reduce(*sub, std::span<float>(d, 4), op::sum);
  ringzero::all_reduce(world, std::span<float>(d, 4), op::sum);  // the parent still works
  float back[4] = {};
  cuda_ok(cudaMemcpy(back, d, sizeof back, cudaMemcpyDeviceToHost), "cudaMemcpy");
  CHECK(std::equal(back, back + 4, h));
  cuda_ok(cudaFree(d), "cudaFree");
}

TEST_CASE("elastic: each generation builds its NCCL communicator anew over its own store keys") {
  if (!have_gpu()) return;
  char tmpl[] = "/tmp/ringzero-nccl-elastic-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  auto store = std::make_shared<ringzero::bootstrap::file_store>(tmpl, 20s);
  ringzero::elastic::limits lim;
  ringzero::elastic::session s(store, 0, 1, lim, 1s);
  s.join();
  for (int generation = 0; generation < 2; ++generation) {
    CAPTURE(generation);
    auto comm = s.communicator<nccl::communicator>(nccl::config{.device = 0});
    CHECK(comm.size() == 1);
    float* d = nullptr;
    cuda_ok(cudaMalloc(&d, 4 * sizeof(float)), "cudaMalloc");
    const float h[4] = {1, 2, 3, 4};
    cuda_ok(cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice), "cudaMemcpy");
    ringzero::all_reduce(comm, std::span<float>(d, 4), op::sum);
    float back[4] = {};
    cuda_ok(cudaMemcpy(back, d, sizeof back, cudaMemcpyDeviceToHost), "cudaMemcpy");
    CHECK(std::equal(back, back + 4, h));
    cuda_ok(cudaFree(d), "cudaFree");
    s.grow();  // the next generation: a fresh key prefix, a fresh NCCL unique id
  }
  std::filesystem::remove_all(tmpl);
}

TEST_CASE("async calls on a caller's stream complete at synchronize()") {
  if (!have_gpu()) return;
  auto comm = nccl::communicator::single();
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  constexpr std::size_t count = 1 << 20;
  device_buffer<float> a(count), b(count);
  std::vector<float> host(count);
  for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i % 1000) * 0.5f;
  cuda_ok(cudaMemcpyAsync(a.span().data(), host.data(), count * sizeof(float),
                          cudaMemcpyHostToDevice, s),
          "cudaMemcpyAsync");
  b.poison();
  const ringzero::options async{.stream = s, .async = true};
  for (int i = 0; i < 8; ++i) {
    ringzero::all_reduce(comm, a.span(), b.span(), op::sum, async);
    ringzero::all_reduce(comm, b.span(), a.span(), op::max, async);
  }
  comm.transport().synchronize(s);
  CHECK(a.download() == host);
  CHECK(b.download() == host);
  cuda_ok(cudaStreamDestroy(s), "cudaStreamDestroy");
}

TEST_CASE("bad arguments throw invalid_argument and leave the communicator usable") {
  if (!have_gpu()) return;
  auto comm = nccl::communicator::single();
  device_buffer<int> d(64);
  std::vector<int> host(64, 3);
  const auto expect_invalid = [](auto&& call, const std::string& text) {
    try {
      call();
      FAIL("expected invalid_argument containing '", text, "'");
    } catch (const ringzero::invalid_argument& e) {
      CHECK_MESSAGE(std::string(e.what()).find(text) != std::string::npos, e.what());
    }
  };
  // Host memory beyond the staging bound (small blocking calls are staged: the next case).
  std::vector<int> bulk(nccl::transport::host_staging_bytes / sizeof(int));
  expect_invalid([&] { ringzero::all_reduce(comm, std::span<int>(bulk), op::sum); },
                 "all_reduce: the start of the input");
  expect_invalid([&] { ringzero::all_reduce(comm, d.span(), std::span<int>(host), op::sum); },
                 "all_reduce: the start of the output");
  expect_invalid(
      [&] { ringzero::all_reduce(comm, d.span().first(8), d.span().subspan(8, 9), op::sum); },
      "all_reduce: input has 8 elements but output has 9");
  expect_invalid(
      [&] { ringzero::reduce_scatter(comm, d.span().first(8), d.span().subspan(8, 4), op::sum); },
      "reduce_scatter: input must hold size() * output elements (1 * 4 = 4), got 8");
  expect_invalid([&] { ringzero::broadcast(comm, d.span(), 1); },
                 "broadcast: root 1 is out of range for a 1-rank communicator");
  expect_invalid([&] { ringzero::send(comm, d.span(), 0); },
                 "send: peer 0 is not another rank of this 1-rank communicator (this is rank 0)");
  // A span far longer than its allocation ends in memory CUDA does not know. Checked on the
  // check itself: if it missed, NCCL's illegal access would poison the context for every test.
  device_buffer<std::uint8_t> tiny(16);
  expect_invalid(
      [&] { nd_check(tiny.span().data(), std::size_t{1} << 30, comm.transport().device()); },
      "all_reduce: the end of the input");
  CHECK_FALSE(comm.transport().aborted());
  std::vector<int> v(64, 5);
  d.upload(v);
  ringzero::all_reduce(comm, d.span(), op::sum);
  CHECK(d.download() == v);
}

TEST_CASE("small blocking calls on host memory are staged through the device") {
  if (!have_gpu()) return;
  auto comm = nccl::communicator::single();
  std::vector<int> v{1, 2, 3};
  ringzero::all_reduce(comm, std::span<int>(v), op::sum);  // in place, one rank: unchanged
  CHECK(v == std::vector<int>{1, 2, 3});
  std::vector<std::uint64_t> mine{7, 8}, all(2);
  ringzero::all_gather(comm, std::span<const std::uint64_t>(mine), std::span<std::uint64_t>(all));
  CHECK(all == mine);
  const std::vector<float> in{0.5f, 1.5f, 2.5f};
  std::vector<float> out(3);
  ringzero::all_reduce(comm, std::span<const float>(in), std::span<float>(out), op::max);
  CHECK(out == in);
  // Never asynchronously: the copy back would have to wait anyway.
  CHECK_THROWS_AS(ringzero::all_reduce(comm, std::span<int>(v), op::sum, {.async = true}),
                  ringzero::invalid_argument);
  CHECK_FALSE(comm.transport().aborted());
}

TEST_CASE("NCCL errors become transport_error with NCCL's text and abort the communicator") {
  if (!have_gpu()) return;
  device_buffer<float> d(16);
  // A call NCCL refuses (a datatype it does not know): a non-blocking communicator keeps that
  // error as its state, so ringzero aborts it and says why from then on.
  auto comm = nccl::communicator::single();
  try {
    comm.transport().enqueue("custom all_reduce", {}, [&](ncclComm_t h, cudaStream_t s) {
      return ncclAllReduce(d.span().data(), d.span().data(), 16, ncclNumTypes, ncclSum, h, s);
    });
    FAIL("expected transport_error");
  } catch (const ringzero::transport_error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find("custom all_reduce on rank 0 of 1 (device 0): NCCL error: invalid "
                           "argument") != std::string::npos,
                  msg);
    CHECK_MESSAGE(msg.find("NCCL's last error: AllReduce : invalid type") != std::string::npos,
                  msg);
    CHECK_MESSAGE(msg.find("the communicator was aborted") != std::string::npos, msg);
    CHECK(e.code() == ringzero::errc::transport);
  }
  CHECK(comm.transport().aborted());
  CHECK(comm.transport().native_handle() == nullptr);
  try {
    ringzero::all_reduce(comm, d.span(), op::sum);
    FAIL("expected transport_error");
  } catch (const ringzero::transport_error& e) {
    CHECK_MESSAGE(
        std::string(e.what()).find("all_reduce: this communicator was aborted after an "
                                   "earlier failure: custom all_reduce") != std::string::npos,
        e.what());
  }

  // Any other status is mapped the same way, with NCCL's own wording.
  auto other = nccl::communicator::single();
  CHECK_THROWS_WITH_AS(
      other.transport().enqueue("custom", {},
                                [](ncclComm_t, cudaStream_t) { return ncclSystemError; }),
      doctest::Contains("custom on rank 0 of 1 (device 0): NCCL error: unhandled system error"),
      ringzero::transport_error);
  CHECK(other.transport().aborted());

  // A fresh communicator works: the failures stayed with the ones that were aborted.
  auto fresh = nccl::communicator::single();
  std::vector<float> v(16, 1.5f);
  d.upload(v);
  ringzero::all_reduce(fresh, d.span(), op::sum);
  CHECK(d.download() == v);
}

TEST_CASE("a call whose stream never drains times out, names the call and aborts") {
  if (!have_gpu()) return;
  auto comm = nccl::communicator(nccl::transport::single({.timeout = 10s}));
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  device_buffer<float> a(1024), b(1024);
  stream_gate gate;
  cuda_ok(cudaLaunchHostFunc(s, &stream_gate::hold, &gate), "cudaLaunchHostFunc");
  // Opens the gate late whatever happens, so an abort that waits for the stream still returns.
  std::thread opener([&] {
    std::this_thread::sleep_for(3s);
    gate.open = true;
  });
  const auto start = std::chrono::steady_clock::now();
  try {
    ringzero::all_reduce(comm, a.span(), b.span(), op::sum, {.timeout = 500ms, .stream = s});
    FAIL("expected timeout_error");
  } catch (const ringzero::timeout_error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find("all_reduce on rank 0 of 1 (device 0) did not complete within 0.5 s") !=
                      std::string::npos,
                  msg);
    CHECK_MESSAGE(msg.find("NCCL does not report which rank") != std::string::npos, msg);
    CHECK(e.peer() == -1);
  }
  // ncclCommAbort waits for the work queued ahead of NCCL's on the stream, so this returns
  // once the gate opens, not at the deadline; a stuck NCCL kernel, by contrast, is stopped.
  const auto waited = std::chrono::steady_clock::now() - start;
  MESSAGE("timed out and aborted after ",
          std::chrono::duration_cast<std::chrono::milliseconds>(waited).count(), " ms");
  CHECK(comm.transport().aborted());
  opener.join();
  cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  cuda_ok(cudaStreamDestroy(s), "cudaStreamDestroy");
  CHECK_THROWS_AS(comm.transport().synchronize(), ringzero::transport_error);
}

TEST_CASE("a call on the communicator's stream waits for the default stream's work first") {
  if (!have_gpu()) return;
  // The communicator's stream is non-blocking; a buffer the default (legacy) stream is still
  // writing must not be read early. The write is held behind a gate for 200 ms.
  auto comm = nccl::communicator::single();
  constexpr std::size_t n = 1 << 16;
  device_buffer<float> in(n), out(n);
  in.poison();
  out.poison();
  float* pinned = nullptr;
  cuda_ok(cudaMallocHost(&pinned, n * sizeof(float)), "cudaMallocHost");
  for (std::size_t i = 0; i < n; ++i) pinned[i] = static_cast<float>(i % 977);
  stream_gate gate;
  cuda_ok(cudaLaunchHostFunc(cudaStreamLegacy, &stream_gate::hold, &gate), "cudaLaunchHostFunc");
  cuda_ok(cudaMemcpyAsync(in.span().data(), pinned, n * sizeof(float), cudaMemcpyHostToDevice,
                          cudaStreamLegacy),
          "cudaMemcpyAsync");
  std::thread opener([&] {
    std::this_thread::sleep_for(200ms);
    gate.open = true;
  });
  ringzero::all_reduce(comm, std::span<const float>(in.span()), out.span(), op::sum);
  opener.join();
  const std::vector<float> got = out.download();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += got[i] != static_cast<float>(i % 977);
  CHECK_MESSAGE(wrong == 0, wrong, " of ", n,
                " elements were read before the default stream wrote them");
  cuda_ok(cudaFreeHost(pinned), "cudaFreeHost");
}

TEST_CASE("creation with a rank that never comes times out and aborts") {
  if (!have_gpu()) return;
  memory_store store;
  const auto start = std::chrono::steady_clock::now();
  try {
    nccl::communicator comm(nccl::transport(store, 0, 2, {.device = 0, .timeout = 2s}));
    FAIL("expected timeout_error");
  } catch (const ringzero::timeout_error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find("creating the NCCL communicator on rank 0 of 2 (device 0) did not "
                           "complete within 2 s") != std::string::npos,
                  msg);
  }
  MESSAGE("creation gave up after ",
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                start)
              .count(),
          " ms");
}

TEST_CASE("a rank named dead ends creation at once, naming it, not at the deadline") {
  if (!have_gpu()) return;
  // What an elastic session's probe (config::dead_rank) reports once the launcher reaped a
  // process or its heartbeat stopped: here after 300 ms, against a 30 s deadline.
  memory_store store;
  const auto start = std::chrono::steady_clock::now();
  nccl::config cfg{.device = 0, .timeout = 30s};
  cfg.dead_rank = [start] { return std::chrono::steady_clock::now() - start > 300ms ? 1 : -1; };
  std::string what;
  int peer = -2;
  try {
    nccl::communicator comm(nccl::transport(store, 0, 2, cfg));
  } catch (const ringzero::peer_error& e) {
    what = e.what();
    peer = e.peer();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  MESSAGE("creation ended after ",
          std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), " ms: ", what);
  CHECK(peer == 1);
  CHECK_MESSAGE(what.find("rank 1 died") != std::string::npos, what);
  CHECK(took < 10s);
}

TEST_CASE("abort() from another thread ends a call held on the device, and every later one") {
  if (!have_gpu()) return;
  auto comm = nccl::communicator(nccl::transport::single({.timeout = 30s}));
  device_buffer<float> d(1 << 16);
  d.upload(std::vector<float>(1 << 16, 1.0f));
  stream_gate gate;
  cuda_ok(cudaLaunchHostFunc(comm.transport().stream(), &stream_gate::hold, &gate),
          "cudaLaunchHostFunc");
  std::thread stopper([&] {
    std::this_thread::sleep_for(300ms);
    comm.abort("stopped by the test");
  });
  // The stream is held until the gate opens; NCCL's abort waits for work queued ahead of it.
  std::thread opener([&] {
    std::this_thread::sleep_for(2s);
    gate.open = true;
  });
  const auto start = std::chrono::steady_clock::now();
  std::string what;
  try {
    ringzero::all_reduce(comm, d.span(), op::sum);
  } catch (const ringzero::peer_error& e) {
    what = e.what();
  }
  stopper.join();
  opener.join();
  MESSAGE("the call ended after ",
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                start)
              .count(),
          " ms: ", what);
  CHECK_MESSAGE(what.find("stopped by the test") != std::string::npos, what);
  CHECK(comm.transport().aborted());
  CHECK_THROWS_AS(ringzero::all_reduce(comm, d.span(), op::sum), ringzero::peer_error);
}

TEST_CASE("shrink() makes the survivors' communicator without a new rendezvous") {
  if (!have_gpu()) return;
  const int n = nccl::device_count();
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 27, 0)
  MESSAGE("this NCCL has no ncclCommShrink; shrink() is refused");
  CHECK_THROWS_AS((void)nccl::transport::single().shrink({}), ringzero::unsupported);
  return;
#endif
  if (n < 2) {
    MESSAGE("one GPU: a shrink needs two ranks, one GPU each (scripts/gpu_check.sh --ranks)");
    return;
  }
  run_world(n, [&](nccl::communicator& comm) {
    const int last = comm.size() - 1;
    if (comm.rank() == last) {
      comm.abort("excluded");  // it leaves: destroyed at once, without finalizing
      return;
    }
    const int excluded[] = {last};
    nccl::communicator next(comm.transport().shrink(excluded), comm.timeout());
    CHECK(next.size() == comm.size() - 1);
    CHECK(next.rank() == comm.rank());
    int current = -1;
    cuda_ok(cudaGetDevice(&current), "cudaGetDevice");
    CHECK(current == next.transport().device());
    device_buffer<float> d(1000);
    d.upload(std::vector<float>(1000, 1.0f));
    ringzero::all_reduce(next, d.span(), op::sum);
    CHECK(d.download()[999] == static_cast<float>(next.size()));
    comm.abort("shrunk");  // the old communicator's last rank left: do not finalize with it
  });
}

TEST_CASE("split() across ranks: two halves, each summing its own") {
  if (!have_gpu()) return;
  const int n = nccl::device_count();
  if (n < 2 || n % 2 != 0) {
    MESSAGE(n, " GPU(s): a split into halves needs an even number of ranks, one GPU each");
    return;
  }
  run_world(n, [&](nccl::communicator& comm) {
    const int half = comm.rank() / (n / 2);
    std::optional<nccl::communicator> sub = comm.split(half, comm.rank());
    REQUIRE(sub);
    CHECK(sub->size() == n / 2);
    CHECK(sub->rank() == comm.rank() % (n / 2));
    device_buffer<float> d(1000);
    d.upload(std::vector<float>(1000, static_cast<float>(comm.rank())));
    ringzero::all_reduce(*sub, d.span(), op::sum);
    float want = 0.0f;
    for (int r = half * (n / 2); r < (half + 1) * (n / 2); ++r) want += static_cast<float>(r);
    CHECK(d.download()[999] == want);
  });
}

TEST_CASE("two ranks on one GPU: NCCL's refusal arrives as a ringzero error") {
  if (!have_gpu()) return;
  memory_store store;
  std::vector<std::string> outcome(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        nccl::communicator comm(nccl::transport(store, r, 2, {.device = 0, .timeout = 30s}));
        outcome[static_cast<std::size_t>(r)] = "created";
      } catch (const ringzero::transport_error& e) {
        outcome[static_cast<std::size_t>(r)] = std::string("transport_error: ") + e.what();
      } catch (const ringzero::timeout_error& e) {
        outcome[static_cast<std::size_t>(r)] = std::string("timeout_error: ") + e.what();
      } catch (const std::exception& e) {
        outcome[static_cast<std::size_t>(r)] = std::string("other: ") + e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) MESSAGE("rank ", r, ": ", outcome[static_cast<std::size_t>(r)]);
  int refused = 0;
  for (const auto& o : outcome) {
    CHECK(o != "created");
    if (o.rfind("transport_error: ", 0) == 0 && o.find("invalid usage") != std::string::npos &&
        o.find("Duplicate GPU") != std::string::npos)
      ++refused;
  }
  CHECK_MESSAGE(refused >= 1, "expected a transport_error naming NCCL's duplicate-GPU refusal");
}

TEST_CASE("adopting an ncclComm_t: borrowed handles outlive the wrapper, owned ones do not") {
  if (!have_gpu()) return;
  int dev = 0;
  ncclComm_t raw = nullptr;
  cuda_ok(cudaSetDevice(dev), "cudaSetDevice");
  REQUIRE(ncclCommInitAll(&raw, 1, &dev) == ncclSuccess);
  device_buffer<double> d(100);
  std::vector<double> v(100, 2.5);
  d.upload(v);
  {
    nccl::communicator comm(nccl::transport(raw, nccl::ownership::borrowed));
    CHECK(comm.rank() == 0);
    CHECK(comm.size() == 1);
    CHECK(comm.transport().device() == dev);
    ringzero::all_reduce(comm, d.span(), op::avg);
  }
  CHECK(d.download() == v);
  CHECK(ncclCommDestroy(raw) == ncclSuccess);

  REQUIRE(ncclCommInitAll(&raw, 1, &dev) == ncclSuccess);
  nccl::communicator owner{nccl::transport(raw)};
  nccl::communicator moved = std::move(owner);
  CHECK_FALSE(owner.valid());
  CHECK(moved.transport().native_handle() == raw);
  CHECK_THROWS_WITH_AS(ringzero::all_reduce(owner, d.span(), op::sum),
                       "ringzero: all_reduce: this communicator was moved from",
                       ringzero::invalid_argument);
  ringzero::all_reduce(moved, d.span(), op::min);
  CHECK(d.download() == v);
  owner = std::move(moved);
  CHECK(owner.transport().native_handle() == raw);
}

TEST_CASE("options::reproducible on GPU buffers gives the exact sum rounded once") {
  if (!have_gpu()) return;
  if (ringzero::kernels::registered_device_reproducible() == nullptr) {
    FAIL("this test links kernels/cuda/device_reduction.cuh; its reproducible kernels are missing");
    return;
  }
  const int n = nccl::device_count();
  run_world(n, [&](nccl::communicator& comm) {
    namespace rp = ringzero::reproducible;
    const int r = comm.rank();
    const auto un = static_cast<std::size_t>(n);
    // Terms of 2^+-40 that ordinary float addition cannot sum exactly, an inf and a NaN.
    auto term = [](int rank, std::size_t i) {
      if (i == 7) return rank == 0 ? INFINITY : 1.0f;
      if (i == 11) return NAN;
      const auto h =
          static_cast<std::uint32_t>((i * 2654435761u) ^ (static_cast<unsigned>(rank) * 40503u));
      return std::ldexp(1.0f + static_cast<float>(h & 0xffff) / 65536.0f,
                        static_cast<int>(h % 81) - 40) *
             ((h >> 20) & 1 ? -1.0f : 1.0f);
    };
    // 1,048,583 elements: 16,385 blocks, so the layout's scan spans many of CUB's tiles.
    for (std::size_t count :
         {std::size_t{1}, std::size_t{1009}, std::size_t{70001}, std::size_t{1048583}}) {
      for (op o : {op::sum, op::avg}) {
        const std::size_t total = un * count;  // reduce_scatter's input; the others use count
        std::vector<float> in(total), want(total), terms(un);
        for (std::size_t i = 0; i < total; ++i) {
          in[i] = term(r, i);
          for (int j = 0; j < n; ++j) terms[static_cast<std::size_t>(j)] = term(j, i);
          want[i] =
              rp::serial_sum(terms.data(), un, o == op::avg ? static_cast<std::uint32_t>(n) : 1);
        }
        float* din = nullptr;
        float* dout = nullptr;
        cuda_ok(cudaMalloc(&din, total * sizeof(float)), "cudaMalloc");
        cuda_ok(cudaMalloc(&dout, total * sizeof(float)), "cudaMalloc");
        cuda_ok(cudaMemcpy(din, in.data(), total * sizeof(float), cudaMemcpyHostToDevice),
                "cudaMemcpy");
        ringzero::options opt;
        opt.reproducible = true;
        std::vector<float> got(count);
        auto compare = [&](const char* what, const float* expect) {
          cuda_ok(cudaMemcpy(got.data(), dout, count * sizeof(float), cudaMemcpyDeviceToHost),
                  "cudaMemcpy");
          CHECK_MESSAGE(std::memcmp(got.data(), expect, count * sizeof(float)) == 0,
                        what << " " << ringzero::op_name(o) << " count " << count);
        };
        ringzero::all_reduce(comm, std::span<const float>(din, count),
                             std::span<float>(dout, count), o, opt);
        compare("all_reduce", want.data());
        ringzero::reduce_scatter(comm, std::span<const float>(din, total),
                                 std::span<float>(dout, count), o, opt);
        compare("reduce_scatter", want.data() + static_cast<std::size_t>(r) * count);
        ringzero::reduce(comm, std::span<const float>(din, count), std::span<float>(dout, count), o,
                         0, opt);
        if (r == 0) compare("reduce", want.data());
        cuda_ok(cudaFree(din), "cudaFree");
        cuda_ok(cudaFree(dout), "cudaFree");
      }
    }
    ringzero::barrier(comm);
  });
}
