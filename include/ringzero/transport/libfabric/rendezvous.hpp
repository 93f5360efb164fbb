// The libfabric transport's handshake: building the world communicator's rails and engine
// through a store:
//   1. every rank publishes its host name (node placement, and whether shm can serve all) and
//      its process identity (the watchdog's liveness checks between ranks on one host);
//   2. rank 0 picks the provider, opens its rails and publishes the provider's name; the
//      others open the same provider;
//   3. every rank publishes its rails' names (fi_getname), the striping threshold and each
//      rail's link speed, inserts everyone's names into each rail's address vector, agrees with
//      every peer on each rail's share of a striped message (the lower of the two ends' speeds),
//      starts its watchdog and hands the rails to the kit's engine;
//   4. a last round of keys tells each rank that all others have finished reading, and rank 0
//      that all others are done with the store, so a rank 0 that serves it may close it.
// A rank that fails to open its rails publishes the reason in place of its name, so the
// others fail at once with that reason instead of waiting for the store's deadline.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/store.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/detail/delivery.hpp"
#include "ringzero/transport/detail/interfaces.hpp"
#include "ringzero/transport/detail/pci_topology.hpp"
#include "ringzero/transport/libfabric/engine.hpp"
#include "ringzero/transport/libfabric/provider.hpp"

