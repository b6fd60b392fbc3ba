#include "tests/core/testkit/program.h"

#include <algorithm>

#include "core/assert.h"
#include "tests/core/testkit/driver.h"

namespace th::test {

PlannedOp plan_op(std::uint32_t op, std::uint32_t p1, std::uint32_t p2, Version latest) {
  PlannedOp planned;
  planned.kind = static_cast<OpKind>(op % 7);
  const std::uint32_t fault = op / 7;
  const bool carries_layout = planned.kind == OpKind::kPublish || planned.kind == OpKind::kReplicate ||
                              planned.kind == OpKind::kUpdate;
  if (fault > 0 && carries_layout) {
    // A transposed weight on a publisher would fix the model's layout (nothing to refuse then).
    const bool transposed = (fault - 1) % 2 == 1 && planned.kind != OpKind::kPublish;
    planned.layout_fault = transposed ? LayoutFault::kTransposed : LayoutFault::kBadBox;
    planned.fault_shard = (fault - 1) / 2;
  }
  switch (planned.kind) {
    case OpKind::kPublish:
      // The next version, one that skips numbers (so that latest-k must count), or an old one.
      planned.version = p1 < 3 ? latest + p1 : p2 + 1;
      break;
    case OpKind::kReplicate:
      // latest, latest-k (k up to 3, which may reach below what exists), or an absolute version:
      // a past one, the latest, a skipped one or one not published yet (only these wait, with a
      // timeout: a call that need not wait must never hang).
      if (p1 < 2) {
        planned.selector = Selector::latest(p1 == 0 ? 0 : 1 + p2 % 3);
      } else {
        planned.selector = Selector::absolute(latest + p2 > 0 ? latest + p2 - 1 : 0);
        planned.timeout_ms = p1 == 3 || p2 >= 2 ? kCallTimeoutMaxMs : 0;
      }
      break;
    case OpKind::kUpdate:
      planned.selector = p1 < 3 ? Selector::latest() : Selector::latest(1 + p2 % 2);
      break;
    case OpKind::kWait: {
      planned.predicate.kind = static_cast<WaitPredicate::Kind>(p1 % 3);
      planned.predicate.version = planned.predicate.kind == WaitPredicate::Kind::kVersionAtLeast
                                      ? latest + 1 + p2 % 2
                                      : std::max<Version>(latest, 1) - (p2 == 3 && latest > 1 ? 1 : 0);
      planned.predicate.replicas_min = p2 % 3 + 1;
      static constexpr const char* kRoles[] = {"rollout", "trainer", "rollout", "nobody"};
      planned.predicate.role = kRoles[p2 % 4];
      planned.timeout_ms = p2 % 2 == 0 ? 1000 : 0;
      break;
    }
    default:
      break;
  }
  return planned;
}

RequestBody body_for(const PlannedOp& op, std::uint32_t shard, std::uint32_t sliced_shards) {
  const LayoutFault fault = shard == op.fault_shard ? op.layout_fault : LayoutFault::kNone;
  const LayoutRef layout =
      sliced_shards == 0 ? layout_for(shard, 4096, fault) : sliced_layout_for(shard, sliced_shards, fault);
  switch (op.kind) {
    case OpKind::kPublish:
      return PublishRequest{op.version, layout,
                            sliced_shards == 0 ? checksums_for(op.version, shard)
                                               : sliced_checksums_for(op.version, shard, sliced_shards)};
    case OpKind::kUnpublish:
      return UnpublishRequest{};
    case OpKind::kReplicate:
      return ReplicateRequest{op.selector, layout, op.timeout_ms};
    case OpKind::kUpdate:
      return UpdateRequest{op.selector, layout};
    case OpKind::kList:
      return ListRequest{};
    case OpKind::kWait:
      return WaitRequest{op.predicate, op.timeout_ms};
    case OpKind::kClose:
      return CloseRequest{};
  }
  TH_ASSERT(false, "unknown op");
}

}  // namespace th::test
