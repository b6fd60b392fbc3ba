#include "sim/plan.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "core/assert.h"
#include "core/limits.h"

namespace th::sim {

namespace {

constexpr double kBytesPerMsPerGbps = 1e9 / 8 / 1000;  // 1 Gbit/s in bytes per ms
constexpr TimeMs kPollMs = 500;
constexpr TimeMs kPlanLivenessMs = 600'000;  // after the last cycle, for the last transfers
constexpr std::uint32_t kVersionsMax = 1000;
constexpr std::uint32_t kGpusMax = 65'536;
// GPUs x versions: a plan's events grow with both (about 80 per GPU and version), and the
// simulator stops a run past 200 M events as hung.
constexpr std::uint64_t kGpuVersionsMax = 1'000'000;
constexpr double kBytesPerMsMin = 1000;  // 8 Mbit/s: the simulator counts whole bytes per ms
constexpr double kSecondsMax = 1e6;      // hold, train

double percentile(std::vector<double> values, double fraction) {
  TH_ASSERT(!values.empty());
  std::sort(values.begin(), values.end());
  // Nearest rank.
  const auto rank = static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(values.size())));
  return values[std::clamp<std::size_t>(rank, 1, values.size()) - 1];
}

VersionStall summarize(std::uint32_t version, const std::vector<double>& rollout_s, double trainer_gpu_s,
                       std::uint32_t trainer_gpus) {
  VersionStall stall;
  stall.version = version;
  stall.rollout_gpus = static_cast<std::uint32_t>(rollout_s.size());
  stall.gpus = stall.rollout_gpus + trainer_gpus;
  for (double s : rollout_s) stall.rollout_gpu_s += s;
  stall.total_gpu_s = stall.rollout_gpu_s + trainer_gpu_s;
  if (!rollout_s.empty()) {
    stall.p50_s = percentile(rollout_s, 0.50);
    stall.p99_s = percentile(rollout_s, 0.99);
    stall.max_s = *std::max_element(rollout_s.begin(), rollout_s.end());
    stall.mean_s = stall.rollout_gpu_s / static_cast<double>(rollout_s.size());
  }
  return stall;
}

// The fleet, in the simulator's order: trainers, then rollouts (spot first, remote last).
struct FleetReplica {
  bool trainer = false;
  bool spot = false;
  bool remote = false;
  std::uint32_t join_version = 1;  // spot: when its batch starts
  std::uint32_t first_gpu = 0;   // in fleet order (plan_nic_factor's, PlanStats::gpu_nodes' index)
};

std::vector<FleetReplica> fleet_of(const PlanSpec& spec) {
  std::vector<FleetReplica> fleet;
  std::uint32_t gpu = 0;
  for (std::uint32_t r = 0; r < spec.trainers + spec.rollouts; ++r) {
    FleetReplica replica;
    replica.trainer = r < spec.trainers;
    const std::uint32_t index = r - (replica.trainer ? r : spec.trainers);
    if (!replica.trainer) {
      replica.spot = index < spec.spot;
      replica.remote = index >= spec.rollouts - spec.remote;
      if (replica.spot && spec.join_every > 0) {
        replica.join_version = 1 + (1 + index / std::max(1U, spec.join_batch)) * spec.join_every;
      }
    }
    replica.first_gpu = gpu;
    gpu += replica.trainer ? spec.shards : spec.rollout_gpus();
    fleet.push_back(replica);
  }
  return fleet;
}

bool present(const PlanSpec& spec, const FleetReplica& replica, std::uint32_t version) {
  if (replica.trainer) return true;
  if (version < replica.join_version) return false;
  return !(replica.spot && spec.leave_version > 0 && version >= spec.leave_version);
}


double gpu_rate(const PlanSpec& spec, std::uint32_t gpu) {  // bytes per ms, before efficiency
  return spec.gpu_bytes_per_ms() * plan_nic_factor(spec.seed, gpu, spec.nic_jitter);
}

double step_ms(const PlanSpec& spec) { return (spec.hold_s + spec.train_s) * 1000; }

// Without pipeline replication, every reader may read a complete copy at once (th-server's
// --no-pipeline with a large --fanout-max, as bench/run-fanout runs it).
std::uint32_t fanout_used(const PlanSpec& spec, bool pipeline) {
  return pipeline ? spec.fanout : std::max<std::uint32_t>(64, spec.rollouts);
}

