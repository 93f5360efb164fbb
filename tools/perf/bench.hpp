// The benchmark loop every rank runs, nccl-tests' procedure step for step: warm up every size,
// then per row and per placement (out-of-place, in-place) one untimed call, a barrier, -n timed
// iterations of -m calls each, the times of all ranks combined as -a says, then -c checked calls
// on fresh inputs whose outputs every rank compares with the reference.
//
// The loop is written against a backend: the transport plus where its buffers live. Host
// transports (loopback, libfabric) use host_backend below; a GPU backend stages inputs and
// outputs through host memory.
#pragma once

#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "cli.hpp"
#include "data.hpp"
#include "report.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/types.hpp"

namespace ringzero::perf {

/// Fixed-size record a rank contributes to the "Using devices" block.
struct device_record {
  std::int32_t pid = 0;
  std::int32_t device = 0;
  char host[64] = {};
  char hex[16] = {};
  char description[176] = {};
};

inline void copy_text(char* dst, std::size_t n, std::string_view s) {
  const std::size_t len = std::min(n - 1, s.size());
  std::memcpy(dst, s.data(), len);
  dst[len] = '\0';
}

[[nodiscard]] inline std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

/// The CPU's model name, as /proc/cpuinfo spells it ("cpu" when it cannot be read).
[[nodiscard]] inline std::string cpu_model() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (f == nullptr) return "cpu";
  char line[512];
  std::string model = "cpu";
  while (std::fgets(line, sizeof line, f) != nullptr) {
    std::string_view l(line);
    if (!l.starts_with("model name")) continue;
    const auto colon = l.find(':');
    if (colon == std::string_view::npos) break;
    l.remove_prefix(colon + 1);
    while (!l.empty() && (l.front() == ' ' || l.front() == '\t')) l.remove_prefix(1);
    while (!l.empty() && (l.back() == '\n' || l.back() == ' ')) l.remove_suffix(1);
    model = std::string(l);
    break;
  }
  std::fclose(f);
  return model;
}

/// Page-aligned, zeroed memory; zeroing faults every page in before anything is timed.
class host_buffer {
 public:
  explicit host_buffer(std::size_t bytes) : bytes_(std::max<std::size_t>(bytes, 64)) {
    const std::size_t rounded = (bytes_ + 4095) / 4096 * 4096;
    ptr_.reset(static_cast<std::byte*>(std::aligned_alloc(4096, rounded)));
    if (!ptr_) throw error(errc::unsupported, fmt::format("cannot allocate {} bytes", rounded));
    std::memset(ptr_.get(), 0, rounded);
  }
  [[nodiscard]] std::byte* data() const noexcept { return ptr_.get(); }

 private:
  struct deleter {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  std::size_t bytes_;
  std::unique_ptr<std::byte, deleter> ptr_;
};

/// One call of collective `c` through ringzero's API for `comm` (run_collective with c's
/// descriptor, send_recv for sendrecv). `copy(dst, src,
/// bytes)` moves bytes within this rank's memory: sendrecv on one rank is a copy, and in-place
/// sendrecv receives into `bounce` because the peer may write the buffer before it has been sent.
template <class Comm, class Opts, element E, class Copy>
void call_collective(Comm& comm, const Opts& opt, collective c, const E* in, E* out,
                     const shape& sh, op o, int root, E* bounce, Copy copy) {
  const int n = comm.size();
  const int r = comm.rank();
  if (c != collective::send_recv) {
    // Buffers a rank does not use (root-only ones elsewhere) are passed empty, as a caller would.
    const collective_descriptor& d = describe(c);
    ringzero::run_collective(comm, d, std::span<const E>(in, d.uses_in(r, root) ? sh.send : 0),
                             std::span<E>(out, d.uses_out(r, root) ? sh.recv : 0), o, root, opt);
    return;
  }
  // sendrecv_perf: each rank sends to the next and receives from the previous.
  if (n == 1) {
    if (in != out && sh.send > 0) copy(out, in, sh.send * sizeof(E));
    return;
  }
  E* dst = in == out ? bounce : out;
  ringzero::send_recv(comm, std::span<const E>(in, sh.send), (r + 1) % n,
                      std::span<E>(dst, sh.recv), (r - 1 + n) % n, opt);
  if (dst != out && sh.recv > 0) copy(out, dst, sh.recv * sizeof(E));
}

/// A communicator whose collectives take host memory: the collectives API of collectives.hpp.
template <class T>
class host_backend {
 public:
  host_backend(T& comm, const options& o, std::string device_description)
      : comm_(comm), description_(std::move(device_description)) {
    opt_.algorithm = o.algo;
    opt_.reproducible = o.reproducible;
    opt_.wire = o.wire;
    opt_.wire_block = o.wire_block;
    if (o.timeout_s > 0)
      opt_.timeout = std::chrono::nanoseconds(static_cast<long long>(o.timeout_s * 1e9));
    meta_ = opt_;
    meta_.algorithm = algorithm::ring;
    meta_.reproducible = false;
    meta_.wire = wire_format::full;
  }

