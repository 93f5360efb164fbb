// Choosing the NICs nearest a GPU (transport/detail/pci_topology.hpp) on copies of sysfs laid out
// as AWS's GPU hosts are: p4d (8 GPUs, 4 EFA devices, two GPUs and one device behind each PCIe
// switch, two switches per socket) and p5 (8 GPUs, 32 EFA devices, four behind each GPU's
// switch). The trees are built in a temporary directory with the kernel's symlinks
// (bus/pci/devices/ADDR, class/infiniband/DEV/device, class/net/IF/device), so the code reads them
// as it reads /sys.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "multiprocess.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/detail/pci_topology.hpp"

using namespace std::chrono_literals;
namespace d = ringzero::detail;
namespace fs = std::filesystem;
using names = std::vector<std::string>;

namespace {

/// A sysfs copy under a fresh temporary directory, removed with the object.
class fake_sysfs {
 public:
  fake_sysfs() {
    char tmpl[] = "/tmp/ringzero-sysfs-XXXXXX";
    if (!::mkdtemp(tmpl)) throw ringzero::bootstrap_error("mkdtemp failed");
    root_ = tmpl;
  }
  ~fake_sysfs() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  fake_sysfs(const fake_sysfs&) = delete;
  fake_sysfs& operator=(const fake_sysfs&) = delete;

  [[nodiscard]] const fs::path& root() const { return root_; }

  /// A PCI device at `chain` (root complex first, the device's own address last), listed in
  /// bus/pci/devices; returns its directory.
  fs::path device(const std::vector<std::string>& chain) {
    fs::path p = root_ / "devices";
    for (const auto& c : chain) p /= c;
    fs::create_directories(p);
    fs::create_directories(root_ / "bus" / "pci" / "devices");
    const fs::path link = root_ / "bus" / "pci" / "devices" / chain.back();
    if (!fs::exists(link)) fs::create_directory_symlink(p, link);
    return p;
  }
  /// An RDMA device (class/infiniband/NAME/device) or a network interface (class/net/NAME/device)
  /// on the PCI device at `chain`.
  void rdma(const std::string& name, const std::vector<std::string>& chain) {
    link("infiniband", name, device(chain));
  }
  void interface(const std::string& name, const fs::path& device_dir) {
    link("net", name, device_dir);
  }
  /// A virtual interface: in class/net, no device link.
  void virtual_interface(const std::string& name) {
    fs::create_directories(root_ / "class" / "net" / name);
  }

