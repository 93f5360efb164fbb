#!/usr/bin/env bash
# Packs the GPU check's binaries from a build folder into OUT, laid out as the build is, with the
# shared libraries they need that a bare GPU machine may lack (fmt, libfabric and its providers'
# dependencies, the CUDA runtime) in OUT/lib: for a GPU machine without compilers or network.
# NCCL is left out (it is large, and the GPU machine's own or PyPI's wheel is used there).
#
#   scripts/gpu_bundle.sh build/gpu .gpu-bundle
#   (on the GPU machine)  scripts/gpu_check.sh --prebuilt .gpu-bundle
set -euo pipefail
build=${1:?usage: gpu_bundle.sh BUILD OUT}
out=${2:?usage: gpu_bundle.sh BUILD OUT}
rm -rf "$out"
mkdir -p "$out/lib"
bins=(
  tests/zero/test_zero_sharder_cuda tests/zero/test_zero_sharder_cuda_per_thread
  tests/transport/test_nccl_gpu tests/kernels/test_cuda_kernels
  tests/transport/test_libfabric_hmem_gpu tests/transport/test_cuda_loopback
  examples/ringzero-cuda-train tools/perf/ringzero-perf
  tools/run/ringzero-run bench/gpu/ringzero-bench-kernels bench/gpu/ringzero-bench-nccl
  bench/gpu/ringzero-bench-staged
)
for b in "${bins[@]}"; do
  [[ -x $build/$b ]] || continue
  mkdir -p "$out/$(dirname "$b")"
  cp "$build/$b" "$out/$b"
  strip --strip-debug "$out/$b" 2>/dev/null || true
  # Every library but the C runtime, the driver and NCCL.
  ldd "$build/$b" | awk '$3 ~ /^\// {print $3}' |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libstdc\+\+|libgcc_s|libcuda|libnccl)\.so' |
    while read -r lib; do cp -Ln "$lib" "$out/lib/" 2>/dev/null || true; done
done
# libfabric loads its providers' libraries as it starts: take the ones it links.
if [[ -e $out/lib/libfabric.so.1 ]]; then
  ldd "$out/lib/libfabric.so.1" | awk '$3 ~ /^\// {print $3}' | grep -Ev '/(libc|ld-linux[^/]*)\.so' |
    while read -r lib; do cp -Ln "$lib" "$out/lib/" 2>/dev/null || true; done
fi
du -sh "$out"
