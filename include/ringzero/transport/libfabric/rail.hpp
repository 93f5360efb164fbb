// One rail: the libfabric resources of one NIC (fabric, domain, completion queue, address
// vector, an FI_EP_RDM endpoint with tagged messaging, and the domain's memory registrations),
// and the provider calls on them, as a rail kind of the transport kit (transport/detail/rail.hpp:
// post, poll, cancel, link state, price). A rail knows nothing of requests, queues, deadlines or
// failures: the kit's rail engine (transport/detail/rail_engine.hpp) decides what to post on which
// rail and when, reads each rail's completions, and delivers reliably over several. A NIC is
// added by opening another rail; the engine does not change.
//
// One code path serves every provider: what differs between efa, shm, tcp;ofi_rxm,
// verbs;ofi_rxm and sockets is read from the fi_info the provider returns (mr_mode, mode,
// tag width, inject and message size limits) and honoured:
//   - FI_MR_LOCAL: buffers get descriptors from the rail's registration cache (mr_cache.hpp),
//     with FI_MR_ENDPOINT binding, FI_MR_PROV_KEY keys and FI_MR_ALLOCATED (only buffers the
//     caller allocated are ever registered); registrations belong to a domain, so each rail
//     keeps its own;
//   - FI_CONTEXT / FI_CONTEXT2: every operation starts with an fi_context2 the provider may use;
//   - FI_HMEM (config::device_memory): asked for only when the caller will hand it CUDA device
//     buffers, since it narrows the providers on offer; device buffers are registered with
//     FI_HMEM_CUDA (mr_cache::register_device), always carry their descriptor (FI_MR_HMEM), and
//     are never injected (fi_tinject takes no descriptor, so the provider would read the device
//     address as host memory);
//   - a message's piece number (several rails) rides in the tag bits above the communicator
//     ids, and its sequence number in 4 bytes of remote CQ data.
// Every provider call runs under the watchdog's eye (watched): a call that never returns (a
// peer killed holding shm's lock) ends the process past the deadline.
#pragma once

#include <fmt/core.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/interfaces.hpp"
#include "ringzero/transport/detail/rail.hpp"
#include "ringzero/transport/libfabric/error.hpp"
#include "ringzero/transport/libfabric/mr_cache.hpp"
#include "ringzero/transport/libfabric/watchdog.hpp"
#include "ringzero/tuning/defaults.hpp"

namespace ringzero::libfabric::detail {

/// A rail's own limits, named once.
struct rail_limits {
  /// Room for a provider's address as text (fi_sockaddr_in6://[...]:port fits).
  static constexpr std::size_t address_text_bytes = 128;
};

/// The libfabric API version ringzero is written against (FI_MR_ENDPOINT and FI_CONTEXT2 need
/// at least 1.5; 1.14 is the oldest release the build accepts).
inline constexpr std::uint32_t api_version = FI_VERSION(1, 14);

/// Owns one fid_* object and closes it.
template <class F>
class handle {
 public:
  handle() = default;
  handle(const handle&) = delete;
  handle& operator=(const handle&) = delete;
  ~handle() { reset(); }
  void reset() noexcept {
    if (p_) fi_close(&p_->fid);
    p_ = nullptr;
  }
  [[nodiscard]] F* get() const noexcept { return p_; }
  [[nodiscard]] F** out() noexcept {
    reset();
    return &p_;
  }
  /// Gives the object up without closing it.
  [[nodiscard]] F* release() noexcept { return std::exchange(p_, nullptr); }

