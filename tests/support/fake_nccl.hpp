// ringzero's NCCL backend shaped over the fake CUDA runtime (fake_device.hpp), so that its
// multi-rank device paths run without a GPU, each rank on a device of its own (fake_fabric.hpp is
// the libfabric-shaped transport):
//
//   nccl_transport  native collectives on device memory, as ringzero::nccl::transport: its
//                   device chosen by detail::choose_rank_device and current in the constructing
//                   thread from then on, every buffer checked to be memory of that device (or
//                   small host memory, which NCCL's transport stages), a stream of its device,
//                   abort() that fails every later call; the sharder's memory on it is `space`.
//                   The collectives run on the host over loopback ranks, on copies of the bytes,
//                   with the ring: one order of additions at every size, as the host sharder's.
//   space           the sharder's device space on one fake device: zero::emulated_device_space's
//                   streams and element work, with every buffer fake device memory of the
//                   transport's device, every element operation refused on memory of another
//                   device or host memory, and host waits going through the transport, which
//                   refuses them once aborted, as NCCL's does.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "fake_device.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/detail/rank_device.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/transport/loopback.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/zero/device_space.hpp"

namespace fake_device {

struct nccl_config {
  int device = -1;  ///< as nccl::config::device
  /// How long each task of the sharder's compute stream takes (space), as kernels take time.
  std::chrono::microseconds compute_latency{0};
};

class nccl_transport {
 public:
  using from_env_options = nccl_config;
  static constexpr bool device_memory_only = true;
  static constexpr std::size_t host_staging_bytes = std::size_t{1} << 20;

  nccl_transport(ringzero::loopback::transport inner, const nccl_config& cfg = {})
      : world_(std::make_unique<ringzero::loopback::communicator>(std::move(inner))),
        aborted_(std::make_shared<ringzero::detail::abort_state>()),
        latency_(cfg.compute_latency) {
    device_ = ringzero::detail::choose_rank_device(cfg.device, device_count(), world_->rank());
    set_device(device_);
    stream_.reset(as_stream(create_stream(device_)));
  }

  [[nodiscard]] int rank() const { return world_->rank(); }
  [[nodiscard]] int size() const { return world_->size(); }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] const ringzero::tuning::policy& tuning() const {
    return world_->transport().tuning();
  }
  [[nodiscard]] CUstream_st* stream() const noexcept {
    return reinterpret_cast<CUstream_st*>(stream_.get());
  }
  [[nodiscard]] std::chrono::microseconds compute_latency() const noexcept { return latency_; }

  void abort(const std::string& why) { aborted_->set(why); }
  [[nodiscard]] std::optional<std::string> abort_reason() const {
    return aborted_->reason_if_set();
  }

  /// Waits for `s` (null: the transport's stream), refused once aborted, as nccl::transport's.
  void wait_idle(CUstream_st* s) {
    usable("synchronize");
    drain(s != nullptr ? s : stream(), {});
  }

