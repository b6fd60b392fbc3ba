#!/usr/bin/env bash
# Proves that check_purity.sh can fail: on a copy of core/ with one planted violation per category it
# must fail every time, and on the untouched copy it must pass.
set -u
here=$(cd "$(dirname "$0")" && pwd)
core=${1:?usage: check_purity_test.sh CORE_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

plants=(
  '#include <thread>'
  '#include <random>'
  '#include <chrono>'
  '#include <sys/socket.h>'
  '#include <capnp/message.h>'
  '#include <infiniband/verbs.h>'
  '#include <cuda_runtime.h>'
  '#include <iostream>'
  'inline long now_ns() { return std::chrono::steady_clock::now().time_since_epoch().count(); }'
  'inline int roll() { return std::rand(); }'
  'inline const char* home() { return getenv("HOME"); }'
)

rm -rf "$work/core" && cp -r "$core" "$work/core"
if ! "$here/check_purity.sh" "$work/core" > /dev/null; then
  echo "FAIL: the untouched copy of core/ is reported impure"
  exit 1
fi
failures=0
for plant in "${plants[@]}"; do
  rm -rf "$work/core" && cp -r "$core" "$work/core"
  printf '%s\n' "$plant" >> "$work/core/hub.cpp"
  if "$here/check_purity.sh" "$work/core" > /dev/null; then
    echo "FAIL: not caught: $plant"
    failures=$((failures + 1))
  else
    echo "caught: $plant"
  fi
done
exit $((failures > 0))
