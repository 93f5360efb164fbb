// A transport written against the concept 0.2 documented (transport/concept.hpp, "Adding a
// transport" in docs/architecture.md): rank, size, isend/irecv returning a move-only request,
// test, progress, and tuning() returning a ringzero::cost_params; and a loopback world tuned
// through world_options::cost, read back through communicator::cost(). 0.3 renamed these
// without aliases; the deprecated aliases keep such code compiling, with warnings.
#include <ringzero/ringzero.hpp>

#include <fmt/core.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <vector>

namespace {

void expect(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(fmt::format("own_transport: expected {}", what));
}

// Messages between the threads of one process: (from, to, tag) -> payloads in posting order.
struct mailbox {
  std::mutex mutex;
  std::map<std::tuple<int, int, ringzero::tag_t>, std::deque<std::vector<std::byte>>> queued;
};

class pair_transport {
 public:
  class request {
   public:
    request() = default;
    request(request&&) = default;
    request& operator=(request&&) = default;

   private:
    friend class pair_transport;
    bool is_recv = false;
    int peer = 0;
    ringzero::tag_t tag = 0;
    std::span<std::byte> into{};
  };

  pair_transport(std::shared_ptr<mailbox> box, int rank) : box_(std::move(box)), rank_(rank) {}

  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return 2; }
  [[nodiscard]] ringzero::cost_params tuning() const {
    ringzero::cost_params p;
    p.alpha = 3e-6;
    return p;
  }

  request isend(int peer, ringzero::tag_t tag, std::span<const std::byte> data) {
    std::lock_guard lock(box_->mutex);
    box_->queued[{rank_, peer, tag}].emplace_back(data.begin(), data.end());
    return {};
  }
  request irecv(int peer, ringzero::tag_t tag, std::span<std::byte> data) {
    request r;
    r.is_recv = true;
    r.peer = peer;
    r.tag = tag;
    r.into = data;
    return r;
  }
  bool test(request& r) {
    if (!r.is_recv) return true;
    std::lock_guard lock(box_->mutex);
    auto& q = box_->queued[{r.peer, rank_, r.tag}];
    if (q.empty()) return false;
    if (q.front().size() != r.into.size())
      throw ringzero::transport_error("own_transport: a message of another size");
    std::memcpy(r.into.data(), q.front().data(), r.into.size());
    q.pop_front();
    r.is_recv = false;
    return true;
  }
  void progress() {}

 private:
  std::shared_ptr<mailbox> box_;
  int rank_;
};

static_assert(ringzero::transport<pair_transport> && ringzero::messaging<pair_transport>);

}  // namespace

int main() {
  try {
    auto box = std::make_shared<mailbox>();
    std::vector<float> sums[2];
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r)
      ranks.emplace_back([&, r] {
        ringzero::communicator<pair_transport> comm(pair_transport(box, r));
        std::vector<float> v(5000, static_cast<float>(r + 1));
        ringzero::all_reduce(comm, std::span<float>(v), ringzero::op::sum);
        sums[r] = v;
      });
    for (auto& t : ranks) t.join();
    for (const auto& s : sums)
      for (float x : s) expect(x == 3.0f, "1 + 2 in every element, on both ranks");

    ringzero::loopback::world_options opts;
    ringzero::cost_params slow;
    slow.alpha = 7e-5;
    opts.cost = slow;
    ringzero::loopback::world world(2, opts);
    world.run([](ringzero::loopback::communicator& comm) {
      expect(comm.cost().alpha == 7e-5, "the policy set through world_options::cost");
      const ringzero::tuning_policy& same = comm.tuning();
      expect(same.alpha == 7e-5, "tuning_policy naming the same policy");
    });
    std::puts("own_transport: a 0.2 transport and a 0.2-tuned loopback world ran");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
