// Sub-communicators of the loopback transport and the hierarchical all_reduce built on them.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "conformance_matrix.hpp"
#include "ringzero/ringzero.hpp"

using ringzero::op;
namespace loopback = ringzero::loopback;

TEST_CASE("split groups ranks by color and orders them by key") {
  loopback::world w(6);
  std::mutex m;
  std::vector<std::string> errors;
  w.run([&](loopback::communicator& comm) {
    const int r = comm.rank();
    // Keys reverse the order inside each color.
    auto sub = comm.split(r % 2, -r);
    REQUIRE(sub.has_value());
    std::vector<int> expect;
    for (int x = 5; x >= 0; --x)
      if (x % 2 == r % 2) expect.push_back(x);
    const auto pos = std::find(expect.begin(), expect.end(), r) - expect.begin();
    std::lock_guard lock(m);
    CHECK_MESSAGE(sub->size() == 3, "rank ", r, " expected a 3-rank sub-communicator");
    CHECK_MESSAGE(sub->members() == expect, "rank ", r, " expected world members in key order");
    CHECK_MESSAGE(sub->rank() == pos, "rank ", r, " expected sub rank ", pos);
    CHECK_MESSAGE(sub->comm_id() != 0, "a sub-communicator must not reuse the world's id 0");
  });
}

TEST_CASE("a negative color leaves a rank out") {
  loopback::world w(4);
  w.run([&](loopback::communicator& comm) {
    auto sub = comm.split(comm.rank() == 2 ? -1 : 7, 0);
    if (comm.rank() == 2) {
      CHECK_FALSE(sub.has_value());
      return;
    }
    REQUIRE(sub.has_value());
    CHECK(sub->size() == 3);
    std::vector<int> v{comm.rank()};
    ringzero::all_reduce(*sub, std::span<int>(v), op::sum);
    CHECK_MESSAGE(v[0] == 0 + 1 + 3, "the sum over world ranks 0, 1 and 3");
  });
}

TEST_CASE("collectives on a sub-communicator and its parent interleave without mixing") {
  loopback::world w(4);
  w.run([&](loopback::communicator& comm) {
    const int r = comm.rank();
    auto sub = comm.split(r / 2, r);
    REQUIRE(sub.has_value());
    std::vector<double> world_v(1000, r + 1.0), sub_v(1000, 10.0 * (r + 1));
    // Group 0 runs its own collective first, group 1 the world's: their messages cross.
    if (r / 2 == 0) {
      ringzero::all_reduce(*sub, std::span<double>(sub_v), op::sum);
      ringzero::all_reduce(comm, std::span<double>(world_v), op::sum);
    } else {
      ringzero::all_reduce(comm, std::span<double>(world_v), op::sum);
      ringzero::all_reduce(*sub, std::span<double>(sub_v), op::sum);
    }
    const double sub_expect = r / 2 == 0 ? 10.0 + 20.0 : 30.0 + 40.0;
    CHECK_MESSAGE(world_v[999] == 10.0, "world sum 1+2+3+4");
    CHECK_MESSAGE(sub_v[0] == sub_expect, "rank ", r, " sub-communicator sum");
  });
}

TEST_CASE("ids are reused once every member destroyed the communicator holding them") {
  loopback::world w(4);
  w.run([&](loopback::communicator& comm) {
    std::uint32_t first = 0;
    {
      auto a = comm.split(0, comm.rank());
      auto b = comm.split(comm.rank() % 2, comm.rank());
      first = a->comm_id();
      CHECK_MESSAGE(b->comm_id() != a->comm_id(),
                    "live communicators sharing ranks need ids "
                    "of their own");
      // Disjoint groups of one split may share an id: they never exchange messages.
      auto pair = comm.split(comm.rank() / 2, 0);
      std::vector<std::uint32_t> ids{pair->comm_id()};
      std::vector<std::uint32_t> all(4);
      ringzero::all_gather(comm, std::span<const std::uint32_t>(ids),
                           std::span<std::uint32_t>(all));
      CHECK(all[0] == all[2]);
    }
    auto again = comm.split(0, comm.rank());
    CHECK_MESSAGE(again->comm_id() == first, "the lowest free id is taken again");
  });
}

