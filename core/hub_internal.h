// What more than one of the files that implement th::Hub (core/hub*.cpp) needs and hub.h does not
// show: small helpers over shards and replicas. Private to those files.
#pragma once

#include <cstdint>
#include <string>

#include "core/hub.h"

namespace th::detail {

template <typename F>
void for_each_shard(const ShardSet& set, std::uint32_t count, F&& f) {
  for (std::uint32_t shard = 0; shard < count; ++shard) {
    if (set.test(shard)) f(shard);
  }
}

inline std::string describe(const Replica& replica) {
  return "replica '" + replica.name + "' (incarnation " + std::to_string(replica.incarnation) + ")";
}

}  // namespace th::detail
