#!/usr/bin/env bash
# ringzero-perf --memory device where it cannot run: every rank must fail at once with one line
# saying why ($3: "no CUDA device is visible" where CUDA is built in, "built without CUDA"
# where it is not) and exit status 3, alone and as two ranks under ringzero-run ($2), rather
# than crash or wait for peers. Where a GPU is present (/dev/nvidia0, ...) there is nothing to
# refuse, and the test reports a skip (exit 77).
set -u
perf=$1
run=$2
expect=$3
if [ "$expect" = "no CUDA device is visible" ] && compgen -G "/dev/nvidia[0-9]*" >/dev/null; then
  echo "skipped: a CUDA device is visible here"
  exit 77
fi
status=0
fail() {
  echo "FAILED: $*"
  status=1
}

out=$("$perf" all_reduce -T libfabric --memory device -b 8 -e 8 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 3 ] || fail "one rank: exit status $rc, expected 3"
[ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] || fail "one rank: expected exactly one line"
grep -q -- "--memory device: .*$expect" <<<"$out" || fail "one rank: no '$expect' line"

out=$(timeout 60 "$run" -n 2 --timeout 50 -- "$perf" all_reduce -T libfabric --memory device \
  -b 8 -e 8 2>&1)
rc=$?
echo "$out"
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "two ranks: exit status $rc, expected a failure"
[ "$(grep -c -- "$expect" <<<"$out")" -ge 1 ] || fail "two ranks: no '$expect' line"
exit $status
