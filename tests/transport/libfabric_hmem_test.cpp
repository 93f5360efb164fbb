// Device memory over the libfabric transport (options::device_memory), where no GPU is needed:
// the FI_HMEM capability the transport records is what fi_getinfo says of each provider, a
// provider without it is refused at startup with an error naming it on every rank, a CUDA
// registration the provider cannot make is refused naming it, and host collectives on an
// endpoint opened for device memory give the same results as before; with a host stand-in for
// the CUDA runtime, device buffers reach the device path and are refused where the endpoint
// cannot take them. The device path itself runs in libfabric_hmem_gpu_test.cu.
#include <doctest/doctest.h>
#include <rdma/fabric.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "fake_device.hpp"
#include "multiprocess.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/libfabric.hpp"

using namespace std::chrono_literals;
using ringzero::op;
namespace fabric = ringzero::libfabric;
using multiprocess::rank_checks;
using multiprocess::require_all_passed;

namespace {

/// What libfabric itself answers when asked for `provider` with FI_HMEM: written out here,
/// apart from the transport's own query, so the test does not check the code with itself.
/// -1: the provider is not there at all; 0: there, without FI_HMEM; 1: with FI_HMEM.
int reports_hmem(const char* provider) {
  auto ask = [&](bool hmem) {
    fi_info* hints = fi_allocinfo();
    REQUIRE(hints != nullptr);
    hints->caps = FI_TAGGED | (hmem ? FI_HMEM : 0);
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                                  FI_MR_ENDPOINT | (hmem ? FI_MR_HMEM : 0);
    hints->fabric_attr->prov_name = ::strdup(provider);
    fi_info* out = nullptr;
    const int rc = fi_getinfo(FI_VERSION(1, 14), nullptr, nullptr, 0, hints, &out);
    fi_freeinfo(hints);
    const bool found = rc == 0 && out != nullptr;
    bool has = false;
    for (const fi_info* i = found ? out : nullptr; i; i = i->next)
      has = has || (i->caps & FI_HMEM) != 0;
    if (out) fi_freeinfo(out);
    return found && (!hmem || has);
  };
  if (!ask(false)) return -1;
  return ask(true) ? 1 : 0;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("a provider without FI_HMEM is refused at startup, on every rank, naming it") {
  for (const char* provider : {"tcp;ofi_rxm", "sockets"}) {
    CAPTURE(provider);
    const int hmem = reports_hmem(provider);
    if (hmem != 0) {
      const std::string why =
          std::string(provider) +
          (hmem < 0 ? " is not built into this libfabric" : " reports FI_HMEM") +
          "; the refusal is not exercised for it";
      MESSAGE(why);
      continue;
    }
    auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      std::string what;
      bool refused = false;
      try {
        fabric::communicator comm(
            fabric::transport(s, r, n, {.provider = provider, .device_memory = true}));
      } catch (const ringzero::error& e) {
        what = e.what();
        refused = r == 0 ? e.code() == ringzero::errc::unsupported : true;
      }
      check.expect(refused, "opening with device_memory to fail; got '" + what + "'");
      if (r == 0) std::fprintf(stderr, "refused as expected: %s\n", what.c_str());
      check.expect(contains(what, std::string("libfabric provider '") + provider + "'") &&
                       contains(what, "does not report FI_HMEM") &&
                       contains(what, "stage them through host memory"),
                   "the error to name the provider and what it lacks; got '" + what + "'");
      // The same provider opens for host memory: only the request for device memory failed.
      fabric::communicator host(fabric::transport(s, r, n, {.provider = provider}));
      check.expect(!host.transport().device_memory(), "a host-memory endpoint without FI_HMEM");
      return check.code();
    });
    require_all_passed(out);
  }
}

TEST_CASE("the FI_HMEM capability recorded is the one fi_getinfo reports") {
  for (const char* provider : {"shm", "tcp;ofi_rxm", "sockets"}) {
    CAPTURE(provider);
    const int hmem = reports_hmem(provider);
    if (hmem < 0) continue;
    const std::string said =
        std::string(provider) + (hmem ? " reports" : " does not report") + " FI_HMEM";
    MESSAGE(said);
    auto out = multiprocess::run(1, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      bool opened = false;
      std::string what;
      try {
        fabric::transport t(s, r, n, {.provider = provider, .device_memory = true});
        opened = true;
        check.expect(t.device_memory(), "device_memory() once opened with FI_HMEM");
      } catch (const ringzero::error& e) {
        what = e.what();
      }
      check.expect(opened == (hmem == 1),
                   std::string("the endpoint to open exactly when fi_getinfo reports FI_HMEM; ") +
                       (opened ? "it opened" : "it failed: " + what));
      // Without the request nothing changes: FI_HMEM is not asked for, so not recorded.
      fabric::transport plain(s, r, n, {.provider = provider});
      check.expect(!plain.device_memory(), "no FI_HMEM unless device_memory was asked for");
      return check.code();
    });
    require_all_passed(out);
  }
}

