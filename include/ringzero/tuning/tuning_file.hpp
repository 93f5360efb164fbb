// Measured cost-model constants: the file `ringzero-perf --tune` writes and RINGZERO_TUNING
// names. Every transport ships defaults (tuning/defaults.hpp, each with its source); a tuning
// file replaces them with what this machine measured, one section per transport:
//
//   # ringzero tuning file (ringzero-perf --tune); seconds per message, per byte, per byte reduced
//   version = 1
//
//   [shm]
//   measured = 2 ranks on host-a, 2026-11-25 04:50 UTC, ringzero 0.1.0
//   alpha = 4.12e-07
//   beta = 1.31e-10
//   gamma = 9.1e-11
//   one_phase_bytes = 16384
//   one_phase_ranks = 2
//
// Sections are named by the transport's tuning_name(): "loopback", "shm", "libfabric:<provider>"
// ("libfabric:shm", "libfabric:tcp;ofi_rxm"). Whole-line comments start with '#'.
//
// The cost model must give every rank the same prices, or ranks pick different algorithms and
// deadlock; agree_tuning() makes the ranks compare what they read before any collective runs.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "ringzero/detail/agreement.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange_records.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"

namespace ringzero::tuning {

/// The format version this ringzero writes and reads.
inline constexpr int tuning_file_version = 1;

/// One transport's constants. Unset fields keep the transport's defaults.
struct tuning_section {
  std::string name{};
  std::optional<double> alpha{};
  std::optional<double> beta{};
  std::optional<double> gamma{};
  std::optional<std::size_t> chunk_bytes{};
  /// policy::one_phase_bytes and the world size it was measured at (policy::one_phase_ranks);
  /// a file sets both or neither.
  std::optional<std::size_t> one_phase_bytes{};
  std::optional<int> one_phase_ranks{};
  /// Free text: the ranks, host and date the values were measured with.
  std::string measured{};

  /// `p` with this section's values in place of its own.
  [[nodiscard]] tuning::policy apply(tuning::policy p) const {
    if (alpha) p.alpha = *alpha;
    if (beta) p.beta = *beta;
    if (gamma) p.gamma = *gamma;
    if (chunk_bytes) p.chunk_bytes = *chunk_bytes;
    if (one_phase_bytes) p.one_phase_bytes = *one_phase_bytes;
    if (one_phase_ranks) p.one_phase_ranks = *one_phase_ranks;
    return p;
  }
};

struct tuning_file {
  int version = tuning_file_version;
  std::vector<tuning_section> sections;

  [[nodiscard]] const tuning_section* find(std::string_view name) const {
    for (const auto& s : sections)
      if (s.name == name) return &s;
    return nullptr;
  }
  /// Replaces the section of that name, or appends it.
  void put(tuning_section s) {
    for (auto& mine : sections)
      if (mine.name == s.name) {
        mine = std::move(s);
        return;
      }
    sections.push_back(std::move(s));
  }
};

namespace detail {

[[nodiscard]] inline std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string_view::npos) return {};
  const auto e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

/// A number as format_tuning writes it, and as people type it: decimal or exponent notation.
[[nodiscard]] inline std::optional<double> parse_double(std::string_view v) {
  double x = 0;
  const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc{} || p != v.data() + v.size() || v.empty()) return std::nullopt;
  return x;
}

}  // namespace detail

