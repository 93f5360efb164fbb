// ringzero as a c10d::Backend: torch.distributed's process groups over ringzero's communicators.
//
// Every call returns at once with a work whose collective runs on the communication thread of
// the communicator's transport (one per transport: a backend and the ones split from it share
// it, so their calls keep the order they were made in, as ringzero's transports need). DDP's
// bucket all_reduces so run while backward goes on, as with gloo and NCCL. A caller that waits
// on a work nobody has started runs it itself (the thread is idle, the order is the same), and a
// call made with async_op=False runs so at once: a blocking call costs no thread hand-off.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm.hpp"

namespace ringzero_torch {

class progress;
class backend;

/// One call's work: what runs on the communication thread, its outputs and its future.
class work : public c10d::Work {
 public:
  /// What a work runs: returns the message to watch when the call is a posted isend/irecv (the
  /// work completes when the message does), else nullptr (the work completes on return).
  using body = std::function<std::unique_ptr<message>()>;

  work(int rank, int size, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
       body run, std::function<void()> finish);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  void abort() override;

  /// The progress thread (or a waiter running the work inline) reports the outcome.
  void complete(std::exception_ptr error) noexcept;

 private:
  friend class progress;
  friend class backend;
  body run_;
  std::function<void()> finish_;  ///< on success, before the future: copies back into outputs
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<bool> done_{false};
  int size_;
  /// Weak: the thread may drop the last reference to a work, and must not be the one that
  /// destroys (joins) itself.
  std::weak_ptr<progress> progress_;
};

/// The communication thread of one transport and the queue in front of it.
class progress : public std::enable_shared_from_this<progress> {
 public:
  progress();
  ~progress();
  progress(const progress&) = delete;
  progress& operator=(const progress&) = delete;

  /// Queues w. wake = false leaves the thread asleep: for a caller that runs w itself at once
  /// (run_inline) unless the thread is busy, which then finds w when it looks again.
  void post(const c10::intrusive_ptr<work>& w, bool wake = true);
  /// Wakes the thread (after a post without waking that run_inline could not serve).
  void wake() { wake_.notify_one(); }
  /// Runs w in the calling thread if nothing runs now and w is next; false otherwise.
  bool run_inline(work* w);
  /// Fails every queued work with `error` and stops the thread (abort, shutdown after a failure).
  void stop(std::exception_ptr error);
  /// Runs what is queued, waits for posted messages, then stops the thread.
  void drain();

 private:
  void loop();
  void execute(const c10::intrusive_ptr<work>& w);
  bool poll_messages();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<c10::intrusive_ptr<work>> queue_;
  std::atomic<std::size_t> queued_{0};
  /// Someone (the thread or an inline waiter) holds the communicator: at most one at a time.
  bool busy_ = false;
  bool stopping_ = false;
  std::exception_ptr stop_error_;
  /// Posted isend/irecv, read and written only by whoever holds busy_.
  std::vector<std::pair<std::unique_ptr<message>, c10::intrusive_ptr<work>>> messages_;
  std::atomic<std::size_t> message_count_{0};
  std::thread thread_;
};

struct backend_options {
  std::chrono::milliseconds timeout{0};
  bool reproducible = false;
  std::string algorithm;  ///< empty: automatic (or RINGZERO_ALGO)
};

class backend : public c10d::Backend {
 public:
  /// Joins the ranks meeting in `store` (torch's, as init_process_group or new_group hands it).
  backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, backend_options o);
  /// A backend split from `parent` (split_group): shares its transport and thread.
  backend(std::shared_ptr<comm> c, std::shared_ptr<progress> p, backend_options o);
  ~backend() override;

  const std::string getBackendName() const override { return "ringzero"; }
  [[nodiscard]] std::string transport_name() const { return comm_->transport_name(); }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  uint64_t getSequenceNumberForGroup() override { return sequence_; }
  void setTimeout(std::chrono::milliseconds timeout) override { options_.timeout = timeout; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  void abort() override;
  void shutdown() override;

 private:
  /// Queues `run` as one work; `finish` runs on success before the future completes. A call
  /// torch makes with async_op=False (`async` false) is waited on at once: it runs in the
  /// caller's thread when the communication thread is idle, without the two hand-offs.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title,
                                         std::vector<at::Tensor> outputs, work::body run,
                                         std::function<void()> finish = {}, bool async = true);
  /// The options of one call: its own timeout if set, else the backend's.
  [[nodiscard]] call_options call(std::chrono::milliseconds timeout) const;

  std::shared_ptr<comm> comm_;
  std::shared_ptr<progress> progress_;
  backend_options options_;
  std::atomic<uint64_t> sequence_{0};
};

/// The DistBackendError for a failed call, naming the rank that failed (or, for a timeout, the
/// one that never answered) where one is known.
[[nodiscard]] std::exception_ptr backend_error(const std::string& what, int rank, int size,
                                               int culprit, bool timed_out = false);

}  // namespace ringzero_torch
