#include "tests/core/testkit/fleet.h"

#include <algorithm>
#include <utility>

namespace th::test {

namespace {

// Fleet tests use a short heartbeat timeout so that a few ticks evict a crashed replica.
constexpr TimeMs kHeartbeatTimeoutMs = 1000;
constexpr TimeMs kBarrierTimeoutMs = 2000;
constexpr std::size_t kProgramBacklogMax = 8;
constexpr int kHealRoundsMax = 400;

[[noreturn]] void fail(const std::string& what) { throw AssertionFailure("fleet: " + what); }

}  // namespace

ReadFailure read_failure_of(std::uint32_t choice) {
  static constexpr ReadFailure kReasons[] = {ReadFailure::kSourceUnreachable, ReadFailure::kSourceRefused,
                                             ReadFailure::kChecksumMismatch};
  return kReasons[choice % 3];
}

std::ostream& operator<<(std::ostream& out, const FleetSpec& spec) {
  out << "settings{pipeline=" << spec.settings.pipeline << " fanout=" << spec.settings.fanout_max
      << " smart_skipping=" << spec.settings.smart_skipping;
  // (Printed only where not the default, so that older counterexamples read the same.)
  if (spec.settings.drain_grace_ms != HubSettings{}.drain_grace_ms) out << " drain_grace=" << spec.settings.drain_grace_ms;
  if (spec.settings.model_grace_ms != HubSettings{}.model_grace_ms) out << " model_grace=" << spec.settings.model_grace_ms;
  out << "} faults=" << spec.faults << " closes=" << spec.closes;
  for (const auto& model : spec.models) {
    out << " model " << model.name << "/" << model.num_shards << (model.sliced ? " sliced" : "");
  }
  for (const auto& replica : spec.replicas) {
    out << " replica " << replica.name << "{" << spec.models[replica.model].name << " "
        << replica.datacenter << (replica.spot ? " spot" : "") << (replica.trainer ? " trainer" : "");
    if (replica.num_shards != 0) out << " shards-" << replica.num_shards;
    if (replica.retention.keep_latest) out << " keep-latest-" << *replica.retention.keep_latest;
    for (Version pinned : replica.retention.pinned) out << " pin-" << pinned;
    out << "}";
  }
  return out;
}

std::uint32_t shards_of(const FleetSpec& spec, std::uint32_t replica) {
  const FleetSpec::ReplicaSpec& replica_spec = spec.replicas[replica];
  return replica_spec.num_shards != 0 ? replica_spec.num_shards : spec.models[replica_spec.model].num_shards;
}

FleetSpec fleet_base(bool faults, bool closes) {
  FleetSpec spec;
  spec.faults = faults;
  spec.closes = closes;
  spec.settings.heartbeat_timeout_ms = kHeartbeatTimeoutMs;
  spec.settings.barrier_timeout_ms = kBarrierTimeoutMs;
  return spec;
}

FleetSpec only_spot_rollouts(FleetSpec spec) {
  for (FleetSpec::ReplicaSpec& replica : spec.replicas) {
    replica.spot = !replica.trainer;
    if (replica.trainer) replica.retention.keep_latest = 1;
  }
  return spec;
}

rc::Gen<FleetSpec> gen_fleet(bool faults, bool closes, bool layouts, int replicas_min) {
  TH_ASSERT(replicas_min >= 2 && replicas_min <= 6);
  return rc::gen::exec([faults, closes, layouts, replicas_min] {
    FleetSpec spec = fleet_base(faults, closes);
    spec.settings.pipeline = *rc::gen::weightedElement<bool>({{3, true}, {1, false}});
    spec.settings.fanout_max = spec.settings.pipeline
                                   ? *rc::gen::weightedElement<std::uint32_t>({{3, 1}, {1, 2}})
                                   : *rc::gen::inRange<std::uint32_t>(1, 4);
    spec.settings.smart_skipping = *rc::gen::arbitrary<bool>();
    // Drains with a deadline and models that end, within the few seconds a run lasts (the
    // defaults, 30 s and 60 s, are rarely reached): ticks are 100 ms multiples and reads end only
    // when the fleet says, so readers of a draining copy often outlast the grace.
    spec.settings.drain_grace_ms =
        *rc::gen::weightedElement<TimeMs>({{2, HubSettings{}.drain_grace_ms}, {1, 500}, {1, 1500}, {1, 3000}});
    spec.settings.model_grace_ms = *rc::gen::weightedElement<TimeMs>({{2, HubSettings{}.model_grace_ms}, {1, 0}, {1, 2000}});
    const int models = *rc::gen::inRange(1, 3);
    for (int m = 0; m < models; ++m) {
      // Now and then a model sliced like a tensor-parallel one, whose rollouts may have another
      // shard count than its trainer and read its copies across layouts (README "Layouts").
      const auto shards = *rc::gen::inRange<std::uint32_t>(1, 4);
      const bool sliced = layouts && *rc::gen::weightedElement<bool>({{2, false}, {1, true}});
      spec.models.push_back({"m" + std::to_string(m), shards, sliced});
    }
    const int replicas = *rc::gen::inRange(replicas_min, 7);
    for (int i = 0; i < replicas; ++i) {
      FleetSpec::ReplicaSpec replica;
      replica.model = static_cast<std::uint32_t>(i % models);
      replica.name = "r" + std::to_string(i);
      replica.trainer = i < models;
      // A third datacenter now and then: chains of sources that cross two of them (the
      // 'waiting chain' counts of select_source) need three.
      replica.datacenter = *rc::gen::weightedElement<std::string>({{4, "dc0"}, {4, "dc1"}, {1, "dc2"}});
      replica.spot = *rc::gen::weightedElement<bool>({{3, false}, {1, true}});
      if (*rc::gen::arbitrary<bool>()) {
        replica.retention.keep_latest = *rc::gen::inRange<std::uint64_t>(0, 3);
      }
      if (*rc::gen::weightedElement<bool>({{4, false}, {1, true}})) {
        replica.retention.pinned.push_back(*rc::gen::inRange<Version>(1, 4));
      }
      if (spec.models[replica.model].sliced && !replica.trainer) {
        replica.num_shards = *rc::gen::inRange<std::uint32_t>(1, 4);
      }
      spec.replicas.push_back(std::move(replica));
    }
    return spec;
  });
}

std::string_view action_name(Action::Kind kind) {
  static constexpr const char* kNames[] = {"plan",  "step", "step-all", "finish-read", "fail-read",
                                           "offload", "crash", "tick",  "diverge",   "failover",
                                           "burst", "crash-source", "cancel"};
  const auto index = static_cast<std::size_t>(kind);
  return index < std::size(kNames) ? kNames[index] : std::string_view{};
}

std::ostream& operator<<(std::ostream& out, const Action& action) {
  out << action_name(action.kind) << "(" << action.a << "," << action.b;
  if (action.kind == Action::Kind::kPlan) out << "=" << op_name(static_cast<OpKind>(action.b % 7));
  out << "," << action.c << "," << action.d << (action.go ? ",go" : "") << ")";
  return out;
}

rc::Gen<Action> gen_action(const FleetSpec& spec) {
  const std::size_t faults = spec.faults ? 1 : 0;
  const std::size_t closes = spec.closes ? 1 : 0;
  const auto replicas = static_cast<std::uint32_t>(spec.replicas.size());
  return rc::gen::exec([=, spec = spec] {
    Action action;
    action.kind = *rc::gen::weightedElement<Action::Kind>({
        {20, Action::Kind::kPlan},
        {12, Action::Kind::kStep},
        {14, Action::Kind::kStepAll},
        {16, Action::Kind::kFinishRead},
        {2 * faults, Action::Kind::kFailRead},
        {6, Action::Kind::kOffload},
        {2 * faults, Action::Kind::kCrash},
        {5, Action::Kind::kTick},
        {1 * closes, Action::Kind::kDiverge},
        {1 * faults, Action::Kind::kFailover},
        {4, Action::Kind::kBurst},
        {2 * faults, Action::Kind::kCrashSource},
        {3, Action::Kind::kCancel},
    });
    action.a = *rc::gen::inRange<std::uint32_t>(0, replicas);
    const std::uint32_t shards = shards_of(spec, action.a);
    switch (action.kind) {
      case Action::Kind::kPlan:
        // Ops: 0 publish, 1 unpublish, 2 replicate, 3 update, 4 list, 5 wait, 6 close.
        if (spec.replicas[action.a].trainer) {
          action.b = *rc::gen::weightedElement<std::uint32_t>(
              {{9, 0}, {7, 1}, {1, 2}, {1, 3}, {1, 4}, {2, 5}, {1 * closes, 6}});
        } else {
          action.b = *rc::gen::weightedElement<std::uint32_t>(
              {{1, 0}, {2, 1}, {5, 2}, {9, 3}, {1, 4}, {1, 5}, {1 * closes, 6}});
        }
        // Now and then a shard registers a layout the hub must refuse (program.h plan_op).
        if ((action.b == 0 || action.b == 2 || action.b == 3) &&
            *rc::gen::weightedElement<bool>({{15, false}, {1, true}})) {
          action.b += 7 * (1 + 2 * *rc::gen::inRange<std::uint32_t>(0, shards) + *rc::gen::inRange<std::uint32_t>(0, 2));
        }
        action.c = *rc::gen::weightedElement<std::uint32_t>({{2, 0}, {5, 1}, {1, 2}, {1, 3}});
        action.d = *rc::gen::inRange<std::uint32_t>(0, 4);
        action.go = *rc::gen::weightedElement<bool>({{3, true}, {1, false}});
        break;
      case Action::Kind::kStep:
      case Action::Kind::kDiverge:
      case Action::Kind::kCancel:
        action.b = *rc::gen::inRange<std::uint32_t>(0, shards);
        break;
      case Action::Kind::kFailRead:
        action.b = *rc::gen::inRange<std::uint32_t>(0, 3);
        [[fallthrough]];
      case Action::Kind::kFinishRead:
      case Action::Kind::kOffload:
        action.a = *rc::gen::inRange<std::uint32_t>(0, 8);
        break;
      case Action::Kind::kCrash:
        action.b = *rc::gen::inRange<std::uint32_t>(0, 2);
        break;
      case Action::Kind::kCrashSource:
        action.a = *rc::gen::inRange<std::uint32_t>(0, 4);
        break;
      case Action::Kind::kTick:
        action.a = *rc::gen::inRange<std::uint32_t>(1, 16);
        break;
      default:
        break;
    }
    return action;
  });
}

rc::Gen<std::shared_ptr<const rc::state::Command<FleetSpec, Fleet>>> gen_command(
    const FleetSpec& spec) {
  return rc::gen::map(gen_action(spec), [](Action action) {
    return std::shared_ptr<const rc::state::Command<FleetSpec, Fleet>>(
        std::make_shared<FleetCommand>(action));
  });
}

rc::Gen<Action> gen_chain_action(const FleetSpec& spec) {
  const auto replicas = static_cast<std::uint32_t>(spec.replicas.size());
  return rc::gen::exec([=] {
    Action action;
    action.kind = *rc::gen::weightedElement<Action::Kind>({
        {12, Action::Kind::kPlan},
        {12, Action::Kind::kFinishRead},
        {3, Action::Kind::kCrashSource},
        {2, Action::Kind::kStepAll},
        {1, Action::Kind::kTick},
    });
    switch (action.kind) {
      case Action::Kind::kPlan:
        // A rollout replicates latest (drops its copy first if it holds one); the trainer
        // unpublishes and publishes the next version.
        action.a = *rc::gen::weightedElement<std::uint32_t>({{1, 0}, {12, 1}});
        action.a = action.a == 0 ? 0 : *rc::gen::inRange<std::uint32_t>(1, replicas);
        action.b = action.a == 0 ? *rc::gen::element<std::uint32_t>(0, 1) : *rc::gen::element<std::uint32_t>(2, 1);
        action.c = action.a == 0 ? 1 : 0;  // publish: the next version; replicate: latest
        action.go = true;
        break;
      case Action::Kind::kCrashSource:
        action.b = 1;  // rollouts only: the chains' roots, not the trainer that holds every version
        [[fallthrough]];
      case Action::Kind::kFinishRead:
        action.a = *rc::gen::inRange<std::uint32_t>(0, 8);
        break;
      case Action::Kind::kStepAll:
        action.a = *rc::gen::inRange<std::uint32_t>(0, replicas);
        break;
      default:
        action.a = *rc::gen::inRange<std::uint32_t>(1, 8);
        break;
    }
    return action;
  });
}

rc::Gen<ChainCase> gen_uneven_case() {
  return rc::gen::exec([] {
    ChainCase uneven;
    FleetSpec& spec = uneven.spec;
    spec = fleet_base(/*faults=*/true, /*closes=*/false);
    spec.settings.pipeline = true;
    spec.settings.fanout_max = *rc::gen::inRange<std::uint32_t>(1, 3);
    spec.settings.smart_skipping = *rc::gen::arbitrary<bool>();
    spec.models.push_back({"m0", 2u, false});
    const auto rollouts = *rc::gen::inRange<std::uint32_t>(3, 6);
    for (std::uint32_t r = 0; r <= rollouts; ++r) {
      FleetSpec::ReplicaSpec replica;
      replica.name = "r" + std::to_string(r);
      replica.datacenter = "dc0";
      replica.trainer = r == 0;
      if (replica.trainer) replica.retention.keep_latest = 1;
      spec.replicas.push_back(std::move(replica));
    }
    std::vector<Action>& program = uneven.program;
    const int versions = *rc::gen::inRange(2, 6);
    for (int v = 0; v < versions; ++v) {
      if (v > 0) program.push_back(Action{Action::Kind::kPlan, 0, 1, 0, 0, true});  // unpublish
      program.push_back(Action{Action::Kind::kPlan, 0, 0, 1, 0, true});               // the next version
      program.push_back(Action{Action::Kind::kBurst, 0, 0, 0, 0, false});             // every rollout updates
      // Half the time, in the last version (the rates known, and the versions before left to
      // reorder undisturbed), readers fail their sources as the burst reorders the chains: a copy
      // that its reader failed, looking for a source again after failing its own, must not be put
      // ahead of a slower copy (which would then read from it).
      if (v == versions - 1 && *rc::gen::arbitrary<bool>()) {
        for (int failure = 0; failure < 2; ++failure) {
          program.push_back(Action{Action::Kind::kFailRead, *rc::gen::inRange<std::uint32_t>(0, 4),
                                   *rc::gen::inRange<std::uint32_t>(0, 3), 0, 0, false});
        }
      }
      // The shards' reads finish one by one, some after a while: uneven rates.
      const int finishes = *rc::gen::inRange(4, 14);
      for (int f = 0; f < finishes; ++f) {
        if (*rc::gen::weightedElement<bool>({{1, true}, {2, false}})) {
          program.push_back(Action{Action::Kind::kTick, *rc::gen::inRange<std::uint32_t>(1, 6), 0, 0, 0, false});
        }
        program.push_back(Action{Action::Kind::kFinishRead, *rc::gen::inRange<std::uint32_t>(0, 4), 0, 0, 0, false});
      }
    }
    const auto tail = *rc::gen::container<std::vector<Action>>(*rc::gen::inRange(0, 8), gen_chain_action(spec));
    program.insert(program.end(), tail.begin(), tail.end());
    return uneven;
  });
}

rc::Gen<ChainCase> gen_chain_case() {
  return rc::gen::exec([] {
    ChainCase chain_case;
    FleetSpec& spec = chain_case.spec;
    spec = fleet_base(/*faults=*/true, /*closes=*/false);
    spec.settings.pipeline = true;
    spec.settings.fanout_max = 1;
    spec.settings.smart_skipping = true;
    // Half the cases slice the model (a two-shard trainer), and each chain holds a layout of its
    // own: a root then counts the other layout's chains as sources soon (it reads them once
    // complete), and must not count one that ends in a root still waiting itself. (Chains of one
    // layout cannot show that: a root reads the end of another's chain at once, as its cross-
    // datacenter reader does not take the end's one local slot.)
    const bool sliced = *rc::gen::arbitrary<bool>();
    spec.models.push_back({"m0", sliced ? 2u : 1u, sliced});
    auto add = [&](const std::string& datacenter, bool trainer, std::uint32_t shards = 0) {
      FleetSpec::ReplicaSpec replica;
      replica.name = "r" + std::to_string(spec.replicas.size());
      replica.datacenter = datacenter;
      replica.trainer = trainer;
      replica.num_shards = shards;  // 0: the model's
      if (trainer) replica.retention.keep_latest = 1;  // its unpublish offloads
      spec.replicas.push_back(std::move(replica));
      return static_cast<std::uint32_t>(spec.replicas.size() - 1);
    };
    auto any_layout = [&] { return sliced ? *rc::gen::inRange<std::uint32_t>(1, kSlicedShardsMax) : 0u; };
    std::vector<std::string> remote = {"dc1", "dc2", "dc3"};
    const std::string trainer_dc = remote[*rc::gen::inRange<std::size_t>(0, 3)];
    add(trainer_dc, true);
    // The datacenters of the chains' tails: each a datacenter of its own, apart from the trainer's,
    // as far as there are; else any.
    std::erase(remote, trainer_dc);
    if (*rc::gen::arbitrary<bool>()) std::swap(remote[0], remote[1]);
    const int chains = *rc::gen::weightedElement<int>({{1, 1}, {3, 2}, {2, 3}});
    // Each chain's shard count (sliced: 1 to 3, the first two chains' different).
    std::vector<std::uint32_t> layouts;
    for (int c = 0; c < chains; ++c) {
      std::uint32_t shards = any_layout();
      if (sliced && c == 1) shards = 1 + (layouts[0] - 1 + *rc::gen::inRange<std::uint32_t>(1, 3)) % 3;
      layouts.push_back(shards);
    }
    std::vector<std::uint32_t> sources;
    for (int c = 0; c < chains; ++c) sources.push_back(add("dc0", false, layouts[c]));
    // Someone near the trainer reads it first, so that the tails read the chains' ends.
    const bool occupied = *rc::gen::weightedElement<bool>({{3, true}, {1, false}});
    const std::uint32_t occupier = occupied ? add(trainer_dc, false, any_layout()) : 0;
    std::vector<std::vector<std::uint32_t>> levels;  // readers by depth, one per chain and depth
    const int depth = *rc::gen::inRange(1, 4);
    for (int d = 0; d < depth; ++d) {
      levels.emplace_back();
      for (int c = 0; c < chains; ++c) levels.back().push_back(add("dc0", false, layouts[c]));
    }
    std::vector<std::uint32_t> tails;
    for (int c = 0; c < chains; ++c) {
      tails.push_back(add(c < 2 && *rc::gen::weightedElement<bool>({{4, true}, {1, false}})
                              ? remote[static_cast<std::size_t>(c)]
                              : *rc::gen::element<std::string>("dc1", "dc2", "dc3"),
                          false, layouts[c]));
    }
    const int extra = *rc::gen::inRange(0, 3);
    for (int e = 0; e < extra; ++e) {
      add(*rc::gen::element<std::string>("dc0", "dc1", "dc2", "dc3"), false, any_layout());
    }

    std::vector<Action>& program = chain_case.program;
    auto replicate = [&](std::uint32_t replica) {
      program.push_back(Action{Action::Kind::kPlan, replica, 2, 0, 0, true});
    };
    program.push_back(Action{Action::Kind::kPlan, 0, 0, 1, 0, true});  // the trainer publishes
    for (std::uint32_t source : sources) {
      replicate(source);
      for (std::uint32_t shard = 0; shard < shards_of(spec, source); ++shard) {
        program.push_back(Action{Action::Kind::kFinishRead, 0, 0, 0, 0, false});  // the only ones
      }
    }
    for (const auto& level : levels) {
      for (std::uint32_t reader : level) replicate(reader);
    }
    // After the chains, so that the tails (which take the least loaded, oldest copy) read their
    // ends rather than the copy it makes.
    if (occupied) replicate(occupier);
    for (std::uint32_t tail : tails) replicate(tail);
    // Sources die: mostly the chains' roots' (the first serving rollouts), in any order.
    const int deaths = *rc::gen::inRange(0, chains + 2);
    for (int d = 0; d < deaths; ++d) {
      const std::uint32_t which = *rc::gen::weightedElement<std::uint32_t>({{3, 0}, {2, 1}, {1, 2}, {1, 3}, {1, 4}});
      program.push_back(Action{Action::Kind::kCrashSource, which, 1, 0, 0, false});
    }
    const int more = *rc::gen::inRange(0, 20);
    for (int i = 0; i < more; ++i) program.push_back(*gen_chain_action(spec));
    return chain_case;
  });
}


Fleet::Fleet(const FleetSpec& spec) : spec_(spec), driver_(spec.settings), reference_(spec.settings) {
  driver_.set_watcher(&reference_);
  init();
}

void Fleet::init() {
  runs_.resize(spec_.replicas.size());
  for (std::size_t i = 0; i < runs_.size(); ++i) {
    runs_[i].shards.resize(shards_of(spec_, static_cast<std::uint32_t>(i)));
  }
}

void Fleet::apply(const Action& action) {
  switch (action.kind) {
    case Action::Kind::kPlan:
      plan(action.a, action.b, action.c, action.d);
      if (action.go) apply(Action{Action::Kind::kStepAll, action.a, 0, 0, 0, false});
      break;
    case Action::Kind::kStep:
      step(action.a, action.b);
      break;
    case Action::Kind::kStepAll:
      for (std::uint32_t shard = 0; shard < runs_[action.a].shards.size(); ++shard) {
        step(action.a, shard);
        pump();
      }
      break;
    case Action::Kind::kFinishRead:
    case Action::Kind::kFailRead: {
      auto reads = outstanding_reads();
      std::erase_if(reads, [&](const auto& entry) {
        // A crashed source serves nothing, and one still receiving not all: such reads can only
        // fail, or wait.
        return action.kind == Action::Kind::kFinishRead && !can_finish(entry.second);
      });
      if (reads.empty()) break;
      const auto [client, read] = reads[action.a % reads.size()];
      driver_.inbox(client).reads.erase(read.transfer);
      const auto [replica, shard] = owners_.at(client);
      coverage_.pipelined_reads += read.source.partial;
      coverage_.cross_dc_reads += read.source.datacenter != spec_.replicas[replica].datacenter;
      if (action.kind == Action::Kind::kFinishRead) {
        ++coverage_.reads_done;
        runs_[replica].shards[shard].bytes = read.version;
        // A read across layouts reports the checksums of what it assembled.
        const bool across = !read.reshard.empty();
        coverage_.reshard_reads += across;
        driver_.report(client, TransferDone{read.transfer, read.epoch,
                                            across ? checksums_of(replica, read.version, shard) : nullptr});
      } else {
        ++coverage_.reads_failed;
        const ReadFailure reason = read_failure_of(action.b);
        coverage_.checksum_failures += reason == ReadFailure::kChecksumMismatch;
        driver_.report(client, TransferFailed{read.transfer, read.epoch, reason});
      }
      break;
    }
    case Action::Kind::kOffload: {
      const auto offloads = outstanding_offloads();
      if (offloads.empty()) break;
      const auto [client, version] = offloads[action.a % offloads.size()];
      auto& pending = driver_.inbox(client).offloads;
      pending.erase(std::find(pending.begin(), pending.end(), version));
      const auto [replica, shard] = owners_.at(client);
      runs_[replica].shards[shard].offloads[version] =
          HeldCopy{version, layout_of(replica, shard), checksums_of(replica, version, shard)};
      ++coverage_.offloads;
      driver_.report(client, OffloadDone{version, driver_.inbox(client).offload_copies.at(version)});
      break;
    }
    case Action::Kind::kCrash: {
      ReplicaRun& run = runs_[action.a];
      if (run.crashed) break;
      run.crashed = true;
      if (action.b == 1 && run.shards[0].client != 0) driver_.lose_connection(run.shards[0].client);
      break;
    }
    case Action::Kind::kTick:
      driver_.advance(static_cast<TimeMs>(action.a) * 100, silent_clients());
      break;
    case Action::Kind::kDiverge:
      step(action.a, action.b, /*diverge=*/true);
      break;
    case Action::Kind::kFailover:
      failover();
      break;
    case Action::Kind::kBurst:
      for (std::uint32_t replica = 0; replica < runs_.size(); ++replica) {
        if (spec_.replicas[replica].trainer) continue;
        plan(replica, action.a % 2 == 0 ? 3 : 2, /*latest*/ 0, 0);
        for (std::uint32_t shard = 0; shard < runs_[replica].shards.size(); ++shard) {
          step(replica, shard);
          pump();
        }
      }
      break;
    case Action::Kind::kCancel: {
      const ShardRun& shard = runs_[action.a].shards[action.b];
      if (runs_[action.a].crashed || shard.client == 0 || !shard.pending_seq) break;
      ++coverage_.cancels;
      driver_.report(shard.client, CancelCall{*shard.pending_seq});
      break;
    }
    case Action::Kind::kCrashSource: {
      std::vector<std::uint32_t> sources;
      for (std::uint32_t replica = 0; replica < runs_.size(); ++replica) {
        const ReplicaRun& run = runs_[replica];
        if (run.crashed || run.shards[0].client == 0) continue;
        if (action.b == 1 && spec_.replicas[replica].trainer) continue;
        if (!driver_.inbox(run.shards[0].client).grants.empty()) sources.push_back(replica);
      }
      if (sources.empty()) break;
      Action crash;
      crash.kind = Action::Kind::kCrash;
      crash.a = sources[action.a % sources.size()];
      crash.b = 1;
      apply(crash);
      break;
    }
  }
  pump();
}

void Fleet::plan(std::uint32_t replica, std::uint32_t op, std::uint32_t p1, std::uint32_t p2) {
  ReplicaRun& run = runs_[replica];
  std::size_t slowest = run.program.size();
  for (const ShardRun& shard : run.shards) slowest = std::min(slowest, shard.next_op);
  if (run.program.size() - slowest >= kProgramBacklogMax) return;
  const std::string& model = spec_.models[spec_.replicas[replica].model].name;
  const Version latest = driver_.hub().latest(model).value_or(0);
  PlannedOp planned = plan_op(op, p1, p2, latest);
  run.program.push_back(planned);
}

OpenRequest Fleet::open_request(std::uint32_t replica, std::uint32_t shard) const {
  const FleetSpec::ReplicaSpec& spec = spec_.replicas[replica];
  OpenRequest request;
  request.model = spec_.models[spec.model].name;
  request.replica = spec.name;
  request.incarnation = runs_[replica].incarnation;
  request.shard = shard;
  request.num_shards = static_cast<std::uint32_t>(runs_[replica].shards.size());
  request.datacenter = spec.datacenter;
  request.spot = spec.spot;
  request.role = spec.trainer ? "trainer" : "rollout";
  request.retention = spec.retention;
  request.data_endpoint = "tcp://" + spec.name + "/" + std::to_string(shard);
  if (const auto& resume = runs_[replica].shards[shard].resume) {
    request.resume = std::make_shared<const Resume>(*resume);
  }
  return request;
}

void Fleet::open_shard(std::uint32_t replica, std::uint32_t shard) {
  ShardRun& run = runs_[replica].shards[shard];
  run.client = driver_.new_client();
  run.opened = false;
  run.open_seq = run.last_seq;
  owners_[run.client] = {replica, shard};
  driver_.open(run.client, open_request(replica, shard), run.open_seq);
}

void Fleet::restart(std::uint32_t replica) {
  ReplicaRun& run = runs_[replica];
  ++run.incarnation;
  run.crashed = false;
  run.program.clear();
  for (ShardRun& shard : run.shards) shard = ShardRun{};
}

void Fleet::step(std::uint32_t replica, std::uint32_t shard_index, bool diverge) {
  ReplicaRun& run = runs_[replica];
  if (run.crashed) restart(replica);  // the replica's process comes back
  ShardRun& shard = run.shards[shard_index];
  if (shard.client == 0) {
    open_shard(replica, shard_index);
    return;
  }
  if (!shard.opened || shard.pending_seq) return;
  if (shard.next_op >= run.program.size()) return;
  if (diverge) {
    if (run.program[shard.next_op].kind == OpKind::kList) return;
    shard.pending_diverged = true;
    shard.pending_seq = driver_.call(shard.client, ListRequest{});
    return;
  }
  shard.wrote_buffers = false;
  shard.pending_seq = driver_.call(shard.client, body_for(run.program[shard.next_op], shard_index, sliced_shards(replica)));
}

void Fleet::pump() {
  std::set<std::uint32_t> evicted;
  for (std::uint32_t replica = 0; replica < runs_.size(); ++replica) {
    ReplicaRun& run = runs_[replica];
    if (run.crashed) continue;
    for (std::uint32_t index = 0; index < run.shards.size(); ++index) {
      ShardRun& shard = run.shards[index];
      if (shard.client == 0) continue;
      Inbox& box = driver_.inbox(shard.client);
      if (!box.evictions.empty()) evicted.insert(replica);
      if (shard.pending_seq && !box.reads.empty()) shard.wrote_buffers = true;
      for (const auto& [transfer, read] : box.reads) {
        if (shard.bytes != read.version) shard.bytes.reset();  // rewritten from now on
      }
      for (Version version : box.releases) shard.offloads.erase(version);
      box.releases.clear();
      while (auto reply = driver_.take_reply(shard.client)) {
        on_reply(replica, index, *reply);
        if (shard.client == 0) break;
      }
    }
  }
  for (std::uint32_t replica : evicted) restart(replica);
  coverage_.evictions += evicted.size();
  // A replica whose shards all closed leaves; it may come back as a new incarnation.
  for (std::uint32_t replica = 0; replica < runs_.size(); ++replica) {
    ReplicaRun& run = runs_[replica];
    const bool all_closed = std::all_of(run.shards.begin(), run.shards.end(),
                                        [](const ShardRun& shard) { return shard.closed; });
    if (all_closed) restart(replica);
  }
}

void Fleet::on_reply(std::uint32_t replica, std::uint32_t index, const Reply& reply) {
  ReplicaRun& run = runs_[replica];
  ShardRun& shard = run.shards[index];
  if (!shard.opened) {
    if (reply.seq != shard.open_seq) return;
    if (std::holds_alternative<OpenOk>(reply.outcome)) {
      shard.opened = true;
      shard.resume.reset();
    } else {
      restart(replica);  // a failed (re-)open: start over as a new incarnation
    }
    return;
  }
  if (!shard.pending_seq || reply.seq != *shard.pending_seq) return;
  shard.pending_seq.reset();
  const bool diverged = std::exchange(shard.pending_diverged, false);
  TxnRecord record;
  record.seq = reply.seq;
  record.outcome = reply.outcome;
  if (!diverged) {
    const PlannedOp& op = run.program[shard.next_op];
    record.op.kind = op.kind;
    if (op.kind == OpKind::kPublish) record.op.version = op.version;
    if (op.kind == OpKind::kReplicate || op.kind == OpKind::kUpdate) record.op.selector = op.selector;
    if (op.kind == OpKind::kWait) record.op.predicate = op.predicate;
  }
  if (const auto* error = std::get_if<Error>(&reply.outcome)) {
    switch (error->code) {
      case Errc::kReplicaClosed:
        // The call is answered (a resume after a failover says so, as the agent's does); the shard
        // makes its planned call again as the next one, so that the close completes.
        shard.last_seq = reply.seq;
        shard.last_txn = record;
        return;
      case Errc::kReplicaEvicted:
      case Errc::kDivergentCall:
      case Errc::kUnknownClient:
        return;  // the eviction notice restarts the replica
      default:
        break;
    }
  }
  const std::string& model = spec_.models[spec_.replicas[replica].model].name;
  const bool spot = spec_.replicas[replica].spot;
  auto hold = [&](Version version) {
    shard.held = HeldCopy{version, layout_of(replica, index), checksums_of(replica, version, index)};
    if (!spot) completed_[model].insert(version);
  };
  std::visit(
      [&](const auto& outcome) {
        using T = std::decay_t<decltype(outcome)>;
        if constexpr (std::is_same_v<T, Error>) {
          coverage_.unavailable += outcome.code == Errc::kVersionUnavailable;
          if (shard.wrote_buffers) shard.held.reset();
        } else if constexpr (std::is_same_v<T, PublishOk>) {
          hold(outcome.version);
          shard.bytes = outcome.version;  // written before it published
        } else if constexpr (std::is_same_v<T, ReplicateOk>) {
          hold(outcome.version);
        } else if constexpr (std::is_same_v<T, UpdateOk>) {
          if (outcome.status == UpdateStatus::kUpdated) hold(*outcome.version);
        } else if constexpr (std::is_same_v<T, UnpublishOk>) {
          shard.held.reset();
        } else if constexpr (std::is_same_v<T, CloseOk>) {
          shard.held.reset();
          shard.offloads.clear();
          shard.closed = true;
        }
      },
      reply.outcome);
  shard.last_seq = reply.seq;
  driver_.inbox(shard.client).reads.clear();
  if (diverged) return;
  shard.last_txn = record;
  ++shard.next_op;
}

std::vector<std::pair<ClientId, StartRead>> Fleet::outstanding_reads() {
  std::vector<std::pair<ClientId, StartRead>> reads;
  for (const ReplicaRun& run : runs_) {
    if (run.crashed) continue;
    for (const ShardRun& shard : run.shards) {
      if (shard.client == 0) continue;
      for (const auto& [transfer, read] : driver_.inbox(shard.client).reads) {
        reads.emplace_back(shard.client, read);
      }
    }
  }
  return reads;
}

std::vector<std::pair<ClientId, Version>> Fleet::outstanding_offloads() {
  std::vector<std::pair<ClientId, Version>> offloads;
  for (const ReplicaRun& run : runs_) {
    if (run.crashed) continue;
    for (const ShardRun& shard : run.shards) {
      if (shard.client == 0) continue;
      for (Version version : driver_.inbox(shard.client).offloads) {
        offloads.emplace_back(shard.client, version);
      }
    }
  }
  return offloads;
}

std::set<ClientId> Fleet::silent_clients() const {
  std::set<ClientId> live;
  for (const ReplicaRun& run : runs_) {
    if (run.crashed) continue;
    for (const ShardRun& shard : run.shards) {
      if (shard.client != 0) live.insert(shard.client);
    }
  }
  std::set<ClientId> silent;
  for (const auto& [client, owner] : owners_) {
    if (!live.contains(client)) silent.insert(client);
  }
  return silent;
}

bool Fleet::can_finish(const StartRead& read) const {
  for (std::size_t i = 0; i < runs_.size(); ++i) {
    if (spec_.replicas[i].name != read.source.replica) continue;
    if (runs_[i].crashed || runs_[i].incarnation != read.source.incarnation) return false;
    if (read.source.kind == CopyKind::kOffload) return true;
    if (read.reshard.empty()) {
      return read.shard < runs_[i].shards.size() && runs_[i].shards[read.shard].bytes == read.version;
    }
    // Another layout: the reader takes pieces from every shard of the source, each of which must
    // hold the version whole and serve this transfer (a source shard without the grant refuses).
    const std::vector<ShardRun>& source = runs_[i].shards;
    if (read.reshard.size() != source.size()) return false;
    return std::all_of(source.begin(), source.end(), [&](const ShardRun& shard) {
      return shard.client != 0 && shard.bytes == read.version &&
             driver_.inbox_of(shard.client).grants.contains({read.transfer, read.epoch});
    });
  }
  return false;
}

std::uint32_t Fleet::sliced_shards(std::uint32_t replica) const {
  return spec_.models[spec_.replicas[replica].model].sliced ? shards_of(spec_, replica) : 0;
}

LayoutRef Fleet::layout_of(std::uint32_t replica, std::uint32_t shard) const {
  const std::uint32_t sliced = sliced_shards(replica);
  return sliced == 0 ? layout_for(shard) : sliced_layout_for(shard, sliced);
}

ChecksumsRef Fleet::checksums_of(std::uint32_t replica, Version version, std::uint32_t shard) const {
  const std::uint32_t sliced = sliced_shards(replica);
  return sliced == 0 ? checksums_for(version, shard) : sliced_checksums_for(version, shard, sliced);
}

void Fleet::failover() {
  ++coverage_.failovers;
  driver_.restart_server();
  for (std::uint32_t replica = 0; replica < runs_.size(); ++replica) {
    ReplicaRun& run = runs_[replica];
    if (run.crashed) continue;
    const bool any_open = std::any_of(run.shards.begin(), run.shards.end(),
                                      [](const ShardRun& shard) { return shard.opened; });
    if (!any_open) {
      for (ShardRun& shard : run.shards) shard = ShardRun{};
      continue;
    }
    for (std::uint32_t index = 0; index < run.shards.size(); ++index) {
      ShardRun& shard = run.shards[index];
      // A call in flight that may write the buffers (replicate, update) leaves them dirty: the
      // shard announces nothing and will call again.
      const bool may_write =
          shard.pending_seq && shard.next_op < run.program.size() &&
          (run.program[shard.next_op].kind == OpKind::kReplicate ||
           run.program[shard.next_op].kind == OpKind::kUpdate);
      if (may_write) shard.held.reset();
      Resume resume;
      resume.primary = shard.held;
      for (const auto& [version, held] : shard.offloads) resume.offloads.push_back(held);
      resume.last_txn = shard.last_txn;
      shard.resume = resume;
      shard.pending_seq.reset();
      shard.pending_diverged = false;
      shard.wrote_buffers = false;
      open_shard(replica, index);
    }
  }
}

void Fleet::open_all() {
  for (std::uint32_t replica = 0; replica < runs_.size(); ++replica) {
    for (std::uint32_t shard = 0; shard < runs_[replica].shards.size(); ++shard) {
      if (runs_[replica].shards[shard].client == 0) open_shard(replica, shard);
    }
  }
  pump();
}

void Fleet::heal_and_check_liveness() {
  // Runs until nothing has moved for longer than any call's timeout plus a few heartbeat
  // timeouts (so that crashed replicas are evicted and every deadline passes).
  constexpr int kQuietRoundsMin = (kCallTimeoutMaxMs + 3 * kHeartbeatTimeoutMs) / 300 + 1;
  int quiet_rounds = 0;
  for (int round = 0; round < kHealRoundsMax; ++round) {
    bool progress = false;
    for (std::uint32_t replica = 0; replica < runs_.size(); ++replica) {
      if (runs_[replica].crashed) continue;
      for (std::uint32_t shard = 0; shard < runs_[replica].shards.size(); ++shard) {
        const ShardRun before = runs_[replica].shards[shard];
        step(replica, shard);
        pump();
        const ShardRun& after = runs_[replica].shards[shard];
        progress = progress || before.client != after.client || before.pending_seq != after.pending_seq ||
                   before.opened != after.opened || before.next_op != after.next_op;
      }
    }
    for (auto reads = outstanding_reads(); !reads.empty(); reads = outstanding_reads()) {
      std::erase_if(reads, [&](const auto& entry) { return !can_finish(entry.second); });
      if (reads.empty()) break;
      apply(Action{Action::Kind::kFinishRead, 0, 0, 0, 0, false});
      progress = true;
    }
    while (!outstanding_offloads().empty()) {
      apply(Action{Action::Kind::kOffload, 0, 0, 0, 0, false});
      progress = true;
    }
    apply(Action{Action::Kind::kTick, 3, 0, 0, 0, false});
    quiet_rounds = progress ? 0 : quiet_rounds + 1;
    if (quiet_rounds > kQuietRoundsMin) break;
  }
  reference_.check_quiescent();
  const HubActivity activity = driver_.hub().activity();
  if (activity.transfers_active != 0 || activity.transfers_waiting != 0 ||
      activity.copies_draining != 0 || activity.copies_offloading != 0) {
    fail("liveness: after healing, " + std::to_string(activity.transfers_active) +
         " transfers are active, " + std::to_string(activity.transfers_waiting) + " wait for a source, " +
         std::to_string(activity.copies_draining) + " copies drain and " +
         std::to_string(activity.copies_offloading) + " offloads are unfinished");
  }
}

void Fleet::check_retained_versions_readable() {
  for (std::uint32_t m = 0; m < spec_.models.size(); ++m) {
    const std::string& model = spec_.models[m].name;
    for (Version version : completed_[model]) {
      if (!driver_.hub().retained(model, version)) continue;
      ReplicaSpec probe;
      probe.model = model;
      probe.name = "probe-" + std::to_string(version);
      probe.num_shards = spec_.models[m].num_shards;
      probe.datacenter = "dc0";
      const auto shards = driver_.open_replica(probe);
      const bool sliced = spec_.models[m].sliced;
      for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
        const LayoutRef layout = sliced ? sliced_layout_for(shard, probe.num_shards) : layout_for(shard);
        driver_.call(shards[shard], ReplicateRequest{Selector::absolute(version), layout, 0});
      }
      std::optional<Outcome> outcome;
      for (int round = 0; round < kHealRoundsMax && !outcome; ++round) {
        driver_.finish_reads(shards, sliced);
        apply(Action{Action::Kind::kFinishRead, 0, 0, 0, 0, false});
        apply(Action{Action::Kind::kOffload, 0, 0, 0, 0, false});
        if (driver_.has_reply(shards[0])) outcome = driver_.replies(shards);
      }
      if (!is<ReplicateOk>(outcome)) {
        fail("retention: retained version " + std::to_string(version) + " of " + model +
             " cannot be read: " + (outcome ? describe(*outcome) : "no answer"));
      }
      driver_.call_all(shards, CloseRequest{});
      for (int round = 0; round < kHealRoundsMax && !driver_.has_reply(shards[0]); ++round) {
        apply(Action{Action::Kind::kFinishRead, 0, 0, 0, 0, false});
      }
      (void)driver_.replies(shards);
    }
  }
}

}  // namespace th::test
