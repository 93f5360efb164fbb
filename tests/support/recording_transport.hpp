// A transport that forwards everything to another one and remembers each send it posts, so a
// test can see which algorithm ran from who sent what to whom, without the algorithm knowing.
// It is also the smallest example of a transport: messaging and a tuning policy, nothing else.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "ringzero/transport/concept.hpp"

namespace ringzero::testing {

template <messaging Inner>
class recording {
 public:
  using request = typename Inner::request;

  /// One posted send. `tag` keeps only the (step, chunk) bits: the sequence number and the
  /// communicator id differ from call to call.
  struct sent {
    int peer = -1;
    tag_t tag = 0;
    std::size_t bytes = 0;
    friend bool operator==(const sent&, const sent&) = default;
  };

  explicit recording(Inner& inner) : inner_(&inner) {}

  [[nodiscard]] int rank() const { return inner_->rank(); }
  [[nodiscard]] int size() const { return inner_->size(); }
  [[nodiscard]] tuning::policy tuning() const { return inner_->tuning(); }
  [[nodiscard]] request isend(int peer, tag_t tag, std::span<const std::byte> data) {
    sends_.push_back({peer, tag & ((tag_t{1} << tag_layout::sequence_shift) - 1), data.size()});
    return inner_->isend(peer, tag, data);
  }
  [[nodiscard]] request irecv(int peer, tag_t tag, std::span<std::byte> data) {
    return inner_->irecv(peer, tag, data);
  }
  [[nodiscard]] bool test(request& r) { return inner_->test(r); }
  void progress() { inner_->progress(); }

  [[nodiscard]] const std::vector<sent>& sends() const noexcept { return sends_; }
  void clear() noexcept { sends_.clear(); }

 private:
  Inner* inner_;
  std::vector<sent> sends_;
};

}  // namespace ringzero::testing