TEST_CASE("topology of a world and of its sub-communicators") {
  loopback::world w(6, {.ranks_per_node = 2});
  std::mutex m;
  w.run([&](loopback::communicator& comm) {
    const int r = comm.rank();
    const auto t = comm.topo();
    // Odd world ranks: 1, 3, 5, one on each node.
    auto odd = comm.split(r % 2, r);
    const auto st = odd->topo();
    std::lock_guard lock(m);
    CHECK(t.node == r / 2);
    CHECK(t.local_rank == r % 2);
    CHECK(t.local_size == 2);
    CHECK(t.node_count == 3);
    CHECK(st.node_count == 3);
    CHECK(st.local_size == 1);
    CHECK(st.node == r / 2);
  });
}

namespace {

void check_hierarchical(int ranks, int per_node) {
  // The levels are the public collectives, which their own tests cover for every type; here
  // one integer, one float and one 16-bit type cover the decomposition, padding and avg.
  using split_types = conformance::types<std::int8_t, float, ringzero::bfloat16>;
  std::vector<conformance::test_case> cases;
  for (auto& tc : conformance::matrix(ranks, true, split_types::dtypes))
    if (tc.coll == ringzero::collective::all_reduce && tc.algo == ringzero::algorithm::hierarchical)
      cases.push_back(tc);
  loopback::world w(ranks, {.ranks_per_node = per_node});
  std::mutex m;
  std::vector<std::string> failures;
  w.run([&](loopback::communicator& comm) {
    auto f = conformance::run_all<split_types>(comm, cases);
    std::lock_guard lock(m);
    failures.insert(failures.end(), f.begin(), f.end());
  });
  for (const auto& f : failures) FAIL_CHECK(f);
  CHECK(failures.empty());
}

}  // namespace

TEST_CASE("hierarchical all_reduce, 2 nodes x 2 ranks") {
  check_hierarchical(4, 2);
}
TEST_CASE("hierarchical all_reduce, 2 nodes x 3 ranks") {
  check_hierarchical(6, 3);
}
TEST_CASE("hierarchical all_reduce, unequal nodes 2 + 2 + 1") {
  check_hierarchical(5, 2);
}
TEST_CASE("hierarchical all_reduce, one rank per node") {
  check_hierarchical(3, 1);
}

TEST_CASE("hierarchical all_reduce builds its sub-communicators once") {
  loopback::world w(4, {.ranks_per_node = 2});
  w.run([&](loopback::communicator& comm) {
    std::vector<float> v(100, 1.0f);
    ringzero::all_reduce(comm, std::span<float>(v), op::sum,
                         {.algorithm = ringzero::algorithm::hierarchical});
    const void* cached = static_cast<const void*>(comm.hierarchy());
    REQUIRE(cached != nullptr);
    ringzero::all_reduce(comm, std::span<float>(v), op::sum,
                         {.algorithm = ringzero::algorithm::hierarchical});
    CHECK(static_cast<const void*>(comm.hierarchy()) == cached);
    CHECK(v[0] == 16.0f);
  });
}

TEST_CASE("the cost model considers hierarchical only where it can decompose") {
  namespace tuning = ringzero::tuning;
  const ringzero::tuning::policy p{};
  const auto ar = ringzero::collective::all_reduce;
  const auto hier = ringzero::algorithm::hierarchical;
  for (double bytes : {8.0, 1e6, 1e9}) {
    CHECK(tuning::select(ar, bytes, 8, p, ringzero::topology{.node_count = 1}) != hier);
    CHECK(tuning::select(ar, bytes, 8, p, ringzero::topology{.node_count = 8}) != hier);
  }
  // Non-power-of-two ranks on two nodes of three: the flat butterflies pay for folding.
  CHECK(std::isfinite(tuning::predict_hierarchical(1e9, 6, 2, p)));
  CHECK(tuning::predict_hierarchical(1e9, 6, 2, p) <=
        tuning::predict(ar, ringzero::algorithm::ring, 1e9, 6, p));
  // Unequal nodes (5 ranks on 2) are costed, not refused.
  CHECK(std::isfinite(tuning::predict_hierarchical(1e6, 5, 2, p)));
}
