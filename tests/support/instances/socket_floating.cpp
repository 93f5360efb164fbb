// detail::run over the socket transport, floating element types (instances.hpp says why).
#include "instances.hpp"

RINGZERO_TEST_FLOATING_ELEMENTS(RINGZERO_TEST_INSTANTIATE_RUN, ringzero::socket::transport)
