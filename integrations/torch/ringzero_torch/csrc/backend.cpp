#include "backend.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <algorithm>
#include <numeric>
#include <optional>
#include <utility>

namespace ringzero_torch {

namespace {

// The torch Store as comm.hpp's key_value. torch's PrefixStore already keeps each group's keys
// apart.
class torch_store final : public key_value {
 public:
  explicit torch_store(c10::intrusive_ptr<c10d::Store> s) : s_(std::move(s)) {}
  void set(const std::string& key, const std::vector<std::uint8_t>& value) override {
    s_->set(key, value);
  }
  std::vector<std::uint8_t> get(const std::string& key) override { return s_->get(key); }
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    return s_->add(key, delta);
  }
  void wait(const std::vector<std::string>& keys) override { s_->wait(keys); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds limit) override {
    s_->wait(keys, limit);
  }

 private:
  c10::intrusive_ptr<c10d::Store> s_;
};

[[noreturn]] void refuse(const std::string& what) {
  C10_THROW_ERROR(DistBackendError, "ringzero: " + what);
}

std::optional<element> element_of(at::ScalarType t) {
  switch (t) {
    case at::kChar:
      return element::int8;
    case at::kByte:
      return element::uint8;
    case at::kInt:
      return element::int32;
    case at::kUInt32:
      return element::uint32;
    case at::kLong:
      return element::int64;
    case at::kUInt64:
      return element::uint64;
    case at::kHalf:
      return element::float16;
    case at::kFloat:
      return element::float32;
    case at::kDouble:
      return element::float64;
    case at::kBFloat16:
      return element::bfloat16;
    default:
      return std::nullopt;
  }
}

// How one reduction runs: in ringzero (type, op), or gathered and reduced here with torch's own
// elementwise ops (bitwise ops, int16 and the other types ringzero does not reduce).
struct reduction_plan {
  bool native = false;
  element type = element::float32;
  reduction op = reduction::sum;
  c10d::ReduceOp::RedOpType torch_op = c10d::ReduceOp::SUM;
  std::optional<at::Scalar> premul;  ///< PREMUL_SUM's factor, applied to the input first
};

reduction_plan plan(const at::Tensor& t, const c10d::ReduceOp& rop) {
  reduction_plan p;
  p.torch_op = rop.op_;
  if (rop.op_ == c10d::ReduceOp::PREMUL_SUM) {
    const auto* s = dynamic_cast<const c10d::PreMulSumSupplement*>(rop.supplement_.get());
    if (s == nullptr) refuse("PREMUL_SUM without its factor");
    p.premul = s->tensor_factor.defined() ? s->tensor_factor.item() : at::Scalar(s->double_factor);
    p.torch_op = c10d::ReduceOp::SUM;
  }
  if (t.scalar_type() == at::kBool) {
    // Logical or and and, as bytes of 0 and 1.
    p.type = element::uint8;
    switch (p.torch_op) {
      case c10d::ReduceOp::SUM:
      case c10d::ReduceOp::MAX:
      case c10d::ReduceOp::BOR:
        p.native = true;
        p.op = reduction::max;
        return p;
      case c10d::ReduceOp::PRODUCT:
      case c10d::ReduceOp::MIN:
      case c10d::ReduceOp::BAND:
        p.native = true;
        p.op = reduction::min;
        return p;
      default:
        return p;
    }
  }
  const auto e = element_of(t.scalar_type());
  if (!e) return p;
  p.type = *e;
  switch (p.torch_op) {
    case c10d::ReduceOp::SUM:
      p.op = reduction::sum;
      break;
    case c10d::ReduceOp::AVG:
      p.op = reduction::avg;
      break;
    case c10d::ReduceOp::PRODUCT:
      p.op = reduction::prod;
      break;
    case c10d::ReduceOp::MIN:
      p.op = reduction::min;
      break;
    case c10d::ReduceOp::MAX:
      p.op = reduction::max;
      break;
    default:
      return p;
  }
  p.native = true;
  return p;
}

// acc = acc (op) x, with torch's elementwise ops: the gathered path's combine step, the same
// order on every rank so that all of them hold the same bits.
void combine(at::Tensor& acc, const at::Tensor& x, c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
      acc.add_(x);
      return;
    case c10d::ReduceOp::PRODUCT:
      acc.mul_(x);
      return;
    case c10d::ReduceOp::MIN:
      acc = at::minimum(acc, x);
      return;
    case c10d::ReduceOp::MAX:
      acc = at::maximum(acc, x);
      return;
    case c10d::ReduceOp::BAND:
      acc.bitwise_and_(x);
      return;
    case c10d::ReduceOp::BOR:
      acc.bitwise_or_(x);
      return;
    case c10d::ReduceOp::BXOR:
      acc.bitwise_xor_(x);
      return;
    default:
      refuse("unsupported reduce op");
  }
}

