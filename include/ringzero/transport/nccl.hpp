// The NCCL backend: ringzero's collectives on GPU buffers, computed by NCCL. Link ringzero::nccl.
//
//   #include <ringzero/transport/nccl.hpp>
//   auto comm = ringzero::nccl::communicator::from_env();
//   ringzero::all_reduce(comm, std::span<float>(d_grads, n), ringzero::op::avg);      // in place
//   ringzero::all_gather(comm, d_shard, d_full, {.stream = s, .async = true});
//
// The calls have the signatures and guarantees of collectives.hpp, with nccl::options in place of
// ringzero::options (NCCL picks its own algorithm and protocol; NCCL_ALGO and NCCL_PROTO steer it;
// all_to_all(v), gather and scatter are grouped ncclSend/ncclRecv, as nccl-tests runs them):
//   - arguments are validated with the same messages, and every buffer is checked to be memory
//     the communicator's GPU can address, before anything is enqueued (invalid_argument);
//   - by default a call returns once the result is in place, and a call that misses its deadline
//     aborts the communicator and throws timeout_error; options::async returns once enqueued;
//   - RINGZERO_CHECK=1 compares (collective, count, type, op, root) across ranks first.
// Cost: NCCL's (ring or tree over NVLink/PCIe/network, reduction in NCCL's kernels) plus, per
// call, two cudaPointerGetAttributes per distinct buffer (about 1.5 us for an out-of-place call
// on an H100 host) and, when blocking, polling the stream.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>
#include <nccl.h>

#include <cstddef>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/transport/nccl/communicator.hpp"
#include "ringzero/transport/nccl/detail.hpp"
#include "ringzero/types.hpp"

