#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "recording_transport.hpp"
#include "ringzero/ringzero.hpp"

using namespace ringzero;

namespace {

/// Sets an environment variable for one scope. Set before a world starts its threads and
/// restored after they joined, so no rank reads it while it changes.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~scoped_env() {
    if (old_.empty())
      ::unsetenv(name_);
    else
      ::setenv(name_, old_.c_str(), 1);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  const char* name_;
  std::string old_;
};

/// A valid all_reduce after a rejected call: it only works if the rejected call posted nothing
/// (a stray message or a skipped sequence number would make it fail or hang until the timeout).
void check_still_works(loopback::communicator& c) {
  std::vector<std::int32_t> v(37, c.rank() + 1);
  all_reduce(c, std::span<std::int32_t>(v), op::sum);
  const int n = c.size();
  for (auto x : v) REQUIRE(x == n * (n + 1) / 2);
}

}  // namespace

TEST_CASE("send and recv deliver in posting order; send_recv shifts a ring") {
  loopback::world w(3);
  w.run([&](loopback::communicator& c) {
    const int r = c.rank(), n = c.size();
    if (r == 0) {
      send(c, std::span<const double>(std::vector<double>{1.5, 2.5}), 1);
      send(c, std::span<const double>(std::vector<double>{3.5}), 1);
    } else if (r == 1) {
      std::vector<double> a(2), b(1);
      recv(c, std::span<double>(a), 0);
      recv(c, std::span<double>(b), 0);
      CHECK(a == std::vector<double>{1.5, 2.5});
      CHECK(b == std::vector<double>{3.5});
    }
    const std::vector<std::int64_t> mine = {r, 10 * r};
    std::vector<std::int64_t> left(2);
    send_recv(c, std::span<const std::int64_t>(mine), (r + 1) % n, std::span<std::int64_t>(left),
              (r + n - 1) % n);
    CHECK(left == std::vector<std::int64_t>{(r + n - 1) % n, 10 * ((r + n - 1) % n)});
  });
  // Two ranks: the same peer both ways.
  loopback::world pair(2);
  pair.run([&](loopback::communicator& c) {
    const std::vector<float> mine(5, static_cast<float>(c.rank()));
    std::vector<float> theirs(5);
    send_recv(c, std::span<const float>(mine), 1 - c.rank(), std::span<float>(theirs),
              1 - c.rank());
    CHECK(theirs == std::vector<float>(5, static_cast<float>(1 - c.rank())));
  });
}

