// Open MPI's MPI_Reduce_scatter_block or MPI_Allgather under ringzero-perf's procedure, for
// bench/compare --collective reduce_scatter|all_gather: per size (the full buffer of n blocks, as
// ringzero-perf sizes these rows) one untimed call, a barrier, -n timed calls, the slowest
// rank's mean; out-of-place, then in place (MPI_IN_PLACE). Which transport MPI uses is mpirun's
// choice.
//
//   mpi_blocks reduce_scatter|all_gather [-b min] [-e max] [-f factor] [-n iters] [-w warmup]
//              [-c 0|1]
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string_view>
#include <vector>

#include "peer.hpp"

namespace {

using ringzero::bench::peer_collective;
using ringzero::bench::peer_input;

/// One call; in == nullptr means in place. `block` elements per rank.
void call(peer_collective c, const float* in, float* out, std::size_t block) {
  const int b = static_cast<int>(block);
  const void* send = in == nullptr ? MPI_IN_PLACE : static_cast<const void*>(in);
  if (c == peer_collective::reduce_scatter)
    MPI_Reduce_scatter_block(send, out, b, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  else
    MPI_Allgather(send, b, MPI_FLOAT, out, b, MPI_FLOAT, MPI_COMM_WORLD);
}

double timed(peer_collective c, const ringzero::bench::peer_options& o, const float* in, float* out,
             std::size_t block) {
  call(c, in, out, block);
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < o.iters; ++i) call(c, in, out, block);
  double mine = (MPI_Wtime() - t0) / o.iters;
  double slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

/// Runs one call on known inputs and counts wrong elements on every rank. reduce_scatter: each
/// rank's full vector is peer_input(rank, i), and block r of the sum lands on rank r (in place:
/// at the start of the buffer). all_gather: rank r's block is peer_input(r, j) and lands at block
/// r of every output (in place, the input already sits there).
long checked(peer_collective c, int rank, int ranks, float* in, float* out, std::size_t block) {
  const auto n = static_cast<std::size_t>(ranks);
  const auto me = static_cast<std::size_t>(rank);
  const bool in_place = in == nullptr;
  long wrong = 0;
  if (c == peer_collective::reduce_scatter) {
    float* fill = in_place ? out : in;
    for (std::size_t i = 0; i < n * block; ++i) fill[i] = peer_input(rank, i);
    if (!in_place) std::fill(out, out + block, -1e30f);
    call(c, in, out, block);
    for (std::size_t j = 0; j < block; ++j) {
      float want = 0;
      for (int r = 0; r < ranks; ++r) want += peer_input(r, me * block + j);
      if (out[j] != want) ++wrong;
    }
  } else {
    std::fill(out, out + n * block, -1e30f);
    float* fill = in_place ? out + me * block : in;
    for (std::size_t j = 0; j < block; ++j) fill[j] = peer_input(rank, j);
    call(c, in, out, block);
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t j = 0; j < block; ++j)
        if (out[r * block + j] != peer_input(static_cast<int>(r), j)) ++wrong;
  }
  long total = 0;
  MPI_Allreduce(&wrong, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const auto n = static_cast<std::size_t>(ranks);
  int status = 0;
  try {
    const std::string_view what = argc > 1 ? argv[1] : "";
    if (what != "reduce_scatter" && what != "all_gather")
      throw ringzero::invalid_argument(
          "usage: mpi_blocks reduce_scatter|all_gather [-b min] [-e max] [-f factor] "
          "[-n iters] [-w warmup] [-c 0|1]");
    const auto c =
        what == "reduce_scatter" ? peer_collective::reduce_scatter : peer_collective::all_gather;
    // The options follow the collective: parse them as if it were the program name.
    const auto o = ringzero::bench::parse_peer_options(argc - 1, argv + 1);
    const std::size_t max_count = o.max_bytes / sizeof(float);
    std::vector<float> send(max_count, 1.0f), recv(max_count, 1.0f);
    if (rank == 0)
      ringzero::bench::print_header(c == peer_collective::reduce_scatter
                                        ? "Open MPI MPI_Reduce_scatter_block"
                                        : "Open MPI MPI_Allgather",
                                    ranks, o, c);
    for (std::size_t s = o.min_bytes; s <= o.max_bytes; s *= 2)
      for (int w = 0; w < o.warmup; ++w) call(c, send.data(), recv.data(), s / sizeof(float) / n);
    for (std::size_t s : ringzero::bench::peer_sizes(o)) {
      const std::size_t block = s / sizeof(float) / n;
      const double oop = timed(c, o, send.data(), recv.data(), block);
      const long oop_wrong =
          o.check ? checked(c, rank, ranks, send.data(), recv.data(), block) : -1;
      const double ip = timed(c, o, nullptr, recv.data(), block);
      const long ip_wrong = o.check ? checked(c, rank, ranks, nullptr, recv.data(), block) : -1;
      if (rank == 0) ringzero::bench::print_row(block, ranks, oop, oop_wrong, ip, ip_wrong, c);
      if (oop_wrong > 0 || ip_wrong > 0) status = 1;
    }
  } catch (const std::exception& e) {
    if (rank == 0) std::fprintf(stderr, "mpi_blocks: %s\n", e.what());
    status = 2;
  }
  MPI_Finalize();
  return status;
}
