// options::reproducible over loopback: all_reduce, reduce_scatter and reduce of the four
// floating types, sum and avg, every algorithm that implements each (hierarchical with 2 and 3
// ranks per node too), world sizes 1..9, the conformance counts, in place and out of place with
// chunks in flight. Every element must equal one bit pattern: the exact sum of its terms
// rounded once (reproducible::serial_sum), whatever the algorithm, the world size or which rank
// holds which term. The inputs are chosen so that ordinary summation depends on the order:
// terms of 2^+-40 with cancelling pairs, plus infinities and NaN in one case per world.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "conformance.hpp"
#include "fake_device.hpp"
#include "fake_fabric.hpp"
#include "ringzero/detail/reproducible_combine.hpp"
#include "ringzero/reduce/reproducible.hpp"

namespace {

using namespace conformance;
namespace rp = ringzero::reproducible;

/// Rank r's term for element i: the same for a given (seed, r, i) in every world.
template <class E>
E term(std::uint64_t seed, int r, std::size_t i) {
  // Element i's terms on ranks 2k and 2k+1 cancel in their top bits.
  if ((i % 3) == 0 && (r % 2) == 1) {
    const double v = -static_cast<double>(term<E>(seed, r - 1, i)) * 1.0000001;
    if constexpr (std::is_same_v<E, float16> || std::is_same_v<E, bfloat16>)
      return E(static_cast<float>(v));
    else
      return static_cast<E>(v);
  }
  const std::uint64_t h = testing::mix(seed ^ (static_cast<std::uint64_t>(r) << 40) ^ i);
  // float16 has 5 exponent bits: keep its terms within its range.
  const int span = std::is_same_v<E, float16> ? 10 : 40;
  const int e = static_cast<int>((h >> 24) % static_cast<std::uint64_t>(2 * span + 1)) - span;
  const double m = 1.0 + static_cast<double>(h & 0xfffff) / (1u << 20);
  // m * 2^e, exactly: the power of two built from its bits (std::ldexp took a tenth of this
  // test's CPU).
  const double two_e = std::bit_cast<double>(static_cast<std::uint64_t>(1023 + e) << 52);
  const double v = m * two_e * (((h >> 60) & 1) ? -1.0 : 1.0);
  if constexpr (std::is_same_v<E, float16> || std::is_same_v<E, bfloat16>)
    return E(static_cast<float>(v));
  else
    return static_cast<E>(v);
}

template <class E>
E special_term(std::uint64_t seed, int r, std::size_t i) {
  // A few infinities and a NaN in among ordinary terms.
  const float inf = std::numeric_limits<float>::infinity();
  if (i % 17 == 3 && r == 0) return E(inf);
  if (i % 17 == 3 && r == 1) return E(-inf);  // +inf + -inf: NaN
  if (i % 19 == 5 && r % 2 == 0) return E(-inf);
  if (i % 23 == 7 && r == 0) return E(std::numeric_limits<float>::quiet_NaN());
  return term<E>(seed, r, i);
}

template <class E>
bool same_bits(E a, E b) {
  return rp::bits_of(a) == rp::bits_of(b);
}

template <class E, class Term>
E want(int n, std::size_t i, op o, Term&& t) {
  E terms[max_world];  // on the stack: one allocation per element was a twentieth of the CPU
  for (int j = 0; j < n; ++j) terms[j] = t(j, i);
  return rp::serial_sum(terms, static_cast<std::size_t>(n),
                        o == op::avg ? static_cast<std::uint32_t>(n) : 1);
}

template <class E>
void check(world_log& log, const std::string& name, int rank, std::span<const E> out,
           std::size_t base, auto&& want_of) {
  log.checked();
  for (std::size_t i = 0; i < out.size(); ++i) {
    const E w = want_of(base + i);
    if (!same_bits(w, out[i])) {
      log.fail(fmt::format("{}: rank {} element {}: expected {}, got {}", name, rank, base + i,
                           testing::show(w), testing::show(out[i])));
      return;
    }
  }
}

template <class E>
void matrix(loopback::communicator& comm, world_log& log, std::string_view world, bool hier) {
  const int n = comm.size();
  const int r = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  for (op o : {op::sum, op::avg}) {
    for (std::size_t count : counts_for(n)) {
      for (bool special : {false, true}) {
        if (special && count != 1009) continue;
        const std::uint64_t seed = seed_of(dtype_of<E>(), o, count, special);
        auto t = [&](int j, std::size_t i) {
          return special ? special_term<E>(seed, j, i) : term<E>(seed, j, i);
        };
        // The expected bits of the elements this rank checks, once per case: its slice of the
        // all_reduce (all of it on the reduce's root) and its reduce_scatter block.
        const int root = n - 1;
        const auto [lo, hi] =
            r == root ? std::pair<std::size_t, std::size_t>{0, count} : slice(count, r, n);
        const std::size_t rs = static_cast<std::size_t>(r) * count;
        std::vector<E> expected(un * count);
        for (std::size_t i = lo; i < hi; ++i) expected[i] = want<E>(n, i, o, t);
        for (std::size_t i = rs; i < rs + count; ++i)
          if (i < lo || i >= hi) expected[i] = want<E>(n, i, o, t);
        auto expect = [&](std::size_t i) { return expected[i]; };
        // This rank's terms, once per case: every algorithm below starts from a copy.
        std::vector<E> mine(un * count);
        for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = t(r, i);
        const auto terms = [&](std::size_t n_terms) {
          return std::vector<E>(mine.begin(), mine.begin() + static_cast<std::ptrdiff_t>(n_terms));
        };
        for (bool in_place : {false, true}) {
          const auto variant =
              fmt::format("{} {} count {} {}{}", dtype_name(dtype_of<E>()), op_name(o), count,
                          in_place ? "in place" : "out of place", special ? " with inf/NaN" : "");
          // all_reduce
          const std::vector<algorithm> ar =
              hier ? std::vector<algorithm>{algorithm::hierarchical, algorithm::automatic}
                   : std::vector<algorithm>{
                         algorithm::ring, algorithm::tree, algorithm::recursive_doubling,
                         algorithm::recursive_halving_doubling, algorithm::automatic};
          for (algorithm a : ar) {
            const std::string name =
                fmt::format("{}: all_reduce {} {}", world, algorithm_name(a), variant);
            options opt = options_for<E>(a, in_place, count, n);
            opt.reproducible = true;
            std::vector<E> in = terms(count), out(count);
            poison(std::span<E>(out), 0xa5);
            if (in_place)
              all_reduce(comm, std::span<E>(in), o, opt);
            else
              all_reduce(comm, std::span<const E>(in), std::span<E>(out), o, opt);
            const std::span<const E> res =
                in_place ? std::span<const E>(in) : std::span<const E>(out);
            const auto [from, to] = slice(count, r, n);
            check(log, name, r, res.subspan(from, to - from), from, expect);
            log.record(r, name, digest_of(res));
          }
          if (hier) continue;  // reduce_scatter and reduce have no hierarchical algorithm
          // reduce_scatter: `count` is each rank's block
          for (algorithm a :
               {algorithm::ring, algorithm::recursive_halving_doubling, algorithm::automatic}) {
            const std::string name =
                fmt::format("{}: reduce_scatter {} {}", world, algorithm_name(a), variant);
            options opt = options_for<E>(a, in_place, un * count, n);
            opt.reproducible = true;
            std::vector<E> in = terms(un * count), out(count);
            const std::size_t base = static_cast<std::size_t>(r) * count;
            std::span<E> res = in_place ? std::span<E>(in).subspan(base, count) : std::span<E>(out);
            reduce_scatter(comm, std::span<const E>(in), res, o, opt);
            check(log, name, r, std::span<const E>(res), base, expect);
          }
          // reduce, to the last rank
          for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::automatic}) {
            const std::string name =
                fmt::format("{}: reduce {} {}", world, algorithm_name(a), variant);
            options opt = options_for<E>(a, in_place, count, n);
            opt.reproducible = true;
            std::vector<E> in = terms(count), out(r == root ? count : 0);
            if (in_place)
              reduce(comm, std::span<E>(in), o, root, opt);
            else
              reduce(comm, std::span<const E>(in), std::span<E>(out), o, root, opt);
            if (r == root) check(log, name, r, std::span<const E>(in_place ? in : out), 0, expect);
          }
        }
      }
    }
  }
}

