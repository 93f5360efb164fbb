// The sharder over the native shm transport, ranks as processes: its parameters and gradients
// are symmetric memory (the transport's all_reduce reads the peers' buffers in place), and it
// trains to the same bits as with host memory in every stage; split communicators fall back to
// host memory.
#include <doctest/doctest.h>

#include <ringzero/transport/loopback.hpp>
#include <ringzero/transport/shm.hpp>

#include "multiprocess.hpp"
#include "zero_harness.hpp"

#include <fmt/core.h>

#include <chrono>
#include <string>
#include <type_traits>
#include <vector>

using namespace std::chrono_literals;
using ringzero::bfloat16;
namespace shm = ringzero::shm;
namespace zero = ringzero::zero;

// The communicator chooses: symmetric memory where it can allocate it, host memory elsewhere.
static_assert(std::is_same_v<zero::memory_space_t<shm::communicator>,
                             zero::symmetric_space<shm::communicator>>);
static_assert(
    std::is_same_v<zero::memory_space_t<ringzero::loopback::communicator>, zero::host_space>);
static_assert(zero::memory_space<zero::host_space> &&
              zero::memory_space<zero::symmetric_space<shm::communicator>>);
static_assert(zero::host_accessible<zero::symmetric_space<shm::communicator>>);

namespace {

// As the loopback sharder tests' model: several buckets, one parameter larger than a bucket.
template <class P>
zero::model_layout small_model() {
  return zt::make_layout<P>({{37, 5}, {129}, {3, 61, 1}, {300}});
}

/// Whether the sharder's parameters (stages 0-2, where they are addressable) lie in memory the
/// transport maps for every rank: the communicator's own view, not the sharder's.
template <class Shd>
bool parameters_in_segment(shm::communicator& comm, Shd& shd) {
  if (shd.stage() == 3) return true;
  const auto p = shd.parameter(0);
  for (int q = 0; q < comm.size(); ++q)
    if (comm.transport().peer_address(p.data(), q) == nullptr ||
        comm.transport().peer_address(p.data() + p.size() - 1, q) == nullptr)
      return false;
  return true;
}

/// Trains stages 0-3 with host and with symmetric buffers on `comm`; every weight of every run
/// must equal stage 0's on host memory, bit for bit.
template <class P>
void check_stages(shm::communicator& comm, multiprocess::rank_checks& chk, const char* type,
                  int shard_group) {
  const auto layout = small_model<P>();
  zt::run_options o;
  o.world = comm.size();
  o.steps = 2;
  o.clip = 1.0f;
  o.configure = [shard_group](zero::config& c) { c.shard_group_size = shard_group; };
  const auto r = static_cast<std::size_t>(comm.rank());
  const bool hybrid = shard_group != 0 && shard_group != comm.size();
  std::vector<float> reference;
  for (int stage = 0; stage <= 3; ++stage) {
    o.stage = stage;
    const std::string what =
        fmt::format("{}, stage {}, {} ranks{}", type, stage, comm.size(), hybrid ? ", hybrid" : "");
    zt::run_result host;
    host.params.resize(r + 1);
    host.memory.resize(r + 1);
    host.held.resize(r + 1);
    zt::run_result sym = host;
    zt::train_rank<zero::sharder<shm::communicator, P, zero::host_space>>(
        comm, layout, o, host,
        [&](auto& shd) { chk.expect(!shd.symmetric_buffers(), what + ": host_space is host"); });
    zt::train_rank<zero::sharder<shm::communicator, P>>(comm, layout, o, sym, [&](auto& shd) {
      // The transport runs the collectives left at the ring on the world, not on a split group.
      const auto expected = hybrid ? ringzero::algorithm::ring : ringzero::algorithm::automatic;
      const auto& c = shd.configuration().collectives;
      chk.expect(c.all_reduce.algorithm == expected && c.reduce_scatter.algorithm == expected &&
                     c.all_gather.algorithm == expected,
                 what + ": collectives left at the ring go to the transport on the world only");
      if (hybrid) {
        chk.expect(!shd.symmetric_buffers(),
                   what + ": buffers of a split shard group in host memory");
      } else {
        chk.expect(shd.symmetric_buffers(), what + ": symmetric buffers by default");
        chk.expect(parameters_in_segment(comm, shd),
                   what + ": the transport maps the parameters for every rank");
      }
    });
    if (stage == 0) reference = host.params[r];
    chk.expect(!reference.empty() && host.params[r] == reference,
               what + ": host memory, weights bitwise those of stage 0");
    chk.expect(sym.params[r] == reference,
               what + fmt::format(": symmetric memory, weights bitwise those of host memory "
                                  "stage 0 (max rel diff {})",
                                  zt::max_rel_diff(sym.params[r], reference)));
    chk.expect(sym.memory[r].buffers == host.memory[r].buffers &&
                   sym.memory[r].gradients == host.memory[r].gradients &&
                   sym.memory[r].parameters == host.memory[r].parameters,
               what + ": the memory report counts symmetric buffers as host ones");
  }
}

void run_ranks(int n, shm::segment_options tune, int shard_group) {
  auto out = multiprocess::run(n, 240s, [&](int r, int size, ringzero::bootstrap::store& s) {
    shm::communicator comm(shm::transport(s, r, size, {.segment = tune}));
    multiprocess::rank_checks chk{r};
    check_stages<float>(comm, chk, "fp32", shard_group);
    check_stages<bfloat16>(comm, chk, "bf16", shard_group);
    return chk.code();
  });
  multiprocess::require_all_passed(out);
}

}  // namespace

TEST_CASE("shm: symmetric buffers train bitwise as host memory, stages 0-3, 2 ranks") {
  // Small segment and streaming thresholds: the buckets above them go over messages (host
  // buffers) or stream their outputs (symmetric ones), as large buckets of a real model do.
  run_ranks(2, {.segment_bytes = 256, .all_reduce_segment_bytes = 256, .streaming_bytes = 64}, 0);
}

TEST_CASE("shm: symmetric buffers train bitwise as host memory, stages 0-3, 3 ranks") {
  // Every bucket within the segment size: every path sums in rank order (see docs/zero.md for
  // larger buckets on 3 or more ranks).
  run_ranks(3, {}, 0);
}

TEST_CASE("shm: a split shard group keeps its buffers in host memory") {
  run_ranks(2, {}, 1);
}
