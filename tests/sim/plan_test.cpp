// th-plan's planner (sim/plan.h): the simulated TensorHub loop against what its mechanisms must give
// in a fluid model, and the baseline models against their closed forms. Every figure is virtual
// time from a deterministic run (no wall clock is measured).
#include "sim/plan.h"

#include <gtest/gtest.h>

#include <algorithm>

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
