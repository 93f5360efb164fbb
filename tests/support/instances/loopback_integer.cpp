// detail::run over the loopback transport, integer element types (instances.hpp says why).
#include "instances.hpp"

RINGZERO_TEST_INTEGER_ELEMENTS(RINGZERO_TEST_INSTANTIATE_RUN, ringzero::loopback::transport)
