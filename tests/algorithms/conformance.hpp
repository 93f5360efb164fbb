// The conformance matrix every collective test runs: world sizes 1..9, each of the ten element
// types, counts {0, 1, n-1, n, 1009, 65537}, in place and out of place, every algorithm that
// implements the collective plus automatic selection. One loopback world per world size runs
// the whole matrix inside its rank function.
//
// Checks, per case: each rank verifies a slice of the output against the serial reference
// (reference.hpp) and records a digest of all of it; after the world ends the digests of all
// receiving ranks must be equal, so every element is verified on some rank and bitwise equal
// everywhere. Outputs are poisoned before each call, so an element nobody writes is caught.
//
// RINGZERO_CONFORMANCE=reduced keeps every algorithm, type, op and world size but drops the
// largest count. RINGZERO_CONFORMANCE=sizes (the sanitizer builds; `threads` is its old name)
// is reduced with one element type of each size (int8, float16, float, double) instead of all
// ten: which bytes an algorithm touches, and which rank thread touches them when, depends on the
// algorithm, the world, the count and the element size, not on the arithmetic. The arithmetic
// of every type is the reduction kernels', which run under the sanitizers for all ten types in
// test_reduce and test_simd, and on every type through the algorithms in the plain build.
#pragma once

#include <doctest/doctest.h>
#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "reference.hpp"
#include "ringzero/ringzero.hpp"

namespace conformance {

using namespace ringzero;

inline constexpr int max_world = 9;
[[nodiscard]] inline std::string_view conformance_mode() {
  const char* v = std::getenv("RINGZERO_CONFORMANCE");
  return v != nullptr ? std::string_view(v) : std::string_view();
}
/// One element type of each size (RINGZERO_CONFORMANCE=sizes, or its old name threads).
[[nodiscard]] inline bool one_type_per_size() {
  return conformance_mode() == "sizes" || conformance_mode() == "threads";
}
[[nodiscard]] inline bool reduced_mode() {
  return conformance_mode() == "reduced" || one_type_per_size();
}

[[nodiscard]] inline std::vector<std::size_t> counts_for(int n) {
  std::vector<std::size_t> c = {0, 1, static_cast<std::size_t>(n - 1), static_cast<std::size_t>(n),
                                1009};
  if (!reduced_mode()) c.push_back(65537);
  std::sort(c.begin(), c.end());
  c.erase(std::unique(c.begin(), c.end()), c.end());
  return c;
}

[[nodiscard]] inline loopback::world_options world_options_for(int ranks_per_node = 0) {
  loopback::world_options o;
  o.timeout = std::chrono::seconds(60);
  o.ranks_per_node = ranks_per_node;
  return o;
}

/// Calls f(E{}) for each of the ten element types (one of each size under
/// RINGZERO_CONFORMANCE=sizes).
template <class F>
void for_each_type(F&& f) {
  const bool all = !one_type_per_size();
  f(std::int8_t{});
  if (all) f(std::uint8_t{});
  if (all) f(std::int32_t{});
  if (all) f(std::uint32_t{});
  if (all) f(std::int64_t{});
  if (all) f(std::uint64_t{});
  f(float16{});
  f(float{});
  f(double{});
  if (all) f(bfloat16{});
}

/// Distinct inputs per case.
[[nodiscard]] inline std::uint64_t seed_of(dtype t, op o, std::size_t count, int extra = 0) {
  return testing::mix((static_cast<std::uint64_t>(t) << 56) ^
                      (static_cast<std::uint64_t>(o) << 48) ^
                      (static_cast<std::uint64_t>(extra) << 40) ^ count);
}

/// Options for one call on a buffer of `count` elements (the whole all_reduce vector, the
/// reduce_scatter input, the all_gather output). In-place cases use the transport's chunk size
/// (one chunk per message here); out-of-place cases cut the buffer into about 3n chunks (three
/// per ring block), in a size no element size divides, so every pipeline runs with chunks in
/// flight and short last chunks.
template <element E>
[[nodiscard]] options options_for(algorithm a, bool in_place, std::size_t count, int n) {
  options o;
  o.algorithm = a;
  if (!in_place) o.chunk_bytes = count * sizeof(E) / (3 * static_cast<std::size_t>(n)) + 1;
  return o;
}

/// Rank r's share of a buffer of `len` elements, for checks split across ranks.
[[nodiscard]] inline std::pair<std::size_t, std::size_t> slice(std::size_t len, int r, int n) {
  const auto un = static_cast<std::size_t>(n);
  const auto ur = static_cast<std::size_t>(r);
  return {len * ur / un, len * (ur + 1) / un};
}

/// What the ranks of one world found. Rank threads only append here; doctest hears about it
/// from the test's own thread, in report().
class world_log {
 public:
  explicit world_log(int n) : digests_(static_cast<std::size_t>(n)) {}

