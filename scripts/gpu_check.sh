#!/usr/bin/env bash
# The GPU check: everything in ringzero that only a GPU can show, in one run of about 6 minutes
# on a machine with one NVIDIA GPU (the single-GPU stages were 160 s on an H200; the multi-rank
# stage adds about 3 minutes), ending with a summary. Run it first wherever a GPU is available
# and record its figures in docs/performance.md with the date and the card.
#
#   scripts/gpu_check.sh                 build the GPU targets in build/gpu-check, then run
#   scripts/gpu_check.sh --prebuilt DIR  run binaries already built in DIR (a build made on
#                                        another machine: a GPU machine without compilers or
#                                        network, say), with their libraries in DIR/lib if any
#   scripts/gpu_check.sh --ranks N       the multi-rank stage with N ranks, one GPU each (an
#                                        8-GPU machine: --ranks 8); the default runs it with 2
#                                        and 3 ranks sharing GPU 0 (see below)
#
# What runs: every GPU test (NCCL, the CUDA kernels, the sharder on device memory and its
# --default-stream per-thread build, libfabric on device memory, ringzero's schedules across
# threads on one GPU), ringzero-cuda-train at stages 0-3 with its per-step time and device
# budget, ringzero-perf on device memory (NCCL, one rank), processes sharing the GPU over
# libfabric (device buffers staged through the host), and the kernel benchmarks; under
# compute-sanitizer where it is installed. Then the multi-rank stage: ringzero-perf -T nccl on
# several ranks (all_reduce, reduce_scatter, all_gather: NCCL's own, -A ring, -A tree,
# --reproducible), ringzero-cuda-train --reproducible at stages 0 and 3 on 2 ranks against the
# one-rank checksum, a SIGSTOPped rank that must end the other within RINGZERO_TIMEOUT, and an
# elastic job that loses a rank (and, with --ranks, takes one in with --join). Several ranks on
# one GPU: NCCL refuses two ranks of one communicator on a GPU only when their host hashes
# match, so each rank gets its own NCCL_HOSTID and NCCL's socket transport over loopback
# (NCCL_NET=Socket) between them. A GPU test that skips while a GPU is visible is a failure.
# Without a GPU it says so, runs nothing, and exits 0. GPU_CHECK_ONLY=REGEX runs only the steps
# whose names match. NCCL: the system's, else PyPI's wheel at the version docs/nccl.md cites
# (GPU_CHECK_NCCL_VERSION overrides it).
set -uo pipefail
cd "$(dirname "$0")/.."

prebuilt=""
ranks=0
while (($#)); do
  case $1 in
    --prebuilt) prebuilt=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    -h | --help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ $ranks =~ ^[0-9]+$ ]] || { echo "gpu_check: --ranks takes a number" >&2; exit 2; }

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU is visible (nvidia-smi finds none): every GPU step skipped"
  echo "gpu_check: 0 passed, 0 failed, all skipped"
  exit 0
fi

SECONDS=0
results=()
failed=0
passed=0
record() {  # record <name> <PASS|FAIL|N/A> <seconds> [note]; N/A counts as neither
  results+=("$(printf '%-34s %-4s %5ss  %s' "$1" "$2" "$3" "${4:-}")")
  case $2 in
    PASS) passed=$((passed + 1)) ;;
    FAIL) failed=$((failed + 1)) ;;
  esac
}

echo "=== the machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d .)

# NCCL: the system's, else PyPI's wheel (installed first when building and pip reaches PyPI;
# prebuilt binaries only need the library). The wheel ships libnccl.so.2 only; a folder with
# the unversioned name lets CMake's find_library see it.
find_wheel_nccl() {
  python3 -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl")
if s and s.submodule_search_locations: print(list(s.submodule_search_locations)[0])' 2>/dev/null
}
nccl_dir=""
if ! ldconfig -p | grep -q 'libnccl\.so\.2'; then
  nccl_dir=$(find_wheel_nccl)
  if [[ -z $nccl_dir && -z $prebuilt ]]; then
    nccl_version=${GPU_CHECK_NCCL_VERSION:-2.28.9}
    python3 -m pip install -q "nvidia-nccl-cu13==$nccl_version" ||
      python3 -m pip install -q "nvidia-nccl-cu12==$nccl_version"
    nccl_dir=$(find_wheel_nccl)
  fi
