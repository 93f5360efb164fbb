// The checkpoint's four parts, each on its own and through its own header only: the shard file,
// the manifest, the resharding reader and the commit. (checkpoint_test.cpp drives them together
// through the sharder.)
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "ringzero/transport/loopback.hpp"
#include "ringzero/zero/checkpoint/commit.hpp"
#include "ringzero/zero/checkpoint/manifest.hpp"
#include "ringzero/zero/checkpoint/reshard.hpp"
#include "ringzero/zero/checkpoint/shard_file.hpp"

namespace fs = std::filesystem;
namespace zero = ringzero::zero;
using zero::checkpoint_manifest;
using zero::optimizer_kind;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("ringzero-ckpt-parts-" + std::to_string(::getpid())) / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

struct cleanup {
  ~cleanup() {
    std::error_code ec;
    fs::remove_all(
        fs::temp_directory_path() / ("ringzero-ckpt-parts-" + std::to_string(::getpid())), ec);
  }
} const removed_at_exit;

std::vector<std::byte> file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  std::memcpy(out.data(), c.data(), c.size());
  return out;
}

zero::model_layout layout() {
  zero::model_layout l;
  l.add({.name = "a", .shape = {37, 5}});
  l.add({.name = "b", .shape = {129}, .weight_decay = false});
  l.add({.name = "c", .shape = {3, 61}});
  return l;
}

/// The value array `array` holds for element `i` of parameter `p`, whatever the layout.
float value(std::size_t p, std::size_t i, int array) {
  return static_cast<float>(p * 1000 + i) + 0.25f * static_cast<float>(array);
}

/// Rank r's shard arrays of `plan`: every parameter element at its place, padding zero.
std::vector<std::vector<float>> shard_arrays(const zero::partition_plan& plan, int r, int arrays) {
  std::vector<std::vector<float>> out(static_cast<std::size_t>(arrays),
                                      std::vector<float>(plan.shard_size(), 0.0f));
  for (const auto& b : plan.buckets())
    for (std::size_t j = 0; j < b.slice; ++j) {
      const std::size_t flat = b.offset + static_cast<std::size_t>(r) * b.slice + j;
      for (std::size_t p = 0; p < plan.params().size(); ++p) {
        const auto& info = plan.params()[p];
        if (flat >= info.offset && flat < info.offset + info.numel)
          for (int a = 0; a < arrays; ++a)
            out[static_cast<std::size_t>(a)][b.shard_offset + j] = value(p, flat - info.offset, a);
      }
    }
  return out;
}

/// A whole checkpoint of `plan` in memory, as its ranks would save it.
zero::checkpoint_image image_of(const zero::partition_plan& plan, optimizer_kind kind,
                                std::uint64_t step) {
  const int arrays = kind == optimizer_kind::adamw ? 3 : 2;
  zero::checkpoint_image img;
  std::vector<std::uint64_t> written;
  for (int r = 0; r < plan.world_size(); ++r) {
    const auto bytes = zero::detail::shard_image(r, plan.world_size(), step,
                                                 shard_arrays(plan, r, arrays), plan.shard_size());
    const std::uint64_t id = 0x1000 + static_cast<std::uint64_t>(r);
    written.insert(written.end(), {bytes.size(), zero::detail::crc32c(bytes), id});
    img.files[zero::detail::shard_file_name(r, plan.world_size(), step, id)] = bytes;
  }
  img.manifest =
      zero::make_manifest(plan, 2, ringzero::dtype::float32, kind, {.step = step}, {}, written)
          .serialize();
  return img;
}

}  // namespace

// --- shard file ---------------------------------------------------------------------------------