// How long the simulation may run past the last cycle before it is called stuck: generous room
// for the slowest read, queued behind every other reader of a trainer, once per version (a trainer's
// unpublish waits for its reads, so slow reads stretch every cycle).
TimeMs liveness_ms(const PlanSpec& spec) {
  double slowest = spec.gpu_bytes_per_ms() * spec.efficiency * (1 - spec.nic_jitter);
  if (spec.remote > 0) {
    slowest = std::min(slowest, spec.cross_dc_gbps * kBytesPerMsPerGbps / spec.gpus_per_node);
    if (spec.tcp_flow_gbps > 0) slowest = std::min(slowest, spec.tcp_flow_gbps * kBytesPerMsPerGbps);
  }
  // (A rollout shard of another layout reads its share of the model, whole source pieces.)
  const double read_ms = static_cast<double>(spec.shard_bytes) * spec.shards / std::min(spec.shards, spec.rollout_gpus()) / slowest;
  const double readers = std::ceil(static_cast<double>(spec.rollouts) / spec.trainers) + 1;
  return kPlanLivenessMs + static_cast<TimeMs>(std::ceil(spec.versions * (readers + 1) * read_ms));
}

// ---- TensorHub, in the simulator ----

SimOptions sim_options(const PlanSpec& spec, bool pipeline) {
  SimOptions options;
  options.seed = spec.seed;
  Knobs& knobs = options.knobs;
  knobs.workload = Workload::kStandalone;  // not used by a plan's loop; named in the knobs line
  knobs.shards = spec.shards;
  knobs.trainers = spec.trainers;
  knobs.rollouts = spec.rollouts;
  knobs.models = 1;
  knobs.spot_rollouts = spec.spot;
  knobs.remote_rollouts = spec.remote;
  knobs.remote_datacenters = 1;
  knobs.colocated = spec.colocated;
  knobs.pipeline = pipeline;
  knobs.fanout = fanout_used(spec, pipeline);
  knobs.smart_skipping = spec.smart_skipping;
  knobs.rate_aware_sources = spec.rate_aware_sources;
  knobs.offload_seeding = spec.offload_seeding;
  knobs.patch_percent = spec.changed_percent;
  knobs.heartbeat_timeout_ms = 10'000;  // th-server's default
  knobs.drain_grace_ms = std::llround(spec.drain_grace_s * 1000);
  knobs.delay_min_ms = std::max<TimeMs>(0, std::llround(spec.latency_ms));
  knobs.delay_mean_ms = 0;
  knobs.shard_bytes = spec.shard_bytes;
  if (spec.rollout_shards > 0) {
    // th-sim's layouts model: trainers and rollouts place its tensors their own ways (bfloat16,
    // tensor parallel); knobs.shard_bytes is then the whole model.
    knobs.workload = Workload::kLayouts;
    knobs.trainer_placement = Placement{Placement::Kind::kTensorParallel, spec.shards, DType::kBFloat16};
    knobs.rollout_placements.assign(spec.rollouts,
                                    Placement{Placement::Kind::kTensorParallel, spec.rollout_shards, DType::kBFloat16});
    knobs.shard_bytes = spec.shard_bytes * spec.shards;
  }
  knobs.nic_bytes_per_ms =
      static_cast<std::uint64_t>(std::llround(spec.gpu_bytes_per_ms() * spec.efficiency));
  knobs.remote_bytes_per_ms = 0;  // no shared link: each machine's VPC NIC (below)
  knobs.liveness_ms = liveness_ms(spec);
  PlanLoop loop;
  loop.versions = spec.versions;
  loop.hold_ms = std::llround(spec.hold_s * 1000);
  loop.train_ms = std::llround(spec.train_s * 1000);
  loop.poll_ms = kPollMs;
  loop.gpus_per_node = spec.gpus_per_node;
  loop.node_remote_bytes_per_ms = static_cast<std::uint64_t>(std::llround(spec.cross_dc_gbps * kBytesPerMsPerGbps));
  loop.remote_flow_bytes_per_ms = static_cast<std::uint64_t>(std::llround(spec.tcp_flow_gbps * kBytesPerMsPerGbps));
  loop.local_copy_bytes_per_ms = static_cast<std::uint64_t>(std::llround(spec.pcie_gbps * kBytesPerMsPerGbps));
  loop.nic_jitter = spec.nic_jitter;
  // A check of the whole hub costs in proportion to the fleet: check as often per client as a
  // small fleet is checked every 64 steps.
  loop.check_every = std::max<std::uint32_t>(64, spec.gpus() / 8);
  loop.spot_join_every = spec.join_every;
  loop.spot_join_batch = spec.join_batch;
  loop.spot_leave_version = spec.leave_version;
  options.plan = loop;
  return options;
}

