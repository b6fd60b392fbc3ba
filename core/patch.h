#pragma once
// Patches (issue 35, DESIGN.md §7): version v of one tensor written as what changed since v-1 —
// the positions of the elements whose bits differ, and their new bits — so that a rollout that
// holds v-1 pulls a few percent of the bytes. At RL learning rates most bf16 weights keep their
// bits from one step to the next, but the few that change are spread over the whole tensor (issue
// 35: 425 of 433 blocks of 64 KiB touched in every step at lr 1e-6), so a patch names elements,
// not blocks. Pure: bytes in, bytes out; the client converts and checksums (client/patch_writer.h).
//
// Encoding (every integer little-endian):
//   header, kPatchHeaderBytes: magic "THPATCH1" | element_bytes u32 | reserved u32 (0) |
//     tensor_bytes u64 | base_checksum u64 | changed_elements u64
//   then one section per block of kPatchBlockBytes of the tensor (the last may be shorter), in
//   order, each: kind u8 | changed u32 (elements of the block) | payload_bytes u32 | payload
//     kUnchanged: changed 0, no payload;
//     kGaps:   the positions as LEB128 varints, each the distance from the previous changed element
//              less one (the first: its index in the block), then the changed elements' new bytes;
//     kBitmap: a bit per element of the block (least significant first), then the new bytes.
// Why blocks of 1 MiB: they are the checksum's blocks (client/checksum.h), so a reader can apply
// and verify a block at a time; every position is bounded by its block; and each block chooses its
// own encoding. Why two encodings: gaps cost about a byte per change (a gap under 128), a bitmap an
// eighth of a byte per element: gaps win below about one element in eight changed (lr 1e-6: 2-3 %),
// the bitmap above (lr 1e-5: 20 %). Why the new bits and not an XOR with the old: without an
// entropy coder an XOR is as long, and compressing costs the trainer time on every step.
// The base checksum is v-1's, as its publisher announced it: a reader that holds another v-1 (a
// run that restarted) is refused before a byte changes.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "core/result.h"

namespace th {

inline constexpr std::uint64_t kPatchBlockBytes = std::uint64_t{1} << 20;

// The largest patch of a tensor of `tensor_bytes` anyone makes, serves or reads: 2/5 (40 %) of it.
// Past that a read of the bytes costs little more, and the holders of a patch would keep that much
// besides their weights. The hub refuses a publish that announces more (Hub::check_patch).
constexpr std::uint64_t patch_bytes_limit(std::uint64_t tensor_bytes) {
  return tensor_bytes / 5 * 2 + tensor_bytes % 5 * 2 / 5;
}
inline constexpr std::size_t kPatchHeaderBytes = 40;
inline constexpr std::size_t kPatchSectionHeaderBytes = 9;

enum class PatchBlockKind : std::uint8_t { kUnchanged = 0, kGaps = 1, kBitmap = 2 };

struct PatchHeader {
  std::uint32_t element_bytes = 0;
  std::uint64_t tensor_bytes = 0;
  std::uint64_t base_checksum = 0;
  std::uint64_t changed_elements = 0;
};

// Builds a patch from the changes of one tensor, element by element in increasing position (as a
// writer meets them). Keeps the patch, at most `bytes_max` of it (reserved once: it is never
// copied while it grows), and while a block is open its positions (4 bytes each) and new values:
// at most 5 MiB besides, whatever the tensor. Past bytes_max it gives up (a dense read is
// cheaper) and frees what it built: gave_up() and finish() return nothing.
class PatchBuilder {
 public:
  PatchBuilder(std::uint32_t element_bytes, std::uint64_t tensor_bytes, std::uint64_t base_checksum,
               std::uint64_t bytes_max);

  // The element at `position` (in elements from the tensor's start) now holds `new_bytes`
  // (element_bytes of them). Positions strictly increase.
  void changed(std::uint64_t position, const std::byte* new_bytes);
  // The patch, once every element was seen; nothing if it gave up. Call once.
  std::optional<std::vector<std::byte>> finish();

  bool gave_up() const { return gave_up_; }
  std::uint64_t changed_elements() const { return changed_elements_; }

 private:
  void close_blocks_before(std::uint64_t block);
  void close_block();
  void give_up();

  std::uint32_t element_bytes_;
  std::uint64_t tensor_bytes_;
  std::uint64_t elements_per_block_;
  std::uint64_t blocks_;
  std::uint64_t bytes_max_;
  std::vector<std::byte> out_;
  std::uint64_t block_ = 0;  // the open block (== blocks_ once all are closed)
  std::vector<std::uint32_t> block_positions_;
  std::vector<std::byte> block_values_;
  std::optional<std::uint64_t> last_position_;
  std::uint64_t changed_elements_ = 0;
  bool gave_up_ = false;
  bool finished_ = false;
};

// The header of a patch, checked for what the header alone can say (magic, sizes, reserved 0).
Result<PatchHeader> read_patch_header(std::span<const std::byte> patch);

// Applies `patch` to `tensor` (tensor_bytes of `element_bytes` elements, holding v-1, whose
// checksum is `base_checksum`), in place. The whole patch is checked before a byte of the tensor
// is written: a malformed or hostile patch (a position past its block, a payload that says one
// length and holds another, trailing bytes, a base or size that is not the tensor's) is an error
// naming what is wrong, and leaves the tensor as it was. A well-formed patch with wrong values is
// the caller's checksum's to catch. Returns the elements changed. The patch must not overlap the
// tensor, and must not change during the call (it is read twice: checked, then applied).
Result<std::uint64_t> apply_patch(std::span<const std::byte> patch, std::uint32_t element_bytes,
                                  std::span<std::byte> tensor, std::uint64_t base_checksum);

}  // namespace th
