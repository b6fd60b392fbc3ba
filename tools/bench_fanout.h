// th-bench's fan-out node (issue 5, benchmarks 3-5): one process per emulated host, started by
// bench/run-fanout inside that host's network namespace.
//   trainer: publishes one version of one tensor and serves it until its stop file appears.
//   rollout: once the start file appears, replicate("latest") and report how long it stalled; then
//            keeps serving (it is a pipeline source for others) until the stop file appears.
#pragma once

#include <cstdint>
#include <string>

namespace th::bench {

struct FanoutNodeOptions {
  std::string role;          // "trainer" or "rollout"
  std::string server;        // th-server, host:port
  std::string token;
  std::string replica;
  std::string datacenter = "default";
  std::string data_ip;       // this host's address: the data server listens there
  std::uint64_t mib = 256;   // the shard's size
  std::uint32_t tensors = 1; // cut into this many tensors (the last takes the remainder)
  bool resume_reads = true;  // ClientOptions::resume_reads (bench/run-fanout-failure's before and after)
  std::string start_file;    // rollout: replicate once it exists
  std::string stop_file;     // close and exit once it exists
  // Cross-datacenter mode (bench/run-crossdc): the trainer publishes version 1, then version 2 once
  // this file exists; a rollout replicates version 1 first, then at its start file keeps calling
  // update("latest") (every 50 ms while the answer is "not yet", as a rollout that keeps generating
  // with the weights it has) until it holds version 2.
  std::string second_version_file;
  // Next-version mode (bench/run-change's "slow" scenario): a rollout replicates version 1 at its
  // start file as usual, then calls update("latest") once this file exists (the script makes it
  // once the trainer has published version 2, the trainer run with second_version_file): the
  // version read after the hub has timed every rollout once.
  std::string next_version_file;
};

// Prints "node ready" once open (trainer: once published), "RESULT fanout_seconds=... source=..."
// (rollout), and exits 0 once the stop file appears. In cross-datacenter mode a rollout prints
// "RESULT stall_seconds=S until_seconds=U not_yet=N source=R": S the time spent blocked in
// update(), U until it held version 2, N how often it was told "not yet". In next-version mode a
// rollout then prints "RESULT next_seconds=... source=..." for version 2.
int run_fanout_node(const FanoutNodeOptions& options);

}  // namespace th::bench
