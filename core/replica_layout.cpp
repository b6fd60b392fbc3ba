#include "core/replica_layout.h"

#include <algorithm>
#include <map>
#include <string>
#include <string_view>
#include <tuple>

#include "core/box.h"

namespace th {
namespace {

struct Pieces {
  const TensorSpec* first = nullptr;  // the lowest shard's piece: dtype and shape to agree with
  std::uint32_t first_shard = 0;
  std::vector<Box> boxes;
  std::vector<std::uint32_t> owners;  // the shard of each box
};

Error mismatch(const std::string& why) { return make_error(Errc::kLayoutMismatch, why); }

}  // namespace

Status check_replica_pieces(const std::vector<LayoutRef>& shards) {
  bool any_piece = false;  // the layouts of before (no pieces) cost one pass
  for (const LayoutRef& layout : shards) {
    TH_ASSERT(layout != nullptr, "every shard published a layout");
    for (const TensorSpec& tensor : layout->tensors()) any_piece = any_piece || tensor.kind == TensorKind::kPiece;
  }
  if (!any_piece) return Unit{};
  std::map<std::string_view, Pieces> by_name;
  std::size_t pieces_total = 0;
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    for (const TensorSpec& tensor : shards[shard]->tensors()) {
      if (tensor.kind != TensorKind::kPiece) continue;
      if (++pieces_total > limits::kPiecesPerReplicaMax) {
        return make_error(Errc::kLimitExceeded, "a replica's shards hold more than " +
                                                    std::to_string(limits::kPiecesPerReplicaMax) +
                                                    " pieces of tensors");
      }
      Pieces& pieces = by_name[tensor.name];
      if (pieces.first == nullptr) {
        pieces.first = &tensor;
        pieces.first_shard = shard;
      } else if (pieces.first->dtype != tensor.dtype || pieces.first->shape != tensor.shape) {
        return mismatch("tensor '" + tensor.name + "': shard " + std::to_string(pieces.first_shard) + " holds a piece of " +
                        std::string(dtype_name(pieces.first->dtype)) + " " + describe_shape(pieces.first->shape) +
                        ", shard " + std::to_string(shard) + " of " + std::string(dtype_name(tensor.dtype)) + " " +
                        describe_shape(tensor.shape));
      }
      pieces.boxes.push_back(tensor.box);
      pieces.owners.push_back(shard);
    }
  }
  // A name some shard holds as its own (or as bytes) must be a piece nowhere.
  for (std::uint32_t shard = 0; shard < shards.size(); ++shard) {
    for (const TensorSpec& tensor : shards[shard]->tensors()) {
      if (tensor.kind == TensorKind::kPiece) continue;
      if (const auto piece = by_name.find(tensor.name); piece != by_name.end()) {
        return mismatch("tensor '" + tensor.name + "' is a piece of the model's tensor on shard " +
                        std::to_string(piece->second.first_shard) + " but shard " + std::to_string(shard) +
                        "'s own tensor: give one of them another name");
      }
    }
  }
  for (const auto& [name, pieces] : by_name) {
    // Shards may each hold the same box (a tensor every tensor-parallel rank keeps whole, such
    // as a norm's weight): one piece, several holders. Boxes that differ must not overlap.
    std::vector<Box> distinct = pieces.boxes;
    std::sort(distinct.begin(), distinct.end(), [](const Box& a, const Box& b) {
      return std::tie(a.offset, a.extent) < std::tie(b.offset, b.extent);
    });
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    Status tiled = check_tiling(name, pieces.first->shape, distinct);
    if (!tiled) {
      // check_tiling names the boxes; say whose they are.
      std::string whose;
      for (std::size_t i = 0; i < pieces.boxes.size() && i < 16; ++i) {
        whose += (i ? ", " : "") + std::string("shard ") + std::to_string(pieces.owners[i]) + " " +
                 describe_box(pieces.boxes[i]);
      }
      if (pieces.boxes.size() > 16) whose += ", …";
      const Errc code = tiled.error().code == Errc::kLimitExceeded ? Errc::kLimitExceeded : Errc::kLayoutMismatch;
      return make_error(code, tiled.error().detail + " (pieces: " + whose + ")");
    }
  }
  return Unit{};
}

}  // namespace th
