// detail::dispatch over the libfabric transport, every element type (instances.hpp says why). One
// source for all ten types: what their collectives share (the transport, the communicator,
// the parts of each algorithm that do not depend on the type) is compiled once, not once per
// kind of type (docs/testing.md).
#include "instances.hpp"

RINGZERO_TEST_INTEGER_ELEMENTS(RINGZERO_TEST_INSTANTIATE_RUN, ringzero::libfabric::transport)
RINGZERO_TEST_FLOATING_ELEMENTS(RINGZERO_TEST_INSTANTIATE_RUN, ringzero::libfabric::transport)
