// Training state kept in peers' memory (zero/peer_snapshot.hpp): after losing ranks, the
// survivors' copies give back exactly the state a checkpoint on disk gives, at the new world
// size and any stage; losses that leave a shard nowhere are reported on every rank alike.
#include <doctest/doctest.h>

#include "zero_harness.hpp"

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace zero = ringzero::zero;

namespace {

zt::zero::model_layout model() {
  return zt::make_layout<float>({{37, 5}, {129}, {3, 61, 1}});
}

struct scratch {
  fs::path dir =
      fs::temp_directory_path() / ("ringzero-peer-snapshot-" + std::to_string(::getpid()));
  ~scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

// The images of the ranks not in `lost`, in rank order: what the survivors hold.
std::vector<zero::checkpoint_image> survivors(const std::vector<zero::checkpoint_image>& all,
                                              const std::vector<int>& lost) {
  std::vector<zero::checkpoint_image> out;
  for (int r = 0; r < static_cast<int>(all.size()); ++r)
    if (std::find(lost.begin(), lost.end(), r) == lost.end())
      out.push_back(all[static_cast<std::size_t>(r)]);
  return out;
}

}  // namespace

TEST_CASE("a snapshot kept with a ring peer survives any one loss, bitwise as the disk") {
  for (const int stage : {1, 3}) {
    CAPTURE(stage);
    scratch s;
    // 4 ranks train 3 steps, then both save to disk and keep a snapshot with a peer.
    std::vector<zero::checkpoint_image> images(4);
    zt::run_options o;
    o.world = 4;
    o.stage = stage;
    o.steps = 3;
    o.save_dir = s.dir;
    o.snapshots = &images;
    const auto before = zt::train<float>(model(), o);
    for (const auto& img : images) {
      CHECK(img.files.size() == 2);  // its own shard and its predecessor's
      CHECK(img.bytes() > 0);
    }
    // What the disk gives 3 ranks, 2 more steps on.
    zt::run_options d;
    d.world = 3;
    d.stage = 3 - stage + 1;
    d.steps = 2;
    d.load_dir = s.dir;
    const auto from_disk = zt::train<float>(model(), d);
    for (const int lost : {0, 1, 3}) {
      CAPTURE(lost);
      const auto held = survivors(images, {lost});
      zt::run_options m = d;
      m.load_dir.clear();
      m.load_snapshots = &held;
      const auto from_memory = zt::train<float>(model(), m);
      CHECK(from_memory.step_count == before.step_count + 2);
      for (int r = 0; r < 3; ++r)
        CHECK(from_memory.params[static_cast<std::size_t>(r)] ==
              from_disk.params[static_cast<std::size_t>(r)]);
    }
  }
}

TEST_CASE("two losses that are ring neighbours leave a shard nowhere: refused on every rank") {
  std::vector<zero::checkpoint_image> images(4);
  zt::run_options o;
  o.world = 4;
  o.steps = 1;
  o.snapshots = &images;
  (void)zt::train<float>(model(), o);
  // Ranks 1 and 2: rank 1's shard lived on 1 and 2. Ranks 1 and 3 are not neighbours.
  const auto held = survivors(images, {1, 2});
  zt::run_options m;
  m.world = 2;
  m.steps = 0;
  m.load_snapshots = &held;
  CHECK_THROWS_AS((void)zt::train<float>(model(), m), ringzero::checkpoint_error);
  const auto apart = survivors(images, {1, 3});
  m.load_snapshots = &apart;
  CHECK(zt::train<float>(model(), m).step_count == 1);
}

TEST_CASE("an arrival with no snapshot takes part, and a corrupt copy counts as none") {
  std::vector<zero::checkpoint_image> images(2);
  zt::run_options o;
  o.world = 2;
  o.steps = 2;
  o.snapshots = &images;
  const auto before = zt::train<float>(model(), o);
  std::vector<zero::checkpoint_image> held = {images[0], images[1], {}};
  zt::run_options m;
  m.world = 3;
  m.steps = 0;
  m.load_snapshots = &held;
  const auto grown = zt::train<float>(model(), m);
  CHECK(grown.step_count == 2);
  CHECK(grown.params[2] == before.params[0]);
  // Every copy of shard 0 corrupt: refused, naming the shard.
  for (auto& img : held)
    for (auto& [name, bytes] : img.files)
      if (name.starts_with("shard-00000") && bytes.size() > 100) bytes[100] ^= std::byte{1};
  try {
    (void)zt::train<float>(model(), m);
    FAIL("a corrupt snapshot loaded");
  } catch (const ringzero::checkpoint_error& e) {
    CHECK(std::string(e.what()).find("shard-00000") != std::string::npos);
  }
}