void run(int n, int per_node) {
  const std::string world =
      per_node ? fmt::format("{} ranks, {} per node", n, per_node) : fmt::format("{} ranks", n);
  run_world(n, world_options_for(per_node), world,
            [&](loopback::communicator& comm, world_log& log) {
              matrix<float>(comm, log, world, per_node != 0);
              matrix<double>(comm, log, world, per_node != 0);
              // One type of each size under the sanitizers (conformance.hpp says why).
              if (!one_type_per_size()) matrix<bfloat16>(comm, log, world, per_node != 0);
              matrix<float16>(comm, log, world, per_node != 0);
            });
}

}  // namespace

TEST_CASE("reproducible sums: every algorithm, 1..9 ranks, one bit pattern") {
  for (int n = 1; n <= max_world; ++n) run(n, 0);
}

TEST_CASE("reproducible sums: hierarchical all_reduce, 2 and 3 ranks per node") {
  for (int per : {2, 3})
    for (int n = per; n <= max_world; n += per) run(n, per);
}

TEST_CASE("reproducible sums: refused with prod, ignored where nothing is added") {
  loopback::world w(2);
  w.run([](loopback::communicator& comm) {
    std::vector<float> v(4, 1.5f);
    options opt;
    opt.reproducible = true;
    CHECK_THROWS_AS(all_reduce(comm, std::span<float>(v), op::prod, opt), invalid_argument);
    // min, max and integer sums are exact already: the option changes nothing.
    all_reduce(comm, std::span<float>(v), op::max, opt);
    CHECK(v[0] == 1.5f);
    std::vector<std::int32_t> iv(3, comm.rank() + 1);
    all_reduce(comm, std::span<std::int32_t>(iv), op::sum, opt);
    CHECK(iv[2] == 3);
  });
}

