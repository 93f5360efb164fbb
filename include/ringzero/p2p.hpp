// Non-blocking, tagged point-to-point messages, for runtimes that post sends and receives before
// they wait on any of them (torch.distributed's isend/irecv and batch_isend_irecv): two ranks
// that each post a receive from the other and then a send to it must not deadlock, which the
// blocking send()/recv() of collectives.hpp cannot promise.
//
//   auto r = ringzero::irecv(comm, std::span<float>(in), peer, /*tag=*/7);
//   auto s = ringzero::isend(comm, std::span<const float>(out), peer, 7);
//   s.wait();
//   r.wait();
//
// Matching: a receive matches the send of the same (peer, tag) posted in the same position, as
// MPI's non-overtaking rule says; tags keep streams apart, and the size of a receive must be the
// size of its send (the transport refuses a mismatch, naming both sizes). Tag 0 is the stream
// that send(), recv() and send_recv() use, so the two APIs can be mixed.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <span>
#include <string_view>
#include <utility>

#include "ringzero/communicator.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/detail/validate.hpp"
#include "ringzero/error.hpp"
#include "ringzero/types.hpp"

namespace ringzero {

/// The largest tag isend()/irecv() accept: a tag takes the step and chunk fields of a message's
/// wire tag (tag_layout), 28 bits, beside a sequence number per (peer, tag).
inline constexpr std::uint32_t max_p2p_tag =
    (std::uint32_t{1} << (tag_layout::step_bits + tag_layout::chunk_bits)) - 1;

namespace detail {
struct p2p_post;
}  // namespace detail

/// One posted isend() or irecv(). Destroying it unfinished cancels the message (the
/// transport's rule: a receive is never written afterwards). The communicator must outlive it.
template <transport T>
class p2p_request {
 public:
  p2p_request() = default;

  /// True once the message completed (then the receive buffer holds it, or the send buffer may
  /// be reused). Moves every message of the transport, not only this one. Throws peer_error
  /// when the peer is known dead, and timeout_error naming the peer once the communicator's
  /// deadline (or the options' timeout) passed since posting without completion.
  [[nodiscard]] bool test() {
    if (done()) return true;
    if (comm_->test(req_)) {
      done_ = true;
      return true;
    }
    if (detail::clock::now() > deadline_) throw timed_out();
    return false;
  }

  /// Blocks until test() is true (or throws what test() throws).
  void wait() {
    if (done()) return;
    detail::backoff b = detail::backoff_for(comm_->topo().local_size);
    while (!test()) b.pause();
  }

  /// Whether the message completed (or nothing was posted).
  [[nodiscard]] bool done() const noexcept { return comm_ == nullptr || done_; }
  [[nodiscard]] int peer() const noexcept { return peer_; }
  [[nodiscard]] std::uint32_t tag() const noexcept { return tag_; }

 private:
  friend struct detail::p2p_post;

  [[nodiscard]] timeout_error timed_out() const {
    std::string what = fmt::format(
        "{} on rank {} of {}: the message of {} bytes {} rank {} (tag {}) did not complete "
        "within {:g} s (RINGZERO_TIMEOUT sets the limit)",
        is_send_ ? "isend" : "irecv", comm_->rank(), comm_->size(), bytes_,
        is_send_ ? "to" : "from", peer_, tag_, std::chrono::duration<double>(timeout_).count());
    if constexpr (requires { comm_->failed_rank(); }) {
      if (const int dead = comm_->failed_rank(); dead >= 0 && dead != peer_)
        return timeout_error(fmt::format("{}; rank {} has died", what, dead), dead);
    }
    return timeout_error(what, peer_);
  }

  communicator<T>* comm_ = nullptr;
  typename communicator<T>::request req_{};
  detail::clock::time_point deadline_{};
  std::chrono::nanoseconds timeout_{0};
  std::size_t bytes_ = 0;
  int peer_ = -1;
  std::uint32_t tag_ = 0;
  bool is_send_ = false;
  bool done_ = false;
};

namespace detail {

struct p2p_post {
  template <class T>
  [[nodiscard]] static p2p_request<T> post(communicator<T>& comm, std::string_view what, int peer,
                                           std::uint32_t tag, bool is_send,
                                           std::span<const std::byte> out, std::span<std::byte> in,
                                           const options& opt) {
    comm.check_usable(what);
    check_options(what, opt);
    check_peer(what, comm.rank(), comm.size(), peer);
    if (tag > max_p2p_tag)
      throw invalid_argument(
          fmt::format("{}: tag {} is above the largest tag, {}", what, tag, max_p2p_tag));
    comm_state& st = comm.state();
    const auto p = static_cast<std::size_t>(peer);
    std::uint32_t seq = 0;
    if (tag == 0) {
      // The stream of send()/recv(): their per-peer sequence numbers, their wire tags.
      auto& seqs = is_send ? st.p2p_send_seq : st.p2p_recv_seq;
      seqs.resize(static_cast<std::size_t>(comm.size()));
      seq = seqs[p]++;
    } else {
      auto& seqs = is_send ? st.p2p_tagged_send_seq : st.p2p_tagged_recv_seq;
      seq = seqs[{peer, tag}]++;
    }
    const tag_t wire =
        make_tag(true, seq, tag >> tag_layout::chunk_bits, tag & tag_layout::chunk_mask);
    p2p_request<T> r;
    r.timeout_ = opt.timeout.count() > 0 ? opt.timeout : std::chrono::nanoseconds(comm.timeout());
    r.req_ = is_send ? comm.isend(peer, wire, out) : comm.irecv(peer, wire, in);
    r.comm_ = &comm;
    r.deadline_ = clock::now() + r.timeout_;
    r.bytes_ = is_send ? out.size_bytes() : in.size_bytes();
    r.peer_ = peer;
    r.tag_ = tag;
    r.is_send_ = is_send;
    return r;
  }
};

}  // namespace detail

/// Posts `data` to `peer` under `tag` (0 .. max_p2p_tag) and returns at once; the buffer must
/// stay untouched until the request is done. Host transports only (NCCL orders its own
/// point-to-point calls on a stream: use send()/recv() there).
template <class T, element E>
requires messaging<T>
[[nodiscard]] p2p_request<T> isend(communicator<T>& comm, std::span<const E> data, int peer,
                                   std::uint32_t tag = 0, const options& opt = {}) {
  return detail::p2p_post::post(comm, "isend", peer, tag, true, std::as_bytes(data), {}, opt);
}

template <class T, element E>
requires messaging<T>
[[nodiscard]] p2p_request<T> isend(communicator<T>& comm, std::span<E> data, int peer,
                                   std::uint32_t tag = 0, const options& opt = {}) {
  return isend(comm, std::span<const E>(data), peer, tag, opt);
}

/// Posts a receive of exactly data.size() elements from `peer` under `tag` and returns at once.
template <class T, element E>
requires messaging<T>
[[nodiscard]] p2p_request<T> irecv(communicator<T>& comm, std::span<E> data, int peer,
                                   std::uint32_t tag = 0, const options& opt = {}) {
  return detail::p2p_post::post(comm, "irecv", peer, tag, false, {}, std::as_writable_bytes(data),
                                opt);
}

}  // namespace ringzero
