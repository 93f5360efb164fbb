// ringzero-perf on the NCCL transport: buffers in GPU memory, collectives enqueued on the
// communicator's stream without waiting (as nccl-tests launches them), completion awaited once
// per timed loop. Inputs are generated on the host and copied in; outputs are copied out to be
// checked. -R 1 registers the buffers with the communicator (ncclCommRegister), -R 2 registers
// them as symmetric windows (ncclCommWindowRegister, NCCL 2.27+); both allocate with
// ncclMemAlloc, as nccl-tests does.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>
#include <nccl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "cli.hpp"
#include "perf.hpp"
#include "ringzero/transport/nccl.hpp"

namespace ringzero::perf {

class nccl_backend {
 public:
  nccl_backend(nccl::communicator& comm, const options& o)
      : comm_(comm), registration_(o.registration) {
    if (o.timeout_s > 0)
      opt_.timeout = std::chrono::nanoseconds(static_cast<long long>(o.timeout_s * 1e9));
    opt_.async = o.blocking == 0;
    // -A ring or tree: ringzero's schedule over ncclSend/ncclRecv with ringzero's kernels
    // (nccl::transport::with_device_executor); left automatic, NCCL's own collective.
    opt_.algorithm = o.algo;
    // A reproducible call reads its agreed windows on the host between passes: it completes
    // before returning whatever -z says.
    opt_.reproducible = o.reproducible;
    meta_.timeout = opt_.timeout;
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 27, 0)
    if (registration_ == 2) registration_ = 1;
#endif
  }
  ~nccl_backend() {
    for (auto& b : buffers_) release(b);
    if (scratch_ != nullptr) static_cast<void>(cudaFree(scratch_));
  }
  nccl_backend(const nccl_backend&) = delete;
  nccl_backend& operator=(const nccl_backend&) = delete;

  [[nodiscard]] int rank() const {
    return comm_.rank();
  }
  [[nodiscard]] int size() const {
    return comm_.size();
  }

  /// What -R did, for the header.
  [[nodiscard]] std::string buffers_note() const {
    switch (registration_) {
      case 1:
        return "ncclMemAlloc + ncclCommRegister (-R 1)";
      case 2:
        return "ncclMemAlloc + ncclCommWindowRegister, symmetric (-R 2)";
      default:
        return "cudaMalloc, unregistered (-R 0)";
    }
  }

  [[nodiscard]] std::byte* allocate(std::size_t bytes) {
    device_buffer b;
    b.bytes = std::max<std::size_t>(bytes, 64);
    const nccl::detail::device_guard guard(comm_.transport().device());
    if (registration_ == 0) {
      check(cudaMalloc(&b.ptr, b.bytes), "cudaMalloc");
    } else {
      check_nccl(ncclMemAlloc(&b.ptr, b.bytes), "ncclMemAlloc");
      b.nccl_alloc = true;
      if (registration_ == 1) {
        check_nccl(ncclCommRegister(comm_.transport().native_handle(), b.ptr, b.bytes, &b.handle),
                   "ncclCommRegister");
      } else {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
        ncclWindow_t w = nullptr;
        check_nccl(ncclCommWindowRegister(comm_.transport().native_handle(), b.ptr, b.bytes, &w,
                                          NCCL_WIN_COLL_SYMMETRIC),
                   "ncclCommWindowRegister");
        b.window = w;
#endif
      }
    }
    // On the communicator's stream, which is non-blocking: a plain cudaMemset would be ordered
    // only with the legacy default stream.
    check(cudaMemsetAsync(b.ptr, 0, b.bytes, comm_.transport().stream()), "cudaMemsetAsync");
    comm_.transport().synchronize();
    buffers_.push_back(b);
    return static_cast<std::byte*>(b.ptr);
  }

