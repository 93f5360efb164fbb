#!/usr/bin/env bash
# Uses ringzero the ways its users do and checks each works: an installed tree (find_package with
# each component, pkg-config), add_subdirectory, FetchContent, a Conan package and a vcpkg port.
# Every consumer compiles a program with -Wall -Wextra -Wpedantic -Werror and runs it.
#
#   tests/package/run.sh [--build DIR] [--work DIR] [--jobs N] [--no-pip] [STEP...]
#
#   STEP      install core libfabric nccl components pkg_config add_subdirectory fetchcontent
#             presets vcpkg conan (default: all, in that order). Every step after install uses the
#             prefix and source snapshot install made, and runs install first if they are missing.
#   --build   install from this configured and built ringzero tree instead of building one
#   --work    scratch directory (default: build/package in the source tree)
#   --no-pip  never pip-install Conan; the conan step is skipped when `conan` is not on PATH
#
# Prints one line per step (ok / FAILED / skipped, with the reason) and exits non-zero if any
# step failed; exits 77 when every step asked for was skipped (CTest's SKIP_RETURN_CODE).
# shellcheck disable=SC2317 # the steps are called indirectly, as "step_$name"
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$(cd "$here/../.." && pwd)
work=$src/build/package
build=""
jobs=$(nproc 2>/dev/null || echo 2)
pip=1
steps=()
while (($#)); do
  case $1 in
    --build) build=$(cd "$2" && pwd) && shift ;;
    --work) work=$2 && shift ;;
    --jobs) jobs=$2 && shift ;;
    --no-pip) pip=0 ;;
    -h | --help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' && exit 0 ;;
    -*) echo "run.sh: unknown option $1" >&2 && exit 2 ;;
    *) steps+=("$1") ;;
  esac
  shift
done
all_steps=(install core libfabric nccl components pkg_config add_subdirectory fetchcontent presets
  vcpkg conan)
