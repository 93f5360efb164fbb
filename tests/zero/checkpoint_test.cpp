#include <doctest/doctest.h>

#include "zero_harness.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ringzero/zero/checkpoint.hpp>

namespace fs = std::filesystem;
using ringzero::bfloat16;
using ringzero::float16;

namespace {

// A scratch directory per test program, removed at exit.
struct scratch {
  fs::path root = fs::temp_directory_path() / ("ringzero-zero-ckpt-" + std::to_string(::getpid()));
  scratch() { fs::create_directories(root); }
  ~scratch() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  fs::path fresh(const std::string& name) const {
    fs::remove_all(root / name);
    return root / name;
  }
};

const scratch& dirs() {
  static const scratch s;
  return s;
}

template <class P>
zt::zero::model_layout model() {
  return zt::make_layout<P>({{37, 5}, {129}, {3, 61, 1}});
}

/// A 4-rank stage-2 run of 3 steps saved to `dir`; returns its weights.
template <class P>
std::vector<float> saved_run(const fs::path& dir,
                             zt::zero::optimizer_kind opt = zt::zero::optimizer_kind::adamw) {
  zt::run_options o;
  o.world = 4;
  o.stage = 2;
  o.steps = 3;
  o.optimizer = opt;
  o.save_dir = dir;
  return zt::train<P>(model<P>(), o).params[0];
}

/// Runs a load at (world, stage) and returns the error message, or "" if it loaded.
std::string load_error(const fs::path& dir, int world, int stage) {
  zt::run_options o;
  o.world = world;
  o.stage = stage;
  o.steps = 0;
  o.load_dir = dir;
  try {
    (void)zt::train<float>(model<float>(), o);
  } catch (const ringzero::checkpoint_error& e) {
    return e.what();
  }
  return "";
}

void flip_byte(const fs::path& file, std::size_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

fs::path shard_file(const fs::path& dir, int rank) {
  for (const auto& e : fs::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    if (name.starts_with(fmt::format("shard-{:05}-", rank)) && name.ends_with(".bin"))
      return e.path();
  }
  return {};
}

}  // namespace

TEST_CASE("a checkpoint loads at another world size and stage with the same weights") {
  const auto dir = dirs().fresh("roundtrip");
  const auto saved = saved_run<float>(dir);
  const auto m = zt::zero::checkpoint_manifest::read(dir);
  CHECK(m.world_size == 4);
  CHECK(m.stage == 2);
  CHECK(m.step == 3);
  CHECK(m.shards.size() == 4);
  const std::pair<int, int> targets[] = {{4, 2}, {2, 3}, {3, 1}, {1, 0}, {5, 2}, {4, 0}};
  for (const auto& target : targets) {
    // Variables, not structured bindings: CAPTURE captures them.
    const int world = target.first, stage = target.second;
    CAPTURE(world);
    CAPTURE(stage);
    zt::run_options o;
    o.world = world;
    o.stage = stage;
    o.steps = 0;
    o.load_dir = dir;
    const auto got = zt::train<float>(model<float>(), o);
    CHECK(got.step_count == 3);
    for (const auto& p : got.params) CHECK(p == saved);
  }
}

TEST_CASE("resuming continues the run: bitwise at the same world size, to tolerance at another") {
  const auto dir = dirs().fresh("resume");
  zt::run_options o;
  o.world = 4;
  o.stage = 2;
  o.steps = 6;
  const auto uninterrupted = zt::train<float>(model<float>(), o);
  (void)saved_run<float>(dir);  // the first 3 of those steps
  o.steps = 3;
  o.load_dir = dir;
  o.stage = 3;  // a different stage, same world size: the same bits
  const auto same = zt::train<float>(model<float>(), o);
  CHECK(same.step_count == 6);
  CHECK(same.params[0] == uninterrupted.params[0]);
  for (std::size_t s = 0; s < 3; ++s)
    CHECK(same.steps[s].grad_norm == uninterrupted.steps[s + 3].grad_norm);
  o.world = 2;
  o.stage = 1;
  const auto fewer = zt::train<float>(model<float>(), o);
  const double d = zt::max_rel_diff(fewer.params[0], uninterrupted.params[0]);
  CHECK_MESSAGE(d < 1e-5, "resumed at 2 ranks: max relative difference ", d);
}

TEST_CASE("a bf16 checkpoint keeps the fp32 master weights, and fp16 keeps its loss scale") {
  const auto dir = dirs().fresh("precision");
  const auto saved = saved_run<bfloat16>(dir);
  zt::run_options o;
  o.world = 2;
  o.stage = 3;
  o.steps = 0;
  o.load_dir = dir;
  CHECK(zt::train<float>(model<float>(), o).params[1] == saved);

  const auto dir16 = dirs().fresh("fp16");
  (void)saved_run<float16>(dir16);  // scale 1024, doubled after steps 2 (growth interval 2)
  const auto m = zt::zero::checkpoint_manifest::read(dir16);
  CHECK(m.loss_scale == 2048.0f);
  CHECK(m.good_steps == 1);
  o.load_dir = dir16;
  o.steps = 2;
  const auto resumed = zt::train<float16>(model<float16>(), o);
  CHECK(resumed.steps[0].loss_scale == 2048.0f);
  CHECK(resumed.steps[1].loss_scale == 4096.0f);
}

TEST_CASE("a corrupt, incomplete or foreign checkpoint is refused with the file named") {
  const auto good = dirs().fresh("good");
  (void)saved_run<float>(good);
  auto copy = [&](const std::string& name) {
    const auto d = dirs().fresh(name);
    fs::copy(good, d);
    return d;
  };
  SUBCASE("a flipped byte in a shard") {
    const auto d = copy("corrupt");
    const auto f = shard_file(d, 2);
    flip_byte(f, fs::file_size(f) / 2);
    for (auto [world, stage] : {std::pair{2, 3}, std::pair{4, 0}}) {
      const auto e = load_error(d, world, stage);
      CHECK_MESSAGE(e.find(f.filename().string()) != std::string::npos, "error: ", e);
      CHECK(e.find("corrupt") != std::string::npos);
    }
  }
  SUBCASE("a missing shard") {
    const auto d = copy("missing");
    const auto f = shard_file(d, 1);
    fs::remove(f);
    const auto e = load_error(d, 3, 2);
    CHECK_MESSAGE(e.find(f.filename().string()) != std::string::npos, "error: ", e);
    CHECK(e.find("missing") != std::string::npos);
  }
  SUBCASE("a truncated shard") {
    const auto d = copy("truncated");
    const auto f = shard_file(d, 3);
    fs::resize_file(f, fs::file_size(f) - 4);
    const auto e = load_error(d, 2, 1);
    CHECK_MESSAGE(e.find(f.filename().string()) != std::string::npos, "error: ", e);
  }
  SUBCASE("no manifest") {
    const auto d = copy("nomanifest");
    fs::remove(d / "manifest.txt");
    CHECK(load_error(d, 2, 2).find("manifest.txt is missing") != std::string::npos);
  }
  SUBCASE("a corrupt manifest") {
    const auto d = copy("badmanifest");
    flip_byte(d / "manifest.txt", 40);
    const auto e = load_error(d, 2, 2);
    CHECK_MESSAGE(e.find("manifest.txt is corrupt") != std::string::npos, "error: ", e);
  }
  SUBCASE("another optimizer's state") {
    zt::run_options o;
    o.world = 2;
    o.steps = 0;
    o.load_dir = good;
    o.optimizer = zt::zero::optimizer_kind::sgd;
    CHECK_THROWS_AS((void)zt::train<float>(model<float>(), o), ringzero::checkpoint_error);
  }
  SUBCASE("another model") {
    zt::run_options o;
    o.world = 2;
    o.steps = 0;
    o.load_dir = good;
    CHECK_THROWS_AS((void)zt::train<float>(zt::make_layout<float>({{37, 5}, {128}, {3, 61, 1}}), o),
                    ringzero::checkpoint_error);
  }
}

TEST_CASE("saving again replaces the checkpoint and removes the old shard files") {
  const auto dir = dirs().fresh("again");
  (void)saved_run<float>(dir);
  zt::run_options o;
  o.world = 2;
  o.stage = 1;
  o.steps = 1;
  o.load_dir = dir;
  o.save_dir = dir;
  const auto after = zt::train<float>(model<float>(), o);
  const auto m = zt::zero::checkpoint_manifest::read(dir);
  CHECK(m.world_size == 2);
  CHECK(m.step == 4);
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir))
    files += e.path().filename().string().starts_with("shard-");
  CHECK(files == 2);
  const zt::zero::checkpoint_reader reader(dir);
  std::vector<float> flat;
  for (const auto& p : reader.read_all_parameters()) flat.insert(flat.end(), p.begin(), p.end());
  CHECK(flat == after.params[0]);
}

