// The request handle every messaging transport hands out for a posted send or receive, written
// once: it shares ownership of the engine that runs the operation (so a handle outliving its
// transport is safe), moves but never copies, and cancels on destruction. What "cancel" means
// is the engine's: a receive is never written afterwards, a send already under way finishes
// from a copy or is withdrawn, and the provider releases the buffer before the handle is gone.
#pragma once

#include <memory>
#include <utility>

namespace ringzero::detail {

/// Handle to one posted operation of an Engine. Op is the engine's handle to the operation
/// (a pointer or a shared_ptr), empty once the operation completed or was given up; Owner (the
/// transport) reads and writes the fields while posting and testing. Dropping a handle whose
/// operation is still pending calls `Engine::abandon(op)`, which must not throw: it runs in
/// destructors, when a wait gave up (a deadline, a failure, abort()) or the caller lost
/// interest.
template <class Owner, class Engine, class Op>
class transport_request {
 public:
  transport_request() = default;
  transport_request(transport_request&& o) noexcept
      : eng_(std::move(o.eng_)), op_(std::exchange(o.op_, Op{})), done_(o.done_) {}
  transport_request& operator=(transport_request&& o) noexcept {
    if (this != &o) {
      abandon();
      eng_ = std::move(o.eng_);
      op_ = std::exchange(o.op_, Op{});
      done_ = o.done_;
    }
    return *this;
  }
  transport_request(const transport_request&) = delete;
  transport_request& operator=(const transport_request&) = delete;
  ~transport_request() { abandon(); }

 private:
  friend Owner;
  void abandon() noexcept {
    static_assert(noexcept(std::declval<Engine&>().abandon(std::declval<Op&>())),
                  "Engine::abandon runs in destructors: it must be noexcept");
    if (op_) eng_->abandon(op_);
    op_ = Op{};
  }

  std::shared_ptr<Engine> eng_;  ///< the engine running the operation
  Op op_{};                      ///< the operation; empty once it completed or was dropped
  bool done_ = false;            ///< completed at posting (or tested complete)
};

}  // namespace ringzero::detail
