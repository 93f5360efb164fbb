// options::wire over loopback: all_gather, reduce_scatter and all_reduce of float, bfloat16 and
// float16 in the bf16, int8 and int4 formats, world sizes 1..7, one node and simulated nodes of
// 2 and 3 ranks (equal ones take two hops, unequal ones one), in place and out of place, counts
// that leave short blocks. Each case checks:
//   - every element bitwise against a serial reference that encodes the same segments and adds
//     them in the documented order (one hop: rank order; two hops: local rank order inside each
//     node, then node order), so which bytes went where, and in which order they were added, is
//     exactly what detail/quantized_call.hpp says;
//   - every element within quantize::error_bound of the exact result;
//   - every rank that receives the same buffer holds the same bits.
// Infinities and NaN, a forced algorithm, the options RINGZERO_CHECK compares and bad input are
// separate cases.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "checks.hpp"
#include "conformance.hpp"
#include "ringzero/reduce/quantize.hpp"

namespace {

using namespace conformance;
namespace q = ringzero::quantize;

constexpr wire_format formats[] = {wire_format::bf16, wire_format::int8, wire_format::int4};

/// Rank r's term i: magnitudes over four binades, random signs, an exact zero now and then.
template <class E>
E term(std::uint64_t seed, int r, std::size_t i) {
  const std::uint64_t h = testing::mix(seed ^ (static_cast<std::uint64_t>(r) << 40) ^ i);
  if (h % 29 == 0) return E(0.0f);
  const double m = 1.0 + static_cast<double>(h & 0xffff) / 65536.0;
  const int e = static_cast<int>((h >> 20) % 4) - 2;
  const double v = std::ldexp(m, e) * ((h >> 40) & 1 ? -1.0 : 1.0);
  return E(static_cast<float>(v));
}
constexpr double max_term = 8.0;  // |term| < 2^2 · 2

/// Encodes `x` (count elements) as one segment and decodes it again: what one wire hop makes of it.
template <class S>
std::vector<float> through_wire(wire_format f, std::size_t block, const S* x, std::size_t count) {
  const q::segment_layout L{f, block, count};
  std::vector<std::uint8_t> bytes(L.bytes());
  q::encode(L, x, bytes.data());
  std::vector<float> v(count);
  q::accumulate(L, bytes.data(), v.data(), true);
  return v;
}

/// The float sums rank g gets from reduce_scatter's documented steps, before the rounding to E.
template <class E>
std::vector<float> reference_sums(wire_format f, std::size_t block, int n, int per_node, int g,
                                  std::size_t count, const std::vector<std::vector<E>>& in) {
  const auto term_block = [&](int r) { return in[static_cast<std::size_t>(r)].data() + g * count; };
  std::vector<float> sums(count, 0.0f);
  const bool two = per_node > 1 && per_node < n && n % per_node == 0;
  const auto add = [&](std::vector<float>& acc, const std::vector<float>& v, bool first) {
    for (std::size_t i = 0; i < count; ++i) acc[i] = first ? v[i] : acc[i] + v[i];
  };
  if (!two) {
    for (int r = 0; r < n; ++r) add(sums, through_wire(f, block, term_block(r), count), r == 0);
    return sums;
  }
  for (int c = 0; c < n / per_node; ++c) {
    std::vector<float> partial(count);
    for (int s = 0; s < per_node; ++s)
      add(partial, through_wire(f, block, term_block(c * per_node + s), count), s == 0);
    add(sums, through_wire(f, block, partial.data(), count), c == 0);
  }
  return sums;
}

struct case_spec {
  wire_format format;
  std::size_t block;
  std::size_t count;  // per rank: the all_gather input, the reduce_scatter output, the all_reduce
  bool in_place;
  op reduction;
};

template <class E>
void run_cases(int n, int per_node) {
  const std::string world = fmt::format("{} ranks, {} per node", n, per_node);
  const std::vector<std::size_t> counts = {1, 7, 300, 1031};
  run_world(
      n, world_options_for(per_node), world, [&](loopback::communicator& comm, world_log& log) {
        const int r = comm.rank();
        for (const wire_format f : formats)
          for (const std::size_t count : counts)
            for (const bool in_place : {false, true})
              for (const op o : {op::sum, op::avg}) {
                const std::size_t block = count == 300 ? 64 : 0;
                const case_spec cs{f, block, count, in_place, o};
                const std::size_t blk = block == 0 ? default_wire_block : block;
                const options opt{.wire = f, .wire_block = block};
                const std::string name = fmt::format(
                    "{} {} {} count {} block {}{}", dtype_name(dtype_of<E>()), wire_format_name(f),
                    op_name(o), count, blk, in_place ? " in place" : "");
                const std::uint64_t seed = seed_of(dtype_of<E>(), o, count, static_cast<int>(f));
                const auto un = static_cast<std::size_t>(n);
                // Every rank's inputs, on every rank, for the references.
                std::vector<std::vector<E>> all(un);
                for (int s = 0; s < n; ++s) {
                  all[static_cast<std::size_t>(s)].resize(un * count);
                  for (std::size_t i = 0; i < un * count; ++i)
                    all[static_cast<std::size_t>(s)][i] = term<E>(seed, s, i);
                }
                const auto& mine = all[static_cast<std::size_t>(r)];
                const auto within = [&](double got, double exact, double bound, std::size_t i,
                                        std::string_view what) {
                  if (std::abs(got - exact) <= bound) return true;
                  log.fail(fmt::format(
                      "{} {}: rank {} element {}: {} is {} from the exact {} (bound {})", what,
                      name, r, i, got, std::abs(got - exact), exact, bound));
                  return false;
                };
                // all_gather: block s is rank s's first `count` terms through the wire.
                if (o == op::sum) {
                  std::vector<E> out(un * count);
                  poison(std::span<E>(out), 0xA5);
                  std::span<const E> in(mine.data(), count);
                  if (in_place) {
                    std::copy(mine.begin(), mine.begin() + static_cast<std::ptrdiff_t>(count),
                              out.begin() + static_cast<std::ptrdiff_t>(r * count));
                    in = std::span<const E>(out.data() + r * count, count);
                  }
                  all_gather(comm, in, std::span<E>(out), opt);
                  const double bound = q::error_bound<E>(f, q::call_shape::gather, n, 0, max_term);
                  bool ok = true;
                  for (int s = 0; s < n && ok; ++s) {
                    const auto v =
                        through_wire(f, blk, all[static_cast<std::size_t>(s)].data(), count);
                    for (std::size_t i = 0; i < count && ok; ++i) {
                      const E want = kernels::from_float<E>(v[i]);
                      const E got = out[static_cast<std::size_t>(s) * count + i];
                      if (std::memcmp(&want, &got, sizeof(E)) != 0) {
                        log.fail(
                            fmt::format("all_gather {}: rank {} block {} element {}: {} not {}",
                                        name, r, s, i, testing::show(got), testing::show(want)));
                        ok = false;
                      }
                      ok = ok && within(kernels::to_float(got),
                                        kernels::to_float(all[static_cast<std::size_t>(s)][i]),
                                        bound, i, "all_gather");
                    }
                  }
                  log.checked();
                  log.record(r, "all_gather " + name, digest_of(std::span<const E>(out)));
                }
                // reduce_scatter: this rank's block of every rank's input, summed through the wire.
                {
                  std::vector<E> buf = mine;
                  std::vector<E> out(count);
                  std::span<E> dst(out);
                  if (in_place)
                    dst = std::span<E>(buf.data() + r * count, count);
                  else
                    poison(dst, 0xA5);
                  reduce_scatter(comm, std::span<const E>(in_place ? buf : mine), dst, o, opt);
                  auto sums = reference_sums<E>(f, blk, n, per_node, r, count, all);
                  const double bound = q::error_bound<E>(f, q::call_shape::reduce_blocks, n,
                                                         per_node, max_term, o == op::avg);
                  for (std::size_t i = 0; i < count; ++i) {
                    const float s = o == op::avg ? sums[i] / static_cast<float>(n) : sums[i];
                    const E want = kernels::from_float<E>(s);
                    if (std::memcmp(&want, &dst[i], sizeof(E)) != 0) {
                      log.fail(fmt::format("reduce_scatter {}: rank {} element {}: {} not {}", name,
                                           r, i, testing::show(dst[i]), testing::show(want)));
                      break;
                    }
                    double exact = 0;
                    for (int s2 = 0; s2 < n; ++s2)
                      exact += kernels::to_float(all[static_cast<std::size_t>(s2)][r * count + i]);
                    if (o == op::avg) exact /= n;
                    if (!within(kernels::to_float(dst[i]), exact, bound, i, "reduce_scatter"))
                      break;
                  }
                  log.checked();
                }
                // all_reduce: the first `count` elements of each rank's input.
                {
                  std::vector<E> buf(mine.begin(),
                                     mine.begin() + static_cast<std::ptrdiff_t>(count));
                  std::vector<E> out(count);
                  std::span<E> dst = in_place ? std::span<E>(buf) : std::span<E>(out);
                  if (!in_place) poison(dst, 0xA5);
                  all_reduce(comm, std::span<const E>(buf), dst, o, opt);
                  // Part p of the padded vector is reduced as rank p's reduce_scatter block.
                  const std::size_t part = (count + un - 1) / un;
                  std::vector<std::vector<E>> padded(un, std::vector<E>(un * part, E(0.0f)));
                  for (std::size_t s = 0; s < un; ++s)
                    std::copy(all[s].begin(), all[s].begin() + static_cast<std::ptrdiff_t>(count),
                              padded[s].begin());
                  const double bound = q::error_bound<E>(f, q::call_shape::reduce_whole, n,
                                                         per_node, max_term, o == op::avg);
                  bool ok = true;
                  for (std::size_t p = 0; p < un && ok && p * part < count; ++p) {
                    auto sums =
                        reference_sums<E>(f, blk, n, per_node, static_cast<int>(p), part, padded);
                    if (o == op::avg)
                      for (float& x : sums) x /= static_cast<float>(n);
                    const auto v = through_wire(f, blk, sums.data(), part);
                    for (std::size_t i = 0; i < part && p * part + i < count && ok; ++i) {
                      const std::size_t at = p * part + i;
                      const E want = kernels::from_float<E>(v[i]);
                      if (std::memcmp(&want, &dst[at], sizeof(E)) != 0) {
                        log.fail(fmt::format("all_reduce {}: rank {} element {}: {} not {}", name,
                                             r, at, testing::show(dst[at]), testing::show(want)));
                        ok = false;
                      }
                      double exact = 0;
                      for (std::size_t s = 0; s < un; ++s) exact += kernels::to_float(all[s][at]);
                      if (o == op::avg) exact /= n;
                      ok = ok && within(kernels::to_float(dst[at]), exact, bound, at, "all_reduce");
                    }
                  }
                  log.checked();
                  log.record(r, "all_reduce " + name, digest_of(std::span<const E>(dst)));
                }
                (void)cs;
              }
      });
}

}  // namespace