TEST_CASE("export_fp32 writes the full model as one safetensors file") {
  const auto dir = dirs().fresh("export");
  const auto saved = saved_run<bfloat16>(dir);
  const auto out = dirs().root / "model.safetensors";
  const auto bytes = zt::zero::export_fp32(dir, out);
  CHECK(bytes == fs::file_size(out));
  std::ifstream f(out, std::ios::binary);
  std::uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  f.read(header.data(), static_cast<std::streamsize>(header_len));
  CHECK(header_len % 8 == 0);
  CHECK(header.find(R"("l0.p0":{"dtype":"F32","shape":[37],"data_offsets":[0,148]})") !=
        std::string::npos);
  CHECK(header.find(R"("l2.p2":{"dtype":"F32","shape":[1],)") != std::string::npos);
  std::vector<float> data(saved.size());
  f.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(data.size() * 4));
  CHECK(f.gcount() == static_cast<std::streamsize>(data.size() * 4));
  CHECK(data == saved);
  CHECK(8 + header_len + data.size() * 4 == bytes);
}

TEST_CASE("saving the same step again writes new shard files, never over the live ones") {
  const auto dir = dirs().fresh("same_step");
  (void)saved_run<float>(dir);
  const auto before = zt::zero::checkpoint_manifest::read(dir);
  zt::run_options o;
  o.world = 4;
  o.stage = 2;
  o.steps = 0;
  o.load_dir = dir;
  o.save_dir = dir;
  (void)zt::train<float>(model<float>(), o);
  const auto after = zt::zero::checkpoint_manifest::read(dir);
  REQUIRE(after.step == before.step);
  for (const auto& a : after.shards)
    for (const auto& b : before.shards)
      CHECK_MESSAGE(a.file != b.file, "the second save of step ", after.step, " reused ", a.file);
}