fi
if [[ -n $nccl_dir ]]; then
  mkdir -p build/nccl-wheel
  ln -sf "$nccl_dir/include" build/nccl-wheel/include
  mkdir -p build/nccl-wheel/lib
  ln -sf "$nccl_dir/lib/libnccl.so.2" build/nccl-wheel/lib/libnccl.so
  ln -sf "$nccl_dir/lib/libnccl.so.2" build/nccl-wheel/lib/libnccl.so.2
  export NCCL_HOME=$PWD/build/nccl-wheel
  export LD_LIBRARY_PATH=$nccl_dir/lib:${LD_LIBRARY_PATH:-}
  echo "NCCL from PyPI's wheel: $nccl_dir"
fi

if [[ -n $prebuilt ]]; then
  build=$(realpath "$prebuilt")
  [[ -d $build/lib ]] && export LD_LIBRARY_PATH=$build/lib:${LD_LIBRARY_PATH:-}
  echo "=== prebuilt binaries in $build"
else
  build=build/gpu-check
  echo "=== building the GPU targets for sm_$arch in $build"
  if [[ -x /usr/local/cuda/bin/nvcc ]] && ! command -v nvcc >/dev/null; then
    export PATH=/usr/local/cuda/bin:$PATH
  fi
  if command -v apt-get >/dev/null && [[ $(id -u) -eq 0 ]]; then bash scripts/deps.sh || true; fi
  start=$SECONDS
  if cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DRINGZERO_WITH_NCCL=ON -DRINGZERO_WITH_CUDA=ON >"$build.configure.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" --target test_nccl_gpu test_cuda_kernels \
      test_zero_sharder_cuda test_zero_sharder_cuda_per_thread test_cuda_loopback \
      ringzero-cuda-train ringzero-perf ringzero-run ringzero-bench-kernels ringzero-bench-nccl \
      >"$build.log" 2>&1; then
    record build PASS $((SECONDS - start))
  else
    tail -n 30 "$build.configure.log" "$build.log"
    record build FAIL $((SECONDS - start)) "see $build.log"
  fi
  # Optional targets: libfabric's (only where libfabric is installed).
  cmake --build "$build" -j "$(nproc)" --target test_libfabric_hmem_gpu ringzero-bench-staged \
    >>"$build.log" 2>&1 || true
fi

sanitizer=""
command -v compute-sanitizer >/dev/null && sanitizer=compute-sanitizer
for d in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
  [[ -z $sanitizer && -x $d/compute-sanitizer ]] && sanitizer=$d/compute-sanitizer
done

log_dir=${GPU_CHECK_LOGS:-$build/gpu-check-logs}
mkdir -p "$log_dir"

# step <name> <timeout s> <command...>: runs it, logs it, fails on a skip while a GPU is visible.
step() {
  local name=$1 limit=$2
  shift 2
  [[ -n ${GPU_CHECK_ONLY:-} && ! $name =~ $GPU_CHECK_ONLY ]] && return
  local exe=$1
  if [[ ! -x $exe ]] && ! command -v "$exe" >/dev/null; then
    record "$name" N/A 0 "not built ($exe)"
    return
  fi
  local log="$log_dir/$name.log" start=$SECONDS rc
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  local took=$((SECONDS - start))
  if grep -Eq "no CUDA device is visible|skipped: no CUDA" "$log"; then
    record "$name" FAIL "$took" "skipped although a GPU is visible"
  elif ((rc == 0)) && grep -q "skipped: no libfabric provider" "$log"; then
    record "$name" N/A "$took" "no libfabric provider here registers CUDA memory (FI_HMEM)"
  elif ((rc == 124)); then
    record "$name" FAIL "$took" "timed out after ${limit}s"
  elif ((rc != 0)); then
    record "$name" FAIL "$took" "exit $rc: $(grep -m1 -E 'ERROR|error|FAILED' "$log" | cut -c1-80)"
  else
    record "$name" PASS "$took" "$(grep -m1 -E '^budget:|test cases:' "$log" | cut -c1-110)"
  fi
  echo "--- $name ($took s, exit $rc)"
  # A failure shows its first report whole (a sanitizer's error with its backtrace).
  ((rc != 0)) && grep -m 1 -A 14 -E '^========= (Invalid|Program hit|Error|Race)|ERROR:' "$log"
  tail -n "${GPU_CHECK_TAIL:-12}" "$log"
}

echo "=== GPU tests"
step test_zero_sharder_cuda 120 "$build/tests/zero/test_zero_sharder_cuda"
step test_zero_sharder_cuda_per_thread 120 "$build/tests/zero/test_zero_sharder_cuda_per_thread"
step test_nccl_gpu 240 "$build/tests/transport/test_nccl_gpu"
step test_cuda_kernels 240 "$build/tests/kernels/test_cuda_kernels"
step test_libfabric_hmem_gpu 120 "$build/tests/transport/test_libfabric_hmem_gpu"
step test_cuda_loopback 120 "$build/tests/transport/test_cuda_loopback"

