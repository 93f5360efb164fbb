// A rail: one path to every peer through one NIC (a libfabric endpoint, a TCP connection per
// peer on one interface, a test's mailbox), as the rail engine (rail_engine.hpp) drives it. A
// rail takes tagged operations and reports how they ended; it knows no request, deadline,
// striping, sequence number, acknowledgement or failover: those are the engine's, written once
// for every kind of rail. A network transport is a rail kind and a handshake that connects
// them; what a kind must offer is the concept at the end of this file:
//
//   post(op)       hand a send or receive over; 0, -EAGAIN (no room now: the engine keeps it
//                  queued and posts it again), or another negative code (error_text says it)
//   poll(events)   report what ended since the last call (done / failed), and what happened to
//                  the links (a connection lost, a peer that said goodbye), through `events`;
//                  never inside post() or cancel()
//   cancel(op)     ask for a posted op back: it then ends as failed(cancelled), or as it
//                  finished if it was too late
//   link_state()   why the rail's link is down (sysfs, an injected fault), or empty
//   price()        the cost model's figures for one message and one byte on this rail
//   name(), traits()
//
// and may offer: inject() (a small send that leaves now, complete on return), prepare() and
// release() (per-op resources such as a memory registration), host_readable() (false for device
// memory the engine may not copy), arrival_rate() (the rate a peer's bytes arrive at, which the
// engine reports to that peer so it can weigh its pieces), close_step() (a goodbye and what is
// still queued, before the rail is destroyed) and leave_open() (give provider resources up
// without closing them, when operations are still held at destruction).
//
// Matching: a receive takes the first message from its peer (any peer with world_peer -1) with
// its piece number and its tag (bits in `ignore` not compared), in the order receives were
// posted; messages with one (peer, piece, tag) arrive in the order they were sent on the rail.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ringzero/tuning/policy.hpp"

namespace ringzero::detail {

/// What the engine does with an operation's completion: a message (or a piece of one) of the
/// caller's, or one of its own (a statement received or sent, a copied send's sending).
enum class op_role : std::uint8_t { message, control_recv, control_send, copy };
enum class op_status : std::uint8_t { pending, done, failed, cancelled };

/// One operation: a message the caller holds, one of its pieces on a rail, or the engine's own.
/// `scratch` comes first: a rail may hand the operation's address to a provider that needs its
/// own space at the start of it (libfabric's fi_context2).
template <class Scratch>
struct rail_op {
  Scratch scratch{};
  op_status state = op_status::pending;
  op_role kind = op_role::message;
  bool is_send = false;
  bool posted = false;    ///< handed to the rail (else queued in the engine)
  bool in_use = false;    ///< made and not yet recycled
  bool orphaned = false;  ///< its request gave up on it; freed when its completion arrives
  bool detached = false;  ///< a send whose request gave up on it: finishes from `own`, then freed
  bool peer_loss = false;
  /// A receive that takes any cut of its message: `buffer` is the whole message, `length` its
  /// size, and each piece says where it goes (rails whose traits say places_pieces).
  bool placed = false;
  bool striped = false;    ///< a message in pieces: posted nowhere, its pieces are
  bool with_data = false;  ///< a send carries `data`
  bool acked = false;      ///< a send: the receiver has it
  bool wire_done = false;  ///< a send: the rail completed it
  bool tracked = false;    ///< a send: listed among the peer's unacknowledged messages
  bool moving = false;     ///< a receive cancelled to be moved off a failed rail
  bool held = false;       ///< a send kept back until the peer has given up a failed rail too
  std::uint8_t rail = 0;
  std::uint8_t piece = 0;      ///< its number within its message (delivery::limits::piece_bits)
  std::uint8_t unsettled = 0;  ///< a striped message's pieces not yet complete
  int world_peer = -1;         ///< the transport's rank; -1: any (the engine's own receives)
  int peer = -1;               ///< the posting communicator's rank, for errors
  std::byte* buffer = nullptr;
  std::size_t length = 0;
  std::size_t offset = 0;  ///< a piece's place in its message
  std::size_t total = 0;   ///< its message's size
  std::size_t got = 0;     ///< a placed message: bytes its pieces brought
  std::uint64_t tag = 0;
  std::uint64_t ignore = 0;  ///< a receive's tag bits not compared
  std::uint64_t data = 0;    ///< the word sent with it (delivery::cq_word), or received
  std::uint64_t seq = 0;     ///< a piece's sequence number toward or from world_peer
  std::uint64_t order = 0;   ///< when it was made: moved receives keep their posting order
  std::string error;
  std::vector<rail_op*> pieces{};      ///< a striped message's pieces still held
  rail_op* parent = nullptr;           ///< for a piece: the message it belongs to
  std::shared_ptr<std::byte[]> own{};  ///< bytes the engine sends from (a copy, a statement)
};

/// How a rail operation failed, as the engine needs to tell it.
enum class rail_fault : std::uint8_t {
  cancelled,  ///< cancel() took it back (or the rail gave it up without being asked)
  truncated,  ///< a receive whose message has another size (`sent` says which, 0: unknown)
  peer_lost,  ///< the path to the peer is gone (a connection reset, an unreachable host)
  other,
};

/// What a rail reports from poll(); the engine implements it.
template <class Op>
class rail_events {
 public:
  /// `op` finished: `len` bytes moved (a receive: its piece's length); `data` arrived with it
  /// when `has_data`.
  virtual void done(Op& op, std::size_t len, std::uint64_t data, bool has_data) = 0;
  virtual void failed(Op& op, rail_fault fault, const std::string& why, std::size_t sent,
                      std::uint64_t data, bool has_data) = 0;
  /// The rail can no longer reach world rank `peer` (its connection broke).
  virtual void link_failed(int peer, const std::string& why) = 0;
  /// `peer` closed its end of this rail in order, naming the rank it saw fail first (-1: none).
  virtual void peer_left(int peer, int culprit) = 0;