TEST_CASE("every collective rejects bad arguments before sending anything") {
  for (int n : {1, 3}) {
    loopback::world w(n, {.timeout = std::chrono::seconds(20)});
    w.run([&](loopback::communicator& c) {
      const int r = c.rank();
      const int root = n - 1;
      const bool is_root = r == root;
      std::vector<float> buf(4 * static_cast<std::size_t>(n) + 8, 1.0f);
      std::span<float> s(buf);
      std::span<float> four = s.first(4);
      std::span<float> other = s.subspan(8, 4);
      const auto bad_op = static_cast<op>(7);
      const auto bad_algo = static_cast<algorithm>(42);
      auto forced = [](algorithm a) { return options{.algorithm = a}; };
      struct bad_call {
        const char* what;
        bool applies;
        std::function<void()> call;
      };
      const std::vector<bad_call> calls = {
          {"all_reduce sizes", true, [&] { all_reduce(c, four, s.subspan(8, 3), op::sum); }},
          {"all_reduce overlap", true, [&] { all_reduce(c, four, s.subspan(1, 4), op::sum); }},
          {"all_reduce op", true, [&] { all_reduce(c, four, bad_op); }},
          {"all_reduce unknown algorithm", true,
           [&] { all_reduce(c, four, op::sum, forced(bad_algo)); }},
          {"reduce_scatter sizes", true,
           [&] { reduce_scatter(c, four, s.subspan(8, 3), op::sum); }},
          {"reduce_scatter overlap", true,
           [&] {
             reduce_scatter(c, s.first(4 * static_cast<std::size_t>(n)),
                            s.subspan(4 * static_cast<std::size_t>(r) + 1, 4), op::sum);
           }},
          {"reduce_scatter op", true,
           [&] { reduce_scatter(c, s.first(4 * static_cast<std::size_t>(n)), s.last(4), bad_op); }},
          {"reduce_scatter tree", true,
           [&] {
             reduce_scatter(c, std::span<const float>(s.first(4 * static_cast<std::size_t>(n))),
                            std::span<float>(s.last(4)), op::sum, forced(algorithm::tree));
           }},
          {"reduce_scatter rd", true,
           [&] {
             reduce_scatter(c, std::span<const float>(s.first(4 * static_cast<std::size_t>(n))),
                            std::span<float>(s.last(4)), op::sum,
                            forced(algorithm::recursive_doubling));
           }},
          {"all_gather sizes", true, [&] { all_gather(c, four, s.subspan(8, 3)); }},
          {"all_gather overlap", true,
           [&] {
             all_gather(c, s.subspan(4 * static_cast<std::size_t>(r) + 1, 4),
                        s.first(4 * static_cast<std::size_t>(n)));
           }},
          {"all_gather tree", true,
           [&] {
             all_gather(c, std::span<const float>(s.last(4)),
                        s.first(4 * static_cast<std::size_t>(n)), forced(algorithm::tree));
           }},
          {"all_gather rhd", true,
           [&] {
             all_gather(c, std::span<const float>(s.last(4)),
                        s.first(4 * static_cast<std::size_t>(n)),
                        forced(algorithm::recursive_halving_doubling));
           }},
          {"broadcast root -1", true, [&] { broadcast(c, four, -1); }},
          {"broadcast root n", true, [&] { broadcast(c, four, n); }},
          {"broadcast rd", true,
           [&] { broadcast(c, four, 0, forced(algorithm::recursive_doubling)); }},
          {"broadcast hier", true, [&] { broadcast(c, four, 0, forced(algorithm::hierarchical)); }},
          {"broadcast root sizes", is_root, [&] { broadcast(c, four, other.first(3), root); }},
          {"broadcast root overlap", is_root, [&] { broadcast(c, four, s.subspan(2, 4), root); }},
          {"reduce root -1", true, [&] { reduce(c, four, op::sum, -1); }},
          {"reduce root n", true, [&] { reduce(c, four, op::sum, n); }},
          {"reduce op", true, [&] { reduce(c, four, bad_op, 0); }},
          {"reduce rhd", true,
           [&] { reduce(c, four, op::sum, 0, forced(algorithm::recursive_halving_doubling)); }},
          {"reduce root sizes", is_root, [&] { reduce(c, four, other.first(3), op::sum, root); }},
          {"reduce root overlap", is_root,
           [&] { reduce(c, four, s.subspan(3, 4), op::max, root); }},
          {"barrier ring", true, [&] { barrier(c, forced(algorithm::ring)); }},
          {"send to self", true, [&] { send(c, four, r); }},
          {"recv from outside", true, [&] { recv(c, four, n); }},
          {"send_recv from -1", true,
           [&] { send_recv(c, std::span<const float>(four), 0, other, -1); }},
      };
      for (const auto& bad : calls) {
        INFO(n << " ranks, rank " << r << ": " << std::string(bad.what));
        if (bad.applies) {
          const auto seq = c.state().collective_seq;
          const auto p2p_sends = c.state().p2p_send_seq;
          const auto p2p_recvs = c.state().p2p_recv_seq;
          CHECK_THROWS_AS(bad.call(), invalid_argument);
          CHECK(c.state().collective_seq == seq);
          CHECK(c.state().p2p_send_seq == p2p_sends);
          CHECK(c.state().p2p_recv_seq == p2p_recvs);
        }
        check_still_works(c);
      }
    });
  }
}

