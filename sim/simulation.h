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
#include <optional>
#include <string>
#include <vector>

#include "core/hub.h"
#include "sim/knobs.h"

namespace th::sim {

// A capacity plan's RL loop (th-plan, sim/plan.h): the same simulator with every fault off and a
// fixed program instead of a drawn one, measured rather than attacked. Trainers publish version v,
// serve it for hold_ms (their colocated rollouts), unpublish (waiting for reads still draining),
// train for train_ms and publish v + 1, up to `versions`. Rollouts wait for the next version
// (generation is not stall: they would wait for the trainer anyway), then update(latest); the
// update calls until one delivers the version are the GPU's stall for it. A rollout told "not yet"
// (smart skipping, offload seeding) goes on generating with what it has and asks again after
// poll_ms; that call's time counts, the time between does not.
struct PlanLoop {
  std::uint32_t versions = 20;
  TimeMs hold_ms = 20'000;
  TimeMs train_ms = 20'000;
  TimeMs poll_ms = 500;
  std::uint32_t gpus_per_node = 8;             // shards are packed onto nodes in fleet order
  std::uint64_t node_remote_bytes_per_ms = 0;  // each node's NIC across datacenters; 0: none
  double nic_jitter = 0;             // each GPU's NIC runs at a rate drawn from [1 - j, 1] x nic
  std::uint32_t spot_join_every = 0;  // spot rollouts join in batches, one every this many versions
  std::uint32_t spot_join_batch = 1;  // ... of this many replicas (0 every: all start at once)
  Version spot_leave_version = 0;     // every spot rollout is preempted when this is published
  std::uint32_t check_every = 64;     // Hub::check_invariants on every Nth hub step (and the last)
  std::uint64_t remote_flow_bytes_per_ms = 0;  // one TCP flow across datacenters at most; 0: no cap
  std::uint64_t local_copy_bytes_per_ms = 0;   // a GPU reading its own CPU offload copy (PCIe); 0: NIC
};

// What a plan measured.
struct PlanSample {
  Version version = 0;
  std::uint32_t replica = 0;  // index into PlanStats::replicas
  std::uint32_t shard = 0;
  TimeMs stall_ms = 0;        // rollouts: update time until the version arrived; trainers: unpublish
};
struct PlanReplica {
  std::string name;
  std::string datacenter;
  bool trainer = false;
  bool spot = false;
};
struct PlanRead {            // a completed shard read
  Version version = 0;
  std::uint32_t source = 0;  // replica indices
  std::uint32_t reader = 0;
  std::uint32_t shard = 0;
  bool remote = false;       // across datacenters
  bool offload = false;      // from a CPU offload copy
};
struct PlanStats {
  std::vector<PlanSample> stalls;
  std::vector<PlanReplica> replicas;
  std::vector<PlanRead> reads;
  std::vector<std::uint32_t> gpu_nodes;  // [GPU in fleet order]: the machine it was placed on
  std::vector<TimeMs> published_ms;     // [v]: when version v was first published (0: not)
  std::uint64_t bytes_local = 0;        // shard bytes read within a datacenter
  std::uint64_t bytes_cross = 0;        // ... across datacenters
  std::uint64_t bytes_offload_local = 0;  // of bytes_local: from CPU offload copies
};

struct SimOptions {
  std::uint64_t seed = 1;
  Knobs knobs;
  bool verbose = false;
  std::string trace_path;  // write a Chrome trace here, if not empty
  std::optional<PlanLoop> plan;  // run a capacity plan's loop instead of the drawn program
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
  std::uint64_t reads_across = 0;   // of the completed: from a copy of another layout (layouts workload)
  std::uint64_t patch_reads = 0;    // of the completed: a patch applied to the version before (knob patch)
  std::uint64_t crashes = 0;
  std::uint64_t divergence_restarts = 0;  // replicas their framework restarted after a divergence
  std::uint64_t run_restarts = 0;   // models whose run started again from version 1 (knob run_restart)
  std::uint64_t models_ended = 0;   // models a hub forgot (no replica for the model grace)
  std::uint64_t evictions = 0;
  std::uint64_t failovers = 0;
  std::uint64_t offloads = 0;
  std::uint64_t seeds = 0;          // offload seeding: CPU copies read across datacenters
  std::uint64_t corrupt_notices = 0;  // shards told readers found their copy corrupt (CopyCorrupt)
  // Rate-aware source selection (the servers alive at the end; core/hub_rates.cpp): readers that
  // took a slower copy's source (it read behind them), and reads placed past a much slower copy.
  std::uint64_t readers_put_ahead = 0;
  std::uint64_t readers_passed_mid_read = 0;  // of those, on a read's progress (TransferProgress)
  std::uint64_t slow_sources_passed = 0;
  std::uint64_t messages = 0;
  std::uint64_t messages_lost = 0;
  std::uint64_t stale_messages = 0;  // instructions that arrived again, late (knob stale)
  PlanStats plan;                   // with SimOptions::plan

  std::string summary() const;
};

SimResult simulate(const SimOptions& options);

// The share of its NIC rate GPU `gpu` (in fleet order: trainers, then rollouts, shard by shard) runs
// at in a plan with `jitter`: in [1 - jitter, 1], drawn from the seed alone, so that the planner's
// baseline models see the same machines as the simulation.
double plan_nic_factor(std::uint64_t seed, std::uint64_t gpu, double jitter);

}  // namespace th::sim
