// detail::run over the libfabric transport, floating element types (instances.hpp says why).
#include "instances.hpp"

RINGZERO_TEST_FLOATING_ELEMENTS(RINGZERO_TEST_INSTANTIATE_RUN, ringzero::libfabric::transport)