  void fail(std::string what) {
    std::lock_guard lock(mutex_);
    ++failure_count_;
    if (failures_.size() < 20) failures_.push_back(std::move(what));
  }

  /// Rank `rank` finished case `name` with output digest `d`; every receiving rank records the
  /// same cases in the same order.
  void record(int rank, const std::string& name, std::uint64_t d) {
    if (rank == 0) names_.push_back(name);
    digests_[static_cast<std::size_t>(rank)].push_back(d);
  }

  /// One more case checked (on any rank).
  void checked() { ++checked_; }

  /// Reports every failure and every case whose outputs differ between ranks.
  void report(std::string_view world) {
    CHECK_MESSAGE(checked_ > 0, world << ": no case was checked");
    for (std::size_t r = 1; r < digests_.size(); ++r) {
      if (digests_[r].size() != digests_[0].size()) {
        fail(fmt::format("rank {} recorded {} cases, rank 0 {}", r, digests_[r].size(),
                         digests_[0].size()));
        continue;
      }
      for (std::size_t c = 0; c < digests_[r].size(); ++c)
        if (digests_[r][c] != digests_[0][c])
          fail(fmt::format("{}: rank {}'s output is not bitwise equal to rank 0's", names_[c], r));
    }
    INFO(world);
    for (const auto& f : failures_) FAIL_CHECK(f);
    if (failure_count_ > failures_.size())
      FAIL_CHECK(fmt::format("... and {} more failures", failure_count_ - failures_.size()));
  }

 private:
  std::vector<std::vector<std::uint64_t>> digests_;
  std::vector<std::string> names_;
  std::mutex mutex_;
  std::vector<std::string> failures_;
  std::size_t failure_count_ = 0;
  std::atomic<std::size_t> checked_{0};
};

template <element E>
[[nodiscard]] std::uint64_t digest_of(std::span<const E> s) {
  return testing::digest(std::as_bytes(s));
}

/// Fills `out` with `pattern`'s bytes: an unwritten element then fails its check (a slice
/// checked against the reference is poisoned with the reference's complement separately).
template <element E>
void poison(std::span<E> out, unsigned char pattern) {
  if (!out.empty()) std::memset(static_cast<void*>(out.data()), pattern, out.size_bytes());
}

/// Compares out[lo, hi) with the reduction want(i); reports the first mismatch.
template <element E, class Want>
void check_reduced(world_log& log, const std::string& name, int rank, std::span<const E> out,
                   std::size_t lo, std::size_t hi, Want&& want) {
  log.checked();
  for (std::size_t i = lo; i < hi; ++i) {
    const testing::reduced<E> w = want(i);
    if (!testing::matches(w, out[i])) {
      log.fail(fmt::format("{}: rank {} element {}: expected {}, got {}", name, rank, i,
                           testing::show(w), testing::show(out[i])));
      return;
    }
  }
}

/// Compares out[lo, hi) bit for bit with want(i) (data movement: gather, broadcast).
template <element E, class Want>
void check_exact(world_log& log, const std::string& name, int rank, std::span<const E> out,
                 std::size_t lo, std::size_t hi, Want&& want) {
  log.checked();
  for (std::size_t i = lo; i < hi; ++i) {
    const E w = want(i);
    if (std::memcmp(&w, &out[i], sizeof(E)) != 0) {
      log.fail(fmt::format("{}: rank {} element {}: expected {}, got {}", name, rank, i,
                           testing::show(w), testing::show(out[i])));
      return;
    }
  }
}

/// f(i) for i in [lo, hi), computed once per case and read by index i - lo: the checks of every
/// algorithm and placement of a case want the same elements, and regenerating each one for each
/// check was half the CPU of the data-movement suites.
template <class E, class F>
[[nodiscard]] std::vector<E> tabulate(std::size_t lo, std::size_t hi, F&& f) {
  std::vector<E> t(hi > lo ? hi - lo : 0);
  for (std::size_t i = lo; i < hi; ++i) t[i - lo] = f(i);
  return t;
}

/// Runs f(comm, log) on every rank of a world of n ranks and reports what the log holds.
template <class F>
void run_world(int n, const loopback::world_options& wo, std::string_view name, F&& f) {
  world_log log(n);
  loopback::world w(n, wo);
  w.run([&](loopback::communicator& comm) { f(comm, log); });
  log.report(name);
}

}  // namespace conformance
