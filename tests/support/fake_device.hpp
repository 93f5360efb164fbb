// A host stand-in for the CUDA runtime and kernels behind kernels::device_runtime and
// kernels::device_reduction, for testing device paths without a GPU. "Device memory" is host
// memory allocated through it (device 0). Work enqueued on a stream does not run when enqueued:
// each poll of an event runs at most one more item of its stream, and draining runs them all,
// so code that reads a result before the event that covers it completed reads stale data.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

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

/// The ranges allocated as device memory, and counters the tests read.
struct state {
  std::mutex m;
  std::vector<std::pair<const std::byte*, std::size_t>> ranges;
  std::size_t events = 0;
  std::size_t polls = 0;
  std::size_t orderings = 0;  ///< reproducible calls ordered behind their caller's stream
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

inline int device_of(const void* p) {
  auto& g = global();
  std::lock_guard lock(g.m);
  const auto* b = static_cast<const std::byte*>(p);
  for (const auto& [lo, n] : g.ranges)
    if (lo <= b && b < lo + n) return 0;
  return -1;
}
inline thread_local int current = 0;
inline int current_device() {
  return current;
}
inline void set_device(int d) {
  current = d;
}
inline CUstream_st* create_stream(int) {
  return reinterpret_cast<CUstream_st*>(new stream);
}
inline void drain(CUstream_st* s) noexcept {
  while (as_stream(s)->step()) {
  }
}
inline void destroy_stream(CUstream_st* s) noexcept {
  drain(s);
  delete as_stream(s);
}
inline void copy(void* dst, const void* src, std::size_t bytes, CUstream_st* s) {
  as_stream(s)->push([=] { std::memcpy(dst, src, bytes); });
}
inline CUevent_st* record(CUstream_st* s) {
  auto& g = global();
  {
    std::lock_guard lock(g.m);
    ++g.events;
  }
  stream* st = as_stream(s);
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
  g.ranges.emplace_back(p, bytes);
  return p;
}
inline void release(void* p) noexcept {
  auto& g = global();
  {
    std::lock_guard lock(g.m);
    std::erase_if(g.ranges, [&](const auto& r) { return r.first == p; });
  }
  ::operator delete (p, std::align_val_t{256});
}

template <ringzero::op O, class T>
void apply(const T* a, const T* b, T* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = ringzero::kernels::combine<O>(a[i], b[i]);
}

inline void combine(ringzero::dtype type, ringzero::op o, const void* a, const void* b, void* out,
                    std::size_t n, CUstream_st* s) {
  as_stream(s)->push([=] {
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
  as_stream(s)->push([=] {
    ringzero::visit_dtype(type, [&](auto zero) {
      using T = decltype(zero);
      auto* d = static_cast<T*>(data);
      for (std::size_t i = 0; i < n; ++i) d[i] = ringzero::kernels::finish_avg(d[i], ranks);
    });
  });
}

inline constexpr ringzero::kernels::device_runtime runtime{
    &device_of, &current_device, &set_device,    &create_stream, &destroy_stream, &copy,
    &record,    &done,           &destroy_event, &drain,         &allocate,       &release};
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
  as_stream(s)->push([=] {
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
  as_stream(s)->push([=] {
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
  as_stream(s)->push([=] {
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
  as_stream(s)->push([=] {
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
  as_stream(s)->push([=] {
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
  as_stream(s)->push([=] {
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
  drain(s);
}
/// The stand-in has no default stream: a named caller's stream is run to its end (what the
/// event would wait for), and every ordering is counted so a test sees the call asked for it.
inline void rp_after(CUstream_st*, CUstream_st* caller) {
  if (caller != nullptr) drain(caller);
  auto& g = global();
  std::lock_guard lock(g.m);
  ++g.orderings;
}
inline constexpr ringzero::kernels::device_reproducible reproducible{
    &rp_windows,       &rp_layout_scratch, &rp_layout, &rp_digits,      &rp_round,
    &rp_special_codes, &rp_apply_specials, &copy,      &rp_synchronize, &rp_after};

/// Device memory of `n` elements, freed on destruction.
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

/// Registers the stand-in as the program's runtime and reductions while it lives.
class installed {
 public:
  installed() {
    ringzero::kernels::register_device_runtime(&runtime);
    ringzero::kernels::register_device_reduction(reductions);
    ringzero::kernels::register_device_reproducible(&reproducible);
  }
  installed(const installed&) = delete;
  installed& operator=(const installed&) = delete;
  ~installed() {
    ringzero::kernels::register_device_runtime(nullptr);
    ringzero::kernels::register_device_reproducible(nullptr);
  }
};

}  // namespace fake_device
