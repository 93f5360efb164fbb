// A soak of random collectives over a real transport, every result checked against the serial
// reference: one rank per process, started by a launcher.
//
//   ringzero-run -n 4 test_soak shm                      # the native shm transport
//   ringzero-run -n 4 test_soak libfabric shm            # libfabric's shm provider
//   ringzero-run -n 4 test_soak libfabric 'tcp;ofi_rxm'
//   ringzero-run -n 4 test_soak socket                   # ringzero's socket transport
//   ringzero-run -n 4 test_soak socket rails             # the same striped over three rails
//
// Op i is drawn from (seed, i) alone, identically on every rank: a kind (the nine collectives
// of the conformance matrix and barrier), element type, op, count (0, 1, primes, up to 4 MiB
// per buffer, mostly small), algorithm (automatic or any the algorithm table offers for the
// kind), root, in place or not, a chunk size, and inputs of its own. Each case runs through
// conformance::run (conformance_matrix.hpp), which poisons the outputs and checks every element
// on every rank: bitwise for integers, min/max and data movement, within the reassociation bound
// of reference.hpp for floating sums, products and averages. Every 64 ops the ranks compare
// what they ran and the digests of the outputs that must be bitwise identical everywhere.
//
// RINGZERO_SOAK_OPS overrides the op count given by --ops (CTest passes the CI budget's, which
// sanitizer builds cut to a tenth);
// RINGZERO_SOAK_SEED repeats a run, which otherwise draws a seed and prints it. Rank 0 prints a
// summary line; any wrong result prints the seed, op index and parameters to reproduce it, and
// makes the exit status 1. RINGZERO_SOAK_CORRUPT=i feeds one op from i on wrong inputs on the
// last rank, for the test that proves such a run fails.
#include <unistd.h>

#include <fmt/core.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// The shm communicator's collectives first: the conformance matrix's qualified calls must see
// them.
#include "ringzero/transport/shm.hpp"
#include "ringzero/transport/socket.hpp"

#include "conformance_matrix.hpp"
#include "reference.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/ringzero.hpp"
#include "sanitized.hpp"
#if RINGZERO_SOAK_WITH_LIBFABRIC
#include "ringzero/transport/libfabric.hpp"
#endif

namespace {

using conformance::test_case;
using ringzero::algorithm;
using ringzero::collective;
using ringzero::op;

constexpr std::array kinds = {collective::all_reduce,  collective::reduce_scatter,
                              collective::all_gather,  collective::broadcast,
                              collective::reduce,      collective::all_to_all,
                              collective::all_to_allv, collective::gather,
                              collective::scatter,     collective::barrier};

/// The largest buffer any rank passes, in bytes; the counts drawn keep below it.
constexpr std::size_t max_bytes = std::size_t{4} << 20;

/// Instrumented ranks run several times slower: the CI budget's op count shrinks with them.
constexpr std::uint64_t ops_divisor = test_support::sanitized ? 10 : 1;

/// Wrong results a rank prints in full; a broken algorithm would otherwise flood the log.
constexpr std::size_t max_reports = 10;

/// Ops between cross-rank comparisons: a wrong digest is found within this many ops.
constexpr std::size_t batch = 64;

class rng {
 public:
  explicit rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() noexcept { return ringzero::testing::mix(state_ += 0x9e3779b97f4a7c15ull); }
  /// Uniform in [0, n), n > 0 (the modulo bias is irrelevant at these n).
  std::size_t below(std::size_t n) noexcept { return static_cast<std::size_t>(next() % n); }
  /// Uniform in [lo, hi].
  std::size_t between(std::size_t lo, std::size_t hi) noexcept { return lo + below(hi - lo + 1); }

