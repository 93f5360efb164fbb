// comm over ringzero's native shared-memory transport: every rank on one host.
#include "comm_impl.hpp"
#include "ringzero/transport/shm.hpp"

namespace ringzero_torch::detail {

template class comm_impl<ringzero::shm::transport>;

std::unique_ptr<comm> make_shm(ringzero::bootstrap::store& store, int rank, int size,
                               std::chrono::nanoseconds timeout) {
  ringzero::shm::options o;
  o.timeout = timeout;
  return std::make_unique<comm_impl<ringzero::shm::transport>>(
      ringzero::shm::communicator(ringzero::shm::transport(store, rank, size, o), timeout), "shm");
}

}  // namespace ringzero_torch::detail
