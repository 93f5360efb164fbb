// Matching on the host, for rails whose link only carries bytes (a TCP connection, a test's
// mailbox): which posted receive an arriving message goes to, and where a message nobody posted
// for waits. The rule is rail.hpp's: a receive takes the first message from its peer with its
// piece number and its tag (bits in its `ignore` not compared), and a message the first receive
// posted for it, whether receives name their peer and tag exactly or not (the rail engine's own
// statements are received from any peer, under a tag mask).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <iterator>
#include <map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace ringzero::detail {

/// Op: a rail_op (world_peer, piece, tag, ignore). Arrival: what a rail keeps of a message
/// nobody posted for (its bytes, or where they are arriving).
template <class Op, class Arrival>
class tag_matcher {
 public:
  struct key {
    int peer = -1;
    std::uint8_t piece = 0;
    std::uint64_t tag = 0;
    friend bool operator<(const key& a, const key& b) noexcept {
      return std::tie(a.peer, a.piece, a.tag) < std::tie(b.peer, b.piece, b.tag);
    }
  };

  /// Posts receive `o`, which claim() found nothing for.
  void post(Op* o) {
    const std::uint64_t at = next_++;
    if (wildcard(*o))
      wild_.push_back({o, at});
    else
      exact_[key_of(*o)].push_back({o, at});
  }

  /// Takes back a posted receive; false when it is not posted (it matched already).
  bool withdraw(Op* o) {
    if (wildcard(*o)) return erase_from(wild_, o);
    const auto it = exact_.find(key_of(*o));
    if (it == exact_.end() || !erase_from(it->second, o)) return false;
    if (it->second.empty()) exact_.erase(it);
    return true;
  }

  /// The receive a message from `peer` with `piece` and `tag` goes to, taken off the list; null
  /// when none is posted.
  [[nodiscard]] Op* match(int peer, std::uint8_t piece, std::uint64_t tag) {
    const auto it = exact_.find(key{peer, piece, tag});
    const entry* best = it != exact_.end() ? &it->second.front() : nullptr;
    auto wild = wild_.end();
    for (auto w = wild_.begin(); w != wild_.end(); ++w)
      if (takes(*w->op, peer, piece, tag)) {
        wild = w;
        break;
      }
    if (wild != wild_.end() && (!best || wild->at < best->at)) {
      Op* o = wild->op;
      wild_.erase(wild);
      return o;
    }
    if (!best) return nullptr;
    Op* o = best->op;
    it->second.pop_front();
    if (it->second.empty()) exact_.erase(it);
    return o;
  }

  /// Keeps a message nobody posted for, until a receive claims it.
  void keep(int peer, std::uint8_t piece, std::uint64_t tag, Arrival a) {
    kept_[key{peer, piece, tag}].push_back({std::move(a), next_++});
  }

  /// For receive `o` about to be posted: the message kept first that it takes, taken off the
  /// list, and the peer it came from.
  [[nodiscard]] std::optional<std::pair<int, Arrival>> claim(const Op& o) {
    auto found = kept_.end();
    if (!wildcard(o)) {
      found = kept_.find(key_of(o));
    } else {
      std::uint64_t first = UINT64_MAX;
      for (auto it = kept_.begin(); it != kept_.end(); ++it)
        if (takes(o, it->first.peer, it->first.piece, it->first.tag) &&
            it->second.front().at < first) {
          first = it->second.front().at;
          found = it;
        }
    }
    if (found == kept_.end()) return std::nullopt;
    std::pair<int, Arrival> out{found->first.peer, std::move(found->second.front().what)};
    found->second.pop_front();
    if (found->second.empty()) kept_.erase(found);
    return out;
  }

  /// The receives posted for `peer` by name, taken off the list in the order they were posted
  /// (its connection is gone); those from any peer stay.
  [[nodiscard]] std::vector<Op*> withdraw_peer(int peer) {
    std::vector<std::pair<std::uint64_t, Op*>> found;
    for (auto it = exact_.begin(); it != exact_.end();) {
      if (it->first.peer != peer) {
        ++it;
        continue;
      }
      for (const entry& e : it->second) found.emplace_back(e.at, e.op);
      it = exact_.erase(it);
    }
    std::sort(found.begin(), found.end());
    std::vector<Op*> out;
    for (const auto& f : found) out.push_back(f.second);
    return out;
  }

  /// Drops what `peer` sent and nobody received.
  void forget(int peer) {
    for (auto it = kept_.begin(); it != kept_.end();)
      it = it->first.peer == peer ? kept_.erase(it) : std::next(it);
  }

  [[nodiscard]] bool has_kept(int peer) const {
    for (const auto& [k, q] : kept_)
      if (k.peer == peer) return true;
    return false;
  }

 private:
  struct entry {
    Op* op;
    std::uint64_t at;
  };
  struct kept_entry {
    Arrival what;
    std::uint64_t at;
  };

  [[nodiscard]] static bool wildcard(const Op& o) noexcept {
    return o.world_peer < 0 || o.ignore != 0;
  }
  [[nodiscard]] static key key_of(const Op& o) noexcept { return {o.world_peer, o.piece, o.tag}; }
  [[nodiscard]] static bool takes(const Op& o, int peer, std::uint8_t piece,
                                  std::uint64_t tag) noexcept {
    return (o.world_peer < 0 || o.world_peer == peer) && o.piece == piece &&
           ((o.tag ^ tag) & ~o.ignore) == 0;
  }
  static bool erase_from(std::deque<entry>& q, Op* o) {
    for (auto it = q.begin(); it != q.end(); ++it)
      if (it->op == o) {
        q.erase(it);
        return true;
      }
    return false;
  }

  std::map<key, std::deque<entry>> exact_;
  std::deque<entry> wild_;
  std::map<key, std::deque<kept_entry>> kept_;
  std::uint64_t next_ = 0;
};

}  // namespace ringzero::detail
