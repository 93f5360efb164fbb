// Where NICs and GPUs sit in a host's PCIe tree, as sysfs shows it, and which NICs are nearest a
// GPU. With RINGZERO_RAILS=auto and a GPU named, each rank drives the NICs nearest its GPU, as
// NCCL and aws-ofi-nccl choose a GPU's NICs: traffic to and from that GPU's memory then crosses
// one PCIe switch, not the host bridge or the link between sockets. On p4d two GPUs share each
// of the 4 EFA devices behind one switch; on p5 each GPU has 4 of the 32.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "ringzero/bootstrap/store.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/detail/interfaces.hpp"

namespace ringzero::detail {

/// A device's place in the PCIe tree: its root complex ("pci0000:00"), then the PCI addresses of
/// the bridges below it, down to the device's own ("0000:00:01.0", "0000:01:00.0", ...). Empty:
/// not a PCI device (a veth, a bridge, loopback), or nothing known of it.
using pci_path = std::vector<std::string>;

namespace pci {

[[nodiscard]] inline bool hex(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isxdigit(static_cast<unsigned char>(c));
  });
}

/// "dddd:bb:dd.f": a PCI device's address as the kernel names it in sysfs.
[[nodiscard]] inline bool is_address(std::string_view s) {
  return s.size() == 12 && s[4] == ':' && s[7] == ':' && s[10] == '.' && hex(s.substr(0, 4)) &&
         hex(s.substr(5, 2)) && hex(s.substr(8, 2)) && hex(s.substr(11, 1));
}

}  // namespace pci

/// A GPU's PCI address in the kernel's spelling (lower case, a 4-digit domain), from any of the
/// spellings tools print: cudaDeviceGetPCIBusId "0000:53:00.0", nvidia-smi "00000000:53:00.0",
/// lspci "53:00.0" (domain 0). Anything else: invalid_argument naming it and `source` (where
/// it came from: an option, a variable).
[[nodiscard]] inline std::string normalize_bus_id(std::string_view id,
                                                  std::string_view source = "a GPU's address") {
  std::string s(id);
  std::transform(s.begin(), s.end(), s.begin(), [](char c) {
    return static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  });
  const auto first = s.find(':');
  if (first != std::string::npos && s.find(':', first + 1) == std::string::npos) s = "0000:" + s;
  const auto colon = s.find(':');
  // A domain of more than 4 digits (nvidia-smi prints 8) keeps its last 4 when the rest are 0.
  if (colon != std::string::npos && colon > 4 && s.find_first_not_of('0') >= colon - 4 &&
      pci::hex(s.substr(0, colon)))
    s.erase(0, colon - 4);
  if (!pci::is_address(s))
    throw invalid_argument(fmt::format(
        "{}: '{}' is not a GPU's PCI address (domain:bus:device.function, e.g. 0000:53:00.0, "
        "as cudaDeviceGetPCIBusId and nvidia-smi print it)",
        source, id));
  return s;
}

/// The PCIe path of the device a sysfs link points at (`<sysfs>/class/net/eth0/device`,
/// `<sysfs>/bus/pci/devices/0000:53:00.0`): the link resolved, from its root complex down, PCI
/// addresses only (a virtio NIC's last component, "virtio0", is not one). Empty where the link
/// does not resolve or leads to no PCI root.
[[nodiscard]] inline pci_path resolve_pci_path(const std::filesystem::path& link) {
  std::error_code ec;
  const auto real = std::filesystem::canonical(link, ec);
  if (ec) return {};
  pci_path out;
  for (const auto& part : real) {
    const std::string p = part.string();
    if (out.empty()) {
      if (p.size() > 3 && p.compare(0, 3, "pci") == 0 && p.find(':') != std::string::npos)
        out.push_back(p);
      continue;
    }
    if (pci::is_address(p)) out.push_back(p);
  }
  return out.size() > 1 ? out : pci_path{};
}

/// A NIC's PCIe path: `name` is a network interface (tcp's domains: class/net/NAME/device) or an
/// RDMA device's libfabric domain ("rdmap16s27-rdm": class/infiniband/rdmap16s27/device).
[[nodiscard]] inline pci_path nic_pci_path(const std::filesystem::path& sysfs,
                                           const std::string& name) {
  if (!sysfs_name(name)) return {};
  if (auto p = resolve_pci_path(sysfs / "class" / "net" / name / "device"); !p.empty()) return p;
  return resolve_pci_path(sysfs / "class" / "infiniband" / name.substr(0, name.find('-')) /
                          "device");
}

/// A GPU's PCIe path from its address (normalize_bus_id's spellings).
[[nodiscard]] inline pci_path gpu_pci_path(const std::filesystem::path& sysfs,
                                           std::string_view bus_id) {
  return resolve_pci_path(sysfs / "bus" / "pci" / "devices" / normalize_bus_id(bus_id));
}