// The reduction of every rank's `in` (contiguous, flat), gathered to every rank and reduced here.
at::Tensor gathered_reduction(comm& c, const at::Tensor& in, const reduction_plan& p,
                              const call_options& o) {
  const int64_t n = c.size();
  at::Tensor all = at::empty({n, in.numel()}, in.options());
  c.all_gather(in.data_ptr(), all.data_ptr(), in.nbytes(), o);
  at::Tensor acc = all[0].clone();
  for (int64_t r = 1; r < n; ++r) combine(acc, all[r], p.torch_op);
  if (p.torch_op == c10d::ReduceOp::AVG) {
    if (at::isIntegralType(acc.scalar_type(), /*includeBool=*/true))
      acc = acc.div(n, "trunc");
    else
      acc.div_(n);
  }
  return acc;
}

std::size_t bytes_of(const at::Tensor& t) {
  return t.nbytes();
}

// A tensor the collective can read and write as one flat buffer: the tensor itself when it is
// contiguous, else a contiguous copy that finish() copies back.
at::Tensor dense(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

void check_tensor(const at::Tensor& t, const char* what) {
  if (!t.defined()) refuse(std::string(what) + ": undefined tensor");
  if (t.layout() != at::kStrided)
    refuse(std::string(what) + ": only dense (strided) tensors are supported, got a " +
           c10::str(t.layout()) + " tensor");
  if (!t.device().is_cpu())
    refuse(std::string(what) + ": this backend moves CPU tensors, got one on " + t.device().str() +
           "; for GPU tensors initialize with backend=\"cpu:ringzero,cuda:nccl\" (docs/torch.md)");
}

void check_single(const std::vector<at::Tensor>& ts, const char* what) {
  if (ts.size() != 1)
    refuse(std::string(what) + ": expects exactly one tensor per call, got " +
           std::to_string(ts.size()));
  check_tensor(ts[0], what);
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  check_tensor(b, what);
  if (a.scalar_type() != b.scalar_type())
    refuse(std::string(what) + ": tensors of different types (" +
           std::string(c10::toString(a.scalar_type())) + " and " +
           std::string(c10::toString(b.scalar_type())) + ")");
}

void check_root(int64_t root, int size, const char* what) {
  if (root < 0 || root >= size)
    refuse(std::string(what) + ": root " + std::to_string(root) + " is not a rank of this " +
           std::to_string(size) + "-rank group");
}

}  // namespace

std::exception_ptr backend_error(const std::string& what, int rank, int size, int culprit,
                                 bool timed_out) {
  std::string msg = what;
  // "Timed out" as gloo says it: scripts (and torch's tests) look for those words.
  if (timed_out)
    msg += "; Timed out" + (culprit >= 0 ? " waiting for rank " + std::to_string(culprit) : "");
  else if (culprit >= 0)
    msg += " [failed rank: " + std::to_string(culprit) + "]";
  msg += " (ringzero backend, rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
  try {
    C10_THROW_ERROR(DistBackendError, msg);
  } catch (...) {
    return std::current_exception();
  }
}

// ---------------------------------------------------------------------------------------------
// work