  void run_native(const ringzero::native_call& c, const ringzero::options& opt) {
    using ringzero::collective;
    const ringzero::collective_descriptor& d = *ringzero::builtin_collectives::find(c.kind);
    usable(d.name);
    if (c.kind == collective::barrier) return ringzero::barrier(*world_);
    if (c.kind == collective::send_recv) return send_recv(c, opt);
    if (c.kind != collective::all_reduce && c.kind != collective::reduce_scatter &&
        c.kind != collective::all_gather && c.kind != collective::broadcast &&
        c.kind != collective::reduce)
      throw ringzero::unsupported(fmt::format("fake nccl: {} is not modelled", d.name));
    const std::size_t es = ringzero::dtype_size(c.type);
    const std::size_t in_len = d.in_elems(c.count, size(), rank(), c.root);
    const std::size_t out_len = d.out_elems(c.count, size(), rank(), c.root);
    const auto* in = static_cast<const std::byte*>(c.in);
    auto* out = static_cast<std::byte*>(c.out);
    const bool staged = !opt.async && (in_len + out_len) * es <= host_staging_bytes &&
                        (out_len == 0 || device_of(out) < 0) && (in_len == 0 || device_of(in) < 0);
    if (!staged) {
      check(d.name, "input", in, in_len * es);
      check(d.name, "output", out, out_len * es);
    }
    // In stream order: what was queued before the call has run.
    drain(opt.stream != nullptr ? opt.stream : stream(), {});
    const bool inside = in_len > 0 && in >= out && in + in_len * es <= out + out_len * es;
    std::vector<std::byte> hout(out_len * es), hin(inside ? 0 : in_len * es);
    if (!hout.empty()) std::memcpy(hout.data(), out, hout.size());
    if (!hin.empty()) std::memcpy(hin.data(), in, hin.size());
    const std::byte* hin_at = inside ? hout.data() + (in - out) : hin.data();
    ringzero::visit_dtype(c.type, [&](auto zero) {
      using E = decltype(zero);
      ringzero::run_collective(
          *world_, d, std::span<const E>(reinterpret_cast<const E*>(hin_at), in_len),
          std::span<E>(reinterpret_cast<E*>(hout.data()), out_len), c.reduction, c.root,
          {.algorithm = ringzero::algorithm::ring, .timeout = opt.timeout});
    });
    if (!hout.empty()) std::memcpy(out, hout.data(), hout.size());
  }

  void all_gather_bytes(std::span<const std::byte> mine, std::span<std::byte> all,
                        const ringzero::options& opt) {
    usable("RINGZERO_CHECK");
    const auto bytes = [](auto s) {
      return std::span(reinterpret_cast<std::uint8_t*>(const_cast<std::byte*>(s.data())), s.size());
    };
    ringzero::all_gather(*world_, std::span<const std::uint8_t>(bytes(mine)), bytes(all),
                         {.timeout = opt.timeout});
  }

 private:
  /// As nccl::transport's (reproducible training's exchange uses it): the send and the receive
  /// together, in stream order, on this device's memory.
  void send_recv(const ringzero::native_call& c, const ringzero::options& opt) {
    const std::size_t es = ringzero::dtype_size(c.type);
    const std::size_t send_bytes = c.peer >= 0 ? c.count * es : 0;
    const std::size_t recv_bytes = c.from >= 0 ? c.recv_count * es : 0;
    check("send_recv", "send buffer", c.in, send_bytes);
    check("send_recv", "receive buffer", c.out, recv_bytes);
    drain(opt.stream != nullptr ? opt.stream : stream(), {});
    std::vector<std::uint8_t> sent(send_bytes), got(recv_bytes);
    if (send_bytes > 0) std::memcpy(sent.data(), c.in, send_bytes);
    ringzero::detail::dispatch_p2p(*world_, "send_recv", std::span<const std::uint8_t>(sent),
                                   c.peer, std::span<std::uint8_t>(got), c.from,
                                   {.timeout = opt.timeout});
    if (recv_bytes > 0) std::memcpy(c.out, got.data(), recv_bytes);
  }

  struct stream_delete {
    void operator()(fake_device::stream* s) const noexcept {
      destroy_stream(reinterpret_cast<CUstream_st*>(s));
    }
  };

  void usable(std::string_view what) const {
    if (auto why = aborted_->reason_if_set())
      throw ringzero::transport_error(fmt::format(
          "{}: this communicator was aborted after an earlier failure: {}", what, *why));
  }

  /// As nccl::detail::check_device_buffer.
  void check(std::string_view what, std::string_view name, const void* p, std::size_t bytes) const {
    if (bytes == 0) return;
    const auto* first = static_cast<const std::byte*>(p);
    for (const std::byte* q : {first, first + bytes - 1}) {
      const int d = device_of(q);
      if (d < 0)
        throw ringzero::invalid_argument(
            fmt::format("{}: the {} is not memory a GPU can address", what, name));
      if (d != device_)
        throw ringzero::invalid_argument(
            fmt::format("{}: the {} is memory of device {} but this communicator uses device {}",
                        what, name, d, device_));
    }
  }