SystemPlan tensorhub_plan(const PlanSpec& spec, const SimResult& result, std::string name,
                          std::string assumptions) {
  SystemPlan system;
  system.name = std::move(name);
  system.assumptions = std::move(assumptions);
  const PlanStats& stats = result.plan;
  std::map<std::uint32_t, std::vector<double>> rollout_s;
  std::map<std::uint32_t, std::pair<double, std::uint32_t>> trainer_s;  // sum, samples
  for (const PlanSample& sample : stats.stalls) {
    const auto version = static_cast<std::uint32_t>(sample.version);
    const double seconds = static_cast<double>(sample.stall_ms) / 1000;
    if (stats.replicas[sample.replica].trainer) {
      trainer_s[version].first += seconds;
      ++trainer_s[version].second;
    } else {
      rollout_s[version].push_back(seconds);
    }
  }
  // Every version, every trainer GPU (one that did not wait, as for the last version, which is
  // never unpublished, waited 0 s): the same rows as the baselines'.
  for (std::uint32_t v = 1; v <= spec.versions; ++v) {
    system.versions.push_back(summarize(v, rollout_s[v], trainer_s[v].first, spec.trainers * spec.shards));
  }
  if (!rollout_s.empty()) system.last_version_gpu_s = rollout_s.rbegin()->second;
  return system;
}

// ---- The baselines, as models ----

// NCCL broadcast per shard (one ring per shard index, rooted at a trainer replica's GPU), started by
// the framework for everyone at once: every GPU of the job waits for the slowest ring. A replica
// that joins after a step's communicator was built waits for the next step's.
SystemPlan nccl_plan(const PlanSpec& spec, const std::vector<FleetReplica>& fleet) {
  SystemPlan system;
  system.name = "NCCL broadcast";
  std::ostringstream says;
  says << "ring broadcast per shard from one trainer replica through every rollout replica, at the "
          "slowest member's NIC rate x "
       << spec.nccl_efficiency << " (the paper's 18.8/25 GB/s) plus one " << spec.nccl_chunk_bytes / 1024
       << " KiB step per hop; a cross-datacenter hop at the VPC NIC's share (TCP); the framework "
          "stops every GPU (trainers too) until the slowest ring ends, + "
       << spec.coordination_ms << " ms of coordination; a replica that joins waits for the next "
          "step's communicator (one step, "
       << step_ms(spec) / 1000 << " s)";
  system.assumptions = says.str();
  for (std::uint32_t v = 1; v <= spec.versions; ++v) {
    double stage_ms = 0;
    std::uint32_t members = 1;  // the root
    bool crosses = false;
    std::vector<const FleetReplica*> joiners;
    for (const FleetReplica& replica : fleet) {
      if (replica.trainer || !present(spec, replica, v)) continue;
      if (v > 1 && replica.join_version == v) {
        joiners.push_back(&replica);
        continue;
      }
      ++members;
      crosses = crosses || replica.remote;
    }
    for (std::uint32_t shard = 0; shard < spec.shards; ++shard) {
      double rate = gpu_rate(spec, fleet[0].first_gpu + shard);
      for (const FleetReplica& replica : fleet) {
        if (replica.trainer || !present(spec, replica, v) || (v > 1 && replica.join_version == v)) continue;
        rate = std::min(rate, gpu_rate(spec, replica.first_gpu + shard));
      }
      rate *= spec.nccl_efficiency;
      if (crosses) {
        const double rings_per_node = std::min(spec.shards, spec.gpus_per_node);
        double cross = spec.cross_dc_gbps * kBytesPerMsPerGbps / rings_per_node;
        if (spec.tcp_flow_gbps > 0) cross = std::min(cross, spec.tcp_flow_gbps * kBytesPerMsPerGbps);
        rate = std::min(rate, cross);
      }
      const double step_bytes = std::min(spec.nccl_chunk_bytes, static_cast<double>(spec.shard_bytes));
      const double ring_ms = (static_cast<double>(spec.shard_bytes) +
                              static_cast<double>(members - 1) * step_bytes) / rate;
      stage_ms = std::max(stage_ms, members > 1 ? ring_ms : 0.0);
    }
    const double stage_s = (stage_ms + spec.coordination_ms) / 1000;
    std::vector<double> rollout_s;
    for (const FleetReplica& replica : fleet) {
      if (replica.trainer || !present(spec, replica, v)) continue;
      const bool joined_now = v > 1 && replica.join_version == v;
      for (std::uint32_t shard = 0; shard < spec.shards; ++shard) {
        rollout_s.push_back(joined_now ? step_ms(spec) / 1000 + stage_s : stage_s);
      }
    }
    const std::uint32_t trainer_gpus = spec.trainers * spec.shards;
    system.versions.push_back(summarize(v, rollout_s, stage_s * trainer_gpus, trainer_gpus));
    if (v == spec.versions) system.last_version_gpu_s = rollout_s;
  }
  return system;
}