namespace ringzero::nccl::detail {

// Argument checks, worded exactly as collectives.hpp words them so a caller sees one message per
// mistake whichever backend runs the call (tests/transport compare the two).

template <element E>
void check_all_reduce(std::span<const E> in, std::span<E> out, op o) {
  ringzero::detail::check_op(o, "all_reduce");
  if (in.size() != out.size())
    throw invalid_argument(
        fmt::format("all_reduce: input has {} elements but output has {}", in.size(), out.size()));
  if (in.data() != out.data() &&
      ringzero::detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("all_reduce: input and output overlap without being the same buffer");
}

template <element E>
void check_reduce_scatter(int rank, int size, std::span<const E> in, std::span<E> out, op o) {
  ringzero::detail::check_op(o, "reduce_scatter");
  const auto n = static_cast<std::size_t>(size);
  if (in.size() != out.size() * n)
    throw invalid_argument(fmt::format(
        "reduce_scatter: input must hold size() * output elements ({} * {} = {}), got {}", n,
        out.size(), n * out.size(), in.size()));
  const E* own_block = in.data() + out.size() * static_cast<std::size_t>(rank);
  if (out.data() != own_block &&
      ringzero::detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument(
        "reduce_scatter: output overlaps the input but is not this rank's block of it");
}

template <element E>
void check_all_gather(int rank, int size, std::span<const E> in, std::span<E> out) {
  const auto n = static_cast<std::size_t>(size);
  if (out.size() != in.size() * n)
    throw invalid_argument(
        fmt::format("all_gather: output must hold size() * input elements ({} * {} = {}), got {}",
                    n, in.size(), n * in.size(), out.size()));
  const E* own_block = out.data() + in.size() * static_cast<std::size_t>(rank);
  if (in.data() != own_block &&
      ringzero::detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("all_gather: input overlaps the output but is not this rank's block");
}

template <element E>
void check_broadcast(int rank, int size, std::span<const E> in, std::span<E> out, int root) {
  ringzero::detail::check_root(root, size, "broadcast");
  if (rank != root) return;
  if (in.size() != out.size())
    throw invalid_argument(fmt::format("broadcast: root's input has {} elements but output has {}",
                                       in.size(), out.size()));
  if (in.data() != out.data() &&
      ringzero::detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("broadcast: input and output overlap without being the same buffer");
}

template <element E>
void check_reduce(int rank, int size, std::span<const E> in, std::span<E> out, op o, int root) {
  ringzero::detail::check_op(o, "reduce");
  ringzero::detail::check_root(root, size, "reduce");
  if (rank != root) return;
  if (in.size() != out.size())
    throw invalid_argument(fmt::format("reduce: root's input has {} elements but output has {}",
                                       in.size(), out.size()));
  if (in.data() != out.data() &&
      ringzero::detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("reduce: input and output overlap without being the same buffer");
}

inline void check_peer(std::string_view what, int rank, int size, int peer) {
  if (peer < 0 || peer >= size || peer == rank)
    throw invalid_argument(
        fmt::format("{}: peer {} is not another rank of this {}-rank "
                    "communicator (this is rank {})",
                    what, peer, size, rank));
}

template <element E>
void check_device(const communicator& comm, std::string_view what, std::string_view name,
                  std::span<const E> s) {
  check_device_buffer(what, name, s.data(), s.size_bytes(), comm.device());
}

static_assert(sizeof(ringzero::detail::call_signature) == 16,
              "the scratch space holds one call signature per rank");

/// RINGZERO_CHECK=1: every rank's (collective, count, type, op, root) gathered through NCCL and
/// compared, so a mismatch fails with both calls named instead of hanging or corrupting data.
template <element E>
void maybe_check(communicator& comm, collective c, std::size_t count, op o, int root) {
  if (!ringzero::detail::check_enabled() || comm.size() == 1) return;
  ringzero::detail::call_signature mine;
  mine.kind = static_cast<std::uint8_t>(c);
  mine.type = static_cast<std::uint8_t>(dtype_of<std::remove_cv_t<E>>());
  mine.reduction = static_cast<std::uint8_t>(o);
  mine.root = root;
  mine.count = count;
  const auto n = static_cast<std::size_t>(comm.size());
  const std::span<std::byte> buf = access::scratch(comm);
  std::byte* own = buf.data() + sizeof mine * static_cast<std::size_t>(comm.rank());
  {
    device_guard guard(comm.device());
    check_cuda(cudaMemcpyAsync(own, &mine, sizeof mine, cudaMemcpyHostToDevice, comm.stream()),
               "RINGZERO_CHECK: cudaMemcpyAsync");
  }
  comm.enqueue("RINGZERO_CHECK", {}, [&](ncclComm_t h, cudaStream_t s) {
    return ncclAllGather(own, buf.data(), sizeof mine, ncclUint8, h, s);
  });
  std::vector<ringzero::detail::call_signature> all(n);
  {
    device_guard guard(comm.device());
    check_cuda(cudaMemcpy(all.data(), buf.data(), n * sizeof mine, cudaMemcpyDeviceToHost),
               "RINGZERO_CHECK: cudaMemcpy");
  }
  const auto describe = [](const ringzero::detail::call_signature& s) {
    return fmt::format("{} (count {}, type {}, op {}, root {})",
                       collective_name(static_cast<collective>(s.kind)), s.count,
                       dtype_name(static_cast<dtype>(s.type)),
                       op_name(static_cast<op>(s.reduction)), s.root);
  };
  for (std::size_t r = 1; r < n; ++r)
    if (std::memcmp(&all[r], &all[0], sizeof mine) != 0)
      throw mismatch_error(fmt::format("RINGZERO_CHECK: rank 0 called {} but rank {} called {}",
                                       describe(all[0]), r, describe(all[r])));
}

/// A CUDA failure inside an enqueued group, reported the way NCCL reports its own.
[[nodiscard]] inline ncclResult_t cuda_status(cudaError_t e) noexcept {
  return e == cudaSuccess ? ncclSuccess : ncclUnhandledCudaError;
}

/// Stream-ordered device scratch (cudaMallocAsync), freed on the same stream when the scope
/// ends. Freed only after the enqueue that uses it has returned: in non-blocking mode
/// ncclGroupEnd may answer before the group's kernels are on the stream, so a free enqueued
/// inside the group's callback could run ahead of them.
class stream_scratch {
 public:
  stream_scratch(int device, cudaStream_t s, std::size_t bytes) : device_(device), stream_(s) {
    const device_guard guard(device_);
    check_cuda(cudaMallocAsync(&data_, bytes, stream_), "nccl: cudaMallocAsync");
  }
  ~stream_scratch() {
    int previous = device_;
    static_cast<void>(cudaGetDevice(&previous));
    if (previous != device_) static_cast<void>(cudaSetDevice(device_));
    static_cast<void>(cudaFreeAsync(data_, stream_));
    if (previous != device_) static_cast<void>(cudaSetDevice(previous));
  }
  stream_scratch(const stream_scratch&) = delete;
  stream_scratch& operator=(const stream_scratch&) = delete;
  [[nodiscard]] void* data() const noexcept { return data_; }

 private:
  int device_;
  cudaStream_t stream_;
  void* data_ = nullptr;
};

/// The group of sends and receives that moves blocks between every pair of ranks, as
/// nccl-tests' alltoall issues it: per peer (this rank included) one ncclSend of its block and
/// one ncclRecv of the peer's. Empty blocks are skipped on both sides, which agree on them.
template <element E>
[[nodiscard]] ncclResult_t exchange_blocks(ncclComm_t h, cudaStream_t s, int size, const E* in,
                                           std::span<const std::size_t> send_counts,
                                           std::span<const std::size_t> send_displs, E* out,
                                           std::span<const std::size_t> recv_counts,
                                           std::span<const std::size_t> recv_displs) {
  if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
  ncclResult_t first = ncclSuccess;
  for (int p = 0; p < size && first == ncclSuccess; ++p) {
    const auto up = static_cast<std::size_t>(p);
    if (send_counts[up] > 0)
      first = ncclSend(in + send_displs[up], send_counts[up], nccl_type_v<E>, p, h, s);
    if (first == ncclSuccess && recv_counts[up] > 0)
      first = ncclRecv(out + recv_displs[up], recv_counts[up], nccl_type_v<E>, p, h, s);
  }
  const ncclResult_t end = ncclGroupEnd();
  return first != ncclSuccess ? first : end;
}

}  // namespace ringzero::nccl::detail

namespace ringzero {

/// out[i] = in[i] reduced over all ranks, on the GPU. In place when in.data() == out.data().
template <element E>
void all_reduce(nccl::communicator& comm, std::span<const E> in, std::span<E> out, op o,
                const nccl::options& opt = {}) {
  constexpr std::string_view what = "all_reduce";
  nccl::detail::check_all_reduce(in, out, o);
  nccl::detail::check_device<E>(comm, what, "input", in);
  if (out.data() != in.data()) nccl::detail::check_device<E>(comm, what, "output", out);
  nccl::detail::maybe_check<E>(comm, collective::all_reduce, out.size(), o, 0);
  if (out.empty()) return;
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    return ncclAllReduce(in.data(), out.data(), out.size(), nccl::detail::nccl_type_v<E>,
                         nccl::detail::to_nccl(o), h, s);
  });
}

/// In-place all_reduce.
template <element E>
void all_reduce(nccl::communicator& comm, std::span<E> data, op o, const nccl::options& opt = {}) {
  all_reduce(comm, std::span<const E>(data), data, o, opt);
}

template <element E>
void all_reduce(nccl::communicator& comm, std::span<E> in, std::span<E> out, op o,
                const nccl::options& opt = {}) {
  all_reduce(comm, std::span<const E>(in), out, o, opt);
}

/// in holds size()*out.size() elements, block r for rank r; out receives this rank's block
/// reduced over all ranks. In place when out is this rank's block of in.
template <element E>
void reduce_scatter(nccl::communicator& comm, std::span<const E> in, std::span<E> out, op o,
                    const nccl::options& opt = {}) {
  constexpr std::string_view what = "reduce_scatter";
  nccl::detail::check_reduce_scatter(comm.rank(), comm.size(), in, out, o);
  nccl::detail::check_device<E>(comm, what, "input", in);
  if (out.data() != in.data() + out.size() * static_cast<std::size_t>(comm.rank()))
    nccl::detail::check_device<E>(comm, what, "output", out);
  nccl::detail::maybe_check<E>(comm, collective::reduce_scatter, out.size(), o, 0);
  if (out.empty()) return;
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    return ncclReduceScatter(in.data(), out.data(), out.size(), nccl::detail::nccl_type_v<E>,
                             nccl::detail::to_nccl(o), h, s);
  });
}

template <element E>
void reduce_scatter(nccl::communicator& comm, std::span<E> in, std::span<E> out, op o,
                    const nccl::options& opt = {}) {
  reduce_scatter(comm, std::span<const E>(in), out, o, opt);
}

/// out (size()*in.size() elements) receives every rank's in, block r from rank r. In place when
/// in is this rank's block of out.
template <element E>
void all_gather(nccl::communicator& comm, std::span<const E> in, std::span<E> out,
                const nccl::options& opt = {}) {
  constexpr std::string_view what = "all_gather";
  nccl::detail::check_all_gather(comm.rank(), comm.size(), in, out);
  nccl::detail::check_device<E>(comm, what, "output", out);
  if (in.data() != out.data() + in.size() * static_cast<std::size_t>(comm.rank()))
    nccl::detail::check_device<E>(comm, what, "input", in);
  nccl::detail::maybe_check<E>(comm, collective::all_gather, in.size(), op::sum, 0);
  if (in.empty()) return;
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    return ncclAllGather(in.data(), out.data(), in.size(), nccl::detail::nccl_type_v<E>, h, s);
  });
}

