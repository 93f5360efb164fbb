// The dispatcher's entry points, declared for the code that runs collectives inside a collective
// (the hierarchical algorithm's levels, the reproducible passes): the dispatcher's own header
// (detail/dispatch.hpp) includes that code, so it cannot be included back. A program that calls
// them includes detail/dispatch.hpp, or collectives.hpp, which defines them.
#pragma once

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/types.hpp"

namespace ringzero::detail {

/// Runs a validated call (buffers, op and root checked, options too) on `comm` by the first of
/// the dispatcher's paths that takes it, with the algorithms of `Table` where it runs one of
/// ringzero's algorithms.
template <class Table, class T, element E>
void dispatch(communicator<T>& comm, const algorithms::call<E>& c, const options& opt);

/// dispatch() with ringzero's own algorithms (algorithms::builtin), for code that the table's
/// header includes (a name it cannot spell yet).
template <class T, element E>
void dispatch_builtin(communicator<T>& comm, const algorithms::call<E>& c, const options& opt);

}  // namespace ringzero::detail
