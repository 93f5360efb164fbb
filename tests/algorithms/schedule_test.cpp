// The schedules NCCL runs on GPU buffers (algorithms/schedule.hpp), run here on host memory by
// the host executor over loopback ranks: the same steps, message ids, operand order and scratch,
// with the kernels' per-element arithmetic.
//
// Per case (world sizes 1, 2, 3, 4, 5, 8; counts 0, 1, 2, 7, primes and a large one; every
// element type and op; in place and out of place):
//   - each rank checks a slice of its output against the serial reference, and outputs every
//     rank holds are bitwise equal across ranks (conformance.hpp's digests);
//   - a second run on the same inputs gives the same bits (the order is fixed);
//   - ring all_reduce and reduce_scatter give the bits of ringzero's host ring, and the tree's
//     reduce (and all_reduce's result on rank 0) those of the host's binomial reduce: the
//     schedules keep the host algorithms' reduction order;
//   - inputs are not written, and reduce leaves out untouched off the root.
// Separately, every schedule's messages are recorded per rank and played against each other as
// NCCL would match them (in posting order per pair of ranks, a send completing only once its
// receive is posted): ids and counts must agree, no step may deadlock, and no step may receive
// into memory it also sends or receives elsewhere.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <tuple>
#include <vector>

#include "conformance.hpp"
#include "ringzero/algorithms/schedule.hpp"
#include "ringzero/algorithms/schedule/host_executor.hpp"