TEST_CASE("shard file: written atomically as its image, and recognised only as itself") {
  const fs::path dir = fresh_dir("shard");
  const std::vector<std::vector<float>> arrays = {{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}};
  const auto w = zero::detail::write_shard(dir, 1, 4, 120, 0xabc, arrays, 5);
  const fs::path path = dir / zero::detail::shard_file_name(1, 4, 120, 0xabc);
  CHECK(path.filename() == "shard-00001-of-00004.step-120.0000000000000abc.bin");
  const auto bytes = file_bytes(path);
  CHECK(bytes == zero::detail::shard_image(1, 4, 120, arrays, 5));
  CHECK(w.bytes == bytes.size());
  CHECK(w.crc == zero::detail::crc32c(bytes));
  CHECK(bytes.size() == zero::detail::shard_header_bytes + 2 * 5 * sizeof(float));
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);

  CHECK(zero::detail::shard_matches(bytes, 1, 4, 120, 2, 5));
  CHECK_FALSE(zero::detail::shard_matches(bytes, 0, 4, 120, 2, 5));
  CHECK_FALSE(zero::detail::shard_matches(bytes, 1, 3, 120, 2, 5));
  CHECK_FALSE(zero::detail::shard_matches(bytes, 1, 4, 121, 2, 5));
  CHECK_FALSE(zero::detail::shard_matches(bytes, 1, 4, 120, 3, 5));
  CHECK_FALSE(
      zero::detail::shard_matches(std::span(bytes).first(bytes.size() - 1), 1, 4, 120, 2, 5));
  // Sizes from a corrupt manifest must not wrap into a match.
  CHECK_FALSE(zero::detail::shard_matches(bytes, 1, 4, 120, 2,
                                          std::numeric_limits<std::size_t>::max() / 2));
  auto foreign = bytes;
  foreign[0] = std::byte{'X'};
  CHECK_FALSE(zero::detail::shard_matches(foreign, 1, 4, 120, 2, 5));

  CHECK_THROWS_AS((void)zero::detail::shard_image(0, 1, 0, arrays, 4), ringzero::invalid_argument);
}

// --- manifest -----------------------------------------------------------------------------------

TEST_CASE("manifest: what make_manifest builds reads back equal, and a flipped byte is caught") {
  const zero::partition_plan plan(layout(), 3, 64);
  for (const optimizer_kind kind : {optimizer_kind::adamw, optimizer_kind::sgd}) {
    const std::vector<std::uint64_t> written = {100, 0xdeadbeef, 1, 200, 0x1234, 2, 300, 7, 3};
    const auto m =
        zero::make_manifest(plan, 3, ringzero::dtype::bfloat16, kind,
                            {.step = 9, .optimizer_steps = 8, .loss_scale = 512, .good_steps = 4},
                            {{"default", 0.5f}}, written);
    const std::string text = m.serialize();
    const auto back = checkpoint_manifest::parse(text, "m.txt");
    CHECK(back.serialize() == text);
    CHECK(back.world_size == 3);
    CHECK(back.stage == 3);
    CHECK(back.precision == ringzero::dtype::bfloat16);
    CHECK(back.step == 9);
    CHECK(back.optimizer_steps == 8);
    CHECK(back.loss_scale == 512);
    CHECK(back.good_steps == 4);
    CHECK(back.optimizer == kind);
    // The master weights, then the optimizer's moments by the names its descriptor gives.
    const zero::optimizer_descriptor& d = zero::describe(kind);
    REQUIRE(back.arrays.size() == 1 + static_cast<std::size_t>(d.moments));
    CHECK(back.arrays[0] == "master");
    for (int i = 0; i < d.moments; ++i)
      CHECK(back.arrays[static_cast<std::size_t>(i) + 1] ==
            d.moment_names[static_cast<std::size_t>(i)]);
    CHECK(back.arrays.size() == (kind == optimizer_kind::adamw ? 3u : 2u));
    REQUIRE(back.shards.size() == 3);
    CHECK(back.shards[1].bytes == 200);
    CHECK(back.shards[1].crc == 0x1234);
    CHECK(back.shards[2].file == zero::detail::shard_file_name(2, 3, 9, 3));
    REQUIRE(back.groups.size() == 1);
    CHECK(back.groups[0].lr == 0.5f);
    CHECK(back.find("b") == 1);
    CHECK(back.params[1].weight_decay == false);
    CHECK_NOTHROW(zero::check_compatible(back, plan, kind, "d"));
    const optimizer_kind other =
        kind == optimizer_kind::adamw ? optimizer_kind::sgd : optimizer_kind::adamw;
    CHECK_THROWS_AS(zero::check_compatible(back, plan, other, "d"), ringzero::checkpoint_error);

    std::string bad = text;
    bad[text.find("param b") + 6] = 'B';
    try {
      (void)checkpoint_manifest::parse(bad, "m.txt");
      FAIL("a corrupt manifest parsed");
    } catch (const ringzero::checkpoint_error& e) {
      CHECK(std::string(e.what()).find("m.txt is corrupt") != std::string::npos);
    }
  }
  zero::model_layout wider = layout();
  wider.add({.name = "d", .shape = {2}});
  const auto m = checkpoint_manifest::parse(image_of(plan, optimizer_kind::adamw, 1).manifest, "x");
  CHECK_THROWS_AS(
      zero::check_compatible(m, zero::partition_plan(wider, 3, 64), optimizer_kind::adamw, "d"),
      ringzero::checkpoint_error);
}