  [[nodiscard]] int rank() const { return comm_.rank(); }
  [[nodiscard]] int size() const { return comm_.size(); }

  [[nodiscard]] std::byte* allocate(std::size_t bytes) {
    buffers_.emplace_back(bytes);
    return buffers_.back().data();
  }
  /// Host memory is written and read where it is.
  [[nodiscard]] std::byte* begin_write(std::byte* buf, std::size_t) { return buf; }
  void end_write(std::byte*, std::size_t) {}
  [[nodiscard]] const std::byte* read(const std::byte* buf, std::size_t) { return buf; }
  /// Every call returns with its result in place.
  void complete() {}

  template <element E>
  void run(collective c, const E* in, E* out, const shape& sh, op o, int root, E* bounce) {
    call_collective(comm_, opt_, c, in, out, sh, o, root, bounce,
                    [](void* dst, const void* src, std::size_t n) { std::memcpy(dst, src, n); });
  }

  /// Every rank's `v`, in rank order, on every rank.
  template <class V>
  [[nodiscard]] std::vector<V> all_gather(const V& v) {
    std::vector<V> all(static_cast<std::size_t>(comm_.size()));
    ringzero::all_gather(
        comm_, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(&v), sizeof(V)),
        std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(all.data()),
                                all.size() * sizeof(V)),
        meta_);
    return all;
  }

  /// Completing an all_gather needs every rank to have entered it.
  void barrier() { (void)all_gather(std::uint8_t{0}); }

  [[nodiscard]] device_record local_device() const {
    device_record d;
    d.pid = static_cast<std::int32_t>(::getpid());
    d.device = comm_.rank();
    copy_text(d.host, sizeof d.host, host_name());
    copy_text(d.hex, sizeof d.hex, "cpu");
    copy_text(d.description, sizeof d.description, description_);
    return d;
  }

 private:
  T& comm_;
  ringzero::options opt_;
  ringzero::options meta_;  // results and barriers: always the reference ring
  std::string description_;
  std::vector<host_buffer> buffers_;
};

/// What a rank knows at the end of a run; every rank computes the same.
struct outcome {
  int errors = 0;  ///< (rank, row half) pairs with wrong elements, as nccl-tests counts them
};

/// Set in the environment, the last rank (the root, for reduce and gather) reads the first element
/// of its output bit-flipped in every check. For tests: it proves a wrong element fails the run.
[[nodiscard]] inline bool corrupt_requested() {
  auto v = ringzero::detail::getenv_str("RINGZERO_PERF_CORRUPT");
  return v && *v != "0";
}

template <class Backend>
class engine {
 public:
  /// `rep` is non-null on the rank that prints (rank 0).
  engine(Backend& b, const options& o, report* rep) : b_(b), o_(o), rep_(rep) {}

