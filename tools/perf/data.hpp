// What ringzero-perf moves and how it checks it: buffer shapes and bandwidth formulas as
// nccl-tests defines them (doc/PERFORMANCE.md there), deterministic per-rank inputs, and the
// reference each rank compares its output with.
//
// Inputs are small integers (sum/min/max/avg: -11..11, or 0..22 for unsigned types; prod: 1 or
// 2), so every reduction order gives the same exact result in every type for the rank counts a
// benchmark uses; integer types are compared exactly and floating types with a small relative
// tolerance, which only matters for avg (one rounded division) and very large worlds.
//
// With --reproducible, floating sums and averages get inputs that no floating-point order adds
// exactly (random signs, 53 random significand bits, exponents over 16 binades, one element in
// 64 zero), and each output element must be bitwise the serial exact sum of every rank's term
// (reproducible::serial_sum): the collective has to be exact, not merely close.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cli.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/reduce/quantize.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/types.hpp"

namespace ringzero::perf {

/// Element counts of one row, in nccl-tests' terms: `param` is the count the collective is
/// called with (the count column), send/recv the buffer lengths, and the in-place offsets are
/// where, per rank, the input and output sit inside the receive buffer.
struct shape {
  std::size_t send = 0;
  std::size_t recv = 0;
  std::size_t param = 0;
  std::size_t send_inplace_offset = 0;
  std::size_t recv_inplace_offset = 0;
};

/// `bytes` is the row's nominal size: the whole vector for all_reduce, broadcast, reduce and
/// sendrecv; the full (n-block) buffer for reduce_scatter, all_gather, alltoall, gather and
/// scatter (nccl-tests' in-place offsets: the input is block rank() of the output for gather,
/// the output block rank() of the input for scatter, and alltoall works on one buffer).
[[nodiscard]] inline shape shape_for(collective c, std::size_t bytes, std::size_t type_size,
                                     int n) {
  const collective_descriptor& d = describe(c);
  const auto ranks = static_cast<std::size_t>(n);
  // The count nccl-tests calls with: the row's size is the full buffer, size() blocks of it
  // where the collective has such a buffer.
  const std::size_t param = d.blocked() ? bytes / type_size / ranks : bytes / type_size;
  shape s;
  s.param = param;
  s.send = collective_descriptor::elems(d.in.size, param, n);
  s.recv = collective_descriptor::elems(d.out.size, param, n);
  // In place, the count-sized buffer is this rank's block of the other (collective_table.hpp).
  if (d.in.size == extent::one && d.out.size == extent::blocks) s.send_inplace_offset = param;
  if (d.in.size == extent::blocks && d.out.size == extent::one) s.recv_inplace_offset = param;
  return s;
}

/// The size column: the larger of the two buffers, in bytes.
[[nodiscard]] inline std::size_t row_bytes(const shape& s, std::size_t type_size) {
  return std::max(s.send, s.recv) * type_size;
}

struct bandwidth {
  double alg = 0;  ///< GB/s, GB = 1e9 bytes
  double bus = 0;
};

/// algbw = S/t with S the full buffer; busbw = algbw times nccl-tests' factor (the
/// descriptor's: 2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter, all_gather, alltoall,
/// gather and scatter, 1 for the rest).
[[nodiscard]] inline bandwidth bandwidth_for(collective c, const shape& s, std::size_t type_size,
                                             int n, double seconds) {
  if (!(seconds > 0)) return {};
  const collective_descriptor& d = describe(c);
  const double bytes = static_cast<double>(d.full_elems(s.param, n) * type_size);
  const double alg = bytes / 1e9 / seconds;
  return {alg, alg * d.bus_bandwidth_factor(n)};
}

template <element E>
[[nodiscard]] constexpr E from_int(long v) noexcept {
  if constexpr (std::is_same_v<E, float16> || std::is_same_v<E, bfloat16>)
    return E(static_cast<float>(v));
  else
    return static_cast<E>(v);
}

/// Element i of rank `rank`'s input for a given check round.
template <element E>
[[nodiscard]] E input_value(int rank, std::size_t i, std::uint32_t seed, op o) noexcept {
  const auto r = static_cast<std::size_t>(rank);
  if (o == op::prod) return from_int<E>((i + 3 * r + seed) % 7 == 0 ? 2 : 1);
  const long v = static_cast<long>((i * 7 + r * 13 + std::size_t{seed} * 3) % 23);
  return from_int<E>(std::is_unsigned_v<E> ? v : v - 11);
}

/// input_value repeats every 161 elements (23 for the additive pattern, 7 for prod), so inputs
/// and references are built from one period and the check costs one compare per element. Data
/// landing a multiple of 161 elements away from its place would pass; blocks and chunks are
/// powers of two or count/n long, which 161 = 7 * 23 divides only by coincidence.
inline constexpr std::size_t pattern_period = 161;

template <element E>
using pattern = std::array<E, pattern_period>;

template <element E>
[[nodiscard]] pattern<E> input_pattern(int rank, std::uint32_t seed, op o) noexcept {
  pattern<E> p;
  for (std::size_t k = 0; k < pattern_period; ++k) p[k] = input_value<E>(rank, k, seed, o);
  return p;
}

template <element E>
void fill_input(E* dst, std::size_t count, int rank, std::uint32_t seed, op o) noexcept {
  const pattern<E> p = input_pattern<E>(rank, seed, o);
  for (std::size_t i = 0, k = 0; i < count; ++i) {
    dst[i] = p[k];
    if (++k == pattern_period) k = 0;
  }
}

/// Whether --reproducible gives this row exact-sum inputs and a bitwise reference: floating types
/// under sum or avg (min, max and integers keep the small-integer pattern, exact already).
template <element E>
[[nodiscard]] constexpr bool exact_sum_row(bool reproducible, op o) noexcept {
  return reproducible && reproducible::supported_v<E> && (o == op::sum || o == op::avg);
}

/// splitmix64's finalizer: every input bit moves about half the output bits.
[[nodiscard]] constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15u;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9u;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBu;
  return x ^ (x >> 31);
}

