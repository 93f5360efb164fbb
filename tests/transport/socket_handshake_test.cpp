// The socket transport against a hostile neighbour: connections to a rank's setup port that do
// not belong to the job (a stranger claiming a rank, one that says nothing, one that forges a
// proof), and frames whose headers no rank of the job sends (offsets past the message, sizes
// announced and never sent, ranks, kinds and piece numbers out of range). Each must be refused or
// dropped, logged, and hold up nothing; the job must go on bitwise as without them. The handshake's
// own cases (socket/handshake.hpp) run over socket pairs, and its HMAC against RFC 4231's vectors.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/core.h>

#include "multiprocess.hpp"
#include "ringzero/detail/hmac.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/socket.hpp"

using namespace std::chrono_literals;
namespace sock = ringzero::socket;
namespace d = ringzero::socket::detail;
using multiprocess::contains;
using multiprocess::rank_checks;
using multiprocess::require_all_passed;
using test_support::closed_within;

namespace {

std::vector<std::byte> bytes_of(std::string_view s) {
  const auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

std::string hex(std::span<const std::byte> b) {
  std::string s;
  for (const std::byte x : b) s += fmt::format("{:02x}", static_cast<unsigned>(x));
  return s;
}

/// Rank `rank`'s port on its first rail, as it published it in the store.
int published_port(ringzero::bootstrap::store& s, int rank) {
  const std::string v = s.get_string(fmt::format("ringzero-socket/0/rails/{}", rank));
  return std::stoi(v.substr(v.rfind(':') + 1));
}

d::unique_fd connect_to(int port) {
  d::unique_fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0)
    throw ringzero::bootstrap_error(fmt::format("connect: {}", std::strerror(errno)));
  return fd;
}

/// Sends all of `b` (blocking socket); false once the peer closed.
bool send_all(int fd, std::span<const std::byte> b) {
  while (!b.empty()) {
    const ssize_t n = ::send(fd, b.data(), b.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    b = b.subspan(static_cast<std::size_t>(n));
  }
  return true;
}

/// Two ranks' all_reduce of 1 + 2: the job works as if nobody had interfered.
bool sums_right(sock::communicator& comm, int r) {
  std::vector<float> v(100000, static_cast<float>(r + 1));
  ringzero::all_reduce(comm, std::span<float>(v), ringzero::op::sum);
  return std::all_of(v.begin(), v.end(), [](float x) { return x == 3.0f; });
}

/// Drives two handshakes over a socket pair until neither works; their outcomes. A side that
/// fails closes its end, as meet() does.
template <class Taken>
std::pair<d::handshake::outcome, d::handshake::outcome> drive(d::handshake& a, d::handshake& b,
                                                              const Taken& taken) {
  using o = d::handshake::outcome;
  o ra = o::working, rb = o::working;
  for (int i = 0; i < 100 && (ra == o::working || rb == o::working); ++i) {
    if (ra == o::working && (ra = a.step(taken)) != o::working && ra != o::done)
      static_cast<void>(a.release());
    if (rb == o::working && (rb = b.step(taken)) != o::working && rb != o::done)
      static_cast<void>(b.release());
  }
  return {ra, rb};
}

/// A store whose get() of one key first waits for another: holds a rank between publishing
/// its own addresses and reading a peer's, where strangers can come first.
class held_store final : public ringzero::bootstrap::store {
 public:
  held_store(ringzero::bootstrap::store& s, std::string key, std::string until)
      : s_(s), key_(std::move(key)), until_(std::move(until)) {}
  void set(std::string_view k, std::span<const std::byte> v) override { s_.set(k, v); }
  [[nodiscard]] std::vector<std::byte> get(std::string_view k) override {
    if (k == key_) s_.wait(std::span<const std::string>(&until_, 1));
    return s_.get(k);
  }
  std::int64_t add(std::string_view k, std::int64_t delta) override { return s_.add(k, delta); }
  void wait(std::span<const std::string> keys) override { s_.wait(keys); }

 private:
  ringzero::bootstrap::store& s_;
  std::string key_, until_;
};

/// The kit's rail engine over one socket rail, as rank 1 of 2, whose connection to rank 0 is a
/// socket pair: what the test writes into `wire` is what rank 0 sent.
struct one_engine {
  d::unique_fd wire;
  std::shared_ptr<d::engine> eng;

  one_engine() {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) == 0);
    auto rail = std::make_unique<d::rail>("pair", 0, 2, std::make_shared<d::poller>(1));
    rail->adopt(0, d::unique_fd(sv[0]));
    std::vector<std::unique_ptr<d::rail>> rails;
    rails.push_back(std::move(rail));
    eng = std::make_shared<d::engine>(ringzero::detail::rail_engine_config{.rank = 1,
                                                                           .size = 2,
                                                                           .name = "socket",
                                                                           .fabric = "sockets",
                                                                           .timeout = 30s,
                                                                           .acknowledge = true},
                                      std::move(rails));
    wire.reset(sv[1]);
  }