  [[nodiscard]] std::byte* begin_write(std::byte*, std::size_t bytes) {
    if (staging_.size() < bytes) staging_.resize(bytes);
    return staging_.data();
  }
  void end_write(std::byte* buf, std::size_t bytes) {
    if (bytes == 0) return;
    const nccl::detail::device_guard guard(comm_.transport().device());
    // cudaMemcpy from pageable memory may return before its copy lands, ordered only with the
    // legacy stream: copy on the communicator's stream and wait, so the next call reads it.
    check(cudaMemcpyAsync(buf, staging_.data(), bytes, cudaMemcpyHostToDevice,
                          comm_.transport().stream()),
          "cudaMemcpyAsync");
    comm_.transport().synchronize();
  }
  [[nodiscard]] const std::byte* read(const std::byte* buf, std::size_t bytes) {
    if (staging_.size() < bytes) staging_.resize(bytes);
    if (bytes == 0) return staging_.data();
    const nccl::detail::device_guard guard(comm_.transport().device());
    check(cudaMemcpyAsync(staging_.data(), buf, bytes, cudaMemcpyDeviceToHost,
                          comm_.transport().stream()),
          "cudaMemcpyAsync");
    comm_.transport().synchronize();
    return staging_.data();
  }

  /// Waits for everything enqueued, with the communicator's deadline and NCCL's async errors.
  void complete() {
    comm_.transport().synchronize();
  }

  template <element E>
  void run(collective c, const E* in, E* out, const shape& sh, op o, int root, E* bounce) {
    cudaStream_t s = comm_.transport().stream();
    const int device = comm_.transport().device();
    call_collective(comm_, opt_, c, in, out, sh, o, root, bounce,
                    [s, device](void* dst, const void* src, std::size_t n) {
                      const nccl::detail::device_guard guard(device);
                      check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s),
                            "cudaMemcpyAsync");
                    });
  }

  template <class V>
  [[nodiscard]] std::vector<V> all_gather(const V& v) {
    const auto n = static_cast<std::size_t>(comm_.size());
    const std::size_t bytes = n * sizeof(V);
    const nccl::detail::device_guard guard(comm_.transport().device());
    if (scratch_bytes_ < bytes) {
      if (scratch_ != nullptr) check(cudaFree(scratch_), "cudaFree");
      check(cudaMalloc(&scratch_, bytes), "cudaMalloc");
      scratch_bytes_ = bytes;
    }
    auto* base = static_cast<std::uint8_t*>(scratch_);
    std::uint8_t* own = base + sizeof(V) * static_cast<std::size_t>(comm_.rank());
    check(cudaMemcpyAsync(own, &v, sizeof(V), cudaMemcpyHostToDevice, comm_.transport().stream()),
          "cudaMemcpyAsync");
    ringzero::all_gather(comm_, std::span<const std::uint8_t>(own, sizeof(V)),
                         std::span<std::uint8_t>(base, bytes), meta_);
    std::vector<V> all(n);
    check(cudaMemcpyAsync(all.data(), base, bytes, cudaMemcpyDeviceToHost,
                          comm_.transport().stream()),
          "cudaMemcpyAsync");
    comm_.transport().synchronize();
    return all;
  }

  void barrier() {
    ringzero::barrier(comm_, meta_);
  }

  [[nodiscard]] device_record local_device() const {
    device_record d;
    d.pid = static_cast<std::int32_t>(::getpid());
    d.device = comm_.transport().device();
    copy_text(d.host, sizeof d.host, host_name());
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, comm_.transport().device()) == cudaSuccess) {
      copy_text(
          d.hex, sizeof d.hex,
          fmt::format("{:04x}:{:02x}:{:02x}", prop.pciDomainID, prop.pciBusID, prop.pciDeviceID));
      copy_text(d.description, sizeof d.description, prop.name);
    } else {
      copy_text(d.hex, sizeof d.hex, "?");
      copy_text(d.description, sizeof d.description, "unknown GPU");
    }
    return d;
  }

 private:
  struct device_buffer {
    void* ptr = nullptr;
    std::size_t bytes = 0;
    bool nccl_alloc = false;
    void* handle = nullptr;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    ncclWindow_t window = nullptr;
#endif
  };

  static void check(cudaError_t e, const char* what) {
    nccl::detail::check_cuda(e, what);
  }
  /// The communicator is non-blocking: a call may return before its work is done, and the
  /// communicator's asynchronous state says when it is. That state is polled until it settles,
  /// bounded by the communicator's deadline, before anything else uses the communicator.
  void check_nccl(ncclResult_t r, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + comm_.timeout();
    if (r == ncclSuccess || r == ncclInProgress) {
      do {
        if (ncclCommGetAsyncError(comm_.transport().native_handle(), &r) != ncclSuccess) break;
        if (r != ncclInProgress) break;
        if (std::chrono::steady_clock::now() > deadline)
          throw timeout_error(fmt::format("{} did not complete within the deadline", what), -1);
        std::this_thread::yield();
      } while (true);
    }
    if (r != ncclSuccess) throw transport_error(fmt::format("{}: {}", what, ncclGetErrorString(r)));
  }

  void release(device_buffer& b) noexcept {
    if (b.ptr == nullptr) return;
    if (comm_.transport().native_handle() != nullptr) {
      if (b.handle != nullptr)
        static_cast<void>(ncclCommDeregister(comm_.transport().native_handle(), b.handle));
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
      if (b.window != nullptr)
        static_cast<void>(ncclCommWindowDeregister(comm_.transport().native_handle(), b.window));
#endif
    }
    if (b.nccl_alloc)
      static_cast<void>(ncclMemFree(b.ptr));
    else
      static_cast<void>(cudaFree(b.ptr));
    b.ptr = nullptr;
  }

  nccl::communicator& comm_;
  int registration_;
  ringzero::options opt_;
  ringzero::options meta_;
  std::vector<device_buffer> buffers_;
  std::vector<std::byte> staging_;
  void* scratch_ = nullptr;
  std::size_t scratch_bytes_ = 0;
};