work::work(int rank, int size, c10d::OpType type, const char* title,
           std::vector<at::Tensor> outputs, body run, std::function<void()> finish)
    : c10d::Work(rank, type, title),
      run_(std::move(run)),
      finish_(std::move(finish)),
      outputs_(std::move(outputs)),
      future_(
          c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
      size_(size) {}

bool work::isCompleted() {
  return done_.load(std::memory_order_acquire);
}

bool work::isSuccess() const {
  std::lock_guard lock(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr work::exception() const {
  std::lock_guard lock(mutex_);
  return exception_;
}

std::vector<at::Tensor> work::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> work::getFuture() {
  return future_;
}

void work::complete(std::exception_ptr error) noexcept {
  if (!error && finish_) {
    try {
      finish_();
    } catch (...) {
      error = std::current_exception();
    }
  }
  {
    std::lock_guard lock(mutex_);
    completed_ = true;
    exception_ = error;
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  // Callbacks (DDP's bucket hooks) run here, in the thread that completed the work.
  try {
    if (error)
      future_->setError(error);
    else
      future_->markCompleted(c10::IValue(outputs_));
  } catch (...) {  // a callback's own failure is the future's, not this thread's
  }
}

bool work::wait(std::chrono::milliseconds timeout) {
  if (!isCompleted())
    if (auto p = progress_.lock()) p->run_inline(this);
  // A blocking call waits for its peers' answer: spin briefly (a peer on this host answers in
  // microseconds), then sleep on the condition variable.
  for (int i = 0; i < 2000 && !isCompleted(); ++i) std::this_thread::yield();
  std::unique_lock lock(mutex_);
  const auto finished = [&] { return completed_; };
  if (timeout == kNoTimeout || timeout.count() < 0) {
    cv_.wait(lock, finished);
  } else if (!cv_.wait_for(lock, timeout, finished)) {
    C10_THROW_ERROR(DistBackendError, "ringzero: work of rank " + std::to_string(rank_) +
                                          " did not complete within " +
                                          std::to_string(timeout.count()) + " ms (wait timeout)");
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

void work::abort() {
  // One call cannot be taken back from the collective the ranks are in: the whole queue stops.
  if (auto p = progress_.lock()) p->stop(backend_error("the work was aborted", rank_, size_, -1));
}

// ---------------------------------------------------------------------------------------------
// progress

progress::progress() : thread_([this] { loop(); }) {}

progress::~progress() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void progress::post(const c10::intrusive_ptr<work>& w, bool wake) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) {
      w->complete(stop_error_ ? stop_error_
                              : backend_error("the process group was shut down", -1, -1, -1));
      return;
    }
    queue_.push_back(w);
    queued_.fetch_add(1, std::memory_order_release);
  }
  if (wake) wake_.notify_one();
}

bool progress::run_inline(work* w) {
  c10::intrusive_ptr<work> mine;
  {
    std::lock_guard lock(mutex_);
    if (busy_ || queue_.empty() || queue_.front().get() != w) return false;
    mine = queue_.front();
    queue_.pop_front();
    queued_.fetch_sub(1, std::memory_order_relaxed);
    busy_ = true;
  }
  execute(mine);
  if (message_count_.load(std::memory_order_relaxed) != 0) poll_messages();
  bool pending = false;
  {
    std::lock_guard lock(mutex_);
    busy_ = false;
    pending = stopping_ || !queue_.empty() || message_count_.load(std::memory_order_relaxed) != 0;
  }
  // Wake the thread only when it has something to do: a blocking call made back to back would
  // otherwise wake it once per call to find nothing, and on a host with a core or two per rank
  // that wake-up takes the core the peer's call is running on.
  if (pending) wake_.notify_all();
  return true;
}

void progress::execute(const c10::intrusive_ptr<work>& w) {
  std::unique_ptr<message> m;
  try {
    m = w->run_();
  } catch (const comm_error& e) {
    w->complete(
        backend_error(e.what(), w->rank_, w->size_, e.peer, e.k == comm_error::kind::timeout));
    return;
  } catch (const c10::Error&) {
    w->complete(std::current_exception());
    return;
  } catch (const std::exception& e) {
    w->complete(backend_error(std::string("ringzero: ") + e.what(), w->rank_, w->size_, -1));
    return;
  }
  if (!m) {
    w->complete(nullptr);
    return;
  }
  messages_.emplace_back(std::move(m), w);
  message_count_.fetch_add(1, std::memory_order_relaxed);
}

bool progress::poll_messages() {
  bool moved = false;
  for (std::size_t i = 0; i < messages_.size();) {
    auto& [m, w] = messages_[i];
    std::exception_ptr error;
    bool done = false;
    try {
      done = m->test();
    } catch (const comm_error& e) {
      error = backend_error(e.what(), w->rank_, w->size_, e.peer, e.k == comm_error::kind::timeout);
      done = true;
    }
    if (!done) {
      ++i;
      continue;
    }
    moved = true;
    auto finished = std::move(w);
    messages_.erase(messages_.begin() + static_cast<std::ptrdiff_t>(i));
    message_count_.fetch_sub(1, std::memory_order_relaxed);
    finished->complete(error);
  }
  return moved;
}

void progress::loop() {
  unsigned idle = 0;
  for (;;) {
    c10::intrusive_ptr<work> w;
    {
      std::unique_lock lock(mutex_);
      // With messages posted, poll them; else sleep until work comes (after a short spin
      // outside the lock, below).
      wake_.wait(lock, [&] {
        return !busy_ && (stopping_ || !queue_.empty() ||
                          message_count_.load(std::memory_order_relaxed) != 0);
      });
      // Stopping: what is queued still runs (unless the stop was a failure); messages nobody
      // matched are given up below.
      if (stopping_ && (queue_.empty() || stop_error_)) break;
      if (!queue_.empty()) {
        w = queue_.front();
        queue_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
      }
      busy_ = true;
    }
    if (w) execute(w);
    const bool moved = !messages_.empty() && poll_messages();
    {
      std::lock_guard lock(mutex_);
      busy_ = false;
    }
    wake_.notify_all();
    if (w || moved) {
      idle = 0;
    } else if (!messages_.empty()) {
      // Waiting on posted messages only: back off as ringzero's waits do.
      if (++idle > 64)
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      else
        std::this_thread::yield();
    }
    // Spin briefly for the next call before sleeping: a training step issues calls back to
    // back, and a sleeping thread takes tens of microseconds to wake.
    for (int i = 0; w && i < 200 && queued_.load(std::memory_order_acquire) == 0; ++i)
      std::this_thread::yield();
  }
  // Whatever is left fails with the reason the thread stopped.
  std::deque<c10::intrusive_ptr<work>> left;
  {
    std::lock_guard lock(mutex_);
    left.swap(queue_);
  }
  const auto why =
      stop_error_ ? stop_error_ : backend_error("the process group was shut down", -1, -1, -1);
  for (auto& w : left) w->complete(why);
  for (auto& [m, w] : messages_) w->complete(why);
  messages_.clear();
}

void progress::stop(std::exception_ptr error) {
  {
    std::lock_guard lock(mutex_);
    if (!stop_error_) stop_error_ = error;
    stopping_ = true;
  }
  wake_.notify_all();
}

void progress::drain() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

// ---------------------------------------------------------------------------------------------
// backend

backend::backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                 backend_options o)
    : c10d::Backend(rank, size), options_(std::move(o)) {
  torch_store kv(store);
  try {
    comm_ = make_comm(kv, rank, size, options_.timeout);
  } catch (const comm_error& e) {
    std::rethrow_exception(
        backend_error(e.what(), rank, size, e.peer, e.k == comm_error::kind::timeout));
  }
  progress_ = std::make_shared<progress>();
}

backend::backend(std::shared_ptr<comm> c, std::shared_ptr<progress> p, backend_options o)
    : c10d::Backend(c->rank(), c->size()),
      comm_(std::move(c)),
      progress_(std::move(p)),
      options_(std::move(o)) {}

backend::~backend() {
  // A split backend shares its parent's thread, which its parent stops.
  if (progress_ && progress_.use_count() == 1) progress_->drain();
}

c10::intrusive_ptr<c10d::Backend::Options> backend::getBackendOptions() {
  return c10::make_intrusive<c10d::Backend::Options>("ringzero", options_.timeout);
}

call_options backend::call(std::chrono::milliseconds timeout) const {
  call_options o;
  o.timeout = timeout.count() > 0 ? timeout : options_.timeout;
  o.reproducible = options_.reproducible;
  o.algorithm = options_.algorithm;
  return o;
}

c10::intrusive_ptr<c10d::Work> backend::enqueue(c10d::OpType type, const char* title,
                                                std::vector<at::Tensor> outputs, work::body run,
                                                std::function<void()> finish, bool async) {
  auto w = c10::make_intrusive<work>(rank_, size_, type, title, std::move(outputs), std::move(run),
                                     std::move(finish));
  ++sequence_;
  w->progress_ = progress_;
  progress_->post(w, async);
  if (!async && !progress_->run_inline(w.get())) progress_->wake();
  return w;
}

c10::intrusive_ptr<c10d::Work> backend::broadcast(std::vector<at::Tensor>& tensors,
                                                  const c10d::BroadcastOptions& opts) {
  check_single(tensors, "broadcast");
  check_root(opts.rootRank, size_, "broadcast");
  at::Tensor t = tensors[0];
  at::Tensor buf = dense(t);
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(
      c10d::OpType::BROADCAST, "ringzero:broadcast", tensors,
      [c = comm_, buf, root, o = call(opts.timeout)]() -> std::unique_ptr<message> {
        c->broadcast(buf.data_ptr(), bytes_of(buf), root, o);
        return nullptr;
      },
      [t, buf]() mutable {
        if (!t.is_same(buf)) t.copy_(buf);
      },
      opts.asyncOp);
}

namespace {

// In-place all_reduce of a flat, contiguous buffer.
void all_reduce_flat(comm& c, at::Tensor& buf, const reduction_plan& p, const call_options& o) {
  if (p.premul) buf.mul_(*p.premul);
  if (p.native) {
    c.all_reduce(p.type, buf.data_ptr(), buf.data_ptr(), static_cast<std::size_t>(buf.numel()),
                 p.op, o);
    return;
  }
  buf.copy_(gathered_reduction(c, buf.reshape({-1}), p, o).view_as(buf));
}

}  // namespace

c10::intrusive_ptr<c10d::Work> backend::allreduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) {
  check_single(tensors, "allreduce");
  at::Tensor t = tensors[0];
  const reduction_plan p = plan(t, opts.reduceOp);
  at::Tensor buf = dense(t);
  return enqueue(
      c10d::OpType::ALLREDUCE, "ringzero:all_reduce", tensors,
      [c = comm_, buf, p, o = call(opts.timeout)]() mutable -> std::unique_ptr<message> {
        all_reduce_flat(*c, buf, p, o);
        return nullptr;
      },
      [t, buf]() mutable {
        if (!t.is_same(buf)) t.copy_(buf);
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  if (tensors.empty()) refuse("allreduce_coalesced: no tensors");
  for (const auto& t : tensors) check_same(tensors[0], t, "allreduce_coalesced");
  const reduction_plan p = plan(tensors[0], opts.reduceOp);
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  at::Tensor buf = at::cat(flat);
  return enqueue(
      c10d::OpType::ALLREDUCE_COALESCED, "ringzero:all_reduce_coalesced", tensors,
      [c = comm_, buf, p, o = call(opts.timeout)]() mutable -> std::unique_ptr<message> {
        all_reduce_flat(*c, buf, p, o);
        return nullptr;
      },
      [tensors, buf]() mutable {
        int64_t at = 0;
        for (auto& t : tensors) {
          t.copy_(buf.narrow(0, at, t.numel()).view_as(t));
          at += t.numel();
        }
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::reduce(std::vector<at::Tensor>& tensors,
                                               const c10d::ReduceOptions& opts) {
  check_single(tensors, "reduce");
  check_root(opts.rootRank, size_, "reduce");
  at::Tensor t = tensors[0];
  const reduction_plan p = plan(t, opts.reduceOp);
  at::Tensor buf = dense(t);
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(
      c10d::OpType::REDUCE, "ringzero:reduce", tensors,
      [c = comm_, buf, p, root, o = call(opts.timeout)]() mutable -> std::unique_ptr<message> {
        if (p.premul) buf.mul_(*p.premul);
        if (p.native) {
          c->reduce(p.type, buf.data_ptr(), buf.data_ptr(), static_cast<std::size_t>(buf.numel()),
                    p.op, root, o);
        } else {
          at::Tensor r = gathered_reduction(*c, buf.reshape({-1}), p, o);
          if (c->rank() == root) buf.copy_(r.view_as(buf));
        }
        return nullptr;
      },
      [t, buf, root, r = rank_]() mutable {
        if (r == root && !t.is_same(buf)) t.copy_(buf);
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::AllgatherOptions& opts) {
  check_tensor(input, "all_gather_into_tensor");
  check_same(input, output, "all_gather_into_tensor");
  if (output.numel() != input.numel() * size_)
    refuse("all_gather_into_tensor: the output holds " + std::to_string(output.numel()) +
           " elements, not the group's size (" + std::to_string(size_) + ") times the input's " +
           std::to_string(input.numel()));
  at::Tensor in = dense(input);
  at::Tensor out = dense(output);
  return enqueue(
      c10d::OpType::_ALLGATHER_BASE, "ringzero:all_gather_into_tensor", {output},
      [c = comm_, in, out, o = call(opts.timeout)]() -> std::unique_ptr<message> {
        c->all_gather(in.data_ptr(), out.data_ptr(), bytes_of(in), o);
        return nullptr;
      },
      [output, out]() mutable {
        if (!output.is_same(out)) output.copy_(out);
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const c10d::AllgatherOptions& opts) {
  check_single(inputs, "allgather");
  if (outputs.size() != 1 || outputs[0].size() != static_cast<std::size_t>(size_))
    refuse("allgather: expects one list of " + std::to_string(size_) + " output tensors");
  const at::Tensor in = dense(inputs[0]);
  for (const auto& t : outputs[0]) {
    check_same(in, t, "allgather");
    if (t.numel() != in.numel())
      refuse("allgather: an output tensor holds " + std::to_string(t.numel()) +
             " elements and the input " + std::to_string(in.numel()));
  }
  at::Tensor flat = at::empty({size_ * in.numel()}, in.options());
  std::vector<at::Tensor> outs = outputs[0];
  return enqueue(
      c10d::OpType::ALLGATHER, "ringzero:all_gather", outs,
      [c = comm_, in, flat, o = call(opts.timeout)]() -> std::unique_ptr<message> {
        c->all_gather(in.data_ptr(), flat.data_ptr(), bytes_of(in), o);
        return nullptr;
      },
      [outs, flat, n = in.numel()]() mutable {
        for (std::size_t r = 0; r < outs.size(); ++r)
          outs[r].copy_(flat.narrow(0, static_cast<int64_t>(r) * n, n).view_as(outs[r]));
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (inputs.empty()) refuse("allgather_coalesced: no tensors");
  if (outputs.size() != static_cast<std::size_t>(size_))
    refuse("allgather_coalesced: expects " + std::to_string(size_) + " output lists");
  std::vector<at::Tensor> flat_in;
  for (const auto& t : inputs) {
    check_same(inputs[0], t, "allgather_coalesced");
    flat_in.push_back(t.reshape({-1}));
  }
  for (const auto& list : outputs) {
    if (list.size() != inputs.size())
      refuse("allgather_coalesced: every output list must hold one tensor per input");
    for (std::size_t j = 0; j < list.size(); ++j) {
      check_same(inputs[0], list[j], "allgather_coalesced");
      if (list[j].numel() != inputs[j].numel())
        refuse("allgather_coalesced: output and input tensors differ in size");
    }
  }
  at::Tensor in = at::cat(flat_in);
  at::Tensor all = at::empty({size_ * in.numel()}, in.options());
  std::vector<at::Tensor> result;
  for (const auto& list : outputs) result.insert(result.end(), list.begin(), list.end());
  return enqueue(
      c10d::OpType::ALLGATHER_COALESCED, "ringzero:all_gather_coalesced", result,
      [c = comm_, in, all, o = call(opts.timeout)]() -> std::unique_ptr<message> {
        c->all_gather(in.data_ptr(), all.data_ptr(), bytes_of(in), o);
        return nullptr;
      },
      [outputs, all, n = in.numel()]() mutable {
        for (std::size_t r = 0; r < outputs.size(); ++r) {
          int64_t at = static_cast<int64_t>(r) * n;
          for (auto& t : outputs[r]) {
            t.copy_(all.narrow(0, at, t.numel()).view_as(t));
            at += t.numel();
          }
        }
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (outputs.size() != inputs.size())
    refuse("allgather_into_tensor_coalesced: as many outputs as inputs expected");
  std::vector<at::Tensor> ins, outs;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], "allgather_into_tensor_coalesced");
    check_same(inputs[i], outputs[i], "allgather_into_tensor_coalesced");
    if (outputs[i].numel() != inputs[i].numel() * size_)
      refuse("allgather_into_tensor_coalesced: an output is not the group's size times its input");
    ins.push_back(dense(inputs[i]));
    outs.push_back(dense(outputs[i]));
  }
  return enqueue(
      c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED, "ringzero:all_gather_into_tensor_coalesced",
      outputs,
      [c = comm_, ins, outs, o = call(opts.timeout)]() -> std::unique_ptr<message> {
        for (std::size_t i = 0; i < ins.size(); ++i)
          c->all_gather(ins[i].data_ptr(), outs[i].data_ptr(), bytes_of(ins[i]), o);
        return nullptr;
      },
      [outputs, outs]() mutable {
        for (std::size_t i = 0; i < outs.size(); ++i)
          if (!outputs[i].is_same(outs[i])) outputs[i].copy_(outs[i]);
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::GatherOptions& opts) {
  check_single(inputs, "gather");
  check_root(opts.rootRank, size_, "gather");
  const int root = static_cast<int>(opts.rootRank);
  const at::Tensor in = dense(inputs[0]);
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    if (outputs.size() != 1 || outputs[0].size() != static_cast<std::size_t>(size_))
      refuse("gather: the root expects one list of " + std::to_string(size_) + " output tensors");
    for (const auto& t : outputs[0]) {
      check_same(in, t, "gather");
      if (t.numel() != in.numel()) refuse("gather: output and input tensors differ in size");
    }
    outs = outputs[0];
  } else if (!outputs.empty() && !outputs[0].empty()) {
    refuse("gather: only the root passes output tensors");
  }
  at::Tensor flat = rank_ == root ? at::empty({size_ * in.numel()}, in.options()) : at::Tensor();
  return enqueue(
      c10d::OpType::GATHER, "ringzero:gather", outs,
      [c = comm_, in, flat, root, o = call(opts.timeout)]() -> std::unique_ptr<message> {
        c->gather(in.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr, bytes_of(in), root, o);
        return nullptr;
      },
      [outs, flat, n = in.numel()]() mutable {
        for (std::size_t r = 0; r < outs.size(); ++r)
          outs[r].copy_(flat.narrow(0, static_cast<int64_t>(r) * n, n).view_as(outs[r]));
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ScatterOptions& opts) {
  check_single(outputs, "scatter");
  check_root(opts.rootRank, size_, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor out = outputs[0];
  at::Tensor buf = dense(out);
  at::Tensor flat;
  if (rank_ == root) {
    if (inputs.size() != 1 || inputs[0].size() != static_cast<std::size_t>(size_))
      refuse("scatter: the root expects one list of " + std::to_string(size_) + " input tensors");
    std::vector<at::Tensor> parts;
    for (const auto& t : inputs[0]) {
      check_same(out, t, "scatter");
      if (t.numel() != out.numel()) refuse("scatter: output and input tensors differ in size");
      parts.push_back(t.reshape({-1}));
    }
    flat = at::cat(parts);
  } else if (!inputs.empty() && !inputs[0].empty()) {
    refuse("scatter: only the root passes input tensors");
  }
  return enqueue(
      c10d::OpType::SCATTER, "ringzero:scatter", outputs,
      [c = comm_, flat, buf, root, o = call(opts.timeout)]() -> std::unique_ptr<message> {
        c->scatter(flat.defined() ? flat.data_ptr() : nullptr, buf.data_ptr(), bytes_of(buf), root,
                   o);
        return nullptr;
      },
      [out, buf]() mutable {
        if (!out.is_same(buf)) out.copy_(buf);
      },
      opts.asyncOp);
}

namespace {

// Reduce-scatter of a flat input of size()*out.numel() elements into out (contiguous).
void reduce_scatter_flat(comm& c, at::Tensor in, at::Tensor& out, const reduction_plan& p,
                         const call_options& o) {
  if (p.premul) in = in.mul(*p.premul);
  if (p.native) {
    c.reduce_scatter(p.type, in.data_ptr(), out.data_ptr(), static_cast<std::size_t>(out.numel()),
                     p.op, o);
    return;
  }
  at::Tensor all = gathered_reduction(c, in, p, o);
  out.copy_(all.narrow(0, c.rank() * out.numel(), out.numel()).view_as(out));
}

}  // namespace

c10::intrusive_ptr<c10d::Work> backend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ReduceScatterOptions& opts) {
  check_single(outputs, "reduce_scatter");
  if (inputs.size() != 1 || inputs[0].size() != static_cast<std::size_t>(size_))
    refuse("reduce_scatter: expects one list of " + std::to_string(size_) + " input tensors");
  at::Tensor out = outputs[0];
  std::vector<at::Tensor> parts;
  for (const auto& t : inputs[0]) {
    check_same(out, t, "reduce_scatter");
    if (t.numel() != out.numel())
      refuse("reduce_scatter: an input tensor holds " + std::to_string(t.numel()) +
             " elements and the output " + std::to_string(out.numel()));
    parts.push_back(t.reshape({-1}));
  }
  const reduction_plan p = plan(out, opts.reduceOp);
  at::Tensor in = at::cat(parts);
  at::Tensor buf = dense(out);
  return enqueue(
      c10d::OpType::REDUCE_SCATTER, "ringzero:reduce_scatter", outputs,
      [c = comm_, in, buf, p, o = call(opts.timeout)]() mutable -> std::unique_ptr<message> {
        reduce_scatter_flat(*c, in, buf, p, o);
        return nullptr;
      },
      [out, buf]() mutable {
        if (!out.is_same(buf)) out.copy_(buf);
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  check_tensor(output, "reduce_scatter_tensor");
  check_same(output, input, "reduce_scatter_tensor");
  if (input.numel() != output.numel() * size_)
    refuse("reduce_scatter_tensor: the input holds " + std::to_string(input.numel()) +
           " elements, not the group's size (" + std::to_string(size_) + ") times the output's " +
           std::to_string(output.numel()));
  const reduction_plan p = plan(output, opts.reduceOp);
  at::Tensor in = dense(input).reshape({-1});
  at::Tensor buf = dense(output);
  return enqueue(
      c10d::OpType::_REDUCE_SCATTER_BASE, "ringzero:reduce_scatter_tensor", {output},
      [c = comm_, in, buf, p, o = call(opts.timeout)]() mutable -> std::unique_ptr<message> {
        reduce_scatter_flat(*c, in, buf, p, o);
        return nullptr;
      },
      [output, buf]() mutable {
        if (!output.is_same(buf)) output.copy_(buf);
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (outputs.size() != inputs.size())
    refuse("reduce_scatter_tensor_coalesced: as many outputs as inputs expected");
  std::vector<at::Tensor> ins, bufs;
  std::vector<reduction_plan> plans;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(outputs[i], "reduce_scatter_tensor_coalesced");
    check_same(outputs[i], inputs[i], "reduce_scatter_tensor_coalesced");
    if (inputs[i].numel() != outputs[i].numel() * size_)
      refuse("reduce_scatter_tensor_coalesced: an input is not the group's size times its output");
    ins.push_back(dense(inputs[i]).reshape({-1}));
    bufs.push_back(dense(outputs[i]));
    plans.push_back(plan(outputs[i], opts.reduceOp));
  }
  return enqueue(
      c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED, "ringzero:reduce_scatter_tensor_coalesced",
      outputs,
      [c = comm_, ins, bufs, plans, o = call(opts.timeout)]() mutable -> std::unique_ptr<message> {
        for (std::size_t i = 0; i < ins.size(); ++i)
          reduce_scatter_flat(*c, ins[i], bufs[i], plans[i], o);
        return nullptr;
      },
      [outputs, bufs]() mutable {
        for (std::size_t i = 0; i < bufs.size(); ++i)
          if (!outputs[i].is_same(bufs[i])) outputs[i].copy_(bufs[i]);
      },
      opts.asyncOp);
}

namespace {

// Per-rank byte counts of an alltoall_base side: its splits (rows of dim 0), or equal blocks.
std::vector<std::size_t> split_bytes(const at::Tensor& t, const std::vector<int64_t>& splits,
                                     int size, const char* side) {
  std::vector<std::size_t> counts(static_cast<std::size_t>(size));
  if (splits.empty()) {
    if (t.numel() % size != 0 || (t.dim() > 0 && t.size(0) % size != 0))
      refuse(std::string("alltoall_base: the ") + side + " tensor's first dimension (" +
             std::to_string(t.dim() > 0 ? t.size(0) : 0) + ") does not divide among " +
             std::to_string(size) + " ranks");
    std::fill(counts.begin(), counts.end(), t.nbytes() / static_cast<std::size_t>(size));
    return counts;
  }
  if (splits.size() != static_cast<std::size_t>(size))
    refuse(std::string("alltoall_base: ") + side + " splits name " + std::to_string(splits.size()) +
           " ranks, not " + std::to_string(size));
  const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
  const std::size_t row_bytes = rows > 0 ? t.nbytes() / static_cast<std::size_t>(rows) : 0;
  int64_t total = 0;
  for (std::size_t r = 0; r < splits.size(); ++r) {
    if (splits[r] < 0) refuse(std::string("alltoall_base: a negative ") + side + " split");
    counts[r] = static_cast<std::size_t>(splits[r]) * row_bytes;
    total += splits[r];
  }
  if (total != rows)
    refuse(std::string("alltoall_base: the ") + side + " splits add up to " +
           std::to_string(total) + " rows, the tensor has " + std::to_string(rows));
  return counts;
}

std::vector<std::size_t> displacements(const std::vector<std::size_t>& counts) {
  std::vector<std::size_t> d(counts.size());
  std::size_t at = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    d[i] = at;
    at += counts[i];
  }
  return d;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                      std::vector<int64_t>& output_splits,
                                                      std::vector<int64_t>& input_splits,
                                                      const c10d::AllToAllOptions& opts) {
  check_tensor(input, "alltoall_base");
  check_same(input, output, "alltoall_base");
  at::Tensor in = dense(input);
  at::Tensor out = dense(output);
  const bool equal = output_splits.empty() && input_splits.empty();
  if (equal && in.numel() != out.numel())
    refuse("alltoall_base: input and output differ in size (" + std::to_string(in.numel()) +
           " and " + std::to_string(out.numel()) + " elements)");
  auto send = split_bytes(in, input_splits, size_, "input");
  auto recv = split_bytes(out, output_splits, size_, "output");
  return enqueue(
      c10d::OpType::ALLTOALL_BASE, "ringzero:all_to_all_single", {output},
      [c = comm_, in, out, equal, send, recv,
       o = call(opts.timeout)]() -> std::unique_ptr<message> {
        if (equal)
          c->all_to_all(in.data_ptr(), out.data_ptr(), bytes_of(in), o);
        else
          c->all_to_allv(in.data_ptr(), out.data_ptr(), send, displacements(send), recv,
                         displacements(recv), o);
        return nullptr;
      },
      [output, out]() mutable {
        if (!output.is_same(out)) output.copy_(out);
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> backend::alltoall(std::vector<at::Tensor>& outputs,
                                                 std::vector<at::Tensor>& inputs,
                                                 const c10d::AllToAllOptions& opts) {
  if (outputs.size() != static_cast<std::size_t>(size_) ||
      inputs.size() != static_cast<std::size_t>(size_))
    refuse("alltoall: expects " + std::to_string(size_) + " input and output tensors");
  std::vector<std::size_t> send, recv;
  std::vector<at::Tensor> ins;
  for (int r = 0; r < size_; ++r) {
    check_same(inputs[0], inputs[static_cast<std::size_t>(r)], "alltoall");
    check_same(inputs[0], outputs[static_cast<std::size_t>(r)], "alltoall");
    send.push_back(inputs[static_cast<std::size_t>(r)].nbytes());
    recv.push_back(outputs[static_cast<std::size_t>(r)].nbytes());
    ins.push_back(inputs[static_cast<std::size_t>(r)].reshape({-1}));
  }
  at::Tensor in = at::cat(ins);
  const int64_t out_elems =
      std::accumulate(outputs.begin(), outputs.end(), int64_t{0},
                      [](int64_t a, const at::Tensor& t) { return a + t.numel(); });
  at::Tensor out = at::empty({out_elems}, in.options());
  return enqueue(
      c10d::OpType::ALLTOALL, "ringzero:all_to_all", outputs,
      [c = comm_, in, out, send, recv, o = call(opts.timeout)]() -> std::unique_ptr<message> {
        c->all_to_allv(in.data_ptr(), out.data_ptr(), send, displacements(send), recv,
                       displacements(recv), o);
        return nullptr;
      },
      [outputs, out]() mutable {
        int64_t at = 0;
        for (auto& t : outputs) {
          t.copy_(out.narrow(0, at, t.numel()).view_as(t));
          at += t.numel();
        }
      },
      opts.asyncOp);
}

namespace {

std::uint32_t check_tag(int tag, const char* what) {
  if (tag < 0 || static_cast<std::uint32_t>(tag) > max_tag())
    refuse(std::string(what) + ": tag " + std::to_string(tag) + " is outside [0, " +
           std::to_string(max_tag()) + "]");
  return static_cast<std::uint32_t>(tag);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> backend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  check_single(tensors, "send");
  const std::uint32_t t = check_tag(tag, "send");
  at::Tensor buf = dense(tensors[0]);
  return enqueue(c10d::OpType::SEND, "ringzero:send", tensors,
                 [c = comm_, buf, dst, t, o = call({})]() -> std::unique_ptr<message> {
                   return c->isend(buf.data_ptr(), bytes_of(buf), dst, t, o);
                 });
}

c10::intrusive_ptr<c10d::Work> backend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  check_single(tensors, "recv");
  const std::uint32_t t = check_tag(tag, "recv");
  at::Tensor out = tensors[0];
  at::Tensor buf = dense(out);
  return enqueue(
      c10d::OpType::RECV, "ringzero:recv", tensors,
      [c = comm_, buf, src, t, o = call({})]() -> std::unique_ptr<message> {
        return c->irecv(buf.data_ptr(), bytes_of(buf), src, t, o);
      },
      [out, buf]() mutable {
        if (!out.is_same(buf)) out.copy_(buf);
      });
}

c10::intrusive_ptr<c10d::Work> backend::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(
      c10d::OpType::BARRIER, "ringzero:barrier", {},
      [c = comm_, o = call(opts.timeout)]() -> std::unique_ptr<message> {
        c->barrier(o);
        return nullptr;
      },
      {}, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Backend> backend::split(const c10::intrusive_ptr<c10d::Store>&,
                                                 const std::vector<int>& ranks,
                                                 const c10::intrusive_ptr<Options>& opts) {
  // Every rank of this group calls split(), those outside `ranks` too: ringzero's split() with
  // the group's first rank as color (splits are disjoint) and the position in `ranks` as key.
  const auto me = std::find(ranks.begin(), ranks.end(), rank_);
  const int color = me == ranks.end() ? -1 : *std::min_element(ranks.begin(), ranks.end());
  const int key = static_cast<int>(me - ranks.begin());
  std::shared_ptr<comm> sub;
  auto w = enqueue(c10d::OpType::UNKNOWN, "ringzero:split", {},
                   [c = comm_, color, key, &sub]() -> std::unique_ptr<message> {
                     sub = c->split(color, key);
                     return nullptr;
                   });
  w->wait(kNoTimeout);
  if (!sub) return nullptr;
  backend_options o = options_;
  if (opts && opts->timeout.count() > 0) o.timeout = opts->timeout;
  auto b = c10::make_intrusive<backend>(std::move(sub), progress_, o);
  if (opts) {
    b->setGroupUid(opts->group_name);
    b->setGroupDesc(opts->group_desc);
  }
  return b;
}

void backend::abort() {
  comm_->abort("the process group was aborted");
  progress_->stop(backend_error("the process group was aborted", rank_, size_, -1));
}

void backend::shutdown() {
  if (progress_.use_count() == 1) progress_->drain();
}

}  // namespace ringzero_torch