echo "=== ringzero-cuda-train, stages 0-3 (per-step time and device budget)"
for s in 0 1 2 3; do
  step "cuda_train_stage$s" 90 "$build/examples/ringzero-cuda-train" --stage "$s" --steps 20
done
# config::reproducible on device memory: the per-step time against the lines above, and the
# weights' checksum (the same at stages 0 and 3).
for s in 0 3; do
  step "cuda_train_reproducible_stage$s" 90 "$build/examples/ringzero-cuda-train" --stage "$s" \
    --steps 20 --reproducible
done

if [[ -n $sanitizer ]]; then
  echo "=== compute-sanitizer ($sanitizer)"
  # --report-api-errors no: NCCL probes kernels that its build has for other architectures
  # (cudaFuncGetAttributes answering cudaErrorNoKernelImageForDevice, inside libnccl.so.2, 24
  # times in test_zero_sharder_cuda on an H200); those are NCCL's by design, not memory errors.
  step memcheck_sharder_cuda 150 "$sanitizer" --tool memcheck --report-api-errors no \
    --error-exitcode 9 \
    "$build/tests/zero/test_zero_sharder_cuda" -tc='*budget*'
  step memcheck_cuda_train_stage3 120 "$sanitizer" --tool memcheck --report-api-errors no \
    --error-exitcode 9 \
    "$build/examples/ringzero-cuda-train" --stage 3 --steps 4
  step racecheck_cuda_train_stage3 120 "$sanitizer" --tool racecheck --error-exitcode 9 \
    "$build/examples/ringzero-cuda-train" --stage 3 --steps 6
  step memcheck_nccl_reproducible 200 "$sanitizer" --tool memcheck --report-api-errors no \
    --error-exitcode 9 "$build/tests/transport/test_nccl_gpu" -tc='*reproducible*'
  step memcheck_cuda_train_reproducible 150 "$sanitizer" --tool memcheck \
    --report-api-errors no --error-exitcode 9 \
    "$build/examples/ringzero-cuda-train" --stage 3 --steps 4 --reproducible
else
  echo "=== compute-sanitizer is not installed: sanitizer steps not run"
fi

echo "=== ringzero-perf on device memory"
step perf_nccl_all_reduce 120 "$build/tools/perf/ringzero-perf" all_reduce -T nccl \
  -b 8 -e 256M -f 8 -n 20 -w 5 -c 1
step perf_nccl_all_reduce_bf16_avg 120 "$build/tools/perf/ringzero-perf" all_reduce -T nccl \
  -b 1K -e 256M -f 16 -n 20 -w 5 -c 1 -d bfloat16 -o avg
# options::reproducible on device buffers (the kernels of kernels/cuda/reproducible.cuh), each
# sum checked bitwise against the exact serial sum; the plain rows above are the comparison.
step perf_nccl_reproducible_all_reduce 120 "$build/tools/perf/ringzero-perf" all_reduce -T nccl \
  -b 8 -e 256M -f 8 -n 20 -w 5 -c 1 --reproducible
step perf_nccl_reproducible_reduce_scatter_bf16_avg 120 "$build/tools/perf/ringzero-perf" \
  reduce_scatter -T nccl -b 1K -e 256M -f 16 -n 20 -w 5 -c 1 -d bfloat16 -o avg --reproducible
step perf_nccl_reproducible_reduce_double 120 "$build/tools/perf/ringzero-perf" reduce -T nccl \
  -b 1K -e 64M -f 16 -n 10 -w 3 -c 1 -d double --reproducible
step perf_nccl_ring_schedule 120 "$build/tools/perf/ringzero-perf" all_reduce -T nccl \
  -b 1K -e 64M -f 16 -n 10 -w 3 -c 1 -A ring
if [[ -x $build/tools/run/ringzero-run ]]; then
  step staged_libfabric_shm_2 120 "$build/tools/run/ringzero-run" -n 2 --timeout 110 -- \
    "$build/bench/gpu/ringzero-bench-staged" -p shm -A ring -b 4K -e 64M -f 16 -r 10
fi

echo "=== kernel benchmarks"
step bench_kernels 180 "$build/bench/gpu/ringzero-bench-kernels"

