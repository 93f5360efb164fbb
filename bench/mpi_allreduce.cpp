// Open MPI's MPI_Allreduce under ringzero-perf's procedure, for bench/compare: per size one
// untimed call, a barrier, -n timed calls, the slowest rank's mean; out-of-place, then in place
// (MPI_IN_PLACE). Which transport MPI uses is mpirun's choice (--mca btl self,vader or self,tcp).
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <vector>

#include "peer.hpp"

namespace {

double timed(const ringzero::bench::peer_options& o, const float* in, float* out,
             std::size_t count) {
  const int n = static_cast<int>(count);
  MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < o.iters; ++i) MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  double mine = (MPI_Wtime() - t0) / o.iters;
  double slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

long checked(int rank, int ranks, float* in, float* out, std::size_t count) {
  ringzero::bench::peer_fill(in, count, rank);
  if (in != out) std::fill(out, out + count, -1e30f);
  MPI_Allreduce(in == out ? MPI_IN_PLACE : in, out, static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                MPI_COMM_WORLD);
  long wrong = ringzero::bench::peer_wrong(out, count, ranks);
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
  int status = 0;
  try {
    const auto o = ringzero::bench::parse_peer_options(argc, argv);
    const std::size_t max_count = o.max_bytes / sizeof(float);
    std::vector<float> send(max_count, 1.0f), recv(max_count, 1.0f);
    if (rank == 0) ringzero::bench::print_header("Open MPI MPI_Allreduce", ranks, o);
    for (std::size_t s = o.min_bytes; s <= o.max_bytes; s *= 2)
      for (int w = 0; w < o.warmup; ++w)
        MPI_Allreduce(send.data(), recv.data(), static_cast<int>(s / sizeof(float)), MPI_FLOAT,
                      MPI_SUM, MPI_COMM_WORLD);
    for (std::size_t s : ringzero::bench::peer_sizes(o)) {
      const std::size_t count = s / sizeof(float);
      const double oop = timed(o, send.data(), recv.data(), count);
      const long oop_wrong = o.check ? checked(rank, ranks, send.data(), recv.data(), count) : -1;
      const double ip = timed(o, static_cast<const float*>(MPI_IN_PLACE), recv.data(), count);
      const long ip_wrong = o.check ? checked(rank, ranks, recv.data(), recv.data(), count) : -1;
      if (rank == 0) ringzero::bench::print_row(count, ranks, oop, oop_wrong, ip, ip_wrong);
      if (oop_wrong > 0 || ip_wrong > 0) status = 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_allreduce: %s\n", e.what());
    status = 2;
  }
  MPI_Finalize();
  return status;
}
