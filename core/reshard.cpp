#include "core/reshard.h"

#include <algorithm>
#include <map>
#include <string_view>
#include <utility>

namespace th {
namespace {

// A logical tensor as the source replica holds it: its distinct boxes and who holds each.
struct Holder {
  std::uint32_t shard = 0;
  std::uint32_t tensor = 0;
};
struct Logical {
  DType dtype = DType::kBFloat16;
  Shape shape;
  std::vector<Box> boxes;
  std::vector<std::vector<Holder>> holders;  // per box
};

Error refused(const Destination& destination, const std::string& why) {
  return make_error(Errc::kLayoutMismatch, "destination '" + destination.name + "': " + why);
}

bool is_float(DType dtype) {
  return dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32;
}

// The smallest box holding both.
Box bounding(const Box& a, const Box& b) {
  Box joined = a;
  for (std::size_t d = 0; d < a.offset.size(); ++d) {
    const std::uint64_t end = std::max(a.offset[d] + a.extent[d], b.offset[d] + b.extent[d]);
    joined.offset[d] = std::min(a.offset[d], b.offset[d]);
    joined.extent[d] = end - joined.offset[d];
  }
  return joined;
}

}  // namespace

bool converts(DType from, DType to) { return from == to || (is_float(from) && is_float(to)); }

Result<ReshardPlan> plan_reshard(const std::vector<LayoutRef>& source, const std::vector<Destination>& destinations,
                                 std::uint32_t spread) {
  std::map<std::string_view, Logical> logical;
  for (std::uint32_t shard = 0; shard < source.size(); ++shard) {
    TH_ASSERT(source[shard] != nullptr, "every source shard has a layout");
    const auto& tensors = source[shard]->tensors();
    for (std::uint32_t index = 0; index < tensors.size(); ++index) {
      const TensorSpec& tensor = tensors[index];
      if (tensor.kind != TensorKind::kPiece) continue;
      auto [entry, fresh] = logical.try_emplace(tensor.name);
      Logical& held = entry->second;
      if (fresh) {
        held.dtype = tensor.dtype;
        held.shape = tensor.shape;
      }
      TH_ASSERT(held.dtype == tensor.dtype && held.shape == tensor.shape, "the source's pieces agree (checked at publish)");
      const auto box = std::find(held.boxes.begin(), held.boxes.end(), tensor.box);
      if (box == held.boxes.end()) {
        held.boxes.push_back(tensor.box);
        held.holders.push_back({Holder{shard, index}});
      } else {
        held.holders[static_cast<std::size_t>(box - held.boxes.begin())].push_back(Holder{shard, index});
      }
    }
  }

  ReshardPlan plan;
  std::map<std::pair<std::uint32_t, std::uint32_t>, PieceRead> reads;
  for (std::uint32_t index = 0; index < destinations.size(); ++index) {
    const Destination& destination = destinations[index];
    if (destination.segments.empty()) return refused(destination, "it has no segment");
    const Segment& first = destination.segments.front();
    std::uint64_t base = 0;  // where the segment begins in the destination's buffer, in elements
    for (const Segment& segment : destination.segments) {
      const std::string tensor = "tensor '" + segment.tensor + "'";
      if (Status valid = check_box(segment.tensor, segment.shape, segment.box); !valid) {
        return refused(destination, valid.error().detail);
      }
      const bool same_inner = segment.box.extent.size() == first.box.extent.size() &&
                              std::equal(segment.box.extent.begin() + (segment.box.extent.empty() ? 0 : 1),
                                         segment.box.extent.end(),
                                         first.box.extent.begin() + (first.box.extent.empty() ? 0 : 1));
      if (!same_inner || (segment.box.extent.empty() && destination.segments.size() > 1)) {
        return refused(destination, tensor + "'s box " + describe_box(segment.box) + " and " + "tensor '" +
                                        first.tensor + "''s box " + describe_box(first.box) +
                                        " differ beyond dimension 0: segments stack along dimension 0 only");
      }
      const auto found = logical.find(segment.tensor);
      if (found == logical.end()) return refused(destination, tensor + " is a piece on no shard of the source");
      const Logical& held = found->second;
      if (held.shape != segment.shape) {
        return refused(destination, tensor + ": global shape " + describe_shape(held.shape) + " in the source, " +
                                        describe_shape(segment.shape) + " here");
      }
      if (!converts(held.dtype, destination.dtype)) {
        return refused(destination, tensor + ": dtype " + std::string(dtype_name(held.dtype)) + " in the source, " +
                                        std::string(dtype_name(destination.dtype)) +
                                        " here (only bfloat16, float16 and float32 convert on landing)");
      }
      auto runs = plan_copy(segment.tensor, held.shape, 1, segment.box, held.boxes);
      if (!runs.ok()) {
        if (runs.error().code == Errc::kLimitExceeded) return runs.error();
        return refused(destination, runs.error().detail);
      }
      for (const CopyRun& run : runs.value()) {
        const auto& holders = held.holders[run.source];
        const Holder& holder = holders[spread % holders.size()];
        PieceRead& read = reads[{holder.shard, holder.tensor}];
        Box common;
        const bool meet = intersect(held.boxes[run.source], segment.box, &common);
        TH_ASSERT(meet, "a run comes from a piece that meets the segment");
        if (read.landings.empty()) {
          read.shard = holder.shard;
          read.tensor = holder.tensor;
          read.needed = common;
        } else {
          read.needed = bounding(read.needed, common);
        }
        if (read.landings.empty() || read.landings.back().destination != index) {
          read.landings.push_back(Landing{index, {}});
        }
        read.landings.back().runs.push_back(
            ElementRun{run.source_offset_bytes, base + run.target_offset_bytes, run.bytes});
      }
      const std::uint64_t elements = element_count(segment.box.extent);
      base += elements;
      plan.elements_needed += elements;
    }
  }
  plan.reads.reserve(reads.size());
  for (auto& [key, read] : reads) {
    const Box& piece = source[read.shard]->tensors()[read.tensor].box;
    read.whole = read.needed == piece;
    plan.elements_in_needed_boxes += element_count(read.needed.extent);
    plan.reads.push_back(std::move(read));
  }
  return plan;
}

}  // namespace th
