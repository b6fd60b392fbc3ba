# Emulated hosts for the benchmarks: sourced by bench/run-fanout (and later cross-datacenter runs).
# Every host is a network namespace with one veth "eth0" to a bridge that lives in a namespace of
# its own; each host's link is shaped with tbf in both directions (host egress on eth0, host
# ingress on the bridge side). Addresses are 10.99.0.0/24, which exists only inside these
# namespaces; no namespace has a default route, and the root namespace is never touched: no packet
# can leave. netns_cleanup removes everything (the scripts trap it on exit, failure included).

netns_prefix="thb$$"
netns_hosts=0

# netns_probe: whether namespaces, veth pairs and tbf can be made here (root or CAP_NET_ADMIN,
# iproute2, the kernel's veth and sch_tbf). Leaves nothing behind.
netns_probe() {
  local probe="$netns_prefix-probe"
  ip netns add "$probe" 2> /dev/null || return 1
  local ok=0
  ip -n "$probe" link add probe0 type veth peer name probe1 2> /dev/null &&
    ip netns exec "$probe" tc qdisc add dev probe0 root tbf rate 1gbit burst 256kb latency 50ms 2> /dev/null ||
    ok=1
  ip netns del "$probe" 2> /dev/null || true
  return $ok
}

# netns_setup HOSTS RATE: hosts 0..HOSTS-1 at 10.99.0.(i+1), links shaped to RATE (e.g. 1gbit).
netns_setup() {
  local hosts=$1 rate=$2
  local bridge="$netns_prefix-br"
  ip netns add "$bridge"
  ip -n "$bridge" link set lo up
  ip -n "$bridge" link add br0 type bridge
  ip -n "$bridge" link set br0 up
  for i in $(seq 0 $((hosts - 1))); do netns_add_host "$i" "$bridge" "$rate"; done
}

# netns_add_host I BRIDGE RATE: host I (10.99.0.(I+1)) on BRIDGE's br0, its link shaped both ways.
netns_add_host() {
  local i=$1 bridge=$2 rate=$3
  local host="$netns_prefix-h$i"
  ip netns add "$host"
  netns_hosts=$((i + 1))
  ip -n "$bridge" link add "vb$i" type veth peer name eth0 netns "$host"
  ip -n "$bridge" link set "vb$i" master br0 up
  ip -n "$host" link set lo up
  ip -n "$host" addr add "10.99.0.$((i + 1))/24" dev eth0
  ip -n "$host" link set eth0 up
  ip netns exec "$host" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
  ip netns exec "$bridge" tc qdisc add dev "vb$i" root tbf rate "$rate" burst 256kb latency 50ms
}

# netns_setup_two_dcs HOSTS_A HOSTS_B RATE WAN_RATE: two datacenters, each a bridge in a namespace
# of its own; hosts 0..HOSTS_A-1 on the first, the next HOSTS_B on the second (same addressing as
# netns_setup), every host link shaped to RATE; the bridges joined by one link "wan" shaped to
# WAN_RATE both ways. netns_wan_bytes tells what crossed it.
netns_setup_two_dcs() {
  local hosts_a=$1 hosts_b=$2 rate=$3 wan_rate=$4
  local bridge_a="$netns_prefix-br" bridge_b="$netns_prefix-br2"
  ip netns add "$bridge_a"
  ip netns add "$bridge_b"
  netns_second_bridge=1
  for bridge in "$bridge_a" "$bridge_b"; do
    ip -n "$bridge" link set lo up
    ip -n "$bridge" link add br0 type bridge
    ip -n "$bridge" link set br0 up
  done
  ip -n "$bridge_a" link add wan type veth peer name wan netns "$bridge_b"
  for bridge in "$bridge_a" "$bridge_b"; do
    ip -n "$bridge" link set wan master br0 up
    ip netns exec "$bridge" tc qdisc add dev wan root tbf rate "$wan_rate" burst 256kb latency 100ms
  done
  for i in $(seq 0 $((hosts_a + hosts_b - 1))); do
    if [ "$i" -lt "$hosts_a" ]; then netns_add_host "$i" "$bridge_a" "$rate"; else netns_add_host "$i" "$bridge_b" "$rate"; fi
  done
}

# Bytes that crossed the link between the two datacenters so far (both directions).
netns_wan_bytes() {
  ip netns exec "$netns_prefix-br" sh -c 'echo $(( $(cat /sys/class/net/wan/statistics/tx_bytes) + $(cat /sys/class/net/wan/statistics/rx_bytes) ))'
}

# netns_run HOST COMMAND...: runs COMMAND inside host HOST's namespace.
netns_run() {
  local host=$1
  shift
  ip netns exec "$netns_prefix-h$host" "$@"
}

# Stops every process in the hosts' namespaces (a backgrounded netns_run is a subshell: killing its
# pid would leave the command itself running).
netns_kill_all() {
  for i in $(seq 0 $((netns_hosts - 1))); do
    ip netns pids "$netns_prefix-h$i" 2> /dev/null | xargs -r kill 2> /dev/null || true
  done
  for _ in $(seq 50); do
    local left=0
    for i in $(seq 0 $((netns_hosts - 1))); do
      [ -n "$(ip netns pids "$netns_prefix-h$i" 2> /dev/null)" ] && left=1
    done
    [ "$left" -eq 0 ] && return 0
    sleep 0.1
  done
  for i in $(seq 0 $((netns_hosts - 1))); do
    ip netns pids "$netns_prefix-h$i" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
  done
}

netns_cleanup() {
  netns_kill_all
  for i in $(seq 0 $((netns_hosts - 1))); do ip netns del "$netns_prefix-h$i" 2> /dev/null || true; done
  ip netns del "$netns_prefix-br" 2> /dev/null || true
  [ -n "${netns_second_bridge:-}" ] && ip netns del "$netns_prefix-br2" 2> /dev/null || true
}
