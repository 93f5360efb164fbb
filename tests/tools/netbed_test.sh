#!/usr/bin/env bash
# bench/netbed at a small scale: 2 simulated hosts joined by 2 rails shaped to 200mbit, one
# ringzero-perf rank on each, all_reduce of 4 MiB over libfabric tcp;ofi_rxm with the result
# checked (-c 1). Asserts what the bed is for:
#   - the ranks ran on different hosts as ringzero sees them (its RINGZERO_DEBUG=INFO lines name
#     each rank's host), so it used the network between them and no shared memory;
#   - the all_reduce checked clean, and its bytes crossed the rails (interface counters);
#   - the shaping holds (bus bandwidth under 2 rails x 200 Mbit/s);
#   - with RINGZERO_RAILS=auto, libfabric and the socket transport each find both rails (and not
#     loopback), and libfabric cuts each large message into a piece per rail: the two rails carry
#     its bytes half and half, within 2 % (messages placed whole by tag split them 45:55 here);
#   - a rail whose link goes down mid-run (socket transport, then libfabric): both ranks warn
#     naming it, its traffic moves to the other rail, and every call checks clean;
#   - the bed leaves no namespace behind: after `down`, and after a `run` that made its own bed
#     and whose command failed.
# Skips (exit 77) where the bed cannot run: not root, no ip netns, no unshare.
#
#   netbed_test.sh RINGZERO_PERF
set -euo pipefail

perf=${1:?usage: netbed_test.sh RINGZERO_PERF}
netbed=$(cd "${BASH_SOURCE[0]%/*}/../../bench" && pwd)/netbed

skip() {
  echo "SKIP: $*"
  exit 77
}
[[ $EUID -eq 0 ]] || skip "the bed needs root (network and UTS namespaces)"
if ! command -v ip >/dev/null || ! ip netns list >/dev/null 2>&1; then skip "'ip netns' is not available"; fi
command -v tc >/dev/null || skip "tc (iproute2) is not installed"
if ! command -v unshare >/dev/null || ! unshare --uts true 2>/dev/null; then
  skip "unshare cannot create UTS namespaces here"
fi

# A name of its own, so that it runs beside other beds and other runs of itself.
name=t$$
logs=$(mktemp -d)
cleanup() {
  bash "$netbed" --name "$name" down >/dev/null 2>&1 || true
  bash "$netbed" --name "${name}b" down >/dev/null 2>&1 || true
  rm -rf "$logs"
}
trap cleanup EXIT

failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
leftover() { ip netns list | awk '{print $1}' | grep -E "^$1-" || true; }

rc=0
bash "$netbed" --name "$name" --rails 2 --rate 200mbit up || rc=$?
((rc != 77)) || skip "bench/netbed cannot make a bed here"
((rc == 0)) || { echo "FAIL: bench/netbed up exited with $rc"; exit 1; }

size=$((4 << 20))
rc=0
bash "$netbed" --name "$name" --logs "$logs" --timeout 60 run -- \
  env FI_PROVIDER='tcp;ofi_rxm' RINGZERO_DEBUG=INFO RINGZERO_TIMEOUT=50 \
  "$perf" all_reduce -T libfabric -p 'tcp;ofi_rxm' -d float -o sum -b $size -e $size \
  -n 3 -w 1 -c 1 >"$logs/table" || rc=$?
cat "$logs/table"
((rc == 0)) || fail "ringzero-perf exited with $rc"

# The row of 4 MiB: no wrong element out of place or in place, and the footer agrees.
# busbw from the time column (the table's GB/s has two decimals); all_reduce on 2 ranks: x 1.
read -r busbw wrong iwrong <<<"$(awk -v s=$size '$1 == s && NF >= 13 {print $1 / ($6 * 1e-6), $9, $13}' "$logs/table")"
[[ ${wrong:-x} == 0 && ${iwrong:-x} == 0 ]] || fail "the 4 MiB row is missing or has wrong elements"
grep -q 'Out of bounds values : 0 OK' "$logs/table" || fail "ringzero-perf did not report 0 out of bounds"

# ringzero's own view: each rank on its own host, over tcp, bound to a rail address of its host.
for rank in 0 1; do
  line=$(grep -o "libfabric: rank $rank of 2 on .*" "$logs/$rank.err" | head -n 1 || true)
  echo "rank $rank: ${line:-no libfabric line}"
  [[ $line == "libfabric: rank $rank of 2 on "*"($name-h$rank)" ]] ||
    fail "rank $rank did not report host $name-h$rank: '${line}'"
  [[ $line == *tcp* ]] || fail "rank $rank does not use the tcp provider: '$line'"
  grep -Eq "address fi_sockaddr_in://10\.77\.[0-9]+\.$((rank + 1)):" "$logs/$rank.err" ||
    fail "rank $rank's endpoint is not on one of its rails (10.77.*.$((rank + 1)))"
  ! grep -q '^shm: ' "$logs/$rank.err" || fail "rank $rank used the shm transport"
done

# The bytes crossed the rails: host 0 sent at least its share (S/2 each way, per call).
sent=0
for r in 0 1; do
  n=$(bash "$netbed" --name "$name" exec 0 cat "/sys/class/net/rz$r/statistics/tx_bytes")
  sent=$((sent + n))
done
echo "host 0 sent $sent bytes over rz0 and rz1"
((sent >= size)) || fail "only $sent bytes left host 0 over the rails"

