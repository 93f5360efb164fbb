// One process's libfabric endpoint: fabric, domain, completion queue, address vector and an
// FI_EP_RDM endpoint with tagged messaging, shared by a communicator and every
// sub-communicator split from it. Everything that talks to libfabric lives here; the
// communicator only maps its ranks and tags onto it.
//
// One code path serves every provider: what differs between efa, shm, tcp;ofi_rxm,
// verbs;ofi_rxm and sockets is read from the fi_info the provider returns (mr_mode, mode,
// tag width, inject and message size limits) and honoured:
//   - FI_MR_LOCAL: buffers get descriptors from a registration cache (mr_cache.hpp), with
//     FI_MR_ENDPOINT binding, FI_MR_PROV_KEY keys and FI_MR_ALLOCATED (only buffers the
//     caller allocated are ever registered);
//   - FI_CONTEXT / FI_CONTEXT2: every operation's context starts with an fi_context2 the
//     provider may use;
//   - -FI_EAGAIN on a post: the completion queue is read (which is what frees provider
//     resources under manual progress) and the post retried until the deadline;
//   - data progress is manual: test() and progress() read the completion queue;
//   - FI_HMEM (config::device_memory): asked for only when the caller will hand it CUDA device
//     buffers, since it narrows the providers on offer; device buffers are registered with
//     FI_HMEM_CUDA (mr_cache::register_device), always carry their descriptor (FI_MR_HMEM), and
//     are never injected (fi_tinject takes no descriptor, so the provider would read the device
//     address as host memory).
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
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/transport/detail/pending_report.hpp"
#include "ringzero/transport/libfabric/error.hpp"
#include "ringzero/transport/libfabric/mr_cache.hpp"
#include "ringzero/transport/libfabric/watchdog.hpp"

