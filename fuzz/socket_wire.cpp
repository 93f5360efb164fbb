// The socket transport's wire format as a rank reads it, over a real socket pair. The first
// byte picks the side:
//   even: frames (socket/wire.hpp) arriving from rank 0 at the kit's rail engine over one socket
//         rail (socket/rail.hpp), rank 1 of 2, with receives of 16 B, 4 KiB and 1 MiB posted and
//         a 128 KiB send under way (so that statements have something to acknowledge), read
//         until the stream ends;
//   odd:  what a stranger sends to a listening rank during setup (socket/handshake.hpp): the
//         accepting side of a handshake, under a secret the input cannot know.
// Either must end in an error of ringzero's or in nothing, never in a crash, an out-of-bounds
// access or memory a header announced.
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/detail/rail_engine.hpp"
#include "ringzero/transport/socket/handshake.hpp"
#include "ringzero/transport/socket/rail.hpp"

namespace d = ringzero::socket::detail;

namespace {

std::pair<d::unique_fd, d::unique_fd> socket_pair() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) std::abort();
  return {d::unique_fd(sv[0]), d::unique_fd(sv[1])};
}

// Writes what the socket takes of `rest`; at its end, closes the writing side.
void feed(int fd, std::span<const std::uint8_t>& rest, bool& ended) {
  if (ended) return;
  if (!rest.empty()) {
    const ssize_t n = ::send(fd, rest.data(), rest.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) rest = rest.subspan(static_cast<std::size_t>(n));
    if (n < 0 && errno != EAGAIN && errno != EINTR) rest = {};
  }
  if (rest.empty()) {
    ::shutdown(fd, SHUT_WR);
    ended = true;
  }
}

void frames(std::span<const std::uint8_t> input) {
  auto [mine, theirs] = socket_pair();
  auto rail = std::make_unique<d::rail>("pair", 0, 2, std::make_shared<d::poller>(1));
  rail->adopt(0, std::move(mine));
  std::vector<std::unique_ptr<d::rail>> rails;
  rails.push_back(std::move(rail));
  using engine = ringzero::detail::rail_engine<d::rail>;
  auto eng = std::make_shared<engine>(
      ringzero::detail::rail_engine_config{
          .rank = 1, .size = 2, .timeout = std::chrono::seconds(5), .acknowledge = true},
      std::move(rails));
  static std::vector<std::byte> small(16), page(4096), large(std::size_t{1} << 20),
      out(std::size_t{128} << 10);
  std::vector<d::op*> ops{eng->recv(0, 0, 1, small), eng->recv(0, 0, 2, page),
                          eng->recv(0, 0, 3, large), eng->send(0, 0, 9, out)};
  bool ended = false;
  std::array<std::byte, 65536> sink{};
  for (int round = 0; round < 100000; ++round) {
    feed(theirs.get(), input, ended);
    // What the engine sends (statements, the send) is read and dropped.
    while (::recv(theirs.get(), sink.data(), sink.size(), MSG_DONTWAIT) > 0) {
    }
    bool pending = false;
    for (auto& o : ops) {
      if (!o) continue;
      try {
        if (eng->test(o)) o = nullptr;
      } catch (const ringzero::error&) {
        o = nullptr;
      }
      pending = pending || o != nullptr;
    }
    // Once the stream ended the peer is gone, and every operation ended with it.
    if (!pending) return;
  }
  std::abort();  // the stream ended long ago: an operation never did
}

void handshake(std::span<const std::uint8_t> input) {
  auto [mine, theirs] = socket_pair();
  d::handshake_terms terms{.rank = 1, .size = 2, .generation = 0};
  terms.secret.fill(std::byte{0x2a});
  auto h = d::handshake::accepting(std::move(mine), 0, terms, "fuzz");
  bool ended = false;
  std::array<std::byte, 256> sink{};
  for (int round = 0; round < 100000; ++round) {
    feed(theirs.get(), input, ended);
    while (::recv(theirs.get(), sink.data(), sink.size(), MSG_DONTWAIT) > 0) {
    }
    const auto o = h.step([](int, int) { return false; });
    if (o == d::handshake::outcome::done) std::abort();  // it cannot know the secret
    if (o != d::handshake::outcome::working) return;
  }
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // The engine logs every violation it finds: too many lines for a fuzzer's log.
  ringzero::log::set_level(ringzero::log::level::none);
  if (size == 0) return 0;
  const std::span<const std::uint8_t> rest(data + 1, size - 1);
  if (data[0] % 2 == 0)
    frames(rest);
  else
    handshake(rest);
  return 0;
}
