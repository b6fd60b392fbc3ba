// Proof that the checkers can fail: the same property as hub_property_test, run against a hub with
// one deliberately planted bug (core built with TH_CANARY, tests only), must be falsified, and by
// the checker that guards the invariant the bug breaks.
#include <gtest/gtest.h>

#include <string>

#include "tests/core/testkit/fleet.h"

#ifndef TH_CANARY
#error "this test links the canary build of core"
#endif

namespace th::test {
namespace {

// Returns the message of the last failure RapidCheck saw (after shrinking), or "" if the property
// held for every case.
// `without_retention` drops every retention rule, so that a bug that breaks retention as well as
// another invariant is caught by the other invariant's checker.
std::string falsify(CanaryBugs bugs, bool without_retention = false) {
  static std::string last_failure;
  last_failure.clear();
  const bool held = rc::check("fleet with a planted bug", [bugs, without_retention] {
    FleetSpec spec = *gen_fleet(/*faults=*/true, /*closes=*/true);
    if (without_retention) {
      for (FleetSpec::ReplicaSpec& replica : spec.replicas) replica.retention = Retention{};
    }
    try {
      Fleet fleet(spec, bugs);
      rc::state::check(spec, fleet, &gen_command);
      fleet.heal_and_check_liveness();
    } catch (const std::exception& failure) {
      last_failure = failure.what();
      throw;
    }
  });
  return held ? std::string() : last_failure;
}

TEST(HubCanary, EarlyUnpublishAckBreaksIntegrity) {
  CanaryBugs bugs;
  bugs.early_unpublish_ack = true;
  EXPECT_NE(falsify(bugs, /*without_retention=*/true).find("integrity:"), std::string::npos);
}

TEST(HubCanary, SkippedOffloadBreaksRetention) {
  CanaryBugs bugs;
  bugs.skip_offload = true;
  EXPECT_NE(falsify(bugs).find("retention:"), std::string::npos);
}

TEST(HubCanary, IgnoredFanOutBreaksLoad) {
  CanaryBugs bugs;
  bugs.ignore_fanout = true;
  const std::string failure = falsify(bugs);
  EXPECT_NE(failure.find("load:"), std::string::npos) << failure;
}

TEST(HubCanary, RemoteFirstBreaksTopology) {
  CanaryBugs bugs;
  bugs.prefer_remote = true;
  EXPECT_NE(falsify(bugs).find("topology:"), std::string::npos);
}

TEST(HubCanary, PerShardAnswersBreakConsistency) {
  CanaryBugs bugs;
  bugs.per_shard_resolve = true;
  EXPECT_NE(falsify(bugs).find("consistency:"), std::string::npos);
}

TEST(HubCanary, WithoutBugsTheSameRunHolds) {
  EXPECT_EQ(falsify(CanaryBugs{}), "");
}

}  // namespace
}  // namespace th::test
