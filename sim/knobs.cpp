#include "sim/knobs.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <sstream>

#include "core/limits.h"

namespace th::sim {

namespace {

constexpr std::array<std::string_view, kWorkloadCount> kWorkloadNames = {
    "colocated", "standalone", "elastic", "cross-dc", "off-by-k", "multi-model", "mixed", "layouts"};

// A fault is off in about a third of the seeds; when on, its strength is drawn.
bool on(Rng& rng) { return rng.below(3) != 0; }

// A value from a fixed table: spreads draws over orders of magnitude (as many runs at 0.1% as at
// 1%) without floating-point functions whose last bit may differ between libraries.
template <std::size_t N>
double pick(Rng& rng, const std::array<double, N>& values) {
  return values[rng.below(N)];
}
constexpr std::array<double, 6> kRareToCommon = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05};
constexpr std::array<double, 5> kPerSecond = {0.005, 0.01, 0.03, 0.1, 0.2};

// The layouts workload's replicas: trainers at TP=8 (TP=4 or TP=2 in some seeds: a smaller
// cluster), bfloat16; rollouts take the kinds below in turn from a drawn start (so that four or
// more cover them all), a third of them in float32 (converted on landing). The trainers' own
// placement among them gives same-layout (pipelined) reads too.
void draw_placements(Rng& rng, Knobs& knobs) {
  using Kind = Placement::Kind;
  constexpr std::array<std::uint32_t, 4> kTrainerShards = {8, 8, 4, 2};
  // FSDP over 3, 5 or 6 shards: uneven chunks, and (5, 6) shards that hold no row of some tensors.
  constexpr std::array<std::uint32_t, 3> kFsdpShards = {3, 5, 6};
  const std::uint32_t tp = kTrainerShards[rng.below(kTrainerShards.size())];
  knobs.shards = tp;
  knobs.trainer_placement = Placement{Kind::kTensorParallel, tp, DType::kBFloat16};
  // Enough rollouts that replicas of other layouts meet (the colocated workload draws as few as 0).
  knobs.rollouts = std::max<std::uint32_t>(knobs.rollouts, 2);
  const std::array<Placement, 5> kinds = {Placement{Kind::kTensorParallel, 4}, Placement{Kind::kTensorParallel, 2},
                                          Placement{Kind::kTensorParallel, 1}, Placement{Kind::kFsdp, 0},
                                          Placement{Kind::kTensorParallel, tp}};
  const std::uint64_t start = rng.below(kinds.size());
  knobs.rollout_placements.clear();
  for (std::uint32_t r = 0; r < knobs.rollouts; ++r) {
    Placement placement = kinds[(start + r) % kinds.size()];
    if (placement.kind == Kind::kFsdp) placement.shards = kFsdpShards[rng.below(kFsdpShards.size())];
    placement.dtype = rng.below(3) == 0 ? DType::kFloat32 : DType::kBFloat16;
    knobs.rollout_placements.push_back(placement);
  }
}

}  // namespace

std::string describe(const Placement& placement) {
  return std::string(placement.kind == Placement::Kind::kFsdp ? "fsdp" : "tp") + std::to_string(placement.shards) +
         "/" + std::string(dtype_name(placement.dtype));
}

std::string_view workload_name(Workload workload) {
  return kWorkloadNames[static_cast<std::size_t>(workload)];
}

Result<Workload> parse_workload(std::string_view name) {
  for (std::size_t i = 0; i < kWorkloadNames.size(); ++i) {
    if (kWorkloadNames[i] == name) return static_cast<Workload>(i);
  }
  return make_error(Errc::kInvalidArgument,
                    "unknown workload '" + std::string(name) + "'; choose from " + workload_list());
}

std::string workload_list() {
  std::string list;
  for (std::string_view name : kWorkloadNames) {
    if (!list.empty()) list += ", ";
    list += name;
  }
  return list;
}

