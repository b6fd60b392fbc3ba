// Model-based property tests of the hub and the shard agent (RapidCheck, rc::state).
//
// Random fleets of SPMD replicas (trainers and rollouts, spot or not, in two datacenters, with
// latest-k and pinned retention rules) run random programs of every operation and argument shape,
// while reads complete or fail, offloads are made, replicas crash, time passes and the server
// fails over. Checked after every step:
//   - every answer of the hub against an independent reference model of its observable semantics
//     (testkit/reference.h): resolution of selectors, update's decisions, the source named, when
//     publish, wait, timeouts and evictions are due, what list shows;
//   - DESIGN.md §5 from the outside (sim/observer.h) and the hub's own invariants;
//   - at the end, with faults healed: nothing the hub owes is left unanswered.
// The HubModel properties drive the hub directly (testkit/fleet.h): exact control of every
// interleaving. The AgentModel properties put a real ShardAgent behind every shard, over a network
// that loses, duplicates and reorders messages (testkit/cluster.h), and check what the
// applications see: one answer per call for all shards, bytes that are the version they were told.
//
// Each property prints how often cases exercised what it is there for, and fails if reads,
// pipelined reads, offloads or failovers (where they can happen) were in fewer than 10% of cases.
// CI runs each with RC_PARAMS="max_success=1000" (tests/core/CMakeLists.txt).
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/state.h>

#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "tests/core/testkit/cluster.h"
#include "tests/core/testkit/fleet.h"

namespace th::test {
namespace {

// What share of cases exercised each label.
class Coverage {
 public:
  void add(const std::vector<std::pair<std::string, bool>>& labels) {
    ++cases_;
    for (const auto& [label, seen] : labels) {
      RC_CLASSIFY(seen, label);
      counts_[label] += seen ? 1 : 0;
    }
  }
  // Prints the table; every label in `required` must be in at least `share_min` of the cases.
  void check(const std::string& property, const std::vector<std::string>& required,
             double share_min) const {
    std::cout << "coverage of " << property << " (" << cases_ << " cases):\n";
    for (const auto& [label, count] : counts_) {
      std::cout << "  " << label << ": "
                << (cases_ == 0 ? 0.0 : 100.0 * static_cast<double>(count) / static_cast<double>(cases_))
                << "%\n";
    }
    for (const std::string& label : required) {
      const auto found = counts_.find(label);
      const double share = found == counts_.end() || cases_ == 0
                               ? 0.0
                               : static_cast<double>(found->second) / static_cast<double>(cases_);
      EXPECT_GE(share, share_min) << property << ": too few cases with " << label;
    }
  }