TEST_CASE("quantized collectives: the documented steps, bitwise, within the error bound") {
  for (int n = 1; n <= 7; ++n) {
    run_cases<float>(n, 0);
    if (n >= 2) run_cases<float>(n, 2);  // 2 per node: two hops at even n, one at odd n
  }
  run_cases<float>(6, 3);
  run_cases<float>(7, 3);  // nodes of 3, 3 and 1
  run_cases<bfloat16>(4, 2);
  run_cases<bfloat16>(3, 0);
  run_cases<float16>(4, 2);
  run_cases<float16>(5, 0);
}

TEST_CASE("a large all_gather goes in pieces, with the whole block's values") {
  // Two pieces of whole scale blocks (1000 elements), the last block short, encoded and decoded
  // on a helper thread beside the transfer: every value as the unpieced segment gives it (a
  // piece cut inside a scale block gets other scales and fails this).
  const std::size_t count = 2 * ringzero::tuning::thresholds::quantized_gather_piece_elems + 777;
  for (const wire_format f : {wire_format::int8, wire_format::int4, wire_format::bf16}) {
    std::vector<std::vector<float>> in(3), out(3);
    ringzero::loopback::world w(3, world_options_for());
    w.run([&](loopback::communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      in[r].resize(count);
      for (std::size_t i = 0; i < count; ++i) in[r][i] = term<float>(11, comm.rank(), i);
      out[r].assign(3 * count, -1.0f);
      all_gather(comm, std::span<const float>(in[r]), std::span<float>(out[r]),
                 options{.wire = f, .wire_block = 1000});
    });
    for (std::size_t src = 0; src < 3; ++src) {
      const auto want = through_wire(f, 1000, in[src].data(), count);
      for (std::size_t r = 0; r < 3; ++r)
        CHECK(std::memcmp(out[r].data() + src * count, want.data(), count * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("quantized collectives: inf and NaN as documented, the same bits on every rank") {
  // 4 ranks in nodes of 2 (two hops). Element 5: +inf on rank 1, -inf on rank 3; element 9: +inf
  // on rank 1 only; element 300: NaN on rank 2. Element 7 shares element 5's scale block.
  constexpr std::size_t count = 600, block = 256;
  const float inf = std::numeric_limits<float>::infinity();
  const auto input = [&](std::size_t r) {
    std::vector<float> v(count);
    for (std::size_t i = 0; i < count; ++i) v[i] = term<float>(5, static_cast<int>(r), i);
    if (r == 1) v[5] = v[9] = inf;
    if (r == 3) v[5] = -inf;
    if (r == 2) v[300] = std::nanf("");
    return v;
  };
  for (const wire_format f : formats) {
    INFO(std::string(wire_format_name(f)));
    std::vector<std::vector<float>> gathered(4), sums(4);
    ringzero::loopback::world w(4, world_options_for(2));
    w.run([&](loopback::communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      const std::vector<float> in = input(r);
      const options opt{.wire = f, .wire_block = block};
      gathered[r].assign(4 * count, 0.0f);
      all_gather(comm, std::span<const float>(in), std::span<float>(gathered[r]), opt);
      sums[r].assign(count, 0.0f);
      all_reduce(comm, std::span<const float>(in), std::span<float>(sums[r]), op::sum, opt);
    });
    for (std::size_t r = 1; r < 4; ++r) {
      CHECK(std::memcmp(gathered[r].data(), gathered[0].data(), 4 * count * sizeof(float)) == 0);
      CHECK(std::memcmp(sums[r].data(), sums[0].data(), count * sizeof(float)) == 0);
    }
    const std::vector<float>& g = gathered[0];
    const std::vector<float>& s = sums[0];
    for (std::size_t src = 0; src < 4; ++src) {
      const std::vector<float> in = input(src);
      const auto want = through_wire(f, block, in.data(), count);
      CHECK(std::memcmp(g.data() + src * count, want.data(), count * sizeof(float)) == 0);
    }
    if (f == wire_format::bf16) {  // carried as they are
      CHECK(g[count + 5] == inf);
      CHECK(g[3 * count + 5] == -inf);
      CHECK(s[9] == inf);
    } else {  // the reserved code: NaN, the block's other elements scaled by the finite ones
      CHECK(std::isnan(g[count + 5]));
      CHECK(std::isnan(g[3 * count + 5]));
      CHECK(std::isnan(s[9]));
      CHECK(std::isfinite(g[count + 7]));
      CHECK(std::abs(g[count + 7] - input(1)[7]) <=
            0.5 * max_term / (f == wire_format::int8 ? 127 : 7));
    }
    CHECK(std::isnan(s[5]));  // +inf + -inf, or a NaN code
    CHECK(std::isnan(g[2 * count + 300]));
    CHECK(std::isnan(s[300]));
    CHECK(std::isfinite(s[7]));
    CHECK(std::isfinite(s[301]));
  }
}

TEST_CASE("quantized collectives: bad input is refused before anything is sent") {
  using test_support::error_of;
  ringzero::loopback::world w(2, world_options_for());
  std::vector<std::string> messages(8);
  w.run([&](loopback::communicator& comm) {
    std::vector<float> f(4, 1.0f), g(8);
    std::vector<std::int32_t> i(4, 1);
    const options int8{.wire = wire_format::int8};
    const auto ok_after = [&] {  // the communicator stays usable after each refusal
      all_gather(comm, std::span<const float>(f), std::span<float>(g), int8);
      CHECK(std::abs(g[5] - 1.0f) <= 1.0f / 254);
    };
    std::vector<std::string> got;
    got.push_back(error_of<ringzero::invalid_argument>(
        [&] { all_reduce(comm, std::span<std::int32_t>(i), op::sum, int8); }));
    ok_after();
    got.push_back(error_of<ringzero::invalid_argument>(
        [&] { broadcast(comm, std::span<float>(f), 0, int8); }));
    got.push_back(error_of<ringzero::invalid_argument>(
        [&] { all_reduce(comm, std::span<float>(f), op::max, int8); }));
    got.push_back(error_of<ringzero::invalid_argument>([&] {
      all_reduce(comm, std::span<float>(f), op::sum,
                 options{.reproducible = true, .wire = wire_format::int4});
    }));
    got.push_back(error_of<ringzero::invalid_argument>([&] {
      all_reduce(comm, std::span<float>(f), op::sum, options{.wire = static_cast<wire_format>(9)});
    }));
    got.push_back(error_of<ringzero::invalid_argument>([&] {
      all_reduce(comm, std::span<float>(f), op::sum,
                 options{.wire = wire_format::int8, .wire_block = max_wire_block + 1});
    }));
    ok_after();
    if (comm.rank() == 0)
      for (std::size_t k = 0; k < got.size(); ++k) messages[k] = got[k];
  });
  CHECK(messages[0] ==
        "ringzero: all_reduce: options::wire int8 carries float, bfloat16 or float16, not int32");
  CHECK(messages[1] ==
        "ringzero: broadcast: options::wire applies to all_gather, reduce_scatter and all_reduce");
  CHECK(messages[2] == "ringzero: all_reduce: options::wire int8 reduces with sum or avg, not max");
  CHECK(
      test_support::contains(messages[3], "options::reproducible and options::wire int4 exclude"));
  CHECK(messages[4] == "ringzero: all_reduce: options::wire holds 9, which names no wire format");
  CHECK(messages[5] == "ringzero: all_reduce: options::wire_block 16777217 (at most 16777216)");
}

TEST_CASE("quantized collectives: RINGZERO_CHECK=1 compares the wire format and block") {
  test_support::scoped_env check("RINGZERO_CHECK", "1");
  ringzero::loopback::world w(2, world_options_for());
  std::vector<std::string> messages(2);
  w.run([&](loopback::communicator& comm) {
    std::vector<float> f(4, 1.0f);
    const options mine = comm.rank() == 0 ? options{.wire = wire_format::int8}
                                          : options{.wire = wire_format::int8, .wire_block = 64};
    messages[static_cast<std::size_t>(comm.rank())] = test_support::error_of<mismatch_error>(
        [&] { all_reduce(comm, std::span<float>(f), op::sum, mine); });
  });
  for (const auto& m : messages)
    CHECK(m ==
          "ringzero: RINGZERO_CHECK: rank 0 called all_reduce (count 4, type float, op sum, root "
          "0, algorithm auto, wire int8 in blocks of 256) but rank 1 called all_reduce (count 4, "
          "type float, op sum, root 0, algorithm auto, wire int8 in blocks of 64)");
}