  outcome run() {
    const std::size_t bytes = std::max<std::size_t>(o_.max_bytes, 64);
    send_ = b_.allocate(bytes);
    recv_ = b_.allocate(bytes);
    if (o_.coll == collective::send_recv) bounce_ = b_.allocate(bytes);
    corrupt_ = corrupt_requested();
    for (int cycle = 0; cycle < o_.cycles; ++cycle)
      for (dtype t : o_.types)
        visit_dtype(t, [&](auto tag) {
          using E = decltype(tag);
          const std::vector<op> ops = has_op(o_.coll) ? o_.ops : std::vector<op>{op::sum};
          for (op x : ops)
            for (int root : roots()) time_test<E>(x, root);
        });
    return totals_;
  }

 private:
  using clock = std::chrono::steady_clock;

  [[nodiscard]] std::vector<int> roots() const {
    if (!has_root(o_.coll)) return {-1};
    const int n = b_.size();
    if (o_.root >= n)
      throw invalid_argument(fmt::format("-r {}: root out of range for {} ranks", o_.root, n));
    if (o_.root >= 0) return {o_.root};
    std::vector<int> all(static_cast<std::size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    return all;
  }

  template <element E>
  void time_test(op x, int root) {
    const int n = b_.size();
    b_.barrier();
    // Warm every size up, doubling from -b to -e, so no row pays for first-touch effects.
    for (std::size_t s = o_.min_bytes; s <= o_.max_bytes; s = s ? s * 2 : 1) {
      const shape sh = shape_for(o_.coll, s, sizeof(E), n);
      for (int w = 0; w < o_.warmup_iters; ++w) launch<E>(sh, x, root, false);
      b_.complete();
    }
    for (std::size_t s : sweep_sizes(o_)) {
      const shape sh = shape_for(o_.coll, s, sizeof(E), n);
      row r;
      r.bytes = row_bytes(sh, sizeof(E));
      r.count = sh.param;
      r.type = std::string(dtype_name(dtype_of<E>()));
      r.redop = has_op(o_.coll) ? std::string(op_name(x)) : "none";
      r.root = root;
      r.iters = o_.iters;
      if (rep_) rep_->begin_row(r);
      r.out_of_place = bench_time<E>(sh, x, root, false);
      if (rep_) rep_->add_cell(r.out_of_place);
      r.in_place = bench_time<E>(sh, x, root, true);
      if (rep_) {
        rep_->add_cell(r.in_place);
        rep_->end_row(r);
      }
    }
  }

  template <element E>
  [[nodiscard]] E* input_ptr(const shape& sh, bool in_place) const {
    if (!in_place) return reinterpret_cast<E*>(send_);
    return reinterpret_cast<E*>(recv_) +
           sh.send_inplace_offset * static_cast<std::size_t>(b_.rank());
  }
  template <element E>
  [[nodiscard]] E* output_ptr(const shape& sh, bool in_place) const {
    return reinterpret_cast<E*>(recv_) +
           (in_place ? sh.recv_inplace_offset * static_cast<std::size_t>(b_.rank()) : 0);
  }

  template <element E>
  void launch(const shape& sh, op x, int root, bool in_place) {
    b_.template run<E>(o_.coll, input_ptr<E>(sh, in_place), output_ptr<E>(sh, in_place), sh, x,
                       root, reinterpret_cast<E*>(bounce_));
  }

  /// Fresh inputs for check round `seed`, and poison wherever an output will land.
  template <element E>
  void prepare(const shape& sh, op x, int root, bool in_place, std::uint32_t seed) {
    const int r = b_.rank();
    const std::size_t recv_len = (in_place ? std::max(sh.send, sh.recv) : sh.recv) * sizeof(E);
    std::byte* recv = b_.begin_write(recv_, recv_len);
    std::memset(recv, poison_byte, recv_len);
    // Off the root an in-place broadcast or scatter has no input, only the output region.
    const bool writes_input = !in_place || describe(o_.coll).uses_in(r, root);
    const auto fill = [&](E* dst) {
      if (exact_sum_row<E>(o_.reproducible, x))
        fill_exact_sum_input(dst, sh.send, r, seed);
      else
        fill_input(dst, sh.send, r, seed, x);
    };
    if (in_place) {
      if (writes_input)
        fill(reinterpret_cast<E*>(recv) + sh.send_inplace_offset * static_cast<std::size_t>(r));
      b_.end_write(recv_, recv_len);
    } else {
      b_.end_write(recv_, recv_len);
      std::byte* send = b_.begin_write(send_, sh.send * sizeof(E));
      fill(reinterpret_cast<E*>(send));
      b_.end_write(send_, sh.send * sizeof(E));
    }
  }

  [[nodiscard]] double combine_times(const std::vector<double>& t) const {
    switch (o_.average) {
      case time_mode::rank0:
        return t.front();
      case time_mode::avg:
        return std::accumulate(t.begin(), t.end(), 0.0) / static_cast<double>(t.size());
      case time_mode::min:
        return *std::min_element(t.begin(), t.end());
      case time_mode::max:
        break;
    }
    return *std::max_element(t.begin(), t.end());
  }

  template <element E>
  cell bench_time(const shape& sh, op x, int root, bool in_place) {
    const int n = b_.size();
    // A reproducible sum costs what its data asks (digits per element), so it is timed on real
    // inputs even without -c.
    if (o_.check > 0 || o_.reproducible) prepare<E>(sh, x, root, in_place, 0);
    launch<E>(sh, x, root, in_place);
    b_.complete();
    b_.barrier();

    const auto t0 = clock::now();
    for (int it = 0; it < o_.iters; ++it) {
      for (int m = 0; m < o_.agg_iters; ++m) launch<E>(sh, x, root, in_place);
      if (o_.blocking == 1) {
        b_.complete();
        b_.barrier();
      }
    }
    b_.complete();
    const double mine = std::chrono::duration<double>(clock::now() - t0).count() /
                        (static_cast<double>(o_.iters) * o_.agg_iters);
    const double seconds = combine_times(b_.all_gather(mine));

    cell c;
    c.time_us = seconds * 1e6;
    c.bw = bandwidth_for(o_.coll, sh, sizeof(E), n, seconds);
    b_.barrier();

    if (o_.check > 0) {
      c.wrong = 0;
      check_spec spec{o_.coll, sh, n, b_.rank(), root, x, 0, o_.reproducible, o_.wire};
      const bool corrupt_here =
          corrupt_ && b_.rank() == (describe(o_.coll).out.root_only ? root : n - 1);
      for (int k = 0; k < o_.check; ++k) {
        spec.seed = ++seed_;
        prepare<E>(sh, x, root, in_place, spec.seed);
        launch<E>(sh, x, root, in_place);
        b_.complete();
        E* out = output_ptr<E>(sh, in_place);
        const auto* view = reinterpret_cast<const E*>(
            b_.read(reinterpret_cast<const std::byte*>(out), sh.recv * sizeof(E)));
        const std::int64_t local = count_wrong<E>(spec, view, corrupt_here);
        std::int64_t total = 0;
        for (std::int64_t w : b_.all_gather(local)) {
          total += w;
          if (w > 0) ++totals_.errors;
        }
        c.wrong = total;
        if (total > 0) break;
      }
    }
    return c;
  }

  Backend& b_;
  const options& o_;
  report* rep_;
  std::byte* send_ = nullptr;
  std::byte* recv_ = nullptr;
  std::byte* bounce_ = nullptr;
  bool corrupt_ = false;
  std::uint32_t seed_ = 0;
  outcome totals_;
};

/// Gathers every rank's device record; all ranks get the list.
template <class Backend>
[[nodiscard]] std::vector<device_info> gather_devices(Backend& b) {
  std::vector<device_info> out;
  int rank = 0;
  for (const device_record& d : b.all_gather(b.local_device())) {
    out.push_back({rank++, d.pid, d.host, d.device, d.hex, d.description});
  }
  return out;
}

}  // namespace ringzero::perf
