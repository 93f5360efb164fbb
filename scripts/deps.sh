#!/usr/bin/env bash
# Installs the Debian 12 packages ringzero's build, tests, demos and benchmarks use, and Conan for
# the packaging test. Idempotent: asks apt only for what is missing, so a prepared machine starts
# instantly.
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

# Conan, for the packaging test's `conan create` (tests/package/run.sh), is a PyPI package: it goes
# into a virtual environment of this checkout (build/conan-venv) here, with the other downloads,
# not in the middle of the suite. Without PyPI the packaging test tries again, and skips the step
# when it cannot.
root=$(cd "$(dirname "$0")/.." && pwd)
if ! command -v conan >/dev/null && [[ ! -x $root/build/conan-venv/bin/conan ]]; then
  echo "deps: installing conan into build/conan-venv"
  rm -rf "$root/build/conan-venv"
  if ! { python3 -m venv "$root/build/conan-venv" &&
    "$root/build/conan-venv/bin/pip" install --quiet conan; }; then
    echo "deps: could not install conan from PyPI; the packaging test will try again" >&2
    rm -rf "$root/build/conan-venv"
  fi
fi
