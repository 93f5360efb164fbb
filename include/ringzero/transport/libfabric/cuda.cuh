// Collectives on CUDA device buffers over the libfabric transport: the EFA GPUDirect RDMA case.
// The provider reads and writes device memory itself (FI_HMEM_CUDA registrations, see
// transport::register_device_buffer); the reductions run as CUDA kernels (kernels/cuda/
// reduce.cuh); nothing passes through host memory. Link ringzero::libfabric and ringzero::cuda,
// and compile with nvcc.
//
//   libfabric::options opt;
//   opt.device_memory = true;              // the provider must report FI_HMEM
//   auto comm = libfabric::communicator::from_env(opt);
//   libfabric::cuda::device_collectives dev(comm, device);
//   dev.all_reduce(std::span<const float>(d_in, n), std::span<float>(d_out, n), op::sum);
//
// The schedule is the ring's (algorithms/ring.hpp), step for step: 2(n-1) latency steps and
// 2(n-1)/n of the data sent per rank for all_reduce, whatever RINGZERO_ALGO says, because the
// other algorithms reduce and copy with the CPU. Each reduced chunk is complete on the device
// before it is sent on (the provider reads device memory, not the stream), so kernels and
// messages alternate rather than overlap.
//
// Buffers must hold their inputs when a call starts (synchronize the streams that wrote them)
// and hold the results when it returns. A buffer is registered with the provider on first use
// and stays registered: register_buffer() an allocation once, whole, and forget() it before
// cudaFree.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <string_view>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/algorithms/ring.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/cuda/reduce.cuh"
#include "ringzero/op.hpp"
#include "ringzero/transport/libfabric.hpp"
#include "ringzero/types.hpp"

