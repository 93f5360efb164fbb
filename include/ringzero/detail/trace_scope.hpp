// The scopes the collectives layer (one per entry point) and callers' phases open. With
// RINGZERO_TRACE unset a collective_scope costs two readings of the counters' clock
// (detail/tick_clock.hpp), three counter additions and one well-predicted branch; defining
// RINGZERO_DISABLE_TRACE compiles even those away.
#pragma once

#include <unistd.h>

#include <fmt/compile.h>
#include <fmt/format.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <span>
#include <string_view>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/detail/pipeline.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/detail/tick_clock.hpp"
#include "ringzero/detail/trace_state.hpp"
#include "ringzero/detail/trace_writer.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::detail {

/// The innermost traced call on this thread; nested calls write to its file.
inline thread_local trace_record* trace_current = nullptr;

/// The file this thread last recorded a collective in (compared, never dereferenced): a phase
/// on that thread goes on the collectives' track, where it nests around them, because Chrome's
/// format wants one track's slices nested, and a phase on another thread (the sharder's caller)
/// overlaps them without nesting.
inline thread_local const trace_writer* trace_thread_writer = nullptr;

[[nodiscard]] inline double trace_us(std::chrono::steady_clock::time_point t) noexcept {
  return std::chrono::duration<double, std::micro>(t.time_since_epoch()).count();
}

[[nodiscard]] inline std::int64_t trace_ns(std::chrono::steady_clock::duration d) noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

/// A communicator whose calls are counted: it has ringzero's per-communicator state. Every
/// communicator<T> is one, those over backends that run their own collectives (NCCL) included;
/// only one that also does messaging (collective_comm) writes a timeline under RINGZERO_TRACE,
/// since opening the file measures clocks with point-to-point messages.
template <class C>
concept counted_comm = requires(C& c, const C& cc) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  { c.state() } -> std::same_as<comm_state&>;
};

/// Reads RINGZERO_TRACE once per communicator.
inline void trace_read_mode(trace_state& t, int rank, int size) {
  t.rank = rank;
  t.size = size;
  t.mode.store(getenv_str("RINGZERO_TRACE") ? 1 : 0, std::memory_order_relaxed);
}

/// Offset of rank 0's steady clock from this rank's, NTP-style: the best of a few ping-pongs
/// with rank 0, each giving offset = t0 - (sent + received) / 2 with an error below half its
/// round trip. Every rank takes part, rank 0 serving the others one at a time.
template <collective_comm T>
[[nodiscard]] std::pair<double, double> trace_clock_offset_us(T& comm) {
  const int n = comm.size();
  if (n == 1) return {0.0, 0.0};
  constexpr int rounds = 8;
  exchange<T> ex(comm, "RINGZERO_TRACE clock sync", "ping-pong");
  double stamp = 0;
  const auto buf = std::as_writable_bytes(std::span<double>(&stamp, 1));
  if (comm.rank() == 0) {
    for (int peer = 1; peer < n; ++peer)
      for (int i = 0; i < rounds; ++i) {
        auto r = ex.recv(peer, 2 * i, 0, buf);
        ex.wait(r);
        stamp = trace_us(std::chrono::steady_clock::now());
        auto s = ex.send(peer, 2 * i + 1, 0, buf);
        ex.wait(s);
      }
    return {0.0, 0.0};
  }
  double best_rtt = std::numeric_limits<double>::infinity();
  double offset = 0;
  for (int i = 0; i < rounds; ++i) {
    const double sent = trace_us(std::chrono::steady_clock::now());
    auto s = ex.send(0, 2 * i, 0, buf);
    ex.wait(s);
    auto r = ex.recv(0, 2 * i + 1, 0, buf);
    ex.wait(r);
    const double received = trace_us(std::chrono::steady_clock::now());
    if (received - sent < best_rtt) {
      best_rtt = received - sent;
      offset = stamp - (sent + received) / 2;
    }
  }
  return {offset, best_rtt};
}

