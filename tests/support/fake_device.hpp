// A host stand-in for the CUDA runtime and kernels behind kernels::device_runtime,
// kernels::device_reduction and kernels::device_reproducible, for testing device paths without a
// GPU. "Device memory" is host memory allocated through it. It models what breaks when several
// ranks of a job each drive their own GPU:
//   - several devices (installed(n)), a current device per thread (0 until set), memory owned by
//     the device current when it was allocated, streams by the device they were made for;
//   - a kernel (a reduction or a reproducible pass) launched while another device is current, a
//     kernel that touches memory of another device or host memory, and an event recorded on a
//     stream of another device are refused at once, with transport_error, where a GPU without
//     peer access would fault or fail the launch; copies go between any memories, as CUDA's;
//   - work enqueued on a stream does not run when enqueued: each poll of an event runs at most
//     one more item of its stream, and draining runs them all, so code that reads a result before
//     the event that covers it completed reads stale data. An item that runs once memory it
//     touches was freed is recorded as a fault (faults()), as a use after free on a GPU;
//   - a device may be made to need cudaDeviceFlushGPUDirectRDMAWrites (unordered_remote_writes):
//     data a NIC wrote into its memory (remote_write, from a test's transport) is then refused to a
//     kernel until the device was flushed.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <deque>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "ringzero/error.hpp"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/kernels/device_reproducible.hpp"
#include "ringzero/kernels/device_runtime.hpp"
#include "ringzero/kernels/reduce.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/types.hpp"

namespace fake_device {

struct stream {
  explicit stream(int d) : device(d) {}
  const int device;
  std::mutex m;
  std::deque<std::function<void()>> work;
  std::size_t enqueued = 0;
  std::size_t ran = 0;

