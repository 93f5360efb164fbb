// The dispatcher's paths for options::reproducible (detail/dispatch.hpp): every call whose
// collective reduces (its descriptor says so), of a floating type, with sum or avg. Its sums are
// exact: on device buffers as kernels between the passes (detail/reproducible_device.hpp), in a
// transport that sums exactly itself where it has that path (shm: in the segment), else as
// ordinary collectives on integers (detail/reproducible_call.hpp). Which collectives take them is
// the descriptor's `reduces`, never a list: a new reducing collective honours the option with no
// change here.
#pragma once

#include <fmt/core.h>

#include <type_traits>

#include "ringzero/algorithm.hpp"
#include "ringzero/detail/call_route.hpp"
#include "ringzero/detail/reproducible_call.hpp"
#include "ringzero/detail/reproducible_device.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/device_reproducible.hpp"
#include "ringzero/kernels/device_runtime.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/types.hpp"

namespace ringzero::detail::paths {

/// The device options::reproducible's passes run on: the transport's where it has one (NCCL),
/// else the buffers' (x.device); never merely the calling thread's. -1: host buffers.
template <class R>
[[nodiscard]] int reproducible_device_of(const R& x) {
  if constexpr (requires { x.comm.transport().device(); })
    return x.comm.transport().device();
  else
    return x.device;
}

/// On device buffers: NCCL's (every call on it), or a messaging transport's that moves device
/// memory. The passes' kernels come from the registered device tables.
struct reproducible_device {
  template <class R>
  [[nodiscard]] static bool applies(const R& x) {
    return x.reproducible && reproducible_device_of(x) >= 0;
  }
  template <class R>
  [[nodiscard]] static bool run(R& x) {
    using E = typename R::element_type;
    if constexpr (reproducible::supported_v<std::remove_cv_t<E>>) {
      const kernels::device_reproducible& k = kernels::required_device_reproducible(x.d.name);
      const kernels::device_runtime* rt = kernels::registered_device_runtime();
      if (rt == nullptr)  // registered with k by the same header: only a test can split them
        throw unsupported(fmt::format("{}: no CUDA runtime table", x.d.name));
      run_reproducible_device<typename R::table>(x.comm, x.call, x.opt, *rt, k,
                                                 reproducible_device_of(x));
    }
    return true;
  }
};

/// A float sum offered to a transport that sums exactly itself (shm: in the segment, at the
/// plain call's phases and bytes). As the plain native path: the world communicator, the
/// algorithm automatic and no RINGZERO_ALGO. The transport says first whether it will run the
/// call, so that one it leaves is counted only as the host path's collectives.
struct reproducible_native {
  template <class R>
  [[nodiscard]] static bool applies(const R& x) {
    return reproducible_native_collectives<typename R::transport_type> &&
           std::is_same_v<typename R::element_type, float> && x.reproducible && x.comm.size() > 1 &&
           x.comm.comm_id() == 0 && x.opt.algorithm == algorithm::automatic && !x.env.algo;
  }
  template <class R>
  [[nodiscard]] static bool run(R& x) {
    if constexpr (reproducible_native_collectives<typename R::transport_type>) {
      native_call nc = native_call_of(x.call, x.size.count, x.comm.state().collective_seq);
      nc.reproducible = true;
      if (!x.comm.transport().runs_reproducible(nc)) return false;
      if (x.start(algorithm::automatic)) return true;
      options resolved = x.opt;
      if (resolved.timeout.count() <= 0) resolved.timeout = x.comm.timeout();
      if (!x.comm.transport().try_native(nc, resolved))
        throw transport_error(fmt::format(
            "{}: the transport said it would sum this call exactly, then declined it", x.d.name));
      ++x.comm.state().collective_seq;
      return true;
    } else {
      return false;
    }
  }
};

/// Host buffers anywhere else: the passes as collectives on integers, through the dispatcher.
struct reproducible_host {
  template <class R>
  [[nodiscard]] static bool applies(const R& x) {
    return x.reproducible;
  }
  template <class R>
  [[nodiscard]] static bool run(R& x) {
    using E = typename R::element_type;
    if constexpr (reproducible::supported_v<std::remove_cv_t<E>>)
      run_reproducible<typename R::table>(x.comm, x.call, x.opt);
    return true;
  }
};

}  // namespace ringzero::detail::paths