TEST_CASE("reproducible sums: the same bits whichever rank holds which term") {
  // One term per rank, in every rotation of the terms over 6 ranks: the bits never change.
  constexpr int n = 6;
  constexpr std::size_t count = 4099;
  std::vector<std::vector<float>> results;
  std::mutex m;
  for (int rot = 0; rot < n; ++rot) {
    loopback::world w(n);
    w.run([&](loopback::communicator& comm) {
      std::vector<float> v(count);
      for (std::size_t i = 0; i < count; ++i) v[i] = term<float>(99, (comm.rank() + rot) % n, i);
      options opt;
      opt.reproducible = true;
      all_reduce(comm, std::span<float>(v), op::sum, opt);
      if (comm.rank() == 0) {
        std::lock_guard lock(m);
        results.push_back(v);
      }
    });
  }
  REQUIRE(results.size() == static_cast<std::size_t>(n));
  for (const auto& r : results) CHECK(std::memcmp(r.data(), results[0].data(), count * 4) == 0);
  // And plain float sums do depend on the placement here (the test would prove nothing else).
  std::vector<float> plain_a(count, 0.0f), plain_b(count, 0.0f);
  for (int j = 0; j < n; ++j)
    for (std::size_t i = 0; i < count; ++i) {
      plain_a[i] += term<float>(99, j, i);
      plain_b[i] += term<float>(99, n - 1 - j, i);
    }
  CHECK(std::memcmp(plain_a.data(), plain_b.data(), count * 4) != 0);
}

TEST_CASE("accumulated micro-batches: one bit pattern on 1, 2, 3, 4, 6 and 12 ranks") {
  // 12 micro-batches of `count` terms; rank r of n takes micro-batches [12r/n, 12(r+1)/n), adds
  // each into its accumulator, and the ranks combine them, as all_reduce and as
  // reduce_scatter. Every world size must give the serial exact sum of all 12, rounded once.
  constexpr int batches = 12;
  constexpr std::size_t count = 12 * 67;  // divisible by every world size here
  auto batch_term = [](int b, std::size_t i) { return term<float>(1234, b, i); };
  std::vector<float> want(count);
  for (std::size_t i = 0; i < count; ++i) {
    std::vector<float> t;
    for (int b = 0; b < batches; ++b) t.push_back(batch_term(b, i));
    want[i] = rp::serial_sum(t.data(), t.size());
  }
  for (int n : {1, 2, 3, 4, 6, 12}) {
    std::mutex m;
    int wrong = 0;
    loopback::world w(n);
    w.run([&](loopback::communicator& comm) {
      const int r = comm.rank();
      rp::accumulator<float> acc(count);
      std::vector<float> g(count);
      for (int b = batches * r / n; b < batches * (r + 1) / n; ++b) {
        for (std::size_t i = 0; i < count; ++i) g[i] = batch_term(b, i);
        acc.add(std::span<const float>(g));
      }
      std::vector<float> all(count), mine(count / static_cast<std::size_t>(n));
      ringzero::detail::combine_accumulators(comm, acc, std::span<float>(all), 1, options{});
      ringzero::detail::combine_accumulators(comm, acc, std::span<float>(mine), 1, options{});
      int bad = std::memcmp(all.data(), want.data(), count * 4) != 0;
      bad += std::memcmp(mine.data(), want.data() + static_cast<std::size_t>(r) * mine.size(),
                         mine.size() * 4) != 0;
      std::lock_guard lock(m);
      wrong += bad;
    });
    CHECK_MESSAGE(wrong == 0, n << " ranks");
  }
}