// --- resharding reader --------------------------------------------------------------------------

TEST_CASE("reshard: every element reads back the same from any world size and bucket size") {
  for (const auto& target :
       {std::pair{1, 0}, std::pair{2, 64}, std::pair{3, 100}, std::pair{5, 0}, std::pair{7, 16}}) {
    // Variables, not structured bindings: CAPTURE captures them.
    const int world = target.first, bucket = target.second;
    CAPTURE(world);
    CAPTURE(bucket);
    const zero::partition_plan plan(layout(), world, static_cast<std::size_t>(bucket));
    const auto img = image_of(plan, optimizer_kind::adamw, 4);
    const zero::checkpoint_reader reader(img);
    const auto all = reader.read_all_parameters();
    REQUIRE(all.size() == 3);
    for (std::size_t p = 0; p < all.size(); ++p)
      for (std::size_t i = 0; i < all[p].size(); ++i) REQUIRE(all[p][i] == value(p, i, 0));
    // A piece of a moment that crosses shard boundaries.
    std::vector<float> piece(150);
    const zero::checkpoint_reader::request rq{
        .param = 0, .begin = 20, .count = 150, .array = 2, .dst = piece.data()};
    reader.read(std::span(&rq, 1));
    for (std::size_t i = 0; i < piece.size(); ++i) REQUIRE(piece[i] == value(0, 20 + i, 2));
    const zero::checkpoint_reader::request outside{
        .param = 1, .begin = 100, .count = 30, .array = 0, .dst = piece.data()};
    CHECK_THROWS_AS(reader.read(std::span(&outside, 1)), ringzero::invalid_argument);
  }
}

TEST_CASE("reshard: a shard that is missing, short, corrupt or foreign is named") {
  const zero::partition_plan plan(layout(), 3, 64);
  const auto good = image_of(plan, optimizer_kind::sgd, 2);
  const std::string name1 = zero::detail::shard_file_name(1, 3, 2, 0x1001);
  REQUIRE(good.files.contains(name1));
  const auto message = [](const zero::checkpoint_image& img) -> std::string {
    try {
      (void)zero::checkpoint_reader(img).read_all_parameters();
      return "";
    } catch (const ringzero::checkpoint_error& e) {
      return e.what();
    }
  };
  auto missing = good;
  missing.files.erase(name1);
  CHECK(message(missing).find(name1 + " (rank 1 of 3) is not held") != std::string::npos);
  auto shorter = good;
  shorter.files[name1].pop_back();
  CHECK(message(shorter).find("the manifest says") != std::string::npos);
  auto corrupt = good;
  corrupt.files[name1][zero::detail::shard_header_bytes + 3] ^= std::byte{1};
  CHECK(message(corrupt).find(name1 + " is corrupt") != std::string::npos);
  CHECK(message(good).empty());
}

// --- commit -------------------------------------------------------------------------------------