 protected:
  virtual ~rail_events() = default;
};

/// A send that leaves at once (rail::inject), from bytes the rail does not keep.
struct rail_message {
  int peer = -1;
  std::span<const std::byte> bytes{};
  std::uint64_t tag = 0;
  std::uint8_t piece = 0;
  bool with_data = false;
  std::uint64_t data = 0;
  std::size_t offset = 0;
  std::size_t total = 0;
  /// Another message to the same peer follows at once: a rail that bundles may keep this one
  /// to leave with it (a statement riding with data, one system call for both).
  bool more = false;
};

/// What a rail can do, read once by the engine.
struct rail_traits {
  std::size_t send_limit = 1;     ///< sends posted at once; more wait in the engine
  std::size_t receive_limit = 1;  ///< receives likewise
  std::size_t inject_size = 0;    ///< the largest inject(); 0: none
  std::size_t max_message_size = SIZE_MAX;
  /// Every piece carries its offset and its message's size: a receive takes any cut (placed),
  /// so the sender may cut by measured rates instead of shares both ends agreed.
  bool places_pieces = false;
  /// The rail reads a posted send's bytes from op.buffer afresh at each call: the engine may
  /// point it at a copy meanwhile (an abandoned send then finishes from the copy).
  bool rebuffers = false;
  /// inject() with `more` keeps the message for the next one to the same peer.
  bool bundles = false;
};

template <class R>
concept rail_kind = requires(R& r, const R& cr, typename R::op& o,
                             rail_events<typename R::op>& events) {
  typename R::scratch;
  requires std::same_as<typename R::op, rail_op<typename R::scratch>>;
  { r.post(o) }
  noexcept->std::same_as<long>;
  {r.poll(events)};
  { r.cancel(o) }
  noexcept;
  { cr.link_state() } -> std::same_as<std::string>;
  { cr.price() } -> std::same_as<tuning::rail_price>;
  { cr.name() } -> std::convertible_to<const std::string&>;
  { cr.traits() } -> std::same_as<rail_traits>;
  { cr.error_text(long{}) } -> std::same_as<std::string>;
};

}  // namespace ringzero::detail