TEST_CASE("reproducible sums on device buffers: the kernels' passes give the host's bits") {
  // The device path (detail/reproducible_device.hpp) with a host stand-in for the CUDA runtime
  // whose streams run work late (fake_device.hpp), over a transport that moves device memory
  // (fake_fabric.hpp: its collectives are ringzero's schedules with the stand-in's kernels): a
  // pass read before it was waited for reads stale data. Every collective, both ops, with
  // inf/NaN, against the host path's bits.
  const fake_device::installed fake;
  const auto& rt = fake_device::runtime;
  const auto& k = fake_device::reproducible;
  for (int n : {1, 2, 3, 5}) {
    std::mutex m;
    std::vector<std::string> failures;
    loopback::world w(n);
    w.run([&](loopback::communicator& plain) {
      auto comm = fake_device::fabric_of(plain);
      const int r = comm.rank();
      const auto un = static_cast<std::size_t>(n);
      auto fail = [&](std::string what) {
        std::lock_guard lock(m);
        failures.push_back(fmt::format("{} ranks, rank {}: {}", n, r, what));
      };
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1009}}) {
        for (op o : {op::sum, op::avg}) {
          const std::uint64_t seed = 77 + count;
          options opt;
          opt.reproducible = true;
          // all_reduce and reduce over `count`, reduce_scatter over n * count.
          std::vector<float> in(un * count);
          for (std::size_t i = 0; i < in.size(); ++i) in[i] = special_term<float>(seed, r, i);
          fake_device::buffer<float> din(in.size()), dout(un * count);
          if (!in.empty()) std::memcpy(din.data(), in.data(), in.size() * sizeof(float));
          for (collective kind :
               {collective::all_reduce, collective::reduce_scatter, collective::reduce}) {
            const std::size_t in_n = kind == collective::reduce_scatter ? un * count : count;
            const std::size_t out_n = kind == collective::reduce_scatter
                                          ? count
                                          : (kind == collective::reduce && r != 0 ? 0 : count);
            std::vector<float> host(out_n);
            const algorithms::call<float> hc{kind, std::span<const float>(in.data(), in_n),
                                             std::span<float>(host), o, 0};
            ringzero::detail::run_reproducible(plain, hc, opt);
            std::memset(dout.data(), 0xa5, dout.size() * sizeof(float));
            const algorithms::call<float> dc{kind, std::span<const float>(din.data(), in_n),
                                             std::span<float>(dout.data(), out_n), o, 0};
            ringzero::detail::run_reproducible_device(comm, dc, opt, rt, k, 0);
            if (out_n && std::memcmp(host.data(), dout.data(), out_n * sizeof(float)) != 0)
              fail(fmt::format("{} {} count {}: device bits differ from the host's",
                               collective_name(kind), op_name(o), count));
          }
        }
      }
    });
    for (const auto& f : failures) FAIL_CHECK(f);
  }
}

