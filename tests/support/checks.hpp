// Helpers the loopback tests of bad input share: an environment variable set for one scope,
// the message of an expected error, and a runner for a table of calls that must be rejected
// before they post anything; and for the tests of hostile clients, whether a server closed a
// connection.
#pragma once

#include <doctest/doctest.h>
#include <poll.h>
#include <sys/socket.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ringzero/ringzero.hpp"

namespace test_support {

/// Sets (or with nullptr unsets) an environment variable for one scope. Set before a world
/// starts its threads and restored after they joined, so no rank reads it while it changes.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~scoped_env() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

[[nodiscard]] inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

/// The message of the Error that f throws; a failed check (and "") if it throws nothing or
/// something else.
template <class Error, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL_CHECK("threw the wrong type: " << e.what());
    return "";
  }
  FAIL_CHECK("threw nothing");
  return "";
}

/// A valid all_reduce after a rejected call: it only works if the rejected call posted nothing
/// (a stray message or a skipped sequence number would make it fail or hang until the timeout).
inline void check_still_works(ringzero::loopback::communicator& c) {
  std::vector<std::int32_t> v(37, c.rank() + 1);
  ringzero::all_reduce(c, std::span<std::int32_t>(v), ringzero::op::sum);
  const int n = c.size();
  for (auto x : v) REQUIRE(x == n * (n + 1) / 2);
}

/// A case tried on every rank where it `applies` (rooted calls check some arguments on the root
/// only): `call` must throw Error naming every part of `names`.
struct bad_call {
  const char* what;
  std::function<void()> call;
  std::vector<std::string> names = {};
  bool applies = true;
};

/// Tries each call, checks that it was rejected without moving any sequence number (collective
/// or point-to-point), then that the communicator still works.
template <class Error = ringzero::invalid_argument>
void try_all(ringzero::loopback::communicator& c, const std::vector<bad_call>& calls) {
  for (const auto& bad : calls) {
    INFO(c.size() << " ranks, rank " << c.rank() << ": " << bad.what);
    if (bad.applies) {
      const auto seq = c.state().collective_seq;
      const auto p2p_sends = c.state().p2p_send_seq;
      const auto p2p_recvs = c.state().p2p_recv_seq;
      const std::string what = error_of<Error>(bad.call);
      INFO("message: " << what);
      for (const auto& part : bad.names)
        CHECK_MESSAGE(contains(what, part), "expected the message to name '", part, "'");
      CHECK(c.state().collective_seq == seq);
      CHECK(c.state().p2p_send_seq == p2p_sends);
      CHECK(c.state().p2p_recv_seq == p2p_recvs);
    }
    check_still_works(c);
  }
}

/// Whether the other side closes `fd` within `limit`, reading and dropping what it sends.
[[nodiscard]] inline bool closed_within(int fd, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  std::array<std::byte, 4096> buf{};
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    if (::recv(fd, buf.data(), buf.size(), 0) <= 0) return true;
  }
}

}  // namespace test_support
