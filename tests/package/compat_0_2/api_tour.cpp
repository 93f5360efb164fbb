// As 0.2 documented it, unchanged (its examples/docs/api_tour.cpp at 3087dec); built by
// tests/package/CMakeLists.txt with deprecation warnings allowed.
// The calls docs/api.md shows, run by four loopback ranks; every snippet checks its result, so
// the documentation cannot drift from what the library does.
#include <ringzero/ringzero.hpp>

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("api_tour: " + what);
}

void all_reduce_example(ringzero::loopback::communicator& comm) {
  // docs-begin: all_reduce
  std::vector<float> grads(4096, 1.0f);
  ringzero::all_reduce(comm, std::span<float>(grads), ringzero::op::sum);  // in place

  std::vector<float> mean(grads.size());
  ringzero::all_reduce(comm, std::span<const float>(grads), std::span<float>(mean),
                       ringzero::op::avg);  // out of place: grads is left as it is
  // docs-end: all_reduce
  const auto n = static_cast<float>(comm.size());
  expect(std::ranges::all_of(grads, [&](float g) { return g == n; }), "all_reduce sum");
  expect(std::ranges::all_of(mean, [&](float m) { return m == n; }), "all_reduce avg");
}

void shard_example(ringzero::loopback::communicator& comm) {
  // docs-begin: reduce_scatter
  const std::size_t shard = 1024;
  const auto ranks = static_cast<std::size_t>(comm.size());
  std::vector<float> full(shard * ranks, 1.0f);  // this rank's whole gradient
  std::vector<float> mine(shard);                // block rank() of the sum, and nothing else
  ringzero::reduce_scatter(comm, std::span<const float>(full), std::span<float>(mine),
                           ringzero::op::sum);

  // ... update this rank's shard of the parameters from `mine`, then share every shard:
  ringzero::all_gather(comm, std::span<const float>(mine), std::span<float>(full));
  // docs-end: reduce_scatter
  const auto n = static_cast<float>(comm.size());
  expect(std::ranges::all_of(full, [&](float x) { return x == n; }), "reduce_scatter/all_gather");
}

void rooted_example(ringzero::loopback::communicator& comm) {
  // docs-begin: broadcast
  std::vector<double> weights(1000);
  if (comm.rank() == 0) std::ranges::fill(weights, 0.5);  // only the root's data matters
  ringzero::broadcast(comm, std::span<double>(weights), /*root=*/0);
  // docs-end: broadcast
  expect(std::ranges::all_of(weights, [](double w) { return w == 0.5; }), "broadcast");

  // docs-begin: reduce
  std::vector<std::int64_t> counts(8, comm.rank());
  ringzero::reduce(comm, std::span<std::int64_t>(counts), ringzero::op::max, /*root=*/0);
  // On rank 0 every element is now size() - 1; the other ranks' counts are unspecified.
  // docs-end: reduce
  if (comm.rank() == 0)
    expect(std::ranges::all_of(counts, [&](std::int64_t c) { return c == comm.size() - 1; }),
           "reduce max");
}

void point_to_point_example(ringzero::loopback::communicator& comm) {
  // docs-begin: point_to_point
  ringzero::barrier(comm);  // nobody passes until every rank has arrived

  // Shift a block one rank to the right around the ring.
  const int right = (comm.rank() + 1) % comm.size();
  const int left = (comm.rank() + comm.size() - 1) % comm.size();
  std::vector<std::int32_t> out(16, comm.rank()), in(16);
  ringzero::send_recv(comm, std::span<const std::int32_t>(out), right, std::span<std::int32_t>(in),
                      left);

  // Plain send and recv are matched in posting order per pair of ranks.
  if (comm.rank() == 0) ringzero::send(comm, std::span<const std::int32_t>(out), 1);
  if (comm.rank() == 1) ringzero::recv(comm, std::span<std::int32_t>(in), 0);
  // docs-end: point_to_point
  // Rank 1's block came from rank 0 both times.
  expect(std::ranges::all_of(in, [&](std::int32_t x) { return x == left; }), "send_recv");
}

void options_example(ringzero::loopback::communicator& comm) {
  std::vector<float> grads(1 << 16, 1.0f);
  // docs-begin: options
  ringzero::options opt;
  opt.algorithm = ringzero::algorithm::tree;  // instead of the cost model's choice
  opt.timeout = std::chrono::seconds(30);     // instead of RINGZERO_TIMEOUT
  ringzero::all_reduce(comm, std::span<float>(grads), ringzero::op::sum, opt);

  // What the cost model would pick for 64 MiB on this communicator:
  const ringzero::algorithm pick = ringzero::tuning::select(
      ringzero::collective::all_reduce, 64.0 * (1 << 20), comm.size(), comm.cost());
  ringzero::log::info("64 MiB all_reduce on {} ranks: {}", comm.size(),
                      ringzero::algorithm_name(pick));
  // docs-end: options
  const auto n = static_cast<float>(comm.size());
  expect(std::ranges::all_of(grads, [&](float g) { return g == n; }), "all_reduce with tree");
}

void types_example(ringzero::loopback::communicator& comm) {
  // docs-begin: types
  // bfloat16 and float16 are reduced in float and rounded to nearest-even once per step.
  std::vector<ringzero::bfloat16> g(256, ringzero::bfloat16(0.5f));
  ringzero::all_reduce(comm, std::span<ringzero::bfloat16>(g), ringzero::op::sum);
  const float total = g[0];  // 0.5 * size(), exactly representable here
  // docs-end: types
  expect(total == 0.5f * static_cast<float>(comm.size()), "bfloat16 all_reduce");
}

void split_example(ringzero::loopback::communicator& comm) {
  // docs-begin: split
  // Even and odd ranks each get a communicator of their own (as MPI_Comm_split).
  std::optional<ringzero::loopback::communicator> half = comm.split(comm.rank() % 2, comm.rank());
  std::vector<int> x(16, 1);
  ringzero::all_reduce(*half, std::span<int>(x), ringzero::op::sum);  // sums over half the ranks
  // docs-end: split
  expect(half->size() == comm.size() / 2 && x[0] == half->size(), "split");
}

void errors_example(ringzero::loopback::communicator& comm) {
  // docs-begin: errors
  std::vector<float> in(10), out(11);
  std::string message;
  try {
    ringzero::all_reduce(comm, std::span<const float>(in), std::span<float>(out),
                         ringzero::op::sum);
  } catch (const ringzero::invalid_argument& e) {
    message = e.what();  // thrown on this rank, before anything was sent
  } catch (const ringzero::error& e) {
    // Any other failure; e.code() tells a timeout from a dead peer from a network error.
    fmt::print(stderr, "{} ({})\n", e.what(), ringzero::errc_name(e.code()));
    throw;
  }
  // docs-end: errors
  expect(message == "ringzero: all_reduce: input has 10 elements but output has 11",
         "invalid_argument for mismatched sizes, got '" + message + "'");
}

}  // namespace

int main() {
  try {
    ringzero::log::set_level(ringzero::log::level::none);
    // docs-begin: loopback
    ringzero::loopback::world world(4);  // four ranks, run as four threads of this process
    world.run([](ringzero::loopback::communicator& comm) {
      all_reduce_example(comm);  // every rank calls every collective, in the same order
      shard_example(comm);
      rooted_example(comm);
      point_to_point_example(comm);
      options_example(comm);
      types_example(comm);
      split_example(comm);
      errors_example(comm);
    });
    // docs-end: loopback
    fmt::print("api_tour: every example gave the expected result\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
