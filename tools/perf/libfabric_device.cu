// ringzero-perf on the libfabric transport with buffers in GPU memory (--memory device): one rank
// per process on GPU LOCAL_RANK % (visible GPUs), the buffers cudaMalloc'ed and registered with
// the provider as FI_HMEM_CUDA memory, the collectives ringzero's own on device buffers (the
// schedules of algorithms/schedule.hpp on the messaging device executor: the provider moving
// device memory, the reductions as kernels). Inputs are generated on the host and copied in;
// outputs are copied out to be checked, as nccl_backend.hpp does.
#include <cuda_runtime.h>
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "bench.hpp"
#include "cli.hpp"
#include "libfabric_device.hpp"
#include "perf.hpp"
#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/kernels/cuda/device_reduction.cuh"
// Last: libfabric's headers define short macros (count_of, container_of) that would rename
// functions of that name in headers read after them.
#include "ringzero/transport/libfabric.hpp"

namespace ringzero::perf {

namespace {

using ringzero::detail::check_cuda;
using device_guard = ringzero::detail::cuda_device_guard;

class libfabric_device_backend {
 public:
  libfabric_device_backend(libfabric::communicator& comm, const options& o, int device)
      : comm_(comm), device_(device) {
    if (o.timeout_s > 0)
      opt_.timeout = std::chrono::nanoseconds(static_cast<long long>(o.timeout_s * 1e9));
    timed_ = opt_;
    timed_.algorithm = o.algo;
    timed_.reproducible = o.reproducible;
  }
  ~libfabric_device_backend() {
    for (auto& b : buffers_) {
      comm_.transport().forget_memory(b.first, b.second);
      static_cast<void>(cudaFree(b.first));
    }
    if (scratch_ != nullptr) {
      comm_.transport().forget_memory(scratch_, scratch_bytes_);
      static_cast<void>(cudaFree(scratch_));
    }
  }
  libfabric_device_backend(const libfabric_device_backend&) = delete;
  libfabric_device_backend& operator=(const libfabric_device_backend&) = delete;

  [[nodiscard]] int rank() const { return comm_.rank(); }
  [[nodiscard]] int size() const { return comm_.size(); }

  [[nodiscard]] std::byte* allocate(std::size_t bytes) {
    bytes = std::max<std::size_t>(bytes, 64);
    const device_guard guard(device_);
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
    buffers_.emplace_back(p, bytes);
    check_cuda(cudaMemset(p, 0, bytes), "cudaMemset");
    // Registered whole, once: every row's buffers lie inside it.
    comm_.transport().register_device_buffer(p, bytes, device_);
    return static_cast<std::byte*>(p);
  }