/// Parses the text of a tuning file. `file` names it in errors: invalid_argument naming the file,
/// the line and what is wrong with it.
[[nodiscard]] inline tuning_file parse_tuning(std::string_view text, std::string_view file) {
  tuning_file out;
  bool have_version = false;
  tuning_section* current = nullptr;
  int current_line = 0;
  int line_no = 0;
  const auto fail = [&](int line, const std::string& what) {
    return invalid_argument(fmt::format("tuning file {}: line {}: {}", file, line, what));
  };
  const auto close_section = [&] {
    if (!current) return;
    if (!current->alpha && !current->beta && !current->gamma && !current->chunk_bytes &&
        !current->one_phase_bytes)
      throw fail(current_line,
                 fmt::format("section [{}] sets none of alpha, beta, gamma, chunk_bytes, "
                             "one_phase_bytes",
                             current->name));
    if (current->one_phase_bytes.has_value() != current->one_phase_ranks.has_value())
      throw fail(current_line,
                 fmt::format("section [{}] sets one of one_phase_bytes and one_phase_ranks; the "
                             "limit holds at the world size it was measured at, so both or neither",
                             current->name));
  };
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t nl = text.find('\n', pos);
    const std::string_view raw =
        text.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    pos = nl == std::string_view::npos ? text.size() + 1 : nl + 1;
    ++line_no;
    const std::string_view line = detail::trim(raw);
    if (line.empty() || line.front() == '#') continue;
    if (line.front() == '[') {
      if (line.back() != ']')
        throw fail(line_no,
                   fmt::format("'{}' opens a section but does not close it with ']'", line));
      if (!have_version) throw fail(line_no, "a section before the 'version = 1' line");
      const std::string name(detail::trim(line.substr(1, line.size() - 2)));
      if (name.empty()) throw fail(line_no, "a section without a name ('[]')");
      close_section();
      if (out.find(name)) throw fail(line_no, fmt::format("section [{}] appears twice", name));
      out.sections.push_back(tuning_section{.name = name});
      current = &out.sections.back();
      current_line = line_no;
      continue;
    }
    const auto eq = line.find('=');
    if (eq == std::string_view::npos)
      throw fail(line_no,
                 fmt::format("'{}' is neither 'key = value', '[section]' nor a comment", line));
    const std::string_view key = detail::trim(line.substr(0, eq));
    const std::string_view value = detail::trim(line.substr(eq + 1));
    if (key == "version") {
      if (have_version || current)
        throw fail(line_no, "'version' must come once, before every section");
      const auto v = detail::parse_double(value);
      if (!v || *v != std::floor(*v))
        throw fail(line_no, fmt::format("version '{}' is not an integer", value));
      if (*v != tuning_file_version)
        throw fail(line_no, fmt::format("version {} is not the version this ringzero reads ({})",
                                        value, tuning_file_version));
      have_version = true;
      continue;
    }
    if (!current)
      throw fail(line_no, fmt::format("'{}' outside a section (start one with [transport])", key));
    if (key == "measured") {
      current->measured = std::string(value);
      continue;
    }
    const auto set_once = [&](auto& field, auto x) {
      if (field) throw fail(line_no, fmt::format("'{}' is set twice in [{}]", key, current->name));
      field = x;
    };
    if (key == "alpha" || key == "beta" || key == "gamma") {
      const auto x = detail::parse_double(value);
      if (!x) throw fail(line_no, fmt::format("{} = '{}' is not a number", key, value));
      // Seconds per message or per byte: a second per byte is a hundred years a gigabyte.
      const bool positive = key == "beta";
      if (!std::isfinite(*x) || *x < 0 || (positive && *x == 0) || *x >= 1)
        throw fail(line_no, fmt::format("{} = {} is outside {} 1) seconds", key, value,
                                        positive ? "(0," : "[0,"));
      set_once(key == "alpha"  ? current->alpha
               : key == "beta" ? current->beta
                               : current->gamma,
               *x);
      continue;
    }
    if (key == "chunk_bytes" || key == "one_phase_bytes" || key == "one_phase_ranks") {
      std::size_t n = 0;
      const auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
      // A world size fits an int; a byte count of 2^62 is already absurd.
      const std::size_t most =
          key == "one_phase_ranks" ? std::size_t{1} << 30 : std::size_t{1} << 62;
      if (ec != std::errc{} || p != value.data() + value.size() || value.empty() || n == 0)
        throw fail(line_no, fmt::format("{} = '{}' is not a positive integer", key, value));
      if (n > most) throw fail(line_no, fmt::format("{} = {} is more than {}", key, n, most));
      if (key == "chunk_bytes")
        set_once(current->chunk_bytes, n);
      else if (key == "one_phase_bytes")
        set_once(current->one_phase_bytes, n);
      else
        set_once(current->one_phase_ranks, static_cast<int>(n));
      continue;
    }
    throw fail(line_no, fmt::format("unknown key '{}' (expected alpha, beta, gamma, chunk_bytes, "
                                    "one_phase_bytes, one_phase_ranks or measured)",
                                    key));
  }
  close_section();
  if (!have_version) throw fail(line_no, "no 'version = 1' line: is this a ringzero tuning file?");
  return out;
}

