// comm (comm.hpp) over ringzero::communicator<Transport>: the ringzero half of the extension.
// Each transport's file (comm_shm.cpp, comm_socket.cpp) instantiates it once.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/p2p.hpp"

namespace ringzero_torch::detail {

/// Runs f, turning ringzero's errors into comm_error; failed() names the rank a transport saw
/// fail, for an error that names none itself.
template <class F, class G>
decltype(auto) translate(F&& f, G&& failed) {
  using kind = comm_error::kind;
  try {
    return f();
  } catch (const comm_error&) {
    throw;
  } catch (const ringzero::timeout_error& e) {
    throw comm_error(kind::timeout, e.what(), e.peer() >= 0 ? e.peer() : failed());
  } catch (const ringzero::peer_error& e) {
    throw comm_error(kind::peer, e.what(), e.peer() >= 0 ? e.peer() : failed());
  } catch (const ringzero::error& e) {
    kind k = kind::other;
    switch (e.code()) {
      case ringzero::errc::invalid_argument:
        k = kind::invalid;
        break;
      case ringzero::errc::unsupported:
        k = kind::unsupported;
        break;
      case ringzero::errc::transport:
        k = kind::transport;
        break;
      case ringzero::errc::bootstrap:
        k = kind::bootstrap;
        break;
      case ringzero::errc::mismatch:
        k = kind::mismatch;
        break;
      default:
        break;
    }
    throw comm_error(k, e.what(), failed());
  } catch (const std::exception& e) {
    throw comm_error(kind::other, e.what(), failed());
  }
}

/// ringzero's store concept over torch's Store (through key_value). Failures of the store
/// itself (its server gone, its deadline passed) become bootstrap_error naming the key.
class store_adapter final : public ringzero::bootstrap::store {
  template <class F>
  static decltype(auto) guard(std::string_view what, std::string_view key, F&& f) {
    try {
      return f();
    } catch (const std::exception& e) {
      throw ringzero::bootstrap_error(fmt::format(
          "rendezvous through torch's Store failed: {}('{}'): {}", what, key, e.what()));
    }
  }

 public:
  explicit store_adapter(key_value& kv) : kv_(kv) {}

  void set(std::string_view key, std::span<const std::byte> value) override {
    guard("set", key, [&] {
      const auto* p = reinterpret_cast<const std::uint8_t*>(value.data());
      kv_.set(std::string(key), std::vector<std::uint8_t>(p, p + value.size()));
      return 0;
    });
  }
  [[nodiscard]] std::vector<std::byte> get(std::string_view key) override {
    return guard("get", key, [&] { return to_bytes(kv_.get(std::string(key))); });
  }
  std::int64_t add(std::string_view key, std::int64_t delta) override {
    return guard("add", key, [&] { return kv_.add(std::string(key), delta); });
  }
  void wait(std::span<const std::string> keys) override {
    guard("wait", keys.empty() ? std::string_view{} : std::string_view(keys[0]), [&] {
      kv_.wait(std::vector<std::string>(keys.begin(), keys.end()));
      return 0;
    });
  }
  [[nodiscard]] std::vector<std::byte> get_within(std::string_view key,
                                                  std::chrono::nanoseconds limit) override {
    return guard("get", key, [&] {
      kv_.wait({std::string(key)}, std::chrono::duration_cast<std::chrono::milliseconds>(limit) +
                                       std::chrono::milliseconds(1));
      return to_bytes(kv_.get(std::string(key)));
    });
  }