# Shaped: at most 2 x 200 Mbit/s = 50 MB/s, with room for the token bucket's burst.
if [[ -n ${busbw:-} ]]; then
  echo "busbw $busbw B/s"
  awk -v b="$busbw" 'BEGIN {exit !(b > 0 && b <= 50e6 * 1.25)}' ||
    fail "busbw $busbw B/s is outside (0, 62.5 MB/s]: is the rate shaping in place?"
fi

# Both rails at once, discovered: the same all_reduce over libfabric (every message of 128 KiB or
# more in a piece per rail), then over the socket transport. Host 0's bytes out per rail (data,
# and acknowledgements of what came back) must split evenly under libfabric's fixed cut; the
# socket transport places pieces by measured rate, so there each rail must only carry a share.
tx() { bash "$netbed" --name "$name" exec 0 cat "/sys/class/net/rz$1/statistics/tx_bytes"; }
for transport in libfabric socket; do
  before=("$(tx 0)" "$(tx 1)")
  rc=0
  bash "$netbed" --name "$name" --logs "$logs" --timeout 60 run -- \
    env FI_PROVIDER='tcp;ofi_rxm' RINGZERO_RAILS=auto RINGZERO_DEBUG=INFO RINGZERO_TIMEOUT=50 \
    "$perf" all_reduce -T $transport -d float -o sum -b $size -e $size \
    -n 3 -w 1 -c 1 >"$logs/table.$transport" || rc=$?
  ((rc == 0)) || fail "ringzero-perf -T $transport over two rails exited with $rc"
  read -r wrong iwrong <<<"$(awk -v s=$size '$1 == s && NF >= 13 {print $9, $13}' "$logs/table.$transport")"
  [[ ${wrong:-x} == 0 && ${iwrong:-x} == 0 ]] ||
    fail "-T $transport over two rails: the 4 MiB row is missing or has wrong elements"
  for rank in 0 1; do
    grep -q "RINGZERO_RAILS=auto: 2 rails: rz0,rz1" "$logs/$rank.err" ||
      fail "-T $transport, rank $rank did not discover rz0 and rz1: $(grep -o 'RINGZERO_RAILS=auto.*' "$logs/$rank.err" | head -n 1)"
  done
  d0=$(($(tx 0) - before[0]))
  d1=$(($(tx 1) - before[1]))
  echo "-T $transport, two rails: host 0 sent $d0 bytes over rz0, $d1 over rz1"
  ((d0 + d1 >= 4 * size)) || fail "only $((d0 + d1)) bytes left host 0 in 4 calls of $size bytes"
  # Striped, the two rails' bytes differ by 0.2 % (measured); placed whole by tag, by 9 %.
  least=0.49
  [[ $transport == socket ]] && least=0.2
  awk -v a="$d0" -v b="$d1" -v l=$least 'BEGIN {exit !(a >= l * (a + b) && b >= l * (a + b))}' ||
    fail "-T $transport: the rails' shares ($d0 and $d1) are below $least each"
done

# A rail that goes down mid-run (its link set down in host 0, as a pulled cable would): each
# transport moves its traffic to the other rail, warns naming it on both hosts, and every call
# still checks clean. Both run the transport kit's rail engine, which finds out from the link's
# state (or a connection that breaks) and sends again what the rail held unacknowledged.
for transport in socket libfabric; do
  bash "$netbed" --name "$name" exec 0 ip link set rz1 up
  rc=0
  bash "$netbed" --name "$name" --logs "$logs" --timeout 60 run -- \
    env FI_PROVIDER='tcp;ofi_rxm' RINGZERO_RAILS=rz0,rz1 RINGZERO_TIMEOUT=50 \
    "$perf" all_reduce -T $transport -d float -o sum -b $size -e $size \
    -n 10 -w 1 -c 1 >"$logs/table.failover" &
  runner=$!
  sleep 1
  bash "$netbed" --name "$name" exec 0 ip link set rz1 down
  wait $runner || rc=$?
  ((rc == 0)) || fail "-T $transport: ringzero-perf with a rail going down exited with $rc"
  read -r wrong iwrong <<<"$(awk -v s=$size '$1 == s && NF >= 13 {print $9, $13}' "$logs/table.failover")"
  [[ ${wrong:-x} == 0 && ${iwrong:-x} == 0 ]] ||
    fail "-T $transport: with a rail going down, the 4 MiB row is missing or has wrong elements"
  for rank in 0 1; do
    line=$(grep -o "rail rz1 failed toward rank $((1 - rank)).*" "$logs/$rank.err" | head -n 1 || true)
    echo "-T $transport, rank $rank: ${line:-no warning about rz1}"
    [[ $line == *"go over rail rz0"* ]] || fail "-T $transport: rank $rank did not move rz1's traffic to rz0"
  done
done

bash "$netbed" --name "$name" down
[[ -z $(leftover "$name") ]] || fail "namespaces left after down: $(leftover "$name")"

# A run without a bed makes one and removes it, here after its command failed.
rc=0
bash "$netbed" --name "${name}b" --rate 0 run -- sh -c 'test "$(hostname)" = "$0-h$NETBED_HOST" && exit 3' "${name}b" || rc=$?
((rc == 3)) || fail "run of a failing command exited with $rc, not 3 (the ranks' status)"
[[ -z $(leftover "${name}b") ]] || fail "namespaces left after run: $(leftover "${name}b")"

if ((failures)); then
  echo "netbed: $failures check(s) failed"
  exit 1
fi
echo "netbed: all checks passed"
