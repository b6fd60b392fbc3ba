#include "core/patch.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>

#include "core/assert.h"

namespace th {
namespace {

constexpr char kMagic[8] = {'T', 'H', 'P', 'A', 'T', 'C', 'H', '1'};

void put_u32(std::vector<std::byte>& out, std::uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::byte>(value >> (8 * i)));
}
void put_u64(std::vector<std::byte>& out, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>(value >> (8 * i)));
}
std::size_t varint_bytes(std::uint32_t value) {
  std::size_t bytes = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++bytes;
  }
  return bytes;
}
void put_varint(std::vector<std::byte>& out, std::uint32_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<std::byte>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<std::byte>(value));
}

std::uint64_t blocks_of(std::uint64_t tensor_bytes) {
  return tensor_bytes / kPatchBlockBytes + (tensor_bytes % kPatchBlockBytes != 0 ? 1 : 0);
}
std::uint64_t block_elements(std::uint64_t block, std::uint64_t tensor_bytes, std::uint32_t element_bytes) {
  const std::uint64_t start = block * kPatchBlockBytes;
  return (std::min(tensor_bytes, start + kPatchBlockBytes) - start) / element_bytes;
}
std::uint64_t bitmap_bytes(std::uint64_t elements) { return (elements + 7) / 8; }

bool valid_element_bytes(std::uint32_t element_bytes) {
  // A block holds whole elements: every dtype's size divides kPatchBlockBytes.
  return element_bytes == 1 || element_bytes == 2 || element_bytes == 4 || element_bytes == 8;
}

// The caller's element size, checked before anything divides by it.
std::uint32_t required_element_bytes(std::uint32_t element_bytes) {
  TH_REQUIRE(valid_element_bytes(element_bytes), "elements of 1, 2, 4 or 8 bytes", element_bytes);
  return element_bytes;
}

// Reads a patch front to back, every bound checked. With `tensor` null it only checks; with a
// tensor it writes the new elements (apply_patch runs it twice: check, then write, so that a bad
// patch changes nothing).
class Reader {
 public:
  explicit Reader(std::span<const std::byte> patch) : patch_(patch) {}

  bool take(std::size_t bytes, const std::byte*& at) {
    if (patch_.size() - offset_ < bytes) return false;
    at = patch_.data() + offset_;
    offset_ += bytes;
    return true;
  }
  bool u8(std::uint8_t& value) {
    const std::byte* at = nullptr;
    if (!take(1, at)) return false;
    value = static_cast<std::uint8_t>(*at);
    return true;
  }
  template <typename T>
  bool uint(T& value) {
    const std::byte* at = nullptr;
    if (!take(sizeof(T), at)) return false;
    value = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) value |= static_cast<T>(static_cast<std::uint8_t>(at[i])) << (8 * i);
    return true;
  }
  // A LEB128 varint of at most 5 bytes that fits 32 bits.
  bool varint(std::uint32_t& value) {
    std::uint64_t result = 0;
    for (int shift = 0; shift < 35; shift += 7) {
      std::uint8_t byte = 0;
      if (!u8(byte)) return false;
      result |= static_cast<std::uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) {
        if (result > UINT32_MAX) return false;
        value = static_cast<std::uint32_t>(result);
        return true;
      }
    }
    return false;
  }
  std::size_t left() const { return patch_.size() - offset_; }

 private:
  std::span<const std::byte> patch_;
  std::size_t offset_ = 0;
};

Error malformed(const std::string& what) { return make_error(Errc::kInvalidArgument, "malformed patch: " + what); }

Result<PatchHeader> parse_header(Reader& reader) {
  const std::byte* magic = nullptr;
  if (!reader.take(sizeof kMagic, magic) || std::memcmp(magic, kMagic, sizeof kMagic) != 0) {
    return malformed("it does not start with THPATCH1");
  }
  PatchHeader header;
  std::uint32_t reserved = 0;
  if (!reader.uint(header.element_bytes) || !reader.uint(reserved) || !reader.uint(header.tensor_bytes) ||
      !reader.uint(header.base_checksum) || !reader.uint(header.changed_elements)) {
    return malformed("its header is cut short");
  }
  if (!valid_element_bytes(header.element_bytes)) {
    return malformed("elements of " + std::to_string(header.element_bytes) + " bytes");
  }
  if (reserved != 0) return malformed("a reserved word is not 0");
  if (header.tensor_bytes % header.element_bytes != 0) {
    return malformed("a tensor of " + std::to_string(header.tensor_bytes) + " bytes is not whole elements");
  }
  if (header.changed_elements > header.tensor_bytes / header.element_bytes) {
    return malformed("more changed elements than the tensor has");
  }
  return header;
}

