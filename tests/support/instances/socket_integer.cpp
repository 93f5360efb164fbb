// detail::run over the socket transport, integer element types (instances.hpp says why).
#include "instances.hpp"

RINGZERO_TEST_INTEGER_ELEMENTS(RINGZERO_TEST_INSTANTIATE_RUN, ringzero::socket::transport)
