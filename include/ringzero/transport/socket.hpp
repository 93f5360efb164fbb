// The socket transport: ranks as processes on one host or many, over TCP connections of
// their own, with rails. Header-only, POSIX only; nothing to link.
//
//   auto comm = ringzero::socket::communicator::from_env();  // ringzero-run, torchrun, Slurm
//   ringzero::all_reduce(comm, std::span<float>(grads), ringzero::op::sum);
//
// Rails: RINGZERO_RAILS=eth0,eth1,... (interface names, alike on every host, as
// NCCL_SOCKET_IFNAME takes them; IPv4 addresses also do) opens one connection per rail to
// each peer, from and to that interface's IPv4 address (socket/rail.hpp: a rail kind of the
// transport kit). Messages of at least options::stripe_bytes are cut into a piece per rail, in
// proportion to each rail's rate as the receiver measures it (so a rail of half the speed
// takes half as much), smaller ones go whole on their tag's rail; a message completes once the
// receiver acknowledged every piece, and what arrives is bitwise what was sent.
// RINGZERO_RAILS=auto discovers them: the interfaces (up, not loopback, IPv4) that every rank
// has, on one subnet, with addresses that differ from host to host (detail::agree_rails).
// Without RINGZERO_RAILS: one rail, on RINGZERO_SOCKET_IFNAME when set, else loopback when
// every rank is on this host, else the address this host reaches MASTER_ADDR from.
//
// A rail whose connection to a peer fails (or whose interface's link goes down) while other
// rails to that peer still work: its unacknowledged messages and all later traffic go over the
// others (a warning names the rail); only when no rail to a peer is left do the waits on it
// fail, with peer_error naming the rank (and the rail that went last). The kit's rail engine
// (transport/detail/rail_engine.hpp) does all of that, as for libfabric. A peer that closes its
// transport says so, naming the rank it saw fail first, if any, so that every survivor's error
// names the same culprit.
//
// Setup proves every connection: rank 0 draws a secret for the job and hands it over through
// the store, and a connection counts as a rank's only once both ends proved they hold it
// (socket/handshake.hpp); strangers on the setup ports are refused or dropped without holding
// setup up, and the ports close once setup is done. Every frame header is then checked against
// the message and the receive it targets before a byte is allocated or copied (rail.hpp).
//
// Ranks of one host run the hierarchical algorithm's node level over the native shm transport
// (node_transport), as under libfabric.
//
// Progress is manual, as for every ringzero transport: messages move while a thread is inside
// test() or progress(), which every blocking collective calls. A communicator is used from one
// thread at a time; those split from one world share its transport (calls are serialized).
// docs/architecture.md says why ringzero has this transport besides libfabric's tcp;ofi_rxm.
#pragma once

#include "ringzero/communicator.hpp"
#include "ringzero/transport/socket/transport.hpp"

namespace ringzero::socket {

/// ringzero's communicator over sockets: communicator::from_env() joins the job.
using communicator = ringzero::communicator<transport>;

}  // namespace ringzero::socket