Knobs draw_knobs(Rng& rng, const Workload* workload) {
  Knobs knobs;
  knobs.workload = workload != nullptr ? *workload
                                       : static_cast<Workload>(rng.below(kFirstDrawnWorkloads));
  knobs.shards = static_cast<std::uint32_t>(rng.range(1, 3));
  knobs.trainers = static_cast<std::uint32_t>(rng.range(1, 2));
  knobs.rollouts = static_cast<std::uint32_t>(rng.range(2, 6));
  switch (knobs.workload) {
    case Workload::kColocated:
      knobs.colocated = true;
      knobs.trainers = static_cast<std::uint32_t>(rng.range(2, 3));
      knobs.rollouts = static_cast<std::uint32_t>(rng.range(0, 2));
      break;
    case Workload::kStandalone:
      break;
    case Workload::kElastic:
      knobs.spot_rollouts = knobs.rollouts - static_cast<std::uint32_t>(rng.range(0, 1));
      knobs.preemption_storm = rng.chance(0.6);
      break;
    case Workload::kCrossDc:
      knobs.remote_rollouts = knobs.rollouts - static_cast<std::uint32_t>(rng.range(0, 1));
      break;
    case Workload::kOffByK:
      knobs.off_by = static_cast<std::uint32_t>(rng.range(1, 2));
      break;
    case Workload::kMultiModel:
      knobs.models = 2;
      knobs.rollouts = static_cast<std::uint32_t>(rng.range(2, 4));
      break;
    case Workload::kMixed:
      knobs.models = static_cast<std::uint32_t>(rng.range(1, 2));
      knobs.colocated = rng.chance(0.5);
      knobs.spot_rollouts = static_cast<std::uint32_t>(rng.range(0, knobs.rollouts / 2));
      knobs.remote_rollouts = static_cast<std::uint32_t>(rng.range(0, knobs.rollouts / 2));
      knobs.off_by = static_cast<std::uint32_t>(rng.range(0, 1));
      knobs.preemption_storm = knobs.spot_rollouts > 0 && rng.chance(0.3);
      break;
    case Workload::kLayouts:
      // Of everything the rollouts of the other workloads meet, some: spot instances (and
      // storms), a second datacenter, rollouts that lag. The placements are drawn last (below).
      knobs.rollouts = static_cast<std::uint32_t>(rng.range(3, 6));
      knobs.spot_rollouts = static_cast<std::uint32_t>(rng.range(0, knobs.rollouts / 2));
      knobs.remote_rollouts = static_cast<std::uint32_t>(rng.range(0, knobs.rollouts / 2));
      knobs.off_by = static_cast<std::uint32_t>(rng.range(0, 1));
      knobs.preemption_storm = knobs.spot_rollouts > 0 && rng.chance(0.3);
      break;
  }
  knobs.pipeline = rng.below(4) != 0;
  knobs.fanout = knobs.pipeline ? static_cast<std::uint32_t>(rng.range(1, 2))
                                : static_cast<std::uint32_t>(rng.range(1, 4));
  knobs.smart_skipping = rng.chance(0.7);
  knobs.heartbeat_timeout_ms = rng.range(2000, 6000);
  if (on(rng)) knobs.drop = pick(rng, kRareToCommon);
  if (on(rng)) knobs.duplicate = pick(rng, kRareToCommon);
  knobs.delay_min_ms = rng.range(0, 2);
  knobs.delay_mean_ms = on(rng) ? rng.range(1, 30) : 1;
  if (on(rng)) {
    knobs.clog_per_s = pick(rng, kPerSecond);
    knobs.clog_ms = rng.range(100, 3000);
  }
  if (on(rng)) {
    knobs.partition_per_s = pick(rng, kPerSecond);
    knobs.partition_ms = rng.range(500, 8000);
  }
  if (on(rng)) knobs.crash_per_s = pick(rng, kPerSecond);
  knobs.server_crash = rng.chance(0.25);
  if (on(rng)) knobs.read_failure = pick(rng, kRareToCommon);
  if (on(rng)) knobs.straggler_fraction = static_cast<double>(rng.range(1, 3)) / 10;
  if (on(rng)) knobs.clock_skew_ppm = rng.range(100, 50'000);
  // Sizes set the timing only (the real buffers are small): enough that transfers overlap and
  // pipelines form, small enough that the liveness phase can move everything several times.
  knobs.shard_bytes = static_cast<std::uint64_t>(rng.range(8, 64)) << 20;
  // Drawn last, so that the knobs above stay what each seed drew before the option existed.
  knobs.offload_seeding = knobs.remote_rollouts > 0 && rng.chance(0.5);
  // Chains of sources across three or more datacenters (one in four seeds with several remote
  // rollouts).
  if (knobs.remote_rollouts > 1 && rng.chance(0.25)) {
    knobs.remote_datacenters = static_cast<std::uint32_t>(rng.range(2, 3));
  }
  // Drawn after everything else (the knobs above stay what each seed drew before it); it matters
  // only where crashes happen (drawn, or a harsh-crash profile).
  knobs.rack_crashes = rng.chance(0.3);
  // Now and then a remote datacenter as large as the paper's (many rollouts behind one slow link):
  // with several sources per datacenter, losing some leaves chains of waiting readers there.
  if (knobs.workload == Workload::kCrossDc && rng.chance(0.3)) {
    const auto extra = static_cast<std::uint32_t>(rng.range(4, 8));
    knobs.rollouts += extra;
    knobs.remote_rollouts += extra;
  }
  // Drawn last (see above): applications that give up on calls.
  if (rng.chance(0.4)) knobs.cancel = static_cast<double>(rng.range(1, 4)) / 10;
  // Drawn last (see above): corrupted bytes, in flight and at the source.
  if (on(rng)) knobs.corrupt = pick(rng, kRareToCommon);
  if (on(rng)) knobs.tamper_per_s = pick(rng, kPerSecond);
  // Drawn last (see above): instructions that arrive again, late.
  if (on(rng)) knobs.stale = pick(rng, kRareToCommon);
  // Drawn last (see above): one seed in eight of those that draw their workload reads across
  // layouts, in the fleet its workload drew; then every replica's placement.
  if (workload == nullptr && rng.below(8) == 0) knobs.workload = Workload::kLayouts;
  if (knobs.workload == Workload::kLayouts) draw_placements(rng, knobs);
  // Drawn last (see above): readers that crawl, and drains with a deadline short enough to meet them.
  // (Rarely in the drawn block: CI's sim_throttle_* blocks set it; elsewhere it would change what
  // the existing seeds explore.)
  if (rng.chance(0.15)) knobs.throttle_fraction = static_cast<double>(rng.range(1, 3)) / 10;
  if (rng.chance(0.5)) knobs.drain_grace_ms = rng.range(1, 10) * 1000;
  // Drawn last (see above): models that end, and runs that restart from version 1 in their name.
  if (rng.chance(0.5)) knobs.model_grace_ms = rng.range(1, 5) * 1000;
  knobs.run_restart = rng.chance(0.25);
  // Drawn last (see above): versions of which a few percent of the bytes change, published with
  // patches. 34 %: many tensors' patches pass the publisher's 40 % and are left out.
  if (rng.chance(0.35)) {
    constexpr std::uint32_t kPercents[] = {3, 10, 34};
    knobs.patch_percent = kPercents[rng.below(3)];
  }
  return knobs;
}

namespace {

template <typename T>
bool parse_number(std::string_view text, T& value) {
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  return error == std::errc() && end == text.data() + text.size();
}

}  // namespace

std::string fault_keys() {
  return "none, drop, duplicate, stale (share of instructions that arrive again 0.5-8 s late), delay (mean ms), clog (per s), partition (per s), crash (per s), "
         "storm (0/1), rack (0/1: a crash takes the datacenter's serving replicas along), server-crash (0/1), "
         "read-failure, straggler (fraction), skew (ppm), cancel (share of a rollout's waiting calls), "
         "corrupt (share of reads with a bit flipped in flight), tamper (per s: a source's published buffers "
         "change under its readers), throttle (share of rollout hosts whose downloads crawl at 2 KB/s), "
         "run-restart (0/1: once, every replica of a model stops until the model ended, and its run starts "
         "again from version 1), patch (percent of bytes that change per version, published with patches; 0: all); and the hub options offload-seeding (0/1), drain-grace (ms) and model-grace (ms)";
}

Status apply_overrides(Knobs& knobs, std::string_view overrides) {
  std::string_view rest = overrides;
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    if (item == "none") {
      knobs.drop = knobs.duplicate = knobs.stale = knobs.clog_per_s = knobs.partition_per_s = 0;
      knobs.crash_per_s = knobs.read_failure = knobs.straggler_fraction = knobs.throttle_fraction = 0;
      knobs.preemption_storm = knobs.server_crash = knobs.rack_crashes = knobs.run_restart = false;
      knobs.clock_skew_ppm = 0;
      knobs.cancel = 0;
      knobs.corrupt = knobs.tamper_per_s = 0;
      knobs.delay_mean_ms = 1;
      continue;
    }
    const std::size_t equals = item.find('=');
    const std::string_view key = item.substr(0, equals);
    const std::string_view text = equals == std::string_view::npos ? "" : item.substr(equals + 1);
    auto bad = [&] {
      return make_error(Errc::kInvalidArgument, "bad fault override '" + std::string(item) +
                                                    "'; keys: " + fault_keys());
    };
    double number = 0;
    if (!parse_number(text, number) || number < 0) return bad();
    if (key == "drop" && number <= 1) {
      knobs.drop = number;
    } else if (key == "duplicate" && number <= 1) {
      knobs.duplicate = number;
    } else if (key == "stale" && number <= 1) {
      knobs.stale = number;
    } else if (key == "delay") {
      knobs.delay_mean_ms = static_cast<TimeMs>(number);
    } else if (key == "clog") {
      knobs.clog_per_s = number;
      if (knobs.clog_ms == 0) knobs.clog_ms = 1000;
    } else if (key == "partition") {
      knobs.partition_per_s = number;
      if (knobs.partition_ms == 0) knobs.partition_ms = 3000;
    } else if (key == "crash") {
      knobs.crash_per_s = number;
    } else if (key == "rack") {
      knobs.rack_crashes = number != 0;
    } else if (key == "storm") {
      knobs.preemption_storm = number != 0;
    } else if (key == "server-crash") {
      knobs.server_crash = number != 0;
    } else if (key == "read-failure" && number <= 1) {
      knobs.read_failure = number;
    } else if (key == "straggler" && number <= 1) {
      knobs.straggler_fraction = number;
    } else if (key == "throttle" && number <= 1) {
      knobs.throttle_fraction = number;
    } else if (key == "drain-grace" && number >= 1 && number <= static_cast<double>(limits::kDeadlineMsMax)) {
      knobs.drain_grace_ms = static_cast<TimeMs>(number);
    } else if (key == "model-grace" && number <= static_cast<double>(limits::kDeadlineMsMax)) {
      knobs.model_grace_ms = static_cast<TimeMs>(number);
    } else if (key == "patch" && number <= 100) {
      knobs.patch_percent = static_cast<std::uint32_t>(number);
    } else if (key == "run-restart") {
      knobs.run_restart = number != 0;
    } else if (key == "offload-seeding") {
      knobs.offload_seeding = number != 0;
    } else if (key == "cancel" && number <= 1) {
      knobs.cancel = number;
    } else if (key == "corrupt" && number <= 1) {
      knobs.corrupt = number;
    } else if (key == "tamper") {
      knobs.tamper_per_s = number;
    } else if (key == "skew") {
      knobs.clock_skew_ppm = static_cast<std::int64_t>(number);
    } else {
      return bad();
    }
  }
  return Unit{};
}

