#!/usr/bin/env bash
# Two simulated hosts on one machine: two network namespaces joined by a veth pair, each with
# its own host name (a UTS namespace per rank), and two ranks in each, joined over
# tcp;ofi_rxm through the TCP store that rank 0 serves. The ranks run the test case named below
# from the test program given as $1 (torchrun-style variables, so through from_env()); with
# arguments after it, they run `$1 ARGS...` instead (a benchmark: ringzero-perf ...), and
# rank 0's standard output is printed unprefixed.
#
# Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), iproute2 and util-linux; without them it
# prints SKIP and exits 77, which CTest reports as skipped. Uses 198.51.100.0/24 (TEST-NET-2)
# inside the namespaces only, and removes them on exit.
set -euo pipefail

program=${1:?usage: two_hosts.sh TEST_PROGRAM [ARGS...]}
shift
case_name="two hosts rank"
if (($# > 0)); then
  args=("$@")
  debug=${RINGZERO_DEBUG:-WARN}
else
  args=(--no-skip "--test-case=$case_name")
  debug=INFO
fi
limit=${RINGZERO_TWO_HOSTS_LIMIT:-180}

skip() {
  echo "SKIP: $*"
  exit 77
}

[[ $(id -u) -eq 0 ]] || skip "network namespaces need root"
command -v ip >/dev/null || skip "ip (iproute2) is not installed"
command -v unshare >/dev/null || skip "unshare (util-linux) is not installed"

tag=$$
ns=("rzA$tag" "rzB$tag")
veth=("rzA$tag" "rzB$tag")
addr=(198.51.100.1 198.51.100.2)
host=("ringzero-host-a" "ringzero-host-b")
pids=()

cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
}
trap cleanup EXIT

ip netns add "${ns[0]}" 2>/dev/null || skip "cannot create network namespaces here"
ip netns add "${ns[1]}" || skip "cannot create a second network namespace"
ip link add "${veth[0]}" netns "${ns[0]}" type veth peer name "${veth[1]}" netns "${ns[1]}" ||
  skip "cannot create a veth pair"
# IPv6 off on the veth pair: whether a kernel lists a link's IPv6 address before or after its
# IPv4 one, and whether duplicate address detection has finished when the ranks start, varies
# between machines, and a link-local IPv6 name cannot be dialled from the other host. The
# endpoint prefers reachable IPv4 addresses (tested on its own, in "the endpoint address is one
# that peers on other hosts can reach"); here the link offers IPv4 only.
for i in 0 1; do
  ip netns exec "${ns[$i]}" sysctl -qw "net.ipv6.conf.${veth[$i]}.disable_ipv6=1" 2>/dev/null || true
  ip -n "${ns[$i]}" link set lo up
  ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${veth[$i]}"
  ip -n "${ns[$i]}" link set "${veth[$i]}" up
done
unshare --uts true 2>/dev/null || skip "cannot create UTS namespaces (separate host names)"
# libfabric lists only interfaces that are up: wait for both ends of the link.
for try in $(seq 100); do
  up=0
  for i in 0 1; do
    ip -n "${ns[$i]}" -o link show dev "${veth[$i]}" | grep -q LOWER_UP && up=$((up + 1))
  done
  ((up == 2)) && break
  sleep 0.1
done
((up == 2)) || { echo "the veth pair did not come up"; exit 1; }

# The namespaces are fresh, so any port is free in them.
port=29500
token="two-hosts-$tag-$RANDOM"
logs=$(mktemp -d)
for rank in 0 1 2 3; do
  h=$((rank / 2))
  ip netns exec "${ns[$h]}" unshare --uts env \
    RANK=$rank WORLD_SIZE=4 LOCAL_RANK=$((rank % 2)) LOCAL_WORLD_SIZE=2 \
    MASTER_ADDR="${addr[0]}" MASTER_PORT=$port RINGZERO_TOKEN="$token" \
    FI_TCP_IFACE="${veth[$h]}" RINGZERO_TIMEOUT=60 RINGZERO_DEBUG="$debug" \
    sh -c 'hostname "$0" && exec "$@"' "${host[$h]}" \
    timeout "$limit" "$program" "${args[@]}" >"$logs/$rank" 2>"$logs/$rank.err" &
  pids+=($!)
done

status=0
for rank in 0 1 2 3; do
  wait "${pids[$rank]}" || { echo "rank $rank failed (exit status $?)"; status=1; }
done
pids=()
if (($# > 0)); then
  cat "$logs/0"
  for rank in 0 1 2 3; do sed "s/^/[${host[$((rank / 2))]} rank $rank] /" "$logs/$rank.err" >&2; done
else
  for rank in 0 1 2 3; do
    cat "$logs/$rank" "$logs/$rank.err" | sed "s/^/[${host[$((rank / 2))]} rank $rank] /"
  done
fi
rm -rf "$logs"
if ((status == 0)); then echo "two hosts: all 4 ranks passed"; fi
exit $status