 private:
  std::uint64_t state_;
};

[[nodiscard]] bool is_prime(std::size_t v) noexcept {
  if (v < 2) return false;
  for (std::size_t d = 2; d * d <= v; ++d)
    if (v % d == 0) return false;
  return true;
}

[[nodiscard]] std::size_t prime_at_most(std::size_t v) noexcept {
  while (v > 2 && !is_prime(v)) --v;
  return v;
}

/// How many elements the largest buffer of `c` holds per unit of test_case::count: the count is
/// the whole vector for all_reduce, broadcast and reduce, and one rank's block for the rest
/// (all_to_allv's blocks reach count + 6, testing::v_count).
[[nodiscard]] std::size_t elements_of(collective c, std::size_t count, int n) noexcept {
  const auto un = static_cast<std::size_t>(n);
  switch (c) {
    case collective::all_reduce:
    case collective::broadcast:
    case collective::reduce:
      return count;
    case collective::all_to_allv:
      return count == 0 ? 0 : (count + 6) * un;
    case collective::barrier:
      return 0;
    default:
      return count * un;
  }
}

/// A count skewed small, with the edges every algorithm splits on (0, 1, n-1, n, n+1) and
/// primes, so blocks divide unevenly; a few reach the byte cap.
[[nodiscard]] std::size_t draw_count(rng& g, collective c, std::size_t elem, int n) {
  const std::size_t cap = std::max<std::size_t>(max_bytes / elem / elements_of(c, 1, n), 1);
  const auto un = static_cast<std::size_t>(n);
  std::size_t v = 0;
  const std::size_t k = g.below(100);
  if (k < 8)
    v = 0;
  else if (k < 16)
    v = 1;
  else if (k < 22)
    v = un - 1 + g.below(3);
  else if (k < 55)
    v = prime_at_most(g.between(2, 64));
  else if (k < 80)
    v = prime_at_most(g.between(64, 4096));
  else if (k < 95)
    v = g.between(4096, 65536);
  else
    v = g.between(65536, cap);
  return std::min(v, cap);
}

/// Op `index` of the soak named by `seed`; every rank draws the same.
[[nodiscard]] test_case draw(std::uint64_t seed, std::uint64_t index, int n, bool multi_node) {
  rng g(ringzero::testing::mix(seed ^ ringzero::testing::mix(index)));
  test_case tc;
  tc.coll = kinds[g.below(kinds.size())];
  if (tc.coll == collective::barrier) return tc;
  const auto algos = conformance::algorithms_for(tc.coll, multi_node);
  tc.algo = algos[g.below(algos.size())];
  tc.type = ringzero::all_dtypes[g.below(std::size(ringzero::all_dtypes))];
  const bool reducing = tc.coll == collective::all_reduce ||
                        tc.coll == collective::reduce_scatter || tc.coll == collective::reduce;
  tc.reduction = reducing ? ringzero::all_ops[g.below(std::size(ringzero::all_ops))] : op::sum;
  tc.in_place = tc.coll != collective::all_to_allv && g.below(2) == 0;
  tc.count = draw_count(g, tc.coll, ringzero::dtype_size(tc.type), n);
  const bool rooted = tc.coll == collective::broadcast || tc.coll == collective::reduce ||
                      tc.coll == collective::gather || tc.coll == collective::scatter;
  if (rooted) tc.root = static_cast<int>(g.below(static_cast<std::size_t>(n)));
  // Half the ops cut their buffer into 1 to 16 chunks of a size no element size divides, so
  // pipelines run with chunks in flight and a short last one.
  if (g.below(2) == 0) {
    const std::size_t bytes = elements_of(tc.coll, tc.count, n) * ringzero::dtype_size(tc.type);
    tc.chunk_bytes = bytes / g.between(1, 16) + 1 + 2 * g.below(30);
  }
  tc.salt = g.next();
  return tc;
}

/// What ops the soak ran, by kind, and how many bytes its ranks' largest buffers held.
struct tally {
  std::array<std::size_t, kinds.size()> per_kind{};
  std::size_t ops = 0;
  std::uint64_t bytes = 0;

  void add(const test_case& tc, int n) {
    for (std::size_t k = 0; k < kinds.size(); ++k)
      if (kinds[k] == tc.coll) ++per_kind[k];
    ++ops;
    bytes += elements_of(tc.coll, tc.count, n) * ringzero::dtype_size(tc.type);
  }

  [[nodiscard]] std::string kinds_line() const {
    std::string s;
    for (std::size_t k = 0; k < kinds.size(); ++k)
      s += fmt::format("{}{}={}", k ? " " : "", ringzero::collective_name(kinds[k]), per_kind[k]);
    return s;
  }
};

/// The parameters of a case as one word: ranks compare these to prove they ran the same op.
[[nodiscard]] std::uint64_t digest_of(const test_case& tc) {
  using ringzero::testing::mix;
  std::uint64_t h = mix(
      (static_cast<std::uint64_t>(tc.coll) << 56) ^ (static_cast<std::uint64_t>(tc.algo) << 48) ^
      (static_cast<std::uint64_t>(tc.type) << 40) ^
      (static_cast<std::uint64_t>(tc.reduction) << 32) ^
      (static_cast<std::uint64_t>(tc.in_place) << 31) ^ static_cast<std::uint64_t>(tc.root));
  h = mix(h ^ tc.count);
  h = mix(h ^ tc.chunk_bytes);
  return mix(h ^ tc.salt);
}

/// The kinds whose output is the same on every rank; the others land differently per rank
/// (or on the root only) and are checked where they land.
[[nodiscard]] bool replicated(collective c) noexcept {
  return c == collective::all_reduce || c == collective::all_gather || c == collective::broadcast;
}

struct settings {
  std::string label;    // "shm", "libfabric shm", ...
  std::string command;  // this program's command line, for the reproduction
  std::uint64_t ops = 0;
};

/// A count or seed from the environment, else `fallback`; refuses what is not a number.
[[nodiscard]] std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const auto v = ringzero::detail::getenv_int(name);
  if (!v) return fallback;
  if (*v < 0) throw ringzero::invalid_argument(fmt::format("{}={} must not be negative", name, *v));
  return static_cast<std::uint64_t>(*v);
}

