// Swarm testing (after TigerBeetle's VOPR and FoundationDB's BUGGIFY): every fault and workload knob
// is drawn per seed, and each fault is switched off entirely in a good share of seeds, so that runs
// differ in kind and not only in detail. A run's first output line names the seed and every knob.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "core/types.h"
#include "sim/random.h"

namespace th::sim {

enum class Workload : std::uint8_t {
  kColocated,   // trainers that also roll out: publish -> rollout -> unpublish -> train -> publish
  kStandalone,  // a trainer and standalone rollouts: update(latest) in a loop
  kElastic,     // spot rollouts, preempted without notice (and in storms), rejoining
  kCrossDc,     // most rollouts in a second datacenter behind a slow link
  kOffByK,      // asynchronous training: rollouts follow latest-k, the trainer retains latest-k
  kMultiModel,  // two models at once
  kMixed,       // all of the above in one fleet
  // Replicas that place the model's tensors their own ways (sim/layouts.h): a TP=8 trainer, TP=4,
  // TP=2, TP=1 and FSDP-like rollouts, some in float32, reading one another's copies across layouts.
  kLayouts,
};
inline constexpr int kWorkloadCount = 8;
// The workloads a seed draws first: all but kLayouts, which is drawn last (draw_knobs), so that the
// seeds of the others stay what they drew before it existed.
inline constexpr int kFirstDrawnWorkloads = 7;
std::string_view workload_name(Workload workload);
Result<Workload> parse_workload(std::string_view name);
std::string workload_list();  // "colocated, standalone, …"

// How a replica places the model's logical tensors over its shards (the layouts workload, whose
// tensors sim/layouts.h lists).
struct Placement {
  enum class Kind : std::uint8_t {
    kTensorParallel,  // Megatron-style: each tensor split evenly by rows or by columns, or replicated
    kFsdp,            // FSDP2 Shard(0): each tensor chunked by rows as torch.chunk does (the last
                      // shards may hold fewer rows, or none of a tensor)
  };
  Kind kind = Kind::kTensorParallel;
  std::uint32_t shards = 1;
  DType dtype = DType::kBFloat16;
  friend bool operator==(const Placement&, const Placement&) = default;
};
std::string describe(const Placement& placement);  // "tp8/bfloat16", "fsdp5/float32"

struct Knobs {
  Workload workload = Workload::kMixed;
  // The fleet.
  std::uint32_t shards = 2;          // per replica
  std::uint32_t trainers = 1;        // per model
  std::uint32_t rollouts = 4;        // per model
  std::uint32_t models = 1;
  std::uint32_t spot_rollouts = 0;   // per model, of `rollouts`
  std::uint32_t remote_rollouts = 0; // per model, in other datacenters than the trainers'
  std::uint32_t remote_datacenters = 1;  // the remote rollouts take turns among dc1..dcN
  std::uint32_t off_by = 0;          // rollouts follow latest-off_by
  bool colocated = false;            // trainers roll out between publish and unpublish
  // The layouts workload: how the trainers and each rollout (by index) place the model's tensors;
  // `shards` is then the trainers'. Empty otherwise: every replica holds `shards` shards of the
  // other workloads' two fixed tensors.
  std::optional<Placement> trainer_placement;
  std::vector<Placement> rollout_placements;
  // The hub.
  bool pipeline = true;
  std::uint32_t fanout = 1;
  bool smart_skipping = true;
  // Not drawn (every seed runs the server's default): th-plan turns it off for a before/after.
  bool rate_aware_sources = true;
  bool offload_seeding = false;
  TimeMs heartbeat_timeout_ms = 3000;
  // Network faults (control plane).
  double drop = 0;                   // per message
  double duplicate = 0;              // per message
  // Per instruction to a worker: a copy arrives again 0.5-8 s later, after newer ones (a stale
  // instruction: a retransmission from an earlier path, a message replayed by a proxy).
  double stale = 0;
  TimeMs delay_min_ms = 1;
  TimeMs delay_mean_ms = 2;          // exponential on top of the minimum: reorders messages
  double clog_per_s = 0;             // a worker's messages stall for clog_ms
  TimeMs clog_ms = 0;
  double partition_per_s = 0;        // a replica is cut from the server (one or both ways)
  TimeMs partition_ms = 0;
  // Process and data-plane faults.
  double crash_per_s = 0;            // a rollout replica crashes (mid-transfer when it can)
  // A crash takes its rack along: every other rollout replica of its datacenter that serves a
  // transfer at that moment crashes with it (correlated failures: a top-of-rack switch, a power
  // feed). Several sources of one datacenter lost at once leave several waiting readers there.
  bool rack_crashes = false;
  bool preemption_storm = false;     // many spot replicas at once
  bool server_crash = false;         // the primary server dies once; clients fail over
  double read_failure = 0;           // a read fails for no reason on the source's side
  // Bytes that are not what was published (DESIGN.md §5.1: every byte a reader keeps matches the
  // version's checksum). `corrupt`: the share of reads that a bit flip hits on the way (a NIC, a
  // link, a bad DIMM on the reader). `tamper`: per second, a source's buffers change under a
  // published version (a trainer that writes its tensors while published, or memory gone bad):
  // every read of them fails its checksum until the source holds another version.
  double corrupt = 0;
  double tamper_per_s = 0;
  double straggler_fraction = 0;     // hosts with a tenth of the bandwidth and slow steps
  // Rollout hosts whose downloads crawl at 2 KB/s while faults are on (a throttled or overloaded
  // reader): a source's unpublish, update or close waits for them one drain grace at most.
  double throttle_fraction = 0;
  TimeMs drain_grace_ms = 30'000;    // the hub's (HubSettings::drain_grace_ms)
  // A model with no replica ends after this (the hub's HubSettings::model_grace_ms).
  TimeMs model_grace_ms = 60'000;
  // A run restarts from version 1 in its model's name (a trainer starting over from step 0): once,
  // while faults are on, every replica of one model stops, and all come back once the hub must
  // have ended the model; its trainers publish version 1 of a new run, whose bytes are not the
  // old run's.
  bool run_restart = false;
  std::int64_t clock_skew_ppm = 0;   // each worker's clock runs up to this much fast or slow
  // The application: the share of a rollout's replicate, update and wait calls that one of its
  // shards cancels (UserCancel) a while after making it.
  double cancel = 0;
  // Delta versions: the percentage of a shard's bytes that change from one version to the next
  // (the content's change period, sim/layouts.h); 0: every byte changes. With it on, trainers
  // publish each version with a patch against the one before, and rollouts that hold that one read
  // the patch (README "Delta versions"); drawn in about a third of the seeds.
  std::uint32_t patch_percent = 0;
  // The data plane.
  std::uint64_t shard_bytes = 64ULL << 20;  // modelled size of one shard
  std::uint64_t nic_bytes_per_ms = 1'250'000;  // 10 Gbit/s up and down per host
  std::uint64_t remote_bytes_per_ms = 125'000;  // 1 Gbit/s between datacenters, shared
  // Phases.
  TimeMs safety_ms = 30'000;         // faults on
  TimeMs liveness_ms = 90'000;       // faults healed: everything must converge within this
};

// Draws every knob from `rng` for `workload` (or one drawn too, if none is given).
Knobs draw_knobs(Rng& rng, const Workload* workload);

// Applies "key=value,key=value" overrides ("none" switches every fault off). Unknown keys and bad
// values are errors that name the key.
Status apply_overrides(Knobs& knobs, std::string_view overrides);

// Named fault profiles, applied over the drawn knobs (and under --faults):
//   drawn         every knob as drawn from the seed (swarm testing)
//   harsh-net     partitions and clogging every second, 100 ms mean delays
//   harsh-crash   5% of messages lost, a crash every 2 s, 10% of reads fail, a server failover
//   harsh-bytes   a bit flipped in flight in 10% of reads; a source's published buffers change
//                 under its readers every 2 s
//   harsh         all three at once
Status apply_profile(Knobs& knobs, std::string_view profile);
std::string profile_list();  // "drawn, harsh-net, …"
std::string fault_keys();  // the keys apply_overrides accepts, for --help

std::string describe(const Knobs& knobs);

}  // namespace th::sim