/// Element i of rank `rank`'s exact-sum input for check round `seed`: zero one time in 64,
/// otherwise +-(1 + f) * 2^e with f 53 random bits and e in [-8, 8), rounded to E. A block of 64
/// floats then spans at most 40 bits, one digit per element (double: two).
template <element E>
[[nodiscard]] E exact_sum_value(int rank, std::size_t i, std::uint32_t seed) noexcept {
  const std::uint64_t h = mix64(mix64(i) ^ (std::uint64_t{seed} << 32) ^
                                static_cast<std::uint64_t>(static_cast<std::uint32_t>(rank)));
  if ((h & 63) == 0) return E{};
  const int e = static_cast<int>((h >> 6) & 15) - 8;
  const double m = 1.0 + std::ldexp(static_cast<double>(h >> 11), -53);
  const double v = std::ldexp((h >> 10) & 1 ? -m : m, e);
  return E(v);
}

template <element E>
void fill_exact_sum_input(E* dst, std::size_t count, int rank, std::uint32_t seed) noexcept {
  for (std::size_t i = 0; i < count; ++i) dst[i] = exact_sum_value<E>(rank, i, seed);
}

/// Output buffers are filled with this byte before a checked run, so an element the collective
/// never wrote is caught: 0xA5 repeated is not an integer in any floating type and lies outside
/// the range of expected values of the integer types for worlds of up to 7 ranks.
inline constexpr unsigned char poison_byte = 0xA5;

template <element E>
[[nodiscard]] constexpr double tolerance() noexcept {
  if constexpr (std::is_same_v<E, float16>)
    return 2e-3;
  else if constexpr (std::is_same_v<E, bfloat16>)
    return 1.6e-2;
  else if constexpr (std::is_same_v<E, float>)
    return 1e-5;
  else
    return 1e-12;
}

template <element E>
[[nodiscard]] constexpr double to_double(E v) noexcept {
  if constexpr (std::is_same_v<E, float16> || std::is_same_v<E, bfloat16>)
    return static_cast<float>(v);
  else
    return static_cast<double>(v);
}

template <element E>
[[nodiscard]] bool matches(E got, E want) noexcept {
  if constexpr (std::is_integral_v<E>) {
    return got == want;
  } else {
    const double g = to_double(got);
    const double w = to_double(want);
    if (std::isnan(w)) return std::isnan(g);
    if (std::isinf(w)) return g == w;
    return std::abs(g - w) <= tolerance<E>() * std::max(1.0, std::abs(w));
  }
}

/// What one rank's output must hold.
struct check_spec {
  collective coll = collective::all_reduce;
  shape sh;
  int ranks = 1;
  int rank = 0;
  int root = 0;
  op reduction = op::sum;
  std::uint32_t seed = 0;
  bool reproducible = false;  ///< --reproducible: exact_sum_row decides what that means here
  wire_format wire = wire_format::full;  ///< --wire: outputs within wire_tolerance
};

/// The difference from the exact result a --wire row allows: quantize::error_bound for inputs of
/// the pattern's magnitude (11), the largest over the ways the ranks may be split into equal
/// nodes (one hop or two, which this check does not know), the output's rounding included.
template <element E>
[[nodiscard]] double wire_tolerance(const check_spec& s) {
  if constexpr (!quantize::supported_v<E>) {
    return 0.0;
  } else {
    const auto shape = s.coll == collective::all_gather       ? quantize::call_shape::gather
                       : s.coll == collective::reduce_scatter ? quantize::call_shape::reduce_blocks
                                                              : quantize::call_shape::reduce_whole;
    double bound = 0;
    for (int per_node = 0; per_node <= s.ranks; ++per_node)
      if (per_node == 0 || s.ranks % per_node == 0)
        bound = std::max(bound, quantize::error_bound<E>(s.wire, shape, s.ranks, per_node, 11.0,
                                                         s.reduction == op::avg));
    return bound;
  }
}

/// Whether this rank's output is defined (reduce and gather leave non-root outputs alone).
[[nodiscard]] inline bool has_output(const check_spec& s) {
  return describe(s.coll).uses_out(s.rank, s.root);
}