TEST_CASE("a directory that cannot be created is reported as such") {
  const auto root = dirs().fresh("not_a_dir");
  fs::create_directories(root);
  std::ofstream(root / "file") << "x";
  zt::run_options o;
  o.world = 2;
  o.steps = 1;
  o.save_dir = root / "file" / "ckpt";
  CHECK_THROWS_WITH_AS((void)zt::train<float>(model<float>(), o),
                       doctest::Contains("cannot create the checkpoint directory"),
                       ringzero::checkpoint_error);
}

TEST_CASE("manifest: group learning rates round-trip; a version-1 checkpoint (no groups) loads") {
  using manifest = ringzero::zero::checkpoint_manifest;
  namespace zero = ringzero::zero;
  const auto dir = dirs().fresh("groups");
  const auto layout = zt::make_layout<float>({{37, 5}, {129}, {3, 61, 1}},
                                             [](int layer, int) { return layer == 1 ? 1 : 0; });
  zt::run_options o;
  o.configure = [](zero::config& c) {
    c.groups = {{.name = "decay"}, {.name = "no_decay", .lr = 0.1f}};
  };
  o.save_dir = dir;
  (void)zt::train<float>(layout, o);
  const auto m = manifest::read(dir);
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[0].name == "decay");
  CHECK(m.groups[0].lr == 0.05f);  // the harness's base rate
  CHECK(m.groups[1].name == "no_decay");
  CHECK(m.groups[1].lr == 0.1f);

  // The same checkpoint as version 1 wrote it: no groups line, its own checksum.
  auto rewrite = [](const fs::path& file, int version, bool drop_groups) {
    std::ifstream in(file, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    text.erase(text.rfind("crc32c "));
    text.replace(text.find("checkpoint 2"), 12, fmt::format("checkpoint {}", version));
    if (drop_groups) {
      const auto g = text.find("groups 2\n");
      REQUIRE(g != std::string::npos);
      text.erase(g, text.find("buckets ") - g);
    }
    text += fmt::format("crc32c {:08x}\n", zero::detail::crc32c(std::as_bytes(std::span(text))));
    std::ofstream(file, std::ios::binary | std::ios::trunc) << text;
  };
  const auto v1 = dirs().fresh("groups-v1");
  fs::copy(dir, v1);
  rewrite(v1 / "manifest.txt", 1, true);
  CHECK(manifest::read(v1).groups.empty());
  o.save_dir.clear();
  o.load_dir = v1;
  const auto from_v1 = zt::train<float>(layout, o);
  o.load_dir = dir;
  const auto from_v2 = zt::train<float>(layout, o);
  CHECK(from_v1.step_count == 6);
  CHECK(from_v1.params[0] == from_v2.params[0]);

  const auto v3 = dirs().fresh("groups-v3");
  fs::copy(dir, v3);
  rewrite(v3 / "manifest.txt", 3, false);
  CHECK_THROWS_WITH_AS((void)manifest::read(v3), doctest::Contains("format version 3"),
                       ringzero::checkpoint_error);
}

