// Model-based property tests of the Hub (RapidCheck, rc::state): random fleets of SPMD replicas run
// random programs against one hub while reads complete or fail, offloads happen, replicas crash,
// time passes and the server fails over. After every action the hub's own invariants
// (Hub::check_invariants) and the Observer's outside view of DESIGN.md §5 must hold; at the end,
// with faults healed, nothing may be left in flight.
//
// CI runs each property with RC_PARAMS="max_success=1000" (see tests/core/CMakeLists.txt).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>
#include <rapidcheck/state.h>

#include "tests/core/testkit/fleet.h"

namespace th::test {
namespace {

void classify(const Fleet& fleet) {
  const Fleet::Coverage& seen = fleet.coverage();
  RC_CLASSIFY(seen.reads_done > 0, "reads");
  RC_CLASSIFY(seen.pipelined_reads > 0, "pipelined reads");
  RC_CLASSIFY(seen.cross_dc_reads > 0, "cross-datacenter reads");
  RC_CLASSIFY(seen.reads_failed > 0, "failed reads");
  RC_CLASSIFY(seen.offloads > 0, "offloads");
  RC_CLASSIFY(seen.evictions > 0, "evictions");
  RC_CLASSIFY(seen.failovers > 0, "failovers");
  RC_CLASSIFY(seen.unavailable > 0, "version unavailable");
}

// Runs random actions on the fleet, heals it and checks liveness; with `retention`, every replica
// opens first (so that its rule holds before any version exists) and retained versions must still
// be readable at the end.
void run_fleet(const FleetSpec& spec, bool retention = false) {
  RC_LOG() << spec << '\n';
  Fleet fleet(spec);
  if (retention) fleet.open_all();
  rc::state::check(spec, fleet, &gen_command);
  fleet.heal_and_check_liveness();
  if (retention) fleet.check_retained_versions_readable();
  classify(fleet);
}

RC_GTEST_PROP(HubProperty, InvariantsHoldUnderFaults, ()) {
  run_fleet(*gen_fleet(/*faults=*/true, /*closes=*/true));
}

// Retention, explicitly: without crashes or departures, every version that a non-spot replica
// once held completely and that a retention rule covers can still be read at the end. Every
// replica opens first, so that its rule holds before any version exists.
RC_GTEST_PROP(HubRetentionProperty, RetainedVersionsStayReadable, ()) {
  run_fleet(*gen_fleet(/*faults=*/false, /*closes=*/false), /*retention=*/true);
}

// Retention with only spot rollouts: the trainer's copy is the only one that counts, so every
// unpublish of a retained version offloads first (the Observer checks it at each unpublish).
RC_GTEST_PROP(HubRetentionProperty, SpotReplicasNeverCount, ()) {
  FleetSpec spec = *gen_fleet(/*faults=*/false, /*closes=*/false);
  for (FleetSpec::ReplicaSpec& replica : spec.replicas) {
    replica.spot = !replica.trainer;
    if (replica.trainer) replica.retention.keep_latest = 1;
  }
  run_fleet(spec, /*retention=*/true);
}

}  // namespace
}  // namespace th::test
