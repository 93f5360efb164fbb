// The dispatcher's path to a transport's own collectives (detail/dispatch.hpp): every call on a
// backend that runs its collectives itself (NCCL), unless options::algorithm names one of
// ringzero's schedules for it (the device schedule path); or, on a transport with a faster path
// for some calls (shm: in its shared segment), the calls it takes. Such a transport may decline
// a call: it then stays started (counted once) for the host path.
#pragma once

#include <fmt/core.h>

#include <string_view>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/schedule.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/detail/call_route.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/tuning/policy.hpp"

namespace ringzero::detail {

/// Whether a native transport can run options::algorithm for collective `c`: as a schedule
/// where it runs ringzero's schedules and one implements `c` (NCCL), never otherwise. Checked
/// before anything is sent, alike on every rank.
template <class T>
void check_forced_native(collective c, algorithm a) {
  const std::string_view what = collective_name(c);
  if constexpr (!scheduled_collectives<T>) {
    throw unsupported(fmt::format(
        "{}: this backend runs its own collectives; algorithm '{}' cannot be forced on it", what,
        algorithm_name(a)));
  } else {
    if (!algorithms::builtin::known(a))
      throw invalid_argument(fmt::format(
          "{}: options::algorithm holds {}, which names no algorithm", what, static_cast<int>(a)));
    if (!algorithms::schedule::has_schedule(a, c))
      throw unsupported(fmt::format(
          "{}: algorithm '{}' does not run on this backend's buffers; ringzero's algorithms "
          "there are {}; leave options::algorithm automatic for the backend's own collective",
          what, algorithm_name(a), algorithms::schedule::summary));
  }
}

/// options::async on a transport that completes every call before returning.
inline void refuse_async(std::string_view what, const options& opt) {
  if (opt.async)
    throw invalid_argument(
        fmt::format("{}: options::async needs a stream-ordered backend (NCCL); this transport "
                    "completes every call before returning",
                    what));
}

/// Offers `nc` to a transport that runs some collectives itself; true where it ran it, which
/// takes a sequence number, as a call over messages does.
template <class T>
[[nodiscard]] bool offer_native(communicator<T>& comm, native_call& nc, const options& opt) {
  nc.one_phase_bytes = tuning::one_phase_limit(comm.tuning(), comm.size());
  options resolved = opt;
  if (resolved.timeout.count() <= 0) resolved.timeout = comm.timeout();
  if (!comm.transport().try_native(nc, resolved)) return false;
  ++comm.state().collective_seq;
  return true;
}

namespace paths {

struct native {
  template <class R>
  [[nodiscard]] static bool applies(const R& x) {
    using T = typename R::transport_type;
    if constexpr (native_collectives<T>)
      return x.opt.algorithm == algorithm::automatic || !scheduled_collectives<T>;
    else if constexpr (some_native_collectives<T>)
      // The world communicator only (the transport's ranks are its ranks), with nothing asking
      // for one of ringzero's algorithms.
      return x.comm.size() > 1 && x.comm.comm_id() == 0 &&
             x.opt.algorithm == algorithm::automatic && !x.env.algo && x.device < 0;
    else
      return false;
  }

  template <class R>
  [[nodiscard]] static bool run(R& x) {
    using T = typename R::transport_type;
    if constexpr (native_collectives<T>) {
      if (x.opt.algorithm != algorithm::automatic)
        check_forced_native<T>(x.call.kind, x.opt.algorithm);
      // A stream-ordered call (options::async) is timed to its enqueue, not to its completion.
      if (x.start(algorithm::automatic)) return true;
      x.comm.transport().run_native(
          native_call_of(x.call, x.size.count, x.comm.state().collective_seq), x.opt);
      return true;
    } else if constexpr (some_native_collectives<T>) {
      refuse_async(x.d.name, x.opt);
      // Offered before the cost model prices the algorithms: a sub-microsecond shared-memory
      // call should not pay for a choice it does not use.
      if (x.start(algorithm::automatic)) return true;
      native_call nc = native_call_of(x.call, x.size.count, x.comm.state().collective_seq);
      return offer_native(x.comm, nc, x.opt);
    } else {
      return false;
    }
  }
};

}  // namespace paths
}  // namespace ringzero::detail
