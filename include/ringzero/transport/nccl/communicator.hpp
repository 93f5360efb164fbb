// Deprecated: nccl::transport is in ringzero/transport/nccl/transport.hpp since 0.4 (this header
// held the transport, not the communicator; ringzero/transport/nccl.hpp gives the communicator).
// Removed in 0.5.
#pragma once

#pragma message( \
    "ringzero/transport/nccl/communicator.hpp is deprecated: include ringzero/transport/nccl/transport.hpp")
#include "ringzero/transport/nccl/transport.hpp"
