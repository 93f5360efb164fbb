#!/usr/bin/env bash
# The cost of counters and tracing at 8 B, measured side by side in one run (docs/observability.md):
#   off   ringzero-perf built with -DRINGZERO_DISABLE_TRACE (counters and tracing compiled out)
#   in    the same sources built normally, RINGZERO_TRACE unset (counters on, tracing off)
#   on    the normal build with RINGZERO_TRACE set (one JSON line written per collective)
# Rounds alternate the three so that drift on a shared machine hits them alike; the table gives
# the median over rounds of ringzero-perf's out-of-place time, and in brackets the fastest and
# slowest round, so that the noise is in view.
#   bash scripts/trace_overhead.sh [ROUNDS] [BUILD_IN] [BUILD_OUT]   (default 7 build/trace-in
#                                                                     build/trace-out)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-7}
build_in=${2:-build/trace-in}
build_out=${3:-build/trace-out}
configure() {  # DIR EXTRA_CXX_FLAGS
  if [[ ! -f "$1/CMakeCache.txt" ]]; then
    cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRINGZERO_BUILD_TESTS=OFF \
      -DRINGZERO_BUILD_BENCH=OFF -DRINGZERO_BUILD_EXAMPLES=OFF -DRINGZERO_WITH_LIBFABRIC=ON \
      -DRINGZERO_WITH_NCCL=OFF -DCMAKE_CXX_FLAGS="$2" >/dev/null
  fi
  cmake --build "$1" --target ringzero-perf ringzero-run >/dev/null
}
configure "$build_in" ""
configure "$build_out" "-DRINGZERO_DISABLE_TRACE"
trace_dir=$(mktemp -d)
trap 'rm -rf "$trace_dir"' EXIT
args=(all_reduce -b 8 -e 8 -n 50000 -w 5000 -A ring)
# One ringzero-perf run; prints its out-of-place time in microseconds.
measure() {  # TRANSPORT BUILD [VAR=VALUE]
  local transport=$1 build=$2
  shift 2
  local cmd=("$build/tools/perf/ringzero-perf" "${args[@]}" -t 2)
  if [[ $transport == shm ]]; then
    cmd=("$build/tools/run/ringzero-run" -n 2 --timeout 120 "$build/tools/perf/ringzero-perf"
         "${args[@]}" -T libfabric -p shm)
  fi
  env "$@" "${cmd[@]}" | awk '$1 == 8 && NF >= 10 { print $6; exit }'
}
spread() {  # median [min-max] of the numbers on stdin
  sort -g | awk '{ v[NR] = $1 } END {
    m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf "%.2f [%.2f-%.2f]", m, v[1], v[NR] }'
}
echo "| transport | compiled out (us) | compiled in, RINGZERO_TRACE unset (us) | RINGZERO_TRACE set (us) |"
echo "|---|---|---|---|"
for transport in loopback shm; do
  : >"$trace_dir/off" && : >"$trace_dir/in" && : >"$trace_dir/on"
  for ((r = 0; r < rounds; ++r)); do
    measure "$transport" "$build_out" >>"$trace_dir/off"
    measure "$transport" "$build_in" >>"$trace_dir/in"
    measure "$transport" "$build_in" RINGZERO_TRACE="$trace_dir/files" >>"$trace_dir/on"
  done
  echo "| $transport (2 ranks, all_reduce 8 B) | $(spread <"$trace_dir/off") |" \
    "$(spread <"$trace_dir/in") | $(spread <"$trace_dir/on") |"
done
