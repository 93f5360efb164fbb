#!/usr/bin/env bash
# The README's first command: installs what is missing, builds, and trains the GPT demo
# (examples/gpt), a small character model learning Newton's Opticks with ZeRO stage 3 across four
# processes over libfabric (shm), launched by ringzero-run. scripts/demo_mlp.sh is the small one.
#
#   scripts/demo.sh                   # 4 processes, 300 steps; extra flags go to ringzero-gpt
#   scripts/demo.sh --reshard         # 4 processes stop at step 150 and save; 2 resume to 300
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build/demo -G Ninja -DCMAKE_BUILD_TYPE=Release -DRINGZERO_BUILD_TESTS=OFF \
  -DRINGZERO_BUILD_BENCH=OFF -DRINGZERO_WITH_LIBFABRIC=ON >/dev/null
cmake --build build/demo --target ringzero-gpt ringzero-run
run=./build/demo/tools/run/ringzero-run
gpt=./build/demo/examples/ringzero-gpt
if [[ "${1:-}" == "--reshard" ]]; then
  shift
  ckpt=build/demo/gpt-checkpoint
  rm -rf "$ckpt"
  "$run" -n 4 -- "$gpt" --stop-after 150 --sample 0 --save "$ckpt" "$@"
  "$run" -n 2 -- "$gpt" --resume "$ckpt" "$@"
else
  "$run" -n 4 -- "$gpt" "$@"
fi