/// The text of `f`, as parse_tuning reads it back: numbers with 17 significant digits, so every
/// reader gets the same doubles.
[[nodiscard]] inline std::string format_tuning(const tuning_file& f) {
  std::string s =
      "# ringzero tuning file (ringzero-perf --tune): alpha in seconds per message, beta in\n"
      "# seconds per byte, gamma in seconds per byte reduced. Used where RINGZERO_TUNING names "
      "it.\n";
  s += fmt::format("version = {}\n", f.version);
  for (const auto& sec : f.sections) {
    s += fmt::format("\n[{}]\n", sec.name);
    if (!sec.measured.empty()) s += fmt::format("measured = {}\n", sec.measured);
    if (sec.alpha) s += fmt::format("alpha = {:.17g}\n", *sec.alpha);
    if (sec.beta) s += fmt::format("beta = {:.17g}\n", *sec.beta);
    if (sec.gamma) s += fmt::format("gamma = {:.17g}\n", *sec.gamma);
    if (sec.chunk_bytes) s += fmt::format("chunk_bytes = {}\n", *sec.chunk_bytes);
    if (sec.one_phase_bytes) s += fmt::format("one_phase_bytes = {}\n", *sec.one_phase_bytes);
    if (sec.one_phase_ranks) s += fmt::format("one_phase_ranks = {}\n", *sec.one_phase_ranks);
  }
  return s;
}

