#!/usr/bin/env bash
# The whole test suite, as CI runs it (the README's second command):
#   1. build with -Wall -Wextra -Wpedantic -Werror, run every test, check that every public
#      header compiles on its own and that the code is clang-formatted;
#   2. the same tests under AddressSanitizer + UndefinedBehaviorSanitizer;
#   3. the same tests under ThreadSanitizer.
# Usage: scripts/test.sh [--quick]   (--quick: stage 1 only)
#
# It ends with a table of the time each step took. The suite is meant to finish within
# RINGZERO_TEST_BUDGET_S seconds (default 1500 with the torch stage, 1200 without it, on 2
# cores, installing packages not counted; docs/testing.md has the figures); past that it prints
# a warning, not a failure, since machines differ, but a change that pushes it over should say
# why.
set -euo pipefail
cd "$(dirname "$0")/.."

budget_default=1500
[[ ${RINGZERO_TORCH:-1} != 0 ]] || budget_default=1200
budget=${RINGZERO_TEST_BUDGET_S:-$budget_default}
[[ $budget =~ ^[0-9]+$ ]] || { echo "test: RINGZERO_TEST_BUDGET_S='$budget' is not a number of seconds" >&2; exit 2; }
# lap <name>: the time since the previous lap is <name>'s, for the table at the end.
laps=()
lap_start=$SECONDS
lap() {
  laps+=("$1|$((SECONDS - lap_start))")
  lap_start=$SECONDS
}

bash scripts/deps.sh
lap "packages (scripts/deps.sh; not budgeted)"
deps_s=$((SECONDS))

quick=0
[[ ${1:-} == --quick ]] && quick=1
jobs=$(nproc)
passed=0
failed=0
failures=()

stage() { printf '\n=== %s\n' "$*"; }

# The suite keeps more processes and threads busy than the machine has CPUs (ctest -j on every
# core, tests of up to 9 ranks, the sanitizer builds behind them): a rank that spins or yields
# while it waits only keeps its CPU from the rank it waits for and from the builds. Sleeping
# waits (RINGZERO_WAIT_MODE=sleep, docs/environment.md) took a quarter less CPU for two
# conformance suites side by side (docs/testing.md). test_shm_conformance_2 keeps the default.
export RINGZERO_WAIT_MODE=${RINGZERO_WAIT_MODE:-sleep}

