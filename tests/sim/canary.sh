#!/usr/bin/env bash
# canary.sh TH_SIM_CANARY BUG CHECKER SEEDS_MAX
# Runs seeds 1, 2, … of th-sim-canary with BUG planted until one fails with a violation of CHECKER
# (the invariant the bug breaks); fails if none does within SEEDS_MAX seeds. Another checker may
# fire first on some seeds (a bug usually breaks more than one invariant): those seeds are counted
# and the search goes on, because this test proves that CHECKER itself can fail.
set -euo pipefail
sim=$1 bug=$2 checker=$3 seeds_max=$4
others=0
for ((seed = 1; seed <= seeds_max; seed++)); do
  status=0
  output=$("$sim" --bug "$bug" --seed "$seed" 2>&1) || status=$?
  case $status in
    0) continue ;;
    1) ;;
    *) echo "$output"; echo "canary: th-sim-canary exited $status (usage or crash) on seed $seed"; exit 1 ;;
  esac
  if grep -q "^violation at [0-9]* ms: $checker:" <<<"$output"; then
    grep "^violation at" <<<"$output"
    echo "canary: --bug $bug caught by the $checker checker at seed $seed" \
         "($others earlier seeds caught by other checkers)"
    exit 0
  fi
  others=$((others + 1))
done
echo "canary: --bug $bug was not caught by the $checker checker within $seeds_max seeds" \
     "($others seeds caught by other checkers)"
exit 1
