// A host's network interfaces as rails: which could be one (up, not loopback, IPv4), and which
// the ranks of a job can use together. Shared by the transports that take RINGZERO_RAILS=auto
// (socket, libfabric's tcp), so that both discover the same rails.
#pragma once

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <fmt/core.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/detail/socket.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/error.hpp"

namespace ringzero::detail {

/// An interface that could be a rail: up, not loopback, with an IPv4 address and its prefix;
/// or a NIC known by name only (an EFA device, which has no IP address): prefix -1.
struct interface_address {
  std::string name;
  in_addr address{};
  int prefix = 0;  ///< network bits of the address (24 for a /24); -1: no address
  friend bool operator==(const interface_address& a, const interface_address& b) {
    return a.name == b.name && a.address.s_addr == b.address.s_addr && a.prefix == b.prefix;
  }
};

/// This host's interfaces that could be rails, by name, each once (its first IPv4 address).
[[nodiscard]] inline std::vector<interface_address> local_interfaces() {
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0)
    throw bootstrap_error(fmt::format("getifaddrs failed: {}", std::strerror(errno)));
  std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> guard(ifs, &::freeifaddrs);
  std::vector<interface_address> out;
  for (const ifaddrs* p = ifs; p != nullptr; p = p->ifa_next) {
    if (p->ifa_addr == nullptr || p->ifa_addr->sa_family != AF_INET || p->ifa_netmask == nullptr)
      continue;
    if ((p->ifa_flags & IFF_UP) == 0 || (p->ifa_flags & IFF_LOOPBACK) != 0) continue;
    if (std::any_of(out.begin(), out.end(), [&](const auto& c) { return c.name == p->ifa_name; }))
      continue;
    const auto mask = ntohl(reinterpret_cast<const sockaddr_in*>(p->ifa_netmask)->sin_addr.s_addr);
    out.push_back({.name = p->ifa_name,
                   .address = reinterpret_cast<const sockaddr_in*>(p->ifa_addr)->sin_addr,
                   .prefix = std::popcount(mask)});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

/// The IPv4 address this host reaches `host` from (its route's source), found by connecting a
/// UDP socket, which sends nothing: the interface a job that rendezvouses at `host` is on. None
/// when `host` does not resolve to IPv4 or no route leads there.
[[nodiscard]] inline std::optional<in_addr> route_source(const std::string& host) {
  in_addr to{};
  if (::inet_pton(AF_INET, host.c_str(), &to) != 1) {
    try {
      const auto eps = bootstrap::detail::resolve(host, 9);
      if (eps.empty() || eps.front().family() != AF_INET) return std::nullopt;
      to = reinterpret_cast<const sockaddr_in*>(eps.front().sa())->sin_addr;
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  bootstrap::detail::unique_fd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd) return std::nullopt;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr = to;
  a.sin_port = htons(9);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0)
    return std::nullopt;
  sockaddr_in local{};
  socklen_t len = sizeof local;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) return std::nullopt;
  return local.sin_addr;
}

/// Interfaces as one line of text for the store ("eth1=10.0.1.5/24 eth2=10.0.2.5/24 rdmap0",
/// the last one without an address), and back.
[[nodiscard]] inline std::string interfaces_text(const std::vector<interface_address>& cs) {
  std::string out;
  for (const auto& c : cs) {
    if (c.prefix < 0) {
      out += fmt::format("{}{}", out.empty() ? "" : " ", c.name);
      continue;
    }
    char buf[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &c.address, buf, sizeof buf);
    out += fmt::format("{}{}={}/{}", out.empty() ? "" : " ", c.name, buf, c.prefix);
  }
  return out;
}
[[nodiscard]] inline std::vector<interface_address> parse_interfaces(std::string_view text) {
  std::vector<interface_address> out;
  while (!text.empty()) {
    const auto sp = text.find(' ');
    const std::string_view item = text.substr(0, sp);
    const auto eq = item.rfind('=');
    const auto slash = item.rfind('/');
    interface_address c;
    if (eq == std::string_view::npos && item.find('/') == std::string_view::npos) {
      c.name = std::string(item);
      c.prefix = -1;
      out.push_back(std::move(c));
      if (sp == std::string_view::npos) break;
      text.remove_prefix(sp + 1);
      continue;
    }
    if (eq == std::string_view::npos || slash == std::string_view::npos || slash < eq)
      throw bootstrap_error(
          fmt::format("socket transport: '{}' is not an interface's address", std::string(item)));
    c.name = std::string(item.substr(0, eq));
    const std::string ip(item.substr(eq + 1, slash - eq - 1));
    if (::inet_pton(AF_INET, ip.c_str(), &c.address) != 1)
      throw bootstrap_error(fmt::format("socket transport: '{}' is not an IPv4 address", ip));
    c.prefix = std::stoi(std::string(item.substr(slash + 1)));
    out.push_back(std::move(c));
    if (sp == std::string_view::npos) break;
    text.remove_prefix(sp + 1);
  }
  return out;
}

/// The network an address lies in: its masked bits (host order).
[[nodiscard]] inline std::uint32_t network_of(const interface_address& a) noexcept {
  const std::uint32_t mask = a.prefix <= 0    ? 0u
                             : a.prefix >= 32 ? 0xffffffffu
                                              : ~((1u << (32 - a.prefix)) - 1);
  return ntohl(a.address.s_addr) & mask;
}

/// The rails the ranks can use together, given each rank's interfaces and host name (index =
/// rank): the interface names every rank has whose addresses lie in one subnet (one prefix, one
/// network) and differ between hosts, in name order; a NIC without an address (prefix -1)
/// counts where every rank has it, without one. The first rule drops a management network
/// named alike but addressed per site; the second a bridge every host numbers the same
/// (docker0's 172.17.0.1, libvirt's 192.168.122.1), which no host reaches on another.
[[nodiscard]] inline std::vector<std::string> agree_rails(
    const std::vector<std::vector<interface_address>>& per_rank,
    const std::vector<std::string>& hosts) {
  std::vector<std::string> out;
  if (per_rank.empty()) return out;
  for (const auto& first : per_rank.front()) {
    if (first.prefix < 0) {
      if (std::all_of(per_rank.begin(), per_rank.end(), [&](const auto& mine) {
            return std::any_of(mine.begin(), mine.end(), [&](const interface_address& c) {
              return c.name == first.name && c.prefix < 0;
            });
          }))
        out.push_back(first.name);
      continue;
    }
    const auto network = network_of(first);
    std::vector<std::pair<std::string, std::uint32_t>> seen;  // (host, address)
    bool usable = true;
    for (std::size_t r = 0; r < per_rank.size() && usable; ++r) {
      const auto& mine = per_rank[r];
      const auto it = std::find_if(mine.begin(), mine.end(), [&](const interface_address& c) {
        return c.name == first.name;
      });
      if (it == mine.end() || it->prefix != first.prefix || network_of(*it) != network) {
        usable = false;
        break;
      }
      const std::string& host = r < hosts.size() ? hosts[r] : std::string();
      for (const auto& [h, a] : seen)
        if (h != host && a == it->address.s_addr) usable = false;
      seen.emplace_back(host, it->address.s_addr);
    }
    if (usable) out.push_back(first.name);
  }
  return out;
}

/// Whether any of the rails `names` (among this rank's `mine`) reaches any other: NICs without
/// addresses (EFA's devices, one fabric), or interfaces all on one subnet. Alike on every rank
/// for rails agree_rails chose: it kept only names with one prefix and one network everywhere.
[[nodiscard]] inline bool rails_interchangeable(const std::vector<interface_address>& mine,
                                                const std::vector<std::string>& names) {
  const interface_address* first = nullptr;
  for (const auto& n : names) {
    const auto it =
        std::find_if(mine.begin(), mine.end(), [&](const auto& m) { return m.name == n; });
    if (it == mine.end()) return false;
    if (!first) first = &*it;
    const bool alike = it->prefix < 0
                           ? first->prefix < 0
                           : first->prefix == it->prefix && network_of(*first) == network_of(*it);
    if (!alike) return false;
  }
  return true;
}

/// Whether `name` (an interface's or a device's, as a user or provider gives it) is one file
/// name, so that a path built from it stays in its sysfs directory.
[[nodiscard]] inline bool sysfs_name(std::string_view name) noexcept {
  return !name.empty() && name.find('/') == std::string_view::npos && name != "." && name != "..";
}

/// A network interface's link speed in Mbit/s as the kernel reports it
/// (/sys/class/net/NAME/speed), or 0: no such interface, or one without a speed (loopback, a
/// link that is down, which reads -1).
[[nodiscard]] inline std::uint64_t interface_mbps(const std::string& name) {
  if (!sysfs_name(name)) return 0;
  std::ifstream in("/sys/class/net/" + name + "/speed");
  long long mbps = 0;
  if (!(in >> mbps) || mbps <= 0) return 0;
  return static_cast<std::uint64_t>(mbps);
}

/// Why a NIC's link is down, or empty: up, or nothing known of it. `name` is an interface
/// (/sys/class/net/NAME/operstate: "up", or "unknown" for loopback and links without carrier
/// detection, count as up) or an RDMA device's domain as libfabric names it, e.g.
/// "rdmap16s27-rdm" (/sys/class/infiniband/DEVICE/ports/1/state: "4: ACTIVE" is up).
[[nodiscard]] inline std::string link_down(const std::string& name) {
  if (!sysfs_name(name)) return {};
  std::string state;
  if (std::ifstream in("/sys/class/net/" + name + "/operstate"); in >> state)
    return state == "up" || state == "unknown" ? std::string() : "operstate " + state;
  const std::string device = name.substr(0, name.find('-'));
  if (std::ifstream in("/sys/class/infiniband/" + device + "/ports/1/state");
      std::getline(in, state))
    return state.find("ACTIVE") != std::string::npos ? std::string() : "port state " + state;
  return {};
}

/// Every rank's `mine` through the store (under key("rails-offered", rank)), and the rails they
/// agree on (agree_rails). Every rank must call it.
template <class Key>
[[nodiscard]] inline std::vector<std::string> agree_rails_over(
    bootstrap::store& s, const Key& key, int rank, int size,
    const std::vector<interface_address>& mine, const std::vector<std::string>& hosts) {
  s.set_string(key("rails-offered", rank), interfaces_text(mine));
  std::vector<std::vector<interface_address>> all(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r)
    all[static_cast<std::size_t>(r)] = parse_interfaces(s.get_string(key("rails-offered", r)));
  return agree_rails(all, hosts);
}

/// Names as a comma-separated list, as RINGZERO_RAILS takes them (for logs).
[[nodiscard]] inline std::string rail_list(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ",") + n;
  return out;
}

}  // namespace ringzero::detail
