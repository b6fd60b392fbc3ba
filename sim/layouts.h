// What the simulated shards hold, byte for byte, and the simulated data plane's read from a source
// of another layout (README "Layouts", DESIGN.md §7-8).
//
//   content     the bytes of version v that a shard's buffers must hold, computed from v alone and
//               from where the shard's tensors sit: for the layouts workload, element e of the
//               model's logical tensor t in version v is a bfloat16 value of (model, v, t, e),
//               stored in the piece's dtype (bfloat16, or float32: exact, so every path of
//               conversions gives the same bytes). A checker thus knows the bytes a reader of any
//               layout must hold without reading anyone's buffers, and so without trusting the
//               reshard planner (core/reshard.h) the data plane below uses.
//   placements  the model's logical tensors, and each placement's pieces of them (Placement:
//               tensor parallel by rows, by columns or replicated; FSDP's uneven row chunks)
//   reshard     one reader shard's read of a complete copy of another layout (StartRead::reshard),
//               as a real client carries it out: it plans which pieces of which source shards it
//               needs, reads each whole, verifies it against its source shard's checksum, and only
//               then lands (converting the dtype) the part it needs; then it reports the checksums
//               of its tensors as assembled.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/messages.h"
#include "core/reshard.h"
#include "core/result.h"
#include "core/types.h"
#include "sim/knobs.h"

namespace th::sim {

// The checksum of one tensor's bytes (FNV-1a: any change of one byte changes it).
std::uint64_t fnv(const std::uint8_t* bytes, std::size_t size);

// A shard's layout and its tensors back to back in one buffer (in layout order), and the bytes
// of any version in it.
class ShardContent {
 public:
  // The other workloads' shard `shard`: two tensors of bytes whose every byte mixes (model,
  // version, shard, offset), so that a mix-up of any of them shows.
  //
  // `change_period` (delta versions, knob patch): 1, every byte (element) differs from one
  // version to the next; p > 1, each changes in one version of every p (at a phase of its own),
  // so that about 1/p of them change per version and a patch against the version before is small.
  static std::shared_ptr<const ShardContent> plain(std::uint32_t shard, std::uint32_t change_period = 1);
  // A shard of `placement` (the layouts workload): its pieces of the model's logical tensors.
  static std::shared_ptr<const ShardContent> placed(const Placement& placement, std::uint32_t shard,
                                                    std::uint32_t change_period = 1);
  // A shard of any layout whose tensors are all pieces of the model's logical tensors.
  static std::shared_ptr<const ShardContent> pieces(LayoutRef layout, std::uint32_t change_period = 1);

  const LayoutRef& layout() const { return layout_; }
  std::size_t size() const { return size_; }
  std::size_t offset(std::size_t tensor) const { return offsets_[tensor]; }
  // The byte at `offset` of this shard's buffer holding `version` of model `model`.
  std::uint8_t byte(int model, Version version, std::size_t offset) const;
  // All of them.
  std::vector<std::uint8_t> bytes(int model, Version version) const;
  // One per tensor, over `buffer` (size() bytes): what the publisher computes and readers verify.
  Checksums checksums(const std::vector<std::uint8_t>& buffer) const;

 private:
  ShardContent(LayoutRef layout, bool plain, std::uint32_t shard, std::uint32_t change_period);
  LayoutRef layout_;
  std::uint32_t change_period_ = 1;
  bool plain_ = false;
  std::uint32_t shard_ = 0;                  // plain: the shard whose bytes these are
  std::vector<std::size_t> offsets_;         // per tensor, where it begins; then size()
  std::vector<std::uint64_t> tensor_keys_;   // pieces: per tensor, its logical tensor's key
  std::size_t size_ = 0;
};

// The bytes of all of the model's logical tensors in bfloat16 (a TP=1 bfloat16 shard's).
std::size_t model_bytes();

// One reader shard's read across layouts, planned from a StartRead whose `reshard` lists every
// shard of the source. Pieces are read in plan order (by source shard, then tensor).
class ReshardRead {
 public:
  // The plan for the reader's tensors (`reader`: its layout, all pieces) from the source shards'
  // layouts; the error is core/reshard.h's (a tensor no source holds, a shape or dtype that does
  // not fit, a box left uncovered).
  static Result<ReshardRead> plan(const StartRead& read, const LayoutRef& reader);

  std::size_t pieces() const { return plan_.reads.size(); }
  std::uint32_t shard_of(std::size_t piece) const { return plan_.reads[piece].shard; }
  // The source shards it reads from, each once, in order.
  const std::vector<std::uint32_t>& shards() const { return shards_; }
  // Where piece `piece` sits in its source shard's buffer, as the source's layout (the one the
  // hub named) places its tensors: [first, second).
  std::pair<std::uint64_t, std::uint64_t> span(std::size_t piece) const;
  // Bytes read before piece `piece` (piece == pieces(): all of them).
  std::uint64_t bytes_before(std::size_t piece) const { return before_[piece]; }

  enum class Landed : std::uint8_t { kLanded, kChecksumMismatch, kOutOfBounds };
  // Reads piece `piece` whole from `source` (the source shard's buffer as one-sided reads see it;
  // `flip`: a bit flipped on the way, at that byte of the piece), verifies it against the source
  // shard's checksum, and only then lands what the reader needs of it in `into` (the reader's
  // buffer, its tensors back to back), converted to each tensor's dtype. A piece beyond the
  // source's buffer is refused, as a data plane refuses a read outside the registered regions.
  Landed land(std::size_t piece, const std::vector<std::uint8_t>& source,
              std::optional<std::pair<std::uint64_t, int>> flip, std::vector<std::uint8_t>& into) const;

 private:
  std::vector<LayoutRef> sources_;       // per source shard
  std::vector<ChecksumsRef> checksums_;  // per source shard
  LayoutRef reader_;
  std::vector<std::uint64_t> reader_offsets_;  // per reader tensor, where it begins in the buffer
  ReshardPlan plan_;
  std::vector<std::uint32_t> shards_;
  std::vector<std::uint64_t> before_;
};

}  // namespace th::sim