 private:
  std::size_t cases_ = 0;
  std::map<std::string, std::size_t> counts_;
};

void tally(Coverage& coverage, const Fleet& fleet) {
  const Fleet::Coverage& seen = fleet.coverage();
  const Reference::Seen& judged = fleet.reference().seen();
  coverage.add({{"reads", seen.reads_done > 0},
                {"pipelined reads", seen.pipelined_reads > 0},
                {"cross-datacenter reads", seen.cross_dc_reads > 0},
                {"failed reads", seen.reads_failed > 0},
                {"checksum failures", seen.checksum_failures > 0},
                {"reads across layouts", seen.reshard_reads > 0},
                {"offloads", seen.offloads > 0},
                {"evictions", seen.evictions > 0},
                {"failovers", seen.failovers > 0},
                {"version unavailable", seen.unavailable > 0},
                {"selectors resolved", judged.resolutions > 0},
                {"skipped versions", judged.skipped_versions > 0},
                {"not yet (smart skipping)", judged.not_yet > 0},
                {"waits answered", judged.waits_answered > 0},
                {"timeouts", judged.timeouts > 0},
                {"calls cancelled", judged.cancels > 0},
                {"reads revoked at a drain grace", judged.revokes > 0},
                {"copies found corrupt (owner told)", judged.corrupt_notices > 0},
                {"models ended", judged.lives_ended > 0},
                // Rate-aware selection (the hub since its last restart): a reader took a slower
                // copy's source, which read again behind it.
                {"readers put ahead", fleet.driver().hub().stats().transfers_displaced > 0}});
}

void tally(Coverage& coverage, const Cluster& cluster) {
  const Cluster::Coverage& seen = cluster.coverage();
  const Reference::Seen& judged = cluster.reference().seen();
  coverage.add({{"reads", seen.reads_done > 0},
                {"pipelined reads", seen.pipelined_reads > 0},
                {"failed reads", seen.reads_failed > 0},
                {"checksum failures", seen.checksum_failures > 0},
                {"offloads", seen.offloads > 0},
                {"failovers", seen.failovers > 0},
                {"evictions", seen.evictions > 0},
                {"lost messages", seen.lost > 0},
                {"duplicated messages", seen.duplicated > 0},
                {"late copies of old messages", seen.replayed > 0},
                {"reordered messages", seen.reordered > 0},
                {"selectors resolved", judged.resolutions > 0},
                {"waits answered", judged.waits_answered > 0},
                {"copies found corrupt (owner told)", seen.corrupt_notices > 0 && judged.corrupt_notices > 0},
                {"calls cancelled", seen.cancels > 0 && judged.cancels > 0}});
}

// Programs long enough for reads to chain, versions to pile up and retention to matter: RapidCheck
// sizes a sequence by the case's size (0..100), which alone leaves most cases a few steps long.
constexpr double kCommandsScale = 10.0;

template <typename Sut, typename GenFunc>
void run_commands(const FleetSpec& spec, Sut& sut, GenFunc&& gen_func) {
  const auto commands =
      *rc::gen::scale(kCommandsScale, rc::state::gen::commands(spec, std::forward<GenFunc>(gen_func)));
  rc::state::runAll(commands, spec, sut);
}

// Runs random actions on the fleet, heals it and checks liveness; with `retention`, every replica
// opens first (so that its rule holds before any version exists) and retained versions must still
// be readable at the end.
void run_fleet(Coverage& coverage, const FleetSpec& spec, bool retention = false) {
  RC_LOG() << spec << '\n';
  Fleet fleet(spec);
  if (retention) fleet.open_all();
  run_commands(spec, fleet, &gen_command);
  fleet.heal_and_check_liveness();
  if (retention) fleet.check_retained_versions_readable();
  tally(coverage, fleet);
}

void run_cluster(Coverage& coverage, const FleetSpec& spec, bool lossy) {
  RC_LOG() << spec << (lossy ? " lossy" : " reliable") << '\n';
  Cluster cluster(spec, lossy);
  run_commands(spec, cluster, [lossy](const FleetSpec& model) { return gen_cluster_command(model, lossy); });
  cluster.heal_and_check_liveness();
  tally(coverage, cluster);
}

const std::vector<std::string> kRequired = {"reads", "pipelined reads", "offloads", "failovers"};
constexpr double kShareMin = 0.10;

TEST(HubModel, AnswersMatchTheReferenceModelUnderFaults) {
  Coverage coverage;
  EXPECT_TRUE(rc::check("hub answers = reference model, with faults", [&] {
    run_fleet(coverage, *gen_fleet(/*faults=*/true, /*closes=*/true));
  }));
  coverage.check("HubModel.AnswersMatchTheReferenceModelUnderFaults", kRequired, kShareMin);
}

// Retention, explicitly: without crashes or departures, every version that a non-spot replica
// once held completely and that a retention rule covers can still be read at the end. Every
// replica opens first, so that its rule holds before any version exists.
TEST(HubModel, RetainedVersionsStayReadable) {
  Coverage coverage;
  EXPECT_TRUE(rc::check("retained versions stay readable", [&] {
    run_fleet(coverage, *gen_fleet(/*faults=*/false, /*closes=*/false), /*retention=*/true);
  }));
  coverage.check("HubModel.RetainedVersionsStayReadable", {"reads", "offloads"}, kShareMin);
}

// Retention with only spot rollouts: the trainer's copy is the only one that counts, so every
// unpublish of a retained version offloads first (the Observer checks it at each unpublish).
TEST(HubModel, SpotReplicasNeverCountForRetention) {
  Coverage coverage;
  EXPECT_TRUE(rc::check("spot replicas never count", [&] {
    run_fleet(coverage, only_spot_rollouts(*gen_fleet(/*faults=*/false, /*closes=*/false)),
              /*retention=*/true);
  }));
  coverage.check("HubModel.SpotReplicasNeverCountForRetention", {"reads", "offloads"}, kShareMin);
}

// Chains of pipelined sources across four datacenters, whose roots fail (testkit/fleet.h,
// ChainCase): every reader still gets its version or a clear error once faults heal (DESIGN.md
// §5.6), checked as in every HubModel property. RC_LOG prints the fleet and the actions as
// property-regressions.txt takes them.
TEST(HubModel, ChainsAcrossDatacentersConverge) {
  Coverage coverage;
  EXPECT_TRUE(rc::check("chains across datacenters converge", [&] {
    const ChainCase chain_case = *gen_chain_case();
    const FleetSpec& spec = chain_case.spec;
    RC_LOG() << spec << '\n';
    Fleet fleet(spec);
    fleet.open_all();  // so that each planned call goes out at once
    for (const Action& action : chain_case.program) {
      RC_LOG() << action << ' ';
      fleet.apply(action);
    }
    fleet.heal_and_check_liveness();
    tally(coverage, fleet);
  }));
  coverage.check("HubModel.ChainsAcrossDatacentersConverge", {"reads", "pipelined reads", "cross-datacenter reads"},
                 kShareMin);
}

// Rollouts of uneven speed, updating together version after version (testkit/fleet.h,
// gen_uneven_case): rate-aware source selection moves readers ahead of slower copies, which read
// again behind them; every update still gets its version or a clear error, checked as in every
// HubModel property.
TEST(HubModel, UnevenReadersConverge) {
  Coverage coverage;
  EXPECT_TRUE(rc::check("uneven readers converge", [&] {
    const ChainCase uneven = *gen_uneven_case();
    RC_LOG() << uneven.spec << '\n';
    Fleet fleet(uneven.spec);
    fleet.open_all();
    for (const Action& action : uneven.program) {
      RC_LOG() << action << ' ';
      fleet.apply(action);
    }
    fleet.heal_and_check_liveness();
    tally(coverage, fleet);
  }));
  coverage.check("HubModel.UnevenReadersConverge", {"reads", "pipelined reads", "readers put ahead"}, kShareMin);
}

// Fleets of agents have at least four replicas: with two or three (one or two models) few have two
// rollouts of one model reading at once, and pipelined reads were in 10-11 % of 1,000 cases, so
// that a seed in six failed the 10 % floor by chance (seeds 1, 6, 777001).
constexpr int kClusterReplicasMin = 4;

TEST(AgentModel, LossyNetworkOneAnswerRightBytes) {
  Coverage coverage;
  EXPECT_TRUE(rc::check("agents over a lossy network", [&] {
    run_cluster(coverage, *gen_fleet(/*faults=*/true, /*closes=*/true, /*layouts=*/false, kClusterReplicasMin),
                /*lossy=*/true);
  }));
  coverage.check("AgentModel.LossyNetworkOneAnswerRightBytes", kRequired, kShareMin);
}

// With every message delivered in order, a shard can be silent only if its process is dead: a live
// one evicted for silence is a bug (of the agent's heartbeats, or of the hub's expiry).
TEST(AgentModel, ReliableNetworkEvictsOnlyTheDead) {
  Coverage coverage;
  EXPECT_TRUE(rc::check("agents over a reliable network", [&] {
    run_cluster(coverage, *gen_fleet(/*faults=*/true, /*closes=*/true, /*layouts=*/false, kClusterReplicasMin),
                /*lossy=*/false);
  }));
  coverage.check("AgentModel.ReliableNetworkEvictsOnlyTheDead", kRequired, kShareMin);
}

}  // namespace
}  // namespace th::test