  /// A data frame as rank 0's engine writes it: message `seq` to this rank, with `tag`.
  [[nodiscard]] static d::frame_header data(std::uint64_t seq, ringzero::tag_t tag,
                                            std::uint64_t total, std::uint64_t offset,
                                            std::uint64_t length) {
    return {
        .kind = d::frame_kind::data,
        .with_word = 1,
        .word = static_cast<std::uint32_t>(ringzero::detail::delivery::cq_word::make(seq, false)),
        .length = length,
        .tag = tag,
        .total = total,
        .offset = offset};
  }

  void send(const d::frame_header& h, std::size_t payload = 0) {
    write(std::as_bytes(std::span(&h, 1)));
    const std::vector<std::byte> body(payload, std::byte{0x5a});
    write(body);
  }

  /// Writes `b` whole, moving the engine while the socket is full: one thread is both ranks, and
  /// a payload larger than the socket's buffer is only taken as the engine reads it.
  void write(std::span<const std::byte> b) {
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (!b.empty()) {
      const ssize_t n = ::send(wire.get(), b.data(), b.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        b = b.subspan(static_cast<std::size_t>(n));
        continue;
      }
      REQUIRE((n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)));
      REQUIRE(std::chrono::steady_clock::now() < until);
      eng->progress();
    }
  }

  [[nodiscard]] d::op* recv(ringzero::tag_t tag, std::span<std::byte> buf) {
    return eng->recv(0, 0, tag, buf);
  }

  /// Moves the engine until `o` finishes or fails (its error), or 5 s pass ("pending").
  std::string outcome(d::op* o) {
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < until) {
      try {
        if (eng->test(o)) return "done";
      } catch (const ringzero::error& e) {
        return e.what();
      }
    }
    eng->abandon(o);
    return "pending";
  }
};

}  // namespace