// UCX point to point: every rollout GPU reads its shard from a trainer replica's GPU (assigned
// round robin), all at once, splitting the source's NIC evenly; elastic (spot) replicas read from
// the standalone rollouts once those have the version (the paper's trainer -> standalone -> elastic
// topology), or from the trainers when there are no standalones. Colocated: the stage stops every
// GPU until the last read ends; otherwise each rollout GPU waits for its own read and the trainers
// for the reads they serve.
// `gpu_nodes`: the machine of every GPU, as the simulation placed it (PlanStats::gpu_nodes).
SystemPlan ucx_plan(const PlanSpec& spec, const std::vector<FleetReplica>& fleet,
                    const std::vector<std::uint32_t>& gpu_nodes, std::uint64_t& bytes_cross) {
  SystemPlan system;
  system.name = "UCX point-to-point";
  std::ostringstream says;
  says << "every rollout GPU reads from a trainer GPU (round robin), all at once, the source's NIC "
          "split evenly, at x "
       << spec.ucx_efficiency << " (the paper's 18.1/25 GB/s); spot replicas read from the standalone "
          "rollouts after those finish; across datacenters each read is TCP through both machines' VPC NIC, split "
          "between the machine's reads across"
       << (spec.tcp_flow_gbps > 0 ? ", at most the TCP flow cap" : "") << "; "
       << (spec.colocated ? "colocated: every GPU waits for the last read"
                          : "each rollout GPU waits for its own read")
       << ", + " << spec.coordination_ms << " ms of coordination";
  system.assumptions = says.str();
  const double cross_node_rate = spec.cross_dc_gbps * kBytesPerMsPerGbps;
  struct Read {
    std::uint32_t reader_gpu, source_gpu, reader_node, source_node;
    bool remote;
    double start_ms = 0;
    double end_ms = 0;
  };
  for (std::uint32_t v = 1; v <= spec.versions; ++v) {
    std::vector<const FleetReplica*> trainers;
    std::vector<const FleetReplica*> standalone;
    std::vector<const FleetReplica*> elastic;
    for (const FleetReplica& replica : fleet) {
      if (!present(spec, replica, v)) continue;
      (replica.trainer ? trainers : replica.spot ? elastic : standalone).push_back(&replica);
    }
    // Two phases: from the trainers, then (elastic) from the standalones.
    auto run_phase = [&](const std::vector<const FleetReplica*>& readers,
                         const std::vector<const FleetReplica*>& sources,
                         const std::vector<double>& source_ready_ms) {
      std::vector<Read> reads;
      for (std::size_t i = 0; i < readers.size(); ++i) {
        const FleetReplica& source = *sources[i % sources.size()];
        for (std::uint32_t shard = 0; shard < spec.shards; ++shard) {
          Read read{readers[i]->first_gpu + shard, source.first_gpu + shard,
                    gpu_nodes.at(readers[i]->first_gpu + shard), gpu_nodes.at(source.first_gpu + shard),
                    readers[i]->remote != source.remote};
          read.start_ms = source_ready_ms.empty() ? 0 : source_ready_ms[(i % sources.size()) * spec.shards + shard];
          reads.push_back(read);
        }
      }
      std::map<std::uint32_t, std::uint32_t> per_source;
      std::map<std::uint32_t, std::uint32_t> cross_per_node;
      for (const Read& read : reads) {
        ++per_source[read.source_gpu];
        if (read.remote) {
          ++cross_per_node[read.reader_node];
          ++cross_per_node[read.source_node];
        }
      }
      for (Read& read : reads) {
        double rate = std::min(gpu_rate(spec, read.source_gpu) / per_source[read.source_gpu],
                               gpu_rate(spec, read.reader_gpu)) *
                      spec.ucx_efficiency;
        if (read.remote) {
          rate = std::min({rate, cross_node_rate / cross_per_node[read.reader_node],
                           cross_node_rate / cross_per_node[read.source_node]});
          if (spec.tcp_flow_gbps > 0) rate = std::min(rate, spec.tcp_flow_gbps * kBytesPerMsPerGbps);
          bytes_cross += spec.shard_bytes;
        }
        read.end_ms = read.start_ms + static_cast<double>(spec.shard_bytes) / rate;
      }
      return reads;
    };
    std::vector<const FleetReplica*> first = standalone;
    if (standalone.empty()) first.insert(first.end(), elastic.begin(), elastic.end());
    std::vector<Read> reads = trainers.empty() || first.empty() ? std::vector<Read>{}
                                                                : run_phase(first, trainers, {});
    if (!standalone.empty() && !elastic.empty()) {
      std::vector<double> ready_ms;  // per standalone GPU, in (replica, shard) order
      for (const Read& read : reads) ready_ms.push_back(read.end_ms);
      const std::vector<Read> second = run_phase(elastic, standalone, ready_ms);
      reads.insert(reads.end(), second.begin(), second.end());
    }
    double stage_ms = 0;
    for (const Read& read : reads) stage_ms = std::max(stage_ms, read.end_ms);
    std::vector<double> rollout_s;
    for (const Read& read : reads) {
      rollout_s.push_back(((spec.colocated ? stage_ms : read.end_ms) + spec.coordination_ms) / 1000);
    }
    // Trainers serve (and, colocated, wait) until the last read from them ends.
    double trainer_ms = 0;
    for (const Read& read : reads) {
      if (read.start_ms == 0) trainer_ms = std::max(trainer_ms, read.end_ms);
    }
    const std::uint32_t trainer_gpus = spec.trainers * spec.shards;
    const double trainer_s = ((spec.colocated ? stage_ms : trainer_ms) + spec.coordination_ms) / 1000;
    system.versions.push_back(summarize(v, rollout_s, trainer_s * trainer_gpus, trainer_gpus));
    if (v == spec.versions) system.last_version_gpu_s = rollout_s;
  }
  return system;
}