namespace ringzero::libfabric::cuda {

namespace detail {

inline void check(cudaError_t e, std::string_view what) {
  if (e != cudaSuccess)
    throw transport_error(
        fmt::format("{}: CUDA error: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

/// Makes `device` current for its lifetime, then restores the caller's.
class device_guard {
 public:
  explicit device_guard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() { static_cast<void>(cudaSetDevice(previous_)); }

 private:
  int previous_ = 0;
};

}  // namespace detail

/// The ring collectives of algorithms/ring.hpp on device buffers of one CUDA device, over a
/// libfabric communicator opened with options::device_memory. Used from one thread at a time,
/// like the communicator; every rank calls the same collectives in the same order.
class device_collectives {
 public:
  /// `device`: the CUDA ordinal the buffers live on. Throws unsupported when the communicator
  /// was not opened for device memory, naming its provider.
  device_collectives(communicator& comm, int device) : comm_(comm), device_(device) {
    comm_.check_usable("libfabric::cuda::device_collectives");
    if (!comm_.transport().device_memory())
      throw unsupported(fmt::format(
          "libfabric::cuda::device_collectives: the communicator (provider '{}') was opened "
          "without libfabric::options::device_memory",
          comm_.transport().provider()));
    const detail::device_guard guard(device_);
    detail::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  device_collectives(const device_collectives&) = delete;
  device_collectives& operator=(const device_collectives&) = delete;
  ~device_collectives() {
    release_scratch();
    if (stream_ != nullptr) static_cast<void>(cudaStreamDestroy(stream_));
  }

  [[nodiscard]] int device() const noexcept { return device_; }

  /// Registers [p, p+bytes) of this device with the provider now (see the top of this file).
  void register_buffer(const void* p, std::size_t bytes) { adopt(p, bytes); }
  /// Drops the registration of [p, p+bytes): before cudaFree.
  void forget(const void* p, std::size_t bytes) { comm_.transport().forget_memory(p, bytes); }

  /// out = in reduced over every rank. in.size() == out.size(); in may equal out.
  template <element E>
  void all_reduce(std::span<const E> in, std::span<E> out, op o,
                  const ringzero::options& opt = {}) {
    comm_.check_usable("all_reduce");
    if (in.size() != out.size())
      throw invalid_argument(
          fmt::format("all_reduce: input has {} elements, output {}", in.size(), out.size()));
    if (out.empty()) return;
    adopt(in.data(), in.size_bytes());
    adopt(out.data(), out.size_bytes());
    const detail::device_guard guard(device_);
    const int n = comm_.size();
    if (n == 1) {
      copy(out.data(), in.data(), out.size_bytes());
      return;
    }
    ringzero::detail::exchange<communicator> ex(comm_, "all_reduce", "ring", opt.timeout);
    const auto bl = algorithms::block_layout::even(out.size(), n);
    const auto ch = chunks<E>(bl, opt);
    E* rbuf = reinterpret_cast<E*>(scratch(2 * bl.max_length * sizeof(E)));
    E* base = out.data();
    algorithms::ring::detail::reduce_scatter_phase(
        ex, bl, in.data(), [&](std::size_t b, int) { return base + bl.offset[b]; }, o, ch, rbuf,
        reducer());
    algorithms::ring::detail::all_gather_phase(ex, bl, base, ch, n - 1);
  }

  /// in holds size()*out.size() elements; out receives block rank(), reduced over every rank.
  /// out may be in's own block.
  template <element E>
  void reduce_scatter(std::span<const E> in, std::span<E> out, op o,
                      const ringzero::options& opt = {}) {
    comm_.check_usable("reduce_scatter");
    const int n = comm_.size();
    if (in.size() != out.size() * static_cast<std::size_t>(n))
      throw invalid_argument(fmt::format("reduce_scatter: input has {} elements, not {} ranks x {}",
                                         in.size(), n, out.size()));
    if (out.empty()) return;
    adopt(in.data(), in.size_bytes());
    adopt(out.data(), out.size_bytes());
    const detail::device_guard guard(device_);
    if (n == 1) {
      copy(out.data(), in.data(), out.size_bytes());
      return;
    }
    ringzero::detail::exchange<communicator> ex(comm_, "reduce_scatter", "ring", opt.timeout);
    const auto bl = algorithms::block_layout::uniform(out.size(), n);
    const auto ch = chunks<E>(bl, opt);
    // Two receive slots and two partial-result slots, as the host ring keeps them: the input is
    // never written, and the last step reduces straight into out.
    E* rbuf = reinterpret_cast<E*>(scratch(4 * bl.max_length * sizeof(E)));
    E* partial = rbuf + 2 * bl.max_length;
    E* out_base = out.data();
    algorithms::ring::detail::reduce_scatter_phase(
        ex, bl, in.data(),
        [&](std::size_t, int s) {
          return s == n - 2 ? out_base : partial + static_cast<std::size_t>(s % 2) * bl.max_length;
        },
        o, ch, rbuf, reducer());
  }

  /// out holds size()*in.size() elements, rank r's input at block r; in may be out's block
  /// rank().
  template <element E>
  void all_gather(std::span<const E> in, std::span<E> out, const ringzero::options& opt = {}) {
    comm_.check_usable("all_gather");
    const int n = comm_.size();
    if (out.size() != in.size() * static_cast<std::size_t>(n))
      throw invalid_argument(fmt::format("all_gather: output has {} elements, not {} ranks x {}",
                                         out.size(), n, in.size()));
    if (in.empty()) return;
    adopt(in.data(), in.size_bytes());
    adopt(out.data(), out.size_bytes());
    const detail::device_guard guard(device_);
    const auto bl = algorithms::block_layout::uniform(in.size(), n);
    copy(out.data() + bl.offset[static_cast<std::size_t>(comm_.rank())], in.data(),
         in.size_bytes());
    if (n == 1) return;
    ringzero::detail::exchange<communicator> ex(comm_, "all_gather", "ring", opt.timeout);
    algorithms::ring::detail::all_gather_phase(ex, bl, out.data(), chunks<E>(bl, opt), 0);
  }

 private:
  /// Reduces one chunk with kernels on this object's stream and waits for it: the ring sends
  /// the result next, and the provider reads device memory, not the stream's future.
  struct kernel_reducer {
    cudaStream_t stream;
    template <element E>
    void operator()(op o, const E* a, const E* b, E* out, std::size_t n, bool finish,
                    int ranks) const {
      kernels::cuda::combine(o, a, b, out, n, stream);
      if (finish) kernels::cuda::finish_avg(out, n, ranks, stream);
      detail::check(cudaStreamSynchronize(stream), "libfabric::cuda reduction");
    }
  };
  [[nodiscard]] kernel_reducer reducer() const noexcept { return {stream_}; }

  template <element E>
  [[nodiscard]] algorithms::chunking chunks(const algorithms::block_layout& bl,
                                            const ringzero::options& opt) const {
    return algorithms::chunking::make(
        bl.max_length, sizeof(E), algorithms::ring::detail::chunk_bytes_for<E>(opt, comm_.cost()),
        comm_.cost().burst);
  }

  void copy(void* dst, const void* src, std::size_t bytes) {
    if (dst == src || bytes == 0) return;
    detail::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
                  "cudaMemcpyAsync");
    detail::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  /// Checks that [p, p+bytes) is memory of this device (a host pointer handed to the provider
  /// as FI_HMEM_CUDA would be read as device memory) and registers it, once.
  void adopt(const void* p, std::size_t bytes) {
    if (bytes == 0) return;
    cudaPointerAttributes attr{};
    detail::check(cudaPointerGetAttributes(&attr, p), "cudaPointerGetAttributes");
    if (attr.type != cudaMemoryTypeDevice)
      throw invalid_argument(fmt::format(
          "libfabric::cuda: the buffer at {} is not CUDA device memory (cudaMalloc it, or use "
          "ringzero's host collectives for host memory)",
          p));
    if (attr.device != device_)
      throw invalid_argument(fmt::format(
          "libfabric::cuda: the buffer at {} is on CUDA device {}, these collectives on device {}",
          p, attr.device, device_));
    comm_.transport().register_device_buffer(p, bytes, device_);
  }

  /// Device scratch of at least `bytes`, registered; grown (never shrunk) between calls, when
  /// no message uses it.
  [[nodiscard]] std::byte* scratch(std::size_t bytes) {
    if (bytes <= scratch_bytes_) return scratch_;
    release_scratch();
    const detail::device_guard guard(device_);
    void* p = nullptr;
    detail::check(cudaMalloc(&p, bytes), "cudaMalloc (libfabric::cuda scratch)");
    scratch_ = static_cast<std::byte*>(p);
    scratch_bytes_ = bytes;
    comm_.transport().register_device_buffer(scratch_, scratch_bytes_, device_);
    return scratch_;
  }

  void release_scratch() noexcept {
    if (scratch_ == nullptr) return;
    try {
      comm_.transport().forget_memory(scratch_, scratch_bytes_);
    } catch (...) {
      // A communicator already torn down has dropped its registrations with its endpoint.
    }
    static_cast<void>(cudaFree(scratch_));
    scratch_ = nullptr;
    scratch_bytes_ = 0;
  }

  communicator& comm_;
  int device_;
  cudaStream_t stream_ = nullptr;
  std::byte* scratch_ = nullptr;
  std::size_t scratch_bytes_ = 0;
};

}  // namespace ringzero::libfabric::cuda
