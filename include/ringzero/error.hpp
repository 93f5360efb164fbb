// One exception hierarchy for everything ringzero reports: every failure a caller can see is a
// ringzero::error carrying an errc, so a trainer can catch one type and still tell a timeout
// from a bad argument.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace ringzero {

enum class errc {
  invalid_argument = 1,  ///< the caller passed something the call cannot accept
  unsupported,           ///< valid request, but not available here (provider, algorithm, type)
  timeout,               ///< a blocking wait passed its deadline
  peer_failure,          ///< another rank died or reported an error
  transport,             ///< the network layer (libfabric, NCCL, sockets) failed
  bootstrap,             ///< rendezvous or environment detection failed
  checkpoint,            ///< a checkpoint is missing, corrupt or inconsistent
  mismatch,              ///< ranks disagree on a collective's arguments (RINGZERO_CHECK)
};

[[nodiscard]] constexpr const char* errc_name(errc c) noexcept {
  switch (c) {
    case errc::invalid_argument:
      return "invalid argument";
    case errc::unsupported:
      return "unsupported";
    case errc::timeout:
      return "timeout";
    case errc::peer_failure:
      return "peer failure";
    case errc::transport:
      return "transport error";
    case errc::bootstrap:
      return "bootstrap error";
    case errc::checkpoint:
      return "checkpoint error";
    case errc::mismatch:
      return "argument mismatch";
  }
  return "error";
}

class error : public std::runtime_error {
 public:
  error(errc code, const std::string& what)
      : std::runtime_error(std::string("ringzero: ") + what), code_(code) {}
  [[nodiscard]] errc code() const noexcept { return code_; }

 private:
  errc code_;
};

class invalid_argument : public error {
 public:
  explicit invalid_argument(const std::string& what) : error(errc::invalid_argument, what) {}
};

class unsupported : public error {
 public:
  explicit unsupported(const std::string& what) : error(errc::unsupported, what) {}
};

/// Raised by waits that outlive their deadline; peer() is the rank that never answered (-1 if
/// the wait was not on one peer).
class timeout_error : public error {
 public:
  timeout_error(const std::string& what, int peer) : error(errc::timeout, what), peer_(peer) {}
  [[nodiscard]] int peer() const noexcept { return peer_; }

 private:
  int peer_;
};

/// Another rank failed: it exited, its connection broke, or it raised an error of its own.
class peer_error : public error {
 public:
  peer_error(const std::string& what, int peer) : error(errc::peer_failure, what), peer_(peer) {}
  [[nodiscard]] int peer() const noexcept { return peer_; }

 private:
  int peer_;
};

class transport_error : public error {
 public:
  explicit transport_error(const std::string& what) : error(errc::transport, what) {}
};

class bootstrap_error : public error {
 public:
  explicit bootstrap_error(const std::string& what) : error(errc::bootstrap, what) {}
};

class checkpoint_error : public error {
 public:
  explicit checkpoint_error(const std::string& what) : error(errc::checkpoint, what) {}
};

class mismatch_error : public error {
 public:
  explicit mismatch_error(const std::string& what) : error(errc::mismatch, what) {}
};

}  // namespace ringzero
