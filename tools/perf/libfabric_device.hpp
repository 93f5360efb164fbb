// ringzero-perf on the libfabric transport with buffers in GPU memory (--memory device). The
// runner lives in libfabric_device.cu, compiled by nvcc where CUDA is built in; this header only
// declares it, so main.cpp stays a C++ source that needs no CUDA header.
#pragma once

#include "cli.hpp"
#include "perf.hpp"

namespace ringzero::perf {

/// One rank of a --memory device run: exit status as perf::main returns them.
[[nodiscard]] int run_libfabric_device(const options& o, const context& ctx);

}  // namespace ringzero::perf