TEST_CASE("HMAC-SHA-256 gives RFC 4231's results") {
  using ringzero::detail::hmac_sha256;
  const std::vector<std::byte> key20(20, std::byte{0x0b});
  CHECK(hex(hmac_sha256(key20, {bytes_of("Hi There")})) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  // Test case 2, the message fed in two parts.
  CHECK(hex(hmac_sha256(bytes_of("Jefe"),
                        {bytes_of("what do ya want "), bytes_of("for nothing?")})) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // Test case 6: a key longer than a block is hashed first.
  const std::vector<std::byte> key131(131, std::byte{0xaa});
  CHECK(hex(hmac_sha256(key131, {bytes_of("Test Using Larger Than Block-Size Key - Hash Key "
                                          "First")})) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  // A message that needs a second padding block (55 < length mod 64).
  ringzero::detail::sha256 h;
  h.update(bytes_of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"));
  CHECK(hex(h.finish()) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(ringzero::detail::same_bytes(key20, key20));
  CHECK_FALSE(ringzero::detail::same_bytes(key20, key131));
}

TEST_CASE("the handshake: only a peer holding the job's secret, with a claim this rank expects") {
  d::handshake_terms acceptor{.rank = 1, .size = 3, .generation = 4};
  ringzero::detail::random_bytes(acceptor.secret);
  d::handshake_terms connector = acceptor;
  connector.rank = 0;
  using o = d::handshake::outcome;
  const auto pair = [] {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) == 0);
    return std::pair{d::unique_fd(sv[0]), d::unique_fd(sv[1])};
  };
  const auto none = [](int, int) { return false; };
  const auto run = [&](const d::handshake_terms& c, int rail, const auto& taken) {
    auto [a_fd, c_fd] = pair();
    auto a = d::handshake::accepting(std::move(a_fd), 0, acceptor, "test");
    auto k = d::handshake::connecting(std::move(c_fd), 1, rail, c);
    const auto [ra, rk] = drive(a, k, taken);
    return std::tuple{ra, rk, a.why(), k.why(), a.peer()};
  };

  SUBCASE("the job's own rank is welcome, both ends proven") {
    const auto [ra, rk, wa, wk, peer] = run(connector, 0, none);
    CHECK(ra == o::done);
    CHECK(rk == o::done);
    CHECK(peer == 0);
  }
  SUBCASE("another secret: the connecting side refuses the acceptor's proof") {
    auto other = connector;
    other.secret[7] ^= std::byte{1};
    const auto [ra, rk, wa, wk, peer] = run(other, 0, none);
    CHECK(rk == o::refused);
    CHECK(contains(wk, "could not prove it holds this job's secret"));
    CHECK(ra == o::refused);  // it closed without a proof
  }
  SUBCASE("a claim this rank does not expect is refused, saying why") {
    auto higher = connector;
    higher.rank = 2;
    auto [ra, rk, wa, wk, peer] = run(higher, 0, none);
    CHECK(ra == o::refused);
    CHECK(rk == o::refused);
    CHECK(contains(wk, "only lower ranks"));
    auto stale = connector;
    stale.generation = 3;
    std::tie(ra, rk, wa, wk, peer) = run(stale, 0, none);
    CHECK(contains(wk, "another setup of the job"));
    CHECK(contains(wa, "claimed rank 0 rail 0"));
    std::tie(ra, rk, wa, wk, peer) = run(connector, 1, none);  // reaches rail 0 claiming rail 1
    CHECK(contains(wk, "another rail"));
  }
  SUBCASE("a second claim of a rank connected already is refused on both sides") {
    const auto [ra, rk, wa, wk, peer] =
        run(connector, 0, [](int p, int r) { return p == 0 && r == 0; });
    CHECK(ra == o::refused);
    CHECK(contains(wa, "connected on that rail already"));
    CHECK(rk == o::refused);
    CHECK(contains(wk, "connected on that rail already"));
  }
  SUBCASE("a forged proof is refused; a stranger's bytes are no hello") {
    auto [a_fd, c_fd] = pair();
    auto a = d::handshake::accepting(std::move(a_fd), 0, acceptor, "test");
    d::hello h{.rank = 0, .rail = 0, .generation = 4};
    REQUIRE(::send(c_fd.get(), &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h));
    CHECK(a.step(none) == o::working);  // answered with its challenge; waits for the proof
    d::challenge c{};
    REQUIRE(::recv(c_fd.get(), &c, sizeof c, 0) == static_cast<ssize_t>(sizeof c));
    CHECK(c.says == d::verdict::welcome);
    d::proof p{};
    p.mac.fill(std::byte{0x42});
    REQUIRE(::send(c_fd.get(), &p, sizeof p, 0) == static_cast<ssize_t>(sizeof p));
    CHECK(a.step(none) == o::refused);
    CHECK(contains(a.why(), "without holding this job's secret"));

    auto [b_fd, s_fd] = pair();
    auto b = d::handshake::accepting(std::move(b_fd), 0, acceptor, "test");
    const auto http = bytes_of("GET / HTTP/1.1\r\nHost: x\r\n\r\n     ");
    REQUIRE(::send(s_fd.get(), http.data(), http.size(), 0) > 0);
    CHECK(b.step(none) == o::refused);
    CHECK(contains(b.why(), "did not introduce itself"));
  }
}

TEST_CASE("setup: strangers on a rank's port are refused or dropped and hold nothing up") {
  // Process 2 is the stranger. Before rank 0 connects (it is held before reading rank 1's
  // address), the stranger connects to rank 1's port and (1) says nothing, keeping the
  // connection open, (2) claims rank 0 in the previous version's hello, (3) claims rank 0 and
  // sends a proof it could not have made. Written against the transport's options of before the
  // handshake, so that it also runs without it.
  auto out = multiprocess::run(3, 150s, [](int r, int, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    if (r == 2) {
      const int port = published_port(s, 1);
      const auto silent = connect_to(port);
      const auto old = connect_to(port);
      const std::array<std::uint32_t, 4> claim{0x4b53525a, 0, 0, 0};  // magic, rank, rail, g
      send_all(old.get(), std::as_bytes(std::span(claim)));
      const auto forged = connect_to(port);
      std::array<std::uint32_t, 16> hello_proof{0x3253525a, 0, 0, 0};  // + nonce, + a proof
      hello_proof.back() = 7;
      send_all(forged.get(), std::as_bytes(std::span(hello_proof)));
      s.set_string("strangers-here", "1");
      check.expect(closed_within(old.get(), 10s), "the old-style claim of rank 0 closed");
      check.expect(closed_within(forged.get(), 10s), "the forged claim of rank 0 closed");
      // The silent connection goes once setup is over, without being taken for a rank.
      const std::string done = "job-done";
      s.wait(std::span<const std::string>(&done, 1));
      check.expect(closed_within(silent.get(), 10s), "the silent connection closed after setup");
      return check.code();
    }
    held_store held(s, "ringzero-socket/0/rails/1", "strangers-here");
    std::string log;
    bool right = false;
    double setup_s = 0;
    log = multiprocess::capture_info_log("socket-strangers", [&] {
      const auto t0 = std::chrono::steady_clock::now();
      sock::communicator comm(sock::transport(
          r == 0 ? static_cast<ringzero::bootstrap::store&>(held) : s, r, 2, {.timeout = 60s}));
      setup_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      right = sums_right(comm, r);
    });
    check.expect(right, "the all_reduce of the two real ranks");
    if (r == 1) {
      // Before the handshake: the silent stranger held setup for the whole timeout (60 s).
      check.expect(setup_s < 20, fmt::format("setup within 20 s, took {:.1f} s", setup_s));
      check.expect(contains(log, "dropped a connection from 127.0.0.1") &&
                       contains(log, "did not introduce itself") &&
                       contains(log, "without holding this job's secret"),
                   fmt::format("each stranger logged with its address and why, got '{}'", log));
      s.set_string("job-done", "1");
    }
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("setup: a connection that does not finish its handshake in time is dropped") {
  // Rank 1 meets alone with a silent stranger, rank 0 arriving only once the stranger was
  // dropped (or 10 s passed).
  d::handshake_terms one{.rank = 1, .size = 2, .generation = 0};
  ringzero::detail::random_bytes(one.secret);
  d::handshake_terms zero = one;
  zero.rank = 0;
  const std::vector<d::rail_address> rails{d::find_rail("127.0.0.1")};
  std::vector<d::unique_fd> listening, none;
  auto [fd, addr] = d::listen_on(rails[0], 0);
  listening.push_back(std::move(fd));
  const std::vector<std::vector<sockaddr_in>> addresses{{addr}, {addr}};
  const auto deadline = d::clock::now() + 60s;
  const auto meet = [&](const d::handshake_terms& t, const std::vector<d::unique_fd>& l,
                        int& adopted, std::string& failure) {
    try {
      d::meet(t,
              {.rails = rails,
               .listeners = l,
               .addresses = addresses,
               .handshake_timeout = 500ms,
               .deadline = deadline,
               .timeout = 60s},
              [&](int peer, int, d::unique_fd) { adopted = peer; });
    } catch (const std::exception& e) {
      failure = e.what();
    }
  };
  int adopted_by_1 = -1, adopted_by_0 = -1;
  std::string failure_1, failure_0;
  std::thread rank1([&] { meet(one, listening, adopted_by_1, failure_1); });
  const auto silent = connect_to(ntohs(addr.sin_port));
  const auto t0 = std::chrono::steady_clock::now();
  const bool closed = closed_within(silent.get(), 10s);
  const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::thread rank0([&] { meet(zero, none, adopted_by_0, failure_0); });
  rank0.join();
  rank1.join();
  CHECK(closed);
  CHECK(after >= 0.4);
  CHECK(after < 5);
  CHECK(failure_1.empty());
  CHECK(failure_0.empty());
  CHECK(adopted_by_1 == 0);
  CHECK(adopted_by_0 == 1);
}

TEST_CASE("frames: every header field is checked before a byte is allocated or copied") {
  using E = one_engine;
  one_engine e;
  std::vector<std::byte> buf(4096);
  auto recv = [&](ringzero::tag_t tag) { return e.recv(tag, buf); };

  SUBCASE("a piece past the end of its message") {
    const auto o = recv(5);
    e.send(E::data(0, 5, 4096, 1 << 20, 4096), 4096);
    const std::string what = e.outcome(o);
    CHECK(contains(what, "protocol violation: a piece outside its message"));
    CHECK(contains(what, "rank 0"));
  }
  SUBCASE("a piece whose end wraps around") {
    const auto o = recv(5);
    e.send(E::data(0, 5, 4096, ~std::uint64_t{0} - 10, 64), 64);
    CHECK(contains(e.outcome(o), "a piece outside its message"));
  }
  SUBCASE("sizes announced and never sent hold only what was sent") {
    rusage before{};
    ::getrusage(RUSAGE_SELF, &before);
    // Pieces of messages of 1 GiB that nobody posted for, and one piece that announces 512 MiB
    // and brings 64 KiB (what follows it on the stream is its payload).
    for (std::uint64_t m = 0; m < 3; ++m)
      e.send(E::data(m, 100 + m, std::uint64_t{1} << 30, 0, 64 << 10), 64 << 10);
    // A message after them, received once the engine read the three.
    e.send(E::data(3, 7, 4096, 0, 4096), 4096);
    CHECK(e.outcome(recv(7)) == "done");
    e.send(E::data(4, 8, std::uint64_t{1} << 30, 0, std::uint64_t{512} << 20), 64 << 10);
    const auto o = recv(9);
    CHECK(e.outcome(o) == "pending");
    rusage after{};
    ::getrusage(RUSAGE_SELF, &after);
    const long grew_mib = (after.ru_maxrss - before.ru_maxrss) / 1024;
    INFO("maximum resident set grew by " << grew_mib << " MiB");
    CHECK(grew_mib < 256);
  }
  SUBCASE("a message over the size limit") {
    const auto o = recv(5);
    e.send(E::data(0, 5, std::uint64_t{1} << 41, 0, 64), 64);
    CHECK(contains(e.outcome(o), "a message over the size limit"));
  }
  SUBCASE("a piece of a message whose size is not its receive's is refused naming both") {
    std::vector<std::byte> mib(1 << 20);
    const auto o = e.recv(5, mib);
    e.send(E::data(0, 5, 1 << 21, 0, 4096), 4096);
    const std::string what = e.outcome(o);
    CHECK(contains(what, "posted a 1048576 byte receive"));
    CHECK(contains(what, "the peer sent 2097152 bytes"));
  }
  SUBCASE("goodbyes naming no rank, unknown kinds, piece numbers out of range") {
    const auto o = recv(5);
    e.send(d::frame_header::bye(999));
    CHECK(contains(e.outcome(o), "a goodbye naming rank 999"));
    one_engine g;
    const auto q = g.recv(5, buf);
    d::frame_header h = E::data(0, 5, 64, 0, 0);
    h.kind = static_cast<d::frame_kind>(77);
    g.send(h);
    CHECK(contains(g.outcome(q), "a frame of unknown kind 77"));
    one_engine p;
    const auto r = p.recv(5, buf);
    h = E::data(0, 5, 64, 0, 64);
    h.piece = 200;
    p.send(h, 64);
    CHECK(contains(p.outcome(r), "a piece number out of range"));
  }
  SUBCASE("a statement that is no statement is dropped; the stream goes on") {
    d::frame_header h = E::data(0, 0, 28, 0, 28);
    h.piece = ringzero::detail::delivery::limits::control_piece;
    e.send(h, 28);
    e.send(E::data(0, 7, 4096, 0, 4096), 4096);
    CHECK(e.outcome(recv(7)) == "done");
  }
  SUBCASE("what a rank sends is still taken, whole and unexpected") {
    std::vector<std::byte> big(3 << 20);
    const auto o = e.recv(3, big);
    e.send(E::data(0, 3, 3 << 20, 0, 3 << 20), 3 << 20);
    CHECK(e.outcome(o) == "done");
    CHECK(big[0] == std::byte{0x5a});
    CHECK(big.back() == std::byte{0x5a});
    // Unexpected (its receive is posted after a later message was read), then received: held
    // as its bytes came, in chunks.
    e.send(E::data(1, 4, 3 << 20, 0, 3 << 20), 3 << 20);
    e.send(E::data(2, 7, 4096, 0, 4096), 4096);
    CHECK(e.outcome(recv(7)) == "done");
    std::fill(big.begin(), big.end(), std::byte{0});
    CHECK(e.outcome(e.recv(4, big)) == "done");
    CHECK(std::all_of(big.begin(), big.end(), [](std::byte b) { return b == std::byte{0x5a}; }));
  }
}
