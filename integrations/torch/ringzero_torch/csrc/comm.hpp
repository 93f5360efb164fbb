// The seam between the two halves of the extension. The ringzero half (comm_*.cpp) includes
// ringzero's headers and no torch header; the torch half (backend.cpp, module.cpp) includes
// torch's and no ringzero header. What crosses is this file: a communicator with its element
// types as codes and its buffers as pointers, the store as a key-value interface, and errors as
// comm_error. The typed collectives (the slow part of the build) then compile without torch's
// headers, and the files that include torch's compile without ringzero's templates.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace ringzero_torch {

/// Element types the reductions know (ringzero::dtype's order); anything else moves as bytes.
enum class element : std::uint8_t {
  int8,
  uint8,
  int32,
  uint32,
  int64,
  uint64,
  float16,
  float32,
  float64,
  bfloat16
};
enum class reduction : std::uint8_t { sum, prod, min, max, avg };

/// What a failed call reports, so the torch half can raise torch's own error type. `peer` is
/// the rank that failed or never answered (-1: none known).
struct comm_error : std::runtime_error {
  enum class kind { invalid, unsupported, timeout, peer, transport, bootstrap, mismatch, other };
  comm_error(kind k, const std::string& what, int peer)
      : std::runtime_error(what), k(k), peer(peer) {}
  kind k;
  int peer;
};

/// The rendezvous store, as torch's c10d::Store offers it. Every call may throw; the ringzero
/// half turns that into a bootstrap error naming the key.
class key_value {
 public:
  virtual ~key_value() = default;
  virtual void set(const std::string& key, const std::vector<std::uint8_t>& value) = 0;
  virtual std::vector<std::uint8_t> get(const std::string& key) = 0;
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds limit) = 0;
};

struct call_options {
  std::chrono::nanoseconds timeout{0};  ///< 0: the communicator's
  bool reproducible = false;
  std::string algorithm;  ///< empty: automatic
};

/// A posted isend/irecv.
class message {
 public:
  virtual ~message() = default;
  /// True once complete; throws comm_error on failure or past the deadline.
  virtual bool test() = 0;
};

class comm {
 public:
  virtual ~comm() = default;
  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  /// "shm" or "socket": what the ranks agreed on.
  [[nodiscard]] virtual std::string transport_name() const = 0;

  // Counts are elements of `type` (bytes for the data movers): all_reduce, broadcast and
  // reduce the buffer; reduce_scatter the output block; all_gather and gather the input block;
  // scatter the output block; all_to_all the whole buffer.
  virtual void all_reduce(element type, const void* in, void* out, std::size_t count, reduction op,
                          const call_options& o) = 0;
  virtual void reduce(element type, const void* in, void* out, std::size_t count, reduction op,
                      int root, const call_options& o) = 0;
  virtual void reduce_scatter(element type, const void* in, void* out, std::size_t count,
                              reduction op, const call_options& o) = 0;
  virtual void all_gather(const void* in, void* out, std::size_t bytes, const call_options& o) = 0;
  virtual void broadcast(void* data, std::size_t bytes, int root, const call_options& o) = 0;
  virtual void gather(const void* in, void* out, std::size_t bytes, int root,
                      const call_options& o) = 0;
  virtual void scatter(const void* in, void* out, std::size_t bytes, int root,
                       const call_options& o) = 0;
  virtual void all_to_all(const void* in, void* out, std::size_t bytes, const call_options& o) = 0;
  /// Byte counts and displacements per rank, as MPI_Alltoallv.
  virtual void all_to_allv(const void* in, void* out, const std::vector<std::size_t>& send_counts,
                           const std::vector<std::size_t>& send_displs,
                           const std::vector<std::size_t>& recv_counts,
                           const std::vector<std::size_t>& recv_displs, const call_options& o) = 0;
  virtual void barrier(const call_options& o) = 0;
  [[nodiscard]] virtual std::unique_ptr<message> isend(const void* data, std::size_t bytes,
                                                       int peer, std::uint32_t tag,
                                                       const call_options& o) = 0;
  [[nodiscard]] virtual std::unique_ptr<message> irecv(void* data, std::size_t bytes, int peer,
                                                       std::uint32_t tag,
                                                       const call_options& o) = 0;
  /// ringzero's split(): collective over this communicator; nullptr where color < 0. The new
  /// communicator shares this one's transport.
  [[nodiscard]] virtual std::unique_ptr<comm> split(int color, int key) = 0;
  /// Fails every wait, in any thread, and every later call.
  virtual void abort(const std::string& why) noexcept = 0;
  /// The rank (of this communicator) the transport saw fail, or -1.
  [[nodiscard]] virtual int failed_rank() const noexcept = 0;
};

/// Joins the `size` ranks meeting in `store`: native shm when every rank runs on this host,
/// else ringzero's sockets (RINGZERO_TORCH_TRANSPORT=shm|socket forces one). `timeout` bounds
/// the setup and is every later call's deadline.
[[nodiscard]] std::unique_ptr<comm> make_comm(key_value& store, int rank, int size,
                                              std::chrono::nanoseconds timeout);

/// The largest tag isend/irecv accept (ringzero::max_p2p_tag).
[[nodiscard]] std::uint32_t max_tag() noexcept;

}  // namespace ringzero_torch
