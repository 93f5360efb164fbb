// The dispatcher's device schedule path (detail/dispatch.hpp): one of ringzero's algorithms as a
// schedule (algorithms/schedule.hpp) on a device executor. On NCCL when options::algorithm names
// one (the transport's executor: its sends and receives, ringzero's kernels on its stream); on a
// messaging transport that moves device memory (libfabric opened with options::device_memory)
// whenever the buffers are device memory (the messaging executor, detail/device_executor.hpp).
#pragma once

#include <fmt/core.h>

#include <optional>
#include <span>
#include <string_view>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/schedule.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/detail/call_route.hpp"
#include "ringzero/detail/device_executor.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/paths/native.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/kernels/device_runtime.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/native.hpp"

namespace ringzero::detail {

/// The schedule a call on device buffers runs: options::algorithm (refused where it has no
/// schedule for the collective), else RINGZERO_ALGO where it has one, else the ring, else the
/// tree.
template <class Table>
[[nodiscard]] algorithm device_algorithm(collective c, const options& opt, const call_env& env) {
  const std::string_view what = collective_name(c);
  const auto refuse = [&](std::string_view why) {
    return unsupported(fmt::format("{}: {} on device buffers; ringzero's algorithms there are {}",
                                   what, why, algorithms::schedule::summary));
  };
  if (opt.algorithm != algorithm::automatic) {
    if (!algorithms::schedule::has_schedule(opt.algorithm, c))
      throw refuse(fmt::format("algorithm '{}' does not run", algorithm_name(opt.algorithm)));
    return opt.algorithm;
  }
  // RINGZERO_ALGO applies to every call: one without a schedule here keeps the default.
  if (const std::optional<algorithm> a = env_algorithm<Table>(env.algo);
      a && algorithms::schedule::has_schedule(*a, c))
    return *a;
  for (const algorithm a : {algorithm::ring, algorithm::tree})
    if (algorithms::schedule::has_schedule(a, c)) return a;
  throw refuse("no algorithm runs it");
}

namespace paths {

struct device_schedule {
  template <class R>
  [[nodiscard]] static bool applies(const R& x) {
    using T = typename R::transport_type;
    if constexpr (scheduled_collectives<T>)
      return x.opt.algorithm != algorithm::automatic;
    else
      return device_memory_transport<T> && x.device >= 0;
  }

  template <class R>
  [[nodiscard]] static bool run(R& x) {
    using T = typename R::transport_type;
    using E = typename R::element_type;
    const algorithms::call<E>& c = x.call;
    if constexpr (scheduled_collectives<T>) {
      check_forced_native<T>(c.kind, x.opt.algorithm);
      if (x.start(x.opt.algorithm)) return true;
      T& t = x.comm.transport();
      const native_call nc = native_call_of(c, x.size.count, x.comm.state().collective_seq);
      const algorithms::call<E> k = algorithms::schedule::call_of<E>(nc, t.rank(), t.size());
      const std::size_t elems = algorithms::schedule::scratch_elems(x.opt.algorithm, k, t.size());
      t.template with_device_executor<E>(
          nc, x.opt, algorithm_name(x.opt.algorithm), elems, [&](auto& ex, std::span<E> scratch) {
            algorithms::schedule::run(ex, x.opt.algorithm, k, scratch);
          });
      return true;
    } else if constexpr (device_memory_transport<T>) {
      refuse_async(x.d.name, x.opt);
      const std::string_view what = x.d.name;
      T& t = x.comm.transport();
      if (!t.device_memory())
        throw unsupported(fmt::format("{}: {}", what, t.device_memory_refusal()));
      const algorithm a = device_algorithm<typename R::table>(c.kind, x.opt, x.env);
      const kernels::device_reduction* reductions =
          algorithms::schedule::reduces(c.kind)
              ? &kernels::required_device_reduction(what, algorithm_name(a))
              : kernels::registered_device_reduction();
      if (x.start(a)) return true;
      const kernels::device_runtime& rt = *kernels::registered_device_runtime();
      const device_scope current(rt, x.device);
      // Registered whole, the allocation a buffer lies in: a registration covers later calls on
      // other parts of it, and its id tells a new allocation at a freed one's addresses from the
      // old, which must not be reached through the old registration.
      const auto adopt = [&](const void* p, std::size_t bytes) {
        if (bytes == 0) return;
        if (const kernels::device_allocation m = rt.allocation_of(p); m.base != nullptr)
          t.register_device_buffer(m.base, m.bytes, x.device, m.id);
        else
          t.register_device_buffer(p, bytes, x.device, 0);
      };
      if (x.d.uses_in(x.comm.rank(), c.root)) adopt(c.in.data(), c.in.size_bytes());
      if (x.d.uses_out(x.comm.rank(), c.root)) adopt(c.out.data(), c.out.size_bytes());
      device_cache& cache = device_cache_of(x.comm, rt, x.device);
      const std::size_t elems = algorithms::schedule::scratch_elems(a, c, x.comm.size());
      E* scratch =
          elems > 0 ? reinterpret_cast<E*>(cache.scratch(elems * sizeof(E), adopt)) : nullptr;
      device_executor<communicator<T>, E> ex(x.comm, cache, reductions, what, algorithm_name(a),
                                             x.opt.timeout);
      algorithms::schedule::run(ex, a, c, std::span<E>(scratch, elems));
      ex.finish();
      return true;
    } else {
      return false;
    }
  }
};

}  // namespace paths
}  // namespace ringzero::detail
