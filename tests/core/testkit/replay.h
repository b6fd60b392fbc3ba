// Counterexamples of the property tests, replayed from the text RapidCheck prints when a property
// fails: the fleet (FleetSpec's operator<<) and the shrunk list of actions (Action's or
// ClusterAction's operator<<). A counterexample pasted into tests/core/property-regressions.txt
// runs in CI from then on, whatever RapidCheck's generators become: the actions, not the random
// choices that made them, are what is kept. Malformed text throws std::invalid_argument naming
// the piece it could not read.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tests/core/testkit/cluster.h"
#include "tests/core/testkit/fleet.h"

namespace th::test {

// "settings{pipeline=1 fanout=1 smart_skipping=0} faults=1 closes=1 model m0/1 replica r0{m0 dc0
// trainer keep-latest-0} ..." (as printed, on one line or several).
FleetSpec parse_fleet_spec(std::string_view text);

// "burst(0,0,0,0) plan(1,0=publish,2,0,go) ..." separated by white space.
std::vector<Action> parse_fleet_actions(std::string_view text);
std::vector<ClusterAction> parse_cluster_actions(std::string_view text);

// One counterexample of tests/core/property-regressions.txt.
struct Counterexample {
  std::string name;
  std::string why;        // what it found, and where the fix is
  std::string property;   // the TEST it came from, e.g. "AgentModel.LossyNetworkOneAnswerRightBytes"
  std::string spec;
  std::string actions;
};
// The file's entries: "=== name", then "why:", "property:", "spec:" and "actions:" lines (a line
// that starts with white space continues the field before it); "#" starts a comment line.
std::vector<Counterexample> read_counterexamples(const std::string& path);

// Runs a counterexample as its property runs a case (setup, the actions, healing, the final
// checks); throws what the property would have failed with.
void replay(const Counterexample& counterexample);

}  // namespace th::test
