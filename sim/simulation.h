// A FoundationDB-style deterministic simulation of a TensorHub deployment: the real Hub (primary and
// backup server) and one real ShardAgent per simulated worker, on one thread, in virtual time that
// jumps from event to event, with every random choice drawn from one seeded Rng.
//
//   network     control-plane messages are delayed, dropped, duplicated, reordered; workers are
//               clogged and partitioned from the server (both ways or one way)
//   data plane  reads move modelled bytes at each host's NIC rate, shared fairly between the flows
//               of a host, over a slower link between datacenters; every shard has a real (small)
//               buffer whose bytes derive from (model, version, shard, offset), so any mix-up shows
//   workers     trainers and rollouts run the RL loop through their agents; replicas crash (also
//               mid-transfer, as source or reader), spot replicas are preempted in storms, hosts
//               straggle, clocks skew, the primary server dies and clients fail over
//
// Two phases: safety (faults on; no invariant may break), then liveness (faults healed: every live
// rollout must reach the final version and every call must return within the phase). Checks after
// every step: Hub::check_invariants, the Observer (DESIGN.md §5 from the outside), the bytes every
// read copies and every reader keeps.
#pragma once

#include <cstdint>
#include <string>

#include "core/hub.h"
#include "sim/knobs.h"

namespace th::sim {

struct SimOptions {
  std::uint64_t seed = 1;
  Knobs knobs;
  bool verbose = false;
  std::string trace_path;  // write a Chrome trace here, if not empty
};

struct SimResult {
  bool ok = true;
  std::string violation;  // the first one
  std::uint64_t trace_hash = 0;
  std::uint64_t events = 0;
  TimeMs virtual_ms = 0;
  std::uint64_t calls = 0;
  std::uint64_t versions = 0;       // published, all models
  std::uint64_t reads = 0;          // completed shard reads
  std::uint64_t reads_failed = 0;
  std::uint64_t crashes = 0;
  std::uint64_t divergence_restarts = 0;  // replicas their framework restarted after a divergence
  std::uint64_t evictions = 0;
  std::uint64_t failovers = 0;
  std::uint64_t offloads = 0;
  std::uint64_t seeds = 0;          // offload seeding: CPU copies read across datacenters
  std::uint64_t messages = 0;
  std::uint64_t messages_lost = 0;

  std::string summary() const;
};

SimResult simulate(const SimOptions& options);

}  // namespace th::sim
