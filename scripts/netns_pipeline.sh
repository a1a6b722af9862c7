#!/usr/bin/env bash
# Run a 2-rank program over a real (optionally shaped) link: two network namespaces joined by a
# veth pair, rank 0 in the first, rank 1 in the second, `tc tbf` shaping both directions.
#
#   sudo scripts/netns_pipeline.sh [--rate 80mbit] [--burst 64kb] [--mtu 1500] [--port 29500] -- CMD [ARGS...]
#
# Each rank runs CMD with RANK, LOCAL_RANK, WORLD_SIZE=2, MASTER_ADDR (rank 0's veth address),
# MASTER_PORT and GLOO_SOCKET_IFNAME (its veth) set, so build_parallel_context(backend="gloo")
# connects over the veth. No --rate = unshaped. --mtu: the veth's (default 1500 as on a real
# link; lo has 65536). Needs root (ip netns, tc). Exit status: the first failing rank's, else 0.
# Namespaces, veth and qdiscs are always removed, also on Ctrl-C or kill. Each option's value is checked as text
# (never evaluated) before anything is made: a bad one is one line naming the option, exit code 2.
#
# Addresses: 127.77.0.1/30 and 127.77.0.2/30, only inside the two private namespaces (each has
# its own routing table and port space, so concurrent runs do not collide). The kernel treats
# 127/8 on a non-loopback device as martian (connect() fails with EINVAL) unless the device has
# net.ipv4.conf.<dev>.route_localnet=1, which is set below inside each namespace. The /30 routes
# are longer than the namespace's own `local 127.0.0.0/8 dev lo`, so the peer's address goes out
# on the veth, not to the local loopback.
set -euo pipefail

rate="" burst="" mtu=1500 port=29500 subnet=127.77.0 qlatency=200ms
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
refuse() {  # refuse OPTION VALUE WHY
  printf 'netns_pipeline: %s=%q: %s\n' "$1" "$2" "$3" >&2; exit 2
}
# option NAME VALUE REGEX WHY ARGS-LEFT: the value when it matches (bash's =~ on the text: nothing in it runs)
option() {
  [[ $5 -ge 2 ]] || refuse "$1" "" "needs a value"
  [[ $2 =~ $3 ]] || refuse "$1" "$2" "$4"
}
UNIT='[kKmMgGtT]?([bB][iI][tT]|[bB][pP][sS])'
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rate) option "$1" "${2-}" "^[0-9]{1,9}(\.[0-9]{1,6})?([eE][+]?[0-9]{1,2})?$UNIT\$" "a tc rate, e.g. 80mbit" "$#"; rate=$2; shift 2 ;;
    --burst) option "$1" "${2-}" '^[0-9]{1,9}([kKmMgG]?[bB]|[kKmMgG][bB][iI][tT]|[kKmMgG])?$' \
               "a tc burst size, e.g. 64kb" "$#"; burst=$2; shift 2 ;;
    --mtu) option "$1" "${2-}" '^[1-9][0-9]{1,4}$' "a whole number of bytes, 68 to 65535" "$#"
           (( 10#$2 >= 68 && 10#$2 <= 65535 )) || refuse "$1" "$2" "a whole number of bytes, 68 to 65535"
           mtu=$2; shift 2 ;;
    --port) option "$1" "${2-}" '^[1-9][0-9]{0,4}$' "a TCP port, 1 to 65535" "$#"
            (( 10#$2 <= 65535 )) || refuse "$1" "$2" "a TCP port, 1 to 65535"
            port=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) echo "netns_pipeline: unknown option $1" >&2; usage ;;
  esac
done
[[ $# -gt 0 ]] || { echo "netns_pipeline: no command after --" >&2; usage; }
[[ $EUID -eq 0 ]] || { echo "netns_pipeline: needs root (ip netns, tc)" >&2; exit 1; }

id=$$  # per-run names: concurrent runs get their own namespaces and devices (IFNAMSIZ is 15)
ns=("ntx0-$id" "ntx1-$id")
dev=("ntx${id}a" "ntx${id}b")
addr=("$subnet.1" "$subnet.2")
pids=()

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  # deleting a namespace destroys its veth end (and so the pair) and its qdiscs
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add "${ns[0]}"
ip netns add "${ns[1]}"
ip link add "${dev[0]}" type veth peer name "${dev[1]}"
for i in 0 1; do
  ip link set "${dev[$i]}" netns "${ns[$i]}"
  ip -n "${ns[$i]}" link set lo up
  ip netns exec "${ns[$i]}" sysctl -qw "net.ipv4.conf.${dev[$i]}.route_localnet=1"
  ip -n "${ns[$i]}" addr add "${addr[$i]}/30" dev "${dev[$i]}"
  ip -n "${ns[$i]}" link set "${dev[$i]}" mtu "$mtu" up
  if [[ -n "$rate" ]]; then
    # tbf needs a bucket of at least rate/HZ bytes, and veth hands it up to 64 KiB GSO packets
    tc -n "${ns[$i]}" qdisc add dev "${dev[$i]}" root tbf rate "$rate" burst "${burst:-64kb}" latency "$qlatency"
  fi
done

echo "netns_pipeline: ${ns[0]}(${addr[0]}) <-> ${ns[1]}(${addr[1]}) rate=${rate:-unshaped} mtu=$mtu" >&2
for i in 0 1; do
  ip netns exec "${ns[$i]}" env RANK="$i" LOCAL_RANK="$i" WORLD_SIZE=2 MASTER_ADDR="${addr[0]}" \
    MASTER_PORT="$port" GLOO_SOCKET_IFNAME="${dev[$i]}" NTX_NETNS="${ns[$i]}" NTX_RATE="${rate:-}" "$@" &
  pids+=("$!")
done

# first failure wins: stop the other rank (cleanup) instead of letting it wait out its gloo timeout
running=("${pids[@]}")
while [[ ${#running[@]} -gt 0 ]]; do
  status=0
  wait -n -p done_pid "${running[@]}" || status=$?
  if [[ $status -ne 0 ]]; then echo "netns_pipeline: rank pid $done_pid failed (exit $status)" >&2; exit "$status"; fi
  left=()
  for pid in "${running[@]}"; do [[ $pid == "$done_pid" ]] || left+=("$pid"); done
  running=("${left[@]}")
done
pids=()
