#pragma once
// Where a shard's piece of a logical tensor sits in the whole tensor (DESIGN.md §7): a box, the
// offset and extent per dimension, in elements. A replica's pieces of one tensor tile its global
// shape; a reader of another layout fills its own box from the pieces that cover it, as byte runs
// in each piece's row-major buffer. Pure geometry: no I/O, nothing about who holds the bytes.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/limits.h"
#include "core/result.h"
#include "tensorhub/types.h"

namespace th {

// Shape and Box are public values (tensorhub/types.h): a libthclient user places pieces with them.

// The box of a whole tensor of `shape`.
Box whole_box(const Shape& shape);

// Elements in a box of `extent` (1 for a scalar). The extent is one check_box accepted: no overflow.
std::uint64_t element_count(const Shape& extent);
// The same for any shape: nothing if it has 2^64 elements or more.
std::optional<std::uint64_t> checked_element_count(const Shape& shape);
// "[32, 64]" and "[0:16, 0:64]", for errors and logs.
std::string describe_shape(const Shape& shape);
std::string describe_box(const Box& box);

// `box` has the rank of `shape`, at least one element, and lies within it; the error
// (kInvalidArgument) names `tensor`, the box, the shape and the dimension at fault.
Status check_box(std::string_view tensor, const Shape& shape, const Box& box);

// `boxes` tile `shape`: each is a valid box, none overlaps another, and together they hold every
// element. The error names `tensor` and the two boxes that overlap, or how much is missing.
Status check_tiling(std::string_view tensor, const Shape& shape, const std::vector<Box>& boxes);

// The elements two boxes of one tensor share, if any.
bool intersect(const Box& a, const Box& b, Box* common);

// One contiguous copy: `bytes` from offset `source_offset_bytes` of piece `source`'s buffer to
// offset `target_offset_bytes` of the target piece's buffer (both row-major over their boxes).
struct CopyRun {
  std::uint32_t source = 0;
  std::uint64_t source_offset_bytes = 0;
  std::uint64_t target_offset_bytes = 0;
  std::uint64_t bytes = 0;
  friend bool operator==(const CopyRun&, const CopyRun&) = default;
};

// The runs that fill `target` from `sources` (pieces of the tensor of `shape` that do not overlap,
// such as one layout's tiling), longest runs first in each source's order: dimensions a source,
// the target and their common part all span whole are merged into one run. kInvalidArgument names
// the tensor if the sources leave part of the target uncovered; kLimitExceeded if it needs more
// than limits::kCopyRunsPerTensorMax runs (a column split finer than a source could serve well).
Result<std::vector<CopyRun>> plan_copy(std::string_view tensor, const Shape& shape,
                                       std::uint32_t element_bytes, const Box& target,
                                       const std::vector<Box>& sources);

}  // namespace th
