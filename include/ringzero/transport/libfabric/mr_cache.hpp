// Memory registrations, cached by address range. Providers that set FI_MR_LOCAL (efa,
// verbs;ofi_rxm) need a registered descriptor for every buffer they touch, and registering
// (pinning) costs tens of microseconds, so a buffer used every step is registered once.
//
// Registrations cover whole pages, so neighbouring buffers of one allocation share one. A
// registration pins the pages it was made for: memory that is unmapped and mapped again at the
// same address must be announced with forget() (communicator::forget_memory), or the provider
// keeps moving the old pages.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ringzero/transport/libfabric/error.hpp"

namespace ringzero::libfabric::detail {

class mr_cache {
 public:
  struct entry {
    entry() = default;
    entry(const entry&) = delete;
    entry& operator=(const entry&) = delete;
    ~entry() {
      if (mr) fi_close(&mr->fid);
    }
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
    fid_mr* mr = nullptr;
    void* desc = nullptr;
    std::size_t in_use = 0;  ///< operations in flight that use it
    std::uint64_t last_use = 0;
    bool stale = false;  ///< forgotten while in use: closed when the last user completes
  };

  /// mr_mode: the provider's FI_MR_* bits; ep: the endpoint FI_MR_ENDPOINT binds to.
  mr_cache(fid_domain* domain, fid_ep* ep, std::uint64_t mr_mode, std::string provider,
           std::size_t capacity = 64)
      : domain_(domain),
        ep_(ep),
        mr_mode_(mr_mode),
        provider_(std::move(provider)),
        capacity_(capacity) {}
  mr_cache(const mr_cache&) = delete;
  mr_cache& operator=(const mr_cache&) = delete;
  ~mr_cache() { clear(); }

  /// A registration covering [p, p+n), counted in use until release(). n > 0.
  [[nodiscard]] entry* acquire(const void* p, std::size_t n) {
    const auto lo = reinterpret_cast<std::uintptr_t>(p);
    const auto hi = lo + n;
    ++clock_;
    for (auto& e : entries_)
      if (!e->stale && e->begin <= lo && hi <= e->end) {
        ++e->in_use;
        e->last_use = clock_;
        ++hits_;
        return e.get();
      }
    evict();
    const std::uintptr_t page = page_size();
    auto e = std::make_unique<entry>();
    e->begin = lo & ~(page - 1);
    e->end = (hi + page - 1) & ~(page - 1);
    register_range(*e);
    e->in_use = 1;
    e->last_use = clock_;
    entries_.push_back(std::move(e));
    ++misses_;
    return entries_.back().get();
  }

  void release(entry* e) noexcept {
    if (--e->in_use == 0 && e->stale) drop(e);
  }

  /// Drops every registration overlapping [p, p+n).
  void forget(const void* p, std::size_t n) noexcept {
    const auto lo = reinterpret_cast<std::uintptr_t>(p);
    const auto hi = lo + n;
    std::vector<entry*> idle;
    for (auto& e : entries_)
      if (e->begin < hi && lo < e->end) {
        if (e->in_use)
          e->stale = true;
        else
          idle.push_back(e.get());
      }
    for (auto* e : idle) drop(e);
  }

  void clear() noexcept { entries_.clear(); }

  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  [[nodiscard]] std::uint64_t hits() const noexcept { return hits_; }
  [[nodiscard]] std::uint64_t misses() const noexcept { return misses_; }

 private:
  static std::uintptr_t page_size() noexcept {
    static const auto p = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    return p;
  }

  void register_range(entry& e) {
    // Without FI_MR_PROV_KEY the application picks keys, unique within the domain.
    const std::uint64_t key = (mr_mode_ & FI_MR_PROV_KEY) ? 0 : next_key_++;
    check(fi_mr_reg(domain_, reinterpret_cast<const void*>(e.begin), e.end - e.begin,
                    FI_SEND | FI_RECV, 0, key, 0, &e.mr, nullptr),
          "fi_mr_reg", provider_);
    if (mr_mode_ & FI_MR_ENDPOINT) {
      // The entry's destructor closes the registration if either call fails.
      check(fi_mr_bind(e.mr, &ep_->fid, 0), "fi_mr_bind", provider_);
      check(fi_mr_enable(e.mr), "fi_mr_enable", provider_);
    }
    e.desc = fi_mr_desc(e.mr);
  }

  // Keeps the cache bounded: the least recently used idle registration goes first.
  void evict() noexcept {
    while (entries_.size() >= capacity_) {
      entry* victim = nullptr;
      for (auto& e : entries_)
        if (e->in_use == 0 && (!victim || e->last_use < victim->last_use)) victim = e.get();
      if (!victim) return;
      drop(victim);
    }
  }

  void drop(entry* e) noexcept {
    entries_.erase(std::find_if(entries_.begin(), entries_.end(),
                                [&](const auto& x) { return x.get() == e; }));
  }

  fid_domain* domain_;
  fid_ep* ep_;
  std::uint64_t mr_mode_;
  std::string provider_;
  std::size_t capacity_;
  std::vector<std::unique_ptr<entry>> entries_;
  std::uint64_t clock_ = 0;
  std::uint64_t next_key_ = 1;
  std::uint64_t hits_ = 0;
  std::uint64_t misses_ = 0;
};

}  // namespace ringzero::libfabric::detail
