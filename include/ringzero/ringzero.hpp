// The core of ringzero: element types, ops, errors, logging, counters and traces, the
// collectives and the in-process loopback transport. Backends are opt-in: include
// ringzero/transport/libfabric.hpp or ringzero/transport/nccl.hpp and link ringzero::libfabric
// or ringzero::nccl.
#pragma once

#include "ringzero/algorithm.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/model/cost_model.hpp"
#include "ringzero/op.hpp"
#include "ringzero/p2p.hpp"
#include "ringzero/trace.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/loopback.hpp"
#include "ringzero/types.hpp"
#include "ringzero/version.hpp"