TEST_CASE("all_to_all, all_to_allv, gather and scatter reject bad arguments before sending") {
  for (int n : {1, 3}) {
    loopback::world w(n, {.timeout = std::chrono::seconds(20)});
    w.run([&](loopback::communicator& c) {
      const int r = c.rank();
      const auto un = static_cast<std::size_t>(n);
      const auto ur = static_cast<std::size_t>(r);
      const int root = n - 1;
      const bool is_root = r == root;
      std::vector<float> a(4 * un + 8, 1.0f), b(4 * un + 8, 0.0f);
      const std::span<float> in(a), out(b);
      const std::span<float> all_in = in.first(2 * un), all_out = out.first(2 * un);
      auto forced = [](algorithm x) { return options{.algorithm = x}; };
      // A valid all_to_allv layout: two elements per peer, packed.
      std::vector<std::size_t> counts(un, 2), displs(un);
      for (std::size_t i = 0; i < un; ++i) displs[i] = 2 * i;
      auto v = [&](std::span<const std::size_t> sc, std::span<const std::size_t> sd,
                   std::span<const std::size_t> rc, std::span<const std::size_t> rd,
                   std::span<float> i, std::span<float> o, options opt = {}) {
        all_to_allv(c, std::span<const float>(i), sc, sd, o, rc, rd, opt);
      };
      const std::span<const std::size_t> cs(counts), ds(displs);
      std::vector<std::size_t> short_counts(un - 1, 2), far(displs), big(counts), self(counts),
          clash(displs);
      far[un - 1] = 2 * un - 1;
      big[0] = 2 * un + 1;
      self[ur] = 1;
      if (n > 1) clash[1] = 1;
      struct bad_call {
        const char* what;
        bool applies;
        std::function<void()> call;
      };
      const std::vector<bad_call> calls = {
          {"all_to_all sizes", true, [&] { all_to_all(c, all_in, out.first(2 * un + 1)); }},
          {"all_to_all blocks", n > 1,
           [&] { all_to_all(c, in.first(2 * un + 1), out.first(2 * un + 1)); }},
          {"all_to_all overlap", true, [&] { all_to_all(c, all_in, in.subspan(1, 2 * un)); }},
          {"all_to_all linear", true,
           [&] { all_to_all(c, all_in, all_out, forced(algorithm::linear)); }},
          {"all_to_all ring", true,
           [&] { all_to_all(c, all_in, all_out, forced(algorithm::ring)); }},
          {"all_to_allv counts entries", true,
           [&] { v(short_counts, ds, cs, ds, all_in, all_out); }},
          {"all_to_allv displacement entries", true,
           [&] { v(cs, ds, cs, std::span<const std::size_t>(short_counts), all_in, all_out); }},
          {"all_to_allv send block past the end", true,
           [&] { v(cs, far, cs, ds, all_in, all_out); }},
          {"all_to_allv receive count past the end", true,
           [&] { v(cs, ds, big, ds, all_in, all_out); }},
          {"all_to_allv receive blocks overlap", n > 1,
           [&] { v(cs, ds, cs, clash, all_in, all_out); }},
          {"all_to_allv own counts differ", true, [&] { v(self, ds, cs, ds, all_in, all_out); }},
          {"all_to_allv in place", true, [&] { v(cs, ds, cs, ds, all_in, all_in); }},
          {"all_to_allv bruck", true,
           [&] { v(cs, ds, cs, ds, all_in, all_out, forced(algorithm::bruck)); }},
          {"gather root -1", true, [&] { gather(c, in.first(2), all_out, -1); }},
          {"gather root n", true, [&] { gather(c, in.first(2), all_out, n); }},
          {"gather root sizes", is_root,
           [&] { gather(c, in.first(2), out.first(2 * un - 1), root); }},
          {"gather root overlap", is_root,
           [&] { gather(c, out.subspan(2 * ur + 1, 2), all_out, root); }},
          {"gather pairwise", true,
           [&] { gather(c, in.first(2), all_out, 0, forced(algorithm::pairwise)); }},
          {"scatter root -1", true, [&] { scatter(c, all_in, out.first(2), -1); }},
          {"scatter root n", true, [&] { scatter(c, all_in, out.first(2), n); }},
          {"scatter root sizes", is_root,
           [&] { scatter(c, in.first(2 * un + 1), out.first(2), root); }},
          {"scatter root overlap", is_root,
           [&] { scatter(c, all_in, in.subspan(2 * ur + 1, 2), root); }},
          {"scatter bruck", true,
           [&] { scatter(c, all_in, out.first(2), 0, forced(algorithm::bruck)); }},
      };
      for (const auto& bad : calls) {
        INFO(n << " ranks, rank " << r << ": " << std::string(bad.what));
        if (bad.applies) {
          const auto seq = c.state().collective_seq;
          CHECK_THROWS_AS(bad.call(), invalid_argument);
          CHECK(c.state().collective_seq == seq);
        }
        check_still_works(c);
      }
    });
  }
}

