#pragma once
// Read-side resharding (DESIGN.md §7, README "Layouts"): how a reader shard fills its tensors from
// the pieces that the shards of a source replica of another layout hold. Pure planning over
// core/box.h: which source pieces to read, which part of each, and the copy runs from each into
// the reader's buffers. The data plane carries the plan out and verifies what it reads.
#include <cstdint>
#include <string>
#include <vector>

#include "core/box.h"
#include "core/result.h"
#include "core/types.h"

namespace th {

// A part of a reader's tensor: the box `box` of the logical tensor `tensor`, whose global shape
// the reader takes to be `shape` (a source that says otherwise is refused, naming both).
struct Segment {
  std::string tensor;
  Shape shape;
  Box box;
};

// A tensor of the reader as its buffer holds it: segments one after the other along dimension 0,
// each with the same extent in every other dimension. One segment is a plain piece; several make
// a fused tensor (vLLM's qkv_proj holds its q, k and v rows; gate_up_proj its gate and up rows).
struct Destination {
  std::string name;
  DType dtype = DType::kBFloat16;
  std::vector<Segment> segments;
};

// Copies from a source piece's buffer (all of the piece, row-major over its box) into a
// destination's, in elements (the data plane scales them by each side's element size: a dtype
// converted on landing changes it).
struct ElementRun {
  std::uint64_t source_offset = 0;
  std::uint64_t destination_offset = 0;
  std::uint64_t count = 0;
  friend bool operator==(const ElementRun&, const ElementRun&) = default;
};

struct Landing {
  std::uint32_t destination = 0;  // index into the destinations planned for
  std::vector<ElementRun> runs;
};

// One piece of the source replica the reader needs some of.
struct PieceRead {
  std::uint32_t shard = 0;   // the source shard
  std::uint32_t tensor = 0;  // index in that shard's layout
  Box needed;                // the smallest box of the piece holding all that is needed of it
  bool whole = false;        // needed is all of the piece
  std::vector<Landing> landings;
};

struct ReshardPlan {
  std::vector<PieceRead> reads;  // by source shard, then tensor
  std::uint64_t elements_needed = 0;  // what the destinations take (each element once)
  std::uint64_t elements_in_needed_boxes = 0;  // what reading every `needed` box moves
};

// Plans the destinations of one reader shard from `source` (every shard's layout of a replica
// whose pieces check_replica_pieces accepted). Where several shards hold the same box (a
// replicated tensor), `spread` picks among them (the reader's shard index spreads the load).
// kLayoutMismatch names the destination and tensor at fault: a tensor no source shard holds as a
// piece, another global shape, a dtype that does not convert (only bfloat16, float16 and float32
// convert into one another), segments of unequal inner extents, or part of a box no piece holds.
// kLimitExceeded past limits::kCopyRunsPerTensorMax runs for one segment.
Result<ReshardPlan> plan_reshard(const std::vector<LayoutRef>& source, const std::vector<Destination>& destinations,
                                 std::uint32_t spread);

// Whether bytes of `from` may land in a buffer of `to`: the same dtype, or two of bfloat16,
// float16, float32.
bool converts(DType from, DType to);

}  // namespace th