template <class Comm>
int soak(Comm& comm, const settings& s) {
  const int n = comm.size();
  const int me = comm.rank();
  const bool multi_node = comm.topo().node_count > 1;
  const ringzero::options meta{.algorithm = algorithm::ring};

  // Rank 0's seed and op count hold for all: the ranks must draw the same sequence.
  std::array<std::uint64_t, 3> shared{env_u64("RINGZERO_SOAK_SEED", std::random_device{}()),
                                      env_u64("RINGZERO_SOAK_OPS", s.ops),
                                      env_u64("RINGZERO_SOAK_CORRUPT", ~std::uint64_t{0})};
  ringzero::broadcast(comm, std::span<std::uint64_t>(shared), 0, meta);
  const std::uint64_t seed = shared[0];
  const std::uint64_t ops = shared[1];
  std::uint64_t corrupt_from = shared[2];
  auto reproduce = [&](std::uint64_t index) {
    return fmt::format("RINGZERO_SOAK_SEED={} RINGZERO_SOAK_OPS={} ringzero-run -n {} {}", seed,
                       index + 1, n, s.command);
  };

  tally t;
  std::size_t wrong = 0;  // ops wrong on some rank, the same count on every rank
  std::uint64_t first_wrong = 0;
  std::size_t reported = 0;  // wrong results this rank printed; the count goes on past the cap
  std::vector<test_case> cases;
  std::vector<std::uint64_t> words;  // per op: parameters, replicated digest, failed here
  std::vector<std::uint64_t> all;
  const auto start = std::chrono::steady_clock::now();
  for (std::uint64_t first = 0; first < ops; first += batch) {
    const std::uint64_t last = std::min<std::uint64_t>(first + batch, ops);
    cases.clear();
    words.clear();
    for (std::uint64_t i = first; i < last; ++i) {
      test_case tc = draw(seed, i, n, multi_node);
      // For the test that proves a wrong result fails the run: the last rank gives the first
      // op from RINGZERO_SOAK_CORRUPT on that moves data other inputs than the rest expect
      // (all_to_allv's block sizes depend on them too, so it is passed over).
      if (i >= corrupt_from && tc.coll != collective::barrier &&
          tc.coll != collective::all_to_allv) {
        corrupt_from = ~std::uint64_t{0};
        if (me == n - 1) tc.salt = ~tc.salt;
      }
      conformance::outcome r;
      try {
        if (tc.coll == collective::barrier)
          ringzero::barrier(comm);
        else
          r = conformance::run(comm, tc);
      } catch (const std::exception& e) {
        // The ranks may no longer agree on what comes next: stop here (the launcher stops the
        // others).
        std::fprintf(stderr,
                     "soak %s: rank %d: op %llu (%s) threw: %s\n  seed %llu; reproduce: %s\n",
                     s.label.c_str(), me, static_cast<unsigned long long>(i), tc.name().c_str(),
                     e.what(), static_cast<unsigned long long>(seed), reproduce(i).c_str());
        return 1;
      }
      if (!r.failure.empty() && ++reported <= max_reports)
        std::fprintf(
            stderr, "soak %s: WRONG on rank %d, op %llu: %s: %s\n  seed %llu; reproduce: %s\n",
            s.label.c_str(), me, static_cast<unsigned long long>(i), tc.name().c_str(),
            r.failure.c_str(), static_cast<unsigned long long>(seed), reproduce(i).c_str());
      cases.push_back(tc);
      words.insert(words.end(), {digest_of(tc), replicated(tc.coll) ? r.hash : 0,
                                 static_cast<std::uint64_t>(!r.failure.empty())});
      t.add(tc, n);
    }
    all.resize(words.size() * static_cast<std::size_t>(n));
    ringzero::all_gather(comm, std::span<const std::uint64_t>(words), std::span<std::uint64_t>(all),
                         meta);
    for (std::size_t c = 0; c < cases.size(); ++c) {
      std::string why;
      bool failed = false;
      for (int r = 0; r < n; ++r) {
        const std::uint64_t* w = &all[static_cast<std::size_t>(r) * words.size() + 3 * c];
        failed |= w[2] != 0;
        if (r == 0) continue;
        if (w[0] != all[3 * c] && why.empty())
          why = fmt::format("rank {} ran an op with other parameters than rank 0's", r);
        else if (w[1] != all[3 * c + 1] && why.empty())
          why = fmt::format("rank {}'s output is not bitwise equal to rank 0's", r);
      }
      if (!why.empty() && me == 0 && ++reported <= max_reports)
        std::fprintf(stderr, "soak %s: WRONG, op %llu: %s: %s\n  seed %llu; reproduce: %s\n",
                     s.label.c_str(), static_cast<unsigned long long>(first + c),
                     cases[c].name().c_str(), why.c_str(), static_cast<unsigned long long>(seed),
                     reproduce(first + c).c_str());
      if ((failed || !why.empty()) && wrong++ == 0) first_wrong = first + c;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (me == 0) {
    const std::string first =
        wrong == 0 ? std::string() : fmt::format(" (first: op {})", first_wrong);
    std::printf("soak %s, %d ranks: ops=%zu (%s) bytes=%llu wrong=%zu%s seconds=%.1f seed=%llu\n",
                s.label.c_str(), n, t.ops, t.kinds_line().c_str(),
                static_cast<unsigned long long>(t.bytes), wrong, first.c_str(), seconds,
                static_cast<unsigned long long>(seed));
    std::fflush(stdout);
  }
  // A failing rank takes the job down as it exits: none leaves before the summary is out.
  ringzero::barrier(comm);
  return wrong == 0 ? 0 : 1;
}

constexpr const char* usage =
    "usage: test_soak [--ops N] shm | socket [rails] | libfabric PROVIDER\n"
    "  one rank per process, under a launcher: ringzero-run -n 4 test_soak shm\n"
    "  RINGZERO_SOAK_OPS overrides --ops (default 1000, a tenth under sanitizers);\n"
    "  RINGZERO_SOAK_SEED repeats a run;\n"
    "  RINGZERO_SOAK_CORRUPT=I gives one op from I on wrong inputs (the run must fail)\n";

int run(int argc, char** argv) {
  settings s;
  s.ops = 1000 / ops_divisor;
  std::vector<std::string_view> args(argv + 1, argv + argc);
  if (args.size() >= 2 && args[0] == "--ops") {
    s.ops = std::max<std::uint64_t>(std::stoull(std::string(args[1])) / ops_divisor, 1);
    args.erase(args.begin(), args.begin() + 2);
  }
  // The reproduction keeps --ops out: RINGZERO_SOAK_OPS sets the count there.
  s.command = argv[0];
  for (auto a : args)
    s.command += a.find(';') == a.npos ? fmt::format(" {}", a) : fmt::format(" '{}'", a);

  if (args.size() == 1 && args[0] == "shm") {
    s.label = "shm";
    auto comm = ringzero::shm::communicator::from_env();
    return soak(comm, s);
  }
  if (!args.empty() && args.size() <= 2 && args[0] == "socket") {
    // "rails": three loopback addresses as rails, every message of 1 KiB or more striped.
    const bool rails = args.size() == 2 && args[1] == "rails";
    if (args.size() == 2 && !rails) {
      std::fputs(usage, stderr);
      return 2;
    }
    s.label = rails ? "socket, 3 rails" : "socket";
    ringzero::socket::options o;
    if (rails) o = {.rails = {"127.0.0.1", "127.0.0.2", "127.0.0.3"}, .stripe_bytes = 1024};
    auto comm = ringzero::socket::communicator::from_env(o);
    return soak(comm, s);
  }
  if (args.size() == 2 && args[0] == "libfabric") {
#if RINGZERO_SOAK_WITH_LIBFABRIC
    s.label = fmt::format("libfabric {}", args[1]);
    auto comm = ringzero::libfabric::communicator::from_env({.provider = std::string(args[1])});
    return soak(comm, s);
#else
    std::fputs("test_soak: built without libfabric\n", stderr);
    return 2;
#endif
  }
  std::fputs(usage, stderr);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_soak: %s\n", e.what());
    return 1;
  }
}
