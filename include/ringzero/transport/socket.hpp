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
// the message and the receive it targets before a byte is allocated or copied (engine.hpp).
//
// Ranks of one host run the hierarchical algorithm's node level over the native shm transport
// (node_transport), as under libfabric.
//
// Progress is manual, as for every ringzero transport: messages move while a thread is inside
// test() or progress(), which every blocking collective calls. A communicator is used from one
// thread at a time; those split from one world share its transport (calls are serialized).
// docs/architecture.md says why ringzero has this transport besides libfabric's tcp;ofi_rxm.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/hmac.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/process_watch.hpp"
#include "ringzero/transport/detail/rail_engine.hpp"
#include "ringzero/transport/detail/request.hpp"
#include "ringzero/transport/shm.hpp"
#include "ringzero/transport/socket/handshake.hpp"
#include "ringzero/transport/socket/rail.hpp"
#include "ringzero/transport/socket/rails.hpp"
#include "ringzero/transport/socket/wire.hpp"
#include "ringzero/tuning/defaults.hpp"

namespace ringzero::socket {

namespace detail {
/// The kit's rail engine over socket rails.
using engine = ringzero::detail::rail_engine<rail>;

/// Who failed first, as a socket rank sees it: the first rank suspected or reported (a broken
/// connection, a peer's goodbye), and the processes of this host probed, so that a rank that is
/// stopped (SIGSTOP, a debugger) is named as stopped rather than as failed: it keeps its
/// connections open, so only a wait that gives up finds it.
class process_failure final : public ringzero::detail::first_failure {
 public:
  process_failure(int self, std::vector<ringzero::detail::process_id> procs)
      : first_failure(self), self_(self), procs_(std::move(procs)) {}

  [[nodiscard]] std::vector<int> stopped_ranks() const override {
    const auto self = ringzero::detail::self_process();
    std::vector<int> stopped;
    for (std::size_t r = 0; r < procs_.size(); ++r)
      if (static_cast<int>(r) != self_ &&
          ringzero::detail::probe(procs_[r], self) == ringzero::detail::process_state::stopped)
        stopped.push_back(static_cast<int>(r));
    return stopped;
  }
  /// A goodbye naming a rank of this host that is stopped says so, as libfabric's watchdog does.
  void report(int rank, std::string why) override {
    if (rank >= 0 && static_cast<std::size_t>(rank) < procs_.size() && rank != self_ &&
        ringzero::detail::probe(procs_[static_cast<std::size_t>(rank)],
                                ringzero::detail::self_process()) ==
            ringzero::detail::process_state::stopped &&
        why.find("is stopped") == std::string::npos)
      why = fmt::format("rank {} is stopped (SIGSTOP or a debugger), as {}", rank, why);
    first_failure::report(rank, std::move(why));
  }

 private:
  int self_;
  std::vector<ringzero::detail::process_id> procs_;  ///< by rank, as each published itself
};
}  // namespace detail

struct options {
  /// 0: RINGZERO_TIMEOUT (default 300 s). Bounds the setup and every collective.
  std::chrono::nanoseconds timeout{0};
  /// Interface names or IPv4 addresses, one per rail; empty: RINGZERO_RAILS, else one rail on
  /// RINGZERO_SOCKET_IFNAME, else as the header says. Every rank must have as many.
  std::vector<std::string> rails{};
  /// Messages of at least this many bytes are striped over the rails; RINGZERO_STRIPE_BYTES,
  /// when set, replaces it.
  std::size_t stripe_bytes = std::size_t{64} << 10;
  /// A striped message's pieces are cut in proportion to each rail's rate, as the receiving side
  /// measures it; false: equal pieces. RINGZERO_RAIL_SHARES=equal also turns it off (=measured
  /// is the default).
  bool weigh_rails = true;
  /// SO_SNDBUF and SO_RCVBUF of every connection; 0 leaves them to the kernel's autotuning.
  std::size_t buffer_bytes = std::size_t{4} << 20;
  /// How long a connection may hold unacknowledged data before it counts as failed
  /// (TCP_USER_TIMEOUT): what bounds the detection of a link that went down silently.
  std::chrono::milliseconds rail_timeout{10000};
  /// How long a connection accepted during setup may take to prove it belongs to the job
  /// (socket/handshake.hpp) before it is dropped; bounded by `timeout`. The job's own ranks
  /// take milliseconds; the limit is for strangers, who cannot hold setup up meanwhile anyway.
  std::chrono::nanoseconds handshake_timeout{std::chrono::seconds(10)};
  /// The cost model's constants; unset: tuning::defaults::socket over the rails, each priced
  /// tuning::defaults::socket_rail. Must be the same on every rank.
  std::optional<ringzero::tuning::policy> tuning{};
};

class transport {
 public:
  using from_env_options = socket::options;
  /// The ranks of one host also share memory: the hierarchical algorithm runs its node level
  /// over the native shm transport, set up over this one (RINGZERO_NODE_SHM=0 keeps it here).
  using node_transport = ringzero::shm::transport;