  void push(std::function<void()> f) {
    std::lock_guard lock(m);
    work.push_back(std::move(f));
    ++enqueued;
  }
  /// Runs one item; false when there was none.
  bool step() {
    std::function<void()> f;
    {
      std::lock_guard lock(m);
      if (work.empty()) return false;
      f = std::move(work.front());
      work.pop_front();
    }
    f();
    std::lock_guard lock(m);
    ++ran;
    return true;
  }
  [[nodiscard]] std::size_t finished() {
    std::lock_guard lock(m);
    return ran;
  }
};

struct event {
  stream* s;
  std::size_t after;  ///< complete once s has run this many items
};

struct allocation {
  const std::byte* lo = nullptr;
  std::size_t n = 0;
  int device = 0;
  std::uint64_t id = 0;
};

/// The devices, their allocations, and counters the tests read.
struct state {
  std::mutex m;
  int devices = 1;
  std::vector<allocation> ranges;
  std::uint64_t next_id = 0;
  std::size_t events = 0;
  std::size_t polls = 0;
  std::size_t orderings = 0;   ///< reproducible calls ordered behind their caller's stream
  std::size_t flushes = 0;     ///< flush_remote_writes calls
  std::vector<int> unordered;  ///< devices whose remote writes need a flush
  struct written {
    const std::byte* lo;
    std::size_t n;
    int device;
  };
  std::vector<written> unflushed;  ///< remote writes no flush covered yet
  std::vector<std::string> faults;
  std::vector<void*> freed;  ///< released memory, returned to the heap by ~installed()
};
inline state& global() {
  static state s;
  return s;
}

inline stream* as_stream(CUstream_st* s) {
  return reinterpret_cast<stream*>(s);
}
inline event* as_event(CUevent_st* e) {
  return reinterpret_cast<event*>(e);
}

[[noreturn]] inline void refuse(const std::string& what) {
  throw ringzero::transport_error("fake device: " + what);
}

/// What a GPU would have faulted on, found when enqueued work ran; cleared by installed().
inline std::vector<std::string> faults() {
  auto& g = global();
  std::lock_guard lock(g.m);
  return g.faults;
}

/// The allocation holding p (g.m held), or null.
inline const allocation* find_locked(const void* p) {
  const auto* b = static_cast<const std::byte*>(p);
  for (const auto& a : global().ranges)
    if (a.lo <= b && b < a.lo + a.n) return &a;
  return nullptr;
}

inline int device_of(const void* p) {
  auto& g = global();
  std::lock_guard lock(g.m);
  const allocation* a = find_locked(p);
  return a != nullptr ? a->device : -1;
}
inline ringzero::kernels::device_allocation allocation_of(const void* p) {
  auto& g = global();
  std::lock_guard lock(g.m);
  const allocation* a = find_locked(p);
  if (a == nullptr) return {};
  return {a->lo, a->n, a->id};
}
inline int device_count() {
  auto& g = global();
  std::lock_guard lock(g.m);
  return g.devices;
}
inline thread_local int current = 0;
inline int current_device() {
  return current;
}
inline void set_device(int d) {
  if (d < 0 || d >= device_count())
    refuse(
        fmt::format("cudaSetDevice({}): invalid device ordinal ({} devices)", d, device_count()));
  current = d;
}
inline CUstream_st* create_stream(int d) {
  if (d != current)
    refuse(fmt::format("a stream for device {} made while device {} is current", d, current));
  return reinterpret_cast<CUstream_st*>(new stream(d));
}
inline bool drain(CUstream_st* s, std::chrono::nanoseconds) noexcept {
  while (as_stream(s)->step()) {
  }
  return true;
}
inline void destroy_stream(CUstream_st* s) noexcept {
  drain(s, {});
  delete as_stream(s);
}

inline std::string where(int device) {
  return device < 0 ? std::string("host memory") : fmt::format("memory of device {}", device);
}

/// Queues f on s: a kernel (`kernel`) or a copy. A kernel must be launched while s's device is
/// current and touch only memory of that device; the pointers are checked again when f runs,
/// which must find them still allocated.
inline void enqueue(CUstream_st* cs, const char* what, bool kernel,
                    std::initializer_list<const void*> touched, std::function<void()> f) {
  stream* s = as_stream(cs);
  std::vector<const void*> ptrs;
  for (const void* p : touched)
    if (p != nullptr) ptrs.push_back(p);
  std::vector<int> was(ptrs.size());
  {
    auto& g = global();
    std::lock_guard lock(g.m);
    if (kernel && s->device != current)
      refuse(fmt::format("{} launched on a stream of device {} while device {} is current", what,
                         s->device, current));
    for (std::size_t i = 0; i < ptrs.size(); ++i) {
      const allocation* a = find_locked(ptrs[i]);
      was[i] = a != nullptr ? a->device : -1;
      if (!kernel) continue;
      if (was[i] != s->device)
        refuse(fmt::format("{} on device {} touches {} (a GPU without peer access faults)", what,
                           s->device, where(was[i])));
      const auto* b = static_cast<const std::byte*>(ptrs[i]);
      for (const auto& w : g.unflushed)
        if (w.lo <= b && b < w.lo + w.n)
          refuse(
              fmt::format("{} on device {} reads data a NIC wrote there before "
                          "cudaDeviceFlushGPUDirectRDMAWrites made it visible",
                          what, s->device));
    }
  }
  s->push([what, ptrs = std::move(ptrs), was = std::move(was), f = std::move(f)] {
    for (std::size_t i = 0; i < ptrs.size(); ++i)
      if (was[i] >= 0 && device_of(ptrs[i]) != was[i]) {
        auto& g = global();
        std::lock_guard lock(g.m);
        g.faults.push_back(
            fmt::format("{} ran on memory of device {} freed after it was enqueued", what, was[i]));
        return;
      }
    f();
  });
}

inline void copy(void* dst, const void* src, std::size_t bytes, CUstream_st* s) {
  enqueue(s, "a copy", false, {dst, src}, [=] { std::memcpy(dst, src, bytes); });
}
inline CUevent_st* record(CUstream_st* s) {
  auto& g = global();
  stream* st = as_stream(s);
  {
    std::lock_guard lock(g.m);
    if (st->device != current)
      refuse(fmt::format("an event of device {} recorded on a stream of device {}", current,
                         st->device));
    ++g.events;
  }
  std::lock_guard lock(st->m);
  return reinterpret_cast<CUevent_st*>(new event{st, st->enqueued});
}
inline bool done(CUevent_st* e) {
  auto& g = global();
  {
    std::lock_guard lock(g.m);
    ++g.polls;
  }
  event* ev = as_event(e);
  if (ev->s->finished() >= ev->after) return true;
  ev->s->step();
  return false;
}
inline void destroy_event(CUevent_st* e) noexcept {
  delete as_event(e);
}
inline void* allocate(std::size_t bytes) {
  auto* p = static_cast<std::byte*>(::operator new (bytes, std::align_val_t{256}));
  auto& g = global();
  std::lock_guard lock(g.m);
  g.ranges.push_back({p, bytes, current, ++g.next_id});
  return p;
}
/// Makes the allocation at `p` a new one at the same addresses, as cudaFree and then a
/// cudaMalloc of the same size may hand back: its id changes.
inline void reallocate(void* p) {
  auto& g = global();
  std::lock_guard lock(g.m);
  for (auto& a : g.ranges)
    if (a.lo == p) a.id = ++g.next_id;
}
/// The memory stays mapped until installed() ends, so that work still queued on it records a
/// fault instead of corrupting the heap.
inline void release(void* p) noexcept {
  auto& g = global();
  std::lock_guard lock(g.m);
  std::erase_if(g.ranges, [&](const auto& r) { return r.lo == p; });
  g.freed.push_back(p);
}

inline bool remote_writes_ordered(int device) {
  auto& g = global();
  std::lock_guard lock(g.m);
  return std::find(g.unordered.begin(), g.unordered.end(), device) == g.unordered.end();
}
inline void flush_remote_writes() {
  auto& g = global();
  std::lock_guard lock(g.m);
  ++g.flushes;
  std::erase_if(g.unflushed, [](const auto& w) { return w.device == current; });
}
/// Makes `device` need a flush between a NIC's writes and the kernels that read them.
inline void unordered_remote_writes(int device) {
  auto& g = global();
  std::lock_guard lock(g.m);
  g.unordered.push_back(device);
}
/// What a test's transport calls when a receive into [p, p + n) completed: on a device whose
/// remote writes are not ordered, no kernel may read the range before a flush.
inline void remote_write(const void* p, std::size_t n) {
  auto& g = global();
  std::lock_guard lock(g.m);
  const allocation* a = find_locked(p);
  if (a == nullptr || n == 0) return;
  if (std::find(g.unordered.begin(), g.unordered.end(), a->device) == g.unordered.end()) return;
  g.unflushed.push_back({static_cast<const std::byte*>(p), n, a->device});
}

template <ringzero::op O, class T>
void apply(const T* a, const T* b, T* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = ringzero::kernels::combine<O>(a[i], b[i]);
}

inline void combine(ringzero::dtype type, ringzero::op o, const void* a, const void* b, void* out,
                    std::size_t n, CUstream_st* s) {
  enqueue(s, "combine", true, {a, b, out}, [=] {
    ringzero::visit_dtype(type, [&](auto zero) {
      using T = decltype(zero);
      const auto* x = static_cast<const T*>(a);
      const auto* y = static_cast<const T*>(b);
      auto* z = static_cast<T*>(out);
      switch (o) {
        case ringzero::op::sum:
        case ringzero::op::avg:
          return apply<ringzero::op::sum>(x, y, z, n);
        case ringzero::op::prod:
          return apply<ringzero::op::prod>(x, y, z, n);
        case ringzero::op::min:
          return apply<ringzero::op::min>(x, y, z, n);
        case ringzero::op::max:
          return apply<ringzero::op::max>(x, y, z, n);
      }
    });
  });
}

inline void finish_avg(ringzero::dtype type, void* data, std::size_t n, int ranks, CUstream_st* s) {
  enqueue(s, "finish_avg", true, {data}, [=] {
    ringzero::visit_dtype(type, [&](auto zero) {
      using T = decltype(zero);
      auto* d = static_cast<T*>(data);
      for (std::size_t i = 0; i < n; ++i) d[i] = ringzero::kernels::finish_avg(d[i], ranks);
    });
  });
}

inline constexpr ringzero::kernels::device_runtime runtime{
    &device_of, &current_device, &set_device,    &create_stream,         &destroy_stream,
    &copy,      &record,         &done,          &destroy_event,         &drain,
    &allocate,  &release,        &allocation_of, &remote_writes_ordered, &flush_remote_writes};
inline constexpr ringzero::kernels::device_reduction reductions{&combine, &finish_avg};

// options::reproducible's passes, run by the same per-element functions as the CUDA kernels.
template <class F>
void visit_floating(ringzero::dtype type, F&& f) {
  ringzero::visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (ringzero::reproducible::supported_v<T>) f(zero);
  });
}
inline void rp_windows(ringzero::dtype type, const void* in, std::size_t n, std::int32_t* win,
                       CUstream_st* s) {
  enqueue(s, "options::reproducible: windows", true, {n > 0 ? in : nullptr, win}, [=] {
    visit_floating(type, [&](auto zero) {
      using T = decltype(zero);
      namespace rp = ringzero::reproducible;
      const std::size_t blocks = rp::blocks(n);
      bool special = false;
      for (std::size_t b = 0; b < blocks; ++b) {
        const rp::window w = rp::block_window(static_cast<const T*>(in), n, b, special);
        win[2 * b] = w.top;
        win[2 * b + 1] = w.neg_low;
      }
      win[2 * blocks] = special;
    });
  });
}
inline std::size_t rp_layout_scratch(std::size_t) {
  return 0;  // the host's scan needs none
}
inline void rp_layout(const std::int32_t* win, std::size_t n, std::size_t part, std::size_t parts,
                      std::uint64_t* off, std::uint64_t* bounds, void*, std::size_t,
                      CUstream_st* s) {
  enqueue(s, "options::reproducible: layout", true, {win, off, bounds}, [=] {
    namespace rp = ringzero::reproducible;
    const std::size_t blocks = rp::blocks(n);
    std::uint64_t at = 0;
    for (std::size_t b = 0; b < blocks; ++b) {
      off[b] = at;
      at += rp::block_digits(win, n, b);
    }
    off[blocks] = at;
    for (std::size_t r = 0; r <= parts; ++r) bounds[r] = rp::range_position(win, off, n, r * part);
  });
}
inline void rp_digits(ringzero::dtype type, const void* in, std::size_t n, const std::int32_t* win,
                      const std::uint64_t* off, std::size_t count, std::size_t seg, std::int64_t* q,
                      CUstream_st* s) {
  enqueue(s, "options::reproducible: digits", true, {in, win, off, q}, [=] {
    if (seg != 0) std::memset(q, 0, seg * (n / count) * sizeof(std::int64_t));
    visit_floating(type, [&](auto zero) {
      using T = decltype(zero);
      for (std::size_t i = 0; i < n; ++i)
        ringzero::reproducible::element_digits(static_cast<const T*>(in), i, win, off, count, seg,
                                               q);
    });
  });
}
inline void rp_round(ringzero::dtype type, const std::int64_t* q, const std::int32_t* win,
                     const std::uint64_t* off, std::size_t from, std::size_t count,
                     std::uint32_t divisor, void* out, CUstream_st* s) {
  enqueue(s, "options::reproducible: round", true, {q, win, off, out}, [=] {
    visit_floating(type, [&](auto zero) {
      using T = decltype(zero);
      for (std::size_t i = from; i < from + count; ++i)
        static_cast<T*>(out)[i - from] =
            ringzero::reproducible::element_round<T>(q, win, off, from, i, divisor);
    });
  });
}
inline void rp_special_codes(ringzero::dtype type, const void* in, std::size_t n,
                             std::int64_t* codes, CUstream_st* s) {
  enqueue(s, "options::reproducible: inf/NaN codes", true, {in, codes}, [=] {
    visit_floating(type, [&](auto zero) {
      using T = decltype(zero);
      for (std::size_t i = 0; i < n; ++i)
        codes[i] = ringzero::reproducible::special_code(
            ringzero::reproducible::decompose(static_cast<const T*>(in)[i]));
    });
  });
}
inline void rp_apply_specials(ringzero::dtype type, const std::int64_t* codes, std::size_t n,
                              void* out, CUstream_st* s) {
  enqueue(s, "options::reproducible: inf/NaN results", true, {codes, out}, [=] {
    visit_floating(type, [&](auto zero) {
      using T = decltype(zero);
      for (std::size_t i = 0; i < n; ++i) {
        T v{};
        if (ringzero::reproducible::special_result(codes[i], v)) static_cast<T*>(out)[i] = v;
      }
    });
  });
}
inline void rp_synchronize(CUstream_st* s) {
  drain(s, {});
}
/// The stand-in has no default stream: a named caller's stream is run to its end (what the
/// event would wait for), and every ordering is counted so a test sees the call asked for it.
inline void rp_after(CUstream_st*, CUstream_st* caller) {
  if (caller != nullptr) drain(caller, {});
  auto& g = global();
  std::lock_guard lock(g.m);
  ++g.orderings;
}
inline constexpr ringzero::kernels::device_reproducible reproducible{
    &rp_windows,       &rp_layout_scratch, &rp_layout, &rp_digits,      &rp_round,
    &rp_special_codes, &rp_apply_specials, &copy,      &rp_synchronize, &rp_after};