// One block's section: checks it and, with a tensor, writes it.
Result<std::uint64_t> parse_block(Reader& reader, const PatchHeader& header, std::uint64_t block,
                                  std::byte* tensor) {
  const std::string where = "block " + std::to_string(block) + ": ";
  std::uint8_t kind = 0;
  std::uint32_t changed = 0;
  std::uint32_t payload_bytes = 0;
  if (!reader.u8(kind) || !reader.uint(changed) || !reader.uint(payload_bytes)) {
    return malformed(where + "the section's header is cut short");
  }
  if (payload_bytes > reader.left()) return malformed(where + "the payload runs past the patch's end");
  const std::uint64_t elements = block_elements(block, header.tensor_bytes, header.element_bytes);
  const std::uint64_t eb = header.element_bytes;
  if (changed > elements) return malformed(where + "more changes than elements");
  std::byte* block_start = tensor == nullptr ? nullptr : tensor + block * kPatchBlockBytes;
  switch (static_cast<PatchBlockKind>(kind)) {
    case PatchBlockKind::kUnchanged:
      if (changed != 0 || payload_bytes != 0) return malformed(where + "an unchanged block with a payload");
      return std::uint64_t{0};
    case PatchBlockKind::kGaps: {
      if (changed == 0) return malformed(where + "a list of no positions");
      // The positions come first, the values after them: find where the values start by reading
      // every position, then write them in a second walk over the same bytes.
      const std::uint64_t values_bytes = std::uint64_t{changed} * eb;
      if (values_bytes > payload_bytes) return malformed(where + "the payload is shorter than its values");
      const std::size_t positions_bytes = payload_bytes - static_cast<std::size_t>(values_bytes);
      const std::byte* positions_at = nullptr;
      const std::byte* values_at = nullptr;
      if (!reader.take(positions_bytes, positions_at) || !reader.take(values_bytes, values_at)) {
        return malformed(where + "the payload is cut short");
      }
      Reader walk(std::span<const std::byte>(positions_at, positions_bytes));
      std::uint64_t position = 0;
      for (std::uint32_t i = 0; i < changed; ++i) {
        std::uint32_t gap = 0;
        if (!walk.varint(gap)) return malformed(where + "a position is cut short or too long");
        position = (i == 0 ? 0 : position + 1) + gap;
        if (position >= elements) {
          return malformed(where + "a position past the block's " + std::to_string(elements) + " elements");
        }
        if (block_start != nullptr) std::memcpy(block_start + position * eb, values_at + i * eb, eb);
      }
      if (walk.left() != 0) return malformed(where + "bytes between the positions and the values");
      return std::uint64_t{changed};
    }
    case PatchBlockKind::kBitmap: {
      const std::uint64_t map_bytes = bitmap_bytes(elements);
      if (std::uint64_t{payload_bytes} != map_bytes + std::uint64_t{changed} * eb) {
        return malformed(where + "a bitmap payload of the wrong length");
      }
      const std::byte* map = nullptr;
      const std::byte* values_at = nullptr;
      if (!reader.take(map_bytes, map) || !reader.take(std::size_t{changed} * eb, values_at)) {
        return malformed(where + "the payload is cut short");
      }
      std::uint64_t set = 0;
      for (std::uint64_t byte = 0; byte < map_bytes; ++byte) {
        auto bits = static_cast<std::uint8_t>(map[byte]);
        if (byte == map_bytes - 1 && elements % 8 != 0 && (bits >> (elements % 8)) != 0) {
          return malformed(where + "bits past the block's last element");
        }
        set += static_cast<std::uint64_t>(std::popcount(bits));
        if (set > changed) return malformed(where + "more bits set than changes");
        while (bits != 0 && block_start != nullptr) {
          const int bit = std::countr_zero(bits);
          bits &= static_cast<std::uint8_t>(bits - 1);
          const std::uint64_t position = byte * 8 + static_cast<std::uint64_t>(bit);
          const std::uint64_t index = set - static_cast<std::uint64_t>(std::popcount(bits)) - 1;
          std::memcpy(block_start + position * eb, values_at + index * eb, eb);
        }
      }
      if (set != changed) return malformed(where + "fewer bits set than changes");
      return std::uint64_t{changed};
    }
  }
  return malformed(where + "a section of unknown kind " + std::to_string(kind));
}