  /// Handle to one posted send or receive. Destroying it before completion cancels it: a
  /// receive is never written afterwards; a send already under way finishes from a copy.
  using request = ringzero::detail::transport_request<transport, detail::engine, detail::op*>;

  /// Joins the job the environment describes (ringzero-run, torchrun, Slurm, Open MPI
  /// variables): opens the store, connects, closes the store again.
  [[nodiscard]] static transport from_env(const from_env_options& opt = {}) {
    const bootstrap::launch_info info = bootstrap::detect_launch();
    log::detail::process_rank().store(info.rank);
    const auto timeout = opt.timeout.count() > 0 ? opt.timeout : ringzero::detail::env_timeout();
    const std::unique_ptr<bootstrap::store> store = bootstrap::make_store(info, timeout);
    return transport(*store, info.rank, info.world_size, opt, info.master_addr);
  }

  /// Collective over the `size` processes sharing `store` (used only while constructing).
  /// options::rails empty: RINGZERO_RAILS, else RINGZERO_SOCKET_IFNAME, else loopback on one
  /// host, else the address that reaches MASTER_ADDR.
  transport(bootstrap::store& store, int rank, int size, const options& opt = {})
      : transport(store, rank, size, opt,
                  ringzero::detail::getenv_str("MASTER_ADDR").value_or("127.0.0.1")) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return static_cast<int>(hosts_.size()); }
  [[nodiscard]] const ringzero::tuning::policy& tuning() const noexcept { return tuning_; }
  [[nodiscard]] std::string tuning_name() const { return "socket"; }
  [[nodiscard]] std::chrono::nanoseconds default_timeout() const noexcept { return timeout_; }
  [[nodiscard]] const std::string& host_of(int r) const noexcept {
    return hosts_[static_cast<std::size_t>(r)];
  }

  /// Rails, by name as given (the same order on every rank).
  [[nodiscard]] int rails() const noexcept { return static_cast<int>(eng_->rails()); }
  [[nodiscard]] const std::string& rail_name(int r) const {
    return eng_->rail_name(static_cast<std::size_t>(r));
  }
  /// Rails to `peer` still in use.
  [[nodiscard]] int live_rails(int peer) const {
    return static_cast<int>(eng_->rails_in_use(peer));
  }
  /// Payload bytes each rail delivered (acknowledged), to every peer together.
  [[nodiscard]] std::vector<std::uint64_t> rail_bytes() const {
    std::vector<std::uint64_t> out;
    for (std::size_t r = 0; r < eng_->rails(); ++r) out.push_back(eng_->rail_bytes(r));
    return out;
  }
  /// Each rail's rate toward `peer`, bytes per second, as the peer measured it (0: not yet).
  [[nodiscard]] std::vector<double> rail_rates(int peer) const {
    std::vector<double> out;
    for (const auto kib : eng_->rail_rates(peer)) out.push_back(kib * 1024.0);
    return out;
  }
  /// For tests: breaks the connection to `peer` on `rail`, as a failing link would.
  void break_rail(int peer, int rail) {
    eng_->with_rails(
        [&](auto& rails) { rails.at(static_cast<std::size_t>(rail))->break_connection(peer); });
  }
  /// For tests: gives rail `r` up toward every rank, as a link found down would; its messages
  /// move to the rails left (the peers learn it and do the same).
  void fail_rail(std::size_t r, const std::string& why) { eng_->fail_rail(r, why); }
  /// The shared engine, for diagnostics (rails in use, messages each carried).
  [[nodiscard]] const detail::engine& engine() const noexcept { return *eng_; }

  [[nodiscard]] request isend(int peer, tag_t tag, std::span<const std::byte> data) {
    check_peer(peer, "isend");
    if (data.size() > detail::rail_limits::max_message_bytes)
      throw invalid_argument(
          fmt::format("socket transport: a message of {} bytes to rank {}: the limit is {} bytes",
                      data.size(), peer, detail::rail_limits::max_message_bytes));
    request r;
    r.eng_ = eng_;
    r.op_ = eng_->send(peer, peer, tag, data);
    r.done_ = r.op_ == nullptr;
    return r;
  }

