// th-plan: what a job's weight transfers would cost at scale (see sim/plan.h).
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include "sim/plan.h"

int main(int argc, char** argv) {
  th::sim::PlanSpec spec;
  double shard_gb = 0;
  double shard_mib = 0;
  bool no_pipeline = false;
  bool no_smart_skipping = false;
  bool no_rate_aware_sources = false;
  bool skip_no_pipeline = false;
  std::string json_path;
  CLI::App app{
      "th-plan: a capacity planner for TensorHub on the simulator.\n\n"
      "Given a cluster, a model and an RL workload, it runs the real reference server and one real\n"
      "shard agent per GPU in virtual time (th-sim's simulator, every fault off, a fixed loop:\n"
      "trainers publish a version every hold + train seconds; rollouts wait for it, then update)\n"
      "and reports each version's rollout stall (p50/p99/max over GPUs), the GPU-seconds lost per\n"
      "version, the bytes moved within and across datacenters, and the reads each source served.\n"
      "Beside it, with the same machines: TensorHub with pipeline replication off (simulated), and\n"
      "models of NCCL ring broadcast and UCX point-to-point pulls behind a framework's global\n"
      "transfer stage, and the RDMA ideal. Every model's assumptions are printed with the figures.\n\n"
      "Example (the paper's 1T-parameter job, 1,024 GPUs):\n"
      "  th-plan --trainers 96 --rollouts 32 --shards 8 --shard-gb 66 --colocated --versions 5\n\n"
      "Exit status: 0 planned, 1 the simulation failed (a bug: the figures are void), 2 bad usage\n"
      "(every limit is named in its message)."};
  app.add_option("--gpus-per-node", spec.gpus_per_node, "GPUs per machine (8)");
  app.add_option("--nics-per-node", spec.nics_per_node, "RDMA NICs per machine (4)");
  app.add_option("--nic-gbps", spec.nic_gbps, "each RDMA NIC's rate, Gbit/s (400)");
  app.add_option("--cross-dc-gbps", spec.cross_dc_gbps,
                 "each machine's NIC across datacenters (TCP), Gbit/s (200)");
  app.add_option("--tcp-flow-gbps", spec.tcp_flow_gbps,
                 "the most one TCP flow across datacenters moves, Gbit/s (0: no cap)");
  app.add_option("--pcie-gbps", spec.pcie_gbps,
                 "host-to-GPU copy of an offload copy, Gbit/s (0: the NIC rate)");
  app.add_option("--latency-ms", spec.latency_ms, "control-plane latency each way, ms (1)");
  app.add_option("--nic-jitter", spec.nic_jitter,
                 "each GPU's NIC runs at a rate drawn from [1-J, 1] of its share (0)");
  app.add_option("--shard-gb", shard_gb, "bytes per shard, in GB (10^9)");
  app.add_option("--shard-mib", shard_mib, "bytes per shard, in MiB (2^20)");
  app.add_option("--shards", spec.shards, "shards (GPUs) per replica (8)");
  app.add_option("--rollout-shards", spec.rollout_shards,
                 "rollouts of another layout: tensor parallel over N GPUs (1, 2, 4, 8), reading the trainers' "
                 "copies across layouts; the reference is then TensorHub with trainers of the rollouts' layout, "
                 "not the baselines (0: the trainers' layout)");
  app.add_option("--trainers", spec.trainers, "trainer replicas (1)");
  app.add_option("--rollouts", spec.rollouts, "rollout replicas, spot and remote included (1)");
  app.add_option("--spot", spec.spot, "of the rollouts: elastic spot replicas (0)");
  app.add_option("--remote", spec.remote, "of the rollouts: in a second datacenter (0)");
  app.add_flag("--colocated", spec.colocated,
               "trainers roll out too (a baseline's transfer stage then stops every GPU)");
  app.add_option("--versions", spec.versions, "versions to publish (20)");
  app.add_option("--hold-s", spec.hold_s, "a trainer serves each version this long, then unpublishes (20)");
  app.add_option("--train-s", spec.train_s, "then trains this long before the next (20)");
  app.add_option("--join-every", spec.join_every,
                 "spot batch k joins when version 1 + k x N is out (0: all spot rollouts from the start)");
  app.add_option("--join-batch", spec.join_batch, "spot replicas per batch (1)");
  app.add_option("--leave-version", spec.leave_version,
                 "every spot rollout is preempted when this version is out (0: never)");
  app.add_flag("--no-pipeline", no_pipeline, "TensorHub without pipeline replication");
  app.add_flag("--no-smart-skipping", no_smart_skipping, "TensorHub without smart skipping");
  app.add_flag("--no-rate-aware-sources", no_rate_aware_sources,
               "TensorHub without rate-aware source selection (th-server --no-rate-aware-sources)");
  app.add_flag("--offload-seeding", spec.offload_seeding, "TensorHub with offload seeding");
  app.add_option("--changed-percent", spec.changed_percent,
                 "delta versions: this percentage of the weights changes per version, and trainers publish "
                 "patches (0: every weight changes; issue 35 measured 1-3 % at lr 1e-6)")
      ->check(CLI::Range(0, 100));
  app.add_option("--efficiency", spec.efficiency,
                 "TensorHub's data plane, a fraction of the NIC rate (1; the paper measured 0.88)");
  app.add_option("--fanout", spec.fanout, "reads one source copy serves at once (1, th-server's default)");
  app.add_option("--drain-grace-s", spec.drain_grace_s,
                 "th-server's --drain-grace-ms, in seconds (30, its default): a read still running this long after "
                 "its trainer's unpublish is cut, and the plan reports the failed update");
  app.add_option("--nccl-efficiency", spec.nccl_efficiency, "NCCL's fraction of the NIC rate (0.752)");
  app.add_option("--ucx-efficiency", spec.ucx_efficiency, "UCX's fraction of the NIC rate (0.724)");
  app.add_option("--coordination-ms", spec.coordination_ms,
                 "the framework's cost of starting and ending a transfer stage, ms (0)");
  app.add_flag("--skip-no-pipeline", skip_no_pipeline, "do not also simulate TensorHub without pipeline");
  app.add_option("--seed", spec.seed, "draws the NIC jitter (1)");
  app.add_option("--json", json_path, "also write the report as JSON to this file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    const int status = app.exit(error);  // prints --help, or the error
    return status == 0 ? 0 : 2;
  }

  const bool in_gb = app.count("--shard-gb") > 0;
  if (in_gb == (app.count("--shard-mib") > 0)) {
    std::fprintf(stderr, "th-plan: give the shard size once: --shard-gb or --shard-mib\n");
    return 2;
  }
  const double shard_bytes = in_gb ? shard_gb * 1e9 : shard_mib * 1048576;
  if (!(shard_bytes >= 1 && shard_bytes <= 1e15)) {  // NaN fails too
    std::fprintf(stderr, "th-plan: the shard size must be from 1 byte to 1 PB\n");
    return 2;
  }
  spec.shard_bytes = static_cast<std::uint64_t>(std::llround(shard_bytes));
  spec.pipeline = !no_pipeline;
  spec.smart_skipping = !no_smart_skipping;
  spec.rate_aware_sources = !no_rate_aware_sources;
  spec.run_no_pipeline = !skip_no_pipeline;
  auto report = th::sim::plan(spec);
  if (!report.ok()) {
    std::fprintf(stderr, "th-plan: %s\n", report.error().detail.c_str());
    return 2;
  }
  std::fputs(report.value().text().c_str(), stdout);
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << report.value().json() << "\n";
    if (!out.flush()) {
      std::fprintf(stderr, "th-plan: cannot write %s\n", json_path.c_str());
      return 2;
    }
  }
  return report.value().violation.empty() ? 0 : 1;
}
