// Building blocks the tree-shaped and butterfly algorithms share: messages cut into chunks
// (so no single message exceeds the transport's chunk size and reduction overlaps arrival),
// and a non-blocking pipeline that moves chunks up a tree (reduce) and/or down it (broadcast).
// A chain is a tree whose nodes have one child, a binomial tree one whose root has log2(n);
// the double binary tree runs two pipelines side by side.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::detail {

using ringzero::detail::exchange;

/// `elems` elements of the communicator's scratch buffer. One algorithm call takes it once and
/// carves it: a second call would be free to move it.
template <element E, collective_comm T>
[[nodiscard]] std::span<E> scratch_of(T& comm, std::size_t elems) {
  auto raw = comm.state().scratch(elems * sizeof(E));
  return {reinterpret_cast<E*>(raw.data()), elems};
}

template <collective_comm T>
[[nodiscard]] std::size_t chunk_bytes_of(const T& comm, const options& opt) {
  const tuning::policy& cp = comm.tuning();
  return std::max(opt.chunk_bytes ? opt.chunk_bytes : cp.chunk_bytes, cp.min_chunk_bytes);
}

/// Chunk length (elements) for a message of `len` elements; sender and receiver of one message
/// both know its length, so they cut it identically.
template <element E>
[[nodiscard]] std::size_t chunk_elems(std::size_t len, std::size_t chunk_bytes) {
  return chunking::make(len, sizeof(E), chunk_bytes).chunk;
}

/// Chunk length for a message whose chunks are all posted at once: at most `burst` of them
/// (the transport's tuning::policy::burst).
template <element E>
[[nodiscard]] std::size_t burst_chunk_elems(std::size_t len, std::size_t chunk_bytes,
                                            std::size_t burst) {
  return chunking::make(len, sizeof(E), chunk_bytes, burst).chunk;
}

template <collective_comm T, element E>
void post_sends(exchange<T>& ex, int peer, int step, std::span<const E> data,
                std::size_t chunk_bytes, std::vector<typename exchange<T>::pending>& into) {
  const std::size_t c = burst_chunk_elems<E>(data.size(), chunk_bytes, ex.comm().tuning().burst);
  for (std::size_t i = 0, id = 0; i < data.size(); i += c, ++id)
    into.push_back(ex.send(peer, step, static_cast<std::uint32_t>(id),
                           std::as_bytes(data.subspan(i, std::min(c, data.size() - i)))));
}

template <collective_comm T, element E>
void post_recvs(exchange<T>& ex, int peer, int step, std::span<E> data, std::size_t chunk_bytes,
                std::vector<typename exchange<T>::pending>& into) {
  const std::size_t c = burst_chunk_elems<E>(data.size(), chunk_bytes, ex.comm().tuning().burst);
  for (std::size_t i = 0, id = 0; i < data.size(); i += c, ++id)
    into.push_back(ex.recv(peer, step, static_cast<std::uint32_t>(id),
                           std::as_writable_bytes(data.subspan(i, std::min(c, data.size() - i)))));
}

/// Sends `data` to `peer` and waits for it.
template <collective_comm T, element E>
void send_all(exchange<T>& ex, int peer, int step, std::span<const E> data,
              std::size_t chunk_bytes) {
  std::vector<typename exchange<T>::pending> ps;
  post_sends(ex, peer, step, data, chunk_bytes, ps);
  ex.wait_all(ps);
}

template <collective_comm T, element E>
void recv_all(exchange<T>& ex, int peer, int step, std::span<E> data, std::size_t chunk_bytes) {
  std::vector<typename exchange<T>::pending> ps;
  post_recvs(ex, peer, step, data, chunk_bytes, ps);
  ex.wait_all(ps);
}