  [[nodiscard]] request irecv(int peer, tag_t tag, std::span<std::byte> data) {
    check_peer(peer, "irecv");
    request r;
    r.eng_ = eng_;
    r.op_ = eng_->recv(peer, peer, tag, data);
    return r;
  }

  /// Moves every connection; true once r finished. Throws peer_error when its peer is gone
  /// (or another rank failed, or abort() was called), transport_error on a size mismatch.
  [[nodiscard]] bool test(request& r) {
    if (r.done_) return true;
    if (!r.op_) throw invalid_argument("test() on an empty request");
    // Once the engine reports an outcome, finished or thrown, it has taken the operation back.
    auto* c = std::exchange(r.op_, nullptr);
    if (!eng_->test(c)) {
      r.op_ = c;
      return false;
    }
    r.done_ = true;
    return true;
  }

  void progress() { eng_->progress(); }

  /// The rank this one saw fail first (a broken connection, or a peer's word), or -1.
  [[nodiscard]] int failed_rank() const { return eng_->failed_rank(); }

  /// The ranks on this host whose process is stopped (SIGSTOP, a debugger): alive, so nothing
  /// failed, but a wait on them can only time out (communicator::stopped_rank()). A wait that
  /// gives up asks; the first one found is then the failure this rank names, and its goodbye
  /// says so, so that peers that only waited for this rank blame the stopped one, as on
  /// libfabric.
  [[nodiscard]] std::vector<int> stopped_ranks() const {
    std::vector<int> stopped = watch_->stopped_ranks();
    if (!stopped.empty())
      watch_->report(stopped.front(),
                     fmt::format("rank {} is stopped (SIGSTOP or a debugger)", stopped.front()));
    return stopped;
  }

  /// Fails every wait on this transport, and so on every communicator over it, with
  /// peer_error carrying `why`: now, including waits in another thread, and every call after.
  void abort(const std::string& why) { eng_->abort(why); }
  [[nodiscard]] std::optional<std::string> abort_reason() const {
    if (!eng_->aborted()) return std::nullopt;
    return eng_->abort_reason();
  }

  /// RINGZERO_RAIL_SHARES: "measured" (or unset) weighs the rails by their measured rates,
  /// "equal" does not.
  [[nodiscard]] static bool weigh_rails_from_env() {
    return ringzero::detail::weigh_rails_from_env();
  }

  /// RINGZERO_RAILS=auto: the interfaces every rank can use together (detail::agree_rails),
  /// agreed through the store; none on one host, or where none qualifies (with a warning): the
  /// constructor then picks one rail as without RINGZERO_RAILS. Every rank must ask for it.
  template <class Key>
  [[nodiscard]] std::vector<std::string> discover_rails(bootstrap::store& store, int size,
                                                        bool one_host, const Key& key) const {
    if (one_host) {
      log::info("socket: RINGZERO_RAILS=auto on one host: one rail, on loopback");
      return {};
    }
    const auto mine = detail::local_interfaces();
    auto names = ringzero::detail::agree_rails_over(store, key, rank_, size, mine, hosts_);
    if (names.empty())
      log::warn(
          "socket: RINGZERO_RAILS=auto found no interface every rank has on one subnet with "
          "addresses of its own (this host offers: {}); one rail, toward MASTER_ADDR",
          detail::interfaces_text(mine));
    else
      log::info("socket: RINGZERO_RAILS=auto: {} rail{}: {}", names.size(),
                names.size() == 1 ? "" : "s", ringzero::detail::rail_list(names));
    return names;
  }

  /// The rails the environment names: RINGZERO_RAILS, else RINGZERO_SOCKET_IFNAME, else none
  /// (the constructor then picks one).
  [[nodiscard]] static std::vector<std::string> rails_from_env() {
    if (auto rails = ringzero::detail::getenv_list("RINGZERO_RAILS")) return *rails;
    if (auto v = ringzero::detail::getenv_str("RINGZERO_SOCKET_IFNAME")) return {*v};
    return {};
  }