TEST_CASE("commit: the manifest goes in last, then what no manifest lists is removed") {
  const fs::path dir = fresh_dir("commit");
  const zero::partition_plan plan(layout(), 2, 0);
  const auto img = image_of(plan, optimizer_kind::adamw, 5);
  for (const auto& [name, bytes] : img.files)
    zero::detail::write_file_atomic(dir / name, {std::span<const std::byte>(bytes)});
  const auto touch = [&](const std::string& name) { std::ofstream(dir / name) << "x"; };
  touch("shard-00000-of-00002.step-4.00000000000000aa.bin");  // the previous save's
  touch(std::string("shard-00001-of-00002.step-5.bin") + zero::detail::temporary_marker + "77");
  touch(std::string(zero::manifest_file_name) + zero::detail::temporary_marker + "78");
  touch("notes.txt");  // not ours

  const auto m = checkpoint_manifest::parse(img.manifest, "image");
  zero::detail::commit_manifest(dir, m);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  std::vector<std::string> want = {zero::manifest_file_name, "notes.txt"};
  for (const auto& sh : m.shards) want.push_back(sh.file);
  std::sort(want.begin(), want.end());
  CHECK(left == want);
  CHECK(checkpoint_manifest::read(dir).serialize() == img.manifest);
  CHECK(zero::checkpoint_reader(dir).read_all_parameters() ==
        zero::checkpoint_reader(img).read_all_parameters());

  // A failed save's shard goes, unless the manifest in place lists it.
  touch("shard-00000-of-00002.step-6.00000000000000bb.bin");
  zero::detail::discard_failed_shard(dir, "shard-00000-of-00002.step-6.00000000000000bb.bin");
  CHECK_FALSE(fs::exists(dir / "shard-00000-of-00002.step-6.00000000000000bb.bin"));
  zero::detail::discard_failed_shard(dir, m.shards[0].file);
  CHECK(fs::exists(dir / m.shards[0].file));
  zero::detail::discard_failed_shard(dir, "");
  CHECK(fs::exists(dir / "notes.txt"));
}

TEST_CASE("commit: a collective save every rank agrees on, read back at another world size") {
  const fs::path dir = fresh_dir("collective");
  const ringzero::options gather{};
  const auto save = [&](ringzero::loopback::communicator& comm, std::uint64_t step,
                        int failing_rank) {
    const zero::partition_plan plan(layout(), comm.size(), 64);
    auto run = [&](auto&& f) { return f(comm); };
    zero::save_checkpoint(
        run, gather, dir, plan, comm.rank(), step,
        [&] {
          if (comm.rank() == failing_rank) throw std::runtime_error("disk full on this rank");
          return shard_arrays(plan, comm.rank(), 3);
        },
        [&](const std::vector<std::uint64_t>& written) {
          return zero::make_manifest(plan, 2, ringzero::dtype::float32, optimizer_kind::adamw,
                                     {.step = step}, {}, written);
        },
        [](std::uint64_t) {});
  };
  ringzero::loopback::world(3).run(
      [&](ringzero::loopback::communicator& comm) { save(comm, 1, -1); });
  const std::string first = checkpoint_manifest::read(dir).serialize();

  // Rank 2 fails the next save: every rank raises its message, and the first save stays in place.
  std::vector<std::string> errors(3);
  ringzero::loopback::world(3).run([&](ringzero::loopback::communicator& comm) {
    try {
      save(comm, 2, 2);
    } catch (const ringzero::checkpoint_error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors) CHECK(e.find("disk full on this rank") != std::string::npos);
  CHECK(errors[0].find("(reported by rank 2)") != std::string::npos);
  CHECK(checkpoint_manifest::read(dir).serialize() == first);
  for (const auto& e : fs::directory_iterator(dir))
    CHECK(e.path().filename().string().find("step-2") == std::string::npos);

  // Read back on 2 ranks, into their own layout.
  ringzero::loopback::world(2).run([&](ringzero::loopback::communicator& comm) {
    const zero::partition_plan plan(layout(), 2, 32);
    std::vector<float> b(129);
    auto run = [&](auto&& f) { return f(comm); };
    const auto m = zero::read_checkpoint(
        run, gather, dir, plan, optimizer_kind::adamw, [&](const checkpoint_manifest& mf) {
          return std::vector<zero::checkpoint_reader::request>{
              {.param = mf.find("b"), .begin = 0, .count = 129, .array = 1, .dst = b.data()}};
        });
    CHECK(m.step == 1);
    for (std::size_t i = 0; i < b.size(); ++i) REQUIRE(b[i] == value(1, i, 1));
  });
}