TEST_CASE("RINGZERO_CHECK=1: all_to_allv counts that disagree stop every rank") {
  scoped_env check("RINGZERO_CHECK", "1");
  loopback::world w(3, {.timeout = std::chrono::seconds(20)});
  std::mutex m;
  std::vector<std::string> errors(3);
  w.run([&](loopback::communicator& c) {
    const std::vector<float> in(6, 1.0f);
    std::vector<float> out(7);
    std::vector<std::size_t> sc{2, 2, 2}, sd{0, 2, 4}, rc{2, 2, 2}, rd{0, 2, 4};
    // Rank 1 expects three elements from rank 2, which sends two.
    if (c.rank() == 1) rc[2] = 3;
    try {
      all_to_allv(c, std::span<const float>(in), std::span<const std::size_t>(sc),
                  std::span<const std::size_t>(sd), std::span<float>(out),
                  std::span<const std::size_t>(rc), std::span<const std::size_t>(rd));
    } catch (const mismatch_error& e) {
      std::lock_guard lock(m);
      errors[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (const auto& e : errors)
    CHECK(e.find("rank 2 sends 2 elements to rank 1") != std::string::npos);
}

TEST_CASE("RINGZERO_CHECK=1 stops ranks that disagree, on every rank, naming the difference") {
  scoped_env check("RINGZERO_CHECK", "1");
  loopback::world w(3, {.timeout = std::chrono::seconds(20)});
  std::mutex m;
  std::vector<std::string> errors(3);
  w.run([&](loopback::communicator& c) {
    std::vector<float> v(c.rank() == 2 ? 5 : 4, 1.0f);
    try {
      all_reduce(c, std::span<float>(v), op::sum);
    } catch (const mismatch_error& e) {
      std::lock_guard lock(m);
      errors[static_cast<std::size_t>(c.rank())] = e.what();
    }
    // Agreeing calls still pass the check, and the roots must agree too.
    std::vector<float> ok(4, 1.0f);
    all_reduce(c, std::span<float>(ok), op::sum);
    CHECK(ok == std::vector<float>(4, 3.0f));
    CHECK_THROWS_AS(broadcast(c, std::span<float>(ok), c.rank() == 0 ? 1 : 0), mismatch_error);
  });
  for (const auto& e : errors) {
    INFO(e);
    CHECK(e.find("rank 2 called all_reduce (count 5") != std::string::npos);
    CHECK(e.find("count 4") != std::string::npos);
  }
}

TEST_CASE("RINGZERO_ALGO forces an algorithm where it applies; options::algorithm wins") {
  using spy = testing::recording<loopback::transport>;
  // What rank 0 sends in an all_reduce of 8 floats on 4 ranks, by algorithm.
  auto pattern = [](const options& opt) {
    loopback::world w(4);
    std::vector<spy::sent> seen;
    w.run([&](loopback::communicator& c) {
      ringzero::communicator<spy> s(spy(c.transport()));
      std::vector<float> v(8, 1.0f);
      all_reduce(s, std::span<float>(v), op::sum, opt);
      CHECK(v == std::vector<float>(8, 4.0f));
      if (c.rank() == 0) seen = s.transport().sends();
    });
    return seen;
  };
  const algorithm flat[] = {algorithm::ring, algorithm::tree, algorithm::recursive_doubling,
                            algorithm::recursive_halving_doubling};
  std::vector<std::vector<spy::sent>> forced;
  for (algorithm a : flat) forced.push_back(pattern({.algorithm = a}));
  for (std::size_t i = 0; i < forced.size(); ++i)
    for (std::size_t j = i + 1; j < forced.size(); ++j) CHECK(forced[i] != forced[j]);

  for (std::size_t i = 0; i < std::size(flat); ++i) {
    INFO("RINGZERO_ALGO=" << algorithm_name(flat[i]));
    scoped_env env("RINGZERO_ALGO", std::string(algorithm_name(flat[i])).c_str());
    CHECK(pattern({}) == forced[i]);
    const std::size_t other = (i + 1) % std::size(flat);
    CHECK(pattern({.algorithm = flat[other]}) == forced[other]);
  }
  {
    // rd does not implement reduce_scatter: the variable is ignored there, as NCCL_ALGO is.
    scoped_env env("RINGZERO_ALGO", "rd");
    loopback::world w(4);
    w.run([&](loopback::communicator& c) {
      std::vector<int> in(8, 1), out(2);
      reduce_scatter(c, std::span<int>(in), std::span<int>(out), op::sum);
      CHECK(out == std::vector<int>{4, 4});
    });
  }
  {
    scoped_env env("RINGZERO_ALGO", "fastest");
    loopback::world w(2);
    w.run([&](loopback::communicator& c) {
      std::vector<int> v(3, 1);
      CHECK_THROWS_AS(all_reduce(c, std::span<int>(v), op::sum), invalid_argument);
    });
  }
}

TEST_CASE("count 0 and a single rank need no messages") {
  loopback::world one(1);
  one.run([&](loopback::communicator& c) {
    std::vector<int> in = {1, 2, 3}, out(3);
    all_reduce(c, std::span<int>(in), std::span<int>(out), op::avg);
    CHECK(out == in);
    barrier(c);
    CHECK(c.state().collective_seq == 0);
  });
  loopback::world w(3);
  w.run([&](loopback::communicator& c) {
    std::vector<int> none;
    all_reduce(c, std::span<int>(none), op::sum);
    all_gather(c, std::span<int>(none), std::span<int>(none));
    reduce(c, std::span<int>(none), op::sum, 1);
    CHECK(c.state().collective_seq == 0);
  });
}