 private:
  void link(const std::string& cls, const std::string& name, const fs::path& target) {
    const fs::path dir = root_ / "class" / cls / name;
    fs::create_directories(dir);
    fs::create_directory_symlink(target, dir / "device");
  }
  fs::path root_;
};

std::string addr(int bus, int dev = 0) {
  return fmt::format("0000:{:02x}:{:02x}.0", bus, dev);
}

/// p4d's layout: switch s (0-3) under socket s / 2, its root port 0000:R:0s.0, upstream port on
/// bus 0x10 * (s + 1), downstream ports on the next bus, GPUs 2s and 2s + 1 and EFA device s below
/// them. Returns the GPUs' addresses.
std::vector<std::string> p4d(fake_sysfs& sys) {
  std::vector<std::string> gpus;
  for (int s = 0; s < 4; ++s) {
    const std::string root = s < 2 ? "pci0000:00" : "pci0000:80";
    const std::string port = s < 2 ? addr(0, s + 1) : addr(0x80, s + 1);
    const int up = 0x10 * (s + 1);
    for (int slot = 0; slot < 3; ++slot) {
      const std::vector<std::string> chain{root, port, addr(up), addr(up + 1, slot),
                                           addr(up + 2 + slot)};
      if (slot < 2) {
        sys.device(chain);
        gpus.push_back(chain.back());
      } else {
        sys.rdma(fmt::format("rdmap{}s0", up), chain);
      }
    }
  }
  return gpus;
}

/// p5's layout: GPU g (0-7) behind its own switch with four EFA devices, switches 0-3 on socket
/// 0, 4-7 on socket 1.
std::vector<std::string> p5(fake_sysfs& sys) {
  std::vector<std::string> gpus;
  for (int g = 0; g < 8; ++g) {
    const std::string root = g < 4 ? "pci0000:00" : "pci0000:80";
    const std::string port = g < 4 ? addr(0, g + 1) : addr(0x80, g + 1);
    const int up = 0x10 * (g + 1);
    const std::vector<std::string> top{root, port, addr(up)};
    auto gpu = top;
    gpu.insert(gpu.end(), {addr(up + 1, 0), addr(up + 2)});
    sys.device(gpu);
    gpus.push_back(gpu.back());
    for (int n = 0; n < 4; ++n) {
      auto nic = top;
      nic.insert(nic.end(), {addr(up + 1, n + 1), addr(up + 3 + n)});
      sys.rdma(fmt::format("rdmap{}s{}", up, n), nic);
    }
  }
  return gpus;
}

names p4d_nics() {
  return {"rdmap16s0", "rdmap32s0", "rdmap48s0", "rdmap64s0"};
}

names p5_nics() {
  names out;
  for (int g = 0; g < 8; ++g)
    for (int n = 0; n < 4; ++n) out.push_back(fmt::format("rdmap{}s{}", 0x10 * (g + 1), n));
  return out;
}

/// libfabric's efa domains: the device's name and "-rdm".
names rdm(names ns) {
  for (auto& n : ns) n += "-rdm";
  return ns;
}

}  // namespace

