// Memory registrations, cached by address range. Providers that set FI_MR_LOCAL (efa,
// verbs;ofi_rxm) need a registered descriptor for every buffer they touch, and registering
// (pinning) costs tens of microseconds, so a buffer used every step is registered once.
//
// Registrations cover whole pages, so neighbouring buffers of one allocation share one. A
// registration pins the pages it was made for: memory that is unmapped and mapped again at the
// same address must be announced with forget() (communicator::forget_memory), or the provider
// keeps moving the old pages.
//
// CUDA device memory (FI_HMEM_CUDA) is registered only when the caller declares it
// (register_device): the cache cannot tell a device pointer from a host one without the CUDA
// runtime, which the libfabric component does not link. A declaration (device_declarations)
// names the range, its device and its allocation's id; the registration made for it covers
// exactly the declared range (device allocations are not page-granular host mappings), is
// evicted like any other when idle (pinned GPU memory is a scarce resource of the NIC), and is
// made again from the declaration when an operation inside the range needs it. A declaration of
// another allocation at overlapping addresses (one freed and allocated again) replaces the old
// one and drops its registrations: they would move the freed pages.
#pragma once

#include <fmt/core.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/transport/detail/device_declarations.hpp"
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
    int device = -1;     ///< CUDA device ordinal for device memory, -1 for host memory
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

  /// A registration covering [p, p+n), counted in use until release(). n > 0. A registration
  /// that covers it is used as it is; inside a declared device range, that range is registered
  /// (again, if it was evicted); otherwise, with `register_host`, the pages are registered as
  /// host memory, and without it the result is nullptr (no descriptor needed).
  [[nodiscard]] entry* acquire(const void* p, std::size_t n, bool register_host = true) {
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
    if (!declared_.empty()) {
      if (const auto* d = declared_.covering(p, n)) {
        ++misses_;
        return add(d->begin, d->end, d->device);
      }
      // Registering part of a device range as host memory would hand the provider device
      // addresses to read as host pages.
      for (const auto& d : declared_.all())
        if (d.overlaps(lo, hi))
          throw invalid_argument(fmt::format(
              "a {} byte buffer at {} extends past the CUDA device buffer registered at {:#x} "
              "({} bytes): register the whole allocation",
              n, p, d.begin, d.end - d.begin));
    }
    if (!register_host) return nullptr;
    ++misses_;
    const std::uintptr_t page = page_size();
    return add(lo & ~(page - 1), (hi + page - 1) & ~(page - 1), -1);
  }

  void release(entry* e) noexcept {
    if (--e->in_use == 0 && e->stale) drop(e);
  }

  /// Declares [p, p+n) memory of CUDA device `device` in allocation `id` (kernels::
  /// device_allocation; 0 where unknown) and registers it (fi_mr_regattr, FI_HMEM_CUDA), so that
  /// a provider that refuses says so now. A range of the same allocation already declared, or
  /// inside one, is not declared again; a declaration it replaces (another allocation at those
  /// addresses) loses its registrations. Throws unsupported, with the provider's reason, when it
  /// refuses.
  void register_device(const void* p, std::size_t n, int device, std::uint64_t id = 0) {
    const ringzero::detail::device_declarations::outcome o = declared_.declare(p, n, device, id);
    for (const auto& r : o.replaced) drop_overlapping(r.begin, r.end);
    if (!o.added) return;
    const auto lo = reinterpret_cast<std::uintptr_t>(p);
    try {
      release(add(lo, lo + n, device));
    } catch (...) {
      declared_.forget(p, n);
      throw;
    }
  }

  /// Whether [p, p+n) lies in a declared device range.
  [[nodiscard]] bool is_device(const void* p, std::size_t n) const noexcept {
    return !declared_.empty() && declared_.overlaps(p, n);
  }

  /// Drops every declaration and registration overlapping [p, p+n).
  void forget(const void* p, std::size_t n) noexcept {
    declared_.forget(p, n);
    const auto lo = reinterpret_cast<std::uintptr_t>(p);
    drop_overlapping(lo, lo + n);
  }

  void clear() noexcept { entries_.clear(); }

  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  /// Declared device ranges (registered now, or again when next used).
  [[nodiscard]] std::size_t device_ranges() const noexcept { return declared_.size(); }
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
    if (e.device >= 0) {
      iovec iov{reinterpret_cast<void*>(e.begin), e.end - e.begin};
      fi_mr_attr attr{};
      attr.mr_iov = &iov;
      attr.iov_count = 1;
      attr.access = FI_SEND | FI_RECV;
      attr.requested_key = key;
      attr.iface = FI_HMEM_CUDA;
      attr.device.cuda = e.device;
      // The endpoint registers device memory only once the provider reported FI_HMEM; what can
      // still be missing is CUDA among the interfaces this libfabric was built with, which only
      // this call reveals.
      if (const int rc = fi_mr_regattr(domain_, &attr, 0, &e.mr); rc != 0)
        throw unsupported(fmt::format(
            "libfabric provider '{}' reports FI_HMEM but did not register {} bytes of CUDA "
            "device {} memory (fi_mr_regattr with FI_HMEM_CUDA: {}): GPU buffers need a provider "
            "with CUDA memory registration (efa with GPUDirect RDMA, or a libfabric built with "
            "CUDA); stage them through host memory instead",
            provider_, e.end - e.begin, e.device, fi_text(rc)));
    } else {
      check(fi_mr_reg(domain_, reinterpret_cast<const void*>(e.begin), e.end - e.begin,
                      FI_SEND | FI_RECV, 0, key, 0, &e.mr, nullptr),
            "fi_mr_reg", provider_);
    }
    if (mr_mode_ & FI_MR_ENDPOINT) {
      // The entry's destructor closes the registration if either call fails.
      check(fi_mr_bind(e.mr, &ep_->fid, 0), "fi_mr_bind", provider_);
      check(fi_mr_enable(e.mr), "fi_mr_enable", provider_);
    }
    e.desc = fi_mr_desc(e.mr);
  }

  /// A new registration of [begin, end) (`device` < 0: host pages), in use once.
  entry* add(std::uintptr_t begin, std::uintptr_t end, int device) {
    evict();
    auto e = std::make_unique<entry>();
    e->begin = begin;
    e->end = end;
    e->device = device;
    register_range(*e);
    e->in_use = 1;
    e->last_use = clock_;
    entries_.push_back(std::move(e));
    return entries_.back().get();
  }

  /// Drops the registrations overlapping [lo, hi); one in use closes when its last user is done.
  void drop_overlapping(std::uintptr_t lo, std::uintptr_t hi) noexcept {
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
  ringzero::detail::device_declarations declared_;
};

}  // namespace ringzero::libfabric::detail
