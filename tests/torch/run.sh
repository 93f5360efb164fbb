#!/usr/bin/env bash
# The torch stage of scripts/test.sh: builds ringzero-torch against build/torch-venv's torch
# (scripts/deps.sh installs it), then runs tests/torch: the backend as a user meets it
# (test_backend.py: entry point, DDP and FSDP2 against gloo, faults, store, options, traces) and
# PyTorch's own distributed suite over ringzero at 2 and 3 ranks (distributed_suite.py), each
# test's ranks forked from the runner (about a minute per world size).
#
#   RINGZERO_TORCH_SUITE=subset  only the fixed subset, at 2 ranks, spawned
#   RINGZERO_TORCH_SUITE=spawn   the whole suite with every rank a fresh interpreter, as torch's
#                                own CI runs it: well over an hour on 2 cores (docs/torch.md)
#   RINGZERO_TORCH_SUITE=full    also test_backend.py's long cases
#   RINGZERO_TORCH_CXXFLAGS     compiler flags for the extension (here -O1 unless set: it is
#                               compiled to be tested, and -O2 takes half as long again)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=build/torch-venv/bin/python
[[ -x $py ]] || { echo "torch stage: no $py (scripts/deps.sh installs it)" >&2; exit 1; }

start=$SECONDS
RINGZERO_TORCH_CXXFLAGS=${RINGZERO_TORCH_CXXFLAGS:--O1} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$py" -m pip install --quiet --no-deps ./integrations/torch
echo "torch stage: ringzero-torch built and installed in $((SECONDS - start)) s"

status=0
# The ranks wait sleeping, not spinning, on a machine shared with the rest of the suite.
export RINGZERO_WAIT_MODE=${RINGZERO_WAIT_MODE:-sleep} OMP_NUM_THREADS=1
pytest_args=(-q -p no:cacheprovider tests/torch/test_backend.py)
suite=${RINGZERO_TORCH_SUITE:-fork}
[[ $suite == full ]] || pytest_args+=(-m "not full")
timeout 900 "$py" -m pytest "${pytest_args[@]}" || status=1

case $suite in
  subset) timeout 900 "$py" tests/torch/distributed_suite.py --world-size 2 --subset || status=1 ;;
  spawn)
    for n in 2 3; do
      timeout 14400 "$py" tests/torch/distributed_suite.py --world-size "$n" --cpu || status=1
    done
    ;;
  *)
    for n in 2 3; do
      start=$SECONDS
      timeout 900 "$py" tests/torch/distributed_suite.py --world-size "$n" --fork || status=1
      echo "torch stage: PyTorch's distributed suite at $n ranks (forked) in $((SECONDS - start)) s"
    done
    ;;
esac
exit $status