// The roofline: every rollout GPU reads its shard once at its NIC's full rate, nobody else waits.
SystemPlan ideal_plan(const PlanSpec& spec, const std::vector<FleetReplica>& fleet) {
  SystemPlan system;
  system.name = "RDMA ideal";
  system.assumptions =
      "each rollout GPU reads its shard at its NIC's full rate; no coordination, no contention (a "
      "reader of a CPU offload copy on its own machine reads over PCIe, which can be faster)";
  for (std::uint32_t v = 1; v <= spec.versions; ++v) {
    std::vector<double> rollout_s;
    for (const FleetReplica& replica : fleet) {
      if (replica.trainer || !present(spec, replica, v)) continue;
      for (std::uint32_t shard = 0; shard < spec.shards; ++shard) {
        rollout_s.push_back(static_cast<double>(spec.shard_bytes) /
                            gpu_rate(spec, replica.first_gpu + shard) / 1000);
      }
    }
    system.versions.push_back(summarize(v, rollout_s, 0, 0));
    if (v == spec.versions) system.last_version_gpu_s = rollout_s;
  }
  return system;
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

Status PlanSpec::validate() const {
  auto bad = [](std::string what) { return Status(make_error(Errc::kInvalidArgument, std::move(what))); };
  // Written so that NaN fails every test (a comparison with NaN is false).
  auto in = [](double value, double low, double high) { return value >= low && value <= high; };
  if (shards == 0 || shards > limits::kShardsMax) {
    return bad("shards per replica must be in 1.." + std::to_string(limits::kShardsMax) + " (the hub's limit)");
  }
  if (rollout_shards > 0) {
    // th-sim's layouts model splits its tensors 8 ways at most (sim/layouts.cpp).
    auto divides_8 = [](std::uint32_t n) { return n == 1 || n == 2 || n == 4 || n == 8; };
    if (!divides_8(shards) || !divides_8(rollout_shards)) {
      return bad("with --rollout-shards, the trainers' and the rollouts' shards must each be 1, 2, 4 or 8 (th-sim's "
                 "layouts model splits its tensors 8 ways at most)");
    }
    if (colocated) return bad("--rollout-shards and --colocated: a colocated trainer rolls out in its own layout");
  }
  if (gpus_per_node == 0 || nics_per_node == 0) return bad("GPUs per node and NICs per node must be at least 1");
  if (!in(nic_gbps, 1e-3, 1e5)) return bad("the NIC rate must be in 0.001..100000 Gbit/s");
  if (shard_bytes == 0) return bad("the shard size must be at least one byte");
  if (trainers == 0) return bad("a plan needs at least one trainer replica");
  if (rollouts == 0) return bad("a plan needs at least one rollout replica");
  if (spot > rollouts || remote > rollouts) return bad("spot and remote rollouts are counted among the rollouts: at most --rollouts each");
  if (spot + remote > rollouts) return bad("a rollout is spot or remote, not both: spot + remote must not exceed rollouts");
  if (remote > 0 && !(cross_dc_gbps > 0)) return bad("remote rollouts need a cross-datacenter rate above 0");
  if (versions == 0 || versions > kVersionsMax) return bad("versions must be in 1.." + std::to_string(kVersionsMax));
  if (gpus() > kGpusMax) return bad("at most " + std::to_string(kGpusMax) + " GPUs");
  if (static_cast<std::uint64_t>(gpus()) * versions > kGpuVersionsMax) {
    return bad("GPUs x versions must be at most " + std::to_string(kGpuVersionsMax) +
               " (a 4,096-GPU plan: up to 244 versions)");
  }
  // A trainer serves each version at least a second: with less, a version can be gone before a
  // rollout told of it asks for it (TensorHub keeps what retention asks for, and a plan asks none).
  if (!in(hold_s, 1, kSecondsMax)) return bad("the hold time must be in 1..1000000 s");
  if (!in(train_s, 0, kSecondsMax)) return bad("the train time must be in 0..1000000 s");
  if (!in(efficiency, 1e-6, 1) || !in(nccl_efficiency, 1e-6, 1) || !in(ucx_efficiency, 1e-6, 1)) {
    return bad("efficiencies are fractions of the line rate, in (0, 1]");
  }
  if (!in(nic_jitter, 0, 0.99)) return bad("NIC jitter must be in 0..0.99");
  if (!in(latency_ms, 0, 1e4)) return bad("the latency must be in 0..10000 ms");
  if (!in(coordination_ms, 0, 1e7)) return bad("the coordination time must be in 0..10000000 ms");
  if (!in(nccl_chunk_bytes, 1, 1e12)) return bad("NCCL's step must be at least one byte");
  // Rates reach the simulator in whole bytes per millisecond: below 8 Mbit/s that rounding would
  // be a visible error (and 0 would mean "no limit").
  const double slowest_gpu = gpu_bytes_per_ms() * std::min({efficiency, nccl_efficiency, ucx_efficiency}) *
                             (1 - nic_jitter);
  if (!(slowest_gpu >= kBytesPerMsMin)) return bad("each GPU's NIC share (times efficiency and jitter) must be at least 8 Mbit/s");
  for (const auto& [rate, name] : {std::pair{cross_dc_gbps, "cross-datacenter"}, std::pair{tcp_flow_gbps, "TCP flow"},
                                   std::pair{pcie_gbps, "PCIe"}}) {
    if (!(rate == 0 || in(rate * kBytesPerMsPerGbps, kBytesPerMsMin, 1e5 * kBytesPerMsPerGbps))) {
      return bad(std::string("the ") + name + " rate must be 0 (none) or in 0.008..100000 Gbit/s");
    }
  }
  if (join_batch == 0) return bad("a join batch must be at least 1 replica");
  if (fanout == 0) return bad("fan-out must be at least 1");
  if (!in(drain_grace_s, 0.001, static_cast<double>(limits::kDeadlineMsMax) / 1000)) {
    return bad("the drain grace must be in 0.001.." + std::to_string(limits::kDeadlineMsMax / 1000) + " s");
  }
  return Unit{};
}

double PlanSpec::gpu_bytes_per_ms() const {
  return static_cast<double>(nics_per_node) * nic_gbps * kBytesPerMsPerGbps / gpus_per_node;
}

double SystemPlan::mean_total_gpu_s() const {
  double sum = 0;
  for (const VersionStall& v : versions) sum += v.total_gpu_s;
  return versions.empty() ? 0 : sum / static_cast<double>(versions.size());
}

double SystemPlan::mean_rollout_gpu_s() const {
  double sum = 0;
  for (const VersionStall& v : versions) sum += v.rollout_gpu_s;
  return versions.empty() ? 0 : sum / static_cast<double>(versions.size());
}

double SystemPlan::max_s() const {
  double max = 0;
  for (const VersionStall& v : versions) max = std::max(max, v.max_s);
  return max;
}

double SystemPlan::p99_s() const {
  double max = 0;
  for (const VersionStall& v : versions) max = std::max(max, v.p99_s);
  return max;
}

Result<PlanReport> plan(const PlanSpec& spec) {
  if (auto valid = spec.validate(); !valid.ok()) return valid.error();
  PlanReport report;
  report.spec = spec;
  const std::vector<FleetReplica> fleet = fleet_of(spec);

  const auto started = std::chrono::steady_clock::now();
  const SimResult result = simulate(sim_options(spec, spec.pipeline));
  report.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  report.events = result.events;
  report.virtual_s = static_cast<double>(result.virtual_ms) / 1000;
  if (!result.ok) report.violation = result.violation;
  std::ostringstream th_says;
  th_says << "the real Hub and shard agents in virtual time (th-sim's simulator), pipeline "
          << (spec.pipeline ? "on" : "off") << ", fan-out " << fanout_used(spec, spec.pipeline) << ", smart skipping "
          << (spec.smart_skipping ? "on" : "off") << ", rate-aware sources "
          << (spec.rate_aware_sources ? "on" : "off") << ", offload seeding "
          << (spec.offload_seeding ? "on" : "off")
          << (spec.changed_percent > 0 ? ", patches (" + std::to_string(spec.changed_percent) + " % of the weights change per version)" : std::string())
          << ", drain grace " << spec.drain_grace_s
          << " s; data plane at x" << spec.efficiency
          << " of the NIC rate; stall = the rollout's update time until the version arrived, and a "
             "trainer's unpublish time (reads draining)";
  report.systems.push_back(tensorhub_plan(spec, result, spec.pipeline ? "TensorHub" : "TensorHub (no pipeline)",
                                          th_says.str()));

  // Bytes and sources, from TensorHub's reads.
  std::map<std::tuple<Version, std::uint32_t, std::uint32_t>, std::uint64_t> per_source_version;
  std::set<std::uint32_t> sources;
  for (const PlanRead& read : result.plan.reads) {
    (result.plan.replicas[read.source].trainer ? report.reads_from_trainers : report.reads_from_rollouts) += 1;
    sources.insert(read.source);
    report.max_reads_per_source_version =
        std::max(report.max_reads_per_source_version, ++per_source_version[{read.version, read.source, read.shard}]);
  }
  report.sources = sources.size();
  report.bytes_local = result.plan.bytes_local;
  report.bytes_cross = result.plan.bytes_cross;
  report.bytes_offload = result.plan.bytes_offload_local;

  if (spec.pipeline && spec.run_no_pipeline) {
    const SimResult flat = simulate(sim_options(spec, false));
    report.events += flat.events;
    if (!flat.ok && report.violation.empty()) report.violation = "without pipeline: " + flat.violation;
    report.systems.push_back(tensorhub_plan(
        spec, flat, "TensorHub (no pipeline)",
        "the same simulation with pipeline replication off: readers read complete copies only, up to " +
            std::to_string(fanout_used(spec, false)) + " at once from one copy (th-server --no-pipeline --fanout-max " +
            std::to_string(fanout_used(spec, false)) + ")"));
  }
  if (spec.rollout_shards > 0) {
    // The same rollouts and bytes with nothing to reshard: trainers of the rollouts' layout.
    PlanSpec same = spec;
    same.shards = spec.rollout_shards;
    same.shard_bytes = spec.shard_bytes * spec.shards / spec.rollout_shards;
    same.rollout_shards = 0;
    const SimResult reference = simulate(sim_options(same, spec.pipeline));
    report.events += reference.events;
    if (!reference.ok && report.violation.empty()) report.violation = "the same layout: " + reference.violation;
    report.systems.push_back(tensorhub_plan(
        same, reference, "TensorHub, one layout",
        "the same rollouts reading the same bytes from trainers of their own layout (" +
            std::to_string(same.trainers) + " x " + std::to_string(same.shards) +
            " shards): nothing to reshard. The baselines are not run: they broadcast one layout"));
  } else {
    report.systems.push_back(nccl_plan(spec, fleet));
    report.systems.push_back(ucx_plan(spec, fleet, result.plan.gpu_nodes, report.ucx_bytes_cross));
    report.systems.push_back(ideal_plan(spec, fleet));
  }
  report.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return report;
}

std::string PlanReport::text() const {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(2);
  const double model_gb = static_cast<double>(spec.shard_bytes) * spec.shards / 1e9;
  out << "cluster: " << spec.gpus() << " GPUs (" << spec.trainers << " trainer and " << spec.rollouts
      << " rollout replicas of " << spec.shards << " shards"
      << (spec.rollout_shards > 0 ? " (the rollouts: " + std::to_string(spec.rollout_shards) + ", reading across layouts)" : "")
      << "; " << spec.spot << " spot, " << spec.remote
      << " in a second datacenter), " << spec.gpus_per_node << " GPUs and " << spec.nics_per_node << " x "
      << spec.nic_gbps << " Gbit/s NICs per machine (" << spec.gpu_bytes_per_ms() / 1e6
      << " GB/s per GPU), " << spec.cross_dc_gbps << " Gbit/s across datacenters per machine\n";
  out << "model: " << static_cast<double>(spec.shard_bytes) / 1e9 << " GB per shard, " << model_gb
      << " GB per replica; " << spec.versions << " versions, one every " << spec.hold_s + spec.train_s
      << " s\n\n";
  out << "stall per version (s; p50/p99/max over rollout GPUs)      GPU-s per version (all / rollouts)   x TensorHub\n";
  const double base = systems.empty() ? 0 : systems.front().mean_total_gpu_s();
  for (const SystemPlan& system : systems) {
    std::vector<double> p50;
    for (const VersionStall& v : system.versions) p50.push_back(v.p50_s);
    char line[256];
    std::snprintf(line, sizeof line, "  %-26s %7.2f %7.2f %7.2f        %12.1f / %-12.1f   %6.2f\n",
                  system.name.c_str(), p50.empty() ? 0.0 : percentile(p50, 0.5), system.p99_s(),
                  system.max_s(), system.mean_total_gpu_s(), system.mean_rollout_gpu_s(),
                  base > 0 ? system.mean_total_gpu_s() / base : 0.0);
    out << line;
  }
  out << "\nTensorHub's bytes: " << static_cast<double>(bytes_local) / 1e9 << " GB within datacenters ("
      << static_cast<double>(bytes_offload) / 1e9 << " GB from offload copies), "
      << static_cast<double>(bytes_cross) / 1e9 << " GB across";
  if (spec.remote > 0 && model_gb > 0) {
    out << " = " << static_cast<double>(bytes_cross) / 1e9 / model_gb / spec.versions
        << " x the model per version (UCX: " << static_cast<double>(ucx_bytes_cross) / 1e9 / model_gb / spec.versions
        << " x)";
  }
  out << "\nTensorHub's sources: " << reads_from_trainers << " shard reads from trainers, " << reads_from_rollouts
      << " from rollouts; " << sources << " replicas served; the busiest source GPU served "
      << max_reads_per_source_version << " reads of one version\n";
  out << "simulation: " << events << " events in " << wall_s << " s ("
      << static_cast<double>(events) / std::max(wall_s, 1e-9) << " events/s), " << virtual_s
      << " s simulated\n";
  if (!violation.empty()) out << "SIMULATION FAILED (figures void): " << violation << "\n";
  for (const SystemPlan& system : systems) out << "\n" << system.name << ": " << system.assumptions;
  out << "\n";
  return out.str();
}

std::string PlanReport::json() const {
  std::ostringstream out;
  out.precision(6);
  out << "{\"gpus\":" << spec.gpus() << ",\"trainers\":" << spec.trainers << ",\"rollouts\":" << spec.rollouts
      << ",\"spot\":" << spec.spot << ",\"remote\":" << spec.remote << ",\"shards\":" << spec.shards
      << ",\"rollout_shards\":" << spec.rollout_shards
      << ",\"shard_bytes\":" << spec.shard_bytes << ",\"versions\":" << spec.versions
      << ",\"gpu_gbytes_per_s\":" << spec.gpu_bytes_per_ms() / 1e6 << ",\"colocated\":"
      << (spec.colocated ? "true" : "false") << ",\"bytes_local\":" << bytes_local
      << ",\"bytes_cross\":" << bytes_cross << ",\"bytes_offload\":" << bytes_offload
      << ",\"ucx_bytes_cross\":" << ucx_bytes_cross << ",\"reads_from_trainers\":" << reads_from_trainers
      << ",\"reads_from_rollouts\":" << reads_from_rollouts
      << ",\"max_reads_per_source_version\":" << max_reads_per_source_version << ",\"events\":" << events
      << ",\"wall_s\":" << wall_s << ",\"virtual_s\":" << virtual_s << ",\"ok\":"
      << (violation.empty() ? "true" : "false") << ",\"violation\":" << json_string(violation)
      << ",\"systems\":[";
  for (std::size_t i = 0; i < systems.size(); ++i) {
    const SystemPlan& system = systems[i];
    out << (i ? "," : "") << "{\"name\":" << json_string(system.name)
        << ",\"assumptions\":" << json_string(system.assumptions)
        << ",\"mean_total_gpu_s\":" << system.mean_total_gpu_s()
        << ",\"mean_rollout_gpu_s\":" << system.mean_rollout_gpu_s() << ",\"max_s\":" << system.max_s()
        << ",\"p99_s\":" << system.p99_s() << ",\"versions\":[";
    for (std::size_t j = 0; j < system.versions.size(); ++j) {
      const VersionStall& v = system.versions[j];
      out << (j ? "," : "") << "{\"version\":" << v.version << ",\"gpus\":" << v.gpus
          << ",\"rollout_gpus\":" << v.rollout_gpus << ",\"p50_s\":" << v.p50_s
          << ",\"p99_s\":" << v.p99_s << ",\"max_s\":" << v.max_s << ",\"mean_s\":" << v.mean_s
          << ",\"total_gpu_s\":" << v.total_gpu_s << ",\"rollout_gpu_s\":" << v.rollout_gpu_s << "}";
    }
    out << "],\"last_version_gpu_s\":[";
    for (std::size_t j = 0; j < system.last_version_gpu_s.size(); ++j) {
      out << (j ? "," : "") << system.last_version_gpu_s[j];
    }
    out << "]}";
  }
  out << "]}";
  return out.str();
}

}  // namespace th::sim