TEST_CASE("a save that fails on one rank leaves no shard of it behind, and the last save intact") {
  // Rank 1 cannot write (its disk is full); rank 0 wrote its shard under its final name before
  // the save failed. That file must go, or the disk stays full until a later save succeeds;
  // the previous checkpoint's files stay, and it still loads.
  const auto dir = dirs().fresh("full");
  (void)saved_run<float>(dir);
  const auto shard_files = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().starts_with("shard-"))
        names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  const auto before = shard_files();
  REQUIRE(before.size() == 4);
  const auto layout = model<float>();
  const zt::zero::partition_plan plan(layout, 2, 0);
  ringzero::loopback::world w(2);
  std::vector<std::string> errors(2);
  w.run([&](ringzero::loopback::communicator& c) {
    const ringzero::options ring{.algorithm = ringzero::algorithm::ring};
    try {
      zt::zero::save_checkpoint(
          [&](auto&& f) -> decltype(auto) { return f(c); }, ring, dir, plan, c.rank(), 9,
          [&] {
            if (c.rank() == 1) throw ringzero::checkpoint_error("no space left on device");
            return std::vector<std::vector<float>>(1, std::vector<float>(plan.shard_size()));
          },
          [](const std::vector<std::uint64_t>&) -> zt::zero::checkpoint_manifest {
            FAIL("no manifest is built for a save that failed");
            return {};
          },
          [](std::uint64_t) {});
    } catch (const ringzero::checkpoint_error& e) {
      errors[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (const auto& e : errors) CHECK(e.find("no space left on device") != std::string::npos);
  CHECK(shard_files() == before);
  CHECK(zt::zero::checkpoint_manifest::read(dir).step == 3);
  const zt::zero::checkpoint_reader reader(dir);
  CHECK_FALSE(reader.read_all_parameters().empty());
}

TEST_CASE("every rank learns the lowest failing rank's message") {
  for (int world : {1, 3}) {
    ringzero::loopback::world w(world);
    std::vector<std::string> none(static_cast<std::size_t>(world), "x"),
        some(static_cast<std::size_t>(world));
    w.run([&](ringzero::loopback::communicator& c) {
      const ringzero::options ring{.algorithm = ringzero::algorithm::ring};
      const auto r = static_cast<std::size_t>(c.rank());
      none[r] = zt::zero::detail::agree_on_failure(c, "", ring);
      // Ranks 1 and 2 fail; the prefix every ringzero error carries is dropped.
      const std::string mine = c.rank() >= 1 ? fmt::format("ringzero: disk {} full", c.rank()) : "";
      some[r] = zt::zero::detail::agree_on_failure(c, mine, ring);
    });
    for (int r = 0; r < world; ++r) {
      CHECK(none[static_cast<std::size_t>(r)].empty());
      const std::string& got = some[static_cast<std::size_t>(r)];
      if (world == 1)
        CHECK(got.empty());
      else
        CHECK(got == (r == 1 ? std::string("disk 1 full") : "disk 1 full (reported by rank 1)"));
    }
  }
}

TEST_CASE("group learning rates are saved by name and restored by name") {
  zt::zero::config saving;
  saving.groups = {{.name = "a"}, {.name = "b"}};
  const auto saved = zt::zero::saved_groups(saving, {0.5f, 0.25f});
  REQUIRE(saved.size() == 2);
  CHECK(saved[1].name == "b");
  CHECK(saved[1].lr == 0.25f);
  zt::zero::checkpoint_manifest m;
  m.groups = saved;
  // The loading config lists the groups in another order and adds one the checkpoint lacks.
  zt::zero::config loading;
  loading.groups = {{.name = "b"}, {.name = "c"}, {.name = "a"}};
  std::vector<float> lr{1.0f, 1.0f, 1.0f};
  zt::zero::restore_groups(m, loading, lr);
  CHECK(lr == std::vector<float>{0.25f, 1.0f, 0.5f});
  CHECK(zt::zero::saved_groups(zt::zero::config{}, {0.125f})[0].name == "default");
}

TEST_CASE("manifest counts, sizes and offsets are checked before they are used") {
  using manifest = ringzero::zero::checkpoint_manifest;
  namespace zd = ringzero::zero::detail;
  const std::string good =
      "ringzero-zero-checkpoint 2\nworld_size 2\nstage 1\nprecision float32\nstep 5\n"
      "optimizer_steps 5\noptimizer adamw\nloss_scale 1 0\nalignment 16\nshard_size 4\n"
      "arrays master exp_avg exp_avg_sq\ngroups 1\ngroup default 0.001\nbuckets 1\n"
      "bucket 0 8 0\nparams 2\nparam w float32 1 0 0 2 2 3\nparam b float32 0 6 0 1 2\n"
      "shards 2\nshard 0 a.bin 112 0\nshard 1 b.bin 112 0\n";
  // `from` replaced by `to`, with the checksum line a writer would have added.
  auto parse = [&](std::string_view from, std::string_view to) {
    std::string text = good;
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    text += fmt::format("crc32c {:08x}\n", zd::crc32c(std::as_bytes(std::span(text))));
    return manifest::parse(text, "m.txt");
  };
  const manifest m = parse("", "");
  CHECK(m.params[0].numel() == 6);
  CHECK_THROWS_WITH_AS((void)parse("buckets 1", "buckets 99999999999999"),
                       doctest::Contains("99999999999999 buckets"), ringzero::checkpoint_error);
  CHECK_THROWS_WITH_AS((void)parse("params 2", "params 4000000000"), doctest::Contains("params"),
                       ringzero::checkpoint_error);
  CHECK_THROWS_WITH_AS((void)parse("2 2 3", "2 4294967296 4294967297"),
                       doctest::Contains("too many elements"), ringzero::checkpoint_error);
  CHECK_THROWS_WITH_AS((void)parse("param b float32 0 6", "param b float32 0 18446744073709551615"),
                       doctest::Contains("outside its bucket"), ringzero::checkpoint_error);
  CHECK_THROWS_WITH_AS((void)parse("bucket 0 8 0", "bucket 18446744073709551615 8 0"),
                       doctest::Contains("bucket overflows"), ringzero::checkpoint_error);
  CHECK_THROWS_WITH_AS((void)parse(" master exp_avg exp_avg_sq", ""),
                       doctest::Contains("no arrays"), ringzero::checkpoint_error);

  // A shard's expected size is computed without wrapping: a manifest whose arrays × shard_size
  // × 4 wraps to the size of the file at hand must not make that file pass.
  manifest huge = m;
  huge.shard_size = (std::size_t{1} << 62) + 4;  // × 3 arrays × 4 bytes wraps to 48
  std::vector<std::byte> shard(zd::shard_header_bytes + 48);
  zd::shard_header h{};
  std::memcpy(h.magic, zd::shard_magic, sizeof h.magic);
  h.world = 2;
  h.arrays = 3;
  h.shard_size = huge.shard_size;
  h.step = 5;
  std::memcpy(shard.data(), &h, sizeof h);
  CHECK_FALSE(zd::shard_matches(shard, huge, 0));
  h.shard_size = 4;
  std::memcpy(shard.data(), &h, sizeof h);
  CHECK(zd::shard_matches(shard, m, 0));
  CHECK_FALSE(zd::shard_matches(shard, m, 1));  // another rank's
  CHECK_FALSE(zd::shard_matches(std::span(shard).first(40), m, 0));
}