namespace ringzero::libfabric::detail {

struct world {
  std::shared_ptr<engine> eng;
  std::vector<std::string> hosts;  ///< by world rank
};

namespace keys {

inline void set_text(bootstrap::store& s, const std::string& key, std::string_view value) {
  s.set(key, std::as_bytes(std::span<const char>(value.data(), value.size())));
}

[[nodiscard]] inline std::string get_text(bootstrap::store& s, const std::string& key) {
  const auto v = s.get(key);
  return std::string(reinterpret_cast<const char*>(v.data()), v.size());
}

// A published failure starts with a byte no endpoint name or provider name starts with.
inline constexpr char failure_mark = '\x01';

inline void publish_failure(bootstrap::store& s, const std::string& key, const std::exception& e) {
  set_text(s, key, std::string(1, failure_mark) + e.what());
}

inline void throw_if_failure(std::span<const std::byte> v, int rank) {
  if (!v.empty() && static_cast<char>(v[0]) == failure_mark)
    throw bootstrap_error(
        fmt::format("rank {} could not open its libfabric endpoint: {}", rank,
                    std::string_view(reinterpret_cast<const char*>(v.data()) + 1, v.size() - 1)));
}

}  // namespace keys

/// The rails a transport asks for; the rendezvous fills in the provider and whether every rank
/// shares a host.
struct fabric_config {
  std::string provider;  ///< empty: libfabric's first choice under FI_PROVIDER
  /// One rail per entry, each the NIC the provider names as a domain (tcp: an interface, efa: a
  /// device); empty: one rail on the provider's best candidate.
  std::vector<std::string> rails{};
  /// With no rails named: the address this rank rendezvouses from, whose candidate the rail
  /// takes (rail::config::near).
  std::optional<in_addr> near{};
  bool register_always = false;
  bool one_host = true;  ///< every rank on this host: loopback addresses will do
  std::chrono::nanoseconds timeout{std::chrono::seconds(300)};
  /// Ask for FI_HMEM: the caller will pass CUDA device buffers (register_device).
  bool device_memory = false;
  /// With several rails, messages of at least this many bytes are striped over all of them;
  /// must be alike on every rank (connect_rails checks).
  std::size_t stripe_bytes = SIZE_MAX;
  /// Pieces in proportion to the rails' link speeds (rail::link_mbps, the lower of the two
  /// ends'); false, or a speed unknown at either end: equal pieces.
  bool weigh_rails = true;
  /// With rails {"auto"}: the PCI address of this rank's GPU; the rendezvous then keeps the
  /// NICs nearest it (detail::rails_near_gpu). Empty: every NIC found.
  std::string gpu_bus_id{};
};

/// Opens one rail per NIC `cfg` names (one on the provider's best candidate for none), all on
/// one provider, and what they share. Several rails are delivered reliably, which needs 4 bytes
/// of remote CQ data and tag bits above the algorithm's for the piece numbers.
[[nodiscard]] inline std::pair<std::vector<std::unique_ptr<rail>>, fabric_facts> open_rails(
    const fabric_config& cfg) {
  const bool several = cfg.rails.size() > 1;
  const std::size_t most =
      several ? delivery::limits::max_rails : ringzero::detail::rail_engine_limits::max_rails;
  if (cfg.rails.size() > most)
    throw invalid_argument(fmt::format("{} rails asked for; a libfabric engine drives at most {}",
                                       cfg.rails.size(), most));
  std::vector<std::unique_ptr<rail>> rails;
  const auto open = [&](std::string domain) {
    rails.push_back(std::make_unique<rail>(rail::config{.provider = cfg.provider,
                                                        .domain = std::move(domain),
                                                        .near = cfg.near,
                                                        .register_always = cfg.register_always,
                                                        .one_host = cfg.one_host,
                                                        .device_memory = cfg.device_memory,
                                                        .cq_data = several}));
  };
  if (cfg.rails.empty()) open({});
  for (const auto& d : cfg.rails) open(d);
  const rail& first = *rails.front();
  fabric_facts facts{.provider = first.provider(),
                     .mr_mode = first.mr_mode(),
                     .inject_size = first.inject_size(),
                     .registers = first.registers(),
                     .hmem = true,
                     .tag_width = 64,
                     .pieces_in_tag = several};
  for (const auto& r : rails) {
    if (r->provider() != first.provider())
      throw invalid_argument(fmt::format(
          "libfabric rails on different providers ({} on {}, {} on {}): a job's rails share one",
          first.provider(), first.domain_name(), r->provider(), r->domain_name()));
    facts.tag_width = std::min(facts.tag_width, r->tag_width());
    facts.hmem = facts.hmem && r->hmem();
    if (several && r->cq_data_bytes() < 4)
      throw unsupported(fmt::format(
          "libfabric provider {} carries {} bytes of remote CQ data on {}; several rails need "
          "4 (each message's sequence number, so that a failed rail loses none)",
          r->provider(), r->cq_data_bytes(), r->domain_name()));
  }
  if (several && facts.tag_width - tag_bits <= delivery::limits::piece_bits)
    throw unsupported(
        fmt::format("libfabric provider {} matches {} tag bits; several rails need more than {}",
                    facts.provider, facts.tag_width, tag_bits + delivery::limits::piece_bits));
  if (several)
    for (auto& r : rails) r->set_piece_shift(facts.tag_width - delivery::limits::piece_bits);
  return {std::move(rails), std::move(facts)};
}

/// A rank's address as it publishes it: every rail's name (fi_getname), then the striping
/// threshold and each rail's link speed (0 where unknown or not weighed). It starts with a
/// letter: the rendezvous marks a rank's failure with a control byte in its place.
inline constexpr std::byte name_mark{'R'};
[[nodiscard]] inline std::vector<std::byte> endpoint_names(
    const std::vector<std::unique_ptr<rail>>& rails, const fabric_config& cfg) {
  std::vector<std::byte> out{name_mark};
  const auto put = [&](auto v) {
    const auto* b = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), b, b + sizeof v);
  };
  put(static_cast<std::uint32_t>(rails.size()));
  for (const auto& r : rails) {
    const auto n = r->endpoint_name();
    put(static_cast<std::uint32_t>(n.size()));
    out.insert(out.end(), n.begin(), n.end());
  }
  put(static_cast<std::uint64_t>(cfg.stripe_bytes));
  for (const auto& r : rails) put(cfg.weigh_rails ? r->link_mbps() : std::uint64_t{0});
  return out;
}