/// How far apart two devices are, smaller nearer: whether they hang off different root complexes
/// (traffic then crosses the link between sockets), then the bridges between them, up from one
/// to where their paths part and down to the other. Two devices behind one PCIe switch are 4
/// apart (up from each to its own downstream port, and between those ports).
[[nodiscard]] inline std::pair<int, std::size_t> pci_distance(const pci_path& a,
                                                              const pci_path& b) {
  std::size_t common = 0;
  while (common < a.size() && common < b.size() && a[common] == b[common]) ++common;
  return {common == 0 ? 1 : 0, (a.size() - common) + (b.size() - common)};
}

/// NICs in order of nearness to a GPU.
struct nearest_nics {
  std::vector<std::string> order;  ///< every name given: nearest first, ties by name, unknown last
  std::size_t nearest = 0;  ///< how many at the front share the least distance; 0: none known
};

/// `names` ordered by their PCIe distance from the GPU at `gpu_bus_id`. `nearest` is 0 where the
/// GPU or every NIC is unknown to sysfs (virtual interfaces, a container without /sys/bus/pci).
[[nodiscard]] inline nearest_nics order_by_distance(const std::filesystem::path& sysfs,
                                                    std::string_view gpu_bus_id,
                                                    const std::vector<std::string>& names) {
  nearest_nics out;
  const pci_path gpu = gpu_pci_path(sysfs, gpu_bus_id);
  using key = std::tuple<bool, int, std::size_t, std::string>;  // unknown, roots, bridges, name
  std::vector<key> keys;
  for (const auto& n : names) {
    const pci_path nic = gpu.empty() ? pci_path{} : nic_pci_path(sysfs, n);
    if (nic.empty()) {
      keys.emplace_back(true, 0, 0, n);
      continue;
    }
    const auto [roots, bridges] = pci_distance(gpu, nic);
    keys.emplace_back(false, roots, bridges, n);
  }
  std::sort(keys.begin(), keys.end());
  for (const auto& k : keys) out.order.push_back(std::get<3>(k));
  if (!keys.empty() && !std::get<0>(keys.front()))
    out.nearest =
        static_cast<std::size_t>(std::count_if(keys.begin(), keys.end(), [&](const key& k) {
          return !std::get<0>(k) && std::get<1>(k) == std::get<1>(keys.front()) &&
                 std::get<2>(k) == std::get<2>(keys.front());
        }));
  return out;
}

/// The rails a rank drives, given the rails every rank agreed on (`agreed`, alike everywhere)
/// and its GPU: the nearest of them, as many on every rank (the fewest any rank has nearest its
/// GPU, since rail r of one rank talks to rail r of every other). Every rank keeps all of
/// `agreed`, in order, unless every rank named a GPU that sysfs places and `interchangeable`
/// (any rail reaches any other: NICs on one fabric, as EFA's are, or interfaces on one subnet;
/// not rails a subnet each, whose rail r must be the same interface everywhere). Every rank must
/// call it (it reads every rank's count under key("rails-near-gpu", rank)).
template <class Key>
[[nodiscard]] inline std::vector<std::string> rails_near_gpu(
    bootstrap::store& s, const Key& key, int rank, int size, const std::vector<std::string>& agreed,
    bool interchangeable, const std::string& gpu_bus_id, const std::filesystem::path& sysfs) {
  nearest_nics mine;
  if (!gpu_bus_id.empty() && !interchangeable && agreed.size() > 1)
    log::info("rails: {} are not one fabric or one subnet: every rail, whatever GPU {} is near",
              rail_list(agreed), gpu_bus_id);
  if (!gpu_bus_id.empty() && interchangeable && agreed.size() > 1) {
    mine = order_by_distance(sysfs, gpu_bus_id, agreed);
    if (mine.nearest == 0)
      log::info("rails: sysfs does not place GPU {} or the NICs {} in a PCIe tree; every rail",
                gpu_bus_id, rail_list(agreed));
  }
  s.set_string(key("rails-near-gpu", rank), std::to_string(mine.nearest));
  std::size_t fewest = agreed.size();
  for (int r = 0; r < size; ++r) {
    const std::string v = s.get_string(key("rails-near-gpu", r));
    std::size_t n = 0;
    try {
      n = static_cast<std::size_t>(std::stoul(v));
    } catch (const std::exception&) {
      throw bootstrap_error(fmt::format("rank {} published '{}' as its rails near a GPU", r, v));
    }
    fewest = std::min(fewest, n);
  }
  if (fewest == 0 || fewest >= agreed.size()) return agreed;
  mine.order.resize(fewest);
  log::info("rails: the {} of {} NICs nearest GPU {}: {}", fewest, agreed.size(), gpu_bus_id,
            rail_list(mine.order));
  return mine.order;
}

}  // namespace ringzero::detail