TEST_CASE("a GPU's PCI address in every spelling the tools print; anything else is refused") {
  CHECK(d::normalize_bus_id("0000:53:00.0") == "0000:53:00.0");
  CHECK(d::normalize_bus_id("00000000:53:00.0") == "0000:53:00.0");  // nvidia-smi
  CHECK(d::normalize_bus_id("0000:9A:00.0") == "0000:9a:00.0");      // cudaDeviceGetPCIBusId
  CHECK(d::normalize_bus_id("53:00.0") == "0000:53:00.0");           // lspci
  CHECK(d::normalize_bus_id("0001:53:00.0") == "0001:53:00.0");
  for (const char* bad : {"", "gpu0", "0", "0000:53:00", "0000:53:00.00", "10000000:53:00.0",
                          "0000:5g:00.0", "../../etc"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(static_cast<void>(d::normalize_bus_id(bad, "RINGZERO_GPU_BUS_ID")),
                         doctest::Contains("RINGZERO_GPU_BUS_ID"), ringzero::invalid_argument);
  }
}

TEST_CASE("p4d: each pair of GPUs drives the EFA device behind its PCIe switch") {
  fake_sysfs sys;
  const auto gpus = p4d(sys);
  REQUIRE(gpus.size() == 8);
  const names nics = rdm(p4d_nics());
  for (int g = 0; g < 8; ++g) {
    CAPTURE(g);
    const auto near = d::order_by_distance(sys.root(), gpus[static_cast<std::size_t>(g)], nics);
    CHECK(near.nearest == 1);
    const std::size_t own = static_cast<std::size_t>(g / 2);
    REQUIRE(near.order.size() == 4);
    CHECK(near.order[0] == nics[own]);
    // Then the other switch on the same socket, then the other socket's two (by name).
    const std::size_t sibling = own ^ 1u;
    CHECK(near.order[1] == nics[sibling]);
    const std::size_t far = own < 2 ? 2 : 0;
    CHECK(near.order[2] == nics[far]);
    CHECK(near.order[3] == nics[far + 1]);
  }
  // A GPU and the device behind its switch: up two bridges each to where they part.
  const auto gpu = d::gpu_pci_path(sys.root(), gpus[0]);
  const auto efa = d::nic_pci_path(sys.root(), "rdmap16s0-rdm");
  REQUIRE(gpu.size() == 5);
  CHECK(gpu.front() == "pci0000:00");
  CHECK(d::pci_distance(gpu, efa) == std::pair<int, std::size_t>{0, 4});
  CHECK(d::pci_distance(gpu, d::nic_pci_path(sys.root(), "rdmap48s0")).first == 1);
}

TEST_CASE("p5: each GPU drives its four EFA devices of 32") {
  fake_sysfs sys;
  const auto gpus = p5(sys);
  const names nics = p5_nics();
  for (std::size_t g = 0; g < 8; ++g) {
    CAPTURE(g);
    const auto near = d::order_by_distance(sys.root(), gpus[g], nics);
    CHECK(near.nearest == 4);
    REQUIRE(near.order.size() == 32);
    const names four(near.order.begin(), near.order.begin() + 4);
    CHECK(four == names(nics.begin() + static_cast<std::ptrdiff_t>(4 * g),
                        nics.begin() + static_cast<std::ptrdiff_t>(4 * g + 4)));
  }
}

TEST_CASE("what sysfs does not place changes nothing") {
  fake_sysfs sys;
  const auto gpus = p4d(sys);
  sys.virtual_interface("rz0");
  sys.virtual_interface("rz1");
  SUBCASE("virtual interfaces (the test bed's veths): none nearest, every one in name order") {
    const auto near = d::order_by_distance(sys.root(), gpus[0], {"rz1", "rz0"});
    CHECK(near.nearest == 0);
    CHECK(near.order == names{"rz0", "rz1"});
  }
  SUBCASE("a GPU sysfs does not list") {
    const auto near = d::order_by_distance(sys.root(), "0000:ee:00.0", rdm(p4d_nics()));
    CHECK(near.nearest == 0);
    CHECK(near.order == rdm(p4d_nics()));
  }
  SUBCASE("placed NICs come before unplaced ones") {
    const auto near = d::order_by_distance(sys.root(), gpus[2], {"rz0", "rdmap48s0", "rdmap32s0"});
    CHECK(near.nearest == 1);
    CHECK(near.order == names{"rdmap32s0", "rdmap48s0", "rz0"});
  }
  SUBCASE("an interface on a virtio NIC is placed by the PCI device it hangs off") {
    auto dir = sys.device({"pci0000:00", addr(0, 1), addr(0x10), addr(0x11, 3), addr(0x15)});
    fs::create_directories(dir / "virtio3");
    sys.interface("eth0", dir / "virtio3");
    const auto near = d::order_by_distance(sys.root(), gpus[0], {"eth0", "rdmap32s0"});
    CHECK(near.nearest == 1);
    CHECK(near.order.front() == "eth0");
  }
  SUBCASE("names that are no file name are no NIC, even where such a path leads to one") {
    // Without the check, each of these would resolve to rdmap16s0's device.
    REQUIRE_FALSE(d::nic_pci_path(sys.root(), "rdmap16s0").empty());
    const fs::path efa =
        fs::canonical(sys.root() / "class" / "infiniband" / "rdmap16s0" / "device");
    fs::create_directory_symlink(efa, sys.root() / "class" / "device");
    fs::create_directory_symlink(efa, sys.root() / "class" / "net" / "device");
    CHECK(d::nic_pci_path(sys.root(), "../infiniband/rdmap16s0").empty());
    CHECK(d::nic_pci_path(sys.root(), "..").empty());
    CHECK(d::nic_pci_path(sys.root(), "").empty());
  }
}

TEST_CASE("rails narrow to a GPU's nearest only where any rail reaches any other") {
  const auto has = [](std::string_view text) { return d::parse_interfaces(text); };
  // EFA's devices have no address and share one fabric.
  CHECK(d::rails_interchangeable(has("rdmap16s27 rdmap32s27"), {"rdmap16s27", "rdmap32s27"}));
  // Interfaces on one subnet reach each other; a subnet each (the test bed's rz0, rz1) do not.
  CHECK(d::rails_interchangeable(has("eth0=10.0.1.5/16 eth1=10.0.2.5/16"), {"eth0", "eth1"}));
  CHECK_FALSE(d::rails_interchangeable(has("rz0=10.77.0.1/24 rz1=10.77.1.1/24"), {"rz0", "rz1"}));
  CHECK_FALSE(d::rails_interchangeable(has("eth0=10.0.1.5/16 eth1=10.0.2.5/24"), {"eth0", "eth1"}));
  CHECK_FALSE(d::rails_interchangeable(has("rdmap16s27 eth0=10.0.1.5/16"), {"eth0", "rdmap16s27"}));
  CHECK_FALSE(d::rails_interchangeable(has("rdmap16s27 eth0=10.0.1.5/16"), {"rdmap16s27", "eth0"}));
  CHECK_FALSE(d::rails_interchangeable(has("eth0=10.0.1.5/16"), {"eth0", "eth9"}));
}

namespace {

/// rails_near_gpu on `gpu_of.size()` processes sharing a store; rank r names GPU gpu_of[r] (empty:
/// none) and must end with expected[r].
void agree(const fs::path& sysfs, const names& agreed, bool interchangeable,
           const std::vector<std::string>& gpu_of, const std::vector<names>& expected) {
  const int n = static_cast<int>(gpu_of.size());
  const auto key = [](std::string_view what, int r) { return fmt::format("t/{}/{}", what, r); };
  auto out = multiprocess::run(n, 60s, [&](int r, int size, ringzero::bootstrap::store& s) {
    multiprocess::rank_checks check{r};
    const auto mine = d::rails_near_gpu(s, key, r, size, agreed, interchangeable,
                                        gpu_of[static_cast<std::size_t>(r)], sysfs);
    check.expect(mine == expected[static_cast<std::size_t>(r)],
                 fmt::format("rails {}, expected {}", d::rail_list(mine),
                             d::rail_list(expected[static_cast<std::size_t>(r)])));
    return check.code();
  });
  multiprocess::require_all_passed(out);
}

}  // namespace

TEST_CASE("ranks agree: as many rails each, the fewest any rank has nearest its GPU") {
  fake_sysfs sys;
  const auto gpus = p5(sys);
  const names all = p5_nics();
  const names nics(all.begin(), all.begin() + 12);  // the NICs of GPUs 0-2
  SUBCASE("every rank's GPU has four: its own four") {
    agree(sys.root(), nics, true, {gpus[0], gpus[1], gpus[2]},
          {names(nics.begin(), nics.begin() + 4), names(nics.begin() + 4, nics.begin() + 8),
           names(nics.begin() + 8, nics.begin() + 12)});
  }
  SUBCASE("one GPU with two of its four: every rank drives two, its nearest") {
    names some = nics;
    some.erase(some.begin() + 10, some.end());  // GPU 2 keeps rdmap48s0 and rdmap48s1
    agree(sys.root(), some, true, {gpus[0], gpus[1], gpus[2]},
          {names(some.begin(), some.begin() + 2), names(some.begin() + 4, some.begin() + 6),
           names(some.begin() + 8, some.begin() + 10)});
  }
  SUBCASE("a rank that names no GPU: every rank drives every rail") {
    agree(sys.root(), nics, true, {gpus[0], "", gpus[2]}, {nics, nics, nics});
  }
  SUBCASE("a GPU sysfs does not place: every rail") {
    agree(sys.root(), nics, true, {gpus[0], "0000:ee:00.0"}, {nics, nics});
  }
  SUBCASE("rails that are not interchangeable (a subnet each): every rail, in order") {
    agree(sys.root(), nics, false, {gpus[0], gpus[1]}, {nics, nics});
  }
}
