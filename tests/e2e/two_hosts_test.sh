#!/usr/bin/env bash
# Two hosts with libthclient's default data-plane options (issue 18): host A (network namespace,
# 10.99.0.1) runs th-server and a trainer, host B (10.99.0.2) a rollout, on one bridge. Neither
# sets a data address, so each listens on every interface and advertises the address that reaches
# the server; the rollout must pull the trainer's bytes across, checksums verified. (With the old
# default, 127.0.0.1:0, the rollout dialled itself and the read never came.)
#   tests/e2e/two_hosts_test.sh BUILD_DIR        (root: namespaces, veth; exit 77 if unavailable)
set -euo pipefail
build=$1
source "$(cd "$(dirname "$0")/../../bench" && pwd)/netns.sh"
if [ "$(id -u)" -ne 0 ] || ! netns_probe; then
  echo "two_hosts_test: skipped: needs root and network namespaces with veth and tbf"
  exit 77
fi
scratch=$(mktemp -d)
trap 'netns_cleanup; rm -rf "$scratch"' EXIT
netns_setup 2 1gbit
echo "two-hosts-token" > "$scratch/token"

netns_run 0 "$build/tools/th-server" --listen 10.99.0.1:7400 --token-file "$scratch/token" --log-level warn \
  > "$scratch/server.out" 2>&1 &
common=(--server 10.99.0.1:7400 --token two-hosts-token --mib 16 --stop-file "$scratch/stop")
netns_run 0 "$build/tools/th-bench" fanout-node --role trainer --replica trainer "${common[@]}" \
  > "$scratch/trainer.out" 2> "$scratch/trainer.err" &
for _ in $(seq 300); do grep -q "node ready" "$scratch/trainer.out" 2> /dev/null && break; sleep 0.1; done
grep -q "node ready" "$scratch/trainer.out" || { echo "the trainer did not publish"; cat "$scratch"/*.err "$scratch/server.out"; exit 1; }
touch "$scratch/start"
netns_run 1 "$build/tools/th-bench" fanout-node --role rollout --replica rollout "${common[@]}" \
  --start-file "$scratch/start" > "$scratch/rollout.out" 2> "$scratch/rollout.err" &
rollout=$!
for _ in $(seq 300); do grep -q "RESULT" "$scratch/rollout.out" 2> /dev/null && break; sleep 0.1; done
touch "$scratch/stop"
cat "$scratch/trainer.out" "$scratch/rollout.out"
grep -q "RESULT" "$scratch/rollout.out" || { echo "the rollout got no bytes within 30 s"; cat "$scratch"/*.err; exit 1; }
wait "$rollout" || { echo "the rollout failed"; cat "$scratch/rollout.err"; exit 1; }
# The trainer advertised host A's address, the rollout host B's, and the bytes came from the trainer.
grep -Eq "node ready data_endpoint=10\.99\.0\.1:[0-9]+$" "$scratch/trainer.out" || { echo "trainer advertised the wrong address"; exit 1; }
grep -Eq "source=trainer checksum_failures=0 data_endpoint=10\.99\.0\.2:[0-9]+$" "$scratch/rollout.out" ||
  { echo "the rollout did not pull from the trainer across, or advertised the wrong address"; exit 1; }
echo "two_hosts_test: a rollout on host B pulled 16 MiB from a trainer on host A with default data options"