/// Device memory of `n` elements on the current device, freed on destruction.
template <class T>
class buffer {
 public:
  explicit buffer(std::size_t n)
      : n_(n), p_(static_cast<T*>(allocate(std::max<std::size_t>(n, 1) * sizeof(T)))) {}
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  ~buffer() { release(p_); }
  [[nodiscard]] T* data() const noexcept { return p_; }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] std::span<T> span() const noexcept { return {p_, n_}; }

 private:
  std::size_t n_;
  T* p_;
};

/// Registers the stand-in as the program's runtime and reductions while it lives, with
/// `devices` devices, no fault recorded yet and every device's remote writes ordered.
class installed {
 public:
  explicit installed(int devices = 1) {
    current = 0;
    {
      auto& g = global();
      std::lock_guard lock(g.m);
      g.devices = devices;
      g.faults.clear();
      g.unordered.clear();
      g.unflushed.clear();
    }
    ringzero::kernels::register_device_runtime(&runtime);
    ringzero::kernels::register_device_reduction(reductions);
    ringzero::kernels::register_device_reproducible(&reproducible);
  }
  installed(const installed&) = delete;
  installed& operator=(const installed&) = delete;
  ~installed() {
    ringzero::kernels::register_device_runtime(nullptr);
    ringzero::kernels::register_device_reproducible(nullptr);
    auto& g = global();
    std::lock_guard lock(g.m);
    g.devices = 1;
    for (void* p : g.freed) ::operator delete (p, std::align_val_t{256});
    g.freed.clear();
  }
};

}  // namespace fake_device