((${#steps[@]})) || steps=("${all_steps[@]}")
for s in "${steps[@]}"; do
  [[ " ${all_steps[*]} " == *" $s "* ]] || { echo "run.sh: unknown step '$s'" >&2 && exit 2; }
done

mkdir -p "$work/logs"
work=$(cd "$work" && pwd)
prefix=$work/prefix
snapshot=$work/src
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
warnings="-Wall -Wextra -Wpedantic -Werror"
# The consumers build unoptimized (no CMAKE_BUILD_TYPE): they check that the package is found,
# compiles cleanly and runs, which optimization adds nothing to, and the shared main.cpp compiles
# in 16 s of CPU this way against 37 s at Release's -O3. The library's code is checked optimized
# by the project's own -Werror build.
consumer_build_type=""
version=$(sed -nE 's/^project\(ringzero VERSION ([0-9.]+).*/\1/p' "$src/CMakeLists.txt")

skip() {
  echo "$*" >"$log.skip"
  exit 77
}
fail() {
  echo "run.sh: $*"
  exit 1
}
# expect <file> <extended regex> [what]: the file must contain a matching line.
expect() {
  grep -Eq -- "$2" "$1" || fail "expected a line matching '$2' in $1${3:+ ($3)}"
}

# A copy of the source tree as a fresh clone has it (tracked files plus new files git does not
# ignore), committed into its own repository so FetchContent and vcpkg_from_git can clone it.
make_snapshot() {
  rm -rf "$snapshot" && mkdir -p "$snapshot"
  if git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$src" && git ls-files -z --cached --others --exclude-standard |
      while IFS= read -r -d '' f; do [[ -e $f ]] && printf '%s\0' "$f"; done |
      tar --null -T - -cf -) | tar -C "$snapshot" -xf -
  else
    tar -C "$src" --exclude='./build*' -cf - . | tar -C "$snapshot" -xf -
  fi
  git -C "$snapshot" -c init.defaultBranch=main init -q &&
    git -C "$snapshot" add -A &&
    git -C "$snapshot" -c user.name=ringzero -c user.email=ringzero@localhost \
      commit -q -m snapshot
}

# configure_consumer <step> <project dir under tests/package> [cmake args...]: a fresh copy of
# the project in $work/<step>/src (with the shared main.cpp unless it has its own), configured
# into $work/<step>/build.
configure_consumer() {
  local step=$1 project=$2
  shift 2
  rm -rf "${work:?}/$step" && mkdir -p "$work/$step"
  cp -r "$here/$project" "$work/$step/src"
  [[ -f $work/$step/src/main.cpp ]] || cp "$here/find_package/main.cpp" "$work/$step/src/"
  cmake -S "$work/$step/src" -B "$work/$step/build" "${generator[@]}" \
    "-DCMAKE_BUILD_TYPE=$consumer_build_type" "-DCMAKE_CXX_FLAGS=$warnings" "$@"
}

build_consumer() {
  cmake --build "$work/$1/build" -j "$jobs"
}

# check_two_ranks <step> <output file>: the shared program's two ranks both reported success.
check_two_ranks() {
  expect "$2" '^rank 0 of 2: all_reduce gave 3 in all 1000 elements$'
  expect "$2" '^rank 1 of 2: all_reduce gave 3 in all 1000 elements$'
}

# check_nothing_extra <step>: a parent project got ringzero's library targets and none of its
# tests, examples, benchmarks or tools.
check_nothing_extra() {
  local cache=$work/$1/build/CMakeCache.txt
  for option in TESTS EXAMPLES BENCH TOOLS; do
    expect "$cache" "^RINGZERO_BUILD_$option:BOOL=OFF$" "options default off below a parent"
  done
  expect "$cache" '^RINGZERO_INSTALL:BOOL=OFF$' "options default off below a parent"
  local extra
  extra=$(cmake --build "$work/$1/build" --target help |
    grep -Eo '^(test_[a-z0-9_]+|ringzero[-_][a-z0-9_-]+|[a-z_]*verify_interface_header_sets):' |
    tr '\n' ' ')
  [[ -z $extra ]] || fail "the parent project got ringzero's own targets: $extra"
}

have_libfabric() { pkg-config --exists 'libfabric >= 1.14' 2>/dev/null; }

# nccl_available: the installed config finds CUDA and NCCL on this machine.
nccl_available() {
  configure_consumer nccl-probe components -DCMAKE_PREFIX_PATH="$prefix" \
    -DOPTIONAL_COMPONENTS=nccl >"$work/logs/nccl-probe.log" 2>&1 &&
    grep -q 'component nccl: found=TRUE' "$work/logs/nccl-probe.log"
}

step_install() {
  rm -rf "$prefix"
  local tree=$build
  if [[ -z $tree ]]; then
    tree=$work/ringzero-build
    cmake -S "$src" -B "$tree" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DRINGZERO_INSTALL=ON \
      -DRINGZERO_BUILD_TESTS=OFF -DRINGZERO_BUILD_EXAMPLES=OFF -DRINGZERO_BUILD_BENCH=OFF ||
      return 1
    cmake --build "$tree" -j "$jobs" || return 1
  fi
  cmake --install "$tree" --prefix "$prefix" || return 1
  local cmakedir=$prefix/share/cmake/ringzero
  for f in "$cmakedir/ringzeroConfig.cmake" "$cmakedir/ringzeroConfigVersion.cmake" \
    "$cmakedir/ringzero-targets.cmake" "$cmakedir/ringzero-libfabric.cmake" \
    "$cmakedir/ringzero-nccl.cmake" "$prefix/share/pkgconfig/ringzero.pc" \
    "$prefix/share/pkgconfig/ringzero-libfabric.pc" "$prefix/include/ringzero/ringzero.hpp" \
    "$prefix/include/ringzero/collectives.hpp"; do
    [[ -f $f ]] || fail "cmake --install did not install $f"
  done
  # Every public header of the source tree is installed, backends included.
  local missing
  missing=$(cd "$src/include" && find ringzero -type f \( -name '*.hpp' -o -name '*.cuh' \) |
    while read -r h; do [[ -f $prefix/include/$h ]] || echo "$h"; done)
  [[ -z $missing ]] || fail "headers not installed: $missing"
  grep -A1 'requested no architecture check' "$cmakedir/ringzeroConfigVersion.cmake" |
    grep -q 'if("TRUE")' ||
    fail "ringzeroConfigVersion.cmake checks the pointer size; a header-only package must not"
  for tool in ringzero-run ringzero-perf ringzero-model; do
    if [[ -n $(find "$tree" -name "$tool" -type f -perm -u+x -print -quit) ]]; then
      [[ -x $prefix/bin/$tool ]] || fail "$tool was built but not installed"
      echo "installed $tool"
    fi
  done
  if [[ -x $prefix/bin/ringzero-model ]]; then
    "$prefix/bin/ringzero-model" --section published "$prefix/share/ringzero/fabrics/p5.fabric" \
      >/dev/null || fail "the installed ringzero-model cannot read its installed fabric files"
  fi
  make_snapshot
}

ensure_installed() {
  if [[ ! -f $prefix/share/cmake/ringzero/ringzeroConfig.cmake || ! -d $snapshot/.git ]]; then
    step_install || fail "install failed"
  fi
}

step_core() {
  configure_consumer core find_package -DCMAKE_PREFIX_PATH="$prefix" || return 1
  expect "$work/core/build/CMakeCache.txt" "^ringzero_DIR:PATH=$prefix/share/cmake/ringzero$" \
    "the consumer found the installed package"
  build_consumer core || return 1
  "$work/core/build/allreduce" | tee "$work/core/out.txt" || return 1
  check_two_ranks core "$work/core/out.txt"
}

# Two processes over libfabric's shm provider, started by ringzero-run when it was installed, else
# as torchrun would start them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
step_libfabric() {
  have_libfabric || skip "libfabric >= 1.14 is not installed (apt-get install libfabric-dev)"
  configure_consumer libfabric libfabric -DCMAKE_PREFIX_PATH="$prefix" || return 1
  build_consumer libfabric || return 1
  local out=$work/libfabric/out.txt
  export FI_PROVIDER=shm RINGZERO_TIMEOUT=60
  cd "$work/libfabric/build" || return 1
  if [[ -x $prefix/bin/ringzero-run ]]; then
    echo "launching with ringzero-run"
    "$prefix/bin/ringzero-run" -n 2 ./allreduce_fabric >"$out" || { cat "$out" && return 1; }
  else
    echo "launching two processes torchrun-style"
    local port=$((20000 + RANDOM % 40000)) pids=() r rc=0
    for r in 0 1; do
      RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=$port ./allreduce_fabric >"$out.$r" &
      pids+=($!)
    done
    for r in 0 1; do wait "${pids[$r]}" || rc=1; done
    cat "$out.0" "$out.1" >"$out"
    ((rc == 0)) || { cat "$out" && return 1; }
  fi
  cat "$out"
  for r in 0 1; do
    expect "$out" "rank $r of 2 \(pid [0-9]+\): all_reduce gave 3 in all 1000 elements$"
  done
  local processes
  processes=$(sed -nE 's/.*rank [01] of 2 \(pid ([0-9]+)\).*/\1/p' "$out" | sort -u | wc -l)
  ((processes == 2)) || fail "expected the two ranks to be two processes"
}

step_nccl() {
  nccl_available || skip "the CUDA toolkit or NCCL is not installed here"
  configure_consumer nccl nccl -DCMAKE_PREFIX_PATH="$prefix" || return 1
  build_consumer nccl || return 1
  "$work/nccl/build/allreduce_nccl" | tee "$work/nccl/out.txt" || return 1
  expect "$work/nccl/out.txt" '^(no GPU: .*ringzero: .*|rank 0 of 1 on GPU [0-9]+: all_reduce gave 1 in all 1000 elements)$'
}

# How find_package(ringzero) treats components whose dependencies are missing, unknown
# components and versions: configure-only, with the dependencies hidden from CMake.
step_components() {
  local hide=(-DCMAKE_DISABLE_FIND_PACKAGE_PkgConfig=ON -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
  local out=$work/components.out
  configure_consumer components components -DCMAKE_PREFIX_PATH="$prefix" "${hide[@]}" \
    "-DOPTIONAL_COMPONENTS=libfabric;nccl" >"$out" 2>&1 || fail "optional components: configure failed"
  expect "$out" 'optional component libfabric unavailable: pkg-config was not found'
  expect "$out" 'optional component nccl unavailable: the CUDA toolkit was not found'
  expect "$out" 'component libfabric: found=FALSE target=FALSE'
  expect "$out" 'component nccl: found=FALSE target=FALSE'

  configure_consumer components components -DCMAKE_PREFIX_PATH="$prefix" "${hide[@]}" \
    -DREQUIRED_COMPONENTS=nccl >"$out" 2>&1 && fail "a required component without CUDA configured"
  expect "$out" 'required components are unavailable:'
  expect "$out" 'component nccl: the CUDA toolkit was not found'

  configure_consumer components components -DCMAKE_PREFIX_PATH="$prefix" "${hide[@]}" \
    -DREQUIRED_COMPONENTS=libfabric >"$out" 2>&1 &&
    fail "a required component without pkg-config configured"
  expect "$out" 'component libfabric: pkg-config was not found'

  PKG_CONFIG_LIBDIR=/nonexistent PKG_CONFIG_PATH="" configure_consumer components components \
    -DCMAKE_PREFIX_PATH="$prefix" -DREQUIRED_COMPONENTS=libfabric >"$out" 2>&1 &&
    fail "a required component without libfabric configured"
  expect "$out" 'component libfabric: pkg-config cannot find libfabric >= 1.14'

  configure_consumer components components -DCMAKE_PREFIX_PATH="$prefix" \
    -DREQUIRED_COMPONENTS=mpi >"$out" 2>&1 && fail "an unknown component configured"
  expect "$out" "component mpi: no such component \(ringzero has: libfabric, nccl\)"

  configure_consumer components components -DCMAKE_PREFIX_PATH="$prefix" \
    -DREQUIRED_VERSION=1.0 >"$out" 2>&1 && fail "find_package(ringzero 1.0) accepted $version"
  expect "$out" "version: $version"

  if have_libfabric; then
    configure_consumer components components -DCMAKE_PREFIX_PATH="$prefix" \
      -DREQUIRED_COMPONENTS=libfabric >"$out" 2>&1 || fail "component libfabric: configure failed"
    expect "$out" 'component libfabric: found=TRUE target=TRUE'
  fi
  echo "components: optional, required, unknown and version checks behave"
}

# pkg-config against a copy of the installed tree moved elsewhere: the .pc files are relocatable.
step_pkg_config() {
  command -v pkg-config >/dev/null || skip "pkg-config is not installed"
  local moved=$work/pkg_config/moved-prefix
  rm -rf "$work/pkg_config" && mkdir -p "$work/pkg_config" && cp -r "$prefix" "$moved"
  export PKG_CONFIG_PATH=$moved/share/pkgconfig
  [[ $(pkg-config --modversion ringzero) == "$version" ]] || fail "pkg-config reports a wrong version"
  local flags
  flags=$(pkg-config --cflags --libs ringzero) || return 1
  [[ $flags == *"-I$moved/"* ]] || fail "ringzero.pc does not point into the moved tree: $flags"
  cp "$here/find_package/main.cpp" "$work/pkg_config/"
  # shellcheck disable=SC2086 # flags and warnings are word lists
  c++ -std=c++20 $warnings "$work/pkg_config/main.cpp" $flags -o "$work/pkg_config/allreduce" ||
    return 1
  "$work/pkg_config/allreduce" | tee "$work/pkg_config/out.txt" || return 1
  check_two_ranks pkg_config "$work/pkg_config/out.txt"
  if have_libfabric; then
    pkg-config --libs ringzero-libfabric | grep -q -- '-lfabric' ||
      fail "ringzero-libfabric.pc does not pull in libfabric"
  fi
}

step_add_subdirectory() {
  rm -rf "$work/add_subdirectory"
  mkdir -p "$work/add_subdirectory/src/third_party"
  cp -r "$here/add_subdirectory/." "$here/find_package/main.cpp" "$work/add_subdirectory/src/"
  cp -r "$snapshot" "$work/add_subdirectory/src/third_party/ringzero"
  rm -rf "$work/add_subdirectory/src/third_party/ringzero/.git"
  cmake -S "$work/add_subdirectory/src" -B "$work/add_subdirectory/build" "${generator[@]}" \
    "-DCMAKE_BUILD_TYPE=$consumer_build_type" "-DCMAKE_CXX_FLAGS=$warnings" || return 1
  check_nothing_extra add_subdirectory
  build_consumer add_subdirectory || return 1
  "$work/add_subdirectory/build/allreduce" | tee "$work/add_subdirectory/out.txt" || return 1
  check_two_ranks add_subdirectory "$work/add_subdirectory/out.txt"
}

step_fetchcontent() {
  command -v git >/dev/null || skip "git is not installed"
  local commit
  commit=$(git -C "$snapshot" rev-parse HEAD) || return 1
  configure_consumer fetchcontent fetchcontent "-DRINGZERO_REPOSITORY=file://$snapshot" \
    "-DRINGZERO_TAG=$commit" || return 1
  [[ -f $work/fetchcontent/build/_deps/ringzero-src/include/ringzero/ringzero.hpp ]] ||
    fail "FetchContent did not clone ringzero into _deps"
  check_nothing_extra fetchcontent
  build_consumer fetchcontent || return 1
  "$work/fetchcontent/build/allreduce" | tee "$work/fetchcontent/out.txt" || return 1
  check_two_ranks fetchcontent "$work/fetchcontent/out.txt"
}

# Every configure preset of CMakePresets.json configures (cuda only where CUDA and NCCL are).
step_presets() {
  local presets
  presets=$(cd "$snapshot" && cmake --list-presets=configure | sed -nE 's/^ +"([a-z0-9_-]+)".*/\1/p')
  [[ -n $presets ]] || fail "cmake --list-presets found no configure presets"
  local p configured=()
  for p in $presets; do
    if [[ $p == cuda ]] && ! nccl_available; then
      echo "preset cuda: not configured, no CUDA toolkit or NCCL here"
      continue
    fi
    (cd "$snapshot" && cmake --preset "$p" -B "$work/presets/$p") >"$work/logs/preset-$p.log" 2>&1 ||
      { cat "$work/logs/preset-$p.log" && fail "cmake --preset $p failed"; }
    ! grep -A5 'Manually-specified variables were not used' "$work/logs/preset-$p.log" ||
      fail "preset $p sets cache variables the project does not use"
    configured+=("$p")
  done
  echo "configured presets: ${configured[*]}"
  (cd "$snapshot" && cmake --workflow --list-presets) | grep -q '"dev"' ||
    fail "no dev workflow preset"
}

# The overlay port run by a stand-in for vcpkg (vcpkg/vcpkg-shim.cmake says what it covers),
# once as the in-tree overlay and once as a registry copy that fetches with vcpkg_from_git;
# then a consumer finds the result the way a vcpkg toolchain points it there.
step_vcpkg() {
  [[ -f $snapshot/LICENSE ]] ||
    fail "the source tree has no LICENSE file, which vcpkg_install_copyright needs"
  local features=""
  have_libfabric && features=libfabric
  local root=$work/vcpkg
  rm -rf "$root"
  cmake -DPORT_DIR="$snapshot/ports/ringzero" -DOUT="$root/overlay" -DWITH_FEATURES="$features" \
    -P "$here/vcpkg/vcpkg-shim.cmake" || return 1
  mkdir -p "$root/registry" && cp -r "$snapshot/ports/ringzero" "$root/registry/"
  RINGZERO_GIT_URL=file://$snapshot RINGZERO_GIT_REF=$(git -C "$snapshot" rev-parse HEAD) \
    cmake -DPORT_DIR="$root/registry/ringzero" -DOUT="$root/fetched" -P "$here/vcpkg/vcpkg-shim.cmake" ||
    return 1
  local installed=$root/overlay/installed/x64-linux
  diff -r "$installed/include" "$root/fetched/installed/x64-linux/include" >/dev/null ||
    fail "the fetched port installed different headers than the overlay port"
  configure_consumer vcpkg-consumer find_package -DCMAKE_PREFIX_PATH="$installed" || return 1
  expect "$work/vcpkg-consumer/build/CMakeCache.txt" "^ringzero_DIR:PATH=$installed/share/ringzero$"
  build_consumer vcpkg-consumer || return 1
  "$work/vcpkg-consumer/build/allreduce" | tee "$work/vcpkg-consumer/out.txt" || return 1
  check_two_ranks vcpkg "$work/vcpkg-consumer/out.txt"
  if [[ -n $features ]]; then
    configure_consumer vcpkg-components components -DCMAKE_PREFIX_PATH="$installed" \
      -DREQUIRED_COMPONENTS=libfabric >"$work/vcpkg-components.out" 2>&1 ||
      fail "find_package(ringzero COMPONENTS libfabric) failed on the vcpkg tree"
    expect "$work/vcpkg-components.out" 'component libfabric: found=TRUE target=TRUE'
  fi
}

# conan create, offline: fmt and libfabric come from the system through the profile's
# [platform_requires]; no remote is consulted.
step_conan() {
  local conan
  conan=$(command -v conan || true)
  # scripts/deps.sh installs it into build/conan-venv; an earlier run of this step, into $work.
  local venv
  for venv in "$src/build/conan-venv" "$work/conan-venv"; do
    if [[ -z $conan && -x $venv/bin/conan ]]; then conan=$venv/bin/conan; fi
  done
  if [[ -z $conan ]]; then
    ((pip)) || skip "conan is not on PATH (pip install conan)"
    python3 -m venv "$work/conan-venv" || skip "python3 -m venv failed (apt-get install python3-venv)"
    "$work/conan-venv/bin/pip" install --quiet conan || skip "pip install conan failed (no PyPI?)"
    conan=$work/conan-venv/bin/conan
  fi
  export CONAN_HOME=$work/conan-home
  rm -rf "$CONAN_HOME"
  "$conan" --version
  "$conan" profile detect --exist-ok || return 1
  local options=()
  have_libfabric && options=(-o 'ringzero/*:with_libfabric=True')
  (cd "$snapshot" && "$conan" create . -pr:a packaging/conan/debian12 --build=missing --no-remote \
    "${options[@]}") 2>&1 | tee "$work/conan.out" || return 1
  check_two_ranks conan "$work/conan.out"
  expect "$work/conan.out" 'fmt/9\.1\.0 - Platform'
}

mkdir -p "$work/logs"
passed=0
failed=0
skipped=0
for step in "${steps[@]}"; do
  log=$work/logs/$step.log
  rm -f "$log.skip"
  start=$SECONDS
  [[ $step == install ]] || (ensure_installed) >"$work/logs/ensure-install.log" 2>&1 ||
    { echo "package: install  FAILED (log: $work/logs/ensure-install.log)" && exit 1; }
  (set -o pipefail && "step_$step") >"$log" 2>&1
  rc=$?
  took=$((SECONDS - start))
  if ((rc == 0)); then
    printf 'package: %-17s ok (%ss)\n' "$step" "$took"
    passed=$((passed + 1))
  elif ((rc == 77)); then
    printf 'package: %-17s skipped: %s\n' "$step" "$(cat "$log.skip")"
    skipped=$((skipped + 1))
  else
    printf 'package: %-17s FAILED (%ss; log: %s)\n' "$step" "$took" "$log"
    tail -n 25 "$log" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
done
echo "package: $passed ok, $failed failed, $skipped skipped"
((failed == 0)) || exit 1
((passed > 0 || skipped == 0)) || exit 77
exit 0
