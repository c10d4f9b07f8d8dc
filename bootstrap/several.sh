#!/usr/bin/env bash
# Start several linked p2prl bootstrap nodes on this host: node 1 standalone, the others with
# --initial-peers of node 1, so they form one DHT. Prints every node's multiaddrs; Ctrl-C stops all.
#
#   bootstrap/several.sh --loopback            # local test: 127.0.0.1 only, fresh identities in a temp dir
#   bootstrap/several.sh --public-ip 203.0.113.7 --base-port 31337 --dir ./bootstraps
#
# --loopback: every node listens on 127.0.0.1 (random ports) with relay, NAT probing and IPFS off, and
# links through 127.0.0.1, so nothing but loopback is contacted. It always uses fresh identity files:
# restarting a linked node with an existing identity makes hivemind probe the swarm with default
# (non-loopback) settings to check that the identity is free.
# Without --loopback: ports base-port, base-port+1, ... on all interfaces; identities persist in --dir.
# Set P2PRL to the command to run (default: p2prl; e.g. P2PRL="python -m p2prl.cli").
set -euo pipefail

count=3 base_port=31337 dir="" public_ip="" loopback=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --loopback) loopback=1; shift ;;
    --count) count="$2"; shift 2 ;;
    --base-port) base_port="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --public-ip) public_ip="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
read -r -a p2prl <<< "${P2PRL:-p2prl}"

if [[ $loopback == 1 ]]; then
  [[ -z $dir ]] || { echo "--dir is not used with --loopback (fresh identities each time)" >&2; exit 2; }
  dir=$(mktemp -d -t p2prl-bootstraps.XXXXXX)
else
  dir=${dir:-./bootstraps}
fi
mkdir -p "$dir"

pids=()
stop() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop EXIT
trap 'exit 130' INT TERM

wait_maddrs() {  # $1 = maddrs file, $2 = pid; bounded wait
  for _ in $(seq 120); do
    [[ -s $1 ]] && return 0
    kill -0 "$2" 2>/dev/null || { echo "a bootstrap exited during startup; see ${1%.maddrs}.log" >&2; return 1; }
    sleep 0.5
  done
  echo "timed out waiting for $1" >&2; return 1
}

first=""
for i in $(seq 1 "$count"); do
  args=(bootstrap --identity-path "$dir/node$i.id" --maddrs-file "$dir/node$i.maddrs")
  if [[ $loopback == 1 ]]; then
    args+=(--loopback)
  else
    port=$((base_port + i - 1))
    args+=(--host-maddrs "/ip4/0.0.0.0/tcp/$port")
    [[ -z $public_ip ]] || args+=(--announce-maddrs "/ip4/$public_ip/tcp/$port")
  fi
  [[ -z $first ]] || args+=(--initial-peers "$first")
  rm -f "$dir/node$i.maddrs"
  "${p2prl[@]}" "${args[@]}" >"$dir/node$i.out" 2>"$dir/node$i.log" &
  pids+=($!)
  wait_maddrs "$dir/node$i.maddrs" "$!"
  if [[ -z $first ]]; then  # the others link to node 1 over loopback: same host
    id=$(head -n1 "$dir/node1.maddrs"); id=${id##*/p2p/}
    if [[ $loopback == 1 ]]; then
      first=$(grep -m1 '^/ip4/127.0.0.1/' "$dir/node1.maddrs")
    else
      first="/ip4/127.0.0.1/tcp/$base_port/p2p/$id"
    fi
  fi
  echo "node $i (log: $dir/node$i.log):"
  sed 's/^/  /' "$dir/node$i.maddrs"
done

echo "all $count bootstraps are up and linked; publish one multiaddr of each. Ctrl-C stops them."
wait
