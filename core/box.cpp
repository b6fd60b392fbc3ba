#include "core/box.h"

#include <algorithm>
#include <string>

namespace th {
namespace {

Error invalid(std::string_view tensor, const std::string& why) {
  return make_error(Errc::kInvalidArgument, "tensor '" + std::string(tensor) + "': " + why);
}

// Row-major strides of a buffer holding a box of `extent`, in elements.
Shape strides_of(const Shape& extent) {
  Shape strides(extent.size(), 1);
  for (std::size_t d = extent.size(); d-- > 1;) strides[d - 1] = strides[d] * extent[d];
  return strides;
}

}  // namespace

std::string describe_shape(const Shape& shape) {
  std::string text = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) text += (d ? ", " : "") + std::to_string(shape[d]);
  return text + "]";
}

std::string describe_box(const Box& box) {
  std::string text = "[";
  for (std::size_t d = 0; d < box.offset.size() && d < box.extent.size(); ++d) {
    text += (d ? ", " : "") + std::to_string(box.offset[d]) + ":" +
            std::to_string(box.offset[d] + box.extent[d]);
  }
  return text + "]";
}

Box whole_box(const Shape& shape) { return Box{Shape(shape.size(), 0), shape}; }

std::uint64_t element_count(const Shape& extent) {
  std::uint64_t count = 1;
  for (std::uint64_t length : extent) {
    TH_ASSERT(!__builtin_mul_overflow(count, length, &count), "a box's element count overflows");
  }
  return count;
}

std::optional<std::uint64_t> checked_element_count(const Shape& shape) {
  std::uint64_t count = 1;
  for (std::uint64_t length : shape) {
    if (__builtin_mul_overflow(count, length, &count)) return std::nullopt;
  }
  return count;
}

Status check_box(std::string_view tensor, const Shape& shape, const Box& box) {
  if (shape.size() > limits::kBoxRankMax) {
    return invalid(tensor, "its shape " + describe_shape(shape) + " has more than " +
                               std::to_string(limits::kBoxRankMax) + " dimensions");
  }
  if (box.offset.size() != shape.size() || box.extent.size() != shape.size()) {
    return invalid(tensor, "a box of " + std::to_string(box.offset.size()) + " offsets and " +
                               std::to_string(box.extent.size()) + " extents for its shape " +
                               describe_shape(shape));
  }
  std::uint64_t count = 1;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (box.extent[d] == 0) {
      return invalid(tensor, "box " + describe_box(box) + " is empty in dimension " + std::to_string(d));
    }
    if (box.offset[d] >= shape[d] || box.extent[d] > shape[d] - box.offset[d]) {
      return invalid(tensor, "box " + describe_box(box) + " lies outside its shape " + describe_shape(shape) +
                                 " in dimension " + std::to_string(d));
    }
    if (__builtin_mul_overflow(count, shape[d], &count)) {
      return invalid(tensor, "its shape " + describe_shape(shape) + " has more than 2^64 elements");
    }
  }
  return Unit{};
}

bool intersect(const Box& a, const Box& b, Box* common) {
  TH_ASSERT(a.offset.size() == b.offset.size(), "boxes of one tensor have one rank");
  for (std::size_t d = 0; d < a.offset.size(); ++d) {  // first without allocating (the common case)
    if (std::max(a.offset[d], b.offset[d]) >= std::min(a.offset[d] + a.extent[d], b.offset[d] + b.extent[d])) {
      return false;
    }
  }
  if (common == nullptr) return true;
  Box result{Shape(a.offset.size()), Shape(a.offset.size())};
  for (std::size_t d = 0; d < a.offset.size(); ++d) {
    const std::uint64_t begin = std::max(a.offset[d], b.offset[d]);
    const std::uint64_t end = std::min(a.offset[d] + a.extent[d], b.offset[d] + b.extent[d]);
    if (begin >= end) return false;
    result.offset[d] = begin;
    result.extent[d] = end - begin;
  }
  *common = std::move(result);
  return true;
}