/// Sends `mine` to `to` while receiving `theirs` from `from`, and calls on_chunk(begin, size)
/// for each chunk of `theirs` as it lands, so reducing it overlaps the rest of the transfer.
/// With `overlap` (the caller writes over what it sends) a chunk is handed over only once the
/// send chunk at the same position left; `mine` and `theirs` then have equal lengths.
template <collective_comm T, element E, class F>
void swap_chunks(exchange<T>& ex, int to, std::span<const E> mine, int from, std::span<E> theirs,
                 int step, std::size_t chunk_bytes, bool overlap, F&& on_chunk) {
  std::vector<typename exchange<T>::pending> recvs, sends;
  post_recvs(ex, from, step, theirs, chunk_bytes, recvs);
  post_sends(ex, to, step, mine, chunk_bytes, sends);
  const std::size_t c = burst_chunk_elems<E>(theirs.size(), chunk_bytes, ex.comm().tuning().burst);
  for (std::size_t i = 0; i < recvs.size(); ++i) {
    if (overlap) ex.wait(sends[i]);
    ex.wait(recvs[i]);
    on_chunk(i * c, std::min(c, theirs.size() - i * c));
  }
  ex.wait_all(sends);
}

// ---------------------------------------------------------------------------------------------

/// Where a rank sits in one tree. `children` are listed in the order their partial results
/// are combined, and the rank's own contribution goes before children[self]; self is 0 or 1,
/// so the own operand is always among the first two (an in-place input is read before the
/// destination it shares memory with is written).
struct tree_node {
  int parent = -1;  ///< -1 at the root
  std::vector<int> children;
  std::size_t self = 0;
};

enum class flow : std::uint8_t {
  reduce,      ///< partial results flow to the root; out is written only there
  broadcast,   ///< out flows from the root to everyone
  all_reduce,  ///< reduce then broadcast, chunk by chunk, both directions at once
};

/// One tree, one contiguous range, cut into chunks that move independently: a node combines
/// chunk c as soon as its children's chunk c arrived, while chunk c+1 is still on its way.
/// advance() never blocks, so several pipelines (the two halves of a double binary tree) share
/// one thread; drive() runs them.
///
/// Receives from children land in `window` slots per child, so a child is at most `window`
/// chunks ahead of its parent and scratch stays small whatever the message size. Sends to the
/// parent, receives from it and sends to each child are each kept to `inflight` chunks (the
/// transport's tuning::policy::inflight), so
/// the messages in flight stay bounded whatever the message size: a transport can only queue
/// so many (libfabric's shm provider runs out of receive entries otherwise), and chunks
/// posted far ahead gain nothing once the link is busy.
template <collective_comm T, element E>
class tree_pipeline {
 public:
  using pending = typename exchange<T>::pending;
  static constexpr std::size_t window = 2;

  /// Scratch elements a pipeline with this node, flow and chunk length needs.
  [[nodiscard]] static std::size_t scratch_elems(const tree_node& node, flow f, std::size_t chunk) {
    if (f == flow::broadcast) return 0;
    std::size_t slots = node.children.size() * window;
    if (keeps_partials(node, f)) slots += window;
    return slots * chunk;
  }

  /// Up-going chunks carry tag step `step`, down-going ones `step + 1`. avg is finished on the
  /// root (dividing by `ranks`), so every rank receives the same bits.
  tree_pipeline(exchange<T>& ex, tree_node node, flow f, op o, int ranks, const E* in, E* out,
                std::size_t count, std::size_t chunk, std::span<E> scratch, int step)
      : ex_(ex),
        node_(std::move(node)),
        flow_(f),
        op_(o),
        ranks_(ranks),
        in_(in),
        out_(out),
        count_(count),
        chunk_(chunk),
        chunks_(count == 0 ? 0 : (count + chunk - 1) / chunk),
        slots_(scratch.empty() ? nullptr : scratch.data()),
        partials_(keeps_partials(node_, f) ? slots_ + node_.children.size() * window * chunk
                                           : nullptr),
        step_(step),
        inflight_(std::max<std::size_t>(1, ex.comm().tuning().inflight)) {
    const std::size_t k = node_.children.size();
    if (reduces()) {
      child_recvs_.resize(k * window);
      if (!root()) up_sends_.resize(chunks_);
    }
    if (broadcasts()) {
      if (!root()) down_recvs_.resize(chunks_);
      down_sends_.resize(chunks_ * k);
    }
    // A broadcast root has every chunk from the start.
    if (flow_ == flow::broadcast && root()) ready_ = chunks_;
  }

