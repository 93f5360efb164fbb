// The dispatcher's first path (detail/dispatch.hpp): options::wire. all_gather, reduce_scatter and
// all_reduce, or any collective of their shapes, with the elements on the wire in a quantized
// format (detail/quantized_call.hpp): host buffers over a messaging transport. The collectives on
// bytes it runs go through the dispatcher again, each counted and traced as what it is; the call
// itself is only compared (RINGZERO_CHECK, with its wire format and block).
#pragma once

#include <fmt/core.h>

#include <type_traits>

#include "ringzero/detail/call_route.hpp"
#include "ringzero/detail/paths/native.hpp"
#include "ringzero/detail/quantized_call.hpp"
#include "ringzero/error.hpp"
#include "ringzero/reduce/quantize.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/wire.hpp"

namespace ringzero::detail::paths {

struct quantized {
  template <class R>
  [[nodiscard]] static bool applies(const R& x) {
    return x.quantized;
  }

  template <class R>
  [[nodiscard]] static bool run(R& x) {
    using T = typename R::transport_type;
    using E = typename R::element_type;
    if constexpr (native_collectives<T>) {
      throw unsupported(
          fmt::format("{}: options::wire {}: this backend runs its own collectives, on the "
                      "elements as they are",
                      x.d.name, wire_format_name(x.opt.wire)));
    } else {
      refuse_async(x.d.name, x.opt);
      if (x.device >= 0)
        throw unsupported(
            fmt::format("{}: options::wire {} runs on host buffers; these are device memory",
                        x.d.name, wire_format_name(x.opt.wire)));
      maybe_check<T, E>(x.comm, x.call.kind, x.size.count, x.call.reduction, x.call.root, x.opt,
                        x.env.check_on());
      // takes_quantized_path() refused the other element types.
      if constexpr (quantize::supported_v<std::remove_cv_t<E>>)
        if (!x.size.empty)
          run_quantized(x.comm, x.d, x.call.in, x.call.out, x.call.reduction, x.opt);
    }
    return true;
  }
};

}  // namespace ringzero::detail::paths
