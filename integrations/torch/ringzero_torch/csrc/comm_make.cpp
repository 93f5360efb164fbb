// make_comm: which transport the ranks use, agreed through the store.
#include <fmt/core.h>

#include <string>

#include "comm_impl.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/log.hpp"

namespace ringzero_torch {

namespace detail {

std::unique_ptr<comm> make_shm(ringzero::bootstrap::store& store, int rank, int size,
                               std::chrono::nanoseconds timeout);
std::unique_ptr<comm> make_socket(ringzero::bootstrap::store& store, int rank, int size,
                                  std::chrono::nanoseconds timeout);

}  // namespace detail

std::unique_ptr<comm> make_comm(key_value& kv, int rank, int size,
                                std::chrono::nanoseconds timeout) {
  return detail::translate(
      [&] {
        detail::store_adapter store(kv);
        const std::string forced =
            ringzero::detail::getenv_str("RINGZERO_TORCH_TRANSPORT").value_or("");
        if (!forced.empty() && forced != "shm" && forced != "socket")
          throw ringzero::invalid_argument(
              fmt::format("RINGZERO_TORCH_TRANSPORT='{}' is neither 'shm' nor 'socket'", forced));
        // Every rank reads every rank's host, so all of them choose alike.
        const std::string host = ringzero::log::detail::host_name();
        store.set_string(fmt::format("ringzero-torch/host/{}", rank), host);
        bool one_host = true;
        for (int r = 0; r < size; ++r)
          one_host = one_host && store.get_string(fmt::format("ringzero-torch/host/{}", r)) == host;
        if (forced == "shm" || (forced.empty() && one_host))
          return detail::make_shm(store, rank, size, timeout);
        return detail::make_socket(store, rank, size, timeout);
      },
      [] { return -1; });
}

std::uint32_t max_tag() noexcept {
  return ringzero::max_p2p_tag;
}

}  // namespace ringzero_torch