template <element E>
void all_gather(nccl::communicator& comm, std::span<E> in, std::span<E> out,
                const nccl::options& opt = {}) {
  all_gather(comm, std::span<const E>(in), out, opt);
}

/// Copies root's in to every rank's out; in is read only on root. In place when in.data() ==
/// out.data().
template <element E>
void broadcast(nccl::communicator& comm, std::span<const E> in, std::span<E> out, int root,
               const nccl::options& opt = {}) {
  constexpr std::string_view what = "broadcast";
  nccl::detail::check_broadcast(comm.rank(), comm.size(), in, out, root);
  const bool is_root = comm.rank() == root;
  if (is_root && in.data() != out.data()) nccl::detail::check_device<E>(comm, what, "input", in);
  nccl::detail::check_device<E>(comm, what, "output", out);
  nccl::detail::maybe_check<E>(comm, collective::broadcast, out.size(), op::sum, root);
  if (out.empty()) return;
  const E* send = is_root ? in.data() : out.data();
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    return ncclBroadcast(send, out.data(), out.size(), nccl::detail::nccl_type_v<E>, root, h, s);
  });
}

/// In-place broadcast.
template <element E>
void broadcast(nccl::communicator& comm, std::span<E> data, int root,
               const nccl::options& opt = {}) {
  broadcast(comm, std::span<const E>(data), data, root, opt);
}

