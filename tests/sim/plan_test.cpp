// th-plan's planner (sim/plan.h): the simulated TensorHub loop against what its mechanisms must give
// in a fluid model, and the baseline models against their closed forms. Every figure is virtual
// time from a deterministic run (no wall clock is measured).
#include "sim/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

namespace th::sim {
namespace {

constexpr double kGB = 1e9;

// One 1 GB shard per replica on its own 8 Gbit/s NIC (1 GB/s): a read takes 1 s at the line rate.
PlanSpec one_gpu_hosts(std::uint32_t rollouts) {
  PlanSpec spec;
  spec.gpus_per_node = 1;
  spec.nics_per_node = 1;
  spec.nic_gbps = 8;
  spec.shards = 1;
  spec.shard_bytes = static_cast<std::uint64_t>(kGB);
  spec.trainers = 1;
  spec.rollouts = rollouts;
  spec.versions = 2;
  spec.hold_s = 100;
  spec.train_s = 1;
  spec.latency_ms = 0;
  spec.nccl_efficiency = 1;
  spec.ucx_efficiency = 1;
  return spec;
}

const SystemPlan& system(const PlanReport& report, const std::string& name) {
  for (const SystemPlan& s : report.systems) {
    if (s.name == name) return s;
  }
  ADD_FAILURE() << "no system " << name;
  return report.systems.front();
}

PlanReport must_plan(const PlanSpec& spec) {
  auto report = plan(spec);
  EXPECT_TRUE(report.ok()) << (report.ok() ? "" : report.error().detail);
  EXPECT_TRUE(report.value().violation.empty()) << report.value().violation;
  return std::move(report).value();
}

TEST(Plan, PipelineKeepsEveryReaderNearTheLineRate) {
  // Eight readers at once from one source: pipeline replication chains them (each reads from one
  // still receiving), so each takes about one shard time; without it they split the source's NIC.
  const PlanReport report = must_plan(one_gpu_hosts(8));
  const SystemPlan& th = system(report, "TensorHub");
  const SystemPlan& flat = system(report, "TensorHub (no pipeline)");
  ASSERT_EQ(th.versions.size(), 2U);
  for (const VersionStall& v : th.versions) {
    EXPECT_EQ(v.rollout_gpus, 8U);
    EXPECT_GE(v.max_s, 1.0);  // never faster than the NIC
    EXPECT_LE(v.max_s, 1.1) << "version " << v.version;
  }
  // Without pipeline: fair shares of one NIC, every reader done at 8 s (total 64 GPU-s).
  for (const VersionStall& v : flat.versions) {
    EXPECT_NEAR(v.max_s, 8.0, 0.1);
    EXPECT_NEAR(v.rollout_gpu_s, 64.0, 1.0);
  }
  // Sources: the trainer serves one reader per version, the rollouts the other seven.
  EXPECT_EQ(report.reads_from_trainers, 2U);
  EXPECT_EQ(report.reads_from_rollouts, 14U);
  EXPECT_EQ(report.max_reads_per_source_version, 1U);
  EXPECT_EQ(report.bytes_local, 16 * report.spec.shard_bytes);
  EXPECT_EQ(report.bytes_cross, 0U);
}

TEST(Plan, RolloutsOfAnotherLayoutReadAcrossOnceThenPipelineFromTheFirst) {
  // A TP=2 trainer (two 1 GB shards) and three TP=1 rollouts (the whole 2 GB model each). The
  // first rollout reads both trainer shards' pieces whole, at its own NIC: 2 s. A copy still
  // reading across layouts serves nobody, so the other two wait for it, then pipeline from it:
  // 4 s. With trainers of the rollouts' layout there is nothing to reshard: 2 s for everyone.
  PlanSpec spec = one_gpu_hosts(3);
  spec.shards = 2;
  spec.rollout_shards = 1;
  EXPECT_EQ(spec.gpus(), 5U);
  const PlanReport report = must_plan(spec);
  const SystemPlan& across = system(report, "TensorHub");
  const SystemPlan& same = system(report, "TensorHub, one layout");
  ASSERT_EQ(across.versions.size(), 2U);
  for (const VersionStall& v : across.versions) {
    EXPECT_EQ(v.rollout_gpus, 3U);
    EXPECT_GE(v.max_s, 4.0) << "version " << v.version;
    EXPECT_LE(v.max_s, 4.2) << "version " << v.version;
  }
  for (const VersionStall& v : same.versions) EXPECT_LE(v.max_s, 2.2) << "version " << v.version;
  // At least one read across layouts per version; which of the later two takes the trainer, free
  // again, or the first rollout is the source choice's.
  EXPECT_GE(report.reads_from_trainers, 2U);
  EXPECT_EQ(report.reads_from_trainers + report.reads_from_rollouts, 6U);
  EXPECT_EQ(report.bytes_local, 2 * 3 * 2 * report.spec.shard_bytes);  // whole pieces: exactly the model
  for (const char* baseline : {"NCCL broadcast", "UCX point-to-point", "RDMA ideal"}) {
    for (const SystemPlan& s : report.systems) EXPECT_EQ(s.name.rfind(baseline, 0), std::string::npos) << s.name;
  }
  // The layouts model splits its tensors 8 ways at most; colocated rollouts keep the trainers'.
  spec.rollout_shards = 3;
  EXPECT_FALSE(plan(spec).ok());
  spec.rollout_shards = 1;
  spec.colocated = true;
  EXPECT_FALSE(plan(spec).ok());
}

TEST(Plan, BaselineModelsMatchTheirClosedForms) {
  PlanSpec spec = one_gpu_hosts(4);
  spec.run_no_pipeline = false;
  const PlanReport report = must_plan(spec);
  // UCX: four readers split the trainer's NIC: 4 s each; not colocated, each waits for its own.
  const SystemPlan& ucx = system(report, "UCX point-to-point");
  EXPECT_NEAR(ucx.versions[0].max_s, 4.0, 1e-6);
  EXPECT_NEAR(ucx.versions[0].rollout_gpu_s, 16.0, 1e-6);
  // NCCL: one ring of five at the line rate plus one 512 KiB step per hop, for everyone.
  const SystemPlan& nccl = system(report, "NCCL broadcast");
  const double ring_s = (kGB + 4 * 512 * 1024) / (kGB / 1000) / 1000;
  EXPECT_NEAR(nccl.versions[0].max_s, ring_s, 1e-6);
  EXPECT_NEAR(nccl.versions[0].p50_s, ring_s, 1e-6);
  EXPECT_NEAR(nccl.versions[0].total_gpu_s, 5 * ring_s, 1e-6);  // the trainer waits too
  const SystemPlan& ideal = system(report, "RDMA ideal");
  EXPECT_NEAR(ideal.versions[0].max_s, 1.0, 1e-9);
}

TEST(Plan, ColocatedStageStopsEveryGpu) {
  PlanSpec spec = one_gpu_hosts(2);
  spec.trainers = 2;
  spec.colocated = true;
  spec.run_no_pipeline = false;
  const PlanReport report = must_plan(spec);
  // UCX: one reader per trainer, 1 s each; the stage stops all four GPUs for 1 s.
  const SystemPlan& ucx = system(report, "UCX point-to-point");
  EXPECT_NEAR(ucx.versions[0].total_gpu_s, 4.0, 1e-6);
  // TensorHub: the trainers go on (their unpublish comes 100 s later, nothing left to drain).
  const SystemPlan& th = system(report, "TensorHub");
  EXPECT_LT(th.versions[0].total_gpu_s, 2 * 1.1 + 0.1);
}

TEST(Plan, SmartSkippingCrossesOncePerVersion) {
  PlanSpec spec;
  spec.gpus_per_node = 8;
  spec.shards = 2;
  spec.shard_bytes = static_cast<std::uint64_t>(2 * kGB);
  spec.trainers = 2;
  spec.rollouts = 4;
  spec.remote = 4;
  spec.cross_dc_gbps = 16;  // 2 GB/s per machine across
  spec.versions = 3;
  spec.hold_s = 30;
  spec.train_s = 1;
  spec.run_no_pipeline = false;
  const PlanReport report = must_plan(spec);
  const std::uint64_t model = spec.shard_bytes * spec.shards;
  EXPECT_EQ(report.bytes_cross, model * spec.versions);  // one seeding copy per version
  EXPECT_EQ(report.ucx_bytes_cross, 4 * model * spec.versions);  // every reader across
  const SystemPlan& th = system(report, "TensorHub");
  for (const VersionStall& v : th.versions) {
    EXPECT_EQ(v.rollout_gpus, 8U);
    // The seeder waits for the slow link (two flows share 2 GB/s: 2 s); the others read locally.
    EXPECT_GE(v.max_s, 2.0);
    EXPECT_LT(v.p50_s, 1.0);
  }
  // Offload seeding: the seeder's GPU waits only for its own local copy.
  spec.offload_seeding = true;
  spec.pcie_gbps = 80;  // 10 GB/s
  const PlanReport offloaded = must_plan(spec);
  EXPECT_EQ(offloaded.bytes_cross, model * spec.versions);
  EXPECT_GT(offloaded.bytes_offload, 0U);
  EXPECT_LT(system(offloaded, "TensorHub").max_s(), 1.0);
}

TEST(Plan, SpotReplicasJoinAndLeave) {
  PlanSpec spec = one_gpu_hosts(4);
  spec.spot = 3;
  spec.versions = 8;
  spec.join_every = 2;  // batches join at versions 3, 5, 7
  spec.leave_version = 7;  // ... and every spot replica goes when 7 is out (the third never joins)
  spec.run_no_pipeline = false;
  const PlanReport report = must_plan(spec);
  std::vector<std::uint32_t> receiving;
  for (const VersionStall& v : system(report, "TensorHub").versions) receiving.push_back(v.rollout_gpus);
  EXPECT_EQ(receiving, (std::vector<std::uint32_t>{1, 1, 2, 2, 3, 3, 1, 1}));
  // UCX: the spot replicas read from the standalone once it is done (1 s), in turn of joining.
  const SystemPlan& ucx = system(report, "UCX point-to-point");
  EXPECT_NEAR(ucx.versions[4].max_s, 1.0 + 2.0, 1e-6);  // two spot readers share the standalone
  // NCCL: a replica that joined waits for the next step's communicator.
  const SystemPlan& nccl = system(report, "NCCL broadcast");
  EXPECT_GT(nccl.versions[2].max_s, spec.hold_s + spec.train_s);
}

TEST(Plan, NicJitterSlowsTheRingToItsSlowestMember) {
  PlanSpec spec = one_gpu_hosts(16);
  spec.nic_jitter = 0.5;
  spec.seed = 7;
  spec.run_no_pipeline = false;
  const PlanReport report = must_plan(spec);
  const SystemPlan& nccl = system(report, "NCCL broadcast");
  const SystemPlan& ideal = system(report, "RDMA ideal");
  // Everyone waits for the slowest NIC in the ring: at least the slowest reader's own ideal.
  EXPECT_GE(nccl.versions[0].p50_s, ideal.versions[0].max_s);
  EXPECT_LT(ideal.versions[0].p50_s, ideal.versions[0].max_s);
  // Determinism: the same seed plans the same figures.
  const PlanReport again = must_plan(spec);
  EXPECT_EQ(again.events, report.events);
  EXPECT_DOUBLE_EQ(system(again, "TensorHub").mean_total_gpu_s(), system(report, "TensorHub").mean_total_gpu_s());
}

TEST(Plan, UcxPlacesShardsOnTheirMachines) {
  // Six shards on four-GPU machines: each replica fills one machine and two GPUs of the next, and
  // a role or datacenter starts a new machine. Across datacenters a machine's VPC NIC (25 GB/s) is
  // split among its reads: four of 1 GB at 6.25 GB/s, two at 12.5 GB/s.
  PlanSpec spec;
  spec.gpus_per_node = 4;
  spec.nics_per_node = 4;
  spec.nic_gbps = 200;
  spec.shards = 6;
  spec.shard_bytes = static_cast<std::uint64_t>(kGB);
  spec.rollouts = 1;
  spec.remote = 1;
  spec.versions = 1;
  spec.run_no_pipeline = false;
  const PlanReport report = must_plan(spec);
  const SystemPlan& ucx = system(report, "UCX point-to-point");
  EXPECT_NEAR(ucx.versions[0].rollout_gpu_s, 4 * 0.16 + 2 * 0.08, 1e-9);
  EXPECT_EQ(report.ucx_bytes_cross, 6 * spec.shard_bytes);
}

TEST(Plan, EverySystemCountsEveryVersionAndTrainer) {
  // Every rollout is spot and gone from version 3 on; the last version is never unpublished. Each
  // system still has a row per version with every trainer GPU in it, so their means compare.
  PlanSpec spec = one_gpu_hosts(2);
  spec.spot = 2;
  spec.versions = 5;
  spec.leave_version = 3;
  spec.run_no_pipeline = false;
  const PlanReport report = must_plan(spec);
  for (const SystemPlan& s : report.systems) {
    ASSERT_EQ(s.versions.size(), 5U) << s.name;
    EXPECT_EQ(s.versions[4].rollout_gpus, 0U) << s.name;
    if (s.name != "RDMA ideal") {
      EXPECT_EQ(s.versions[4].gpus, 1U) << s.name;  // the trainer
    }
  }
}

TEST(Plan, SpotBatchesDueAfterTheLastVersionAreNotWaitedFor) {
  PlanSpec spec = one_gpu_hosts(2);
  spec.spot = 1;
  spec.join_every = 5;  // the batch would join at version 6
  spec.versions = 4;
  spec.run_no_pipeline = false;
  const PlanReport report = must_plan(spec);
  // The plan ends once the standalone holds version 4: about four cycles, not the liveness bound.
  EXPECT_LT(report.virtual_s, 4 * (spec.hold_s + spec.train_s) + 10);
}

TEST(Plan, SlowReadsStretchTheCyclesWithoutFailing) {
  // A read takes 400 s, twenty times the hold: the trainer's unpublish waits for it every cycle
  // (a server whose drain grace is longer than a read), and three cycles run past any fixed margin
  // after the nominal 3 x 21 s.
  PlanSpec spec = one_gpu_hosts(2);
  spec.shard_bytes = static_cast<std::uint64_t>(400 * kGB);
  spec.hold_s = 20;
  spec.drain_grace_s = 1000;
  spec.versions = 3;
  spec.run_no_pipeline = false;
  const PlanReport report = must_plan(spec);
  const SystemPlan& th = system(report, "TensorHub");
  EXPECT_GE(th.max_s(), 400.0);
  EXPECT_GT(th.versions[0].total_gpu_s - th.versions[0].rollout_gpu_s, 300.0);  // the trainer waited
}

TEST(Plan, ReadsLongerThanTheDrainGraceAreCutAndTheReportSaysWhy) {
  // th-server's default drain grace (30 s) against reads of 400 s: the trainer's unpublish cuts
  // them; the plan does not hide that as a stall, it names the option that decides it.
  PlanSpec spec = one_gpu_hosts(2);
  spec.shard_bytes = static_cast<std::uint64_t>(400 * kGB);
  spec.versions = 2;
  spec.run_no_pipeline = false;
  const Result<PlanReport> report = plan(spec);
  ASSERT_TRUE(report.ok()) << report.error().detail;
  EXPECT_NE(report.value().violation.find("cut at the drain grace (30 s"), std::string::npos)
      << report.value().violation;
  EXPECT_NE(report.value().violation.find("--drain-grace-ms"), std::string::npos) << report.value().violation;
}

TEST(Plan, BadInputIsNamed) {
  auto refused = [](auto change, const std::string& words) {
    PlanSpec spec = one_gpu_hosts(2);
    change(spec);
    auto report = plan(spec);
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.error().code, Errc::kInvalidArgument);
    EXPECT_NE(report.error().detail.find(words), std::string::npos) << report.error().detail;
  };
  refused([](PlanSpec& s) { s.shards = 0; }, "shards");
  refused([](PlanSpec& s) { s.shard_bytes = 0; }, "shard size");
  refused([](PlanSpec& s) { s.spot = 3; }, "spot");
  refused([](PlanSpec& s) { s.spot = 1; s.remote = 2; }, "spot + remote");
  refused([](PlanSpec& s) { s.versions = 0; }, "versions");
  refused([](PlanSpec& s) { s.efficiency = 1.5; }, "efficienc");
  refused([](PlanSpec& s) { s.nic_jitter = 1; }, "jitter");
  refused([](PlanSpec& s) { s.remote = 1; s.cross_dc_gbps = 0; }, "cross-datacenter");
  refused([](PlanSpec& s) { s.trainers = 40'000; s.rollouts = 40'000; }, "GPUs");
  refused([](PlanSpec& s) { s.shards = 300; }, "hub's limit");
  refused([](PlanSpec& s) { s.hold_s = 0; }, "hold");
  refused([](PlanSpec& s) { s.hold_s = std::nan(""); }, "hold");
  refused([](PlanSpec& s) { s.train_s = 1e300; }, "train");
  refused([](PlanSpec& s) { s.coordination_ms = INFINITY; }, "coordination");
  refused([](PlanSpec& s) { s.nic_gbps = std::nan(""); }, "NIC rate");
  refused([](PlanSpec& s) { s.efficiency = std::nan(""); }, "efficienc");
  refused([](PlanSpec& s) { s.nic_jitter = std::nan(""); }, "jitter");
  refused([](PlanSpec& s) { s.remote = 1; s.cross_dc_gbps = 1e-6; }, "cross-datacenter rate");
  refused([](PlanSpec& s) { s.tcp_flow_gbps = 1e-6; }, "TCP flow");
  refused([](PlanSpec& s) { s.nic_gbps = 0.001; s.gpus_per_node = 64; }, "8 Mbit/s");
  refused([](PlanSpec& s) { s.trainers = 2048; s.rollouts = 2048; s.versions = 300; }, "GPUs x versions");
  refused([](PlanSpec& s) { s.drain_grace_s = 0; }, "drain grace");
  refused([](PlanSpec& s) { s.drain_grace_s = std::nan(""); }, "drain grace");
}

TEST(Plan, ReportsAreComplete) {
  const PlanReport report = must_plan(one_gpu_hosts(2));
  const std::string text = report.text();
  for (const char* word : {"TensorHub", "NCCL broadcast", "UCX point-to-point", "RDMA ideal", "events/s"}) {
    EXPECT_NE(text.find(word), std::string::npos) << word;
  }
  const std::string json = report.json();
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
  EXPECT_NE(json.find("\"last_version_gpu_s\":["), std::string::npos);
}

}  // namespace
}  // namespace th::sim
