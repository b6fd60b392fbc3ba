#include "tests/core/testkit/replay.h"

#include <cctype>
#include <charconv>
#include <fstream>
#include <regex>
#include <stdexcept>

namespace th::test {

namespace {

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("replay: " + what); }

std::uint32_t number(std::string_view text, std::string_view what) {
  std::uint32_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || end != text.data() + text.size()) {
    bad("'" + std::string(text) + "' is not a number (" + std::string(what) + ")");
  }
  return value;
}

std::vector<std::string_view> words(std::string_view text) {
  std::vector<std::string_view> out;
  std::size_t at = 0;
  while (at < text.size()) {
    while (at < text.size() && std::isspace(static_cast<unsigned char>(text[at]))) ++at;
    std::size_t end = at;
    while (end < text.size() && !std::isspace(static_cast<unsigned char>(text[end]))) ++end;
    if (end > at) out.push_back(text.substr(at, end - at));
    at = end;
  }
  return out;
}

// "name(a,b[=op],c,d[,go])" into its name and fields.
struct ActionText {
  std::string_view name;
  std::uint32_t a = 0, b = 0, c = 0, d = 0;
  bool go = false;
};

ActionText split_action(std::string_view word) {
  const std::size_t open = word.find('(');
  if (open == std::string_view::npos || word.back() != ')') bad("'" + std::string(word) + "' is not an action");
  ActionText action;
  action.name = word.substr(0, open);
  std::vector<std::string_view> fields;
  std::string_view rest = word.substr(open + 1, word.size() - open - 2);
  for (std::size_t comma; (comma = rest.find(',')) != std::string_view::npos; rest.remove_prefix(comma + 1)) {
    fields.push_back(rest.substr(0, comma));
  }
  fields.push_back(rest);
  if (fields.size() == 5 && fields[4] == "go") {
    action.go = true;
    fields.pop_back();
  }
  if (fields.size() != 4) bad("'" + std::string(word) + "' has not four fields");
  // b of a plan prints as "0=publish": the number is what counts.
  const std::string_view b = fields[1].substr(0, fields[1].find('='));
  action.a = number(fields[0], word);
  action.b = number(b, word);
  action.c = number(fields[2], word);
  action.d = number(fields[3], word);
  return action;
}

template <typename ActionType, typename Kind>
std::vector<ActionType> parse_actions(std::string_view text, Kind last) {
  std::vector<ActionType> actions;
  for (std::string_view word : words(text)) {
    const ActionText parsed = split_action(word);
    bool found = false;
    for (int k = 0; k <= static_cast<int>(last); ++k) {
      if (action_name(static_cast<Kind>(k)) != parsed.name) continue;
      ActionType action;
      action.kind = static_cast<Kind>(k);
      action.a = parsed.a;
      action.b = parsed.b;
      action.c = parsed.c;
      action.d = parsed.d;
      action.go = parsed.go;
      actions.push_back(action);
      found = true;
      break;
    }
    if (!found) bad("unknown action '" + std::string(parsed.name) + "'");
  }
  return actions;
}

std::string trim(std::string text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  std::size_t start = 0;
  while (start < text.size() && std::isspace(static_cast<unsigned char>(text[start]))) ++start;
  return text.substr(start);
}

}  // namespace

FleetSpec parse_fleet_spec(std::string_view text_view) {
  const std::string text(text_view);
  std::smatch match;
  static const std::regex kHead(
      R"(settings\{pipeline=([01]) fanout=(\d+) smart_skipping=([01])( drain_grace=(\d+))?( model_grace=(\d+))?\}\s+faults=([01])\s+closes=([01]))");
  if (!std::regex_search(text, match, kHead)) bad("no 'settings{...} faults=N closes=N' in '" + text + "'");
  FleetSpec spec = fleet_base(match[8] == "1", match[9] == "1");
  spec.settings.pipeline = match[1] == "1";
  spec.settings.fanout_max = number(match[2].str(), "fanout");
  spec.settings.smart_skipping = match[3] == "1";
  if (match[5].matched) spec.settings.drain_grace_ms = number(match[5].str(), "drain_grace");
  if (match[7].matched) spec.settings.model_grace_ms = number(match[7].str(), "model_grace");
  static const std::regex kModel(R"(model (\S+)/(\d+)( sliced)?)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), kModel); it != std::sregex_iterator(); ++it) {
    spec.models.push_back({(*it)[1].str(), number((*it)[2].str(), "shards"), (*it)[3].matched});
  }
  static const std::regex kReplica(R"(replica (\S+)\{([^}]*)\})");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), kReplica); it != std::sregex_iterator(); ++it) {
    FleetSpec::ReplicaSpec replica;
    replica.name = (*it)[1].str();
    const std::string inner = (*it)[2].str();
    const std::vector<std::string_view> fields = words(inner);
    if (fields.size() < 2) bad("replica '" + replica.name + "' names no model and datacenter");
    const auto model = std::find_if(spec.models.begin(), spec.models.end(),
                                    [&](const auto& m) { return m.name == fields[0]; });
    if (model == spec.models.end()) bad("replica '" + replica.name + "' of an unknown model");
    replica.model = static_cast<std::uint32_t>(model - spec.models.begin());
    replica.datacenter = std::string(fields[1]);
    for (std::size_t i = 2; i < fields.size(); ++i) {
      const std::string_view flag = fields[i];
      if (flag == "spot") {
        replica.spot = true;
      } else if (flag == "trainer") {
        replica.trainer = true;
      } else if (flag.starts_with("keep-latest-")) {
        replica.retention.keep_latest = number(flag.substr(12), "keep-latest");
      } else if (flag.starts_with("pin-")) {
        replica.retention.pinned.push_back(number(flag.substr(4), "pin"));
      } else if (flag.starts_with("shards-")) {
        replica.num_shards = static_cast<std::uint32_t>(number(flag.substr(7), "shards"));
        if (replica.num_shards == 0 || replica.num_shards > kSlicedShardsMax) {
          bad("replica '" + replica.name + "': shards-N takes 1 to " + std::to_string(kSlicedShardsMax));
        }
        if (!spec.models[replica.model].sliced) bad("replica '" + replica.name + "': shards-N of a model not sliced");
      } else {
        bad("replica '" + replica.name + "': unknown flag '" + std::string(flag) + "'");
      }
    }
    spec.replicas.push_back(std::move(replica));
  }
  if (spec.models.empty() || spec.replicas.empty()) bad("a fleet needs a model and a replica");
  return spec;
}