/// Counts elements of `out` (s.sh.recv elements, this rank's output) that differ from the
/// reference. With `corrupt_first` the first element is judged as if it had arrived
/// bit-flipped, which is how tests prove that a wrong element makes the run fail.
template <element E>
[[nodiscard]] std::int64_t count_wrong(const check_spec& s, const E* out, bool corrupt_first) {
  if (!has_output(s) || s.sh.recv == 0) return 0;
  const int n = s.ranks;
  std::int64_t wrong = 0;
  E first_want{};
  const bool exact = exact_sum_row<E>(s.reproducible, s.reduction);
  const bool wired = s.wire != wire_format::full;
  const double allowed = wired ? wire_tolerance<E>(s) : 0.0;
  auto same = [&](E got, E want) {
    if (exact) return std::memcmp(&got, &want, sizeof(E)) == 0;
    if (wired) return std::abs(to_double(got) - to_double(want)) <= allowed;
    return matches(got, want);
  };
  // Compares out[begin, begin+len) with `want` read from position `phase` of its period.
  auto compare = [&](const pattern<E>& want, std::size_t begin, std::size_t len,
                     std::size_t phase) {
    if (begin == 0 && len > 0) first_want = want[phase % pattern_period];
    for (std::size_t j = 0, k = phase % pattern_period; j < len; ++j) {
      if (!same(out[begin + j], want[k])) ++wrong;
      if (++k == pattern_period) k = 0;
    }
  };
  switch (s.coll) {
    case collective::all_reduce:
    case collective::reduce:
    case collective::reduce_scatter: {
      if constexpr (reproducible::supported_v<E>) {
        if (exact) {
          // reduce_scatter's output is block rank() of the full vector.
          const std::size_t from = s.coll == collective::reduce_scatter
                                       ? static_cast<std::size_t>(s.rank) * s.sh.param
                                       : 0;
          const auto divisor = static_cast<std::uint32_t>(s.reduction == op::avg ? n : 1);
          std::vector<E> terms(static_cast<std::size_t>(n));
          for (std::size_t j = 0; j < s.sh.recv; ++j) {
            for (int r = 0; r < n; ++r)
              terms[static_cast<std::size_t>(r)] = exact_sum_value<E>(r, from + j, s.seed);
            const E want = reproducible::serial_sum(terms.data(), terms.size(), divisor);
            if (j == 0) first_want = want;
            if (!same(out[j], want)) ++wrong;
          }
          break;
        }
      }
      pattern<E> want = input_pattern<E>(0, s.seed, s.reduction);
      for (int r = 1; r < n; ++r) {
        const pattern<E> other = input_pattern<E>(r, s.seed, s.reduction);
        reduction::combine(s.reduction, want.data(), other.data(), want.data(), pattern_period);
      }
      if (s.reduction == op::avg) reduction::finish_avg(want.data(), pattern_period, n);
      // reduce_scatter's output is block rank() of the full vector.
      const std::size_t phase =
          s.coll == collective::reduce_scatter ? static_cast<std::size_t>(s.rank) * s.sh.param : 0;
      compare(want, 0, s.sh.recv, phase);
      break;
    }
    case collective::all_gather:
      for (int r = 0; r < n; ++r)
        compare(input_pattern<E>(r, s.seed, s.reduction), static_cast<std::size_t>(r) * s.sh.send,
                s.sh.send, 0);
      break;
    case collective::broadcast:
      compare(input_pattern<E>(s.root, s.seed, s.reduction), 0, s.sh.recv, 0);
      break;
    case collective::send_recv:
      compare(input_pattern<E>((s.rank - 1 + n) % n, s.seed, s.reduction), 0, s.sh.recv, 0);
      break;
    case collective::all_to_all:
      // Block r comes from rank r, which sent its block rank() of its input.
      for (int r = 0; r < n; ++r)
        compare(input_pattern<E>(r, s.seed, s.reduction), static_cast<std::size_t>(r) * s.sh.param,
                s.sh.param, static_cast<std::size_t>(s.rank) * s.sh.param);
      break;
    case collective::gather:
      for (int r = 0; r < n; ++r)
        compare(input_pattern<E>(r, s.seed, s.reduction), static_cast<std::size_t>(r) * s.sh.param,
                s.sh.param, 0);
      break;
    case collective::scatter:
      compare(input_pattern<E>(s.root, s.seed, s.reduction), 0, s.sh.recv,
              static_cast<std::size_t>(s.rank) * s.sh.param);
      break;
    case collective::barrier:
    case collective::all_to_allv:
      break;  // not among all_colls: parse_coll never yields them
  }
  if (corrupt_first) {
    unsigned char bytes[sizeof(E)];
    std::memcpy(bytes, &out[0], sizeof(E));
    for (auto& x : bytes) x = static_cast<unsigned char>(~x);
    E flipped;
    std::memcpy(&flipped, bytes, sizeof(E));
    wrong += (same(out[0], first_want) ? 1 : 0) - (same(flipped, first_want) ? 1 : 0);
  }
  return wrong;
}

}  // namespace ringzero::perf