std::string profile_list() { return "drawn, harsh-net, harsh-crash, harsh-bytes, harsh"; }

Status apply_profile(Knobs& knobs, std::string_view profile) {
  constexpr std::string_view kNet = "partition=1,clog=1,delay=100,stale=0.05";
  constexpr std::string_view kCrash = "drop=0.05,crash=0.5,read-failure=0.1,server-crash=1";
  constexpr std::string_view kBytes = "corrupt=0.1,tamper=0.5";
  if (profile == "drawn") return Unit{};
  if (profile == "harsh-net") return apply_overrides(knobs, kNet);
  if (profile == "harsh-crash") return apply_overrides(knobs, kCrash);
  if (profile == "harsh-bytes") return apply_overrides(knobs, kBytes);
  if (profile == "harsh") {
    if (Status net = apply_overrides(knobs, kNet); !net.ok()) return net;
    if (Status bytes = apply_overrides(knobs, kBytes); !bytes.ok()) return bytes;
    return apply_overrides(knobs, kCrash);
  }
  return make_error(Errc::kInvalidArgument,
                    "unknown profile '" + std::string(profile) + "'; choose from " + profile_list());
}

std::string describe(const Knobs& knobs) {
  std::ostringstream out;
  out << "workload=" << workload_name(knobs.workload) << " models=" << knobs.models
      << " shards=" << knobs.shards << " trainers=" << knobs.trainers << " rollouts=" << knobs.rollouts
      << " spot=" << knobs.spot_rollouts << " remote=" << knobs.remote_rollouts
      << " remote-dcs=" << knobs.remote_datacenters << " off-by=" << knobs.off_by << " colocated=" << knobs.colocated
      << " pipeline=" << knobs.pipeline << " fanout=" << knobs.fanout
      << " smart-skipping=" << knobs.smart_skipping << " offload-seeding=" << knobs.offload_seeding
      << " heartbeat-timeout=" << knobs.heartbeat_timeout_ms
      << "ms drop=" << knobs.drop << " duplicate=" << knobs.duplicate << " stale=" << knobs.stale << " delay=" << knobs.delay_min_ms
      << "+" << knobs.delay_mean_ms << "ms clog=" << knobs.clog_per_s << "/s*" << knobs.clog_ms
      << "ms partition=" << knobs.partition_per_s << "/s*" << knobs.partition_ms
      << "ms crash=" << knobs.crash_per_s << "/s rack=" << knobs.rack_crashes << " storm=" << knobs.preemption_storm
      << " server-crash=" << knobs.server_crash << " read-failure=" << knobs.read_failure
      << " straggler=" << knobs.straggler_fraction << " cancel=" << knobs.cancel << " corrupt=" << knobs.corrupt
      << " tamper=" << knobs.tamper_per_s << "/s skew=" << knobs.clock_skew_ppm
      << "ppm shard=" << (knobs.shard_bytes >> 20) << "MiB throttle=" << knobs.throttle_fraction
      << " drain-grace=" << knobs.drain_grace_ms << "ms model-grace=" << knobs.model_grace_ms
      << "ms run-restart=" << knobs.run_restart << " patch=" << knobs.patch_percent << "%";
  if (knobs.trainer_placement) {
    out << " layouts=" << describe(*knobs.trainer_placement) << ":";
    for (std::size_t r = 0; r < knobs.rollout_placements.size(); ++r) {
      out << (r == 0 ? "" : ",") << describe(knobs.rollout_placements[r]);
    }
  }
  return out.str();
}

}  // namespace th::sim
