#!/usr/bin/env bash
# Fails (exit 1, naming file and line) if anything under DIR could do I/O, read a clock, draw random
# numbers, start threads or touch the network, RDMA, CUDA or Cap'n Proto. core/ must stay a pure
# state machine: time and randomness are inputs, effects are data (DESIGN.md §2, CONVENTIONS.md 1).
#
# usage: check_purity.sh DIR
set -u
dir=${1:?usage: check_purity.sh DIR}
[ -d "$dir" ] || { echo "check_purity: no directory $dir" >&2; exit 2; }

forbidden_headers='thread|mutex|shared_mutex|condition_variable|future|atomic|semaphore|stop_token|barrier|latch'
forbidden_headers+='|random|chrono|ctime|time\.h|sys/time\.h'
forbidden_headers+='|fstream|iostream|cstdio|stdio\.h|filesystem'
forbidden_headers+='|unistd\.h|fcntl\.h|sys/[^>]*|netinet/[^>]*|arpa/[^>]*|netdb\.h|poll\.h'
forbidden_headers+='|capnp/[^>"]*|kj/[^>"]*|infiniband/[^>]*|rdma/[^>]*|cuda[^>]*|nccl[^>]*'
forbidden_calls='std::chrono|std::rand\b|\brand\(|\bsrand\(|\btime\(|clock_gettime|gettimeofday'
forbidden_calls+='|random_device|mt19937|default_random_engine|std::this_thread|\bgetenv\b|\bfopen\('

status=0
while IFS= read -r hit; do
  echo "core is not pure: forbidden include: $hit"
  status=1
done < <(grep -rnE "^[[:space:]]*#[[:space:]]*include[[:space:]]*[<\"]($forbidden_headers)[>\"]" \
           --include='*.h' --include='*.hpp' --include='*.cpp' --include='*.cc' "$dir")
while IFS= read -r hit; do
  echo "core is not pure: clock, randomness, environment or I/O: $hit"
  status=1
done < <(grep -rnE "$forbidden_calls" --include='*.h' --include='*.hpp' --include='*.cpp' \
           --include='*.cc' "$dir" | grep -vE '^[^:]+:[0-9]+:[[:space:]]*//')
[ $status -eq 0 ] && echo "check_purity: $dir is pure ($(find "$dir" -name '*.cpp' -o -name '*.h' | wc -l) files)"
exit $status
