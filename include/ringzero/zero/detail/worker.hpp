// The communication thread. A communicator may be used by one thread at a time, so every
// collective the sharder issues runs here, in submission order; the trainer thread only queues
// work and waits for tickets. Because every rank queues the same collectives in the same order
// (the order of its own calls), the ranks' threads meet in the same collectives.
//
// A failed task (a timeout, a dead peer) stops the thread: tasks behind it are dropped, since
// running them would only wait on peers that are no longer in step, and every wait rethrows the
// failure.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace ringzero::zero::detail {

class worker {
 public:
  using ticket = std::uint64_t;

  /// threaded = false runs each task inside submit(), on the caller's thread.
  explicit worker(bool threaded) {
    if (threaded) thread_ = std::thread([this] { loop(); });
  }
  worker(const worker&) = delete;
  worker& operator=(const worker&) = delete;

  ~worker() { join(); }

  /// Ends the thread; nothing is queued afterwards (submit runs tasks inline). On a normal exit
  /// the queued collectives finish first (peers expect them); while unwinding an exception they
  /// are dropped and only the running one ends. Its owner calls this before the buffers its
  /// tasks use go away; a second call does nothing.
  void join() noexcept {
    if (!thread_.joinable()) return;
    {
      std::unique_lock lock(mutex_);
      if (std::uncaught_exceptions() == 0)
        done_.wait(lock, [&] { return completed_ >= submitted_ || failure_; });
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  /// Queues f; the returned ticket is complete once f and everything queued before it ran.
  ticket submit(std::function<void()> f) {
    if (!thread_.joinable()) {
      f();
      std::lock_guard lock(mutex_);
      completed_ = ++submitted_;
      return submitted_;
    }
    std::lock_guard lock(mutex_);
    if (failure_) std::rethrow_exception(failure_);
    tasks_.push_back(std::move(f));
    ++submitted_;
    wake_.notify_all();
    return submitted_;
  }

  void wait(ticket t) {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return completed_ >= t || failure_; });
    if (completed_ < t) std::rethrow_exception(failure_);
  }

  void drain() {
    ticket t = 0;
    {
      std::lock_guard lock(mutex_);
      t = submitted_;
    }
    wait(t);
  }

  [[nodiscard]] bool done(ticket t) {
    std::lock_guard lock(mutex_);
    return completed_ >= t;
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (stop_) return;
        f = std::move(tasks_.front());
        tasks_.pop_front();
      }
      try {
        f();
      } catch (...) {
        std::lock_guard lock(mutex_);
        failure_ = std::current_exception();
        tasks_.clear();
        done_.notify_all();
        return;
      }
      {
        std::lock_guard lock(mutex_);
        ++completed_;
      }
      done_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::deque<std::function<void()>> tasks_;
  ticket submitted_ = 0;
  ticket completed_ = 0;
  std::exception_ptr failure_;
  bool stop_ = false;
  std::thread thread_;  // last: started after, and joined before, everything above
};

}  // namespace ringzero::zero::detail
