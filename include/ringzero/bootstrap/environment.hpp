// Where this process sits in the job, read from whatever started it: ringzero-run or torchrun
// (RANK, WORLD_SIZE, ...), Open MPI's mpirun (OMPI_COMM_WORLD_*), Slurm's srun (SLURM_*), or
// nothing at all (a single rank). The result says which rank this is and where rank 0's store
// listens, so every rank can rendezvous without further configuration.
//
// Precedence, first match wins:
//   1. RANK / WORLD_SIZE (ringzero-run, torchrun, or set by hand) — a launcher started inside
//      an allocation sets these for its own ranks, so they beat anything inherited;
//   2. OMPI_COMM_WORLD_RANK / _SIZE — checked before Slurm because mpirun inside a Slurm
//      allocation starts its daemons with srun, and its ranks inherit SLURM_* variables that
//      describe those daemons, not the ranks;
//   3. SLURM_PROCID with a job step (SLURM_STEP_ID) — a task of srun; a batch script, which has
//      no step of its own, is a single rank;
//   4. none: a single rank, world size 1.
//
// Malformed values raise invalid_argument and inconsistent or missing ones bootstrap_error,
// each naming the variable, so a typo in a job script fails at startup.
#pragma once

#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"

namespace ringzero::bootstrap {

struct launch_info {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  ///< rank among the processes on this host
  int local_size = 1;  ///< processes on this host
  /// Where rank 0's store listens. A single rank gets 127.0.0.1 and port 0 (any free port).
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  /// Identifies the job to its store: RINGZERO_TOKEN if set (ringzero-run sets a random one),
  /// else derived from the launcher's job id. Without RINGZERO_TOKEN it keeps jobs apart but
  /// is not a secret.
  std::string token;
  /// "ringzero-run", "torchrun", "openmpi", "slurm" or "single".
  std::string launcher = "single";
};

/// Ports derived for Slurm jobs (and single-node Open MPI jobs) without MASTER_PORT lie in
/// [derived_port_first, derived_port_first + derived_port_count): below Linux's ephemeral
/// range, so the kernel never hands them out to outgoing connections.
inline constexpr int derived_port_first = 20000;
inline constexpr int derived_port_count = 10000;

/// The derived port of a job and step: consecutive jobs and steps get different ports, so jobs
/// that share a first node do not collide unless 625 job ids apart.
[[nodiscard]] constexpr int derived_port(std::uint64_t job, std::uint64_t step) noexcept {
  return derived_port_first + static_cast<int>((job * 16 + step) % derived_port_count);
}

/// Expands a Slurm hostlist such as "node[01-04,07],gpu5" to node01 node02 node03 node04
/// node07 gpu5. Several bracket groups in one name multiply out ("r[1-2]n[1-2]" is r1n1 r1n2
/// r2n1 r2n2); numbers keep the zero padding of the range's first bound. Throws
/// invalid_argument on malformed input or more than `max_hosts` names.
[[nodiscard]] std::vector<std::string> expand_hostlist(std::string_view list,
                                                       std::size_t max_hosts = 1 << 20);

/// Reads the environment as described at the top of this file.
[[nodiscard]] launch_info detect_launch();

namespace detail {

[[nodiscard]] inline std::string random_token() {
  std::random_device rd;
  std::string t;
  for (int i = 0; i < 4; ++i) t += fmt::format("{:08x}", rd());
  return t;
}

// Splits at commas outside brackets.
[[nodiscard]] inline std::vector<std::string_view> split_top_level(std::string_view s) {
  std::vector<std::string_view> out;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '[')
      ++depth;
    else if (s[i] == ']')
      --depth;
    else if (s[i] == ',' && depth == 0) {
      out.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  out.push_back(s.substr(start));
  return out;
}

[[nodiscard]] inline bool all_digits(std::string_view s) noexcept {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

// The names one bracket body ("01-04,07") stands for.
[[nodiscard]] inline std::vector<std::string> expand_ranges(std::string_view body,
                                                            std::string_view list,
                                                            std::size_t max_hosts) {
  auto bad = [&](std::string_view why) {
    return invalid_argument(fmt::format("malformed hostlist '{}': {}", list, why));
  };
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= body.size()) {
    std::size_t end = body.find(',', start);
    if (end == std::string_view::npos) end = body.size();
    const std::string_view r = body.substr(start, end - start);
    const std::size_t dash = r.find('-');
    const std::string_view lo = r.substr(0, dash);
    const std::string_view hi = dash == std::string_view::npos ? lo : r.substr(dash + 1);
    if (!all_digits(lo) || !all_digits(hi) || lo.size() > 18 || hi.size() > 18)
      throw bad(fmt::format("'[{}]' is not a list of numbers and ranges", body));
    const unsigned long long a = std::stoull(std::string(lo));
    const unsigned long long b = std::stoull(std::string(hi));
    if (b < a) throw bad(fmt::format("range '{}' runs backwards", r));
    if (b - a >= max_hosts || out.size() + (b - a) >= max_hosts)
      throw bad(fmt::format("more than {} hosts", max_hosts));
    for (unsigned long long v = a; v <= b; ++v) out.push_back(fmt::format("{:0{}}", v, lo.size()));
    start = end + 1;
  }
  return out;
}

}  // namespace detail

inline std::vector<std::string> expand_hostlist(std::string_view list, std::size_t max_hosts) {
  auto bad = [&](std::string_view why) {
    return invalid_argument(fmt::format("malformed hostlist '{}': {}", list, why));
  };
  std::vector<std::string> hosts;
  for (const std::string_view item : detail::split_top_level(list)) {
    if (item.empty()) throw bad("empty host name");
    std::vector<std::string> names{std::string()};
    std::size_t i = 0;
    while (i < item.size()) {
      if (item[i] == ']') throw bad("']' without '['");
      if (item[i] != '[') {
        const std::size_t next = item.find_first_of("[]", i);
        const std::string_view text = item.substr(i, next - i);
        for (auto& n : names) n += text;
        i = next == std::string_view::npos ? item.size() : next;
        continue;
      }
      const std::size_t close = item.find(']', i);
      if (close == std::string_view::npos) throw bad("'[' without ']'");
      const std::string_view body = item.substr(i + 1, close - i - 1);
      if (body.find('[') != std::string_view::npos) throw bad("nested '['");
      const auto alts = detail::expand_ranges(body, list, max_hosts);
      if (names.size() * alts.size() > max_hosts)
        throw bad(fmt::format("more than {} hosts", max_hosts));
      std::vector<std::string> next;
      next.reserve(names.size() * alts.size());
      for (const auto& n : names)
        for (const auto& a : alts) next.push_back(n + a);
      names = std::move(next);
      i = close + 1;
    }
    if (hosts.size() + names.size() > max_hosts)
      throw bad(fmt::format("more than {} hosts", max_hosts));
    hosts.insert(hosts.end(), names.begin(), names.end());
  }
  return hosts;
}

namespace detail {

// The variables one launcher uses, for reading and for error messages.
struct launch_vars {
  const char* launcher;
  const char* rank;
  const char* world;
  const char* local_rank;
  const char* local_size;
};

[[nodiscard]] inline std::optional<int> env_int32(const char* name) {
  const auto v = ringzero::detail::getenv_int(name);
  if (!v) return std::nullopt;
  if (*v < -2147483647LL || *v > 2147483647LL)
    throw invalid_argument(fmt::format("{}={} is out of range", name, *v));
  return static_cast<int>(*v);
}

[[nodiscard]] inline int require_int(const char* name, const char* launcher) {
  const auto v = env_int32(name);
  if (!v)
    throw bootstrap_error(fmt::format("{} launch detected, but {} is not set", launcher, name));
  return *v;
}

inline void check_consistent(const launch_info& li, const launch_vars& v) {
  if (li.world_size < 1)
    throw bootstrap_error(fmt::format("{}={} must be at least 1", v.world, li.world_size));
  if (li.rank < 0 || li.rank >= li.world_size)
    throw bootstrap_error(
        fmt::format("{}={} is not in [0, {}={})", v.rank, li.rank, v.world, li.world_size));
  if (li.local_size < 1 || li.local_size > li.world_size)
    throw bootstrap_error(fmt::format("{}={} is not in [1, {}={}]", v.local_size, li.local_size,
                                      v.world, li.world_size));
  if (li.local_rank < 0 || li.local_rank >= li.local_size)
    throw bootstrap_error(fmt::format("{}={} is not in [0, {}={})", v.local_rank, li.local_rank,
                                      v.local_size, li.local_size));
}

// MASTER_ADDR and MASTER_PORT: both or neither. Returns false if neither is set.
[[nodiscard]] inline bool read_master(launch_info& li, const char* launcher) {
  const auto addr = ringzero::detail::getenv_str("MASTER_ADDR");
  const auto port = env_int32("MASTER_PORT");
  if (!addr && !port) return false;
  if (!addr)
    throw bootstrap_error(
        fmt::format("{} launch: MASTER_PORT is set but MASTER_ADDR is not", launcher));
  if (!port)
    throw bootstrap_error(
        fmt::format("{} launch: MASTER_ADDR is set but MASTER_PORT is not", launcher));
  if (*port < 1 || *port > 65535)
    throw invalid_argument(fmt::format("MASTER_PORT={} is not a TCP port (1-65535)", *port));
  li.master_addr = *addr;
  li.master_port = *port;
  return true;
}

[[nodiscard]] inline std::uint64_t fnv1a(std::string_view s) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

[[nodiscard]] inline launch_info detect_torchrun() {
  constexpr launch_vars v{"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  launch_info li;
  const bool ours = ringzero::detail::getenv_str("RINGZERO_LAUNCHER") == "ringzero-run";
  li.launcher = ours ? "ringzero-run" : "torchrun";
  li.rank = require_int(v.rank, v.launcher);
  li.world_size = require_int(v.world, v.launcher);
  const auto local_rank = env_int32(v.local_rank);
  const auto local_size = env_int32(v.local_size);
  if (local_rank.has_value() != local_size.has_value())
    throw bootstrap_error(fmt::format("{} is set but {} is not",
                                      local_rank ? v.local_rank : v.local_size,
                                      local_rank ? v.local_size : v.local_rank));
  // Set by hand without local variables: assume one rank per host, which is never wrong for
  // correctness (it only forgoes intra-host shortcuts).
  li.local_rank = local_rank.value_or(0);
  li.local_size = local_size.value_or(1);
  check_consistent(li, v);
  if (!read_master(li, v.launcher) && li.world_size > 1)
    throw bootstrap_error(
        "RANK and WORLD_SIZE are set, but MASTER_ADDR and MASTER_PORT (rank 0's host and a free "
        "port) are not");
  const auto token = ringzero::detail::getenv_str("RINGZERO_TOKEN");
  li.token =
      token ? *token
            : "torchrun:" + ringzero::detail::getenv_str("TORCHELASTIC_RUN_ID").value_or("none");
  return li;
}

[[nodiscard]] inline launch_info detect_openmpi() {
  constexpr launch_vars v{"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
  launch_info li;
  li.launcher = "openmpi";
  li.rank = require_int(v.rank, v.launcher);
  li.world_size = require_int(v.world, v.launcher);
  li.local_rank = require_int(v.local_rank, v.launcher);
  li.local_size = require_int(v.local_size, v.launcher);
  check_consistent(li, v);
  const std::string job =
      ringzero::detail::getenv_str("OMPI_MCA_ess_base_jobid")
          .value_or(ringzero::detail::getenv_str("PMIX_NAMESPACE").value_or(""));
  if (!read_master(li, v.launcher) && li.world_size > 1) {
    if (li.local_size != li.world_size || job.empty())
      throw bootstrap_error(
          "started by Open MPI's mpirun across several hosts, but MASTER_ADDR and MASTER_PORT "
          "are not set: set them to rank 0's host and a free port, and pass them to every rank "
          "(mpirun -x MASTER_ADDR -x MASTER_PORT ...)");
    // All ranks share this host: rendezvous on loopback at a port derived from the job id.
    li.master_addr = "127.0.0.1";
    li.master_port = derived_port(fnv1a(job), 0);
  }
  const auto token = ringzero::detail::getenv_str("RINGZERO_TOKEN");
  li.token = token ? *token : "ompi:" + job;
  return li;
}

// SLURM_STEP_TASKS_PER_NODE ("2(x3),1": two tasks on each of three nodes, then one).
[[nodiscard]] inline std::vector<int> parse_tasks_per_node(const char* name, std::string_view s) {
  auto bad = [&] {
    return invalid_argument(
        fmt::format("{}='{}' is not a list like '4(x2),3'", name, std::string(s)));
  };
  std::vector<int> out;
  for (std::string_view item : split_top_level(s)) {
    std::size_t paren = item.find('(');
    const std::string_view count = item.substr(0, paren);
    long long repeat = 1;
    if (paren != std::string_view::npos) {
      if (item.size() < paren + 4 || item.substr(paren, 2) != "(x" || item.back() != ')')
        throw bad();
      const std::string_view r = item.substr(paren + 2, item.size() - paren - 3);
      if (!all_digits(r) || r.size() > 9) throw bad();
      repeat = std::stoll(std::string(r));
    }
    if (!all_digits(count) || count.size() > 9 || repeat < 1 || repeat > (1 << 20)) throw bad();
    out.insert(out.end(), static_cast<std::size_t>(repeat), std::stoi(std::string(count)));
    if (out.size() > (1u << 20)) throw bad();
  }
  return out;
}

[[nodiscard]] inline std::optional<long long> slurm_step() {
  auto step = ringzero::detail::getenv_int("SLURM_STEP_ID");
  if (!step) step = ringzero::detail::getenv_int("SLURM_STEPID");
  // Slurm's special steps (batch script, extern, interactive) use ids near 2^32.
  if (step && (*step < 0 || *step >= 0xfffffff0LL)) return std::nullopt;
  return step;
}

[[nodiscard]] inline launch_info detect_slurm(long long step) {
  using ringzero::detail::getenv_str;
  const auto tpn = getenv_str("SLURM_STEP_TASKS_PER_NODE");
  const launch_vars v{"Slurm", "SLURM_PROCID",
                      getenv_str("SLURM_NTASKS") ? "SLURM_NTASKS" : "SLURM_NPROCS", "SLURM_LOCALID",
                      tpn ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_NTASKS_PER_NODE"};
  launch_info li;
  li.launcher = "slurm";
  li.rank = require_int(v.rank, v.launcher);
  li.world_size = require_int(v.world, v.launcher);
  li.local_rank = require_int(v.local_rank, v.launcher);

  if (tpn) {
    const auto per_node = parse_tasks_per_node("SLURM_STEP_TASKS_PER_NODE", *tpn);
    long long total = 0;
    for (int n : per_node) total += n;
    if (total != li.world_size)
      throw bootstrap_error(
          fmt::format("SLURM_STEP_TASKS_PER_NODE='{}' adds up to {} tasks, but "
                      "{}={}",
                      *tpn, total, v.world, li.world_size));
    const auto node = env_int32("SLURM_NODEID");
    bool uniform = true;
    for (int n : per_node) uniform = uniform && n == per_node[0];
    if (node) {
      if (*node < 0 || static_cast<std::size_t>(*node) >= per_node.size())
        throw bootstrap_error(
            fmt::format("SLURM_NODEID={} is not one of the {} nodes of "
                        "SLURM_STEP_TASKS_PER_NODE='{}'",
                        *node, per_node.size(), *tpn));
      li.local_size = per_node[static_cast<std::size_t>(*node)];
    } else if (uniform) {
      li.local_size = per_node[0];
    } else {
      throw bootstrap_error(
          fmt::format("SLURM_STEP_TASKS_PER_NODE='{}' differs between nodes "
                      "and SLURM_NODEID is not set",
                      *tpn));
    }
  } else if (auto n = env_int32("SLURM_NTASKS_PER_NODE")) {
    li.local_size = *n;
  } else {
    throw bootstrap_error(
        "Slurm launch detected, but neither SLURM_STEP_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE "
        "is set");
  }
  check_consistent(li, v);

  const auto job = ringzero::detail::getenv_int("SLURM_JOB_ID");
  if (!read_master(li, v.launcher)) {
    const char* list_var = nullptr;
    std::optional<std::string> list;
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})
      if ((list = ringzero::detail::getenv_str(name))) {
        list_var = name;
        break;
      }
    if (!list)
      throw bootstrap_error(
          "Slurm launch detected, but no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) "
          "and no MASTER_ADDR is set");
    try {
      li.master_addr = expand_hostlist(*list).front();
    } catch (const invalid_argument& e) {
      throw invalid_argument(fmt::format("{}: {}", list_var, e.what()));
    }
    if (!job)
      throw bootstrap_error(
          "Slurm launch detected, but neither MASTER_PORT nor SLURM_JOB_ID is set");
    li.master_port =
        derived_port(static_cast<std::uint64_t>(*job), static_cast<std::uint64_t>(step));
  }
  const auto token = ringzero::detail::getenv_str("RINGZERO_TOKEN");
  li.token = token ? *token : fmt::format("slurm:{}.{}", job.value_or(0), step);
  return li;
}

}  // namespace detail

inline launch_info detect_launch() {
  using ringzero::detail::getenv_str;
  if (getenv_str("RANK") || getenv_str("WORLD_SIZE")) return detail::detect_torchrun();
  if (getenv_str("OMPI_COMM_WORLD_RANK") || getenv_str("OMPI_COMM_WORLD_SIZE"))
    return detail::detect_openmpi();
  if (getenv_str("SLURM_PROCID"))
    if (const auto step = detail::slurm_step()) return detail::detect_slurm(*step);
  launch_info li;
  li.token = getenv_str("RINGZERO_TOKEN").value_or(detail::random_token());
  return li;
}

/// This process's rank among the processes of its host, as its launcher gave it: LOCAL_RANK
/// (ringzero-run, its elastic arrivals included, and torchrun), OMPI_COMM_WORLD_LOCAL_RANK
/// (mpirun) or SLURM_LOCALID (srun); nothing when none is set. Read on its own, not through
/// detect_launch(): an elastic arrival has a local rank but no RANK. A negative value is refused.
[[nodiscard]] inline std::optional<int> local_rank_from_env() {
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"})
    if (const auto v = detail::env_int32(name)) {
      if (*v < 0) throw invalid_argument(fmt::format("{}={} is negative", name, *v));
      return v;
    }
  return std::nullopt;
}

/// Whether a launched rank whose program names no transport should take ringzero's socket
/// transport rather than libfabric: its job spans hosts (fewer of its ranks on this host than in
/// all) and nothing asks for libfabric (FI_PROVIDER unset, and `libfabric_asked` false: the
/// caller's own reasons, such as a provider named, device buffers or an EFA NIC present).
/// Between hosts the socket transport fills every rail where libfabric's tcp;ofi_rxm reaches
/// about half of one (docs/performance.md, "Between hosts"). ringzero-perf and ringzero-gpt
/// decide with it.
[[nodiscard]] inline bool prefer_socket_between_hosts(const launch_info& info,
                                                      bool libfabric_asked) {
  return info.world_size > 1 && info.local_size < info.world_size && !libfabric_asked &&
         !ringzero::detail::getenv_str("FI_PROVIDER").has_value();
}

}  // namespace ringzero::bootstrap