namespace {

using namespace conformance;
namespace sched = ringzero::algorithms::schedule;

constexpr int worlds[] = {1, 2, 3, 4, 5, 8};

[[nodiscard]] std::vector<std::size_t> schedule_counts(int n) {
  std::vector<std::size_t> c = {0, 1, 2, 7, 13, 257, static_cast<std::size_t>(n) + 1};
  if (!reduced_mode()) c.push_back(10007);
  std::sort(c.begin(), c.end());
  c.erase(std::unique(c.begin(), c.end()), c.end());
  return c;
}

template <element E>
[[nodiscard]] bool same_bits(std::span<const E> a, std::span<const E> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}

template <element E>
void run_schedule(loopback::communicator& comm, algorithm a, collective k, std::span<const E> in,
                  std::span<E> out, op o, int root = 0) {
  sched::run_on_host(comm, a, algorithms::call<E>{k, in, out, o, root});
}

/// all_reduce by `a`: reference slice, twice the same bits, the host algorithm's bits.
template <element E>
void all_reduce_cases(loopback::communicator& comm, world_log& log, std::string_view world,
                      algorithm a, op o, std::size_t count) {
  const int n = comm.size();
  const int r = comm.rank();
  const std::uint64_t seed = seed_of(dtype_of<E>(), o, count, static_cast<int>(a));
  std::vector<E> pristine(count);
  for (std::size_t i = 0; i < count; ++i) pristine[i] = testing::input_value<E>(seed, r, i, o);
  const auto range = slice(count, r, n);
  const std::size_t lo = range.first, hi = range.second;  // the check's lambda captures lo
  std::vector<testing::reduced<E>> want;
  for (std::size_t i = lo; i < hi; ++i)
    want.push_back(testing::reduce_serial<E>(
        o, n, [&](int j) { return testing::input_value<E>(seed, j, i, o); }));

  // What ringzero's host algorithm with the same order gives: ring all_reduce, or for the tree
  // the binomial reduce to rank 0 (checked there; the digests carry it to every rank).
  std::vector<E> host(count);
  if (a == algorithm::ring)
    all_reduce(comm, std::span<const E>(pristine), std::span<E>(host), o,
               {.algorithm = algorithm::ring});
  else
    reduce(comm, std::span<const E>(pristine), std::span<E>(host), o, 0,
           {.algorithm = algorithm::tree});

  for (bool in_place : {false, true}) {
    const std::string name =
        fmt::format("{}: all_reduce {} {} {} count {} {}", world, algorithm_name(a),
                    dtype_name(dtype_of<E>()), op_name(o), count, in_place ? "in place" : "out");
    std::vector<E> runs[2];
    for (auto& out : runs) {
      std::vector<E> in = pristine;
      if (in_place) {
        run_schedule<E>(comm, a, collective::all_reduce, in, in, o);
        out = std::move(in);
      } else {
        out.resize(count);
        poison(std::span<E>(out), 0xa5);
        for (std::size_t i = lo; i < hi; ++i) out[i] = testing::complement(want[i - lo].exact);
        run_schedule<E>(comm, a, collective::all_reduce, in, out, o);
        if (!same_bits<E>(in, pristine))
          log.fail(fmt::format("{}: rank {} input was modified", name, r));
      }
    }
    const std::span<const E> got(runs[0]);
    check_reduced(log, name, r, got, lo, hi, [&](std::size_t i) { return want[i - lo]; });
    if (!same_bits<E>(got, runs[1]))
      log.fail(fmt::format("{}: rank {} got different bits on a second run", name, r));
    if ((a == algorithm::ring || r == 0) && !same_bits<E>(got, host))
      log.fail(fmt::format("{}: rank {} differs from the host {} algorithm's bits", name, r,
                           algorithm_name(a)));
    log.record(r, name, digest_of(got));
  }
}

/// Ring reduce_scatter: this rank's block against the reference and the host ring's bits.
template <element E>
void reduce_scatter_cases(loopback::communicator& comm, world_log& log, std::string_view world,
                          op o, std::size_t count) {
  const int n = comm.size();
  const int r = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  const std::uint64_t seed = seed_of(dtype_of<E>(), o, count, 7);
  std::vector<E> pristine(un * count);
  for (std::size_t i = 0; i < pristine.size(); ++i)
    pristine[i] = testing::input_value<E>(seed, r, i, o);
  const std::size_t base = static_cast<std::size_t>(r) * count;
  std::vector<testing::reduced<E>> want;
  for (std::size_t i = 0; i < count; ++i)
    want.push_back(testing::reduce_serial<E>(
        o, n, [&](int j) { return testing::input_value<E>(seed, j, base + i, o); }));
  std::vector<E> host(count);
  reduce_scatter(comm, std::span<const E>(pristine), std::span<E>(host), o,
                 {.algorithm = algorithm::ring});

  for (bool in_place : {false, true}) {
    const std::string name =
        fmt::format("{}: reduce_scatter ring {} {} count {} {}", world, dtype_name(dtype_of<E>()),
                    op_name(o), count, in_place ? "in place" : "out");
    std::vector<E> runs[2];
    for (auto& result : runs) {
      std::vector<E> in = pristine;
      if (in_place) {
        run_schedule<E>(comm, algorithm::ring, collective::reduce_scatter, in,
                        std::span<E>(in).subspan(base, count), o);
        result.assign(in.begin() + static_cast<std::ptrdiff_t>(base),
                      in.begin() + static_cast<std::ptrdiff_t>(base + count));
        std::copy(pristine.begin() + static_cast<std::ptrdiff_t>(base),
                  pristine.begin() + static_cast<std::ptrdiff_t>(base + count),
                  in.begin() + static_cast<std::ptrdiff_t>(base));
      } else {
        result.resize(count);
        for (std::size_t i = 0; i < count; ++i) result[i] = testing::complement(want[i].exact);
        run_schedule<E>(comm, algorithm::ring, collective::reduce_scatter, in, result, o);
      }
      // In place, only this rank's block may change (restored above before comparing).
      if (!same_bits<E>(in, pristine))
        log.fail(fmt::format("{}: rank {} input (outside its block) was modified", name, r));
    }
    check_reduced(log, name, r, std::span<const E>(runs[0]), 0, count,
                  [&](std::size_t i) { return want[i]; });
    if (!same_bits<E>(runs[0], runs[1]))
      log.fail(fmt::format("{}: rank {} got different bits on a second run", name, r));
    if (!same_bits<E>(runs[0], host))
      log.fail(fmt::format("{}: rank {} differs from the host ring's bits", name, r));
  }
}

/// Tree reduce to a root that varies with the count: the root's result against the reference
/// and the host binomial reduce; out untouched elsewhere.
template <element E>
void reduce_cases(loopback::communicator& comm, world_log& log, std::string_view world, op o,
                  std::size_t count) {
  const int n = comm.size();
  const int r = comm.rank();
  const int root = static_cast<int>(count % static_cast<std::size_t>(n));
  const std::uint64_t seed = seed_of(dtype_of<E>(), o, count, 11);
  std::vector<E> pristine(count);
  for (std::size_t i = 0; i < count; ++i) pristine[i] = testing::input_value<E>(seed, r, i, o);
  std::vector<testing::reduced<E>> want;
  if (r == root)
    for (std::size_t i = 0; i < count; ++i)
      want.push_back(testing::reduce_serial<E>(
          o, n, [&](int j) { return testing::input_value<E>(seed, j, i, o); }));
  std::vector<E> host(count);
  reduce(comm, std::span<const E>(pristine), std::span<E>(host), o, root,
         {.algorithm = algorithm::tree});

  for (bool in_place : {false, true}) {
    const std::string name =
        fmt::format("{}: reduce tree to {} {} {} count {} {}", world, root,
                    dtype_name(dtype_of<E>()), op_name(o), count, in_place ? "in place" : "out");
    std::vector<E> runs[2];
    for (auto& out : runs) {
      std::vector<E> in = pristine;
      if (in_place) {
        run_schedule<E>(comm, algorithm::tree, collective::reduce, in, in, o, root);
        if (r != root && !same_bits<E>(in, pristine))
          log.fail(fmt::format("{}: rank {} (not the root) had its buffer written", name, r));
        out = std::move(in);
      } else {
        out.resize(count);
        poison(std::span<E>(out), 0x5a);
        const std::vector<E> poisoned = out;
        run_schedule<E>(comm, algorithm::tree, collective::reduce, in, out, o, root);
        if (!same_bits<E>(in, pristine))
          log.fail(fmt::format("{}: rank {} input was modified", name, r));
        if (r != root && !same_bits<E>(out, poisoned))
          log.fail(fmt::format("{}: rank {} (not the root) had its output written", name, r));
      }
    }
    if (r != root) continue;
    check_reduced(log, name, r, std::span<const E>(runs[0]), 0, count,
                  [&](std::size_t i) { return want[i]; });
    if (!same_bits<E>(runs[0], runs[1]))
      log.fail(fmt::format("{}: the root got different bits on a second run", name));
    if (!same_bits<E>(runs[0], host))
      log.fail(fmt::format("{}: the root differs from the host binomial reduce's bits", name));
  }
}

/// Ring all_gather and tree broadcast: exact data movement, the same bits on every rank.
template <element E>
void movement_cases(loopback::communicator& comm, world_log& log, std::string_view world,
                    std::size_t count) {
  const int n = comm.size();
  const int r = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  const std::uint64_t seed = seed_of(dtype_of<E>(), op::sum, count, 13);
  const auto value = [&](int rank, std::size_t i) {
    return testing::input_value<E>(seed, rank, i, op::sum);
  };
  std::vector<E> mine(count);
  for (std::size_t i = 0; i < count; ++i) mine[i] = value(r, i);
  const std::string type(dtype_name(dtype_of<E>()));
  for (bool in_place : {false, true}) {
    const std::string how = in_place ? "in place" : "out";
    const std::string gather_name =
        fmt::format("{}: all_gather ring {} count {} {}", world, type, count, how);
    std::vector<E> out(un * count);
    poison(std::span<E>(out), 0xa5);
    const std::span<E> own = std::span<E>(out).subspan(static_cast<std::size_t>(r) * count, count);
    if (in_place) {
      std::copy(mine.begin(), mine.end(), own.begin());
      run_schedule<E>(comm, algorithm::ring, collective::all_gather, own, out, op::sum);
    } else {
      run_schedule<E>(comm, algorithm::ring, collective::all_gather, mine, out, op::sum);
    }
    const auto [lo, hi] = slice(out.size(), r, n);
    check_exact(log, gather_name, r, std::span<const E>(out), lo, hi,
                [&](std::size_t i) { return value(static_cast<int>(i / count), i % count); });
    log.record(r, gather_name, digest_of(std::span<const E>(out)));

    const int root = static_cast<int>((count + 1) % un);
    const std::string bcast_name =
        fmt::format("{}: broadcast tree from {} {} count {} {}", world, root, type, count, how);
    std::vector<E> buf(count);
    poison(std::span<E>(buf), 0x5a);
    if (in_place || r != root) {
      if (r == root) buf = mine;
      run_schedule<E>(comm, algorithm::tree, collective::broadcast, buf, buf, op::sum, root);
    } else {
      run_schedule<E>(comm, algorithm::tree, collective::broadcast, mine, buf, op::sum, root);
    }
    check_exact(log, bcast_name, r, std::span<const E>(buf), 0, count,
                [&](std::size_t i) { return value(root, i); });
    log.record(r, bcast_name, digest_of(std::span<const E>(buf)));
  }
}

template <element E>
void matrix(loopback::communicator& comm, world_log& log, std::string_view world) {
  for (std::size_t count : schedule_counts(comm.size())) {
    for (op o : all_ops) {
      all_reduce_cases<E>(comm, log, world, algorithm::ring, o, count);
      all_reduce_cases<E>(comm, log, world, algorithm::tree, o, count);
      reduce_scatter_cases<E>(comm, log, world, o, count);
      reduce_cases<E>(comm, log, world, o, count);
    }
    movement_cases<E>(comm, log, world, count);
  }
}

// --- the messages as NCCL would match them ------------------------------------------------------

struct message {
  int from = 0;
  int to = 0;
  std::uint32_t id = 0;
  std::size_t count = 0;
  const std::byte* lo = nullptr;
  const std::byte* hi = nullptr;
};

struct group {
  std::vector<message> sends;
  std::vector<message> recvs;
};

/// Records each step of one rank; the local work only checks it is never handed an empty range.
template <element E>
class recording_executor {
 public:
  recording_executor(int rank, int size, std::vector<group>& steps, std::vector<std::string>& bad)
      : rank_(rank), size_(size), steps_(steps), bad_(bad) {}
  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return size_; }
  void exchange(std::span<const sched::transfer<const E>> sends,
                std::span<const sched::transfer<E>> recvs) {
    group g;
    for (const auto& t : sends) g.sends.push_back(describe(rank_, t.peer, t));
    for (const auto& t : recvs) g.recvs.push_back(describe(t.peer, rank_, t));
    if (g.sends.empty() && g.recvs.empty()) bad_.push_back("an empty step");
    steps_.push_back(std::move(g));
  }
  void combine(op, const E*, const E*, E*, std::size_t n) { nonempty(n, "combine"); }
  void finish_avg(E*, std::size_t n, int) { nonempty(n, "finish_avg"); }
  void copy(E*, const E*, std::size_t n) { nonempty(n, "copy"); }