template <element E>
void broadcast(nccl::communicator& comm, std::span<E> in, std::span<E> out, int root,
               const nccl::options& opt = {}) {
  broadcast(comm, std::span<const E>(in), out, root, opt);
}

/// out on root receives in reduced over all ranks; out is not touched elsewhere (it may be
/// empty there).
template <element E>
void reduce(nccl::communicator& comm, std::span<const E> in, std::span<E> out, op o, int root,
            const nccl::options& opt = {}) {
  constexpr std::string_view what = "reduce";
  nccl::detail::check_reduce(comm.rank(), comm.size(), in, out, o, root);
  const bool is_root = comm.rank() == root;
  nccl::detail::check_device<E>(comm, what, "input", in);
  if (is_root && out.data() != in.data()) nccl::detail::check_device<E>(comm, what, "output", out);
  nccl::detail::maybe_check<E>(comm, collective::reduce, in.size(), o, root);
  if (in.empty()) return;
  E* recv = is_root ? out.data() : nullptr;
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    return ncclReduce(in.data(), recv, in.size(), nccl::detail::nccl_type_v<E>,
                      nccl::detail::to_nccl(o), root, h, s);
  });
}

template <element E>
void reduce(nccl::communicator& comm, std::span<E> in, std::span<E> out, op o, int root,
            const nccl::options& opt = {}) {
  reduce(comm, std::span<const E>(in), out, o, root, opt);
}