 private:
  static std::vector<std::byte> to_bytes(const std::vector<std::uint8_t>& v) {
    std::vector<std::byte> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<std::byte>(v[i]);
    return out;
  }
  key_value& kv_;
};

// comm.hpp mirrors ringzero's codes so that the torch half needs no ringzero header: the
// mirror must keep their order.
static_assert(static_cast<int>(element::int8) == static_cast<int>(ringzero::dtype::int8) &&
              static_cast<int>(element::uint8) == static_cast<int>(ringzero::dtype::uint8) &&
              static_cast<int>(element::int32) == static_cast<int>(ringzero::dtype::int32) &&
              static_cast<int>(element::uint32) == static_cast<int>(ringzero::dtype::uint32) &&
              static_cast<int>(element::int64) == static_cast<int>(ringzero::dtype::int64) &&
              static_cast<int>(element::uint64) == static_cast<int>(ringzero::dtype::uint64) &&
              static_cast<int>(element::float16) == static_cast<int>(ringzero::dtype::float16) &&
              static_cast<int>(element::float32) == static_cast<int>(ringzero::dtype::float32) &&
              static_cast<int>(element::float64) == static_cast<int>(ringzero::dtype::float64) &&
              static_cast<int>(element::bfloat16) == static_cast<int>(ringzero::dtype::bfloat16));
static_assert(static_cast<int>(reduction::sum) == static_cast<int>(ringzero::op::sum) &&
              static_cast<int>(reduction::prod) == static_cast<int>(ringzero::op::prod) &&
              static_cast<int>(reduction::min) == static_cast<int>(ringzero::op::min) &&
              static_cast<int>(reduction::max) == static_cast<int>(ringzero::op::max) &&
              static_cast<int>(reduction::avg) == static_cast<int>(ringzero::op::avg));

[[nodiscard]] inline ringzero::op to_op(reduction r) {
  return static_cast<ringzero::op>(static_cast<std::uint8_t>(r));
}
[[nodiscard]] inline ringzero::dtype to_dtype(element e) {
  return static_cast<ringzero::dtype>(static_cast<std::uint8_t>(e));
}
[[nodiscard]] inline ringzero::options to_options(const call_options& o) {
  ringzero::options r;
  r.timeout = o.timeout;
  r.reproducible = o.reproducible;
  if (!o.algorithm.empty()) r.algorithm = ringzero::parse_algorithm(o.algorithm);
  return r;
}

template <class T>
class message_impl final : public message {
 public:
  explicit message_impl(ringzero::p2p_request<T> r) : r_(std::move(r)) {}
  bool test() override {
    return translate([&] { return r_.test(); }, [] { return -1; });
  }

 private:
  ringzero::p2p_request<T> r_;
};

template <class T>
class comm_impl final : public comm {
 public:
  using communicator = ringzero::communicator<T>;

  comm_impl(communicator c, std::string name) : c_(std::move(c)), name_(std::move(name)) {}

  [[nodiscard]] int rank() const override { return c_.rank(); }
  [[nodiscard]] int size() const override { return c_.size(); }
  [[nodiscard]] std::string transport_name() const override { return name_; }

