#include <doctest/doctest.h>

#include <ringzero/transport/loopback.hpp>
#include <ringzero/zero/parameter_cache.hpp>

#include <vector>

namespace zero = ringzero::zero;
using ringzero::loopback::communicator;

namespace {

// Six layers of 16 floats: with 64-byte buckets, one bucket each.
const zero::model_layout& layout() {
  static const zero::model_layout l = [] {
    zero::model_layout m;
    for (int i = 0; i < 6; ++i) {
      m.add_layer("layer" + std::to_string(i));
      m.add({.name = "w" + std::to_string(i), .shape = {16}});
    }
    return m;
  }();
  return l;
}

/// Value of flat element `flat` (the full model is this on every rank).
float value(std::size_t flat, int version) {
  return static_cast<float>(flat) + 1000.0f * version;
}

/// Fills a rank's shard with the version `version` of the model.
void fill(const zero::partition_plan& plan, int rank, std::vector<float>& shard, int version) {
  for (const auto& b : plan.buckets())
    for (std::size_t k = 0; k < b.slice; ++k)
      shard[b.shard_offset + k] =
          value(b.offset + static_cast<std::size_t>(rank) * b.slice + k, version);
}

template <class F>
void with_cache(int world, std::size_t max_buckets, F f) {
  ringzero::loopback::world w(world);
  w.run([&](communicator& comm) {
    const zero::partition_plan plan(layout(), world, 16, 4);
    std::vector<float> shard(plan.shard_size());
    fill(plan, comm.rank(), shard, 0);
    zero::detail::buffer_meter meter;
    zero::detail::worker work(true);
    zero::parameter_cache<communicator, float> cache(
        comm, plan, std::span<const float>(shard), {.algorithm = ringzero::algorithm::ring},
        max_buckets * plan.max_bucket() * sizeof(float), work, meter);
    f(comm, plan, shard, cache, meter);
    // Prefetches may still be running into the cache's buffers; the sharder destroys its worker
    // first for this reason.
    work.drain();
  });
}

}  // namespace

TEST_CASE("a gathered bucket holds the full parameters") {
  with_cache(
      2, 2,
      [](communicator&, const zero::partition_plan& plan, std::vector<float>&, auto& cache, auto&) {
        REQUIRE(plan.buckets().size() == 6);
        for (int b = 0; b < 6; ++b) {
          const float* p = cache.acquire(b, zero::pass::forward);
          const auto& bk = plan.buckets()[static_cast<std::size_t>(b)];
          for (std::size_t k = 0; k < bk.padded; ++k) CHECK(p[k] == value(bk.offset + k, 0));
          cache.release(b);
        }
      });
}

TEST_CASE("forward prefetches ahead within the bound and frees what lies behind") {
  with_cache(2, 3,
             [](communicator&, const zero::partition_plan&, std::vector<float>&, auto& cache,
                auto& meter) {
               (void)cache.acquire(0, zero::pass::forward);
               cache.release(0);
               CHECK(cache.resident(1));
               CHECK(cache.resident(2));
               CHECK_FALSE(cache.resident(3));  // the bound: 3 buckets
               (void)cache.acquire(2, zero::pass::forward);
               cache.release(2);
               CHECK_FALSE(cache.resident(0));
               CHECK_FALSE(cache.resident(1));
               CHECK(cache.resident(3));
               CHECK(cache.resident(4));
               CHECK(cache.bytes() <= cache.max_bytes());
               CHECK(meter.peak <= cache.max_bytes());
             });
}

TEST_CASE("a recompute pass keeps what backward prefetched") {
  with_cache(
      2, 3,
      [](communicator&, const zero::partition_plan&, std::vector<float>&, auto& cache, auto&) {
        // Backward at layer 5 prefetches 4 and 3; recomputing layers 3-4 must not free them.
        (void)cache.acquire(5, zero::pass::backward);
        CHECK(cache.resident(4));
        CHECK(cache.resident(3));
        (void)cache.acquire(3, zero::pass::recompute);
        (void)cache.acquire(4, zero::pass::recompute);
        CHECK(cache.resident(3));
        CHECK(cache.resident(4));
        CHECK(cache.resident(5));
        cache.release(3);
        cache.release(4);
        // A plain forward pass from 3 would have freed 2's neighbour 5? No: only buckets behind it.
        (void)cache.acquire(4, zero::pass::backward);
        CHECK(cache.resident(3));
        cache.release(4);
        cache.release(5);
      });
}

TEST_CASE("refresh regathers held buckets in place and frees the rest") {
  with_cache(3, 2,
             [](communicator& comm, const zero::partition_plan& plan, std::vector<float>& shard,
                auto& cache, auto&) {
               const float* held = cache.acquire(1, zero::pass::forward);
               CHECK(cache.resident(2));  // prefetched, unheld
               cache.settle();            // the prefetch of 2 may still be reading the shard
               fill(plan, comm.rank(), shard, 1);  // the optimizer updated the shard
               cache.refresh();
               CHECK_FALSE(cache.resident(2));
               CHECK(cache.resident(1));
               const auto& bk = plan.buckets()[1];
               for (std::size_t k = 0; k < bk.padded; ++k)
                 CHECK(held[k] == value(bk.offset + k, 1));
               CHECK(cache.references(1) == 1);
               cache.release(1);
               CHECK_FALSE(cache.any_held());
               cache.evict_unreferenced();
               CHECK(cache.bytes() == 0);
             });
}