/// In-place reduce: data on root is replaced by the reduction.
template <element E>
void reduce(nccl::communicator& comm, std::span<E> data, op o, int root,
            const nccl::options& opt = {}) {
  reduce(comm, std::span<const E>(data), data, o, root, opt);
}

/// Block r of in goes to rank r, block r of out comes from rank r: one NCCL group of
/// ncclSend/ncclRecv per peer (nccl-tests' alltoall). In place when in.data() == out.data(); the
/// input is then first copied to a stream-ordered temporary, since a peer may write a block
/// before this rank has sent it.
template <element E>
void all_to_all(nccl::communicator& comm, std::span<const E> in, std::span<E> out,
                const nccl::options& opt = {}) {
  constexpr std::string_view what = "all_to_all";
  ringzero::detail::check_all_to_all(comm.size(), in, out);
  nccl::detail::check_device<E>(comm, what, "input", in);
  if (out.data() != in.data()) nccl::detail::check_device<E>(comm, what, "output", out);
  const auto n = static_cast<std::size_t>(comm.size());
  nccl::detail::maybe_check<E>(comm, collective::all_to_all, in.size() / n, op::sum, 0);
  if (in.empty()) return;
  const std::size_t b = in.size() / n;
  std::vector<std::size_t> counts(n, b), displs(n);
  for (std::size_t i = 0; i < n; ++i) displs[i] = i * b;
  if (in.data() != out.data()) {
    comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
      return nccl::detail::exchange_blocks<E>(h, s, comm.size(), in.data(), counts, displs,
                                              out.data(), counts, displs);
    });
    return;
  }
  const nccl::detail::stream_scratch copy(
      comm.device(), opt.stream != nullptr ? opt.stream : comm.stream(), in.size_bytes());
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    if (const ncclResult_t r = nccl::detail::cuda_status(
            cudaMemcpyAsync(copy.data(), in.data(), in.size_bytes(), cudaMemcpyDeviceToDevice, s));
        r != ncclSuccess)
      return r;
    return nccl::detail::exchange_blocks<E>(h, s, comm.size(), static_cast<const E*>(copy.data()),
                                            counts, displs, out.data(), counts, displs);
  });
}

/// In-place all_to_all.
template <element E>
void all_to_all(nccl::communicator& comm, std::span<E> data, const nccl::options& opt = {}) {
  all_to_all(comm, std::span<const E>(data), data, opt);
}

template <element E>
void all_to_all(nccl::communicator& comm, std::span<E> in, std::span<E> out,
                const nccl::options& opt = {}) {
  all_to_all(comm, std::span<const E>(in), out, opt);
}