 private:
  F* p_ = nullptr;
};

struct info_deleter {
  void operator()(fi_info* i) const noexcept { fi_freeinfo(i); }
};

using info_ptr = std::unique_ptr<fi_info, info_deleter>;

/// The variable ofi_rxm reads, at each endpoint's opening, for the largest message it sends
/// eagerly (in one piece, straight into the receiver's posted buffer) instead of by
/// rendezvous (the sender announces the message, the receiver reads it).
inline constexpr const char* rxm_eager_limit_variable = "FI_OFI_RXM_EAGER_LIMIT";
/// Every message eager: ofi_rxm carries the limit in a 32-bit field of its handshake.
inline constexpr std::string_view rxm_eager_limit_value = "4294967295";

/// ofi_rxm over tcp sends everything past 16 KiB by rendezvous, and a survivor then crashes
/// when a peer dies with a rendezvous under way: libfabric 1.17's ofi_rxm closes the dead
/// peer's connection (sets its endpoint to null) but keeps the announcement it had received
/// from it, and reading that message later, in the survivor's next fi_cq_read, calls fi_readv
/// on the null endpoint (SIGSEGV, docs/reliability.md "A survivor's crash in ofi_rxm"). Sent
/// eagerly, a message never refers back to its sender's connection. It is also the faster
/// protocol on tcp from 64 KiB (one trip instead of three: docs/performance.md). So, before
/// the first tcp;ofi_rxm endpoint opens, ringzero sets FI_OFI_RXM_EAGER_LIMIT unless the user
/// did (theirs is kept: the way to ask for rendezvous back). ofi_rxm honours it where the
/// receiver takes messages of any size (tcp's dynamic receive buffers, and direct send, both
/// on by default; device buffers, with FI_HMEM, then take the eager path that messages up to
/// 16 KiB always took), so only tcp;ofi_rxm is touched; a rank whose limit differs still
/// interoperates (each sender picks its protocol, each receiver takes either). setenv runs
/// once, while the communicator is built: a thread reading the environment at that moment
/// races with it, as with any setenv.
inline void rxm_eager_by_default(std::string_view provider) {
  if (!provider.starts_with("tcp") || provider.find("ofi_rxm") == std::string_view::npos) return;
  static std::once_flag once;
  std::call_once(once, [] {
    if (const char* set = std::getenv(rxm_eager_limit_variable)) {
      log::info(
          "libfabric: {}={} as set (ofi_rxm's rendezvous crashes a survivor of a dead "
          "peer in libfabric 1.17; ringzero would make every message eager)",
          rxm_eager_limit_variable, set);
      return;
    }
    const std::string value(rxm_eager_limit_value);
    if (::setenv(rxm_eager_limit_variable, value.c_str(), 0) == 0)
      log::info("libfabric: {}={}: ofi_rxm sends every message eagerly", rxm_eager_limit_variable,
                value);
  });
}

/// What a rail asks of every provider, and with `hmem` also FI_HMEM (device memory in
/// messages) with the FI_MR_HMEM registration mode the man pages pair it with. Returns the
/// candidates in the provider's order of preference; nullptr-safe: an empty pointer when none
/// matches.
[[nodiscard]] inline info_ptr query(const char* provider, int* rc_out = nullptr, bool hmem = false,
                                    bool cq_data = false) {
  info_ptr hints(fi_allocinfo());
  if (!hints) throw transport_error("fi_allocinfo failed: out of memory");
  hints->caps = FI_TAGGED | FI_DIRECTED_RECV;
  // Remote CQ data is offered through domain_attr->cq_data_size (ofi_rxm carries 8 bytes
  // without listing FI_REMOTE_CQ_DATA among its caps), so asking for it is asking for a size.
  if (cq_data) hints->domain_attr->cq_data_size = 4;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  if (hmem) {
    hints->caps |= FI_HMEM;
    hints->domain_attr->mr_mode |= FI_MR_HMEM;
  }
  // Calls are serialized by the engine's mutex, so the provider may skip its own locks.
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
  if (provider) hints->fabric_attr->prov_name = ::strdup(provider);
  fi_info* out = nullptr;
  const int rc = fi_getinfo(api_version, nullptr, nullptr, 0, hints.get(), &out);
  if (rc_out) *rc_out = rc;
  return info_ptr(rc == 0 ? out : nullptr);
}

/// True for candidates bound to a loopback address, which peers on other hosts cannot reach.
[[nodiscard]] inline bool is_loopback(const fi_info* i) noexcept {
  if (!i->src_addr) return false;
  if (i->addr_format == FI_SOCKADDR_IN && i->src_addrlen >= sizeof(sockaddr_in)) {
    const auto* a = static_cast<const sockaddr_in*>(i->src_addr);
    return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  }
  if (i->addr_format == FI_SOCKADDR_IN6 && i->src_addrlen >= sizeof(sockaddr_in6)) {
    const auto* a = static_cast<const sockaddr_in6*>(i->src_addr);
    return IN6_IS_ADDR_LOOPBACK(&a->sin6_addr);
  }
  return false;
}

/// True for IPv6 link-local candidates (fe80::/10): their names lack the interface scope, so
/// a peer that connects to one gets EINVAL from connect() instead of a connection.
[[nodiscard]] inline bool is_link_local(const fi_info* i) noexcept {
  if (!i->src_addr || i->addr_format != FI_SOCKADDR_IN6 || i->src_addrlen < sizeof(sockaddr_in6))
    return false;
  return IN6_IS_ADDR_LINKLOCAL(&static_cast<const sockaddr_in6*>(i->src_addr)->sin6_addr);
}

/// Whether the candidate is bound to the IPv4 address `a`.
[[nodiscard]] inline bool bound_to(const fi_info* i, const in_addr& a) noexcept {
  return i->src_addr && i->addr_format == FI_SOCKADDR_IN && i->src_addrlen >= sizeof(sockaddr_in) &&
         static_cast<const sockaddr_in*>(i->src_addr)->sin_addr.s_addr == a.s_addr;
}

/// The best of the provider's candidates, first in the provider's order among equals; with a
/// `domain`, only candidates of that domain (a NIC: tcp names its domains after interfaces, efa
/// after devices) count. A candidate is worse when peers could not reach it: loopback once ranks
/// span hosts (an interface that is not up yet drops out of the list, and the loopback entry
/// that remains would strand this rank), then IPv6 link-local (the order of the list differs
/// between kernels, so relying on the first entry works on one machine and hangs on the next),
/// then any IPv6 address when an IPv4 one is on offer. Among those peers can reach, the one
/// bound to `near` (the address the job rendezvouses from) comes first: a one-host job whose
/// store is on 127.0.0.1 stays on loopback instead of opening its ports on the host's external
/// interface. nullptr when no candidate is of `domain`.
[[nodiscard]] inline const fi_info* pick(const fi_info* list, bool one_host,
                                         std::string_view domain = {},
                                         std::optional<in_addr> near = std::nullopt) {
  const fi_info* best = nullptr;
  int best_score = -1;
  for (const fi_info* i = list; i; i = i->next) {
    if (!domain.empty() && (!i->domain_attr->name || domain != i->domain_attr->name)) continue;
    const bool reachable = one_host || !is_loopback(i);
    const int score = (reachable ? 8 : 0) + (reachable && near && bound_to(i, *near) ? 4 : 0) +
                      (is_link_local(i) ? 0 : 2) + (i->addr_format != FI_SOCKADDR_IN6 ? 1 : 0);
    if (score > best_score) {
      best = i;
      best_score = score;
    }
  }
  return best;
}

/// The domains a provider's candidates offer, for an error that names what could be chosen.
[[nodiscard]] inline std::string domains_of(const fi_info* list) {
  std::vector<std::string> names;
  for (const fi_info* i = list; i; i = i->next) {
    std::string n = i->domain_attr->name ? i->domain_attr->name : "?";
    if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(std::move(n));
  }
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

/// What a libfabric rail keeps in each operation (rail_op::scratch, first): the fi_context2 the
/// provider may use (FI_CONTEXT/FI_CONTEXT2 modes), and the buffer's registration.
struct op_scratch {
  fi_context2 provider_scratch{};
  mr_cache::entry* mr = nullptr;
};
using op_context = ringzero::detail::rail_op<op_scratch>;
static_assert(offsetof(op_context, scratch) == 0 && offsetof(op_scratch, provider_scratch) == 0,
              "libfabric needs the fi_context2 at the start of the operation context");

/// What a rail that failed leaves to the provider instead of closing it (rail::leave_open): kept
/// for the life of the process, reachable (leak checkers do not report it) and never closed.
struct left_open {
  std::vector<fid*> objects;
  std::vector<std::unique_ptr<mr_cache>> mrs;

  [[nodiscard]] static std::vector<std::unique_ptr<left_open>>& all() {
    static auto* kept = new std::vector<std::unique_ptr<left_open>>();
    return *kept;
  }
  [[nodiscard]] static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
};

class rail {
 public:
  using scratch = op_scratch;
  using op = op_context;

  struct config {
    std::string provider;  ///< empty: libfabric's first choice under FI_PROVIDER
    /// The NIC, as the provider names its domain (tcp: the interface, efa: the device); empty:
    /// the best candidate the provider offers (pick()).
    std::string domain;
    /// With no `domain`: the address this rank rendezvouses from (pick()'s `near`); none: the
    /// provider's order decides among reachable candidates.
    std::optional<in_addr> near{};
    bool register_always = false;
    bool one_host = true;  ///< every rank on this host: loopback addresses will do
    /// Ask for FI_HMEM: the caller will pass CUDA device buffers (register_device).
    bool device_memory = false;
    /// Ask for FI_REMOTE_CQ_DATA: messages carry a word the receiver's completion reports
    /// (delivery over several rails numbers its messages with it).
    bool cq_data = false;
  };

  explicit rail(const config& cfg) {
    int rc = 0;
    const char* wanted = cfg.provider.empty() ? nullptr : cfg.provider.c_str();
    info_ptr list = query(wanted, &rc, cfg.device_memory, cfg.cq_data);
    if (!list && cfg.device_memory) {
      // Tell "this provider cannot move device memory" apart from "no such provider".
      if (info_ptr plain = query(wanted)) {
        const fi_info* p = plain.get();
        throw unsupported(fmt::format(
            "libfabric provider '{}' does not report FI_HMEM (fi_info -p '{}' -c FI_HMEM lists "
            "nothing), so it cannot move CUDA device memory: GPU buffers need a provider with "
            "CUDA memory registration (efa with GPUDirect RDMA, or shm and verbs;ofi_rxm in a "
            "libfabric built with CUDA); stage them through host memory instead",
            p->fabric_attr->prov_name ? p->fabric_attr->prov_name : "?",
            p->fabric_attr->prov_name ? p->fabric_attr->prov_name : "?"));
      }
    }
    if (!list)
      throw unsupported(fmt::format(
          "libfabric has no FI_EP_RDM provider with tagged messages{}{}: {} (fi_info -l lists "
          "the providers built in; FI_PROVIDER restricts them)",
          cfg.provider.empty() ? "" : " named ", cfg.provider, fi_text(rc)));
    const fi_info* chosen = pick(list.get(), cfg.one_host, cfg.domain, cfg.near);
    if (!chosen)
      throw unsupported(fmt::format(
          "libfabric provider '{}' has no domain named '{}' for a rail (RINGZERO_RAILS names "
          "the NICs as the provider names its domains); it offers: {}",
          list->fabric_attr->prov_name ? list->fabric_attr->prov_name : "?", cfg.domain,
          domains_of(list.get())));
    info_.reset(fi_dupinfo(chosen));
    if (!info_) throw transport_error("fi_dupinfo failed: out of memory");
    // Only a warning: hosts that share one network namespace (containers with host
    // networking) do reach each other over loopback.
    if (!cfg.one_host && (is_loopback(info_.get()) || is_link_local(info_.get())))
      log::warn(
          "libfabric: ranks span hosts but provider {} offers only a loopback or link-local "
          "address here; peers on other hosts may not reach this rank (is the interface up? "
          "FI_TCP_IFACE or RINGZERO_RAILS names the one to use)",
          info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : "?");
    provider_ = info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : "?";
    domain_name_ = info_->domain_attr->name ? info_->domain_attr->name : "?";
    mr_mode_ = info_->domain_attr->mr_mode;
    hmem_ = cfg.device_memory && (info_->caps & FI_HMEM) != 0;
    need_desc_ = (mr_mode_ & FI_MR_LOCAL) || cfg.register_always;
    link_mbps_ = info_->nic && info_->nic->link_attr && info_->nic->link_attr->speed > 0
                     ? info_->nic->link_attr->speed / 1'000'000
                     : ringzero::detail::interface_mbps(domain_name_);
    inject_size_ = info_->tx_attr->inject_size;
    cq_data_bytes_ = cfg.cq_data ? info_->domain_attr->cq_data_size : 0;
    // The engine's safety net under the algorithms' own bounds (tuning::policy::burst and
    // ::inflight): an operation the provider has no room for waits in the engine, in order,
    // instead of failing (-FI_ENOMEM from shm once rx_attr->size receives are posted) or
    // spinning inside the call. Half of each queue, because shm takes entries for early
    // (unexpected) arrivals from the same pool as posted receives.
    recv_cap_ = std::max<std::size_t>(info_->rx_attr->size / 2, 4);
    send_cap_ = std::max<std::size_t>(info_->tx_attr->size / 2, 4);
    max_msg_size_ = info_->ep_attr->max_msg_size;
    // The tag bits a provider matches end at the highest bit of its mem_tag_format.
    const std::uint64_t tag_format = info_->ep_attr->mem_tag_format;
    tag_width_ = tag_format ? 64 - std::countl_zero(tag_format) : 64;
    if (tag_width_ <= tag_bits)
      throw unsupported(
          fmt::format("provider {} matches only {} tag bits; ringzero needs more than {}",
                      provider_, tag_width_, tag_bits));

    check(fi_fabric(info_->fabric_attr, fabric_.out(), nullptr), "fi_fabric", provider_);
    check(fi_domain(fabric_.get(), info_.get(), domain_.out(), nullptr), "fi_domain", provider_);
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_TAGGED;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = std::max<std::size_t>(info_->tx_attr->size + info_->rx_attr->size, 1024);
    check(fi_cq_open(domain_.get(), &cq_attr, cq_.out(), nullptr), "fi_cq_open", provider_);
    fi_av_attr av_attr{};
    av_attr.type =
        info_->domain_attr->av_type == FI_AV_UNSPEC ? FI_AV_TABLE : info_->domain_attr->av_type;
    check(fi_av_open(domain_.get(), &av_attr, av_.out(), nullptr), "fi_av_open", provider_);
    rxm_eager_by_default(provider_);
    check(fi_endpoint(domain_.get(), info_.get(), ep_.out(), nullptr), "fi_endpoint", provider_);
    check(fi_ep_bind(ep_.get(), &av_.get()->fid, 0), "fi_ep_bind(av)", provider_);
    check(fi_ep_bind(ep_.get(), &cq_.get()->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)",
          provider_);
    check(fi_enable(ep_.get()), "fi_enable", provider_);
    mrs_ = std::make_unique<mr_cache>(domain_.get(), ep_.get(), mr_mode_, provider_);
    log::info(
        "libfabric: rail on provider {} fabric {} domain {} address {}, mr_mode {:#x}, mode "
        "{:#x}, {} tag bits, inject {} B{}",
        provider_, info_->fabric_attr->name ? info_->fabric_attr->name : "?", domain_name_,
        address_text(endpoint_name()), mr_mode_, info_->mode, tag_width_, inject_size_,
        hmem_ ? ", FI_HMEM" : "");
  }

  rail(const rail&) = delete;
  rail& operator=(const rail&) = delete;

  /// Closes the endpoint first: that ends every operation still posted, and only then may the
  /// memory the provider was using (registrations, then the queues it reported into) go. The
  /// close is watched, briefly: a close that waits on a peer that stopped must not hold the
  /// process past its deadline.
  ~rail() {
    watched(
        dog_,
        [&] {
          ep_.reset();
          mrs_.reset();
          av_.reset();
          cq_.reset();
          domain_.reset();
          fabric_.reset();
          return 0;
        },
        true);
  }

  /// Hands every provider object and the registrations to `kept` instead of closing them (see
  /// left_open): the rail is empty afterwards, and its destructor closes nothing.
  void leave_open(left_open& kept) noexcept {
    for (fid* f : {&ep_.release()->fid, &av_.release()->fid, &cq_.release()->fid,
                   &domain_.release()->fid, &fabric_.release()->fid})
      kept.objects.push_back(f);
    kept.mrs.push_back(std::move(mrs_));
  }

  /// This rail's address, as the peers' fi_av_insert wants it.
  [[nodiscard]] std::vector<std::byte> endpoint_name() const {
    std::vector<std::byte> buf(256);
    std::size_t len = buf.size();
    int rc = fi_getname(&ep_.get()->fid, buf.data(), &len);
    if (rc == -FI_ETOOSMALL) {
      buf.resize(len);
      rc = fi_getname(&ep_.get()->fid, buf.data(), &len);
    }
    check(rc, "fi_getname", provider_);
    buf.resize(len);
    return buf;
  }

  /// A name as text (the provider's own format, e.g. fi_sockaddr_in://198.51.100.1:41234),
  /// for logs and errors.
  [[nodiscard]] std::string address_text(const std::vector<std::byte>& name) const {
    char buf[rail_limits::address_text_bytes] = {};
    std::size_t len = sizeof(buf);
    if (!fi_av_straddr(av_.get(), name.data(), buf, &len)) return "?";
    return std::string(buf, ::strnlen(buf, sizeof(buf)));
  }

  /// Inserts every rank's name for this rail (index = world rank).
  void connect(const std::vector<std::vector<std::byte>>& names) {
    addrs_.assign(names.size(), FI_ADDR_NOTAVAIL);
    for (std::size_t r = 0; r < names.size(); ++r) {
      const int n = fi_av_insert(av_.get(), names[r].data(), 1, &addrs_[r], 0, nullptr);
      if (n != 1 || addrs_[r] == FI_ADDR_NOTAVAIL)
        throw transport_error(
            fmt::format("fi_av_insert of rank {}'s address failed on provider {} domain {}: {}", r,
                        provider_, domain_name_, n < 0 ? fi_text(n) : "not inserted"));
    }
  }
  [[nodiscard]] fi_addr_t address(int world_rank) const noexcept {
    return addrs_[static_cast<std::size_t>(world_rank)];
  }

  [[nodiscard]] const std::string& provider() const noexcept { return provider_; }
  [[nodiscard]] const std::string& domain_name() const noexcept { return domain_name_; }
  [[nodiscard]] int tag_width() const noexcept { return tag_width_; }
  [[nodiscard]] std::uint64_t mr_mode() const noexcept { return mr_mode_; }
  [[nodiscard]] std::size_t inject_size() const noexcept { return inject_size_; }
  /// Bytes of remote CQ data a message carries (0 unless config::cq_data asked for them).
  [[nodiscard]] std::size_t cq_data_bytes() const noexcept { return cq_data_bytes_; }
  [[nodiscard]] std::size_t max_message_size() const noexcept { return max_msg_size_; }
  /// Operations pass descriptors (FI_MR_LOCAL, or register_always).
  [[nodiscard]] bool registers() const noexcept { return need_desc_; }
  [[nodiscard]] bool hmem() const noexcept { return hmem_; }
  /// The NIC's link speed in Mbit/s: what the provider reports (efa fills fi_info's nic), else
  /// what the kernel reports for the network interface the domain is named after (tcp); 0 when
  /// neither knows (loopback, shm).
  [[nodiscard]] std::uint64_t link_mbps() const noexcept { return link_mbps_; }
  [[nodiscard]] std::size_t send_limit() const noexcept { return send_cap_; }
  [[nodiscard]] std::size_t receive_limit() const noexcept { return recv_cap_; }
  /// The domain's registrations.
  [[nodiscard]] mr_cache& memory() noexcept { return *mrs_; }
  [[nodiscard]] const mr_cache& memory() const noexcept { return *mrs_; }

  /// The watchdog every provider call runs under (null: none yet).
  void set_watchdog(watchdog* dog) noexcept { dog_ = dog; }
  /// With several rails, a message's piece number rides in the tag bits from `shift` up.
  void set_piece_shift(int shift) noexcept { piece_shift_ = shift; }

  // The rail concept (transport/detail/rail.hpp).

  /// fi_tsend (fi_tsenddata with the op's word) or fi_trecv, with the op as the context its
  /// completion returns: 0, -FI_EAGAIN when the provider has no room now, another negative code.
  [[nodiscard]] long post(op& c) noexcept {
    void* desc = c.scratch.mr ? c.scratch.mr->desc : nullptr;
    const fi_addr_t to = c.world_peer < 0 ? FI_ADDR_UNSPEC : address(c.world_peer);
    const std::uint64_t tag = provider_tag(c.tag, c.piece);
    return watched(dog_, [&]() -> long {
      if (!c.is_send)
        return fi_trecv(ep_.get(), c.buffer, c.length, desc, to, tag, provider_ignore(c.ignore),
                        &c);
      if (c.with_data)
        return fi_tsenddata(ep_.get(), c.buffer, c.length, desc, c.data, to, tag, &c);
      return fi_tsend(ep_.get(), c.buffer, c.length, desc, to, tag, &c);
    });
  }
  /// fi_tinject (fi_tinjectdata): 0 when the message left, complete on return.
  [[nodiscard]] long inject(const ringzero::detail::rail_message& m) noexcept {
    const std::uint64_t tag = provider_tag(m.tag, m.piece);
    return watched(dog_, [&]() -> long {
      if (m.with_data)
        return fi_tinjectdata(ep_.get(), m.bytes.data(), m.bytes.size(), m.data, address(m.peer),
                              tag);
      return fi_tinject(ep_.get(), m.bytes.data(), m.bytes.size(), address(m.peer), tag);
    });
  }
  void cancel(op& c) noexcept {
    watched(dog_, [&] { return fi_cancel(&ep_.get()->fid, &c); });
  }
  /// Reads every completion the queue has, reporting each (done, or failed with the provider's
  /// own explanation).
  void poll(ringzero::detail::rail_events<op>& events) {
    std::array<fi_cq_tagged_entry, 16> done;
    for (;;) {
      const ssize_t n =
          watched(dog_, [&] { return fi_cq_read(cq_.get(), done.data(), done.size()); });
      if (n > 0) {
        for (ssize_t i = 0; i < n; ++i) {
          const auto& e = done[static_cast<std::size_t>(i)];
          events.done(*static_cast<op*>(e.op_context), e.len, e.data,
                      (e.flags & FI_REMOTE_CQ_DATA) != 0);
        }
        if (static_cast<std::size_t>(n) < done.size()) break;
        continue;
      }
      if (n == -FI_EAGAIN) break;
      if (n == -FI_EAVAIL) {
        read_error(events);
        continue;
      }
      throw transport_error(fmt::format("fi_cq_read failed on provider {} domain {}: {}", provider_,
                                        domain_name_, fi_text(n)));
    }
  }
  /// Why the NIC's link is down (sysfs), or empty.
  [[nodiscard]] std::string link_state() const { return ringzero::detail::link_down(domain_name_); }
  /// The provider's figures (tuning::libfabric_default), for each rail alike.
  [[nodiscard]] tuning::rail_price price() const {
    const auto& base = tuning::libfabric_default(provider_).value;
    return {.alpha = base.alpha, .beta = base.beta};
  }
  [[nodiscard]] const std::string& name() const noexcept { return domain_name_; }
  [[nodiscard]] ringzero::detail::rail_traits traits() const noexcept {
    return {.send_limit = send_cap_,
            .receive_limit = recv_cap_,
            .inject_size = inject_size_,
            .max_message_size = max_msg_size_};
  }
  [[nodiscard]] std::string error_text(long rc) const { return fi_text(rc); }
  /// The buffer's registration, where the domain needs one (FI_MR_LOCAL, or FI_HMEM).
  void prepare(op& c) {
    if ((registers() || hmem()) && c.length > 0 && c.buffer != nullptr)
      c.scratch.mr = memory().acquire(c.buffer, c.length, registers());
  }
  void release(op& c) noexcept {
    if (c.scratch.mr) memory().release(c.scratch.mr);
    c.scratch.mr = nullptr;
  }
  /// Device buffers are never copied nor injected.
  [[nodiscard]] bool host_readable(const void* p, std::size_t n) const noexcept {
    return !memory().is_device(p, n);
  }
  /// Operations are still held by the provider (abandoned after a failure) at the engine's end:
  /// every provider object is kept open for the life of the process (left_open), and only the
  /// names other processes could still find (this process's /dev/shm regions) are removed.
  void leave_open() noexcept {
    try {
      auto kept = std::make_unique<left_open>();
      leave_open(*kept);
      std::lock_guard lock(left_open::mutex());
      left_open::all().push_back(std::move(kept));
    } catch (...) {
      // Out of memory: the objects stay where they are, unreachable but never closed.
      (void)ep_.release(), (void)av_.release(), (void)cq_.release(), (void)domain_.release();
      (void)fabric_.release();
      (void)mrs_.release();
    }
    remove_shm_regions(static_cast<long>(::getpid()));
  }

 private:
  [[nodiscard]] std::uint64_t provider_tag(std::uint64_t tag, std::uint8_t piece) const noexcept {
    return piece_shift_ < 64 ? tag | (std::uint64_t{piece} << piece_shift_) : tag;
  }
  /// A receive's ignored bits, below the piece field (a statement takes any tag of its piece).
  [[nodiscard]] std::uint64_t provider_ignore(std::uint64_t ignore) const noexcept {
    return piece_shift_ < 64 ? ignore & ((std::uint64_t{1} << piece_shift_) - 1) : ignore;
  }

  void read_error(ringzero::detail::rail_events<op>& events) {
    fi_cq_err_entry err{};
    const ssize_t rc = watched(dog_, [&] { return fi_cq_readerr(cq_.get(), &err, 0); });
    if (rc == -FI_EAGAIN) return;
    if (rc < 0)
      throw transport_error(fmt::format("fi_cq_readerr failed on provider {} domain {}: {}",
                                        provider_, domain_name_, fi_text(rc)));
    char buf[256] = {};
    const char* detail = fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data, buf, sizeof buf);
    const std::string text =
        fmt::format("{} (provider {} error {}: {})", fi_strerror(std::abs(err.err)), provider_,
                    err.prov_errno, detail ? detail : "");
    auto* c = static_cast<op*>(err.op_context);
    if (!c) {
      log::warn("libfabric: completion error without an operation: {}", text);
      return;
    }
    // Providers disagree on the sign of err.
    const int code = err.err < 0 ? -err.err : err.err;
    using fault = ringzero::detail::rail_fault;
    const fault f = code == FI_ECANCELED ? fault::cancelled
                    : code == FI_ETRUNC  ? fault::truncated
                    : is_peer_loss(code) ? fault::peer_lost
                                         : fault::other;
    const std::size_t sent = code == FI_ETRUNC && err.olen ? c->length + err.olen : 0;
    // ofi_rxm reports a truncated message's CQ data without setting FI_REMOTE_CQ_DATA in the
    // error's flags: with CQ data asked for, every message carries it.
    events.failed(*c, f, text, sent, err.data, cq_data_bytes_ > 0);
  }

  info_ptr info_;
  std::string provider_;
  std::string domain_name_;
  std::uint64_t mr_mode_ = 0;
  bool need_desc_ = false;
  bool hmem_ = false;
  std::uint64_t link_mbps_ = 0;
  std::size_t inject_size_ = 0;
  std::size_t cq_data_bytes_ = 0;
  std::size_t max_msg_size_ = 0;
  int tag_width_ = 64;
  std::size_t send_cap_ = 0;  ///< half the provider's queues: set by the constructor
  std::size_t recv_cap_ = 0;
  handle<fid_fabric> fabric_;
  handle<fid_domain> domain_;
  handle<fid_cq> cq_;
  handle<fid_av> av_;
  handle<fid_ep> ep_;
  std::unique_ptr<mr_cache> mrs_;
  std::vector<fi_addr_t> addrs_;
  watchdog* dog_ = nullptr;
  int piece_shift_ = 64;
};
static_assert(ringzero::detail::rail_kind<rail>);

}  // namespace ringzero::libfabric::detail
