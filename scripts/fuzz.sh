#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang in build/fuzz and runs each for a fixed time,
# starting from its seed corpus in fuzz/corpus/<target>/. Fails on any crash, sanitizer report,
# leak, timeout or out-of-memory; the input that did it is left in build/fuzz/artifacts/.
#
#   RINGZERO_FUZZ_SECONDS   seconds per target (default 20; scripts/test.sh passes 6);
#                           for a real hunt give it hours, e.g. RINGZERO_FUZZ_SECONDS=3600
#   RINGZERO_FUZZ_TARGETS   which targets (default: all six)
#   RINGZERO_FUZZ_JOBS      targets fuzzed at once (default: the number of cores)
#   RINGZERO_FUZZ_SEED      libFuzzer's seed (default 1, so a CI failure replays with the same
#                           command; "random" lets libFuzzer pick one, as a hunt should)
#
# A failure's report also goes to build/fuzz/failures.txt, which scripts/test.sh prints again in
# its summary, where a long CI log keeps it in view.
#
# New inputs the fuzzer finds go to build/fuzz/corpus/, not into the repository; copy the few
# that add coverage into fuzz/corpus/ by hand (libFuzzer's -merge=1 picks them).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${RINGZERO_FUZZ_SECONDS:-20}
[[ $seconds =~ ^[1-9][0-9]*$ ]] || { echo "fuzz: RINGZERO_FUZZ_SECONDS='$seconds' is not a positive integer" >&2; exit 2; }
targets=(${RINGZERO_FUZZ_TARGETS:-store_protocol store_server socket_wire checkpoint_manifest checkpoint_shard perf_cli})
seed=${RINGZERO_FUZZ_SEED:-1}
seed_flag=()
if [[ $seed != random ]]; then
  [[ $seed =~ ^[1-9][0-9]*$ ]] || { echo "fuzz: RINGZERO_FUZZ_SEED='$seed' is not a positive integer or 'random'" >&2; exit 2; }
  seed_flag=(-seed="$seed")
fi

cxx=$(command -v clang++-14 || command -v clang++ || true)
[[ -n $cxx ]] || { echo "fuzz: clang++ not found (scripts/deps.sh installs clang-14)" >&2; exit 2; }

dir=build/fuzz
cmake -S . -B "$dir" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DRINGZERO_WERROR=ON -DRINGZERO_BUILD_FUZZERS=ON \
  -DRINGZERO_BUILD_TESTS=OFF -DRINGZERO_BUILD_EXAMPLES=OFF -DRINGZERO_BUILD_BENCH=OFF \
  -DRINGZERO_BUILD_TOOLS=OFF -DRINGZERO_INSTALL=OFF -DRINGZERO_WITH_LIBFABRIC=OFF \
  -DRINGZERO_WITH_NCCL=OFF -DRINGZERO_WITH_CUDA=OFF >/dev/null
cmake --build "$dir" -j "$(nproc)" --target "${targets[@]/#/fuzz_}"

mkdir -p "$dir/artifacts"
rm -f "$dir/failures.txt"
# fuzz_one <target>: runs it for $seconds, its output in $dir/<target>.log; fails on a finding.
fuzz_one() {
  local t=$1 work="$dir/corpus/$1" log="$dir/$1.log"
  mkdir -p "$work"
  # The first corpus directory receives new inputs; the repository's seeds are only read.
  "$dir/fuzz/fuzz_$t" "${seed_flag[@]}" -max_total_time="$seconds" -timeout=10 \
    -rss_limit_mb=2048 -malloc_limit_mb=1024 -print_final_stats=1 -artifact_prefix="$dir/artifacts/$t-" \
    "$work" "fuzz/corpus/$t" >"$log" 2>&1
}
# Each fuzzer is one single-threaded process, so RINGZERO_FUZZ_JOBS of them (default: one per
# core) run side by side: every target still gets its full $seconds, in a fraction of the wall
# time (6 targets on 2 cores: 3 rounds, 60 s, instead of 120 s).
fuzz_jobs=${RINGZERO_FUZZ_JOBS:-$(nproc)}
[[ $fuzz_jobs =~ ^[1-9][0-9]*$ ]] || { echo "fuzz: RINGZERO_FUZZ_JOBS='$fuzz_jobs' is not a positive integer" >&2; exit 2; }
declare -A pid_of=()
for t in "${targets[@]}"; do
  while (($(jobs -pr | wc -l) >= fuzz_jobs)); do wait -n || true; done
  echo "fuzz: $t for ${seconds} s"
  fuzz_one "$t" &
  pid_of[$t]=$!
done
failed=()
for t in "${targets[@]}"; do
  log="$dir/$t.log"
  if wait "${pid_of[$t]}"; then
    execs=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+)/\1/p' "$log")
    rate=$(sed -nE 's/^stat::average_exec_per_sec: *([0-9]+)/\1/p' "$log")
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -n 1)
    echo "fuzz: $t ok: $execs runs, $rate exec/s, $cov"
  else
    {
      echo "fuzz: $t FAILED ($(grep -m1 -oE 'Seed: [0-9]+' "$log"); replay: $dir/fuzz/fuzz_$t <artifact>); the report:"
      grep -vE '^#[0-9]+' "$log" | tail -n 60
    } | tee -a "$dir/failures.txt" >&2
    failed+=("$t")
  fi
done
if ((${#failed[@]})); then
  echo "fuzz: failed: ${failed[*]} (inputs in $dir/artifacts/)" >&2
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran ${seconds} s each without a crash or sanitizer report"
