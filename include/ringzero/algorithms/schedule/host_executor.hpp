// The schedules (algorithms/schedule.hpp) on host memory over any ringzero messaging
// communicator, reducing with the per-element functions the CUDA kernels run
// (kernels/reduce.hpp). It exists to test the schedules without a GPU: every step, message id,
// operand order and scratch layout is the one the NCCL executor runs.
//
//   ringzero::loopback::world(4).run([&](ringzero::loopback::communicator& comm) {
//     ringzero::algorithms::schedule::run_on_host(
//         comm, ringzero::algorithm::ring,
//         ringzero::algorithms::call<float>{ringzero::collective::all_reduce, in, out, op::sum});
//   });
//
// A step posts all its messages, one each (message id = tag step), then waits for all of them,
// with the communicator's deadline. No validation beyond the schedules' own: callers pass what
// collectives.hpp would accept.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/schedule.hpp"
#include "ringzero/algorithms/schedule/executor.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/reduce.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::schedule {

/// Executor over `comm` for one call: takes one collective sequence number, like a host
/// algorithm.
template <collective_comm C, element E>
class host_executor {
 public:
  host_executor(C& comm, std::string_view collective, std::string_view algorithm,
                std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0})
      : ex_(comm, collective, algorithm, timeout) {}

  [[nodiscard]] int rank() const { return ex_.rank(); }
  [[nodiscard]] int size() const { return ex_.size(); }

  void exchange(std::span<const transfer<const E>> sends, std::span<const transfer<E>> recvs) {
    std::vector<typename ringzero::detail::exchange<C>::pending> ps;
    ps.reserve(sends.size() + recvs.size());
    for (const auto& t : recvs)
      ps.push_back(ex_.recv(t.peer, step_of(t.id), 0,
                            std::as_writable_bytes(std::span<E>(t.data, t.count))));
    for (const auto& t : sends)
      ps.push_back(
          ex_.send(t.peer, step_of(t.id), 0, std::as_bytes(std::span<const E>(t.data, t.count))));
    ex_.wait_all(ps);
  }

  void combine(op o, const E* a, const E* b, E* out, std::size_t n) {
    switch (o) {
      case op::sum:
      case op::avg:
        return apply<op::sum>(a, b, out, n);
      case op::prod:
        return apply<op::prod>(a, b, out, n);
      case op::min:
        return apply<op::min>(a, b, out, n);
      case op::max:
        return apply<op::max>(a, b, out, n);
    }
    throw invalid_argument("unknown reduction op code " + std::to_string(static_cast<int>(o)));
  }

  void finish_avg(E* data, std::size_t n, int ranks) {
    for (std::size_t i = 0; i < n; ++i) data[i] = kernels::finish_avg(data[i], ranks);
  }

  void copy(E* dst, const E* src, std::size_t n) { std::memcpy(dst, src, n * sizeof(E)); }

 private:
  [[nodiscard]] static int step_of(std::uint32_t id) {
    if (id >= max_message_ids)
      throw invalid_argument(
          fmt::format("schedule: message id {} does not fit a tag's step bits", id));
    return static_cast<int>(id);
  }

  // The kernels' per-element code, one element at a time as a GPU thread runs it.
  template <op O>
  static void apply(const E* a, const E* b, E* out, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i) out[i] = kernels::combine<O>(a[i], b[i]);
  }

  ringzero::detail::exchange<C> ex_;
};

/// Runs call `c` (validated as collectives.hpp would) with schedule `a` on host memory over
/// `comm`; scratch comes from the heap. opt.timeout bounds every wait.
template <collective_comm C, element E>
void run_on_host(C& comm, algorithm a, const call<E>& c, const options& opt = {}) {
  host_executor<C, E> x(comm, collective_name(c.kind), algorithm_name(a), opt.timeout);
  std::vector<E> scratch(scratch_elems(a, c, comm.size()));
  run(x, a, c, std::span<E>(scratch));
}

}  // namespace ringzero::algorithms::schedule
