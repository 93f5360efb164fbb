// The vocabulary every layer shares, below all of them: where a rank sits (topology) and what a
// message tag holds (tag_t, tag_layout). The transports match tags, the algorithms fill them,
// tuning prices by topology, traces decode them; none of that makes this header depend on any
// of them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ringzero {

/// Where a rank sits: ranks with the same node id share a host (hierarchical algorithms).
struct topology {
  int node = 0;
  int local_rank = 0;
  int local_size = 1;
  int node_count = 1;
};

/// A message tag: 64 bits, of which the algorithm's part is the low 52.
using tag_t = std::uint64_t;

/// The wire format of a tag, in one place:
///   [comm id : 12][p2p : 1][sequence : 23][step : 12][chunk : 16]
/// The communicator fills the top 12 bits with its id, so communicators that share a
/// transport (split()) never match each other's messages; the exchange fills the rest.
/// Steps and chunks wrap: two messages between the same pair of ranks share a tag only if they
/// are 4096 steps or 65536 chunks apart within one collective, which the pipelines never are.
struct tag_layout {
  static constexpr int chunk_bits = 16;
  static constexpr int step_bits = 12;
  static constexpr int sequence_bits = 23;
  static constexpr int p2p_bits = 1;
  static constexpr int comm_id_bits = 12;

  static constexpr int chunk_shift = 0;
  static constexpr int step_shift = chunk_shift + chunk_bits;
  static constexpr int sequence_shift = step_shift + step_bits;
  static constexpr int p2p_shift = sequence_shift + sequence_bits;
  /// Bits an algorithm's tag uses; the communicator id sits above them.
  static constexpr int algorithm_bits = p2p_shift + p2p_bits;
  static constexpr int total_bits = algorithm_bits + comm_id_bits;

  static constexpr std::uint32_t chunk_mask = (1u << chunk_bits) - 1;
  static constexpr std::uint32_t step_mask = (1u << step_bits) - 1;
  static constexpr std::uint32_t sequence_mask = (1u << sequence_bits) - 1;
  static constexpr tag_t algorithm_mask = (tag_t{1} << algorithm_bits) - 1;
  /// The most chunks one message of a collective may be cut into (chunk ids must fit).
  static constexpr std::size_t max_chunks = std::size_t{1} << chunk_bits;
  /// Communicator ids one transport can tell apart.
  static constexpr std::uint32_t max_comm_ids = 1u << comm_id_bits;

  [[nodiscard]] static constexpr tag_t make(bool p2p, std::uint32_t sequence, std::uint32_t step,
                                            std::uint32_t chunk) noexcept {
    return (static_cast<tag_t>(p2p) << p2p_shift) |
           (static_cast<tag_t>(sequence & sequence_mask) << sequence_shift) |
           (static_cast<tag_t>(step & step_mask) << step_shift) |
           (static_cast<tag_t>(chunk & chunk_mask) << chunk_shift);
  }
  [[nodiscard]] static constexpr tag_t with_comm_id(std::uint32_t id, tag_t tag) noexcept {
    return (static_cast<tag_t>(id) << algorithm_bits) | (tag & algorithm_mask);
  }
  [[nodiscard]] static constexpr std::uint32_t sequence_of(tag_t tag) noexcept {
    return static_cast<std::uint32_t>(tag >> sequence_shift) & sequence_mask;
  }
  [[nodiscard]] static constexpr std::uint32_t step_of(tag_t tag) noexcept {
    return static_cast<std::uint32_t>(tag >> step_shift) & step_mask;
  }
  [[nodiscard]] static constexpr std::uint32_t chunk_of(tag_t tag) noexcept {
    return static_cast<std::uint32_t>(tag >> chunk_shift) & chunk_mask;
  }
};

static_assert(tag_layout::total_bits == 64, "the tag layout fills exactly 64 bits");
static_assert(tag_layout::algorithm_bits == 52, "transports reserve 12 bits above 52");
static_assert(tag_layout::make(true, tag_layout::sequence_mask, tag_layout::step_mask,
                               tag_layout::chunk_mask) == tag_layout::algorithm_mask,
              "the algorithm fields tile their 52 bits without gaps or overlap");
static_assert(tag_layout::sequence_of(tag_layout::make(false, 7, 300, 9)) == 7 &&
                  tag_layout::step_of(tag_layout::make(false, 7, 300, 9)) == 300 &&
                  tag_layout::chunk_of(tag_layout::make(false, 7, 300, 9)) == 9,
              "fields read back what was written");

/// Bits of an algorithm's tag (the communicator id goes above them).
inline constexpr int tag_bits = tag_layout::algorithm_bits;

}  // namespace ringzero