Result<std::uint64_t> parse(std::span<const std::byte> patch, std::uint32_t element_bytes, std::uint64_t tensor_bytes,
                            std::uint64_t base_checksum, std::byte* tensor) {
  Reader reader(patch);
  auto header = parse_header(reader);
  if (!header.ok()) return header.error();
  if (header.value().element_bytes != element_bytes || header.value().tensor_bytes != tensor_bytes) {
    return make_error(Errc::kLayoutMismatch,
                      "patch of " + std::to_string(header.value().tensor_bytes) + " bytes in elements of " +
                          std::to_string(header.value().element_bytes) + " for a tensor of " +
                          std::to_string(tensor_bytes) + " bytes in elements of " + std::to_string(element_bytes));
  }
  if (header.value().base_checksum != base_checksum) {
    return make_error(Errc::kChecksumConflict, "the patch is against another base (its checksum " +
                                                   std::to_string(header.value().base_checksum) + ", the tensor's " +
                                                   std::to_string(base_checksum) + ")");
  }
  std::uint64_t changed = 0;
  const std::uint64_t blocks = blocks_of(tensor_bytes);
  for (std::uint64_t block = 0; block < blocks; ++block) {
    auto in_block = parse_block(reader, header.value(), block, tensor);
    if (!in_block.ok()) return in_block.error();
    changed += in_block.value();
  }
  if (reader.left() != 0) return malformed(std::to_string(reader.left()) + " bytes past the last block");
  if (changed != header.value().changed_elements) {
    return malformed("the blocks change " + std::to_string(changed) + " elements, the header says " +
                     std::to_string(header.value().changed_elements));
  }
  return changed;
}

}  // namespace

PatchBuilder::PatchBuilder(std::uint32_t element_bytes, std::uint64_t tensor_bytes, std::uint64_t base_checksum,
                           std::uint64_t bytes_max)
    : element_bytes_(required_element_bytes(element_bytes)),
      tensor_bytes_(tensor_bytes),
      elements_per_block_(kPatchBlockBytes / element_bytes_),
      blocks_(blocks_of(tensor_bytes)),
      bytes_max_(bytes_max) {
  TH_REQUIRE(tensor_bytes % element_bytes == 0, "a tensor of whole elements", tensor_bytes, element_bytes);
  // The most the patch can take: at most bytes_max, at most every block as a bitmap with all its
  // elements. Reserved once, so that the patch is never copied while it grows (a vector that
  // doubles holds both copies at once); the pages it never writes cost no memory.
  const std::uint64_t worst_bytes = kPatchHeaderBytes + blocks_ * kPatchSectionHeaderBytes + tensor_bytes +
                                    bitmap_bytes(tensor_bytes / element_bytes_) + blocks_;
  out_.reserve(static_cast<std::size_t>(std::min(bytes_max_, worst_bytes)));
  // And the open block's positions and values, once (at most 4 MiB and 1 MiB: a block's elements).
  block_positions_.reserve(static_cast<std::size_t>(std::min(elements_per_block_, tensor_bytes / element_bytes_)));
  block_values_.reserve(static_cast<std::size_t>(std::min(kPatchBlockBytes, tensor_bytes)));
  out_.insert(out_.end(), reinterpret_cast<const std::byte*>(kMagic),
              reinterpret_cast<const std::byte*>(kMagic) + sizeof kMagic);
  put_u32(out_, element_bytes);
  put_u32(out_, 0);
  put_u64(out_, tensor_bytes);
  put_u64(out_, base_checksum);
  put_u64(out_, 0);  // changed_elements, filled in by finish()
  TH_ASSERT(out_.size() == kPatchHeaderBytes);
  // Even a patch of no change costs a header and a section per block.
  if (out_.size() + blocks_ * kPatchSectionHeaderBytes > bytes_max_) give_up();
}

void PatchBuilder::changed(std::uint64_t position, const std::byte* new_bytes) {
  TH_REQUIRE(!finished_, "a finished patch takes no more changes");
  TH_REQUIRE(!last_position_ || position > *last_position_, "positions increase", position);
  TH_REQUIRE(position < tensor_bytes_ / element_bytes_, "a position inside the tensor", position);
  last_position_ = position;
  ++changed_elements_;
  if (gave_up_) return;
  const std::uint64_t block = position / elements_per_block_;
  close_blocks_before(block);
  if (gave_up_) return;
  block_positions_.push_back(static_cast<std::uint32_t>(position % elements_per_block_));
  block_values_.insert(block_values_.end(), new_bytes, new_bytes + element_bytes_);
  // The values alone of the open block already pass the limit: no encoding of it fits.
  if (out_.size() + block_values_.size() + (blocks_ - block_) * kPatchSectionHeaderBytes > bytes_max_) give_up();
}

