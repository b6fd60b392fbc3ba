// What the two properties of rate-aware source selection (hub_rates_property.cpp,
// hub_rates_shards_property.cpp) draw alike: when each rollout first reads, and the order the
// rollouts ask in, version by version. Called inside a RapidCheck generator or property.
#pragma once

#include <rapidcheck.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace th::test {

inline std::string rollout_name(std::uint32_t rollout) { return "r" + std::to_string(rollout); }

// Now and then a rollout joins late: never measured, it must not move anyone. Often the slow one:
// asking first in its first version, it is the root every other read of that version went
// behind, so the version's fastest read is its own pace.
inline std::vector<std::uint32_t> gen_first_versions(std::uint32_t rollouts, std::optional<std::uint32_t> slow) {
  std::vector<std::uint32_t> first_version(rollouts, 1);
  if (rollouts > 2 && *rc::gen::arbitrary<bool>()) {
    const std::uint32_t late = slow && *rc::gen::arbitrary<bool>() ? *slow : *rc::gen::inRange<std::uint32_t>(0, rollouts);
    first_version[late] = *rc::gen::inRange<std::uint32_t>(2, 4);
  }
  return first_version;
}

// A random permutation of the rollouts; the slow one first half the time (the chain's root).
inline std::vector<std::uint32_t> gen_ask_order(std::uint32_t rollouts, std::optional<std::uint32_t> slow) {
  std::vector<std::uint32_t> order(rollouts);
  for (std::uint32_t r = 0; r < rollouts; ++r) order[r] = r;
  for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[*rc::gen::inRange<std::size_t>(0, i)]);
  if (slow && *rc::gen::arbitrary<bool>()) {
    order.erase(std::find(order.begin(), order.end(), *slow));
    order.insert(order.begin(), *slow);
  }
  return order;
}

}  // namespace th::test
