// A process killed (SIGKILL) at a random moment of save() must leave a checkpoint that loads:
// the previous good one, or the new one if the save got through its commit. Each trial forks a
// child that runs a 2-rank loopback job (threads) saving into the same directory, kills it after
// a random delay, and loads what is there. The children alternate between re-saving the step the
// directory already holds with different weights (the case that must not rename over live
// files) and saving a new step.
//
// RINGZERO_KILL_TRIALS sets the number of trials (default 200, about a second).
#include <doctest/doctest.h>

#include "zero_harness.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ringzero/zero/checkpoint.hpp>

namespace fs = std::filesystem;

namespace {

zt::zero::model_layout model() {
  return zt::make_layout<float>({{37, 5}, {129}, {3, 61, 1}});
}

/// What a child does: load the pristine checkpoint, take `steps` steps with gradients scaled by
/// `multiplier`, and save into `target`.
struct variant {
  int steps;
  float multiplier;
};

zt::run_options options_for(const variant& v, const fs::path& pristine, const fs::path& target) {
  zt::run_options o;
  o.world = 2;
  o.stage = 2;
  o.steps = v.steps;
  o.grad_multiplier = v.multiplier;
  o.load_dir = pristine;
  o.save_dir = target;
  return o;
}

std::vector<float> read_checkpoint(const fs::path& dir, std::uint64_t& step) {
  const zt::zero::checkpoint_reader reader(dir);
  step = reader.manifest().step;
  std::vector<float> flat;
  for (const auto& p : reader.read_all_parameters()) flat.insert(flat.end(), p.begin(), p.end());
  return flat;
}

int trials_wanted() {
  if (const char* s = std::getenv("RINGZERO_KILL_TRIALS")) return std::max(1, std::atoi(s));
  return 200;
}

/// Runs the variant in a child process; kills it after `delay` unless `delay` is negative.
/// Returns the child's running time.
std::chrono::duration<double> run_child(const variant& v, const fs::path& pristine,
                                        const fs::path& target, std::chrono::duration<double> delay,
                                        bool& killed) {
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // _exit: the child must not run the parent's doctest reporting or static destructors.
    try {
      ringzero::log::set_level(ringzero::log::level::none);
      (void)zt::train<float>(model(), options_for(v, pristine, target));
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);
  }
  killed = false;
  int status = 0;
  if (delay.count() >= 0) {
    const auto until = start + std::chrono::duration_cast<std::chrono::nanoseconds>(delay);
    while (std::chrono::steady_clock::now() < until)
      if (::waitpid(pid, &status, WNOHANG) == pid) return std::chrono::steady_clock::now() - start;
    killed = ::kill(pid, SIGKILL) == 0;
  }
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  const auto took = std::chrono::steady_clock::now() - start;
  if (!killed || !WIFSIGNALED(status)) {
    killed = false;
    REQUIRE_MESSAGE(WIFEXITED(status), "child ended with status ", status);
    REQUIRE_MESSAGE(WEXITSTATUS(status) == 0, "child failed");
  }
  return took;
}

}  // namespace

TEST_CASE("a process killed at any moment of save() leaves a loadable good checkpoint") {
  const fs::path root =
      fs::temp_directory_path() / ("ringzero-zero-kill-" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  const fs::path pristine = root / "pristine";
  const fs::path target = root / "target";

  // The pristine checkpoint (step 3), and the weights each variant saves.
  zt::run_options o;
  o.world = 2;
  o.stage = 2;
  o.steps = 3;
  o.save_dir = pristine;
  (void)zt::train<float>(model(), o);
  const variant variants[] = {{0, 1.0f}, {1, 1.0f}, {1, 3.0f}};
  std::vector<std::vector<float>> expect;
  std::vector<std::uint64_t> expect_step;
  for (const auto& v : variants) {
    fs::remove_all(target);
    expect.push_back(zt::train<float>(model(), options_for(v, pristine, target)).params[0]);
    expect_step.push_back(3 + static_cast<std::uint64_t>(v.steps));
  }
  REQUIRE(expect[1] != expect[2]);  // two different checkpoints of the same step

  // The directory starts with variant 2's checkpoint. Time a few complete children.
  std::chrono::duration<double> longest{0};
  for (int i = 0; i < 3; ++i) {
    bool killed = false;
    longest = std::max(longest, run_child(variants[2], pristine, target,
                                          std::chrono::duration<double>(-1), killed));
  }

  std::mt19937_64 rng(12345);
  const int trials = trials_wanted();
  const auto budget = std::chrono::seconds(trials > 200 ? 3600 : 30);
  const auto begin = std::chrono::steady_clock::now();
  int done = 0, killed_count = 0, committed = 0;
  std::size_t holds = 2;  // which variant the directory holds
  for (; done < trials && std::chrono::steady_clock::now() - begin < budget; ++done) {
    // Step 4 over the other step-4 weights, over itself, or step 3 over step 4, in turn.
    constexpr std::size_t order[] = {1, 2, 2, 1, 0};
    const std::size_t k = order[static_cast<std::size_t>(done) % 5];
    std::uniform_real_distribution<double> when(0.0, longest.count());
    bool killed = false;
    (void)run_child(variants[k], pristine, target, std::chrono::duration<double>(when(rng)),
                    killed);
    killed_count += killed ? 1 : 0;
    std::uint64_t step = 0;
    std::vector<float> got;
    try {
      got = read_checkpoint(target, step);
    } catch (const std::exception& e) {
      FAIL("trial ", done, " (variant ", k, ", killed: ", killed, "): the checkpoint no longer ",
           "loads: ", std::string(e.what()));
    }
    bool known = false;
    for (std::size_t j = 0; j < expect.size(); ++j)
      if (got == expect[j] && step == expect_step[j]) {
        known = true;
        committed += j != holds ? 1 : 0;
        holds = j;
      }
    CHECK_MESSAGE(known, "trial ", done,
                  ": the checkpoint loads but holds none of the saved states");
  }
  MESSAGE(done, " trials, ", killed_count, " killed, ", committed,
          " of them after the new checkpoint was committed; a complete run takes ",
          longest.count() * 1e3, " ms");
  CHECK(done >= std::min(trials, 10));

  // A complete save afterwards leaves exactly the manifest and one file per rank.
  bool killed = false;
  (void)run_child(variants[1], pristine, target, std::chrono::duration<double>(-1), killed);
  int files = 0;
  for (const auto& e : fs::directory_iterator(target)) {
    ++files;
    const auto name = e.path().filename().string();
    CHECK_MESSAGE((name == "manifest.txt" || name.ends_with(".bin")), "left behind: ", name);
  }
  CHECK(files == 3);
  fs::remove_all(root);
}
