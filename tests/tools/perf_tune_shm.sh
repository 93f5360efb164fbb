#!/usr/bin/env bash
# ringzero-perf --tune on the native shm transport, 2 ranks: the file gets the segment's measured
# one-phase limit with the world size it holds at, and a run under RINGZERO_TUNING=that file
# checks every all_reduce clean around the limit, in place and out of place.
#   perf_tune_shm.sh <ringzero-perf> <ringzero-run>
set -euo pipefail
perf=$1
run=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
file=$dir/machine.tuning
"$run" -n 2 --timeout 120 "$perf" all_reduce -T shm --tune "$file" | tee "$dir/tune.out"
grep -q '^# one phase up to .* on 2 ranks (one_phase_bytes = [0-9]*)$' "$dir/tune.out" ||
  { echo "perf_tune_shm: --tune printed no one-phase limit" && exit 1; }
cat "$file"
limit=$(sed -nE 's/^one_phase_bytes = ([0-9]+)$/\1/p' "$file")
[[ -n $limit ]] || { echo "perf_tune_shm: no one_phase_bytes in the file" && exit 1; }
grep -qx 'one_phase_ranks = 2' "$file" || { echo "perf_tune_shm: no one_phase_ranks = 2" && exit 1; }
((limit >= 512 && limit <= 1048576)) ||
  { echo "perf_tune_shm: one_phase_bytes = $limit is outside the measured sizes" && exit 1; }
# Both sides of the limit, checked against the serial reference (-c 1), every type and op.
RINGZERO_TUNING=$file "$run" -n 2 --timeout 120 "$perf" all_reduce -T shm -c 1 \
  -b "$((limit / 2))" -e "$((limit * 4))" -f 2 -n 2 -w 1 -d all -o all | tee "$dir/check.out"
grep -q '^# Out of bounds values : 0 OK$' "$dir/check.out" ||
  { echo "perf_tune_shm: the run under the tuned limit found wrong elements" && exit 1; }