/// This communicator's file, opened (and clocks measured) at its first traced collective.
template <collective_comm T>
trace_writer& trace_open(T& comm, trace_state& t) {
  if (t.writer) return *t.writer;
  auto [path, instance] = trace_paths::claim(*getenv_str("RINGZERO_TRACE"), comm.rank());
  auto w = std::make_unique<trace_writer>(path, comm.rank(), instance);
  const auto [offset_us, rtt_us] = trace_clock_offset_us(comm);
  fmt::memory_buffer b;
  auto out = std::back_inserter(b);
  fmt::format_to(out, R"({{"name":"process_name","ph":"M","pid":{},"tid":{},"args":{{"name":")",
                 comm.rank(), instance);
  json_escape(b, fmt::format("rank {} ({}:{})", comm.rank(), log::detail::host_name(), ::getpid()));
  fmt::format_to(out, R"("}}}})");
  w->event(std::string_view(b.data(), b.size()));
  w->event(fmt::format(R"({{"name":"ringzero_clock","ph":"M","pid":{},"tid":{},"args":{{"rank":{},)"
                       R"("size":{},"instance":{},"offset_us":{:.3f},"rtt_us":{:.3f}}}}})",
                       comm.rank(), instance, comm.rank(), comm.size(), instance, offset_us,
                       rtt_us));
  t.writer = std::move(w);
  t.published.store(t.writer.get(), std::memory_order_release);
  return *t.writer;
}

#ifndef RINGZERO_DISABLE_TRACE

/// One collective call: counted always, recorded while RINGZERO_TRACE is set (on a messaging
/// communicator). `bytes` is the buffer size nccl-tests reports (the full buffer for
/// reduce_scatter and all_gather).
template <counted_comm T>
class collective_scope {
 public:
  collective_scope(T& comm, collective kind, algorithm algo, std::size_t bytes, dtype type, op o,
                   const options& opt, std::string_view name = {})
      : comm_(comm),
        st_(comm.state().trace),
        kind_(kind),
        algo_(algo),
        type_(type),
        op_(o),
        bytes_(bytes),
        opt_(opt),
        name_(name),
        ticks_(tick_clock::now()) {
    if constexpr (collective_comm<T>) {
      if (st_.current_mode() != 0) [[unlikely]]
        begin();
    }
  }
  collective_scope(const collective_scope&) = delete;
  collective_scope& operator=(const collective_scope&) = delete;

  /// The algorithm the call runs, once it is chosen after the scope opened.
  void set_algorithm(algorithm a) noexcept { algo_ = a; }

  ~collective_scope() {
    counter_cell& c = st_.cell(kind_, algo_);
    st_.algorithm_name = &algorithms::builtin::name;
    ++c.calls;
    c.bytes += bytes_;
    c.ticks += tick_clock::now() - ticks_;
    if constexpr (collective_comm<T>) {
      if (active_) [[unlikely]]
        finish(std::chrono::steady_clock::now());
    }
  }

 private:
  void begin() {
    if (st_.current_mode() < 0) trace_read_mode(st_, comm_.rank(), comm_.size());
    if (st_.current_mode() == 0) return;
    trace_record* parent = trace_current;
    rec_.parent = parent;
    // Opening the file measures clocks with every rank, which a point-to-point call (two
    // ranks) cannot ask for: it is recorded once a collective has opened the file. Nor does it
    // take a sequence number, which names a call that all ranks make.
    const bool p2p = kind_ == collective::send_recv;
    if (parent != nullptr && parent->writer != nullptr)
      rec_.writer = parent->writer;
    else if (!p2p || st_.writer)
      rec_.writer = &trace_open(comm_, st_);
    else
      return;
    if (!p2p) seq_ = rec_.writer->next_seq();
    trace_thread_writer = rec_.writer;
    saved_open_ = st_.open;
    st_.open = &rec_;
    trace_current = &rec_;
    uncaught_ = std::uncaught_exceptions();
    active_ = true;
    start_ = std::chrono::steady_clock::now();
  }

  void finish(std::chrono::steady_clock::time_point end) noexcept {
    st_.open = saved_open_;
    trace_current = rec_.parent;
    try {
      trace_writer& w = *rec_.writer;
      std::size_t chunks = 0;
      if (bytes_ > 0 && kind_ != collective::barrier && kind_ != collective::send_recv) {
        const std::size_t cb =
            std::max<std::size_t>(1, algorithms::detail::chunk_bytes_of(comm_, opt_));
        chunks = (bytes_ + cb - 1) / cb;
      }
      const bool failed = std::uncaught_exceptions() > uncaught_;
      w.event_with([&](fmt::memory_buffer& b) {
        auto out = std::back_inserter(b);
        fmt::format_to(
            out, FMT_COMPILE(R"({{"name":"{}","cat":"{}","ph":"X","pid":{},"tid":{},"ts":)"),
            name_.empty() ? collective_name(kind_) : name_,
            kind_ == collective::send_recv ? "p2p" : "collective", w.rank(), w.collective_tid());
        append_us(b, trace_ns(start_.time_since_epoch()));
        fmt::format_to(out, FMT_COMPILE(R"(,"dur":)"));
        append_us(b, trace_ns(end - start_));
        fmt::format_to(
            out,
            FMT_COMPILE(R"(,"args":{{"seq":{},"bytes":{},"type":"{}","op":"{}",)"
                        R"("algorithm":"{}","chunks":{},"ranks":{},"rank":{})"),
            kind_ == collective::send_recv ? -1 : static_cast<std::int64_t>(seq_), bytes_,
            dtype_name(type_), op_name(op_),
            algo_ == algorithm::automatic ? std::string_view("-") : algorithm_name(algo_), chunks,
            comm_.size(), comm_.rank());
        if (rec_.received) {
          fmt::format_to(out, FMT_COMPILE(R"(,"wait_us":)"));
          append_us(b, trace_ns(rec_.first_receive - start_));
        }
        if (failed) fmt::format_to(out, FMT_COMPILE(R"(,"error":true)"));
        fmt::format_to(out, FMT_COMPILE("}}}}"));
      });
    } catch (...) {
      // Unwinding or not, a trace line that cannot be formatted is dropped, not thrown.
    }
  }