 private:
  template <class T>
  static message describe(int from, int to, const sched::transfer<T>& t) {
    const auto* p = reinterpret_cast<const std::byte*>(t.data);
    return {from, to, t.id, t.count, p, p + t.count * sizeof(E)};
  }
  void nonempty(std::size_t n, const char* what) {
    if (n == 0) bad_.push_back(fmt::format("rank {}: {} of 0 elements", rank_, what));
  }
  int rank_;
  int size_;
  std::vector<group>& steps_;
  std::vector<std::string>& bad_;
};

[[nodiscard]] bool overlaps(const message& a, const message& b) {
  return a.lo < b.hi && b.lo < a.hi;
}

/// Plays every rank's steps against each other: the k-th send from a to b meets the k-th
/// receive at b from a; a step ends once every message of it met its partner's step. Returns
/// what went wrong.
std::vector<std::string> play(const std::vector<std::vector<group>>& ranks) {
  std::vector<std::string> bad;
  const int n = static_cast<int>(ranks.size());
  // Where each message of each pair sits: (step index) per k-th send / receive.
  std::map<std::tuple<int, int, bool>, std::vector<std::pair<std::size_t, message>>> queue;
  for (int r = 0; r < n; ++r) {
    const auto& steps = ranks[static_cast<std::size_t>(r)];
    for (std::size_t s = 0; s < steps.size(); ++s) {
      const group& g = steps[s];
      for (const message& m : g.sends) queue[{m.from, m.to, true}].push_back({s, m});
      for (const message& m : g.recvs) queue[{m.from, m.to, false}].push_back({s, m});
      // On a GPU the messages of one step move at the same time.
      for (std::size_t i = 0; i < g.recvs.size(); ++i) {
        for (const message& m : g.sends)
          if (overlaps(g.recvs[i], m))
            bad.push_back(fmt::format("rank {} step {}: receives into memory it sends", r, s));
        for (std::size_t j = i + 1; j < g.recvs.size(); ++j)
          if (overlaps(g.recvs[i], g.recvs[j]))
            bad.push_back(fmt::format("rank {} step {}: two receives share memory", r, s));
      }
    }
  }
  // The partner of every message: same id and count, and where it sits.
  std::map<std::tuple<int, int, bool, std::size_t>, std::size_t> partner_step;
  for (const auto& [key, list] : queue) {
    const auto [from, to, is_send] = key;
    const auto other = queue.find({from, to, !is_send});
    const std::size_t theirs = other == queue.end() ? 0 : other->second.size();
    if (theirs != list.size()) {
      bad.push_back(fmt::format("{} -> {}: {} sends but {} receives", from, to,
                                is_send ? list.size() : theirs, is_send ? theirs : list.size()));
      continue;
    }
    for (std::size_t k = 0; k < list.size(); ++k) {
      const message& a = list[k].second;
      const message& b = other->second[k].second;
      if (a.id != b.id || a.count != b.count)
        bad.push_back(fmt::format("{} -> {} message {}: id {} count {} meets id {} count {}", from,
                                  to, k, a.id, a.count, b.id, b.count));
      partner_step[{from, to, is_send, k}] = other->second[k].first;
    }
  }
  if (!bad.empty()) return bad;
  // The k-th message of (from, to, direction) for each message of each step.
  std::vector<std::vector<std::vector<std::tuple<int, int, bool, std::size_t>>>> keys(
      static_cast<std::size_t>(n));
  std::map<std::tuple<int, int, bool>, std::size_t> seen;
  for (int r = 0; r < n; ++r)
    for (const group& g : ranks[static_cast<std::size_t>(r)]) {
      auto& ks = keys[static_cast<std::size_t>(r)].emplace_back();
      for (const message& m : g.sends)
        ks.emplace_back(m.from, m.to, true, seen[{m.from, m.to, true}]++);
      for (const message& m : g.recvs)
        ks.emplace_back(m.from, m.to, false, seen[{m.from, m.to, false}]++);
    }
  std::vector<std::size_t> at(static_cast<std::size_t>(n), 0);
  for (;;) {
    std::vector<int> ready;
    bool all_done = true;
    for (int r = 0; r < n; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      if (at[ur] == ranks[ur].size()) continue;
      all_done = false;
      bool ok = true;
      for (const auto& key : keys[ur][at[ur]]) {
        const auto [from, to, is_send, k] = key;
        const int peer = is_send ? to : from;
        if (at[static_cast<std::size_t>(peer)] < partner_step.at(key)) ok = false;
      }
      if (ok) ready.push_back(r);
    }
    if (all_done) return bad;
    if (ready.empty()) {
      std::string where;
      for (int r = 0; r < n; ++r)
        where += fmt::format(" rank {} at step {};", r, at[static_cast<std::size_t>(r)]);
      bad.push_back("deadlock:" + where);
      return bad;
    }
    for (int r : ready) ++at[static_cast<std::size_t>(r)];
  }
}

