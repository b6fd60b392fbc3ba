// Counterexamples the property tests once found (tests/core/property-regressions.txt), replayed
// action by action against today's code: each is a named test, and a case that fails again shows
// which regression came back. The parser of their text is checked too, so that an entry that no
// longer parses fails loudly rather than replaying nothing.
#include <gtest/gtest.h>

#include <sstream>
#include <stdexcept>

#include "tests/core/testkit/replay.h"

namespace th::test {
namespace {

const std::string kRegressions = TH_PROPERTY_REGRESSIONS;

}  // namespace

// GoogleTest names a failing case by this, not by its bytes.
void PrintTo(const Counterexample& counterexample, std::ostream* out) { *out << counterexample.name; }

namespace {

class PropertyRegression : public testing::TestWithParam<Counterexample> {};

TEST_P(PropertyRegression, Passes) {
  const Counterexample& entry = GetParam();
  SCOPED_TRACE(entry.name + " (" + entry.property + "): " + entry.why);
  EXPECT_NO_THROW(replay(entry));
}

INSTANTIATE_TEST_SUITE_P(Counterexamples, PropertyRegression,
                         testing::ValuesIn(read_counterexamples(kRegressions)),
                         [](const testing::TestParamInfo<Counterexample>& param) {
                           std::string name = param.param.name;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

TEST(PropertyRegressionText, SpecPrintsBackAsParsed) {
  const std::string text =
      "settings{pipeline=0 fanout=3 smart_skipping=1} faults=1 closes=0 model m0/2 model m1/1 "
      "replica r0{m0 dc1 trainer keep-latest-2} replica r1{m1 dc0 spot pin-1 pin-3}";
  std::ostringstream printed;
  printed << parse_fleet_spec(text);
  EXPECT_EQ(printed.str(), text);
}

TEST(PropertyRegressionText, ActionsPrintBackAsParsed) {
  const std::string fleet_text = "plan(1,3=update,2,0,go) finish-read(5,0,0,0) crash-source(2,0,0,0)";
  std::ostringstream fleet;
  for (const Action& action : parse_fleet_actions(fleet_text)) fleet << (fleet.tellp() > 0 ? " " : "") << action;
  EXPECT_EQ(fleet.str(), fleet_text);
  const std::string cluster_text = "deliver-all(0,0,0,0) replay(7,0,0,0) plan(0,5=wait,1,1)";
  std::ostringstream cluster;
  for (const ClusterAction& action : parse_cluster_actions(cluster_text)) {
    cluster << (cluster.tellp() > 0 ? " " : "") << action;
  }
  EXPECT_EQ(cluster.str(), cluster_text);
}

TEST(PropertyRegressionText, MalformedTextIsRefused) {
  EXPECT_THROW(parse_fleet_spec("model m0/1 replica r0{m0 dc0}"), std::invalid_argument);
  EXPECT_THROW(parse_fleet_spec("settings{pipeline=1 fanout=1 smart_skipping=0} faults=1 closes=1 "
                                "model m0/1 replica r0{m9 dc0}"),
               std::invalid_argument);
  EXPECT_THROW(parse_fleet_actions("burst(0,0,0)"), std::invalid_argument);
  EXPECT_THROW(parse_fleet_actions("deliver(0,0,0,0)"), std::invalid_argument);  // a cluster action
  EXPECT_THROW(parse_cluster_actions("tick(x,0,0,0)"), std::invalid_argument);
}

}  // namespace
}  // namespace th::test
