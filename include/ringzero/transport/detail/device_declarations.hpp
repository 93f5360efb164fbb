// The CUDA device memory a transport was told it moves (register_device_buffer), written once
// for every transport that registers device memory with a NIC (libfabric's mr_cache; the tests'
// stand-in). A declaration is a range, its device and the id of the allocation it lies in
// (kernels::device_allocation): memory freed and allocated again at the same addresses is a new
// allocation with a new id, whose pages a NIC must not reach through a registration of the old
// one, so declaring it replaces the old declaration instead of reusing it. Registrations made
// from declarations may be evicted and made again; the declarations stay until forgotten.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ringzero::detail {

class device_declarations {
 public:
  struct range {
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
    int device = -1;
    std::uint64_t id = 0;  ///< the allocation's; 0 where unknown
    [[nodiscard]] bool overlaps(std::uintptr_t lo, std::uintptr_t hi) const noexcept {
      return begin < hi && lo < end;
    }
  };
  /// What declare() did: `added` unless a declaration of the same allocation covered the range
  /// already; `replaced`, declarations the new one overlaps (another allocation, another
  /// device, or a part of the same one), which the caller deregisters.
  struct outcome {
    bool added = false;
    std::vector<range> replaced;
  };

  /// Declares [p, p+n) memory of `device`, in allocation `id` (0: unknown, matches any).
  outcome declare(const void* p, std::size_t n, int device, std::uint64_t id) {
    const auto lo = reinterpret_cast<std::uintptr_t>(p);
    const auto hi = lo + n;
    for (const range& r : ranges_)
      if (r.device == device && r.begin <= lo && hi <= r.end &&
          (id == 0 || r.id == 0 || r.id == id))
        return {};
    outcome o;
    o.added = true;
    std::erase_if(ranges_, [&](const range& r) {
      if (!r.overlaps(lo, hi)) return false;
      o.replaced.push_back(r);
      return true;
    });
    ranges_.push_back({lo, hi, device, id});
    return o;
  }

  /// The declaration holding all of [p, p+n), or null.
  [[nodiscard]] const range* covering(const void* p, std::size_t n) const noexcept {
    const auto lo = reinterpret_cast<std::uintptr_t>(p);
    for (const range& r : ranges_)
      if (r.begin <= lo && lo + n <= r.end) return &r;
    return nullptr;
  }
  /// Whether any declaration overlaps [p, p+n).
  [[nodiscard]] bool overlaps(const void* p, std::size_t n) const noexcept {
    const auto lo = reinterpret_cast<std::uintptr_t>(p);
    return std::any_of(ranges_.begin(), ranges_.end(),
                       [&](const range& r) { return r.overlaps(lo, lo + n); });
  }
  /// Drops every declaration overlapping [p, p+n).
  void forget(const void* p, std::size_t n) {
    const auto lo = reinterpret_cast<std::uintptr_t>(p);
    std::erase_if(ranges_, [&](const range& r) { return r.overlaps(lo, lo + n); });
  }

  [[nodiscard]] const std::vector<range>& all() const noexcept { return ranges_; }
  [[nodiscard]] std::size_t size() const noexcept { return ranges_.size(); }
  [[nodiscard]] bool empty() const noexcept { return ranges_.empty(); }

 private:
  std::vector<range> ranges_;
};

}  // namespace ringzero::detail
