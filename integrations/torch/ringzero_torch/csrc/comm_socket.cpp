// comm over ringzero's socket transport: ranks on several hosts (RINGZERO_RAILS, as the C++ API).
#include "comm_impl.hpp"
#include "ringzero/transport/socket.hpp"

namespace ringzero_torch::detail {

template class comm_impl<ringzero::socket::transport>;

std::unique_ptr<comm> make_socket(ringzero::bootstrap::store& store, int rank, int size,
                                  std::chrono::nanoseconds timeout) {
  ringzero::socket::options o;
  o.timeout = timeout;
  return std::make_unique<comm_impl<ringzero::socket::transport>>(
      ringzero::socket::communicator(ringzero::socket::transport(store, rank, size, o), timeout),
      "socket");
}

}  // namespace ringzero_torch::detail