void PatchBuilder::close_blocks_before(std::uint64_t block) {
  while (block_ < block && !gave_up_) close_block();
}

void PatchBuilder::close_block() {
  TH_ASSERT(block_ < blocks_);
  const std::uint64_t elements = block_elements(block_, tensor_bytes_, element_bytes_);
  const auto changed = static_cast<std::uint32_t>(block_positions_.size());
  TH_ASSERT(changed <= elements);
  if (changed == 0) {
    out_.push_back(static_cast<std::byte>(PatchBlockKind::kUnchanged));
    put_u32(out_, 0);
    put_u32(out_, 0);
  } else {
    std::uint64_t gaps_bytes = 0;
    for (std::size_t i = 0; i < block_positions_.size(); ++i) {
      gaps_bytes += varint_bytes(i == 0 ? block_positions_[i] : block_positions_[i] - block_positions_[i - 1] - 1);
    }
    const std::uint64_t map_bytes = bitmap_bytes(elements);
    const bool gaps = gaps_bytes <= map_bytes;
    const std::uint64_t payload_bytes = (gaps ? gaps_bytes : map_bytes) + block_values_.size();
    // Given up before the section is appended: out_ never grows past bytes_max (nor past what
    // the constructor reserved, so it is never copied).
    if (out_.size() + kPatchSectionHeaderBytes + payload_bytes + (blocks_ - block_ - 1) * kPatchSectionHeaderBytes >
        bytes_max_) {
      give_up();
      return;
    }
    out_.push_back(static_cast<std::byte>(gaps ? PatchBlockKind::kGaps : PatchBlockKind::kBitmap));
    put_u32(out_, changed);
    put_u32(out_, static_cast<std::uint32_t>(payload_bytes));
    const std::size_t payload_start = out_.size();
    if (gaps) {
      for (std::size_t i = 0; i < block_positions_.size(); ++i) {
        put_varint(out_, i == 0 ? block_positions_[i] : block_positions_[i] - block_positions_[i - 1] - 1);
      }
    } else {
      const std::size_t map_start = out_.size();
      out_.resize(out_.size() + map_bytes);
      for (const std::uint32_t position : block_positions_) {
        out_[map_start + position / 8] |= static_cast<std::byte>(1u << (position % 8));
      }
    }
    out_.insert(out_.end(), block_values_.begin(), block_values_.end());
    TH_ASSERT(out_.size() - payload_start == payload_bytes);
  }
  block_positions_.clear();
  block_values_.clear();
  ++block_;
  if (out_.size() + (blocks_ - block_) * kPatchSectionHeaderBytes > bytes_max_) give_up();
}

void PatchBuilder::give_up() {
  gave_up_ = true;
  // What was built is dropped, its memory too: the trainer keeps no more than bytes_max.
  std::vector<std::byte>().swap(out_);
  std::vector<std::uint32_t>().swap(block_positions_);
  std::vector<std::byte>().swap(block_values_);
}

std::optional<std::vector<std::byte>> PatchBuilder::finish() {
  TH_REQUIRE(!finished_, "finish() once");
  finished_ = true;
  close_blocks_before(blocks_);
  if (gave_up_) return std::nullopt;
  TH_ASSERT(block_ == blocks_ && out_.size() <= bytes_max_);
  for (int i = 0; i < 8; ++i) out_[kPatchHeaderBytes - 8 + i] = static_cast<std::byte>(changed_elements_ >> (8 * i));
  return std::move(out_);
}

Result<PatchHeader> read_patch_header(std::span<const std::byte> patch) {
  Reader reader(patch);
  return parse_header(reader);
}

Result<std::uint64_t> apply_patch(std::span<const std::byte> patch, std::uint32_t element_bytes,
                                  std::span<std::byte> tensor, std::uint64_t base_checksum) {
  TH_REQUIRE(valid_element_bytes(element_bytes), "elements of 1, 2, 4 or 8 bytes", element_bytes);
  auto checked = parse(patch, element_bytes, tensor.size(), base_checksum, nullptr);
  if (!checked.ok()) return checked;
  auto written = parse(patch, element_bytes, tensor.size(), base_checksum, tensor.data());
  TH_ASSERT(written.ok() && written.value() == checked.value(), "a patch checked once reads the same twice");
  return written;
}

}  // namespace th