/// As MPI_Alltoallv (see collectives.hpp): one NCCL group of ncclSend/ncclRecv per non-empty
/// block. No in-place form.
template <element E>
void all_to_allv(nccl::communicator& comm, std::span<const E> in,
                 std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                 std::span<E> out, std::span<const std::size_t> recv_counts,
                 std::span<const std::size_t> recv_displs, const nccl::options& opt = {}) {
  constexpr std::string_view what = "all_to_allv";
  ringzero::detail::check_all_to_allv(comm.rank(), comm.size(), in, send_counts, send_displs, out,
                                      recv_counts, recv_displs);
  nccl::detail::check_device<E>(comm, what, "input", in);
  nccl::detail::check_device<E>(comm, what, "output", std::span<const E>(out));
  nccl::detail::maybe_check<E>(comm, collective::all_to_allv, 0, op::sum, 0);
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    return nccl::detail::exchange_blocks<E>(h, s, comm.size(), in.data(), send_counts, send_displs,
                                            out.data(), recv_counts, recv_displs);
  });
}

template <element E>
void all_to_allv(nccl::communicator& comm, std::span<E> in,
                 std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                 std::span<E> out, std::span<const std::size_t> recv_counts,
                 std::span<const std::size_t> recv_displs, const nccl::options& opt = {}) {
  all_to_allv(comm, std::span<const E>(in), send_counts, send_displs, out, recv_counts, recv_displs,
              opt);
}

/// out on root receives every rank's in, block r from rank r (one NCCL group: the root posts an
/// ncclRecv per peer, every other rank one ncclSend). In place when in is the root's block of out.
template <element E>
void gather(nccl::communicator& comm, std::span<const E> in, std::span<E> out, int root,
            const nccl::options& opt = {}) {
  constexpr std::string_view what = "gather";
  ringzero::detail::check_gather(comm.rank(), comm.size(), in, out, root);
  const bool is_root = comm.rank() == root;
  const std::size_t count = in.size();
  E* own = is_root ? out.data() + count * static_cast<std::size_t>(root) : nullptr;
  if (own != in.data()) nccl::detail::check_device<E>(comm, what, "input", in);
  if (is_root) nccl::detail::check_device<E>(comm, what, "output", std::span<const E>(out));
  nccl::detail::maybe_check<E>(comm, collective::gather, count, op::sum, root);
  if (count == 0) return;
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    if (!is_root) return ncclSend(in.data(), count, nccl::detail::nccl_type_v<E>, root, h, s);
    if (own != in.data())
      if (const ncclResult_t r = nccl::detail::cuda_status(
              cudaMemcpyAsync(own, in.data(), in.size_bytes(), cudaMemcpyDeviceToDevice, s));
          r != ncclSuccess)
        return r;
    if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
    ncclResult_t first = ncclSuccess;
    for (int p = 0; p < comm.size() && first == ncclSuccess; ++p)
      if (p != root)
        first = ncclRecv(out.data() + count * static_cast<std::size_t>(p), count,
                         nccl::detail::nccl_type_v<E>, p, h, s);
    const ncclResult_t end = ncclGroupEnd();
    return first != ncclSuccess ? first : end;
  });
}

template <element E>
void gather(nccl::communicator& comm, std::span<E> in, std::span<E> out, int root,
            const nccl::options& opt = {}) {
  gather(comm, std::span<const E>(in), out, root, opt);
}

/// Block r of root's in goes to rank r's out (one NCCL group: the root posts an ncclSend per
/// peer, every other rank one ncclRecv). In place when out is the root's block of in.
template <element E>
void scatter(nccl::communicator& comm, std::span<const E> in, std::span<E> out, int root,
             const nccl::options& opt = {}) {
  constexpr std::string_view what = "scatter";
  ringzero::detail::check_scatter(comm.rank(), comm.size(), in, out, root);
  const bool is_root = comm.rank() == root;
  const std::size_t count = out.size();
  const E* own = is_root ? in.data() + count * static_cast<std::size_t>(root) : nullptr;
  if (is_root) nccl::detail::check_device<E>(comm, what, "input", in);
  if (own != out.data())
    nccl::detail::check_device<E>(comm, what, "output", std::span<const E>(out));
  nccl::detail::maybe_check<E>(comm, collective::scatter, count, op::sum, root);
  if (count == 0) return;
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    if (!is_root) return ncclRecv(out.data(), count, nccl::detail::nccl_type_v<E>, root, h, s);
    if (own != out.data())
      if (const ncclResult_t r = nccl::detail::cuda_status(
              cudaMemcpyAsync(out.data(), own, out.size_bytes(), cudaMemcpyDeviceToDevice, s));
          r != ncclSuccess)
        return r;
    if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
    ncclResult_t first = ncclSuccess;
    for (int p = 0; p < comm.size() && first == ncclSuccess; ++p)
      if (p != root)
        first = ncclSend(in.data() + count * static_cast<std::size_t>(p), count,
                         nccl::detail::nccl_type_v<E>, p, h, s);
    const ncclResult_t end = ncclGroupEnd();
    return first != ncclSuccess ? first : end;
  });
}

