#!/usr/bin/env bash
# The small demo: installs what is missing, builds, and trains an MLP with ZeRO stage 3 across
# four processes over libfabric (shm), launched by ringzero-run. scripts/demo.sh trains the GPT.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build/demo -G Ninja -DCMAKE_BUILD_TYPE=Release -DRINGZERO_BUILD_TESTS=OFF \
  -DRINGZERO_BUILD_BENCH=OFF -DRINGZERO_WITH_LIBFABRIC=ON >/dev/null
cmake --build build/demo --target ringzero-train ringzero-run
./build/demo/tools/run/ringzero-run -n 4 -- ./build/demo/examples/ringzero-train --stage 3 \
  --precision bf16 --steps 60 --log-every 10 "$@"
