// th-bench reshard (bench/run-reshard, issue 31): a rollout reading from a trainer of another
// layout against the same rollout reading the same bytes from a source of its own layout, in one
// run, over loopback TCP with checksums on.
#pragma once

#include <cstdint>

namespace th::bench {

struct ReshardBenchOptions {
  std::uint64_t hidden = 1024;  // H: a layer holds qkv 3H x H, o H x H, up 4H x H, down H x 4H (bf16), norm H
  std::uint32_t layers = 8;
  int rounds = 3;  // versions per scenario and per reference; medians are reported
};

// Runs every scenario (TP=8 -> TP=4, 2, 1 and FSDP x8 -> TP=2, with tensor-parallel splits along
// the outer and along the inner dimension), prints each round and a RESULT line per scenario.
// Every version the rollouts read is checked element by element. Returns the exit status.
int run_reshard(const ReshardBenchOptions& options);

}  // namespace th::bench