 private:
  transport(bootstrap::store& store, int rank, int size, const options& opt,
            const std::string& master_addr)
      : rank_(rank),
        timeout_(opt.timeout.count() > 0 ? opt.timeout : ringzero::detail::env_timeout()) {
    if (size < 1 || rank < 0 || rank >= size)
      throw invalid_argument(
          fmt::format("socket transport: rank {} is not in [0, {})", rank, size));
    connect(store, size, opt, master_addr);
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size() || peer == rank_)
      throw invalid_argument(fmt::format(
          "socket transport: {} to peer {}: peers are the other ranks of [0, {}), not {}", what,
          peer, size(), rank_));
  }

  void connect(bootstrap::store& store, int size, const options& opt,
               const std::string& master_addr) {
    namespace d = detail;
    const auto deadline = d::clock::now() + timeout_;
    const std::int64_t generation = (store.add("ringzero-socket/joined", 1) - 1) / size;
    const auto key = [&](std::string_view what, int r) {
      return fmt::format("ringzero-socket/{}/{}/{}", generation, what, r);
    };
    store.set_string(key("host", rank_), log::detail::host_name());
    store.set_string(key("process", rank_), ringzero::detail::self_process().text());
    hosts_.resize(static_cast<std::size_t>(size));
    std::vector<ringzero::detail::process_id> procs(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) {
      hosts_[static_cast<std::size_t>(r)] = store.get_string(key("host", r));
      // Unparsable (another build?): that rank is simply not probed.
      if (auto p = ringzero::detail::process_id::parse(store.get_string(key("process", r))))
        procs[static_cast<std::size_t>(r)] = std::move(*p);
    }
    watch_ = std::make_shared<d::process_failure>(rank_, std::move(procs));
    const bool one_host =
        std::all_of(hosts_.begin(), hosts_.end(), [&](const auto& h) { return h == hosts_[0]; });

    // This rank's rails, and a listener on each.
    std::vector<d::rail_address> rails;
    std::string failure;
    try {
      std::vector<std::string> wanted = opt.rails.empty() ? rails_from_env() : opt.rails;
      if (wanted.size() == 1 && wanted.front() == "auto")
        wanted = discover_rails(store, size, one_host, key);
      if (!wanted.empty()) {
        for (const auto& name : wanted) rails.push_back(d::find_rail(name));
      } else if (one_host) {
        rails.push_back(d::find_rail("127.0.0.1"));
      } else if (auto r = d::route_to(master_addr)) {
        rails.push_back(*r);
      } else {
        throw bootstrap_error(
            "socket transport: no route to MASTER_ADDR; set RINGZERO_SOCKET_IFNAME or "
            "RINGZERO_RAILS");
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
    std::vector<d::unique_fd> listeners;
    std::string published;
    if (failure.empty()) {
      try {
        for (const auto& r : rails) {
          auto [fd, addr] = d::listen_on(r, opt.buffer_bytes);
          listeners.push_back(std::move(fd));
          if (!published.empty()) published += ' ';
          published += fmt::format("{}={}", r.name, d::address_text(addr));
        }
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    // The job's secret for this setup (handshake.hpp): drawn by rank 0, handed over by the store,
    // published before rank 0's addresses so that whoever can connect to rank 0 knows it.
    d::job_secret secret{};
    if (rank_ == 0) {
      ringzero::detail::random_bytes(secret);
      store.set(key("secret", 0), secret);
    }
    // A rank that cannot take part says why instead of its addresses, so the others fail at
    // once with that reason instead of at the store's deadline.
    store.set_string(key("rails", rank_), failure.empty() ? published : "!" + failure);
    if (!failure.empty()) throw bootstrap_error(failure);
    std::vector<std::vector<sockaddr_in>> addrs(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) {
      const std::string v = store.get_string(key("rails", r));
      if (!v.empty() && v[0] == '!')
        throw bootstrap_error(
            fmt::format("rank {} could not open its socket transport: {}", r, v.substr(1)));
      std::vector<std::string> rank_names;
      std::string_view s = v;
      while (!s.empty()) {
        const auto sp = s.find(' ');
        const std::string_view item = s.substr(0, sp);
        const auto eq = item.rfind('=');
        const auto colon = item.rfind(':');
        sockaddr_in a{};
        a.sin_family = AF_INET;
        const std::string ip(item.substr(eq + 1, colon - eq - 1));
        ::inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
        a.sin_port =
            htons(static_cast<std::uint16_t>(std::stoi(std::string(item.substr(colon + 1)))));
        addrs[static_cast<std::size_t>(r)].push_back(a);
        rank_names.emplace_back(item.substr(0, eq));
        if (sp == std::string_view::npos) break;
        s.remove_prefix(sp + 1);
      }
      if (rank_names.size() != rails.size())
        throw bootstrap_error(fmt::format(
            "socket transport: rank {} has {} rail{} ({}), this rank {}: RINGZERO_RAILS must "
            "name as many interfaces on every host",
            r, rank_names.size(), rank_names.size() == 1 ? "" : "s", v, rails.size()));
    }
    if (rank_ != 0) {
      const std::vector<std::byte> v = store.get(key("secret", 0));
      if (v.size() != secret.size())
        throw bootstrap_error(fmt::format(
            "socket transport: the job's secret in the store is {} bytes, not {} (another "
            "program's key?)",
            v.size(), secret.size()));
      std::copy(v.begin(), v.end(), secret.begin());
    }

    auto polls = std::make_shared<d::poller>(rails.size());
    std::vector<std::unique_ptr<d::rail>> socket_rails;
    for (std::size_t r = 0; r < rails.size(); ++r)
      socket_rails.push_back(std::make_unique<d::rail>(rails[r].name, r, size, polls));
    const auto user_timeout = std::chrono::milliseconds(std::max<long long>(
        1000, std::min<long long>(
                  opt.rail_timeout.count(),
                  std::chrono::duration_cast<std::chrono::milliseconds>(timeout_).count())));
    d::handshake_terms terms{
        .rank = rank_, .size = size, .generation = static_cast<std::uint32_t>(generation)};
    terms.secret = secret;
    d::meet(terms,
            {.rails = rails,
             .listeners = listeners,
             .addresses = addrs,
             .buffer_bytes = opt.buffer_bytes,
             .user_timeout = user_timeout,
             .handshake_timeout = std::min(opt.handshake_timeout, timeout_),
             .deadline = deadline,
             .timeout = timeout_},
            [&](int peer, int rail, d::unique_fd fd) {
              socket_rails[static_cast<std::size_t>(rail)]->adopt(peer, std::move(fd));
            });
    // The listeners close here: after setup no port of this transport is open.
    listeners.clear();
    // Rank 0 returns last, so that a store it serves may close without stranding a rank.
    store.set_string(key("ready", rank_), "1");
    std::vector<std::string> ready;
    for (int r = 0; r < size; ++r) ready.push_back(key("ready", r));
    store.wait(ready);
    if (rank_ != 0) {
      store.set_string(key("done", rank_), "1");
    } else {
      std::vector<std::string> done;
      for (int r = 1; r < size; ++r) done.push_back(key("done", r));
      store.wait(done);
    }
    std::vector<ringzero::tuning::rail_price> prices;
    for (const auto& r : socket_rails) prices.push_back(r->price());
    tuning_ = opt.tuning
                  ? *opt.tuning
                  : ringzero::tuning::over_rails(ringzero::tuning::defaults::socket.value, prices);
    // Every message numbered and acknowledged, also on one rail: a send over the copied size
    // completes once the receiver has it, so that a pipeline cannot run ahead of its receiver,
    // and a closing rank's last messages are known to have arrived.
    eng_ = std::make_shared<d::engine>(
        ringzero::detail::rail_engine_config{
            .rank = rank_,
            .size = size,
            .name = "socket",
            .fabric = "sockets",
            .timeout = timeout_,
            .stripe_bytes = ringzero::detail::stripe_bytes_from_env(opt.stripe_bytes),
            .acknowledge = true,
            .weigh_by_rate = opt.weigh_rails && weigh_rails_from_env(),
            .watch = watch_,
            .close_grace = std::chrono::seconds(2)},
        std::move(socket_rails));
    std::string rail_text;
    for (const auto& r : rails) {
      char buf[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &r.address, buf, sizeof buf);
      rail_text += fmt::format("{}{} ({})", rail_text.empty() ? "" : ", ", r.name, buf);
    }
    log::info("socket: rank {} of {} on {}, {} rail{}: {}", rank_, size,
              hosts_[static_cast<std::size_t>(rank_)], rails.size(), rails.size() == 1 ? "" : "s",
              rail_text);
  }

  std::shared_ptr<detail::engine> eng_;
  std::vector<std::string> hosts_;
  std::shared_ptr<detail::process_failure> watch_;  ///< the engine's peer_watch
  int rank_ = 0;
  ringzero::tuning::policy tuning_{};
  std::chrono::nanoseconds timeout_{0};
};

/// ringzero's communicator over sockets: communicator::from_env() joins the job.
using communicator = ringzero::communicator<transport>;

}  // namespace ringzero::socket