template <element E>
void scatter(nccl::communicator& comm, std::span<E> in, std::span<E> out, int root,
             const nccl::options& opt = {}) {
  scatter(comm, std::span<const E>(in), out, root, opt);
}

/// Returns once every rank has entered (a one-element all_reduce on the communicator's stream,
/// always waited for). Only options::timeout applies.
inline void barrier(nccl::communicator& comm, const nccl::options& opt = {}) {
  if (comm.size() == 1) return;
  const std::span<std::byte> buf = nccl::detail::access::scratch(comm);
  comm.enqueue("barrier", {.timeout = opt.timeout}, [&](ncclComm_t h, cudaStream_t s) {
    return ncclAllReduce(buf.data(), buf.data(), 1, ncclInt32, ncclSum, h, s);
  });
}

/// Point-to-point send, matched with recv() on `peer` in posting order.
template <element E>
void send(nccl::communicator& comm, std::span<const E> data, int peer,
          const nccl::options& opt = {}) {
  constexpr std::string_view what = "send";
  nccl::detail::check_peer(what, comm.rank(), comm.size(), peer);
  nccl::detail::check_device<E>(comm, what, "buffer", data);
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    return ncclSend(data.data(), data.size(), nccl::detail::nccl_type_v<E>, peer, h, s);
  });
}

template <element E>
void send(nccl::communicator& comm, std::span<E> data, int peer, const nccl::options& opt = {}) {
  send(comm, std::span<const E>(data), peer, opt);
}

/// Point-to-point receive of exactly data.size() elements from `peer`.
template <element E>
void recv(nccl::communicator& comm, std::span<E> data, int peer, const nccl::options& opt = {}) {
  constexpr std::string_view what = "recv";
  nccl::detail::check_peer(what, comm.rank(), comm.size(), peer);
  nccl::detail::check_device<E>(comm, what, "buffer", std::span<const E>(data));
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    return ncclRecv(data.data(), data.size(), nccl::detail::nccl_type_v<E>, peer, h, s);
  });
}

/// Sends `out` to `to` while receiving `in` from `from`, fused in one NCCL group so a ring of
/// ranks each sending to the next cannot deadlock.
template <element E>
void send_recv(nccl::communicator& comm, std::span<const E> out, int to, std::span<E> in, int from,
               const nccl::options& opt = {}) {
  constexpr std::string_view what = "send_recv";
  for (int peer : {to, from}) nccl::detail::check_peer(what, comm.rank(), comm.size(), peer);
  nccl::detail::check_device<E>(comm, what, "send buffer", out);
  nccl::detail::check_device<E>(comm, what, "receive buffer", std::span<const E>(in));
  comm.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
    if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
    const ncclResult_t rr =
        ncclRecv(in.data(), in.size(), nccl::detail::nccl_type_v<E>, from, h, s);
    const ncclResult_t sr =
        ncclSend(out.data(), out.size(), nccl::detail::nccl_type_v<E>, to, h, s);
    const ncclResult_t er = ncclGroupEnd();
    return rr != ncclSuccess ? rr : sr != ncclSuccess ? sr : er;
  });
}

}  // namespace ringzero
