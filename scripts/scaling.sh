#!/usr/bin/env bash
# Regenerates every table and the plot in docs/scaling.md, and docs/zero.md's ZeRO++ table,
# from the fabric files:
#   bash scripts/scaling.sh [BUILD_DIR]      (default build/model)
# Builds ringzero-model only; the plot needs matplotlib (Debian python3-matplotlib).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/model}
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRINGZERO_BUILD_TESTS=OFF \
    -DRINGZERO_BUILD_BENCH=OFF -DRINGZERO_BUILD_EXAMPLES=OFF >/dev/null
fi
cmake --build "$build" --target ringzero-model
fabrics=(tools/model/fabrics/p4d.fabric tools/model/fabrics/p5.fabric)
csv=$(mktemp)
trap 'rm -f "$csv"' EXIT
"$build/tools/model/ringzero-model" --write docs/scaling.md --csv "$csv" "${fabrics[@]}"
# The Debian package installs into the system interpreter, which need not be the first python3.
python=""
for candidate in python3 /usr/bin/python3; do
  if "$candidate" -c "import matplotlib" 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [[ -z "$python" ]]; then
  echo "scaling.sh: no python3 with matplotlib (apt-get install python3-matplotlib)" >&2
  exit 1
fi
"$python" tools/model/plot.py "$csv" docs/scaling.png
"$build/tools/model/ringzero-model" --check docs/scaling.md "${fabrics[@]}"
# docs/zero.md's ZeRO++ table adds a 100 Gbit/s Ethernet cluster to them.
"$build/tools/model/ringzero-model" --write docs/zero.md "${fabrics[@]}" tools/model/fabrics/eth100.fabric