namespace ringzero::libfabric::detail {

/// The endpoint's own limits, named once.
struct endpoint_limits {
  /// How long a cancelled send may take to leave: a send the provider cannot cancel is usually
  /// already on the wire and completes within microseconds; one that has not after 10 ms
  /// will not, and its buffer is kept instead (the communicator outlives it).
  static constexpr std::chrono::nanoseconds cancel_send_grace{10'000'000};
  /// How long submit() drives progress for the first queued operation before returning it to
  /// the caller's own wait loop: long enough to post behind a momentarily full queue, short
  /// enough that the caller's deadline is looked at again.
  static constexpr std::chrono::milliseconds post_progress_window{100};
  /// Completions read per fi_cq_read: one cache-friendly batch; the loop reads until fewer.
  static constexpr std::size_t completion_batch = 16;
  /// Room for a provider's address as text (fi_sockaddr_in6://[...]:port fits).
  static constexpr std::size_t address_text_bytes = 128;
  /// Queue shares before the provider reports its queue sizes (then half of each is used).
  static constexpr std::size_t default_send_cap = 64;
  static constexpr std::size_t default_recv_cap = 128;
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

/// What the endpoint asks of every provider, and with `hmem` also FI_HMEM (device memory in
/// messages) with the FI_MR_HMEM registration mode the man pages pair it with. Returns the
/// candidates in the provider's order of preference; nullptr-safe: an empty pointer when none
/// matches.
[[nodiscard]] inline info_ptr query(const char* provider, int* rc_out = nullptr,
                                    bool hmem = false) {
  info_ptr hints(fi_allocinfo());
  if (!hints) throw transport_error("fi_allocinfo failed: out of memory");
  hints->caps = FI_TAGGED | FI_DIRECTED_RECV;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  if (hmem) {
    hints->caps |= FI_HMEM;
    hints->domain_attr->mr_mode |= FI_MR_HMEM;
  }
  // Calls are serialized by the endpoint's mutex, so the provider may skip its own locks.
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

/// The best of the provider's candidates, first in the provider's order among equals. A
/// candidate is worse when peers could not reach it: loopback once ranks span hosts (an
/// interface that is not up yet drops out of the list, and the loopback entry that remains
/// would strand this rank), then IPv6 link-local (the order of the list differs between
/// kernels, so relying on the first entry works on one machine and hangs on the next), then
/// any IPv6 address when an IPv4 one is on offer.
[[nodiscard]] inline const fi_info* pick(const fi_info* list, bool one_host) {
  const fi_info* best = list;
  int best_score = -1;
  for (const fi_info* i = list; i; i = i->next) {
    const int score = (one_host || !is_loopback(i) ? 4 : 0) + (is_link_local(i) ? 0 : 2) +
                      (i->addr_format != FI_SOCKADDR_IN6 ? 1 : 0);
    if (score > best_score) {
      best = i;
      best_score = score;
    }
  }
  return best;
}

/// A posted operation. The provider sees a pointer to it as the operation's context and may
/// use the leading fi_context2 (FI_CONTEXT/FI_CONTEXT2 modes).
struct op_context {
  enum class status : std::uint8_t { pending, done, failed, cancelled };

  fi_context2 provider_scratch{};
  status state = status::pending;
  bool is_send = false;
  bool orphaned = false;  ///< its request gave up on it; freed when the completion arrives
  int world_peer = -1;
  int peer = -1;  ///< peer as the posting communicator numbers it, for messages
  std::size_t length = 0;
  bool posted = false;  ///< handed to the provider (else waiting in the endpoint's queue)
  void* buffer = nullptr;
  fi_addr_t address = FI_ADDR_UNSPEC;
  std::uint64_t tag = 0;
  mr_cache::entry* mr = nullptr;
  std::string error;
  bool peer_loss = false;
};
static_assert(offsetof(op_context, provider_scratch) == 0,
              "libfabric needs the fi_context2 at the start of the operation context");

/// What an endpoint that failed leaves to the provider instead of closing it (~endpoint): kept
/// for the life of the process, reachable (leak checkers do not report it) and never closed.
struct left_open {
  std::vector<fid*> objects;
  std::unique_ptr<mr_cache> mrs;
  std::deque<op_context> contexts;

  [[nodiscard]] static std::vector<std::unique_ptr<left_open>>& all() {
    static auto* kept = new std::vector<std::unique_ptr<left_open>>();
    return *kept;
  }
  [[nodiscard]] static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
};

class endpoint {
 public:
  struct config {
    std::string provider;  ///< empty: libfabric's first choice under FI_PROVIDER
    bool register_always = false;
    bool one_host = true;  ///< every rank on this host: loopback addresses will do
    std::chrono::nanoseconds timeout{std::chrono::seconds(300)};
    /// Ask for FI_HMEM: the caller will pass CUDA device buffers (register_device).
    bool device_memory = false;
  };

  explicit endpoint(const config& cfg) : timeout_(cfg.timeout) {
    int rc = 0;
    const char* wanted = cfg.provider.empty() ? nullptr : cfg.provider.c_str();
    info_ptr list = query(wanted, &rc, cfg.device_memory);
    if (!list && cfg.device_memory) {
      // Tell "this provider cannot move device memory" apart from "no such provider".
      if (info_ptr plain = query(wanted)) {
        const fi_info* p = pick(plain.get(), cfg.one_host);
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
    info_.reset(fi_dupinfo(pick(list.get(), cfg.one_host)));
    if (!info_) throw transport_error("fi_dupinfo failed: out of memory");
    // Only a warning: hosts that share one network namespace (containers with host
    // networking) do reach each other over loopback.
    if (!cfg.one_host && (is_loopback(info_.get()) || is_link_local(info_.get())))
      log::warn(
          "libfabric: ranks span hosts but provider {} offers only a loopback or link-local "
          "address here; peers on other hosts may not reach this rank (is the interface up? "
          "FI_TCP_IFACE names the one tcp should use)",
          info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : "?");
    provider_ = info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : "?";
    mr_mode_ = info_->domain_attr->mr_mode;
    hmem_ = cfg.device_memory && (info_->caps & FI_HMEM) != 0;
    need_desc_ = (mr_mode_ & FI_MR_LOCAL) || cfg.register_always;
    inject_size_ = info_->tx_attr->inject_size;
    // A safety net under the algorithms' own bounds (tuning::policy::burst and ::inflight):
    // an operation the provider has no room for waits here, in order, instead of failing
    // (-FI_ENOMEM from shm once rx_attr->size receives are posted) or spinning inside the
    // call. Half of each queue, because shm takes entries for early (unexpected) arrivals
    // from the same pool as posted receives.
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
    check(fi_endpoint(domain_.get(), info_.get(), ep_.out(), nullptr), "fi_endpoint", provider_);
    check(fi_ep_bind(ep_.get(), &av_.get()->fid, 0), "fi_ep_bind(av)", provider_);
    check(fi_ep_bind(ep_.get(), &cq_.get()->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)",
          provider_);
    check(fi_enable(ep_.get()), "fi_enable", provider_);
    mrs_ = std::make_unique<mr_cache>(domain_.get(), ep_.get(), mr_mode_, provider_);
    log::info(
        "libfabric: provider {} fabric {} domain {} address {}, mr_mode {:#x}, mode {:#x}, {} "
        "tag bits, inject {} B{}",
        provider_, info_->fabric_attr->name ? info_->fabric_attr->name : "?",
        info_->domain_attr->name ? info_->domain_attr->name : "?", address_text(name()), mr_mode_,
        info_->mode, tag_width_, inject_size_, hmem_ ? ", FI_HMEM" : "");
  }

  endpoint(const endpoint&) = delete;
  endpoint& operator=(const endpoint&) = delete;

  ~endpoint() {
    if (held_ > 0) {
      // Operations the provider never gave back (abandoned after a failure) still point into
      // buffers the caller has likely freed, and at a peer that may never answer: closing the
      // endpoint then makes the provider finish them, and ofi_rxm, tearing down a rendezvous
      // with a stopped peer, read a context of its own it had already freed (SIGSEGV in
      // fi_close). Nothing here drives progress any more, so the provider's objects and the
      // contexts it holds are left as they are, and only the names other processes could
      // still find (this process's /dev/shm regions) are removed: an endpoint that failed is
      // not closed, and its process is usually about to exit.
      log::info("libfabric: {} operation{} still held by provider {}: the endpoint is left open",
                held_, held_ == 1 ? "" : "s", provider_);
      auto kept = std::make_unique<left_open>();
      kept->objects = {&ep_.release()->fid, &av_.release()->fid, &cq_.release()->fid,
                       &domain_.release()->fid, &fabric_.release()->fid};
      kept->mrs = std::move(mrs_);
      kept->contexts = std::move(pool_);  // a deque moves its blocks: the addresses stay
      {
        std::lock_guard lock(left_open::mutex());
        left_open::all().push_back(std::move(kept));
      }
      remove_shm_regions(static_cast<long>(::getpid()));
      dog_.reset();
      return;
    }
    // Closing the endpoint ends every operation still posted; only then may the memory the
    // provider was using (registrations, contexts) go. Each close is watched, briefly: a close
    // that waits on a peer that stopped must not hold the process past its deadline.
    const auto close = [&](auto& h) {
      watched(
          dog_.get(), [&] { return h.reset(), 0; }, true);
    };
    close(ep_);
    watched(
        dog_.get(), [&] { return mrs_.reset(), 0; }, true);
    close(av_);
    close(cq_);
    close(domain_);
    close(fabric_);
    dog_.reset();
  }

  /// This endpoint's address, as the peers' fi_av_insert wants it.
  [[nodiscard]] std::vector<std::byte> name() const {
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
    char buf[endpoint_limits::address_text_bytes] = {};
    std::size_t len = sizeof(buf);
    if (!fi_av_straddr(av_.get(), name.data(), buf, &len)) return "?";
    return std::string(buf, ::strnlen(buf, sizeof(buf)));
  }

  /// Inserts every rank's name (index = world rank).
  void connect(const std::vector<std::vector<std::byte>>& names) {
    addrs_.assign(names.size(), FI_ADDR_NOTAVAIL);
    failures_.assign(names.size(), std::string());
    for (std::size_t r = 0; r < names.size(); ++r) {
      const int n = fi_av_insert(av_.get(), names[r].data(), 1, &addrs_[r], 0, nullptr);
      if (n != 1 || addrs_[r] == FI_ADDR_NOTAVAIL)
        throw transport_error(
            fmt::format("fi_av_insert of rank {}'s address failed on provider {}: {}", r, provider_,
                        n < 0 ? fi_text(n) : "not inserted"));
    }
  }

  /// Starts the watchdog (watchdog.hpp) over the ranks in `peers` (index = world rank); with
  /// a `board`, the ranks agree through it on which rank failed first.
  void watch(int rank, std::vector<process_id> peers,
             std::shared_ptr<failure_board> board = nullptr) {
    watchdog::config cfg;
    cfg.rank = rank;
    cfg.peers = std::move(peers);
    cfg.timeout = timeout_;
    cfg.board = std::move(board);
    dog_ = std::make_unique<watchdog>(std::move(cfg));
  }

  /// The world rank the watchdog found dead, or -1.
  [[nodiscard]] int failed_rank() const noexcept { return dog_ ? dog_->failed_rank() : -1; }
  /// World ranks on this host the watchdog finds stopped (SIGSTOP, a debugger), or none.
  [[nodiscard]] std::vector<int> stopped_ranks() const {
    return dog_ ? dog_->stopped_ranks() : std::vector<int>{};
  }
  [[nodiscard]] const watchdog* dog() const noexcept { return dog_.get(); }

  /// Fails every operation waiting on this endpoint, now and from now on, with `why`. Safe to
  /// call from any thread, without waiting for a thread that is inside a call.
  void abort(const std::string& why) { abort_.set(why); }
  [[nodiscard]] bool aborted() const noexcept { return abort_.is_set(); }
  /// What abort() was given (empty until it was called).
  [[nodiscard]] std::string abort_reason() const { return abort_.reason(); }

  [[nodiscard]] const std::string& provider() const noexcept { return provider_; }
  /// Tag bits above the algorithm's that this provider matches: room for communicator ids.
  [[nodiscard]] int comm_id_bits() const noexcept {
    return std::min(tag_width_ - tag_bits, tag_layout::comm_id_bits);
  }
  [[nodiscard]] int tag_width() const noexcept { return tag_width_; }
  [[nodiscard]] std::uint64_t mr_mode() const noexcept { return mr_mode_; }
  [[nodiscard]] std::size_t inject_size() const noexcept { return inject_size_; }
  [[nodiscard]] std::size_t max_message_size() const noexcept { return max_msg_size_; }
  [[nodiscard]] bool registers() const noexcept { return need_desc_; }
  /// Opened for device memory (config::device_memory) on a provider that reports FI_HMEM.
  /// Whether it can register CUDA memory in particular is known only once it tried: libfabric
  /// has no query for the HMEM interfaces it was built with.
  [[nodiscard]] bool hmem() const noexcept { return hmem_; }
  /// The provider registered CUDA memory at least once (register_device succeeded).
  [[nodiscard]] bool registered_cuda() const {
    std::lock_guard lock(mutex_);
    return registered_cuda_;
  }
  [[nodiscard]] std::size_t device_ranges() const {
    std::lock_guard lock(mutex_);
    return mrs_->device_ranges();
  }

  /// Registers [p, p+n) as memory of CUDA device `device` (fi_mr_regattr with FI_HMEM_CUDA):
  /// sends and receives inside it then pass that registration to the provider. Throws
  /// unsupported when the endpoint was not opened for device memory or the provider refuses.
  void register_device(const void* p, std::size_t n, int device) {
    if (n == 0) return;
    if (device < 0)
      throw invalid_argument(fmt::format("CUDA device ordinal {} is negative", device));
    if (!hmem_)
      throw unsupported(
          fmt::format("libfabric provider '{}' was opened for host memory only: set "
                      "libfabric::options::device_memory to pass CUDA device buffers",
                      provider_));
    std::lock_guard lock(mutex_);
    mrs_->register_device(p, n, device);
    registered_cuda_ = true;
  }
  [[nodiscard]] std::size_t registrations() const {
    std::lock_guard lock(mutex_);
    return mrs_->size();
  }
  void forget_memory(const void* p, std::size_t n) {
    std::lock_guard lock(mutex_);
    mrs_->forget(p, n);
  }

  /// Posts a tagged send; nullptr when it was injected (complete on return). A send beyond
  /// the flow-control limit waits in the endpoint and is posted as earlier ones complete.
  [[nodiscard]] op_context* send(int world_peer, int peer, std::uint64_t tag,
                                 std::span<const std::byte> data) {
    std::lock_guard lock(mutex_);
    check_aborted();
    check_size(data.size(), peer, "send to");
    const fi_addr_t to = addrs_[static_cast<std::size_t>(world_peer)];
    // Injecting past queued sends could reorder two messages with one tag.
    if (inject_size_ > 0 && data.size() <= inject_size_ && waiting_sends_.empty() &&
        !mrs_->is_device(data.data(), data.size())) {
      const ssize_t rc = watched(
          dog_.get(), [&] { return fi_tinject(ep_.get(), data.data(), data.size(), to, tag); });
      if (rc == 0) return nullptr;
      if (rc != -FI_EAGAIN) throw post_failed("send to", peer, rc);
    }
    op_context* c = make(world_peer, peer, true, data.size(), data.data());
    c->buffer = const_cast<std::byte*>(data.data());  // only read: fi_tsend takes const
    c->address = to;
    c->tag = tag;
    submit(c);
    return c;
  }

  [[nodiscard]] op_context* recv(int world_peer, int peer, std::uint64_t tag,
                                 std::span<std::byte> data) {
    std::lock_guard lock(mutex_);
    check_aborted();
    check_size(data.size(), peer, "receive from");
    op_context* c = make(world_peer, peer, false, data.size(), data.data());
    c->buffer = data.data();
    c->address = addrs_[static_cast<std::size_t>(world_peer)];
    c->tag = tag;
    submit(c);
    return c;
  }

  /// Operations handed to the provider and not yet complete, and those waiting to be.
  [[nodiscard]] std::size_t posted_operations() const {
    std::lock_guard lock(mutex_);
    return posted_sends_ + posted_recvs_;
  }
  [[nodiscard]] std::size_t waiting_operations() const {
    std::lock_guard lock(mutex_);
    return waiting_sends_.size() + waiting_recvs_.size();
  }
  [[nodiscard]] std::size_t send_limit() const noexcept { return send_cap_; }
  [[nodiscard]] std::size_t receive_limit() const noexcept { return recv_cap_; }

  /// Reads completions; true once c finished, and c is freed. When it throws, c is freed
  /// (or, if it could not be cancelled, left to the endpoint) too.
  [[nodiscard]] bool test(op_context* c) {
    std::lock_guard lock(mutex_);
    if (c->state == op_context::status::pending) progress_locked();
    switch (c->state) {
      case op_context::status::pending: {
        if (aborted()) {
          const int peer = c->peer;
          const bool is_send = c->is_send;
          abandon_locked(c);
          throw peer_error(fmt::format("the communicator was aborted ({}) while a {} rank {} was "
                                       "pending",
                                       abort_reason(), is_send ? "send to" : "receive from", peer),
                           -1);
        }
        // Waits on live ranks fail too: a collective with a dead member cannot finish. A
        // short delay first lets completions a rank sent just before it exited arrive.
        if (const int dead = failed_rank();
            dead >= 0 && dog_->failure_age_ms() >= settle_ms && dead != c->world_peer) {
          const int peer = c->peer;
          const bool is_send = c->is_send;
          abandon_locked(c);
          throw peer_error(fmt::format("rank {} died ({}); this rank was waiting for a {} rank {} "
                                       "over {}",
                                       dead, dog_->failure(), is_send ? "send to" : "receive from",
                                       peer, provider_),
                           dead);
        }
        const auto& dead = failures_[static_cast<std::size_t>(c->world_peer)];
        if (dead.empty() &&
            !(failed_rank() == c->world_peer && dog_->failure_age_ms() >= settle_ms))
          return false;
        if (dead.empty()) {
          const int peer = c->peer;
          std::string what =
              fmt::format("rank {} died ({}) during a {} it over {}", peer, dog_->failure(),
                          c->is_send ? "send to" : "receive from", provider_);
          abandon_locked(c);
          throw peer_error(what, peer);
        }
        const int peer = c->peer;
        // The ranks' verdict (failure_board) names who failed first; this peer may only have
        // gone down after it.
        if (const int first = failed_rank(); first >= 0 && first != c->world_peer) {
          std::string what = fmt::format(
              "rank {} died ({}); then this rank's {} rank {} failed over {}: {}", first,
              dog_->failure(), c->is_send ? "send to" : "receive from", peer, provider_, dead);
          abandon_locked(c);
          throw peer_error(what, first);
        }
        std::string what = fmt::format("rank {} is unreachable over {}: {}", peer, provider_, dead);
        abandon_locked(c);
        throw peer_error(what, peer);
      }
      case op_context::status::done:
        recycle(c);
        return true;
      case op_context::status::failed:
      case op_context::status::cancelled:
        break;
    }
    const std::string what = c->error;
    const bool lost = c->peer_loss;
    const bool cancelled = c->state == op_context::status::cancelled;
    const int peer = c->peer;
    recycle(c);
    if (cancelled) {
      // Only abandon() cancels, and it never hands the operation back: the provider cancelled
      // it, as rxm does when a connection closes. The closing is this rank's news of a death
      // somewhere; the watchdog says whose.
      const int dead = await_culprit();
      if (dead >= 0)
        throw peer_error(
            fmt::format("rank {} died ({}); provider {} then cancelled a pending operation ({})",
                        dead, dog_->failure(), provider_, what),
            dead);
      throw peer_error(fmt::format("{} by provider {} (its connection to rank {} closed: has it "
                                   "died?)",
                                   what, provider_, peer),
                       peer);
    }
    if (lost) throw peer_error(what, peer);
    throw transport_error(what);
  }

  void progress() {
    std::lock_guard lock(mutex_);
    progress_locked();
  }

  /// The request for c was destroyed before it completed: cancel it and wait for the
  /// provider to let go of its buffer. A receive is drained until the deadline (it is the
  /// one the provider would write into freed memory); a send, which only reads, briefly.
  /// An operation still pending after that is left to the endpoint, which frees its context
  /// when the completion arrives or the endpoint closes.
  void abandon(op_context* c) noexcept {
    std::lock_guard lock(mutex_);
    abandon_locked(c);
  }

 private:
  static constexpr std::int64_t settle_ms = 200;

  /// The world rank the watchdog found dead, waiting up to half a second for it to look: a
  /// failure seen first as a closed connection is named once the watchdog has probed.
  [[nodiscard]] int await_culprit() const {
    if (!dog_) return -1;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    int dead = dog_->failed_rank();
    while (dead < 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      dead = dog_->failed_rank();
    }
    return dead;
  }

  void check_aborted() const {
    if (aborted())
      throw peer_error(fmt::format("the communicator was aborted: {}", abort_reason()), -1);
  }

  /// Every posted or queued operation, for RINGZERO_DEBUG=INFO when a wait gives up.
  void log_pending() const {
    if (!log::enabled(log::level::info)) return;
    ringzero::detail::pending_report report;
    for (const op_context& o : pool_) {
      if (o.state != op_context::status::pending ||
          std::find(free_.begin(), free_.end(), &o) != free_.end())
        continue;
      report.add(o.is_send, o.peer, o.length, o.tag, o.world_peer,
                 o.posted ? "" : " (queued in the endpoint)");
    }
    log::info("libfabric: {} pending operations when a wait gave up:{}", report.count(),
              report.lines());
  }

  void abandon_locked(op_context* c) noexcept {
    if (c->state == op_context::status::pending && !c->posted) {
      // Still waiting in the endpoint: the provider never saw it.
      auto& queue = c->is_send ? waiting_sends_ : waiting_recvs_;
      queue.erase(std::remove(queue.begin(), queue.end(), c), queue.end());
      recycle(c);
      return;
    }
    if (c->state == op_context::status::pending) {
      if (!logged_pending_) {
        logged_pending_ = true;
        try {
          log_pending();
        } catch (...) {
          // Only a diagnostic: the cancellation below matters more.
        }
      }
      watched(dog_.get(), [&] { return fi_cancel(&ep_.get()->fid, c); });
      // Once a rank is dead or stopped, the communicator aborted, or an operation was already
      // given up on, operations that have not finished will not: drain briefly, so that the
      // error reaches the caller in time (a receive from a stopped peer that the provider had
      // matched, say, a rendezvous under way, cannot be cancelled, and waiting out the
      // deadline once for each would keep the caller for as many timeouts).
      const bool failing = aborted() || failed_rank() >= 0 || held_ > 0 ||
                           (dog_ && !dog_->stopped_ranks().empty()) ||
                           !failures_[static_cast<std::size_t>(c->world_peer)].empty();
      const auto limit =
          c->is_send || failing
              ? std::min(timeout_, std::chrono::nanoseconds(endpoint_limits::cancel_send_grace))
              : timeout_;
      const auto deadline = std::chrono::steady_clock::now() + limit;
      try {
        while (c->state == op_context::status::pending &&
               std::chrono::steady_clock::now() < deadline)
          progress_locked();
      } catch (const std::exception& e) {
        log::warn("libfabric: draining a cancelled operation failed: {}", e.what());
      }
      if (c->state == op_context::status::pending) {
        // One warning per endpoint: after a failure, every pending operation ends up here.
        if (orphans_++ == 0)
          log::warn(
              "libfabric: a {} rank {} could not be cancelled; its buffer, and those of any "
              "further operations that cannot be cancelled, must stay valid until the "
              "communicator is destroyed",
              c->is_send ? "send to" : "receive from", c->peer);
        else
          log::info("libfabric: a {} rank {} could not be cancelled either",
                    c->is_send ? "send to" : "receive from", c->peer);
        c->orphaned = true;
        ++held_;
        return;
      }
    }
    recycle(c);
  }

  void check_size(std::size_t bytes, int peer, const char* what) const {
    if (bytes > max_msg_size_)
      throw unsupported(
          fmt::format("a {} rank {} of {} bytes exceeds provider {}'s largest message ({} bytes); "
                      "use a smaller chunk_bytes",
                      what, peer, bytes, provider_, max_msg_size_));
  }

  [[nodiscard]] op_context* make(int world_peer, int peer, bool is_send, std::size_t length,
                                 const void* buf) {
    op_context* c;
    if (free_.empty()) {
      pool_.emplace_back();
      c = &pool_.back();
    } else {
      c = free_.back();
      free_.pop_back();
      *c = op_context{};
    }
    c->world_peer = world_peer;
    c->peer = peer;
    c->is_send = is_send;
    c->length = length;
    if ((need_desc_ || hmem_) && length > 0) {
      try {
        c->mr = mrs_->acquire(buf, length, need_desc_);
      } catch (...) {
        free_.push_back(c);
        throw;
      }
    }
    return c;
  }

  [[nodiscard]] static void* desc(op_context* c) noexcept { return c->mr ? c->mr->desc : nullptr; }

  void recycle(op_context* c) noexcept {
    if (c->mr) mrs_->release(c->mr);
    c->mr = nullptr;
    c->error.clear();
    free_.push_back(c);
  }

  void progress_locked() {
    fi_cq_tagged_entry done[endpoint_limits::completion_batch];
    for (;;) {
      const ssize_t n = watched(dog_.get(), [&] {
        return fi_cq_read(cq_.get(), done, endpoint_limits::completion_batch);
      });
      if (n > 0) {
        for (ssize_t i = 0; i < n; ++i)
          complete(static_cast<op_context*>(done[i].op_context), done[i].len);
        if (static_cast<std::size_t>(n) < endpoint_limits::completion_batch) break;
        continue;
      }
      if (n == -FI_EAGAIN) break;
      if (n == -FI_EAVAIL) {
        read_error();
        continue;
      }
      throw transport_error(
          fmt::format("fi_cq_read failed on provider {}: {}", provider_, fi_text(n)));
    }
    drain(waiting_recvs_, posted_recvs_, recv_cap_);
    drain(waiting_sends_, posted_sends_, send_cap_);
  }

  /// Queues c behind any waiting operation of its direction, then posts what fits. When c is
  /// first in line and only the provider refuses it (-FI_EAGAIN: shm maps a peer's region on
  /// the first message, rxm sets up a connection), progress and retry briefly before leaving
  /// it queued: a caller that posts a send and then waits elsewhere (on the store, say)
  /// expects the message to be on its way.
  void submit(op_context* c) {
    auto& queue = c->is_send ? waiting_sends_ : waiting_recvs_;
    auto& posted = c->is_send ? posted_sends_ : posted_recvs_;
    const std::size_t cap = c->is_send ? send_cap_ : recv_cap_;
    queue.push_back(c);
    drain(queue, posted, cap);
    if (queue.size() != 1 || queue.front() != c || posted >= cap) return;
    const auto until = std::chrono::steady_clock::now() + endpoint_limits::post_progress_window;
    try {
      while (!c->posted && c->state == op_context::status::pending &&
             std::chrono::steady_clock::now() < until)
        progress_locked();  // drains the queues too
    } catch (...) {
      if (!c->posted) {  // nobody holds c yet: the caller gets the exception, not a request
        queue.erase(std::remove(queue.begin(), queue.end(), c), queue.end());
        recycle(c);
      }
      throw;
    }
  }

  /// Posts waiting operations in order while the limit allows and the provider accepts them.
  /// A refusal (-FI_EAGAIN) leaves the rest for the next progress call; an error fails that
  /// operation alone, and its test() reports it.
  void drain(std::deque<op_context*>& queue, std::size_t& posted, std::size_t cap) {
    while (!queue.empty() && posted < cap) {
      op_context* c = queue.front();
      const ssize_t rc = watched(dog_.get(), [&] {
        return c->is_send
                   ? fi_tsend(ep_.get(), c->buffer, c->length, desc(c), c->address, c->tag, c)
                   : fi_trecv(ep_.get(), c->buffer, c->length, desc(c), c->address, c->tag, 0, c);
      });
      if (rc == -FI_EAGAIN) return;
      queue.pop_front();
      if (rc != 0) {
        c->state = op_context::status::failed;
        c->error = post_failed(c->is_send ? "send to" : "receive from", c->peer, rc).what();
        continue;
      }
      c->posted = true;
      ++posted;
    }
  }

  [[nodiscard]] transport_error post_failed(const char* what, int peer, ssize_t rc) const {
    return transport_error(fmt::format("posting a {} rank {} on provider {} failed: {}", what, peer,
                                       provider_, fi_text(rc)));
  }

  /// Bookkeeping for an operation the provider has finished with.
  void retire(op_context* c) noexcept {
    if (!c->posted) return;
    c->posted = false;
    --(c->is_send ? posted_sends_ : posted_recvs_);
  }

  /// An abandoned operation the provider has now given back.
  void release_orphan(op_context* c) noexcept {
    --held_;
    recycle(c);
  }

  void complete(op_context* c, std::size_t len) {
    retire(c);
    if (c->orphaned) return release_orphan(c);
    if (!c->is_send && len != c->length) {
      c->state = op_context::status::failed;
      c->error = fmt::format(
          "message size mismatch with rank {}: posted a {} byte receive, the "
          "peer sent {} bytes (ranks disagree on the collective's count or "
          "type?)",
          c->peer, c->length, len);
      return;
    }
    c->state = op_context::status::done;
  }

  void read_error() {
    fi_cq_err_entry err{};
    const ssize_t rc = watched(dog_.get(), [&] { return fi_cq_readerr(cq_.get(), &err, 0); });
    if (rc == -FI_EAGAIN) return;
    if (rc < 0)
      throw transport_error(
          fmt::format("fi_cq_readerr failed on provider {}: {}", provider_, fi_text(rc)));
    auto* c = static_cast<op_context*>(err.op_context);
    char buf[256] = {};
    const char* detail = fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data, buf, sizeof buf);
    const std::string text =
        fmt::format("{} (provider {} error {}: {})", fi_strerror(std::abs(err.err)), provider_,
                    err.prov_errno, detail ? detail : "");
    if (!c) {
      log::warn("libfabric: completion error without an operation: {}", text);
      return;
    }
    retire(c);
    if (c->orphaned) return release_orphan(c);
    // Providers disagree on the sign of err.
    const int code = err.err < 0 ? -err.err : err.err;
    if (code == FI_ECANCELED) {
      c->state = op_context::status::cancelled;
      c->error =
          fmt::format("{} rank {} was cancelled", c->is_send ? "send to" : "receive from", c->peer);
      return;
    }
    c->state = op_context::status::failed;
    if (code == FI_ETRUNC) {
      c->error = fmt::format(
          "message size mismatch with rank {}: posted a {} byte receive, the peer sent {} "
          "(ranks disagree on the collective's count or type?): {}",
          c->peer, c->length,
          err.olen ? fmt::format("{} bytes", c->length + err.olen) : std::string("more"), text);
      return;
    }
    c->peer_loss = true;
    c->error = fmt::format("{} rank {} failed over {}: {}", c->is_send ? "send to" : "receive from",
                           c->peer, provider_, text);
    if (is_peer_loss(code)) {
      failures_[static_cast<std::size_t>(c->world_peer)] = text;
      if (dog_) dog_->suspect(c->world_peer, fmt::format("its connection failed: {}", text));
    }
  }

  std::chrono::nanoseconds timeout_;
  info_ptr info_;
  std::string provider_;
  std::uint64_t mr_mode_ = 0;
  bool need_desc_ = false;
  bool hmem_ = false;
  bool registered_cuda_ = false;
  std::size_t inject_size_ = 0;
  std::size_t max_msg_size_ = 0;
  int tag_width_ = 64;
  handle<fid_fabric> fabric_;
  handle<fid_domain> domain_;
  handle<fid_cq> cq_;
  handle<fid_av> av_;
  handle<fid_ep> ep_;
  std::unique_ptr<mr_cache> mrs_;
  std::vector<fi_addr_t> addrs_;
  std::vector<std::string> failures_;  ///< why a world rank is known unreachable, or empty
  mutable std::mutex mutex_;
  std::deque<op_context> pool_;  ///< stable addresses: the provider holds pointers
  std::deque<op_context*> waiting_sends_;
  std::deque<op_context*> waiting_recvs_;
  std::size_t posted_sends_ = 0;
  std::size_t posted_recvs_ = 0;
  std::size_t send_cap_ = endpoint_limits::default_send_cap;
  std::size_t recv_cap_ = endpoint_limits::default_recv_cap;
  std::vector<op_context*> free_;
  bool logged_pending_ = false;
  std::size_t orphans_ = 0;
  std::size_t held_ = 0;  ///< orphaned operations the provider has not given back
  ringzero::detail::abort_state abort_;
  // Last: stopped first, before anything it watches goes.
  std::unique_ptr<watchdog> dog_;
};

}  // namespace ringzero::libfabric::detail
