// Open MPI's MPI_Alltoall under ringzero-perf's procedure, for bench/compare --collective alltoall:
// per size (the whole send buffer, n blocks of count/n floats, as ringzero-perf alltoall sizes
// its rows) one untimed call, a barrier, -n timed calls, the slowest rank's mean; out-of-place,
// then in place (MPI_IN_PLACE). Which transport MPI uses is mpirun's choice.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <vector>

#include "peer.hpp"

namespace {

using ringzero::bench::peer_collective;

/// Element i of the block rank `from` sends rank `to`: small integers, exact in float.
float value(int from, int to, std::size_t i) {
  return static_cast<float>(
      (i * 7 + static_cast<std::size_t>(from) * 13 + static_cast<std::size_t>(to) * 5) % 23);
}

double timed(const ringzero::bench::peer_options& o, const float* in, float* out,
             std::size_t block) {
  const int b = static_cast<int>(block);
  MPI_Alltoall(in, b, MPI_FLOAT, out, b, MPI_FLOAT, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < o.iters; ++i)
    MPI_Alltoall(in, b, MPI_FLOAT, out, b, MPI_FLOAT, MPI_COMM_WORLD);
  double mine = (MPI_Wtime() - t0) / o.iters;
  double slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

long checked(int rank, int ranks, float* in, float* out, std::size_t block) {
  const auto n = static_cast<std::size_t>(ranks);
  float* fill = in == nullptr ? out : in;
  for (std::size_t to = 0; to < n; ++to)
    for (std::size_t i = 0; i < block; ++i)
      fill[to * block + i] = value(rank, static_cast<int>(to), i);
  if (in != nullptr) std::fill(out, out + n * block, -1e30f);
  const int b = static_cast<int>(block);
  MPI_Alltoall(in == nullptr ? MPI_IN_PLACE : in, b, MPI_FLOAT, out, b, MPI_FLOAT, MPI_COMM_WORLD);
  long wrong = 0;
  for (std::size_t from = 0; from < n; ++from)
    for (std::size_t i = 0; i < block; ++i)
      if (out[from * block + i] != value(static_cast<int>(from), rank, i)) ++wrong;
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
    const auto o = ringzero::bench::parse_peer_options(argc, argv);
    const std::size_t max_count = o.max_bytes / sizeof(float);
    std::vector<float> send(max_count, 1.0f), recv(max_count, 1.0f);
    if (rank == 0)
      ringzero::bench::print_header("Open MPI MPI_Alltoall", ranks, o, peer_collective::all_to_all);
    for (std::size_t s = o.min_bytes; s <= o.max_bytes; s *= 2)
      for (int w = 0; w < o.warmup; ++w) {
        const int b = static_cast<int>(s / sizeof(float) / n);
        MPI_Alltoall(send.data(), b, MPI_FLOAT, recv.data(), b, MPI_FLOAT, MPI_COMM_WORLD);
      }
    for (std::size_t s : ringzero::bench::peer_sizes(o)) {
      const std::size_t block = s / sizeof(float) / n;
      const double oop = timed(o, send.data(), recv.data(), block);
      const long oop_wrong = o.check ? checked(rank, ranks, send.data(), recv.data(), block) : -1;
      const double ip = timed(o, static_cast<const float*>(MPI_IN_PLACE), recv.data(), block);
      const long ip_wrong = o.check ? checked(rank, ranks, nullptr, recv.data(), block) : -1;
      if (rank == 0)
        ringzero::bench::print_row(block, ranks, oop, oop_wrong, ip, ip_wrong,
                                   peer_collective::all_to_all);
      if (oop_wrong > 0 || ip_wrong > 0) status = 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_alltoall: %s\n", e.what());
    status = 2;
  }
  MPI_Finalize();
  return status;
}