std::vector<Action> parse_fleet_actions(std::string_view text) {
  return parse_actions<Action>(text, Action::Kind::kCancel);
}

// (The last kind of each: a counterexample may name any of them.)
std::vector<ClusterAction> parse_cluster_actions(std::string_view text) {
  return parse_actions<ClusterAction>(text, ClusterAction::Kind::kTamper);
}

std::vector<Counterexample> read_counterexamples(const std::string& path) {
  std::ifstream in(path);
  if (!in) bad("cannot read " + path);
  std::vector<Counterexample> out;
  std::string line;
  std::string* field = nullptr;
  while (std::getline(in, line)) {
    if (line.starts_with("#") || trim(line).empty()) continue;
    if (line.starts_with("=== ")) {
      out.push_back({trim(line.substr(4)), {}, {}, {}, {}});
      field = nullptr;
      continue;
    }
    if (out.empty()) bad(path + ": text before the first '=== name'");
    Counterexample& current = out.back();
    if (std::isspace(static_cast<unsigned char>(line[0]))) {
      if (field == nullptr) bad(path + ": a continuation line without a field");
      *field += " " + trim(line);
      continue;
    }
    const std::size_t colon = line.find(':');
    if (colon == std::string::npos) bad(path + ": '" + line + "' is not 'field: value'");
    const std::string key = line.substr(0, colon);
    field = key == "why"        ? &current.why
            : key == "property" ? &current.property
            : key == "spec"     ? &current.spec
            : key == "actions"  ? &current.actions
                                : nullptr;
    if (field == nullptr) bad(path + ": unknown field '" + key + "'");
    *field = trim(line.substr(colon + 1));
  }
  for (const Counterexample& entry : out) {
    if (entry.property.empty() || entry.spec.empty() || entry.why.empty()) {
      bad(path + ": '" + entry.name + "' needs why, property and spec");
    }
  }
  return out;
}

void replay(const Counterexample& counterexample) {
  const std::string& property = counterexample.property;
  // RapidCheck prints the fleet as generated; this property changes it before it runs.
  const FleetSpec spec = property == "HubModel.SpotReplicasNeverCountForRetention"
                             ? only_spot_rollouts(parse_fleet_spec(counterexample.spec))
                             : parse_fleet_spec(counterexample.spec);
  if (property.starts_with("HubModel.")) {
    // The retention properties open all replicas first and check retention last.
    const bool retention = property == "HubModel.RetainedVersionsStayReadable" ||
                           property == "HubModel.SpotReplicasNeverCountForRetention";
    Fleet fleet(spec);
    if (retention || property == "HubModel.ChainsAcrossDatacentersConverge") fleet.open_all();
    for (const Action& action : parse_fleet_actions(counterexample.actions)) fleet.apply(action);
    fleet.heal_and_check_liveness();
    if (retention) fleet.check_retained_versions_readable();
  } else if (property == "AgentModel.LossyNetworkOneAnswerRightBytes" ||
             property == "AgentModel.ReliableNetworkEvictsOnlyTheDead") {
    Cluster cluster(spec, /*lossy=*/property == "AgentModel.LossyNetworkOneAnswerRightBytes");
    for (const ClusterAction& action : parse_cluster_actions(counterexample.actions)) cluster.apply(action);
    cluster.heal_and_check_liveness();
  } else {
    bad("unknown property '" + property + "'");
  }
}

}  // namespace th::test
