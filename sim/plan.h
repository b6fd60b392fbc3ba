// Capacity planning on the simulator (th-plan): what a job's weight transfers would cost at the
// scale users run, from the real Hub and agents in virtual time (sim/simulation.h, PlanLoop), beside
// the baselines a user would otherwise deploy, written down as explicit models.
//
// The machine model (the simulator's and the baselines'): every shard is one GPU with its own share
// of its machine's RDMA NICs (nics x nic rate / GPUs per machine, the paper's "25 GB/s per shard");
// a GPU's flows share its NIC fairly, up and down separately. Across datacenters, every flow also
// shares its machines' one VPC NIC (TCP) with the machine's other flows across, and one TCP flow
// moves at most `tcp_flow` (a TCP stream does not fill a 200 Gbit/s NIC). A system's data-plane
// efficiency (achieved / line rate on one pair, the paper's Figure 7(a)) scales its RDMA rate.
// Control messages take `latency` each way. Not modelled: NVLink or PCIe contention inside a
// machine, switch oversubscription, congestion control beyond fair sharing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/result.h"
#include "sim/simulation.h"

namespace th::sim {

struct PlanSpec {
  // The cluster.
  std::uint32_t gpus_per_node = 8;
  std::uint32_t nics_per_node = 4;
  double nic_gbps = 400;          // each RDMA NIC
  double cross_dc_gbps = 200;     // each machine's VPC NIC, the only way across datacenters
  double tcp_flow_gbps = 0;       // one TCP flow across datacenters at most (0: no cap)
  double pcie_gbps = 0;           // host to GPU, for a GPU reading its own offload copy (0: NIC rate)
  double latency_ms = 1;          // control plane, each way
  double nic_jitter = 0;          // each GPU's NIC rate is drawn from [1 - j, 1] x its share
  // The model.
  std::uint64_t shard_bytes = 0;
  std::uint32_t shards = 8;       // GPUs per replica (the rollouts' too, unless rollout_shards)
  // The rollouts' own layout: tensor parallel over this many GPUs, reading the trainers' copies
  // across layouts (README "Reading across layouts"; th-sim's layouts workload model). 0: the
  // trainers' layout, byte for byte. The baselines then are not run (they broadcast one layout);
  // the reference is TensorHub with trainers of the rollouts' layout (the same bytes).
  std::uint32_t rollout_shards = 0;
  // The workload.
  std::uint32_t trainers = 1;     // trainer replicas
  std::uint32_t rollouts = 1;     // rollout replicas, spot and remote included
  std::uint32_t spot = 0;         // of the rollouts: elastic, joining in batches
  std::uint32_t remote = 0;       // of the rollouts: in the second datacenter
  bool colocated = false;         // trainers roll out too: a baseline's stage stops every GPU
  std::uint32_t versions = 20;
  double hold_s = 20;             // a trainer serves a version this long, then unpublishes
  double train_s = 20;            // then trains this long
  std::uint32_t join_every = 0;   // spot batch k joins when version 1 + k x join_every is out
  std::uint32_t join_batch = 1;
  std::uint32_t leave_version = 0;  // every spot rollout is preempted when this version is out
  // TensorHub.
  bool pipeline = true;
  bool smart_skipping = true;
  bool rate_aware_sources = true;
  bool offload_seeding = false;
  // Delta versions: the percentage of the weights that change per version (0: all); trainers
  // then publish patches and rollouts that hold the version before read them (README "Delta
  // versions"). The baselines move whole versions.
  std::uint32_t changed_percent = 0;
  double efficiency = 1.0;        // TensorHub's data plane (the paper measured 0.88 on RDMA)
  std::uint32_t fanout = 1;
  // th-server's --drain-grace-ms: a read still running this long after its trainer's unpublish is
  // cut (the trainer goes on), and the plan reports it.
  double drain_grace_s = 30;
  // The baselines.
  double nccl_efficiency = 18.8 / 25;  // the paper's Figure 7(a): 18.8 GB/s of 25
  double ucx_efficiency = 18.1 / 25;   // ... 18.1 GB/s of 25
  double coordination_ms = 0;          // the framework's broadcast of "transfer now" and its barrier
  double nccl_chunk_bytes = 512 * 1024;  // NCCL's pipelining step (4 MiB buffer / 8 steps)
  std::uint64_t seed = 1;
  bool run_no_pipeline = true;    // also simulate TensorHub with pipeline replication off

  // Bad input named: zero shards, more spot or remote rollouts than rollouts, and the like.
  Status validate() const;
  double gpu_bytes_per_ms() const;  // one GPU's RDMA share, before efficiency and jitter
  std::uint32_t gpus() const { return trainers * shards + rollouts * rollout_gpus(); }
  std::uint32_t rollout_gpus() const { return rollout_shards > 0 ? rollout_shards : shards; }
};

// One system's stall for one version, over the GPUs that had to receive it or were stopped for it.
struct VersionStall {
  std::uint32_t version = 0;
  std::uint32_t gpus = 0;         // GPUs with a stall sample: rollouts, and trainers that waited
  std::uint32_t rollout_gpus = 0; // rollout GPUs that received it (or, NCCL, waited for it)
  double p50_s = 0;
  double p99_s = 0;
  double max_s = 0;
  double mean_s = 0;
  double total_gpu_s = 0;         // the sum over every GPU, trainers included
  double rollout_gpu_s = 0;       // ... over rollout GPUs only
};

struct SystemPlan {
  std::string name;
  std::string assumptions;        // how the figures were made, for the report
  std::vector<VersionStall> versions;
  std::vector<double> last_version_gpu_s;  // per rollout GPU, the last version: a CDF's points
  double mean_total_gpu_s() const;   // per version
  double mean_rollout_gpu_s() const;
  double max_s() const;
  double p99_s() const;              // the largest per-version p99
};

struct PlanReport {
  PlanSpec spec;
  std::vector<SystemPlan> systems;   // TensorHub first
  std::uint64_t bytes_local = 0;     // TensorHub: bytes read within a datacenter, all versions
  std::uint64_t bytes_cross = 0;     // ... across datacenters
  std::uint64_t bytes_offload = 0;   // ... of bytes_local, from CPU offload copies
  std::uint64_t ucx_bytes_cross = 0; // the UCX baseline across datacenters, all versions
  std::uint64_t reads_from_trainers = 0;
  std::uint64_t reads_from_rollouts = 0;
  std::uint64_t max_reads_per_source_version = 0;  // the busiest source GPU (shard), per version
  std::uint64_t sources = 0;         // replicas that served at least one read
  std::uint64_t events = 0;          // TensorHub's simulation
  double virtual_s = 0;
  double wall_s = 0;
  std::string violation;             // the simulation's, if it failed (the figures are then void)

  std::string text() const;
  std::string json() const;
};

// Runs TensorHub (and, unless told not to, TensorHub without pipeline replication) in the
// simulator and evaluates the baseline models for the same cluster and workload.
Result<PlanReport> plan(const PlanSpec& spec);

}  // namespace th::sim
