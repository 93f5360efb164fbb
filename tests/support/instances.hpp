// The collectives every test program runs, compiled once (ringzero_test_instances) instead of
// in every test source: the build force-includes this header into each test, and the
// declarations below keep the compiler from instantiating detail::dispatch, and through it every
// algorithm of algorithms::builtin, for these transports and element types. A test that runs
// another combination (its own transport or table) still instantiates that one itself.
// Header-only users of ringzero never see this file.
#pragma once

#include <cstdint>

#include "ringzero/collectives.hpp"
#include "ringzero/transport/loopback.hpp"

// X(T, E) for every element type a collective accepts.
#define RINGZERO_TEST_INTEGER_ELEMENTS(X, T) \
  X(T, std::int8_t)                          \
  X(T, std::uint8_t)                         \
  X(T, std::int32_t) X(T, std::uint32_t) X(T, std::int64_t) X(T, std::uint64_t)
#define RINGZERO_TEST_FLOATING_ELEMENTS(X, T) \
  X(T, ringzero::float16) X(T, float) X(T, double) X(T, ringzero::bfloat16)

#define RINGZERO_TEST_RUN_SIGNATURE(T, E)                               \
  void ringzero::detail::dispatch<ringzero::algorithms::builtin, T, E>( \
      ringzero::communicator<T>&, const ringzero::algorithms::call<E>&, const ringzero::options&);
#define RINGZERO_TEST_EXTERN_RUN(T, E) extern template RINGZERO_TEST_RUN_SIGNATURE(T, E)
#define RINGZERO_TEST_INSTANTIATE_RUN(T, E) template RINGZERO_TEST_RUN_SIGNATURE(T, E)

RINGZERO_TEST_INTEGER_ELEMENTS(RINGZERO_TEST_EXTERN_RUN, ringzero::loopback::transport)
RINGZERO_TEST_FLOATING_ELEMENTS(RINGZERO_TEST_EXTERN_RUN, ringzero::loopback::transport)

// The other transports only where the program links their instances (ringzero_add_test's
// TRANSPORTS): their headers would cost every other test parse time.
#ifdef RINGZERO_TEST_INSTANCES_SHM
#include "ringzero/transport/shm.hpp"
RINGZERO_TEST_INTEGER_ELEMENTS(RINGZERO_TEST_EXTERN_RUN, ringzero::shm::transport)
RINGZERO_TEST_FLOATING_ELEMENTS(RINGZERO_TEST_EXTERN_RUN, ringzero::shm::transport)
#endif
#ifdef RINGZERO_TEST_INSTANCES_LIBFABRIC
#include "ringzero/transport/libfabric.hpp"
RINGZERO_TEST_INTEGER_ELEMENTS(RINGZERO_TEST_EXTERN_RUN, ringzero::libfabric::transport)
RINGZERO_TEST_FLOATING_ELEMENTS(RINGZERO_TEST_EXTERN_RUN, ringzero::libfabric::transport)
#endif
#ifdef RINGZERO_TEST_INSTANCES_SOCKET
#include "ringzero/transport/socket.hpp"
RINGZERO_TEST_INTEGER_ELEMENTS(RINGZERO_TEST_EXTERN_RUN, ringzero::socket::transport)
RINGZERO_TEST_FLOATING_ELEMENTS(RINGZERO_TEST_EXTERN_RUN, ringzero::socket::transport)
#endif
