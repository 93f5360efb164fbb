// Building the world communicator's engine and its rails through a store:
//   1. every rank publishes its host name (node placement, and whether shm can serve all) and
//      its process identity (the watchdog's liveness checks between ranks on one host);
//   2. rank 0 picks the provider, opens its rails and publishes the provider's name; the
//      others open the same provider;
//   3. every rank publishes its rails' names (fi_getname) and inserts everyone's into each
//      rail's address vector, then starts its engine's watchdog;
//   4. a last round of keys tells each rank that all others have finished reading, and rank 0
//      that all others are done with the store, so a rank 0 that serves it may close it.
// A rank that fails to open its rails publishes the reason in place of its name, so the
// others fail at once with that reason instead of waiting for the store's deadline.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
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

inline void drop_env_rails_on_shm(engine::config& cfg, bool rails_from_env) {
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
                                      std::string_view requested, engine::config cfg,
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
  try {
    if (rank == 0) {
      cfg.provider = choose_provider(requested, one_host);
      drop_env_rails_on_shm(cfg, rails_from_env);
      if (wants_discovery()) {
        keys::set_text(s, provider_key, cfg.provider);
        published = true;
        discover();
      }
      w.eng = std::make_shared<engine>(cfg);
      if (!published) keys::set_text(s, provider_key, w.eng->provider());
    } else {
      const auto v = s.get(provider_key);
      keys::throw_if_failure(v, 0);
      cfg.provider.assign(reinterpret_cast<const char*>(v.data()), v.size());
      drop_env_rails_on_shm(cfg, rails_from_env);
      discover();
      w.eng = std::make_shared<engine>(cfg);
    }
  } catch (const bootstrap_error&) {
    throw;
  } catch (const std::exception& e) {
    keys::publish_failure(s, rank == 0 && !published ? provider_key : key("ep", rank), e);
    throw;
  }

  const auto name = w.eng->name();
  s.set(key("ep", rank), name);
  std::vector<std::vector<std::byte>> names(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    names[static_cast<std::size_t>(r)] = s.get(key("ep", r));
    keys::throw_if_failure(names[static_cast<std::size_t>(r)], r);
  }
  w.eng->connect(names, rank);
  w.eng->watch(rank, std::move(processes),
               kept
                   ? std::make_shared<failure_board>(std::move(kept), prefix, rank, served_by_rank0)
                   : nullptr);

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