  T& comm_;
  trace_state& st_;
  collective kind_;
  algorithm algo_;
  dtype type_;
  op op_;
  bool active_ = false;
  std::size_t bytes_;
  const options& opt_;
  std::string_view name_;
  std::int64_t ticks_;  ///< the counters' clock at the start
  /// The timeline's clock at the start, read only while the call is traced.
  std::chrono::steady_clock::time_point start_{};
  trace_record rec_{};
  trace_record* saved_open_ = nullptr;
  std::uint64_t seq_ = 0;
  int uncaught_ = 0;
};

#else

template <counted_comm T>
class collective_scope {
 public:
  collective_scope(T&, collective, algorithm, std::size_t, dtype, op, const options&,
                   std::string_view = {}) noexcept {}
  void set_algorithm(algorithm) noexcept {}
};

#endif

/// A caller's named phase (the sharder's gather, reduce, step, checkpoint): recorded on comm's
/// timeline while RINGZERO_TRACE is set, one branch otherwise. It never communicates, so a
/// phase that only some ranks enter is fine; it is written once comm's file is open, i.e. from
/// comm's first collective on (a phase enclosing that first collective included).
template <collective_comm T>
class phase_scope {
 public:
  phase_scope(T& comm, std::string_view name, std::size_t bytes)
      : st_(comm.state().trace), name_(name), bytes_(bytes) {
    if (st_.current_mode() != 0) [[unlikely]]
      begin();
  }
  phase_scope(const phase_scope&) = delete;
  phase_scope& operator=(const phase_scope&) = delete;
  ~phase_scope() {
    if (active_) [[unlikely]]
      finish();
  }
  void set_bytes(std::size_t bytes) noexcept { bytes_ = bytes; }

 private:
  void begin() {
    // The mode is the collectives' thread's to set; a phase on another thread only looks.
    if (st_.current_mode() < 0 && !getenv_str("RINGZERO_TRACE")) return;
    rec_.parent = trace_current;
    rec_.writer = rec_.parent != nullptr && rec_.parent->writer != nullptr
                      ? rec_.parent->writer
                      : st_.published.load(std::memory_order_acquire);
    trace_current = &rec_;
    active_ = true;
    start_ = std::chrono::steady_clock::now();
  }

  void finish() noexcept {
    const auto end = std::chrono::steady_clock::now();
    trace_current = rec_.parent;
    trace_writer* w =
        rec_.writer != nullptr ? rec_.writer : st_.published.load(std::memory_order_acquire);
    if (w == nullptr) return;
    try {
      w->event_with([&](fmt::memory_buffer& b) {
        auto out = std::back_inserter(b);
        fmt::format_to(out, FMT_COMPILE(R"({{"name":")"));
        json_escape(b, name_);
        fmt::format_to(out, FMT_COMPILE(R"(","cat":"phase","ph":"X","pid":{},"tid":{},"ts":)"),
                       w->rank(), trace_thread_writer == w ? w->collective_tid() : w->phase_tid());
        append_us(b, trace_ns(start_.time_since_epoch()));
        fmt::format_to(out, FMT_COMPILE(R"(,"dur":)"));
        append_us(b, trace_ns(end - start_));
        fmt::format_to(out, FMT_COMPILE(R"(,"args":{{"bytes":{}}}}})"), bytes_);
      });
    } catch (...) {
      // As in collective_scope: a lost trace line must not become an error.
    }
  }

  trace_state& st_;
  std::string_view name_;
  std::size_t bytes_;
  bool active_ = false;
  std::chrono::steady_clock::time_point start_{};
  trace_record rec_{};
};

}  // namespace ringzero::detail
