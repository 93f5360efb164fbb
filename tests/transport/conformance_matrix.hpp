// The conformance matrix a transport runs with ranks as processes: every collective x
// algorithm x element type x op x in/out-of-place x count, each checked on every rank against
// the serial reference of tests/support/reference.hpp (exact for integers, min/max and copies;
// within the reassociation bound for float sums, products and averages), plus a digest of
// every output that run_all() compares across ranks.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "reference.hpp"
#include "ringzero/ringzero.hpp"

namespace conformance {

using ringzero::algorithm;
using ringzero::collective;
using ringzero::op;

struct test_case {
  collective coll = collective::all_reduce;
  algorithm algo = algorithm::automatic;
  ringzero::dtype type = ringzero::dtype::float32;
  op reduction = op::sum;
  bool in_place = false;
  std::size_t count = 0;
  int root = 0;
  std::size_t chunk_bytes = 0;  // options::chunk_bytes; 0 = the transport's
  std::uint64_t salt = 0;       // varies the inputs of otherwise equal cases (the soak's)

  [[nodiscard]] std::string name() const {
    std::string s = fmt::format(
        "{} algo={} type={} op={} {} count={} root={}", collective_name(coll), algorithm_name(algo),
        dtype_name(type), op_name(reduction), in_place ? "in-place" : "out-of-place", count, root);
    if (chunk_bytes != 0) s += fmt::format(" chunk_bytes={}", chunk_bytes);
    if (salt != 0) s += fmt::format(" salt={:#x}", salt);
    return s;
  }
};

[[nodiscard]] inline std::vector<algorithm> algorithms_for(collective c, bool multi_node) {
  std::vector<algorithm> a{algorithm::automatic};
  for (algorithm x : ringzero::tuning::candidates(c, multi_node)) a.push_back(x);
  return a;
}

/// Every case for a world of n ranks over the given element types; hierarchical joins the
/// all_reduce and all_to_all algorithms when the ranks span several nodes. `count` is the
/// per-rank block of all_to_all, gather and scatter, and the scale of all_to_allv's uneven
/// blocks (testing::v_count).
[[nodiscard]] inline std::vector<test_case> matrix(int n, bool multi_node,
                                                   std::span<const ringzero::dtype> types) {
  std::vector<std::size_t> counts{
      0, 1, static_cast<std::size_t>(n) - 1, static_cast<std::size_t>(n), 1009, 65537};
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  std::vector<test_case> cases;
  for (collective c : {collective::all_reduce, collective::reduce_scatter, collective::all_gather,
                       collective::broadcast, collective::reduce, collective::all_to_all,
                       collective::all_to_allv, collective::gather, collective::scatter}) {
    const bool reducing =
        c == collective::all_reduce || c == collective::reduce_scatter || c == collective::reduce;
    const bool rooted = c == collective::broadcast || c == collective::reduce ||
                        c == collective::gather || c == collective::scatter;
    // The algorithms innermost: their cases share inputs and expected results (seed_of leaves
    // out the algorithm and in_place), which check_reduced computes once for the run of them.
    for (ringzero::dtype t : types)
      for (op o : ringzero::all_ops) {
        if (!reducing && o != op::sum) continue;
        for (std::size_t count : counts)
          for (bool in_place : {false, true}) {
            if (in_place && c == collective::all_to_allv) continue;
            for (algorithm a : algorithms_for(c, multi_node)) {
              test_case tc{c, a, t, o, in_place, count, 0};
              if (rooted)
                tc.root = static_cast<int>((count + static_cast<std::size_t>(in_place)) %
                                           static_cast<std::size_t>(n));
              cases.push_back(tc);
            }
          }
      }
  }
  return cases;
}

/// Distinct inputs per case, the same on every rank.
[[nodiscard]] inline std::uint64_t seed_of(const test_case& tc) {
  using ringzero::testing::mix;
  return mix(mix((static_cast<std::uint64_t>(tc.coll) << 56) ^
                 (static_cast<std::uint64_t>(tc.type) << 48) ^
                 (static_cast<std::uint64_t>(tc.reduction) << 40) ^ tc.count) ^
             static_cast<std::uint64_t>(tc.root)) ^
         tc.salt;
}

/// What one case left on one rank.
struct outcome {
  std::uint64_t hash = 0;  // digest of everything this rank received
  std::string failure;     // empty if every check passed
};

namespace detail {

namespace ref = ringzero::testing;

template <class E>
void check_reduced(std::span<const E> out, std::uint64_t seed, std::size_t first, int n, op o,
                   std::string& failure) {
  // The serial reference of the last elements checked, kept for the next case that asks for the
  // same ones: the matrix runs a case's algorithms (and in place, out of place) one after the
  // other on the same inputs, and the reference (n inputs an element) was most of these
  // programs' CPU time. One per thread, as ranks may be threads.
  struct memo {
    std::uint64_t seed = 0;
    std::size_t first = 0;
    int n = 0;
    op o = op::sum;
    std::vector<ref::reduced<E>> want;
  };
  thread_local memo m;
  if (m.seed != seed || m.first != first || m.n != n || m.o != o || m.want.size() != out.size()) {
    m = memo{seed, first, n, o, std::vector<ref::reduced<E>>(out.size())};
    for (std::size_t k = 0; k < out.size(); ++k)
      m.want[k] = ref::reduce_serial<E>(
          o, n, [&](int r) { return ref::input_value<E>(seed, r, first + k, o); });
  }
  for (std::size_t k = 0; k < out.size() && failure.empty(); ++k) {
    const std::size_t i = first + k;
    const auto& want = m.want[k];
    if (!ref::matches(want, out[k]))
      failure =
          fmt::format("element {}: expected {}, got {}", i, ref::show(want), ref::show(out[k]));
  }
}

template <class E>
void check_copy(std::span<const E> out, std::uint64_t seed, std::size_t first, int from, op o,
                std::string& failure) {
  for (std::size_t k = 0; k < out.size() && failure.empty(); ++k) {
    const E want = ref::input_value<E>(seed, from, first + k, o);
    if (std::memcmp(&want, &out[k], sizeof(E)) != 0)
      failure = fmt::format("element {}: expected rank {}'s {}, got {}", first + k, from,
                            ref::show(want), ref::show(out[k]));
  }
}

template <class E>
void check_untouched(std::span<const E> data, std::span<const E> before, const char* what,
                     std::string& failure) {
  if (failure.empty() && !data.empty() &&
      std::memcmp(data.data(), before.data(), data.size_bytes()) != 0)
    failure = fmt::format("{} was modified", what);
}

template <class T, class E>
outcome run_typed(T& comm, const test_case& tc) {
  const int n = comm.size();
  const int me = comm.rank();
  const std::size_t count = tc.count;
  const auto total = count * static_cast<std::size_t>(n);
  const ringzero::options opt{.algorithm = tc.algo, .chunk_bytes = tc.chunk_bytes};
  const op o = tc.reduction;
  const std::uint64_t seed = seed_of(tc);
  outcome res;
  auto gen = [&](std::size_t len, std::size_t first) {
    std::vector<E> v(len);
    for (std::size_t k = 0; k < len; ++k) v[k] = ref::input_value<E>(seed, me, first + k, o);
    return v;
  };
  auto sentinel = [](std::size_t len) {
    std::vector<E> v(len);
    if (len) std::memset(static_cast<void*>(v.data()), 0x5a, len * sizeof(E));
    return v;
  };
  auto hash = [&](std::span<const E> s) {
    res.hash = ref::mix(res.hash ^ ref::digest(std::as_bytes(s)));
  };

  switch (tc.coll) {
    case collective::all_reduce: {
      auto in = gen(count, 0);
      const auto before = in;
      auto out = tc.in_place ? std::vector<E>{} : sentinel(count);
      std::span<E> dst = tc.in_place ? std::span<E>(in) : std::span<E>(out);
      ringzero::all_reduce(comm, std::span<const E>(in), dst, o, opt);
      check_reduced<E>(dst, seed, 0, n, o, res.failure);
      if (!tc.in_place) check_untouched<E>(in, before, "the input", res.failure);
      hash(dst);
      break;
    }
    case collective::reduce_scatter: {
      std::vector<E> in(total);
      for (std::size_t k = 0; k < total; ++k) in[k] = ref::input_value<E>(seed, me, k, o);
      const auto before = in;
      const std::size_t mine = count * static_cast<std::size_t>(me);
      auto out = sentinel(count);
      std::span<E> dst = tc.in_place ? std::span<E>(in).subspan(mine, count) : std::span<E>(out);
      ringzero::reduce_scatter(comm, std::span<const E>(in), dst, o, opt);
      check_reduced<E>(dst, seed, mine, n, o, res.failure);
      if (!tc.in_place) check_untouched<E>(in, before, "the input", res.failure);
      hash(dst);
      break;
    }
    case collective::all_gather: {
      auto out = sentinel(total);
      const std::size_t mine = count * static_cast<std::size_t>(me);
      auto own = gen(count, mine);
      std::span<const E> src = own;
      if (tc.in_place) {
        std::copy(own.begin(), own.end(), out.begin() + static_cast<std::ptrdiff_t>(mine));
        src = std::span<const E>(out).subspan(mine, count);
      }
      ringzero::all_gather(comm, src, std::span<E>(out), opt);
      for (int r = 0; r < n && res.failure.empty(); ++r) {
        const std::size_t first = count * static_cast<std::size_t>(r);
        check_copy<E>(std::span<const E>(out).subspan(first, count), seed, first, r, o,
                      res.failure);
      }
      hash(out);
      break;
    }
    case collective::broadcast: {
      const bool root = me == tc.root;
      auto in = root ? gen(count, 0) : sentinel(count);
      const auto before = in;
      auto out = tc.in_place ? std::vector<E>{} : sentinel(count);
      std::span<E> dst = tc.in_place ? std::span<E>(in) : std::span<E>(out);
      ringzero::broadcast(comm, std::span<const E>(in), dst, tc.root, opt);
      check_copy<E>(dst, seed, 0, tc.root, o, res.failure);
      if (!tc.in_place) check_untouched<E>(in, before, "the input", res.failure);
      hash(dst);
      break;
    }
    case collective::reduce: {
      const bool root = me == tc.root;
      auto in = gen(count, 0);
      const auto before = in;
      auto out = sentinel(count);
      const auto out_before = out;
      std::span<E> dst = tc.in_place ? std::span<E>(in) : std::span<E>(out);
      ringzero::reduce(comm, std::span<const E>(in), dst, o, tc.root, opt);
      if (root) {
        check_reduced<E>(dst, seed, 0, n, o, res.failure);
        hash(dst);
      } else if (!tc.in_place) {
        check_untouched<E>(out, out_before, "a non-root output", res.failure);
      }
      if (!tc.in_place || !root) {
        const char* what = tc.in_place ? "a non-root's in-place buffer" : "the input";
        check_untouched<E>(in, before, what, res.failure);
      }
      break;
    }
    case collective::all_to_all: {
      // Block r of this rank's output is block me of rank r's input.
      auto in = gen(total, 0);
      const auto before = in;
      auto out = tc.in_place ? std::vector<E>{} : sentinel(total);
      std::span<E> dst = tc.in_place ? std::span<E>(in) : std::span<E>(out);
      ringzero::all_to_all(comm, std::span<const E>(in), dst, opt);
      for (int r = 0; r < n && res.failure.empty(); ++r)
        check_copy<E>(std::span<const E>(dst).subspan(count * static_cast<std::size_t>(r), count),
                      seed, count * static_cast<std::size_t>(me), r, o, res.failure);
      if (!tc.in_place) check_untouched<E>(in, before, "the input", res.failure);
      hash(dst);
      break;
    }
    case collective::all_to_allv: {
      // Blocks packed in rank order; element k of the block rank i sends rank j is rank i's
      // input element j * 2^20 + k.
      const auto un = static_cast<std::size_t>(n);
      std::vector<std::size_t> sc(un), sd(un), rc(un), rd(un);
      std::size_t sent = 0, received = 0;
      for (std::size_t j = 0; j < un; ++j) {
        sc[j] = ref::v_count(seed, me, static_cast<int>(j), count);
        rc[j] = ref::v_count(seed, static_cast<int>(j), me, count);
        sd[j] = sent;
        rd[j] = received;
        sent += sc[j];
        received += rc[j];
      }
      std::vector<E> in(sent);
      for (std::size_t j = 0; j < un; ++j)
        for (std::size_t k = 0; k < sc[j]; ++k)
          in[sd[j] + k] = ref::input_value<E>(seed, me, (j << 20) + k, o);
      const auto before = in;
      auto out = sentinel(received);
      ringzero::all_to_allv(comm, std::span<const E>(in), std::span<const std::size_t>(sc),
                            std::span<const std::size_t>(sd), std::span<E>(out),
                            std::span<const std::size_t>(rc), std::span<const std::size_t>(rd),
                            opt);
      for (std::size_t j = 0; j < un && res.failure.empty(); ++j)
        check_copy<E>(std::span<const E>(out).subspan(rd[j], rc[j]), seed,
                      static_cast<std::size_t>(me) << 20, static_cast<int>(j), o, res.failure);
      check_untouched<E>(in, before, "the input", res.failure);
      hash(out);
      break;
    }
    case collective::gather: {
      const bool root = me == tc.root;
      const std::size_t mine = count * static_cast<std::size_t>(me);
      auto out = sentinel(total);
      const auto out_before = out;
      auto own = gen(count, 0);
      std::span<const E> src = own;
      if (tc.in_place && root) {
        std::copy(own.begin(), own.end(), out.begin() + static_cast<std::ptrdiff_t>(mine));
        src = std::span<const E>(out).subspan(mine, count);
      }
      ringzero::gather(comm, src, std::span<E>(out), tc.root, opt);
      if (root) {
        for (int r = 0; r < n && res.failure.empty(); ++r)
          check_copy<E>(std::span<const E>(out).subspan(count * static_cast<std::size_t>(r), count),
                        seed, 0, r, o, res.failure);
        hash(out);
      } else {
        check_untouched<E>(out, out_before, "a non-root output", res.failure);
      }
      break;
    }
    case collective::scatter: {
      const bool root = me == tc.root;
      const std::size_t mine = count * static_cast<std::size_t>(me);
      auto in = root ? gen(total, 0) : std::vector<E>{};
      const auto before = in;
      auto out = sentinel(count);
      std::span<E> dst =
          tc.in_place && root ? std::span<E>(in).subspan(mine, count) : std::span<E>(out);
      ringzero::scatter(comm, std::span<const E>(in), dst, tc.root, opt);
      check_copy<E>(dst, seed, mine, tc.root, o, res.failure);
      if (!tc.in_place) check_untouched<E>(in, before, "the input", res.failure);
      hash(dst);
      break;
    }
    default:
      break;
  }
  return res;
}

}  // namespace detail

/// The element types a test compiles its cases for. Every collective is instantiated once per
/// element type and transport, which is most of these tests' compile time, so a test names the
/// types it runs instead of instantiating all ten and running two.
template <class... E>
struct types {
  static constexpr std::array<ringzero::dtype, sizeof...(E)> dtypes{ringzero::dtype_of<E>()...};
};
using every_type = types<std::int8_t, std::uint8_t, std::int32_t, std::uint32_t, std::int64_t,
                         std::uint64_t, ringzero::float16, float, double, ringzero::bfloat16>;

/// Runs one case on this rank; collective over comm. The case's type must be one of L's.
template <class L = every_type, class T>
[[nodiscard]] outcome run(T& comm, const test_case& tc) {
  return [&]<class... E>(types<E...>) {
    outcome r;
    const bool compiled =
        ((tc.type == ringzero::dtype_of<E>() ? (r = detail::run_typed<T, E>(comm, tc), true)
                                             : false) ||
         ...);
    if (!compiled)
      r.failure = fmt::format("type {} is not compiled into this test's type list",
                              ringzero::dtype_name(tc.type));
    return r;
  }(L{});
}

/// Runs every case, then compares each case's output hash across ranks (gathered once at the
/// end). Returns the failures seen on this rank, one line each.
template <class L = every_type, class T>
[[nodiscard]] std::vector<std::string> run_all(T& comm, std::span<const test_case> cases) {
  std::vector<std::string> failures;
  std::vector<std::uint64_t> hashes(cases.size());
  for (std::size_t c = 0; c < cases.size(); ++c) {
    outcome r = run<L>(comm, cases[c]);
    hashes[c] = r.hash;
    if (!r.failure.empty())
      failures.push_back(fmt::format("rank {}: {}: {}", comm.rank(), cases[c].name(), r.failure));
  }
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::uint64_t> all(hashes.size() * n);
  ringzero::all_gather(comm, std::span<const std::uint64_t>(hashes), std::span<std::uint64_t>(all),
                       {.algorithm = algorithm::ring});
  for (std::size_t c = 0; c < cases.size(); ++c) {
    // Only these leave the same result on every rank; the others a result on the root only or
    // a different one on each rank, each checked against the reference where it lands.
    const collective k = cases[c].coll;
    if (k != collective::all_reduce && k != collective::all_gather && k != collective::broadcast)
      continue;
    for (std::size_t r = 1; r < n; ++r)
      if (all[r * cases.size() + c] != all[c]) {
        failures.push_back(
            fmt::format("{}: rank {} and rank 0 hold different bits", cases[c].name(), r));
        break;
      }
  }
  return failures;
}

}  // namespace conformance