template <element E>
void play_schedule(algorithm a, collective k, int n, std::size_t count, int root) {
  std::vector<std::vector<group>> ranks(static_cast<std::size_t>(n));
  std::vector<std::string> bad;
  const auto un = static_cast<std::size_t>(n);
  for (int r = 0; r < n; ++r) {
    std::vector<E> in(un * count), out(un * count);
    algorithms::call<E> c{k, {}, {}, op::avg, root};
    switch (k) {
      case collective::reduce_scatter:
        c.in = std::span<const E>(in);
        c.out = std::span<E>(out).first(count);
        break;
      case collective::all_gather:
        c.in = std::span<const E>(in).first(count);
        c.out = std::span<E>(out);
        break;
      default:
        c.in = std::span<const E>(in).first(count);
        c.out = std::span<E>(out).first(count);
        break;
    }
    std::vector<E> scratch(sched::scratch_elems(a, c, n));
    recording_executor<E> x(r, n, ranks[static_cast<std::size_t>(r)], bad);
    sched::run(x, a, c, std::span<E>(scratch));
  }
  for (const auto& b : play(ranks)) bad.push_back(b);
  INFO(algorithm_name(a), " ", collective_name(k), " on ", n, " ranks, count ", count, ", root ",
       root);
  for (const auto& b : bad) FAIL_CHECK(b);
}

}  // namespace

