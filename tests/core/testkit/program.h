// The calls the property tests' replicas make: a program of planned operations, appended by the
// tests' actions and run by every shard of the replica (SPMD). Shared by the hub-level fleet and
// the agent-level cluster, so that both explore the same argument shapes.
#pragma once

#include <cstdint>

#include "core/messages.h"

namespace th::test {

// A layout the hub must refuse (testkit/driver.h layout_for).
enum class LayoutFault : std::uint8_t { kNone, kBadBox, kTransposed };

// The longest timeout a planned call has.
inline constexpr TimeMs kCallTimeoutMaxMs = 1500;

struct PlannedOp {
  OpKind kind = OpKind::kList;
  Version version = 0;      // publish
  Selector selector;        // replicate, update
  WaitPredicate predicate;  // wait
  TimeMs timeout_ms = 0;    // replicate, wait
  // publish, replicate, update: shard `fault_shard` registered a layout the hub must refuse.
  LayoutFault layout_fault = LayoutFault::kNone;
  std::uint32_t fault_shard = 0;
};

// Operation `op` (publish, unpublish, replicate, update, list, wait, close: op % 7) with
// parameters p1 and p2 choosing the argument shape, relative to the model's `latest`. For a
// publish, replicate or update, f = op / 7 > 0 is a layout fault on shard (f - 1) / 2: a bad box
// (a publish's always), or for a reader a transposed weight if f - 1 is odd.
PlannedOp plan_op(std::uint32_t op, std::uint32_t p1, std::uint32_t p2, Version latest);

// The request shard `shard` sends for it (deterministic tensors: testkit/driver.h): the testkit's
// own tensors, or with `sliced_shards` the sliced ones of a replica of that many shards.
RequestBody body_for(const PlannedOp& op, std::uint32_t shard, std::uint32_t sliced_shards = 0);

}  // namespace th::test
