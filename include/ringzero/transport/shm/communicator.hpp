// Deprecated: ringzero/transport/shm.hpp gives shm::communicator since 0.4 (each transport's
// communicator comes from the transport's own header). Removed in 0.5.
#pragma once

#pragma message( \
    "ringzero/transport/shm/communicator.hpp is deprecated: include ringzero/transport/shm.hpp")
#include "ringzero/transport/shm.hpp"