TEST_CASE("schedules: which algorithm runs which collective") {
  using sched::has_schedule;
  CHECK(has_schedule(algorithm::ring, collective::all_reduce));
  CHECK(has_schedule(algorithm::ring, collective::reduce_scatter));
  CHECK(has_schedule(algorithm::ring, collective::all_gather));
  CHECK(has_schedule(algorithm::tree, collective::all_reduce));
  CHECK(has_schedule(algorithm::tree, collective::broadcast));
  CHECK(has_schedule(algorithm::tree, collective::reduce));
  CHECK_FALSE(has_schedule(algorithm::ring, collective::broadcast));
  CHECK_FALSE(has_schedule(algorithm::tree, collective::all_gather));
  CHECK_FALSE(has_schedule(algorithm::recursive_doubling, collective::all_reduce));
  CHECK_FALSE(has_schedule(algorithm::automatic, collective::all_reduce));
  CHECK_FALSE(has_schedule(algorithm::pairwise, collective::all_to_all));
  loopback::world(2).run([](loopback::communicator& comm) {
    std::vector<float> v(4, 1.0f);
    CHECK_THROWS_WITH_AS(run_schedule<float>(comm, algorithm::recursive_doubling,
                                             collective::all_reduce, v, v, op::sum),
                         "ringzero: all_reduce: algorithm 'rd' has no schedule for this collective",
                         ringzero::unsupported);
  });
}

TEST_CASE(
    "schedules on the host executor match the reference, the host algorithms and themselves") {
  for (int n : worlds) {
    const std::string world = fmt::format("{} ranks", n);
    run_world(n, world_options_for(), world, [&](loopback::communicator& comm, world_log& log) {
      for_each_type([&](auto e) { matrix<decltype(e)>(comm, log, world); });
    });
  }
}

TEST_CASE("schedules match their messages as NCCL does and cannot deadlock") {
  for (int n : {2, 3, 4, 5, 6, 7, 8, 9, 16, 33}) {
    for (std::size_t count : {std::size_t{1}, std::size_t{5}, static_cast<std::size_t>(n) + 3}) {
      for (const auto& e : sched::schedules)
        for (collective k : {collective::all_reduce, collective::reduce_scatter,
                             collective::all_gather, collective::broadcast, collective::reduce}) {
          if (!e.implements.contains(k)) continue;
          for (int root : {0, n / 2, n - 1}) {
            play_schedule<float>(e.id, k, n, count, root);
            if (k != collective::broadcast && k != collective::reduce) break;
          }
        }
    }
  }
}