# --- the multi-rank stage ------------------------------------------------------------------------
gpus=$(nvidia-smi -L | grep -c '^GPU')
run=$build/tools/run/ringzero-run
perf=$build/tools/perf/ringzero-perf
train=$build/examples/ringzero-cuda-train
if ((ranks > 1 && ranks > gpus)); then
  record multi_rank FAIL 0 "--ranks $ranks but only $gpus GPU(s) are visible"
  ranks=0
fi
if ((ranks > 1)); then
  sizes=("$ranks")
  # One GPU per rank: NCCL's own transports (NVLink, PCIe, the network) as a job uses them.
  spread=()
else
  sizes=(2 3)
  # Every rank on GPU 0, a "host" of its own for NCCL, sockets over loopback between them.
  spread=(env CUDA_VISIBLE_DEVICES=0 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
    bash -c 'NCCL_HOSTID=ringzero-rank-$RANK$RINGZERO_ELASTIC_ID exec "$@"' rank)
fi
# ranks_step <name> <limit s> <ranks> <command...>: the command on that many ranks.
ranks_step() {
  local name=$1 limit=$2 n=$3
  shift 3
  step "$name" "$limit" "$run" -n "$n" --timeout $((limit - 5)) -- "${spread[@]}" "$@"
}
if [[ -x $run && -x $perf ]]; then
  echo "=== several ranks: ${sizes[*]} rank(s), ${gpus} GPU(s)"
  common=(-T nccl -b 8 -e 4M -f 16 -n 5 -w 2 -c 1)
  for n in "${sizes[@]}"; do
    for coll in all_reduce reduce_scatter all_gather; do
      ranks_step "perf_${n}r_${coll}_nccl" 90 "$n" "$perf" "$coll" "${common[@]}"
      ranks_step "perf_${n}r_${coll}_ring" 90 "$n" "$perf" "$coll" "${common[@]}" -A ring
    done
    ranks_step "perf_${n}r_all_reduce_tree" 90 "$n" "$perf" all_reduce "${common[@]}" -A tree
    for coll in all_reduce reduce_scatter; do
      ranks_step "perf_${n}r_${coll}_reproducible" 120 "$n" "$perf" "$coll" "${common[@]}" \
        --reproducible
    done
  done
fi

# The reproducible checksum on 2 ranks (or --ranks) against the one-rank runs above.
crc_of() { grep -ho 'crc32c [0-9a-f]*' "$log_dir/$1.log" 2>/dev/null | tail -n 1; }
if [[ -x $run && -x $train ]]; then
  n=${sizes[0]}
  ((ranks > 1)) || n=2
  for s in 0 3; do
    ranks_step "cuda_train_${n}r_reproducible_stage$s" 120 "$n" "$train" --stage "$s" --steps 20 \
      --micro-batches 2 --reproducible
    one=$(crc_of "cuda_train_reproducible_stage$s")
    several=$(crc_of "cuda_train_${n}r_reproducible_stage$s")
    if [[ -n ${GPU_CHECK_ONLY:-} && ! "cuda_train_${n}r_reproducible_stage$s" =~ $GPU_CHECK_ONLY ]]; then
      :
    elif [[ -n $one && $one == "$several" ]]; then
      record "crc_${n}r_equals_1r_stage$s" PASS 0 "$several on $n ranks and on one"
    else
      record "crc_${n}r_equals_1r_stage$s" FAIL 0 "one rank: '${one:-none}', $n ranks: '${several:-none}'"
    fi
  done
fi