  std::unique_ptr<ringzero::loopback::communicator> world_;
  std::shared_ptr<ringzero::detail::abort_state> aborted_;
  std::chrono::microseconds latency_;
  int device_ = 0;
  std::unique_ptr<fake_device::stream, stream_delete> stream_;
};

using nccl_communicator = ringzero::communicator<nccl_transport>;

/// See the header comment.
class space : public ringzero::zero::emulated_device_space {
  using base = ringzero::zero::emulated_device_space;

 public:
  /// On `t`'s device, host waits through `t`.
  explicit space(nccl_transport& t)
      : base(t.compute_latency()), shared_(std::make_shared<shared>()) {
    shared_->device = t.device();
    shared_->transport = &t;
    const scope on(shared_->device);
    shared_->stats =
        static_cast<std::byte*>(fake_device::allocate(sizeof(double) + sizeof(std::int32_t)));
    std::memset(shared_->stats, 0, sizeof(double) + sizeof(std::int32_t));
  }

  [[nodiscard]] int device() const noexcept { return shared_->device; }

  template <class T>
  [[nodiscard]] ringzero::zero::buffer<T> allocate(std::size_t n) const {
    return allocate_local<T>(n);
  }
  template <class T>
  [[nodiscard]] ringzero::zero::buffer<T> allocate_local(std::size_t n) const {
    const scope on(shared_->device);
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    void* p = fake_device::allocate(bytes);
    std::memset(p, 0, bytes);  // synchronously, as cudaMalloc then a memset the space waits for
    return {std::span<T>(static_cast<T*>(p), n),
            std::shared_ptr<void>(p, [](void* q) { release(q); }), false};
  }
  /// Freed in compute-stream order, as cudaFreeAsync.
  template <class T>
  [[nodiscard]] ringzero::zero::buffer<T> allocate_ordered(
      std::size_t n, ringzero::zero::fill how = ringzero::zero::fill::zeroed) const {
    const scope on(shared_->device);
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    void* p = fake_device::allocate(bytes);
    auto* t = static_cast<T*>(p);
    if (how == ringzero::zero::fill::zeroed) zero(compute_stream(), t, n);
    const base& self = *this;
    std::shared_ptr<void> owner(p, [self](void* q) noexcept {
      try {
        self.enqueue(self.compute_stream(), [q](auto&&) { release(q); });
      } catch (...) {
        release(q);  // the stream failed: nothing runs on it any more
      }
    });
    return {std::span<T>(t, n), std::move(owner), false};
  }

  void synchronize(stream s) const {
    shared_->transport->wait_idle(nullptr);
    base::synchronize(s);
  }
  void synchronize() const {
    shared_->transport->wait_idle(nullptr);
    base::synchronize();
  }