TEST_CASE("a CUDA registration is refused clearly where the endpoint cannot make it") {
  auto out = multiprocess::run(1, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    std::vector<std::byte> buf(4096);
    {
      // Opened for host memory: the transport refuses before libfabric is asked.
      fabric::transport t(s, r, n, {.provider = "shm"});
      std::string what;
      try {
        t.register_device_buffer(buf.data(), buf.size(), 0);
      } catch (const ringzero::error& e) {
        what = e.what();
        check.expect(e.code() == ringzero::errc::unsupported, "unsupported");
      }
      check.expect(contains(what, "'shm'") && contains(what, "device_memory"),
                   "the error to name the provider and the option; got '" + what + "'");
    }
    if (reports_hmem("shm") != 1) return check.code();
    // shm reports FI_HMEM, but registers CUDA memory only in a libfabric built with CUDA. The
    // address is host memory declared as device 0: a libfabric without CUDA refuses it
    // without touching it, which is the refusal under test; one with CUDA may accept it, and
    // then the registration is dropped again.
    fabric::transport t(s, r, n, {.provider = "shm", .device_memory = true});
    std::string what;
    try {
      t.register_device_buffer(buf.data(), buf.size(), 0);
    } catch (const ringzero::error& e) {
      what = e.what();
      check.expect(e.code() == ringzero::errc::unsupported, "unsupported");
    }
    if (what.empty()) {
      std::fprintf(stderr, "this libfabric registered FI_HMEM_CUDA memory on shm\n");
      check.expect(t.engine().device_ranges() == 1, "one device range registered");
      t.forget_memory(buf.data(), buf.size());
      check.expect(t.engine().device_ranges() == 0, "forget_memory to drop it");
    } else {
      std::fprintf(stderr, "refused as expected: %s\n", what.c_str());
      check.expect(
          contains(what, "libfabric provider 'shm' reports FI_HMEM but did not register") &&
              contains(what, "with FI_HMEM_CUDA") && contains(what, "host memory instead"),
          "the error to name the provider and FI_HMEM_CUDA; got '" + what + "'");
      check.expect(t.engine().device_ranges() == 0, "nothing registered after the refusal");
    }
    std::string negative;
    try {
      t.register_device_buffer(buf.data(), buf.size(), -1);
    } catch (const ringzero::invalid_argument& e) {
      negative = e.what();
    }
    check.expect(contains(negative, "-1"), "a negative device ordinal to be refused");
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("host collectives on an endpoint opened for device memory are unchanged") {
  if (reports_hmem("shm") != 1) {
    MESSAGE("shm does not report FI_HMEM here; nothing to open");
    return;
  }
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    fabric::communicator comm(
        fabric::transport(s, r, n, {.provider = "shm", .device_memory = true}));
    check.expect(comm.transport().device_memory(), "an FI_HMEM endpoint");
    // Small messages are injected, large ones go with FI_MR_HMEM set and no descriptor: both
    // are host memory, which FI_MR_HMEM leaves unregistered.
    for (std::size_t count : {std::size_t{3}, std::size_t{100000}}) {
      std::vector<std::int32_t> v(count);
      for (std::size_t i = 0; i < count; ++i) v[i] = r + static_cast<std::int32_t>(i % 7);
      ringzero::all_reduce(comm, std::span<std::int32_t>(v), op::sum,
                           {.algorithm = ringzero::algorithm::ring});
      bool ok = true;
      for (std::size_t i = 0; i < count; ++i)
        ok = ok && v[i] == 3 + 3 * static_cast<std::int32_t>(i % 7);
      check.expect(ok, "the ring sum of " + std::to_string(count) + " elements");
    }
    check.expect(comm.transport().engine().device_ranges() == 0, "no device ranges");
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("device buffers reach the device path, and are refused naming the provider") {
  // The host stand-in for the CUDA runtime (fake_device.hpp) says which buffers are device
  // memory, as kernels/cuda/device_reduction.cuh does in a program with a GPU.
  auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    const fake_device::installed fake;
    fake_device::buffer<float> dev(16);
    std::vector<float> host(16, 1.0f);
    const auto refusal = [&](auto&& call) -> std::string {
      try {
        call();
      } catch (const ringzero::error& e) {
        return e.what();
      }
      return "no error";
    };
    {
      fabric::communicator comm(fabric::transport(s, r, n, {.provider = "tcp;ofi_rxm"}));
      const std::string what = refusal([&] { ringzero::all_reduce(comm, dev.span(), op::sum); });
      check.expect(
          contains(what,
                   "all_reduce: libfabric provider 'tcp;ofi_rxm' was opened for "
                   "host memory only"),
          "device buffers on a host-memory endpoint refused naming it; got '" + what + "'");
      const std::string mixed = refusal(
          [&] { ringzero::all_reduce(comm, std::span<const float>(host), dev.span(), op::sum); });
      check.expect(contains(mixed,
                            "the input is host memory and the output memory of CUDA "
                            "device 0"),
                   "a host input with a device output refused; got '" + mixed + "'");
      // Host buffers still take the host path on the same communicator.
      ringzero::all_reduce(comm, std::span<float>(host), op::sum);
      check.expect(host[0] == static_cast<float>(n), "the host sum");
    }
    if (reports_hmem("shm") == 1) {
      // Debian's shm reports FI_HMEM without CUDA support: the call reaches the device path
      // and the registration of its buffers is refused, naming the provider.
      fabric::communicator comm(
          fabric::transport(s, r, n, {.provider = "shm", .device_memory = true}));
      const std::string what = refusal([&] { ringzero::all_reduce(comm, dev.span(), op::sum); });
      check.expect(contains(what, "libfabric provider 'shm'"),
                   "the device path's registration refused naming shm; got '" + what + "'");
    }
    return check.code();
  });
  require_all_passed(out);
}
