#!/usr/bin/env bash
# Installs the Debian 12 packages ringzero's build, tests, demos and benchmarks use. Idempotent:
# asks apt only for what is missing, so a prepared machine starts instantly.
set -euo pipefail

pkgs=(
  build-essential cmake ninja-build pkg-config git python3 python3-venv
  libfmt-dev doctest-dev               # the core: logging and the test framework
  libfabric-dev libfabric-bin          # ringzero::libfabric (shm, tcp;ofi_rxm, sockets)
  iproute2                             # network namespaces for the two-host test
  clang-format                         # style check
  clang-14 libclang-rt-14-dev          # the libFuzzer targets (scripts/fuzz.sh)
  python3-matplotlib                   # the plots in docs/ (tools/model, tools/trace)
  libopenmpi-dev openmpi-bin libgloo-dev  # peers for bench/compare
)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