TEST_CASE("reproducible sums on device buffers: the digits' layout from the agreed windows") {
  // device_reproducible::layout (the CUDA kernels and the stand-in share block_digits and
  // range_position) against positions counted element by element: block b's digits start
  // where the elements before it end, a part's bound where its first element's digits start.
  // Windows of 0 to max_words digits, blocks cut short at the end, and sizes that are whole
  // blocks, where the last bound lies past the last window.
  const fake_device::installed fake;
  const auto& k = fake_device::reproducible;
  CUstream_st* s = fake_device::create_stream(0);
  std::uint64_t h = 0x5eed;
  for (std::size_t parts : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{5}}) {
    for (std::size_t part : {std::size_t{0}, std::size_t{1}, std::size_t{21}, std::size_t{64},
                             std::size_t{100}, std::size_t{1000}}) {
      const std::size_t n = parts * part;
      const std::size_t blocks = rp::blocks(n);
      std::vector<std::int32_t> win(2 * blocks + 1);
      for (std::size_t b = 0; b < blocks; ++b) {
        h = testing::mix(h + b);
        rp::window w;
        if (h % 7 != 0) {  // one block in seven holds only zeros: no digits
          static constexpr int widths[] = {1, 39, 40, 41, 120, 279, 400};
          w.top = static_cast<std::int32_t>((h >> 8) % 300) - 100;
          w.neg_low = -(w.top - widths[(h >> 20) % 7]);
        }
        win[2 * b] = w.top;
        win[2 * b + 1] = w.neg_low;
      }
      // Element by element: where each one's digits start.
      std::vector<std::uint64_t> at(n + 1, 0);
      for (std::size_t i = 0; i < n; ++i)
        at[i + 1] =
            at[i] + static_cast<std::uint64_t>(rp::words(rp::window{
                        win[2 * (i / rp::block_elems)], win[2 * (i / rp::block_elems) + 1]}));
      const std::size_t scratch = k.layout_scratch(n);
      // Device memory, as the kernels take it.
      fake_device::buffer<std::byte> temp(std::max<std::size_t>(scratch, 1));
      fake_device::buffer<std::int32_t> d_win(win.size());
      fake_device::buffer<std::uint64_t> d_off(blocks + 1), d_bounds(parts + 1);
      std::memcpy(d_win.data(), win.data(), win.size() * sizeof(std::int32_t));
      k.layout(d_win.data(), n, part, parts, d_off.data(), d_bounds.data(), temp.data(),
               temp.size(), s);
      k.synchronize(s);
      const std::span<const std::uint64_t> off = d_off.span(), bounds = d_bounds.span();
      for (std::size_t b = 0; b <= blocks; ++b)
        CHECK_MESSAGE(off[b] == at[std::min(b * rp::block_elems, n)], "n " << n << ": block " << b);
      for (std::size_t r = 0; r <= parts; ++r)
        CHECK_MESSAGE(bounds[r] == at[r * part],
                      "n " << n << ", " << parts << " parts: bound " << r);
    }
  }
  fake_device::destroy_stream(s);
}

TEST_CASE("reproducible sums on device buffers: the passes wait for the caller's stream") {
  // The input is written by a copy still queued on the caller's stream (options::stream); the
  // passes run on a stream of their own, which must be ordered behind it, and complete before
  // the call returns even when options::async asks for stream order. Their scratch is kept.
  const fake_device::installed fake;
  const auto& rt = fake_device::runtime;
  const auto& k = fake_device::reproducible;
  loopback::world w(1);
  w.run([&](loopback::communicator& plain) {
    auto comm = fake_device::fabric_of(plain);
    constexpr std::size_t count = 300;
    std::vector<float> in(count);
    for (std::size_t i = 0; i < count; ++i) in[i] = special_term<float>(5, 0, i);
    fake_device::buffer<float> din(count), dout(count);
    std::memset(din.data(), 0, count * sizeof(float));
    CUstream_st* caller = fake_device::create_stream(0);
    fake_device::copy(din.data(), in.data(), count * sizeof(float), caller);  // runs late
    const std::size_t before = fake_device::global().orderings;
    options opt;
    opt.reproducible = true;
    opt.async = true;
    opt.stream = caller;
    const algorithms::call<float> dc{collective::all_reduce, std::span<const float>(din.span()),
                                     dout.span(), op::sum, 0};
    ringzero::detail::run_reproducible_device(comm, dc, opt, rt, k, 0);
    CHECK(fake_device::global().orderings == before + 1);
    std::vector<float> want(count);
    options host;
    host.reproducible = true;
    ringzero::detail::run_reproducible(
        plain,
        algorithms::call<float>{collective::all_reduce, std::span<const float>(in),
                                std::span<float>(want), op::sum, 0},
        host);
    CHECK(std::memcmp(want.data(), dout.data(), count * sizeof(float)) == 0);
    // The scratch stays with the communicator: a second call of the size allocates nothing.
    const auto held = [] {
      auto& g = fake_device::global();
      std::lock_guard lock(g.m);
      return g.ranges.size();
    };
    const std::size_t after_first = held();
    std::memset(dout.data(), 0, count * sizeof(float));
    ringzero::detail::run_reproducible_device(comm, dc, opt, rt, k, 0);
    CHECK(held() == after_first);
    CHECK(std::memcmp(want.data(), dout.data(), count * sizeof(float)) == 0);
    fake_device::destroy_stream(caller);
  });
}
