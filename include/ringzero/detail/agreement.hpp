// "Every rank made the same call": one record per rank, compared with one rank's, the lowest
// rank that differs named in the error every rank raises alike. Three places ask it and differ
// only in how the records travel: RINGZERO_CHECK before a collective (exchange_records, or a
// backend's own all_gather_bytes), the shm segment's collectives at their first phase (records
// side by side in the segment) and RINGZERO_TUNING's file when a communicator is made
// (exchange_records). call_record is what the first two compare; the third compares its own.
//
// This header needs nothing above the transports; exchange_records, which posts messages, is in
// detail/exchange_records.hpp.
#pragma once

#include <fmt/core.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "ringzero/algorithm.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"
#include "ringzero/wire.hpp"

namespace ringzero::detail {

/// How a backend reads its peers' buffers for a call, where ranks must agree on it too (the shm
/// segment's collectives); 0 elsewhere.
enum class call_path : std::uint8_t {
  segment,       ///< through a shared workspace
  symmetric,     ///< buffers in symmetric memory, read and written in place
  cross_memory,  ///< inputs read from the peers' address spaces
};

/// What a rank is about to run. Compared byte for byte: every field is set on every rank, the
/// ones a collective ignores to 0.
struct call_record {
  std::uint8_t kind = 0;       ///< collective
  std::uint8_t type = 0;       ///< dtype
  std::uint8_t reduction = 0;  ///< op, where the collective reduces
  std::uint8_t algo = 0;       ///< options::algorithm
  call_path path = call_path::segment;
  std::uint8_t reproducible = 0;  ///< 1: options::reproducible's exact sum
  std::uint8_t wire = 0;          ///< options::wire
  std::uint8_t pad = 0;
  std::int32_t root = 0;         ///< where the collective has one
  std::uint32_t wire_block = 0;  ///< options::wire_block in use, where wire is not full
  std::uint64_t count = 0;
  /// Byte for byte, as the records travel: three words, compared on every shm segment call.
  friend bool operator==(const call_record& a, const call_record& b) noexcept {
    return std::memcmp(&a, &b, sizeof a) == 0;
  }
};
static_assert(sizeof(call_record) == 24, "the shm segment keeps two records in a cache line");
static_assert(std::has_unique_object_representations_v<call_record>,
              "no padding: records are compared byte for byte");

/// A record as an error names it; `algorithm_name` (algorithms/table.hpp's, which this header
/// cannot include) names options::algorithm where given.
[[nodiscard]] inline std::string describe(const call_record& r,
                                          std::string_view (*algorithm_name)(algorithm) = nullptr) {
  const std::string_view path = r.path == call_path::symmetric ? ", buffers in symmetric memory"
                                : r.path == call_path::cross_memory
                                    ? ", inputs read across processes"
                                    : "";
  return fmt::format(
      "{} (count {}, type {}, op {}{}, root {}{}{}{})",
      collective_name(static_cast<collective>(r.kind)), r.count,
      dtype_name(static_cast<dtype>(r.type)), op_name(static_cast<op>(r.reduction)),
      r.reproducible != 0 ? ", reproducible" : "", r.root,
      algorithm_name != nullptr
          ? fmt::format(", algorithm {}", algorithm_name(static_cast<algorithm>(r.algo)))
          : std::string(),
      r.wire != 0 ? fmt::format(", wire {} in blocks of {}",
                                wire_format_name(static_cast<wire_format>(r.wire)), r.wire_block)
                  : std::string(),
      path);
}

/// The lowest rank, other than `self`, whose record `record_of(rank)` does not agree with
/// `mine` (`same(a, b)`, default ==); -1 when all agree.
template <class R, class F, class Same = std::equal_to<>>
[[nodiscard]] int first_disagreeing(int ranks, int self, const R& mine, F&& record_of,
                                    Same same = {}) {
  for (int r = 0; r < ranks; ++r)
    if (r != self && !same(record_of(r), mine)) return r;
  return -1;
}

}  // namespace ringzero::detail