/// Inserts every rank's names (index = world rank), each rail's into that rail, and returns, by
/// rank, each rail's share of a striped message to or from it: the lower of the two ends' link
/// speeds, equal where either end does not know (weighing some by a guess would be worse).
[[nodiscard]] inline std::vector<std::vector<std::uint64_t>> connect_rails(
    const std::vector<std::unique_ptr<rail>>& rails, const fabric_config& cfg,
    const std::vector<std::vector<std::byte>>& names) {
  std::vector<std::vector<std::vector<std::byte>>> per_rail(
      rails.size(), std::vector<std::vector<std::byte>>(names.size()));
  std::vector<std::vector<std::uint64_t>> shares;
  for (std::size_t r = 0; r < names.size(); ++r) {
    std::span<const std::byte> in(names[r]);
    if (in.empty() || in[0] != name_mark)
      throw transport_error(fmt::format("rank {}'s libfabric address is not an engine's", r));
    in = in.subspan(1);
    const auto get = [&](auto& v) {
      if (in.size() < sizeof v) return false;
      std::memcpy(&v, in.data(), sizeof v);
      in = in.subspan(sizeof v);
      return true;
    };
    std::uint32_t count = 0;
    if (!get(count))
      throw transport_error(fmt::format("rank {}'s libfabric address is truncated", r));
    if (count != rails.size())
      throw invalid_argument(fmt::format(
          "rank {} opened {} libfabric rail{} and this rank {}: RINGZERO_RAILS must name as "
          "many NICs on every host",
          r, count, count == 1 ? "" : "s", rails.size()));
    for (auto& rail_names : per_rail) {
      std::uint32_t len = 0;
      if (!get(len) || in.size() < len)
        throw transport_error(fmt::format("rank {}'s libfabric address is truncated", r));
      rail_names[r].assign(in.begin(), in.begin() + len);
      in = in.subspan(len);
    }
    std::uint64_t stripe = 0;
    std::vector<std::uint64_t> speeds(rails.size());
    bool complete = get(stripe);
    for (auto& v : speeds) complete = complete && get(v);
    if (!complete)
      throw transport_error(fmt::format("rank {}'s libfabric address is truncated", r));
    if (rails.size() > 1 && stripe != cfg.stripe_bytes)
      throw invalid_argument(fmt::format(
          "rank {} stripes messages of {} bytes and more over its rails, this rank from {}: "
          "libfabric::options::stripe_bytes (RINGZERO_STRIPE_BYTES) must be alike on every rank",
          r, stripe, cfg.stripe_bytes));
    for (std::size_t i = 0; i < rails.size(); ++i)
      speeds[i] = std::min(speeds[i], cfg.weigh_rails ? rails[i]->link_mbps() : 0);
    if (std::find(speeds.begin(), speeds.end(), 0) != speeds.end())
      std::fill(speeds.begin(), speeds.end(), 1);
    shares.push_back(std::move(speeds));
  }
  for (std::size_t i = 0; i < rails.size(); ++i) rails[i]->connect(per_rail[i]);
  return shares;
}

inline void drop_env_rails_on_shm(fabric_config& cfg, bool rails_from_env) {
  if (!rails_from_env || cfg.rails.empty() || cfg.provider != "shm") return;
  log::info(
      "libfabric: RINGZERO_RAILS does not apply to provider shm (it moves no bytes over a "
      "NIC); one rail");
  cfg.rails.clear();
}