  void all_reduce(element type, const void* in, void* out, std::size_t count, reduction op,
                  const call_options& o) override {
    typed(type, [&](auto zero) {
      using E = decltype(zero);
      ringzero::all_reduce(c_, std::span<const E>(static_cast<const E*>(in), count),
                           std::span<E>(static_cast<E*>(out), count), to_op(op), to_options(o));
    });
  }
  void reduce(element type, const void* in, void* out, std::size_t count, reduction op, int root,
              const call_options& o) override {
    typed(type, [&](auto zero) {
      using E = decltype(zero);
      ringzero::reduce(c_, std::span<const E>(static_cast<const E*>(in), count),
                       std::span<E>(static_cast<E*>(out), c_.rank() == root ? count : 0), to_op(op),
                       root, to_options(o));
    });
  }
  void reduce_scatter(element type, const void* in, void* out, std::size_t count, reduction op,
                      const call_options& o) override {
    typed(type, [&](auto zero) {
      using E = decltype(zero);
      const std::size_t n = count * static_cast<std::size_t>(c_.size());
      ringzero::reduce_scatter(c_, std::span<const E>(static_cast<const E*>(in), n),
                               std::span<E>(static_cast<E*>(out), count), to_op(op), to_options(o));
    });
  }
  void all_gather(const void* in, void* out, std::size_t bytes, const call_options& o) override {
    run([&] {
      ringzero::all_gather(c_, bytes_of(in, bytes), bytes_of(out, bytes * size_u()), to_options(o));
    });
  }
  void broadcast(void* data, std::size_t bytes, int root, const call_options& o) override {
    run([&] { ringzero::broadcast(c_, bytes_of(data, bytes), root, to_options(o)); });
  }
  void gather(const void* in, void* out, std::size_t bytes, int root,
              const call_options& o) override {
    run([&] {
      ringzero::gather(c_, bytes_of(in, bytes),
                       bytes_of(out, c_.rank() == root ? bytes * size_u() : 0), root,
                       to_options(o));
    });
  }
  void scatter(const void* in, void* out, std::size_t bytes, int root,
               const call_options& o) override {
    run([&] {
      ringzero::scatter(c_, bytes_of(in, c_.rank() == root ? bytes * size_u() : 0),
                        bytes_of(out, bytes), root, to_options(o));
    });
  }
  void all_to_all(const void* in, void* out, std::size_t bytes, const call_options& o) override {
    run([&] {
      ringzero::all_to_all(c_, bytes_of(in, bytes), bytes_of(out, bytes), to_options(o));
    });
  }
  void all_to_allv(const void* in, void* out, const std::vector<std::size_t>& send_counts,
                   const std::vector<std::size_t>& send_displs,
                   const std::vector<std::size_t>& recv_counts,
                   const std::vector<std::size_t>& recv_displs, const call_options& o) override {
    run([&] {
      ringzero::all_to_allv(c_, bytes_of(in, extent(send_counts, send_displs)), send_counts,
                            send_displs, bytes_of(out, extent(recv_counts, recv_displs)),
                            recv_counts, recv_displs, to_options(o));
    });
  }
  void barrier(const call_options& o) override {
    run([&] { ringzero::barrier(c_, to_options(o)); });
  }
  [[nodiscard]] std::unique_ptr<message> isend(const void* data, std::size_t bytes, int peer,
                                               std::uint32_t tag, const call_options& o) override {
    return run([&]() -> std::unique_ptr<message> {
      return std::make_unique<message_impl<T>>(
          ringzero::isend(c_, bytes_of(data, bytes), peer, tag, to_options(o)));
    });
  }
  [[nodiscard]] std::unique_ptr<message> irecv(void* data, std::size_t bytes, int peer,
                                               std::uint32_t tag, const call_options& o) override {
    return run([&]() -> std::unique_ptr<message> {
      return std::make_unique<message_impl<T>>(
          ringzero::irecv(c_, bytes_of(data, bytes), peer, tag, to_options(o)));
    });
  }
  [[nodiscard]] std::unique_ptr<comm> split(int color, int key) override {
    return run([&]() -> std::unique_ptr<comm> {
      auto sub = c_.split(color, key);
      if (!sub) return nullptr;
      return std::make_unique<comm_impl>(std::move(*sub), name_);
    });
  }
  void abort(const std::string& why) noexcept override {
    try {
      c_.abort(why);
    } catch (...) {  // abort() is the last resort of a failing program: it must not throw
    }
  }
  [[nodiscard]] int failed_rank() const noexcept override {
    if constexpr (requires { c_.failed_rank(); })
      return c_.failed_rank();
    else
      return -1;
  }

 private:
  [[nodiscard]] std::size_t size_u() const { return static_cast<std::size_t>(c_.size()); }
  static std::span<std::uint8_t> bytes_of(void* p, std::size_t n) {
    return {static_cast<std::uint8_t*>(p), n};
  }
  static std::span<const std::uint8_t> bytes_of(const void* p, std::size_t n) {
    return {static_cast<const std::uint8_t*>(p), n};
  }
  static std::size_t extent(const std::vector<std::size_t>& counts,
                            const std::vector<std::size_t>& displs) {
    std::size_t end = 0;
    for (std::size_t i = 0; i < counts.size() && i < displs.size(); ++i)
      if (counts[i] > 0) end = std::max(end, displs[i] + counts[i]);
    return end;
  }
  template <class F>
  decltype(auto) run(F&& f) {
    return translate(std::forward<F>(f), [this] { return failed_rank(); });
  }
  template <class F>
  void typed(element type, F&& f) {
    run([&] { ringzero::visit_dtype(to_dtype(type), f); });
  }

  communicator c_;
  std::string name_;
};

}  // namespace ringzero_torch::detail