  [[nodiscard]] std::byte* begin_write(std::byte*, std::size_t bytes) {
    if (staging_.size() < bytes) staging_.resize(bytes);
    return staging_.data();
  }
  void end_write(std::byte* buf, std::size_t bytes) {
    if (bytes == 0) return;
    const device_guard guard(device_);
    check_cuda(cudaMemcpy(buf, staging_.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    // From pageable memory the copy may still be landing: the collectives' own stream must not
    // read the buffer before it has.
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  [[nodiscard]] const std::byte* read(const std::byte* buf, std::size_t bytes) {
    if (staging_.size() < bytes) staging_.resize(bytes);
    if (bytes == 0) return staging_.data();
    const device_guard guard(device_);
    check_cuda(cudaMemcpy(staging_.data(), buf, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return staging_.data();
  }

  /// Every call returns with its result in device memory.
  void complete() {}

  template <element E>
  void run(collective c, const E* in, E* out, const shape& sh, op o, int, E*) {
    // run_libfabric_device admits only collectives with schedules on device buffers.
    ringzero::run_collective(comm_, describe(c), std::span<const E>(in, sh.send),
                             std::span<E>(out, sh.recv), o, 0, timed_);
  }

  /// Every rank's `v`, through a device all_gather: the results travel as the data does.
  template <class V>
  [[nodiscard]] std::vector<V> all_gather(const V& v) {
    const auto n = static_cast<std::size_t>(comm_.size());
    const std::size_t bytes = n * sizeof(V);
    const device_guard guard(device_);
    if (scratch_bytes_ < bytes) {
      if (scratch_ != nullptr) {
        comm_.transport().forget_memory(scratch_, scratch_bytes_);
        check_cuda(cudaFree(scratch_), "cudaFree");
        scratch_ = nullptr;
      }
      void* p = nullptr;
      check_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
      scratch_ = static_cast<std::uint8_t*>(p);
      scratch_bytes_ = bytes;
      comm_.transport().register_device_buffer(scratch_, scratch_bytes_, device_);
    }
    std::uint8_t* own = scratch_ + sizeof(V) * static_cast<std::size_t>(comm_.rank());
    check_cuda(cudaMemcpy(own, &v, sizeof(V), cudaMemcpyHostToDevice), "cudaMemcpy");
    ringzero::all_gather(comm_, std::span<const std::uint8_t>(own, sizeof(V)),
                         std::span<std::uint8_t>(scratch_, bytes), opt_);
    std::vector<V> all(n);
    check_cuda(cudaMemcpy(all.data(), scratch_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return all;
  }

  /// Completing an all_gather needs every rank to have entered it.
  void barrier() { static_cast<void>(all_gather(std::uint8_t{0})); }

  [[nodiscard]] device_record local_device() const {
    device_record d;
    d.pid = static_cast<std::int32_t>(::getpid());
    d.device = device_;
    copy_text(d.host, sizeof d.host, host_name());
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device_) == cudaSuccess) {
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
  libfabric::communicator& comm_;
  int device_;
  ringzero::options opt_;
  ringzero::options timed_;  ///< the measured calls': -A forces a schedule
  std::vector<std::pair<void*, std::size_t>> buffers_;
  std::vector<std::byte> staging_;
  std::uint8_t* scratch_ = nullptr;
  std::size_t scratch_bytes_ = 0;
};

/// The GPU of this rank: LOCAL_RANK % (visible GPUs), as nccl-tests places one rank per GPU.
/// Throws unsupported when there is none, before any rank waits for the others.
[[nodiscard]] int pick_device() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    static_cast<void>(cudaGetLastError());
    throw unsupported(fmt::format(
        "--memory device: no CUDA device is visible{}",
        e == cudaSuccess ? std::string() : fmt::format(" ({})", cudaGetErrorString(e))));
  }
  const int device = bootstrap::detect_launch().local_rank % count;
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  return device;
}

}  // namespace

int run_libfabric_device(const options& o, const context& ctx) {
  if (o.coll != collective::all_reduce && o.coll != collective::reduce_scatter &&
      o.coll != collective::all_gather)
    throw invalid_argument(fmt::format(
        "--memory device runs all_reduce, reduce_scatter and all_gather over libfabric, not {}",
        coll_name(o.coll)));
  if (!o.tune_file.empty())
    throw invalid_argument("--tune measures host buffers; leave out --memory device");
  const int device = pick_device();

  libfabric::options opts;
  opts.provider = o.provider;
  opts.device_memory = true;
  // With RINGZERO_RAILS=auto, the NICs nearest this GPU (RINGZERO_GPU_BUS_ID overrides).
  if (!ringzero::detail::getenv_str("RINGZERO_GPU_BUS_ID")) {
    char bus_id[32] = {};
    check_cuda(cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device), "cudaDeviceGetPCIBusId");
    opts.gpu_bus_id = bus_id;
  }
  if (o.timeout_s > 0)
    opts.timeout = std::chrono::nanoseconds(static_cast<long long>(o.timeout_s * 1e9));
  auto comm = libfabric::communicator::from_env(opts);

  const bool prints = comm.rank() == 0;
  std::optional<printer> p;
  if (prints) p.emplace(o, ctx);
  run_info info;
  info.program = ctx.program;
  info.transport =
      fmt::format("libfabric, provider {} with FI_HMEM, {} rank{} as processes",
                  comm.transport().provider(), comm.size(), comm.size() == 1 ? "" : "s");
  info.algorithm = fmt::format(
      "{} (device buffers: ringzero's schedule, the provider moves GPU memory, kernels reduce)",
      o.algo == algorithm::automatic ? std::string("ring") : std::string(algorithm_name(o.algo)));
  info.buffers = fmt::format(
      "cudaMalloc on GPU {}, registered with the provider as FI_HMEM_CUDA memory (--memory "
      "device){}",
      device, o.registration == 0 ? "" : "; -R does not apply");
  try {
    libfabric_device_backend b(comm, o, device);
    const outcome r = run_rank(b, o, prints ? &*p : nullptr, info);
    return status_of(r);
  } catch (const std::exception& e) {
    if (p) p->rep().failure(e.what());
    fmt::print(ctx.err, "ringzero-perf: rank {}: {}\n", comm.rank(), e.what());
    return exit_status::failure;
  }
}

}  // namespace ringzero::perf