  tree_pipeline(const tree_pipeline&) = delete;
  tree_pipeline& operator=(const tree_pipeline&) = delete;

  /// Does whatever can be done without waiting; true if anything moved.
  bool advance() {
    bool moved = false;
    if (reduces()) {
      while (posted_ < chunks_ && posted_ < up_head_ + window) {
        post_child_recvs(posted_++);
        moved = true;
      }
      while (up_head_ < posted_ && ready_to_combine(up_head_)) {
        combine(up_head_++);
        moved = true;
      }
    }
    if (broadcasts() && !root()) {
      // In all_reduce the final chunk overwrites the partial we sent up: that send must be
      // gone before the receive is posted.
      const std::size_t limit =
          std::min(flow_ == flow::all_reduce ? up_head_ : chunks_, down_head_ + inflight_);
      while (down_posted_ < limit &&
             (flow_ != flow::all_reduce || ex_.test(up_sends_[down_posted_]))) {
        const auto r = range(down_posted_);
        down_recvs_[down_posted_] =
            ex_.recv(node_.parent, step_ + 1, static_cast<std::uint32_t>(down_posted_),
                     std::as_writable_bytes(std::span<E>(out_ + r.begin, r.size)));
        ++down_posted_;
        moved = true;
      }
      while (down_head_ < down_posted_ && ex_.test(down_recvs_[down_head_])) {
        ++down_head_;
        ready_ = down_head_;
        moved = true;
      }
    }
    if (broadcasts()) {
      while (down_sent_ < ready_ && (down_sent_ < inflight_ || sent_down(down_sent_ - inflight_))) {
        send_down(down_sent_++);
        moved = true;
      }
    }
    return moved;
  }

  /// Everything this rank receives has arrived and everything it sends is posted; only its
  /// own sends may still be in flight.
  [[nodiscard]] bool done() const {
    if (reduces() && up_head_ < chunks_) return false;
    if (broadcasts() && !root() && down_head_ < chunks_) return false;
    if (broadcasts() && !node_.children.empty() && down_sent_ < chunks_) return false;
    return true;
  }

  /// Waits for the remaining sends. Safe to block: every receive a peer needs is posted.
  void finish() {
    ex_.wait_all(up_sends_);
    ex_.wait_all(down_sends_);
  }

 private:
  struct span_range {
    std::size_t begin;
    std::size_t size;
  };

  [[nodiscard]] static bool keeps_partials(const tree_node& node, flow f) {
    return f == flow::reduce && node.parent >= 0 && !node.children.empty();
  }
  [[nodiscard]] bool root() const { return node_.parent < 0; }
  [[nodiscard]] bool reduces() const { return flow_ != flow::broadcast; }
  [[nodiscard]] bool broadcasts() const { return flow_ != flow::reduce; }
  [[nodiscard]] span_range range(std::size_t c) const {
    const std::size_t b = c * chunk_;
    return {b, std::min(chunk_, count_ - b)};
  }
  [[nodiscard]] E* slot(std::size_t child, std::size_t c) const {
    return slots_ + (child * window + c % window) * chunk_;
  }

  void post_child_recvs(std::size_t c) {
    const auto r = range(c);
    for (std::size_t k = 0; k < node_.children.size(); ++k)
      child_recvs_[k * window + c % window] =
          ex_.recv(node_.children[k], step_, static_cast<std::uint32_t>(c),
                   std::as_writable_bytes(std::span<E>(slot(k, c), r.size)));
  }