Status check_tiling(std::string_view tensor, const Shape& shape, const std::vector<Box>& boxes) {
  if (boxes.size() > limits::kBoxesPerTensorMax) {
    return make_error(Errc::kLimitExceeded, "tensor '" + std::string(tensor) + "' is split into " +
                                                std::to_string(boxes.size()) + " pieces (at most " +
                                                std::to_string(limits::kBoxesPerTensorMax) + ")");
  }
  for (const Box& box : boxes) {
    if (Status valid = check_box(tensor, shape, box); !valid) return valid;
  }
  // Overlaps: a sweep along the dimension the boxes are cut most along compares only boxes that
  // meet in it (a split along one dimension is linear; a grid of n pieces is about n^1.5).
  std::uint64_t covered = 0;
  if (!shape.empty()) {
    std::size_t sweep = 0;
    std::size_t most_cuts = 0;
    std::vector<std::uint64_t> offsets(boxes.size());
    for (std::size_t d = 0; d < shape.size(); ++d) {
      for (std::size_t i = 0; i < boxes.size(); ++i) offsets[i] = boxes[i].offset[d];
      std::sort(offsets.begin(), offsets.end());
      const auto cuts = static_cast<std::size_t>(std::unique(offsets.begin(), offsets.end()) - offsets.begin());
      if (cuts > most_cuts) {
        most_cuts = cuts;
        sweep = d;
      }
    }
    std::vector<std::size_t> order(boxes.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return boxes[a].offset[sweep] < boxes[b].offset[sweep]; });
    for (std::size_t i = 0; i < order.size(); ++i) {
      const Box& box = boxes[order[i]];
      for (std::size_t j = i + 1; j < order.size(); ++j) {
        const Box& later = boxes[order[j]];
        if (later.offset[sweep] >= box.offset[sweep] + box.extent[sweep]) break;  // and so do all after it
        Box common;
        if (intersect(box, later, &common)) {
          return invalid(tensor, "boxes " + describe_box(box) + " and " + describe_box(later) +
                                     " overlap in " + describe_box(common));
        }
      }
    }
  } else if (boxes.size() > 1) {
    return invalid(tensor, "a scalar is held by " + std::to_string(boxes.size()) + " pieces");
  }
  for (const Box& box : boxes) covered += element_count(box.extent);  // disjoint, within the shape
  const std::uint64_t total = element_count(shape);
  if (covered != total) {
    return invalid(tensor, "its pieces hold " + std::to_string(covered) + " of the " + std::to_string(total) +
                               " elements of shape " + describe_shape(shape) + ": some part is in no piece");
  }
  return Unit{};
}

Result<std::vector<CopyRun>> plan_copy(std::string_view tensor, const Shape& shape,
                                       std::uint32_t element_bytes, const Box& target,
                                       const std::vector<Box>& sources) {
  TH_ASSERT(element_bytes > 0, "an element has bytes");
  TH_ASSERT(sources.size() <= limits::kBoxesPerTensorMax, "sources are one layout's pieces");
  if (Status valid = check_box(tensor, shape, target); !valid) return valid.error();
  const std::size_t rank = shape.size();
  const Shape target_strides = strides_of(target.extent);
  std::vector<CopyRun> runs;
  std::uint64_t covered = 0;
  for (std::size_t index = 0; index < sources.size(); ++index) {
    const Box& source = sources[index];
    if (Status valid = check_box(tensor, shape, source); !valid) return valid.error();
    Box common;
    if (!intersect(source, target, &common)) continue;
    covered += element_count(common.extent);
    // Inner dimensions that the source, the target and their common part all span whole are one
    // run with the dimension just outside them (which the common part may span only in part).
    std::size_t inner = rank;  // the run spans dimensions [inner, rank)
    while (inner > 0) {
      --inner;
      const bool whole =
          common.extent[inner] == source.extent[inner] && common.extent[inner] == target.extent[inner];
      if (!whole) break;
    }
    const std::uint64_t run_elements =
        element_count(Shape(common.extent.begin() + static_cast<std::ptrdiff_t>(inner), common.extent.end()));
    const std::uint64_t run_count = element_count(common.extent) / run_elements;
    if (runs.size() + run_count > limits::kCopyRunsPerTensorMax) {
      return make_error(Errc::kLimitExceeded,
                        "tensor '" + std::string(tensor) + "': filling box " + describe_box(target) +
                            " takes more than " + std::to_string(limits::kCopyRunsPerTensorMax) + " copies");
    }
    const Shape source_strides = strides_of(source.extent);
    // Walk the outer dimensions [0, inner) of the common part in row-major order.
    Shape position(inner, 0);
    for (std::uint64_t run = 0; run < run_count; ++run) {
      std::uint64_t source_offset = 0;
      std::uint64_t target_offset = 0;
      for (std::size_t d = 0; d < rank; ++d) {
        const std::uint64_t at = common.offset[d] + (d < inner ? position[d] : 0);
        source_offset += (at - source.offset[d]) * source_strides[d];
        target_offset += (at - target.offset[d]) * target_strides[d];
      }
      runs.push_back(CopyRun{static_cast<std::uint32_t>(index), source_offset * element_bytes,
                             target_offset * element_bytes, run_elements * element_bytes});
      for (std::size_t d = inner; d-- > 0;) {
        if (++position[d] < common.extent[d]) break;
        position[d] = 0;
      }
    }
  }
  const std::uint64_t wanted = element_count(target.extent);
  TH_ASSERT(covered <= wanted, "the sources overlap within the target");
  if (covered != wanted) {
    return invalid(tensor, "no piece holds part of box " + describe_box(target) + " (" +
                               std::to_string(wanted - covered) + " of its " + std::to_string(wanted) +
                               " elements)");
  }
  return runs;
}

}  // namespace th