# wait_for_line <file> <regex> <seconds>: polls a log until a line matches.
wait_for_line() {
  local file=$1 regex=$2 until=$((SECONDS + $3))
  while ((SECONDS < until)); do
    grep -Eq "$regex" "$file" 2>/dev/null && return 0
    sleep 0.2
  done
  return 1
}
# The pid of rank R (its RINGZERO_ELASTIC_ID or RANK) among the processes named NAME.
rank_pid() {
  local name=$1 var=$2 want=$3 pid
  for pid in $(pgrep -f "$name"); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "$var=$want" &&
      [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$(basename "$name" | cut -c1-15)" ]]; then
      echo "$pid"
      return 0
    fi
  done
  return 1
}

# signal_rank <job pid> <log> <regex> <seconds> <exe> <var> <value> <signal>: once the log shows
# the regex, sends the signal to the rank whose environment has var=value and prints its pid;
# without one in time, ends the job and prints nothing.
signal_rank() {
  local job=$1 log=$2 regex=$3 wait_s=$4 exe=$5 var=$6 value=$7 sig=$8 pid=""
  wait_for_line "$log" "$regex" "$wait_s" && pid=$(rank_pid "$exe" "$var" "$value")
  if [[ -z $pid ]]; then
    kill "$job" 2>/dev/null
    wait "$job"
    return 1
  fi
  kill "-$sig" "$pid" || return 1
  echo "$pid"
}

# A rank stopped (SIGSTOP) in the middle of a collective: the other must end within
# RINGZERO_TIMEOUT (5 s) plus a margin, with a timeout naming the call, and the launcher then
# stops the job.
if [[ -x $run && -x $perf && ( -z ${GPU_CHECK_ONLY:-} || sigstop =~ $GPU_CHECK_ONLY ) ]]; then
  n=2
  dir=$log_dir/sigstop
  rm -rf "$dir"
  start=$SECONDS
  RINGZERO_TIMEOUT=5 "$run" -n "$n" --output "$dir" --timeout 100 -- "${spread[@]}" "$perf" \
    all_reduce -T nccl -b 64M -e 64M -n 1000000 -w 1 -c 0 >"$log_dir/sigstop.log" 2>&1 &
  job=$!
  # The table's header, then 3 s: inside the timed loop, which has no end in sight.
  if ! victim=$(signal_rank "$job" "$dir/rank0.log" '# Using devices' 60 "$perf" RANK 1 0) ||
    ! sleep 3 || ! kill -STOP "$victim"; then
    record sigstop_rank FAIL $((SECONDS - start)) "the job never reached its timed loop"
  else
    stopped=$SECONDS
    wait "$job"
    rc=$?
    kill -CONT "$victim" 2>/dev/null
    took=$((SECONDS - stopped))
    if ((rc != 0 && took <= 20)) && grep -q "did not complete within 5 s" "$dir/rank0.log"; then
      record sigstop_rank PASS "$took" "rank 0 gave up ${took}s after rank 1 stopped (limit 5 s)"
    else
      record sigstop_rank FAIL "$took" "exit $rc after ${took}s; rank 0: $(tail -n 1 "$dir/rank0.log" | cut -c1-60)"
    fi
  fi
fi

# An elastic job that loses a rank mid-run: the survivors stop at once (the launcher marks the
# rank dead; the communicator is revoked or aborted), form the next generation (ncclCommShrink
# where NCCL has it), load the last checkpoint and finish. With --ranks, a new rank then joins
# (ringzero-run --join: it takes the dead rank's LOCAL_RANK, so its GPU).
if [[ -x $run && -x $train && ( -z ${GPU_CHECK_ONLY:-} || elastic =~ $GPU_CHECK_ONLY ) ]]; then
  n=${sizes[0]}
  ((ranks > 1)) || n=2
  dir=$log_dir/elastic
  rm -rf "$dir" "$log_dir/elastic.ckpt"
  start=$SECONDS
  job_file=$log_dir/elastic.job
  "$run" -n "$n" --elastic "1:$n" --job-file "$job_file" --output "$dir" --timeout 200 -- \
    "${spread[@]}" "$train" --stage 3 --steps 3000 --checkpoint-every 100 \
    --save "$log_dir/elastic.ckpt" >"$log_dir/elastic.log" 2>&1 &
  job=$!
  if ! signal_rank "$job" "$dir/rank0.log" '^step +200 ' 120 "$train" RINGZERO_ELASTIC_ID \
    $((n - 1)) KILL >/dev/null; then
    record elastic_kill FAIL $((SECONDS - start)) "the job never reached step 200 (see $dir)"
  else
    if ((ranks > 1)); then
      wait_for_line "$dir/rank0.log" 'elastic: generation 1' 60
      "$run" -n 1 --join "$job_file" --output "$dir/joined" --timeout 150 -- "$train" \
        --stage 3 --steps 3000 --checkpoint-every 100 --save "$log_dir/elastic.ckpt" \
        >"$log_dir/elastic_join.log" 2>&1 &
      joiner=$!
    fi
    wait "$job"
    rc=$?
    [[ -n ${joiner:-} ]] && wait "$joiner"
    if ((rc == 0)) && grep -q 'elastic: generation 1' "$dir/rank0.log"; then
      record elastic_kill PASS $((SECONDS - start)) "$(grep -m1 'elastic: generation 1' "$dir/rank0.log" | cut -c1-90)"
    else
      record elastic_kill FAIL $((SECONDS - start)) "exit $rc; see $log_dir/elastic.log and $dir"
    fi
  fi
fi

echo
echo "=== summary: $card, $(date -u +%Y-%m-%d), ${SECONDS}s"
for r in "${results[@]}"; do echo "$r"; done
echo "gpu_check: $passed passed, $failed failed"
((failed == 0))