/// Reads and parses the file at `path`; invalid_argument naming it when it cannot be read.
[[nodiscard]] inline tuning_file read_tuning(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw invalid_argument(
        fmt::format("tuning file {}: cannot open it: {}", path, std::strerror(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw invalid_argument(fmt::format("tuning file {}: cannot read it", path));
  return parse_tuning(text.str(), path);
}

/// Writes `f` to `path` through a temporary file renamed over it, so a reader never sees half a
/// file.
inline void write_tuning(const std::string& path, const tuning_file& f) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << format_tuning(f);
    out.flush();
    if (!out)
      throw invalid_argument(
          fmt::format("tuning file {}: cannot write {}: {}", path, tmp, std::strerror(errno)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw invalid_argument(
        fmt::format("tuning file {}: cannot replace it: {}", path, std::strerror(e)));
  }
}

/// What one rank made of RINGZERO_TUNING for its transport.
struct tuning_outcome {
  enum class kind : std::uint8_t { applied, no_section, failed };
  kind what = kind::no_section;
  tuning::policy values{};
  std::string error;  ///< why, when failed
};

/// Reads `path` and applies its section `section` over `defaults`. Never throws: a failure is
/// reported in the outcome so that the ranks can agree on it first (agree_tuning).
[[nodiscard]] inline tuning_outcome load_tuning(const std::string& path, std::string_view section,
                                                const tuning::policy& defaults) {
  tuning_outcome o;
  o.values = defaults;
  try {
    const tuning_file f = read_tuning(path);
    if (const tuning_section* s = f.find(section)) {
      o.what = tuning_outcome::kind::applied;
      o.values = s->apply(defaults);
    }
  } catch (const std::exception& e) {
    o.what = tuning_outcome::kind::failed;
    o.error = e.what();
    // The error is thrown again by agree_tuning, which adds its own prefix.
    constexpr std::string_view prefix = "ringzero: ";
    if (o.error.starts_with(prefix)) o.error.erase(0, prefix.size());
  }
  return o;
}

namespace detail {

/// What ranks exchange to agree: the outcome in a fixed-size record.
struct tuning_record {
  std::uint8_t what = 0;
  std::array<char, 7> pad{};
  double alpha = 0;
  double beta = 0;
  double gamma = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint64_t one_phase_bytes = 0;
  std::int64_t one_phase_ranks = 0;
  std::array<char, 464> error{};
};

[[nodiscard]] inline tuning_record record_of(const tuning_outcome& o) {
  tuning_record r;
  r.what = static_cast<std::uint8_t>(o.what);
  r.alpha = o.values.alpha;
  r.beta = o.values.beta;
  r.gamma = o.values.gamma;
  r.chunk_bytes = o.values.chunk_bytes;
  r.one_phase_bytes = o.values.one_phase_bytes;
  r.one_phase_ranks = o.values.one_phase_ranks;
  std::memcpy(r.error.data(), o.error.data(), std::min(o.error.size(), r.error.size() - 1));
  return r;
}

[[nodiscard]] inline bool same_values(const tuning_record& a, const tuning_record& b) {
  return a.what == b.what && std::memcmp(&a.alpha, &b.alpha, sizeof a.alpha) == 0 &&
         std::memcmp(&a.beta, &b.beta, sizeof a.beta) == 0 &&
         std::memcmp(&a.gamma, &b.gamma, sizeof a.gamma) == 0 && a.chunk_bytes == b.chunk_bytes &&
         a.one_phase_bytes == b.one_phase_bytes && a.one_phase_ranks == b.one_phase_ranks;
}

[[nodiscard]] inline std::string describe(const tuning_record& r) {
  switch (static_cast<tuning_outcome::kind>(r.what)) {
    case tuning_outcome::kind::applied:
      return fmt::format(
          "alpha {:.6g}, beta {:.6g}, gamma {:.6g}, chunk_bytes {}, one_phase_bytes {} at {} ranks",
          r.alpha, r.beta, r.gamma, r.chunk_bytes, r.one_phase_bytes, r.one_phase_ranks);
    case tuning_outcome::kind::no_section:
      return "no section for this transport (defaults)";
    case tuning_outcome::kind::failed:
      return "could not use the file";
  }
  return "?";
}

/// Decides, from every rank's record, the constants all of them use or the error all of them
/// throw, so that no rank runs on while another stops.
[[nodiscard]] inline tuning::policy settle(std::span<const tuning_record> all, int me,
                                           const std::string& path, std::string_view section,
                                           const tuning::policy& mine) {
  for (std::size_t r = 0; r < all.size(); ++r)
    if (static_cast<tuning_outcome::kind>(all[r].what) == tuning_outcome::kind::failed) {
      const std::string why(all[r].error.data());
      if (static_cast<int>(r) == me)
        throw invalid_argument(fmt::format("RINGZERO_TUNING: rank {}: {}", r, why));
      throw invalid_argument(
          fmt::format("RINGZERO_TUNING={}: rank {} could not use it: {}", path, r, why));
    }
  const int r = ringzero::detail::first_disagreeing(
      static_cast<int>(all.size()), 0, all[0],
      [&](int q) { return all[static_cast<std::size_t>(q)]; }, &same_values);
  if (r >= 0)
    throw mismatch_error(fmt::format(
        "RINGZERO_TUNING={}: rank {} read [{}] as {}, rank 0 as {}; every rank must read the "
        "same file",
        path, r, section, describe(all[static_cast<std::size_t>(r)]), describe(all[0])));
  if (static_cast<tuning_outcome::kind>(all[0].what) == tuning_outcome::kind::no_section) {
    static std::atomic<bool> logged{false};
    if (me == 0 && !logged.exchange(true))
      log::warn("RINGZERO_TUNING={} has no section [{}]; keeping the transport's constants", path,
                section);
  }
  return mine;
}

}  // namespace detail

/// Collective over `comm`: every rank sends `mine` (load_tuning's outcome on that rank) to every
/// other, and all of them return rank 0's constants, or all throw the same error: invalid_argument
/// when a rank could not read or parse the file (naming the rank), mismatch_error when ranks read
/// different values. One small message each way per pair of ranks, once per communicator.
template <collective_comm C>
[[nodiscard]] tuning::policy agree_tuning(C& comm, const std::string& path,
                                          std::string_view section, const tuning_outcome& mine) {
  const std::vector<detail::tuning_record> all =
      ringzero::detail::exchange_records(comm, detail::record_of(mine), "tuning");
  return detail::settle(all, comm.rank(), path, section, mine.values);
}

}  // namespace ringzero::tuning