# run_ctest <build dir> [ctest args...]: runs and tallies, continuing past failures so one run
# reports everything that is broken. ctest_jobs (default: the cores) tests at a time.
run_ctest() {
  local dir=$1
  shift
  local log
  log=$(mktemp)
  if ctest --test-dir "$dir" --output-on-failure -j "${ctest_jobs:-$jobs}" "$@" 2>&1 | tee "$log"; then :; fi
  local line total bad
  line=$(grep -E 'tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n 1 || true)
  if [[ -z $line ]]; then
    failures+=("$dir: ctest printed no summary")
    failed=$((failed + 1))
  else
    total=$(sed -E 's/.*out of ([0-9]+).*/\1/' <<<"$line")
    bad=$(sed -E 's/.*tests passed, ([0-9]+) tests? failed.*/\1/' <<<"$line")
    passed=$((passed + total - bad))
    failed=$((failed + bad))
    ((bad == 0)) || failures+=("$dir: $bad of $total failed")
  fi
  rm -f "$log"
}

# configure_build <build dir> [cmake args...] [-- targets...]: configures and builds the targets
# (default: all) in one ninja run, so short jobs fill the cores while the longest ones finish.
configure_build() {
  local dir=$1
  shift
  local args=() targets=()
  while (($#)) && [[ $1 != -- ]]; do args+=("$1") && shift; done
  (($#)) && shift && targets=(--target "$@")
  cmake -S . -B "$dir" -G Ninja -DRINGZERO_WERROR=ON "${args[@]}" >/dev/null
  cmake --build "$dir" -j "$jobs" "${targets[@]}"
}

# The CUDA toolkit installs nvcc outside PATH; with it found, stage 1 compiles every kernel.
if [[ -x /usr/local/cuda/bin/nvcc ]] && ! command -v nvcc >/dev/null; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

# The sanitizer builds run in the background from the start, at the lowest priority (nice 19):
# they take only the CPU that stage 1 leaves idle (the last long compiles, tests that wait on
# deadlines, sockets and timers), so stage 1 runs about as fast as alone, and stages 2 and 3
# start with part of their build done. The builds' output goes to build/<name>.log; a stage
# prints it when its build failed.
#   Sanitizer builds: ASan at -O0 compiles three times faster than at -O1 and the suite still runs
# in minutes, and without debug information (-g0): at -O0 nothing is inlined, so a report's stack
# still has every frame, each named from the symbol table, only without file and line (the build
# took 410 s of CPU against 491 with line tables; docs/testing.md). TSan keeps -O1 (unoptimized,
# its instrumented programs run several times slower) and line tables (-g1), which name the
# frames inlined into a report's stack. NCCL is left to stage 1: without a GPU its tests only check arguments, and
# instrumenting them against the CUDA runtime adds nothing.
#   ASan + UBSan compile with Clang 14 (installed for the fuzzers): side by side, the same tree,
# built from scratch, Clang took 1,054 s of CPU against GCC 12's 2,008, and its tests 733 s
# against 363 (its -O0 code is slower), 1,787 s in all against 2,371 (docs/testing.md). Stage 1
# keeps GCC, so the code is built under -Werror by both compilers. Without clang++-14, GCC.
#   TSan compiles with Clang 14 too: side by side from scratch, Clang took 324 s of CPU against
# GCC's 343 and its tests 60 s against 95 (docs/testing.md), 53 s less in a suite bound by CPU.
# Its test programs build at -O0 (RINGZERO_TEST_FLAGS): their own code is setup, checks and
# waiting, and -O1 with TSan's instrumentation doubled their compile (the typed transport suite:
# 40 s of CPU against 18). What runs hot keeps -O1: the compiled-once collectives and the
# conformance suites (RINGZERO_CONFORMANCE_FLAGS) and the tests marked BUSY (tests/CMakeLists.txt).
# The build took 99 s of CPU less and its tests about 17 s more (docs/testing.md).
sanitizer_builds() {
  renice -n 19 -p "$$" >/dev/null || true
  # With the scheduler's autogroups (sched_autogroup_enabled), each session is a group and
  # groups share the CPU equally, whatever their processes' nice values: the group's own nice
  # is the one that counts, and this build is a session of its own.
  echo 19 >/proc/self/autogroup 2>/dev/null || true
  local build name cxx flags sanitize test_flags conformance_flags rc start
  # <name> <compiler> <CMAKE_CXX_FLAGS_DEBUG> <RINGZERO_SANITIZE> <RINGZERO_TEST_FLAGS>
  # <RINGZERO_CONFORMANCE_FLAGS>, in the order the stages need them.
  for build in "asan|clang++-14|-O0 -g0|address,undefined||" "tsan|clang++-14|-O1 -g1|thread|-O0|-O1"; do
    IFS='|' read -r name cxx flags sanitize test_flags conformance_flags <<<"$build"
    cxx=$(command -v "$cxx" || command -v g++)
    # A build directory configured with another compiler starts again (CMake would refuse it).
    if [[ -f build/$name/CMakeCache.txt ]] &&
      ! grep -qx "CMAKE_CXX_COMPILER:[A-Z]*=$cxx" "build/$name/CMakeCache.txt"; then
      rm -rf "build/$name"
    fi
    start=$SECONDS
    rm -f "build/$name.done"
    if configure_build "build/$name" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Debug \
      "-DCMAKE_CXX_FLAGS_DEBUG=$flags" \
      "-DRINGZERO_SANITIZE=$sanitize" "-DRINGZERO_TEST_FLAGS=$test_flags" \
      "-DRINGZERO_CONFORMANCE_FLAGS=$conformance_flags" -DRINGZERO_BUILD_EXAMPLES=OFF -DRINGZERO_BUILD_BENCH=OFF \
      -DRINGZERO_WITH_NCCL=OFF -DRINGZERO_WITH_CUDA=OFF >"build/$name.log" 2>&1; then
      rc=0
    else
      rc=$?
    fi
    echo "$rc $((SECONDS - start))" >"build/$name.done"
  done
}
# wait_sanitizer_build <asan|tsan>: waits for that background build and reports it.
wait_sanitizer_build() {
  local name=$1 rc secs
  while [[ ! -f build/$name.done ]] && kill -0 "$sanitizer_pid" 2>/dev/null; do sleep 2; done
  if [[ ! -f build/$name.done ]]; then
    echo "$name build: the background build stopped without a result (build/$name.log):"
    tail -n 40 "build/$name.log" 2>/dev/null || true
    failures+=("$name build: stopped without a result")
    failed=$((failed + 1))
    return 1
  fi
  read -r rc secs <"build/$name.done"
  if ((rc != 0)); then
    echo "$name build FAILED (exit $rc); build/$name.log without ninja's progress lines:"
    grep -v '^\[[0-9]*/[0-9]*\] ' "build/$name.log" | tail -n 80 || true
    failures+=("$name build")
    failed=$((failed + 1))
    return 1
  else
    echo "$name build: $(grep -c '^\[[0-9]*/[0-9]*\] ' "build/$name.log") steps, ${secs}s in the background"
  fi
}
if ((quick == 0)); then
  mkdir -p build
  rm -f build/asan.done build/tsan.done
  # A session of its own, so that the whole build (cmake, ninja, the compilers) stops with the
  # script, however the script ends.
  export jobs
  export -f configure_build sanitizer_builds
  setsid bash -c sanitizer_builds &
  sanitizer_pid=$!
  trap 'kill -- "-$sanitizer_pid" 2>/dev/null || true' EXIT
fi

stage "1/3 warnings as errors (-Wall -Wextra -Wpedantic -Werror)"
# -O1 without debug information: the suite needs optimized code, CI needs no debugger, and
# debug information is a third of the compile time of these template-heavy programs. -O1, not
# -O2: it compiles in about two thirds of the CPU time (docs/testing.md), and the hot loops are
# the reduction kernels, written with explicit vector intrinsics either way. The same for nvcc's
# host code (its RelWithDebInfo default is "-O2 -g -DNDEBUG"); ptxas optimizes device code at
# its own default whatever -O says. Release builds and the benchmarks' figures stay at -O2/-O3.
# The header checks build with everything else: alone afterwards, they waited for the slowest
# of the other programs.
# One CUDA architecture, sm_80 (with its PTX), not the default sm_80 and sm_90: no source tests
# __CUDA_ARCH__ beyond "on the device", so a second architecture checks nothing new, and it costs
# a quarter of each nvcc source's CPU time (docs/testing.md). sm_80 is the oldest the project
# supports, so a newer-only intrinsic still fails here.
# The single-process unit tests (label unit) are left to stage 2, which runs them under ASan +
# UBSan: run here too, they only ran again what stage 2 checks more closely, and cost a quarter of
# this build. Stage 1 keeps what an optimized plain build checks best: the conformance suites at
# full size, the transports' multi-process tests, the tools, examples and their tests, and the
# packaging. The conformance suites and the collectives they link (RINGZERO_CONFORMANCE_FLAGS)
# build at -O2: at -O1 GCC inlines little, and they ran up to twice as long. The other test
# programs build at -Og (RINGZERO_TEST_FLAGS): a fifth to a third less CPU than -O1 for each
# source, and their time goes to waiting on other processes, not to their own code (their
# collectives come from the -O2 libraries); GCC's flow-based warnings (-Wmaybe-uninitialized and
# the rest) still run at -Og. The CUDA sources' host code builds at -Og too (nvcc takes no -Og of
# its own; without -O it passes the host compiler's): without a GPU they are only compiled, and
# on one their host code waits on the device. Without a GPU the CUDA sharder test is built once,
# per-thread (RINGZERO_CUDA_STREAM_VARIANTS, tests/zero/CMakeLists.txt says why).
cuda_variants=OFF
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && cuda_variants=ON
configure_build build/ci -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1" \
  -DCMAKE_CUDA_FLAGS_RELWITHDEBINFO="-Xcompiler=-Og -DNDEBUG" -DCMAKE_CUDA_ARCHITECTURES=80 \
  -DRINGZERO_PLAIN_UNIT_TESTS=OFF -DRINGZERO_TEST_FLAGS=-Og -DRINGZERO_CONFORMANCE_FLAGS=-O2 \
  -DRINGZERO_CUDA_STREAM_VARIANTS=$cuda_variants -- all all_verify_interface_header_sets
echo "every public header compiles on its own"
lap "1 build, -Werror (header checks too)"
if command -v clang-format >/dev/null; then
  mapfile -t sources < <(git ls-files '*.hpp' '*.cpp' '*.cuh' '*.cu')
  if ! clang-format --dry-run --Werror "${sources[@]}"; then
    failures+=("clang-format: files above are not formatted")
    failed=$((failed + 1))
  else
    echo "clang-format: ${#sources[@]} files formatted"
  fi
fi
lap "1 clang-format"
run_ctest build/ci -LE unit
lap "1 ctest"
# The torch backend (integrations/torch, docs/torch.md), against the torch scripts/deps.sh put in
# build/torch-venv: the extension's build, the examples against gloo, the fault cases and
# PyTorch's own distributed suite at 2 and 3 ranks (tests/torch/run.sh; about 5 minutes,
# docs/testing.md). RINGZERO_TORCH=0 skips it; RINGZERO_TORCH_SUITE (subset, spawn, full) picks
# how much of it runs, and how.
if [[ ${RINGZERO_TORCH:-1} != 0 ]]; then
  if [[ -x build/torch-venv/bin/python ]]; then
    if bash tests/torch/run.sh; then
      passed=$((passed + 1))
    else
      failures+=("torch: tests/torch/run.sh")
      failed=$((failed + 1))
    fi
  else
    echo "torch stage skipped: scripts/deps.sh could not install torch into build/torch-venv"
  fi
  lap "1 torch (build, examples, faults, PyTorch suite)"
fi
# Conan is a PyPI package, installed by scripts/deps.sh (build/conan-venv); the other consumers
# ran above.
if bash tests/package/run.sh --build build/ci --work build/ci/tests/package/work conan; then
  passed=$((passed + 1))
else
  failures+=("package: conan create")
  failed=$((failed + 1))
fi
lap "1 conan create"
# libFuzzer targets (fuzz/), RINGZERO_FUZZ_SECONDS each (6 s here, two at a time: each target
# reaches its coverage plateau within seconds, 6 s within 10 edges of 10 s, docs/testing.md; set
# it higher for a hunt).
# RINGZERO_FUZZ=0 skips them.
rm -f build/fuzz/failures.txt
if [[ ${RINGZERO_FUZZ:-1} != 0 ]]; then
  if RINGZERO_FUZZ_SECONDS=${RINGZERO_FUZZ_SECONDS:-6} bash scripts/fuzz.sh; then
    passed=$((passed + 1))
  else
    failures+=("fuzz: scripts/fuzz.sh (inputs in build/fuzz/artifacts/)")
    failed=$((failed + 1))
  fi
  lap "1 fuzz (build and run)"
fi

if ((quick == 0)); then
  stage "2/3 AddressSanitizer + UndefinedBehaviorSanitizer"
  if wait_sanitizer_build asan; then
    lap "2 asan+ubsan build (rest of it)"
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
      run_ctest build/asan -LE 'package|nosan'
    lap "2 asan+ubsan ctest"
  fi

  stage "3/3 ThreadSanitizer"
  if wait_sanitizer_build tsan; then
    lap "3 tsan build (rest of it)"
    # Twice as many tests as cores: nothing builds behind this last step to use the CPU its
    # tests leave while they wait on deadlines and peers, and waits sleep (RINGZERO_WAIT_MODE),
    # so the extra tests cost little: 42 s against 56-58 s at one per core (docs/testing.md).
    ctest_jobs=$((2 * jobs)) TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
      run_ctest build/tsan -L tsan -LE 'package|nosan'
    lap "3 tsan ctest"
  fi
fi

total=$((SECONDS - deps_s))
printf '\n=== time per step\n'
declare -A per_stage=()
for l in "${laps[@]}"; do
  printf '%-40s %5ss\n' "${l%|*}" "${l##*|}"
  [[ $l == [123]\ * ]] && per_stage[${l:0:1}]=$((${per_stage[${l:0:1}]:-0} + ${l##*|}))
done
for k in 1 2 3; do
  [[ -n ${per_stage[$k]:-} ]] && printf '%-40s %5ss\n' "stage $k in all" "${per_stage[$k]}"
done
printf '%-40s %5ss (budget %ss)\n' "total" "$total" "$budget"
if ((total > budget)); then
  echo "WARNING: the suite took ${total}s, over its budget of ${budget}s (RINGZERO_TEST_BUDGET_S);" \
    "the steps above show where (docs/testing.md has the expected figures)"
fi

printf '\n=== summary (%ss)\n' "$total"
for f in "${failures[@]}"; do echo "FAILED: $f"; done
# The fuzz report sits far up the log, under the sanitizer stages: repeat it here.
[[ -s build/fuzz/failures.txt ]] && cat build/fuzz/failures.txt
echo "suite: $passed passed, $failed failed"
((failed == 0))