  template <class T>
  void zero(stream s, T* p, std::size_t n) const {
    if (n == 0) return;
    kernel(s, "zero", {p});
    base::zero(s, p, n);
  }
  template <class T>
  void upload(stream s, T* dst, const T* host, std::size_t n) const {
    if (n == 0) return;
    kernel(s, "upload", {dst});
    base::upload(s, dst, host, n);
  }
  template <class T>
  void download(stream s, T* host, const T* src, std::size_t n) const {
    if (n == 0) return;
    if (static_cast<const void*>(src) != shared_->stats) kernel(s, "download", {src});
    base::download(s, host, src, n);
  }
  template <class D, class S>
  void accumulate(stream s, D* dst, const S* src, std::size_t n, bool first, float scale) const {
    if (n == 0) return;
    kernel(s, "accumulate", {dst, src});
    base::accumulate(s, dst, src, n, first, scale);
  }
  template <class P>
  void set_values(stream s, P* param, float* master, const float* values, std::size_t n) const {
    if (n == 0) return;
    kernel(s, "set_values", {param, master});
    base::set_values(s, param, master, values, n);
  }
  /// The statistics live in device memory of this device, as cuda_device_space's: the sharder
  /// all_reduces them there.
  void stats_reset(stream s) const {
    enqueue(s, [st = shared_->stats](auto&&) {
      std::memset(st, 0, sizeof(double) + sizeof(std::int32_t));
    });
  }
  template <class G>
  void stats_add(stream s, std::span<const ringzero::zero::device_run<G>> runs, float scale) const {
    if (runs.empty()) return;
    for (const auto& r : runs) kernel(s, "stats_add", {r.data});
    enqueue(s,
            [st = shared_->stats, scale,
             list = std::vector<ringzero::zero::device_run<G>>(runs.begin(), runs.end())](auto&&) {
              double sumsq = 0.0;
              std::int32_t bad = 0;
              std::memcpy(&sumsq, st, sizeof sumsq);
              std::memcpy(&bad, st + sizeof(double), sizeof bad);
              bool nonfinite = bad != 0;
              for (const auto& r : list)
                ringzero::zero::grad_stats(r.data, r.count, scale, sumsq, nonfinite);
              bad = nonfinite ? 1 : 0;
              std::memcpy(st, &sumsq, sizeof sumsq);
              std::memcpy(st + sizeof(double), &bad, sizeof bad);
            });
  }
  [[nodiscard]] ringzero::zero::device_stats stats() const noexcept {
    return {reinterpret_cast<double*>(shared_->stats),
            reinterpret_cast<std::int32_t*>(shared_->stats + sizeof(double))};
  }
  [[nodiscard]] ringzero::zero::gradient_stats read_stats(stream s) const {
    ringzero::zero::gradient_stats r;
    run_sync(s, [&] {
      std::int32_t bad = 0;
      std::memcpy(&r.sumsq, shared_->stats, sizeof r.sumsq);
      std::memcpy(&bad, shared_->stats + sizeof(double), sizeof bad);
      r.nonfinite = bad != 0;
    });
    return r;
  }
  template <class Table = ringzero::zero::builtin_optimizers, class P, class G>
  void optimizer_step(stream s, ringzero::zero::optimizer_kind kind,
                      std::span<const ringzero::zero::device_segment<P, G>> segs,
                      const ringzero::zero::step_constants& k) const {
    for (const auto& g : segs)
      kernel(s, "optimizer_step", {g.grad, g.master, g.moment1, g.moment2, g.param});
    base::optimizer_step<Table>(s, kind, segs, k);
  }

 private:
  struct shared {
    int device = 0;
    nccl_transport* transport = nullptr;
    std::byte* stats = nullptr;
    ~shared() {
      if (stats != nullptr) release(stats);
    }
  };

  /// Makes a device current for its lifetime, as a CUDA space's device guard.
  struct scope {
    explicit scope(int d) : previous(current_device()) { set_device(d); }
    ~scope() { current = previous; }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    int previous;
  };

  /// Refuses element work on memory that is not this device's, as a kernel launched on it would
  /// fault, and checks again, in the stream's order just before the work, that the memory is
  /// still allocated.
  void kernel(stream s, const char* what, std::initializer_list<const void*> touched) const {
    std::vector<const void*> ptrs;
    for (const void* p : touched)
      if (p != nullptr) ptrs.push_back(p);
    for (const void* p : ptrs)
      if (const int d = device_of(p); d != shared_->device)
        refuse(fmt::format("zero: {} on device {} touches {} (a GPU without peer access faults)",
                           what, shared_->device, where(d)));
    enqueue(s, [what, ptrs, d = shared_->device](auto&&) {
      for (const void* p : ptrs)
        if (device_of(p) != d) {
          auto& g = global();
          std::lock_guard lock(g.m);
          g.faults.push_back(fmt::format(
              "zero: {} ran on memory of device {} freed after it was enqueued", what, d));
          return;
        }
    });
  }

  std::shared_ptr<shared> shared_;
};

/// The sharder's memory on the NCCL-shaped transport (found by argument-dependent lookup, as
/// nccl::memory_space_for is).
[[nodiscard]] inline space memory_space_for(nccl_communicator& comm) {
  return space(comm.transport());
}

}  // namespace fake_device
