#pragma once
// The layouts of a replica's shards taken together (README "Layouts"): each logical tensor that
// the shards hold as pieces (TensorKind::kPiece) is tiled by them, with one dtype and one global
// shape. Checked by the hub when every shard of a replica has published, before the copy counts:
// a reader of another layout will assemble its own pieces from these, so a gap or an overlap here
// would be bytes nobody has, or two answers for one element.
#include <cstdint>
#include <vector>

#include "core/result.h"
#include "core/types.h"

namespace th {

// `shards[i]` is shard i's layout (none null). The error (kLayoutMismatch) names the tensor and
// the shards at fault: a piece whose dtype or global shape differs from another shard's piece of
// it, a name that is a piece on one shard and a shard's own tensor on another, overlapping pieces,
// or elements in no piece. Shards holding the very same box (a replicated tensor) are fine. kLimitExceeded past limits::kPiecesPerReplicaMax pieces in all.
Status check_replica_pieces(const std::vector<LayoutRef>& shards);

}  // namespace th