TEST_CASE("a gathered_parameters handle holds its bucket while it lives and moves with it") {
  using handle = zero::gathered_parameters<communicator, float>;
  with_cache(
      2, 6,
      [](communicator&, const zero::partition_plan& plan, std::vector<float>&, auto& cache, auto&) {
        auto hold = [&](int b) {
          const float* base = cache.acquire(b, zero::pass::recompute);
          return handle(plan, &cache, b, base, plan.buckets()[static_cast<std::size_t>(b)].offset);
        };
        {
          handle h = hold(1);
          CHECK(cache.references(1) == 1);
          const auto w1 = h.param(1);
          REQUIRE(w1.size() == 16);
          for (std::size_t k = 0; k < w1.size(); ++k)
            CHECK(w1[k] == value(plan.params()[1].offset + k, 0));
          CHECK_THROWS_WITH_AS((void)h.param(0),
                               "ringzero: gathered::param: w0 lives in bucket 0, this handle "
                               "holds bucket 1",
                               ringzero::invalid_argument);
          CHECK_THROWS_WITH_AS((void)h.param(6), "ringzero: gathered::param: parameter id 6 of 6",
                               ringzero::invalid_argument);
          handle moved = std::move(h);
          CHECK(cache.references(1) == 1);
          CHECK_THROWS_WITH_AS((void)h.param(1), "ringzero: gathered::param on a released handle",
                               ringzero::invalid_argument);
          handle other = hold(2);
          other = std::move(moved);  // gives bucket 2 back, takes over bucket 1
          CHECK(cache.references(2) == 0);
          CHECK(cache.references(1) == 1);
        }
        CHECK_FALSE(cache.any_held());
        // Without a bucket (stages 0-2), a handle views the flat parameters and holds nothing.
        std::vector<float> flat(plan.padded_size());
        for (std::size_t i = 0; i < flat.size(); ++i) flat[i] = value(i, 0);
        const handle whole(plan, nullptr, -1, flat.data(), 0);
        CHECK(whole.param(4).data() == flat.data() + plan.params()[4].offset);
        CHECK_FALSE(cache.any_held());
      });
}

TEST_CASE("recomputing earlier layers inside backward keeps the bucket backward needs next") {
  // Backward at layer 5 has room for one more bucket and prefetches 4; recomputing the forward
  // of layers 0-3 (an activation checkpoint segment) must leave 4 in place, past the bound.
  for (const auto again : {zero::pass::recompute, zero::pass::backward}) {
    CAPTURE(static_cast<int>(again));
    with_cache(2, 2,
               [again](communicator&, const zero::partition_plan&, std::vector<float>&, auto& cache,
                       auto&) {
                 (void)cache.acquire(5, zero::pass::backward);
                 REQUIRE(cache.resident(4));
                 (void)cache.acquire(0, again);
                 cache.release(0);
                 // The same pass as backward frees every unheld bucket above the one it gathers.
                 CHECK(cache.resident(4) == (again == zero::pass::recompute));
                 CHECK(cache.resident(5));
                 cache.release(5);
               });
  }
}

TEST_CASE("a layer's shared buckets are acquired with it, once, and held by its handle") {
  using handle = zero::gathered_parameters<communicator, float>;
  with_cache(
      2, 2,
      [](communicator&, const zero::partition_plan& plan, std::vector<float>&, auto& cache, auto&) {
        const std::vector<int> with{0};
        {
          // Forward at 5 would free 0 (behind it); as a shared bucket it is kept and gathered.
          const float* base = cache.acquire(5, zero::pass::forward, with);
          const handle h(plan, &cache, 5, base, plan.buckets()[5].offset, with);
          CHECK(cache.references(0) == 1);
          CHECK(cache.references(5) == 1);
          const auto w0 = h.param(0);
          for (std::size_t k = 0; k < w0.size(); ++k)
            CHECK(w0[k] == value(plan.params()[0].offset + k, 0));
          CHECK_THROWS_AS((void)h.param(3), ringzero::invalid_argument);
        }
        CHECK_FALSE(cache.any_held());
        CHECK(cache.resident(0));
      });
}

TEST_CASE("a shared bucket still present is not gathered again") {
  with_cache(
      2, 6,
      [](communicator& comm, const zero::partition_plan&, std::vector<float>&, auto& cache, auto&) {
        // Collectives a call issued, counted on the communicator once they are done.
        const auto issued = [&](auto&& call) {
          cache.settle();
          const auto before = comm.state().collective_seq;
          call();
          cache.settle();
          return comm.state().collective_seq - before;
        };
        const auto one = issued([&] { (void)cache.acquire(4, zero::pass::recompute); });
        REQUIRE(one > 0);
        const std::vector<int> absent{1}, present{4};
        CHECK(issued([&] { (void)cache.acquire(3, zero::pass::recompute, absent); }) == 2 * one);
        CHECK(issued([&] { (void)cache.acquire(5, zero::pass::recompute, present); }) == one);
        CHECK(cache.references(4) == 2);
        for (int b : {1, 3, 4, 4, 5}) cache.release(b);
        CHECK_FALSE(cache.any_held());
      });
}