  [[nodiscard]] bool ready_to_combine(std::size_t c) {
    for (std::size_t k = 0; k < node_.children.size(); ++k)
      if (!ex_.test(child_recvs_[k * window + c % window])) return false;
    // The partial slot is reused every `window` chunks, so its last send must have left;
    // other senders keep `inflight` chunks on their way up.
    if (!root()) {
      const std::size_t lag = keeps_partials(node_, flow_) ? window : inflight_;
      if (c >= lag && !ex_.test(up_sends_[c - lag])) return false;
    }
    return true;
  }

  /// Chunk c has left for every child.
  [[nodiscard]] bool sent_down(std::size_t c) {
    const std::size_t k = node_.children.size();
    for (std::size_t i = 0; i < k; ++i)
      if (!ex_.test(down_sends_[c * k + i])) return false;
    return true;
  }

  void combine(std::size_t c) {
    const auto r = range(c);
    const std::size_t k = node_.children.size();
    const E* own = in_ + r.begin;
    const E* result = own;  // a leaf sends its input as it is
    if (k > 0) {
      E* dest = keeps_partials(node_, flow_) ? partials_ + (c % window) * chunk_ : out_ + r.begin;
      auto operand = [&](std::size_t i) -> const E* {
        if (i == node_.self) return own;
        return slot(i < node_.self ? i : i - 1, c);
      };
      reduction::combine(op_, operand(0), operand(1), dest, r.size);
      for (std::size_t i = 2; i <= k; ++i) reduction::combine(op_, dest, operand(i), dest, r.size);
      result = dest;
    }
    if (!root()) {
      up_sends_[c] = ex_.send(node_.parent, step_, static_cast<std::uint32_t>(c),
                              std::as_bytes(std::span<const E>(result, r.size)));
      return;
    }
    if (k == 0 && own != out_ + r.begin) std::memcpy(out_ + r.begin, own, r.size * sizeof(E));
    if (op_ == op::avg) reduction::finish_avg(out_ + r.begin, r.size, ranks_);
    if (flow_ == flow::all_reduce) ready_ = c + 1;
  }

  void send_down(std::size_t c) {
    const auto r = range(c);
    const std::size_t k = node_.children.size();
    for (std::size_t i = 0; i < k; ++i)
      down_sends_[c * k + i] = ex_.send(node_.children[i], step_ + 1, static_cast<std::uint32_t>(c),
                                        std::as_bytes(std::span<const E>(out_ + r.begin, r.size)));
  }

  exchange<T>& ex_;
  tree_node node_;
  flow flow_;
  op op_;
  int ranks_;
  const E* in_;
  E* out_;
  std::size_t count_;
  std::size_t chunk_;
  std::size_t chunks_;
  E* slots_;
  E* partials_;
  int step_;
  std::size_t inflight_;

  std::vector<pending> child_recvs_;
  std::vector<pending> up_sends_;
  std::vector<pending> down_recvs_;
  std::vector<pending> down_sends_;
  std::size_t posted_ = 0;       ///< chunks whose child receives are posted
  std::size_t up_head_ = 0;      ///< chunks combined (and sent up)
  std::size_t down_posted_ = 0;  ///< chunks whose receive from the parent is posted
  std::size_t down_head_ = 0;    ///< chunks received from the parent
  std::size_t ready_ = 0;        ///< chunks final in out_, ready to go down
  std::size_t down_sent_ = 0;    ///< chunks sent to the children
};

/// Drives pipelines until each has everything it receives, then waits for their sends.
template <collective_comm T, element E, class... P>
void drive(tree_pipeline<T, E>& first, P&... rest) {
  ringzero::detail::backoff b;
  while (!(first.done() && (rest.done() && ...))) {
    // Every pipeline advances on every pass (no short circuit): a logical `||` would starve the
    // later ones while the first keeps moving.
    const bool moved =
        (static_cast<int>(first.advance()) | ... | static_cast<int>(rest.advance())) != 0;
    if (moved)
      b.reset();
    else
      b.pause();
  }
  first.finish();
  (rest.finish(), ...);
}

}  // namespace ringzero::algorithms::detail