/// RINGZERO_RAILS=auto (or options::rails = {"auto"}): the NICs every rank's `provider` offers
/// as domains (efa: its devices; tcp: its interfaces), without those peers on other hosts could
/// not reach (loopback, link-local), agreed through the store: a name every rank has, and, where
/// it is a network interface, on one subnet with addresses of its own on each host
/// (ringzero::detail::agree_rails). None on one host, or where none qualifies (with a warning):
/// the engine then opens one rail on the provider's best candidate.
template <class Key>
[[nodiscard]] inline std::vector<std::string> discover_rails(
    bootstrap::store& s, const Key& key, int rank, int size, const std::string& provider,
    bool one_host, const std::vector<std::string>& hosts, const std::string& gpu_bus_id) {
  if (one_host) {
    log::info("libfabric: RINGZERO_RAILS=auto with every rank on one host: one rail");
    return {};
  }
  const info_ptr list = query(provider.empty() ? nullptr : provider.c_str());
  const auto interfaces = ringzero::detail::local_interfaces();
  std::vector<ringzero::detail::interface_address> mine;
  for (const fi_info* i = list.get(); i; i = i->next) {
    if (!i->domain_attr->name) continue;
    const std::string name = i->domain_attr->name;
    if (std::any_of(mine.begin(), mine.end(), [&](const auto& m) { return m.name == name; }))
      continue;
    const fi_info* best = pick(list.get(), false, name);
    if (!best || is_loopback(best) || is_link_local(best)) continue;
    const auto it = std::find_if(interfaces.begin(), interfaces.end(),
                                 [&](const auto& f) { return f.name == name; });
    mine.push_back(it != interfaces.end()
                       ? *it
                       : ringzero::detail::interface_address{.name = name, .prefix = -1});
  }
  std::sort(mine.begin(), mine.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  auto names = ringzero::detail::agree_rails_over(s, key, rank, size, mine, hosts);
  // A GPU named: the NICs nearest it, where any rail reaches any other (EFA's devices share one
  // fabric; interfaces must share one subnet). Rails a subnet each pair by name, so all stay.
  names = ringzero::detail::rails_near_gpu(s, key, rank, size, names,
                                           ringzero::detail::rails_interchangeable(mine, names),
                                           gpu_bus_id, "/sys");
  // Several rails are delivered reliably, and a message's pieces are numbered in 4 tag bits
  // (delivery::limits): the first rails up to that many (a p5 host lists 32 NICs, four per GPU).
  if (names.size() > delivery::limits::max_rails) {
    log::info("libfabric: RINGZERO_RAILS=auto found {} NICs; driving the first {}", names.size(),
              delivery::limits::max_rails);
    names.resize(delivery::limits::max_rails);
  }
  if (names.empty())
    log::warn(
        "libfabric: RINGZERO_RAILS=auto found no NIC of provider {} that every rank has (this "
        "host offers: {}); one rail",
        provider, ringzero::detail::interfaces_text(mine));
  else
    log::info("libfabric: RINGZERO_RAILS=auto: {} rail{}: {}", names.size(),
              names.size() == 1 ? "" : "s", ringzero::detail::rail_list(names));
  return names;
}

/// `cfg`: the engine as the caller wants it (its rails: the NICs to open, one rail each; empty:
/// one, the provider's best); the rendezvous fills in the provider and whether all ranks share
/// a host. `rails_from_env`: the rails came from RINGZERO_RAILS, which names network interfaces
/// for every transport that has rails, and so do not apply to shm, which has none; `kept`: the
/// same store as `s`, when the caller keeps it open for the engine's lifetime: the ranks then
/// agree through it on which rank failed first (failure_board); `served_by_rank0`: it goes away
/// with rank 0's process (tcp_store).
[[nodiscard]] inline world rendezvous(bootstrap::store& s, int rank, int size,
                                      std::string_view requested, fabric_config cfg,
                                      bool rails_from_env = false,
                                      std::shared_ptr<bootstrap::store> kept = nullptr,
                                      bool served_by_rank0 = false) {
  // Several communicators may be built on one store; each rank counts its own, and the
  // counts agree because every rank builds them in the same order.
  const auto generation = s.add(fmt::format("libfabric/rank/{}/communicators", rank), 1);
  const std::string prefix = fmt::format("libfabric/{}/", generation);
  auto key = [&](std::string_view what, int r) { return fmt::format("{}{}/{}", prefix, what, r); };

  world w;
  keys::set_text(s, key("host", rank), log::detail::host_name());
  keys::set_text(s, key("process", rank), self_process().text());
  w.hosts.resize(static_cast<std::size_t>(size));
  std::vector<process_id> processes(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    w.hosts[static_cast<std::size_t>(r)] = keys::get_text(s, key("host", r));
    // Unparsable (another build of ringzero?): that rank is simply not probed.
    if (auto p = process_id::parse(keys::get_text(s, key("process", r))))
      processes[static_cast<std::size_t>(r)] = std::move(*p);
  }
  const bool one_host =
      std::all_of(w.hosts.begin(), w.hosts.end(), [&](const auto& h) { return h == w.hosts[0]; });

  cfg.one_host = one_host;
  const std::string provider_key = prefix + "provider";
  // Discovering rails needs the provider on every rank before any opens its rails, so then rank
  // 0 publishes its choice first (a failure after that goes where its address would have).
  bool published = false;
  const auto wants_discovery = [&] { return cfg.rails.size() == 1 && cfg.rails.front() == "auto"; };
  const auto discover = [&] {
    if (wants_discovery())
      cfg.rails =
          discover_rails(s, key, rank, size, cfg.provider, one_host, w.hosts, cfg.gpu_bus_id);
  };
  std::vector<std::unique_ptr<rail>> rails;
  fabric_facts facts;
  try {
    if (rank == 0) {
      cfg.provider = choose_provider(requested, one_host);
      drop_env_rails_on_shm(cfg, rails_from_env);
      if (wants_discovery()) {
        keys::set_text(s, provider_key, cfg.provider);
        published = true;
        discover();
      }
      std::tie(rails, facts) = open_rails(cfg);
      if (!published) keys::set_text(s, provider_key, facts.provider);
    } else {
      const auto v = s.get(provider_key);
      keys::throw_if_failure(v, 0);
      cfg.provider.assign(reinterpret_cast<const char*>(v.data()), v.size());
      drop_env_rails_on_shm(cfg, rails_from_env);
      discover();
      std::tie(rails, facts) = open_rails(cfg);
    }
  } catch (const bootstrap_error&) {
    throw;
  } catch (const std::exception& e) {
    keys::publish_failure(s, rank == 0 && !published ? provider_key : key("ep", rank), e);
    throw;
  }

  s.set(key("ep", rank), endpoint_names(rails, cfg));
  std::vector<std::vector<std::byte>> names(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    names[static_cast<std::size_t>(r)] = s.get(key("ep", r));
    keys::throw_if_failure(names[static_cast<std::size_t>(r)], r);
  }
  auto shares = connect_rails(rails, cfg, names);
  auto dog = std::make_shared<watchdog>(watchdog::config{
      .rank = rank,
      .peers = std::move(processes),
      .timeout = cfg.timeout,
      .board = kept
                   ? std::make_shared<failure_board>(std::move(kept), prefix, rank, served_by_rank0)
                   : nullptr});
  for (auto& r : rails) r->set_watchdog(dog.get());
  const std::string provider = facts.provider;
  w.eng = std::make_shared<engine>(
      ringzero::detail::rail_engine_config{.rank = rank,
                                           .size = size,
                                           .name = "libfabric",
                                           .fabric = provider,
                                           .timeout = cfg.timeout,
                                           .stripe_bytes = cfg.stripe_bytes,
                                           .shares = std::move(shares),
                                           .watch = std::move(dog),
                                           .leave_open_after_loss = provider == "shm"},
      std::move(rails), std::move(facts));

  keys::set_text(s, key("ready", rank), "1");
  std::vector<std::string> ready;
  for (int r = 0; r < size; ++r) ready.push_back(key("ready", r));
  s.wait(ready);
  // Rank 0 returns last, once every other rank is past the wait above: a store it serves may
  // then close without leaving a rank waiting for an answer.
  if (rank != 0) {
    keys::set_text(s, key("done", rank), "1");
  } else {
    std::vector<std::string> done;
    for (int r = 1; r < size; ++r) done.push_back(key("done", r));
    s.wait(done);
  }
  return w;
}

}  // namespace ringzero::libfabric::detail
