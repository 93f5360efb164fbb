// A messaging transport for tests that moves GPU memory between ranks that are threads of one
// process: a matched send and receive become one cudaMemcpyPeerAsync on the stream of the rank
// that matched them, and both complete when its event does. It is what libfabric with FI_HMEM is
// to the communicator (a device_memory_transport), so ringzero's schedules run on device buffers
// over it with the real kernels (detail/device_executor.hpp) across ranks, on one GPU (every rank
// on device 0) or several (rank r on device r modulo their number).
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "ringzero/communicator.hpp"
#include "ringzero/detail/cuda_runtime.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/detail/request.hpp"
#include "ringzero/tuning/defaults.hpp"

namespace test_support {

class cuda_loopback {
  using key = std::tuple<int, int, ringzero::tag_t>;  // (source, destination, tag)
  /// One posted message; a send and its receive share the copy's event once matched.
  struct op {
    std::byte* data = nullptr;
    std::size_t bytes = 0;
    int device = 0;
    key at{};
    bool send = false;
    std::shared_ptr<CUevent_st> copied;  // set, under the mailbox's lock, when matched
    std::string mismatch;
  };

 public:
  /// What the ranks of one world share: the messages posted and not yet matched.
  struct mailbox {
    std::mutex m;
    std::map<key, std::deque<std::shared_ptr<op>>> sends, recvs;

    /// A request dropped before its message was matched withdraws it.
    void abandon(std::shared_ptr<op>& o) noexcept {
      std::lock_guard lock(m);
      if (o->copied) return;
      auto& queues = o->send ? sends : recvs;
      const auto q = queues.find(o->at);
      if (q == queues.end()) return;
      for (auto it = q->second.begin(); it != q->second.end(); ++it)
        if (*it == o) {
          q->second.erase(it);
          break;
        }
    }
  };

  using request = ringzero::detail::transport_request<cuda_loopback, mailbox, std::shared_ptr<op>>;

  cuda_loopback(std::shared_ptr<mailbox> box, int rank, int size, int device)
      : box_(std::move(box)), rank_(rank), size_(size), device_(device) {
    const ringzero::detail::cuda_device_guard guard(device_);
    ringzero::detail::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                                 "cuda_loopback: cudaStreamCreateWithFlags");
  }
  cuda_loopback(cuda_loopback&& o) noexcept
      : box_(std::move(o.box_)),
        rank_(o.rank_),
        size_(o.size_),
        device_(o.device_),
        stream_(std::exchange(o.stream_, nullptr)) {}
  cuda_loopback& operator=(cuda_loopback&&) = delete;
  cuda_loopback(const cuda_loopback&) = delete;
  ~cuda_loopback() {
    if (stream_ == nullptr) return;
    static_cast<void>(ringzero::detail::drain_stream(stream_, std::chrono::seconds(30)));
    static_cast<void>(cudaStreamDestroy(stream_));
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] const ringzero::tuning::policy& tuning() const noexcept {
    return ringzero::tuning::defaults::loopback.value;
  }

  [[nodiscard]] request isend(int peer, ringzero::tag_t tag, std::span<const std::byte> data) {
    return post(true, {rank_, peer, tag}, const_cast<std::byte*>(data.data()), data.size());
  }
  [[nodiscard]] request irecv(int peer, ringzero::tag_t tag, std::span<std::byte> data) {
    return post(false, {peer, rank_, tag}, data.data(), data.size());
  }
  [[nodiscard]] bool test(request& r) {
    if (r.done_) return true;
    std::shared_ptr<CUevent_st> e;
    {
      std::lock_guard lock(box_->m);
      e = r.op_->copied;
    }
    if (!e) return false;
    if (!r.op_->mismatch.empty()) throw ringzero::transport_error(r.op_->mismatch);
    const cudaError_t q = cudaEventQuery(e.get());
    if (q == cudaErrorNotReady) return false;
    ringzero::detail::check_cuda(q, "cuda_loopback: cudaEventQuery");
    r.done_ = true;
    r.op_ = nullptr;
    return true;
  }
  void progress() noexcept {}

  [[nodiscard]] bool device_memory() const noexcept { return true; }
  [[nodiscard]] std::string device_memory_refusal() const { return {}; }
  void register_device_buffer(const void*, std::size_t, int, std::uint64_t) {}
  void forget_memory(const void*, std::size_t) {}

 private:
  request post(bool send, key k, std::byte* data, std::size_t bytes) {
    auto mine = std::make_shared<op>();
    mine->data = data;
    mine->bytes = bytes;
    mine->device = device_;
    mine->at = k;
    mine->send = send;
    request r;
    r.op_ = mine;
    r.eng_ = box_;
    std::lock_guard lock(box_->m);
    auto& other = (send ? box_->recvs : box_->sends)[k];
    if (other.empty()) {
      (send ? box_->sends : box_->recvs)[k].push_back(std::move(mine));
      return r;
    }
    std::shared_ptr<op> theirs = std::move(other.front());
    other.pop_front();
    const op& src = send ? *mine : *theirs;
    const op& dst = send ? *theirs : *mine;
    std::shared_ptr<CUevent_st> e = copy(dst, src);
    if (src.bytes != dst.bytes) {
      const std::string why =
          fmt::format("cuda_loopback: rank {} sent {} bytes to rank {}, which posted {}",
                      std::get<0>(k), src.bytes, std::get<1>(k), dst.bytes);
      mine->mismatch = theirs->mismatch = why;
    }
    mine->copied = theirs->copied = std::move(e);
    return r;
  }

  /// Enqueues the copy on this rank's stream and records its event there.
  [[nodiscard]] std::shared_ptr<CUevent_st> copy(const op& dst, const op& src) {
    const ringzero::detail::cuda_device_guard guard(device_);
    cudaEvent_t e = nullptr;
    ringzero::detail::check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                                 "cuda_loopback: cudaEventCreateWithFlags");
    std::shared_ptr<CUevent_st> owned(
        e, [](cudaEvent_t x) { static_cast<void>(cudaEventDestroy(x)); });
    if (src.bytes == dst.bytes && src.bytes > 0)
      ringzero::detail::check_cuda(
          cudaMemcpyPeerAsync(dst.data, dst.device, src.data, src.device, src.bytes, stream_),
          "cuda_loopback: cudaMemcpyPeerAsync");
    ringzero::detail::check_cuda(cudaEventRecord(e, stream_), "cuda_loopback: cudaEventRecord");
    return owned;
  }

  std::shared_ptr<mailbox> box_;
  int rank_;
  int size_;
  int device_;
  cudaStream_t stream_ = nullptr;
};

using cuda_loopback_communicator = ringzero::communicator<cuda_loopback>;

/// Runs f(comm) on n ranks, one thread each, rank r on device r modulo the visible devices
/// (current in its thread); rethrows the first failure.
template <class F>
void run_cuda_loopback(int n, F&& f) {
  int devices = 0;
  ringzero::detail::check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  auto box = std::make_shared<cuda_loopback::mailbox>();
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      try {
        ringzero::detail::check_cuda(cudaSetDevice(r % devices), "cudaSetDevice");
        // A failed rank leaves the others in a schedule: they give up within a minute.
        cuda_loopback_communicator comm(cuda_loopback(box, r, n, r % devices),
                                        std::chrono::seconds(60));
        f(comm);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : ranks) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace test_support
