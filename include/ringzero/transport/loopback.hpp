// The loopback transport: N ranks as N threads of one process, exchanging messages by memcpy.
// Tests and single-process demos use it; it is also the reference the other transports are
// checked against.
//
//   ringzero::loopback::world w(4);
//   w.run([&](ringzero::loopback::communicator& comm) { ringzero::all_reduce(comm, data, op::sum);
//   });
//
// loopback::communicator is ringzero::communicator over the transport
// (transport/loopback/transport.hpp); world runs a function on each rank, a thread each.
#pragma once

#include <fmt/core.h>

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "ringzero/communicator.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/loopback/transport.hpp"

namespace ringzero::loopback {

using communicator = ringzero::communicator<transport>;

/// N ranks as N threads. run() blocks until every rank returns; if any rank throws, the others'
/// waits fail with a peer_error naming it, and run() rethrows the first failure.
class world {
 public:
  explicit world(int size, world_options opts = {}) : size_(size), opts_(opts) {
    if (opts_.cost.given) opts_.tuning = *opts_.cost.given;
    if (size < 1)
      throw invalid_argument(fmt::format("loopback world size must be >= 1, got {}", size));
  }

  [[nodiscard]] int size() const noexcept { return size_; }

  template <class F>
  void run(F&& f) {
    auto shared = std::make_shared<detail::shared_state>(size_);
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size_));
    auto body = [&](int r) {
      // Built inside the try: with RINGZERO_TUNING the constructor talks to the other ranks,
      // and its errors must reach the caller as f's do.
      std::optional<communicator> comm;
      try {
        comm.emplace(transport(shared, r, opts_));
        f(*comm);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        int expected = -1;
        if (shared->failed_rank.load() < 0) {
          std::string what = "unknown exception";
          try {
            throw;
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          static std::mutex m;
          std::lock_guard lock(m);
          if (shared->failed_rank.load() < 0) {
            shared->failure = what;
            shared->failed_rank.compare_exchange_strong(expected, r, std::memory_order_acq_rel);
          }
        }
      }
    };
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size_ - 1));
    for (int r = 1; r < size_; ++r) threads.emplace_back(body, r);
    body(0);
    for (auto& t : threads) t.join();
    // The root cause is the rank that failed first; the others only saw its effect.
    const int first = shared->failed_rank.load();
    if (first >= 0 && errors[static_cast<std::size_t>(first)])
      std::rethrow_exception(errors[static_cast<std::size_t>(first)]);
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

 private:
  int size_;
  world_options opts_;
};

}  // namespace ringzero::loopback
