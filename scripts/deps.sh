#!/usr/bin/env bash
# Installs the Debian 12 packages ringzero's build, tests, demos and benchmarks use, and Conan for
# the packaging test. Idempotent: asks apt only for what is missing, so a prepared machine starts
# instantly.
set -euo pipefail

pkgs=(
  build-essential cmake ninja-build pkg-config git python3 python3-venv
  python3-dev                          # Python.h, for the torch backend's extension (integrations/torch)
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

# torch, for the torch stage of scripts/test.sh (integrations/torch, tests/torch): PyPI's wheel,
# a few GB with the CUDA libraries it carries (it runs on CPU without them), installed once into
# build/torch-venv and reused. The virtual environment is made with Debian's own interpreter
# (/usr/bin/python3, whose headers python3-dev installs), whatever python3 comes first on PATH.
# expecttest and pytest are what torch's own distributed test suite imports. torch is pinned to
# the version whose suite docs/torch.md counts. RINGZERO_TORCH=0 skips it (and the stage).
torch_pin="torch==2.15.*"
if [[ ${RINGZERO_TORCH:-1} != 0 ]] &&
  ! "$root/build/torch-venv/bin/python" -c "import torch, expecttest, pytest" 2>/dev/null; then
  echo "deps: installing $torch_pin into build/torch-venv (once; a few GB)"
  rm -rf "$root/build/torch-venv"
  if ! { /usr/bin/python3 -m venv "$root/build/torch-venv" &&
    "$root/build/torch-venv/bin/pip" install --quiet "$torch_pin" numpy expecttest pytest; }; then
    echo "deps: could not install torch from PyPI; the torch stage will be skipped" >&2
    rm -rf "$root/build/torch-venv"
  fi
fi
