// The dispatcher's last path (detail/dispatch.hpp): one of ringzero's algorithms over messages,
// from the call's table (options::algorithm, else RINGZERO_ALGO where it applies, else the cost
// model). Every call on a messaging transport that no earlier path took ends here.
#pragma once

#include <optional>

#include "ringzero/algorithm.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/detail/call_route.hpp"
#include "ringzero/detail/paths/native.hpp"
#include "ringzero/transport/native.hpp"

namespace ringzero::detail::paths {

struct host {
  template <class R>
  [[nodiscard]] static bool applies(const R&) {
    return !native_collectives<typename R::transport_type>;
  }

  template <class R>
  [[nodiscard]] static bool run(R& x) {
    if constexpr (native_collectives<typename R::transport_type>) {
      return false;  // ringzero's algorithms need a messaging transport
    } else {
      return run_algorithm(x);
    }
  }

 private:
  template <class R>
  [[nodiscard]] static bool run_algorithm(R& x) {
    using Table = typename R::table;
    refuse_async(x.d.name, x.opt);
    const std::optional<algorithm> from_env = x.env_algorithm();
    const algorithm a = choose<Table>(x.comm, x.d, x.size.model_bytes, x.opt, from_env);
    if (x.start(a)) return true;
    const auto& c = x.call;
    if (c.kind == collective::broadcast) {
      if (x.comm.rank() == c.root) copy_if_distinct(c.in, c.out);
      if (x.comm.size() == 1) return true;
    } else if (x.comm.size() == 1) {
      run_alone(c);
      return true;
    }
    options chosen = x.opt;
    chosen.algorithm = a;
    Table::run(a, x.comm, c, chosen);
    return true;
  }
};

}  // namespace ringzero::detail::paths