/// A communicator for this process: the whole world when a launcher started several ranks,
/// otherwise one rank on one GPU.
[[nodiscard]] inline nccl::communicator make_nccl_communicator(const options& o) {
  nccl::config cfg;
  if (o.timeout_s > 0)
    cfg.timeout = std::chrono::nanoseconds(static_cast<long long>(o.timeout_s * 1e9));
  if (launched_as_rank()) return nccl::communicator::from_env(cfg);
  return nccl::communicator(nccl::transport::single(cfg));
}

[[nodiscard]] inline int run_nccl(const options& o, const context& ctx) {
  auto comm = make_nccl_communicator(o);
  nccl_backend b(comm, o);
  const bool prints = comm.rank() == 0;
  std::optional<printer> p;
  if (prints) p.emplace(o, ctx);
  run_info info;
  info.program = ctx.program;
  info.transport = fmt::format(
      "nccl {}.{}.{}, {} rank{}, one GPU each; collectives enqueued "
      "{}",
      NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, comm.size(), comm.size() == 1 ? "" : "s",
      o.blocking == 0 ? "without waiting, stream synchronized per loop"
                      : "and waited for one by one (-z)");
  info.algorithm = o.algo == algorithm::automatic
                       ? "NCCL's choice (NCCL_ALGO steers it)"
                       : fmt::format(
                             "ringzero's {} schedule over ncclSend/ncclRecv, ringzero's "
                             "kernels reducing",
                             algorithm_name(o.algo));
  info.buffers = b.buffers_note();
  try {
    const outcome r = run_rank(b, o, prints ? &*p : nullptr, info);
    return status_of(r);
  } catch (const std::exception& e) {
    if (p) p->rep().failure(e.what());
    fmt::print(ctx.err, "ringzero-perf: rank {}: {}\n", comm.rank(), e.what());
    return exit_status::failure;
  }
}

}  // namespace ringzero::perf
