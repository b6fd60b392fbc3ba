// Patches (core/patch.h): a version written as what changed since the one before. The model here
// is the two tensors themselves: a patch built from the elements whose bytes differ must turn the
// old tensor into the new one exactly, be no longer than the cheaper encoding of each block allows,
// and a damaged patch must either be refused with the old tensor untouched or apply as some patch.
#include "core/patch.h"

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/assert.h"

namespace th {
namespace {

using Bytes = std::vector<std::byte>;

// Tests may draw numbers: splitmix64, so that megabytes of tensor cost one seed to generate.
struct Stream {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  bool chance(std::uint64_t per_million) { return next() % 1000000 < per_million; }
};

Bytes random_bytes(std::uint64_t bytes, std::uint64_t seed) {
  Stream stream{seed};
  Bytes out(bytes);
  for (auto& byte : out) byte = static_cast<std::byte>(stream.next());
  return out;
}

// A new version of `base`: each element changed with the given chance (in millionths).
Bytes changed_copy(const Bytes& base, std::uint32_t element_bytes, std::uint64_t per_million, std::uint64_t seed) {
  Stream stream{seed};
  Bytes out = base;
  for (std::size_t at = 0; at < out.size(); at += element_bytes) {
    if (!stream.chance(per_million)) continue;
    out[at] ^= static_cast<std::byte>(1 + stream.next() % 255);  // certainly another element
  }
  return out;
}

// The patch of old -> new, fed as a writer meets the changes.
std::optional<Bytes> patch_of(const Bytes& old_tensor, const Bytes& new_tensor, std::uint32_t element_bytes,
                              std::uint64_t base_checksum, std::uint64_t bytes_max) {
  PatchBuilder builder(element_bytes, old_tensor.size(), base_checksum, bytes_max);
  for (std::size_t at = 0; at < old_tensor.size(); at += element_bytes) {
    if (std::memcmp(&old_tensor[at], &new_tensor[at], element_bytes) != 0) {
      builder.changed(at / element_bytes, &new_tensor[at]);
    }
  }
  return builder.finish();
}

std::uint64_t changed_elements(const Bytes& a, const Bytes& b, std::uint32_t element_bytes) {
  std::uint64_t changed = 0;
  for (std::size_t at = 0; at < a.size(); at += element_bytes) changed += std::memcmp(&a[at], &b[at], element_bytes) != 0;
  return changed;
}

// The longest a patch may be: per block the cheaper of a varint per change (at most 5 bytes) and
// a bitmap, and every new element.
std::uint64_t patch_bytes_bound(const Bytes& a, const Bytes& b, std::uint32_t element_bytes) {
  std::uint64_t bound = kPatchHeaderBytes;
  for (std::uint64_t start = 0; start < a.size(); start += kPatchBlockBytes) {
    const std::uint64_t end = std::min<std::uint64_t>(a.size(), start + kPatchBlockBytes);
    std::uint64_t changed = 0;
    for (std::uint64_t at = start; at < end; at += element_bytes) changed += std::memcmp(&a[at], &b[at], element_bytes) != 0;
    const std::uint64_t elements = (end - start) / element_bytes;
    bound += kPatchSectionHeaderBytes + changed * element_bytes + std::min(5 * changed, (elements + 7) / 8);
  }
  return bound;
}

constexpr std::uint64_t kNoLimit = ~std::uint64_t{0};
constexpr std::uint64_t kBase = 0x1234;

RC_GTEST_PROP(Patch, TurnsTheOldTensorIntoTheNewOneExactly, ()) {
  const auto element_bytes = *rc::gen::elementOf(std::vector<std::uint32_t>{1, 2, 4, 8});
  // Up to three blocks and a bit, often just around a block's end.
  const auto blocks = *rc::gen::inRange<std::uint64_t>(0, 3);
  const auto slack = *rc::gen::inRange<std::int64_t>(-3, 4);
  const std::int64_t signed_elements =
      static_cast<std::int64_t>(blocks * kPatchBlockBytes / element_bytes) + slack * (*rc::gen::inRange(1, 300));
  const auto elements = static_cast<std::uint64_t>(std::max<std::int64_t>(0, signed_elements));
  const auto per_million = *rc::gen::elementOf(std::vector<std::uint64_t>{0, 1, 300, 30000, 200000, 700000, 1000000});
  const auto seed = *rc::gen::arbitrary<std::uint64_t>();
  const Bytes old_tensor = random_bytes(elements * element_bytes, seed);
  const Bytes new_tensor = changed_copy(old_tensor, element_bytes, per_million, seed + 1);

  auto patch = patch_of(old_tensor, new_tensor, element_bytes, kBase, kNoLimit);
  RC_ASSERT(patch.has_value());
  RC_ASSERT(patch->size() <= patch_bytes_bound(old_tensor, new_tensor, element_bytes));
  auto header = read_patch_header(*patch);
  RC_ASSERT(header.ok());
  RC_ASSERT(header.value().element_bytes == element_bytes);
  RC_ASSERT(header.value().tensor_bytes == old_tensor.size());
  RC_ASSERT(header.value().base_checksum == kBase);
  RC_ASSERT(header.value().changed_elements == changed_elements(old_tensor, new_tensor, element_bytes));

  Bytes tensor = old_tensor;
  auto applied = apply_patch(*patch, element_bytes, tensor, kBase);
  RC_ASSERT(applied.ok());
  RC_ASSERT(applied.value() == header.value().changed_elements);
  RC_ASSERT(tensor == new_tensor);

  // A limit below the patch's size gives it up; at its size keeps it.
  RC_ASSERT(!patch_of(old_tensor, new_tensor, element_bytes, kBase, patch->size() - 1).has_value());
  RC_ASSERT(patch_of(old_tensor, new_tensor, element_bytes, kBase, patch->size()) == patch);
}

RC_GTEST_PROP(Patch, ADamagedPatchIsRefusedWithTheTensorUntouchedOrAppliesAsAnother, ()) {
  const auto element_bytes = *rc::gen::elementOf(std::vector<std::uint32_t>{1, 2, 4});
  const auto elements = *rc::gen::elementOf(std::vector<std::uint64_t>{0, 7, 100, kPatchBlockBytes / element_bytes + 5});
  const auto per_million = *rc::gen::elementOf(std::vector<std::uint64_t>{1000, 50000, 300000});
  const auto seed = *rc::gen::arbitrary<std::uint64_t>();
  const Bytes old_tensor = random_bytes(elements * element_bytes, seed);
  const Bytes new_tensor = changed_copy(old_tensor, element_bytes, per_million, seed + 1);
  Bytes patch = *patch_of(old_tensor, new_tensor, element_bytes, kBase, kNoLimit);

  const auto damage = *rc::gen::inRange(0, 4);
  const auto at = *rc::gen::inRange<std::size_t>(0, patch.size());
  switch (damage) {
    case 0: patch.resize(at); break;                                                    // cut short
    case 1: patch[at] ^= static_cast<std::byte>(*rc::gen::inRange(1, 256)); break;     // a byte flipped
    case 2: patch.insert(patch.begin() + static_cast<std::ptrdiff_t>(at), std::byte{0}); break;  // one more
    default: patch.erase(patch.begin() + static_cast<std::ptrdiff_t>(at)); break;              // one fewer
  }
  Bytes tensor = old_tensor;
  auto applied = apply_patch(patch, element_bytes, tensor, kBase);
  if (!applied.ok()) {
    RC_ASSERT(tensor == old_tensor);
  } else {
    // It parsed as a patch of this tensor: it changed at most the elements it says it did.
    RC_ASSERT(changed_elements(old_tensor, tensor, element_bytes) <= applied.value());
  }
}

// A damaged patch is refused, saying `detail`, and the tensor keeps its old bytes.
void expect_refused(const Bytes& patch, const Bytes& old_tensor, const std::string& detail) {
  Bytes tensor = old_tensor;
  auto applied = apply_patch(patch, 2, tensor, kBase);
  ASSERT_FALSE(applied.ok());
  EXPECT_NE(applied.error().detail.find(detail), std::string::npos) << applied.error().detail;
  EXPECT_EQ(tensor, old_tensor);
}

TEST(Patch, EveryCutOfAPatchIsRefusedAndChangesNothing) {
  const Bytes old_tensor = random_bytes(3 * kPatchBlockBytes / 2, 7);
  const Bytes new_tensor = changed_copy(old_tensor, 2, 20000, 8);
  const Bytes patch = *patch_of(old_tensor, new_tensor, 2, kBase, kNoLimit);
  for (std::size_t cut = 0; cut < patch.size(); cut += 1 + cut / 64) {
    Bytes tensor = old_tensor;
    auto applied = apply_patch(std::span(patch).first(cut), 2, tensor, kBase);
    ASSERT_FALSE(applied.ok()) << cut;
    EXPECT_EQ(applied.error().code, Errc::kInvalidArgument) << cut;
    ASSERT_EQ(tensor, old_tensor) << cut;
  }
}

TEST(Patch, AnotherBaseOrAnotherTensorIsRefusedByName) {
  const Bytes old_tensor = random_bytes(1000, 1);
  const Bytes new_tensor = changed_copy(old_tensor, 2, 50000, 2);
  const Bytes patch = *patch_of(old_tensor, new_tensor, 2, kBase, kNoLimit);
  Bytes tensor = old_tensor;
  auto other_base = apply_patch(patch, 2, tensor, kBase + 1);
  ASSERT_FALSE(other_base.ok());
  EXPECT_EQ(other_base.error().code, Errc::kChecksumConflict);
  EXPECT_NE(other_base.error().detail.find("another base"), std::string::npos) << other_base.error().detail;
  auto other_size = apply_patch(patch, 2, std::span(tensor).first(998), kBase);
  ASSERT_FALSE(other_size.ok());
  EXPECT_EQ(other_size.error().code, Errc::kLayoutMismatch);
  auto other_dtype = apply_patch(patch, 4, tensor, kBase);
  ASSERT_FALSE(other_dtype.ok());
  EXPECT_EQ(other_dtype.error().code, Errc::kLayoutMismatch);
  EXPECT_EQ(tensor, old_tensor);
}

// How each block of a patch is encoded, found by walking its sections.
std::vector<PatchBlockKind> block_kinds(const Bytes& patch) {
  std::vector<PatchBlockKind> kinds;
  for (std::size_t at = kPatchHeaderBytes; at < patch.size();) {
    kinds.push_back(static_cast<PatchBlockKind>(patch[at]));
    std::uint32_t payload_bytes = 0;
    std::memcpy(&payload_bytes, &patch[at + 5], 4);  // little-endian hosts only: tests run on x86/arm
    at += kPatchSectionHeaderBytes + payload_bytes;
  }
  return kinds;
}

TEST(Patch, SparseBlocksListPositionsDenseOnesABitmapAndQuietOnesNothing) {
  // Three blocks of bf16: one element in a hundred changed, none, one in three.
  Bytes old_tensor = random_bytes(3 * kPatchBlockBytes, 3);
  Bytes new_tensor = old_tensor;
  Stream stream{4};
  for (std::size_t at = 0; at < old_tensor.size(); at += 2) {
    const std::uint64_t block = at / kPatchBlockBytes;
    if ((block == 0 && stream.chance(10000)) || (block == 2 && stream.chance(333333))) new_tensor[at] ^= std::byte{1};
  }
  const Bytes patch = *patch_of(old_tensor, new_tensor, 2, kBase, kNoLimit);
  EXPECT_EQ(block_kinds(patch),
            (std::vector{PatchBlockKind::kGaps, PatchBlockKind::kUnchanged, PatchBlockKind::kBitmap}));
  // One change in a hundred costs two bytes of value and a gap of one byte, or two for the gaps of
  // 128 or more (e^-1.28 = 28 % of them): about a thirtieth of the block's dense bytes. The quiet
  // block costs its section's 9 bytes, the dense one its bitmap and values.
  const std::uint64_t sparse_changed = changed_elements(Bytes(old_tensor.begin(), old_tensor.begin() + kPatchBlockBytes),
                                                        Bytes(new_tensor.begin(), new_tensor.begin() + kPatchBlockBytes), 2);
  const std::uint64_t dense_changed = changed_elements(old_tensor, new_tensor, 2) - sparse_changed;
  EXPECT_LE(patch.size(), kPatchHeaderBytes + 3 * kPatchSectionHeaderBytes + sparse_changed * 3 +
                              (sparse_changed * 7 / 20) + kPatchBlockBytes / 16 + dense_changed * 2);
}

TEST(Patch, AnEmptyTensorsPatchIsItsHeader) {
  const Bytes empty;
  const auto patch = patch_of(empty, empty, 2, kBase, kNoLimit);
  ASSERT_TRUE(patch.has_value());
  EXPECT_EQ(patch->size(), kPatchHeaderBytes);
  Bytes tensor;
  auto applied = apply_patch(*patch, 2, tensor, kBase);
  ASSERT_TRUE(applied.ok());
  EXPECT_EQ(applied.value(), 0u);
}

TEST(Patch, APatchThatOutgrowsItsLimitIsGivenUpAndItsMemoryFreed) {
  const Bytes old_tensor = random_bytes(2 * kPatchBlockBytes, 5);
  const Bytes new_tensor = changed_copy(old_tensor, 2, 600000, 6);
  PatchBuilder builder(2, old_tensor.size(), kBase, old_tensor.size() * 4 / 10);
  std::uint64_t fed = 0;
  for (std::size_t at = 0; at < old_tensor.size(); at += 2) {
    if (std::memcmp(&old_tensor[at], &new_tensor[at], 2) == 0) continue;
    builder.changed(at / 2, &new_tensor[at]);
    ++fed;
  }
  EXPECT_TRUE(builder.gave_up());
  EXPECT_EQ(builder.changed_elements(), fed);  // still counted: a writer's stats say what changed
  EXPECT_FALSE(builder.finish().has_value());
}

TEST(Patch, ABuilderMisusedIsACallersBug) {
  PatchBuilder builder(2, 100, kBase, kNoLimit);
  const std::byte value[2] = {};
  builder.changed(5, value);
  EXPECT_THROW(builder.changed(5, value), RequirementFailure);   // positions increase
  EXPECT_THROW(builder.changed(50, value), RequirementFailure);  // past the tensor's 50 elements
  EXPECT_THROW(PatchBuilder(0, 0, kBase, kNoLimit), RequirementFailure);  // not a division by zero
  EXPECT_THROW(PatchBuilder(3, 99, kBase, kNoLimit), RequirementFailure);
  EXPECT_THROW(PatchBuilder(4, 98, kBase, kNoLimit), RequirementFailure);
}

// A hostile section: a list that claims a million changes with a payload of ten bytes is refused
// before anything is written or allocated for it.
TEST(Patch, ASectionThatClaimsMoreThanItHoldsIsRefused) {
  const Bytes old_tensor = random_bytes(4096, 9);
  Bytes new_tensor = old_tensor;
  new_tensor[10] ^= std::byte{1};
  Bytes patch = *patch_of(old_tensor, new_tensor, 2, kBase, kNoLimit);
  const std::uint32_t claimed = 1u << 20;
  std::memcpy(&patch[kPatchHeaderBytes + 1], &claimed, 4);
  expect_refused(patch, old_tensor, "block 0");
}


// A position one past its block's last element, in the last block, would write past the tensor.
TEST(Patch, APositionJustPastTheTensorIsRefused) {
  const Bytes old_tensor = random_bytes(4096, 10);  // one block of 2,048 bf16 elements
  Bytes new_tensor = old_tensor;
  new_tensor[4094] ^= std::byte{1};  // element 2047, the last
  Bytes patch = *patch_of(old_tensor, new_tensor, 2, kBase, kNoLimit);
  const std::size_t gap_at = kPatchHeaderBytes + kPatchSectionHeaderBytes;
  ASSERT_EQ(patch[gap_at], std::byte{0xff});  // 2047 as a varint: 0xff 0x0f
  ASSERT_EQ(patch[gap_at + 1], std::byte{0x0f});
  patch[gap_at] = std::byte{0x80};  // 2048: 0x80 0x10
  patch[gap_at + 1] = std::byte{0x10};
  expect_refused(patch, old_tensor, "past the block's 2048 elements");
}

// A bitmap's last byte has bits for elements the block does not have: set, they are refused.
TEST(Patch, ABitmapBitPastTheTensorIsRefused) {
  const Bytes old_tensor = random_bytes(4090, 11);  // 2,045 elements: the map's last byte holds 5
  Bytes new_tensor = old_tensor;
  for (std::size_t at = 0; at < new_tensor.size(); at += 2) new_tensor[at] ^= std::byte{1};
  Bytes patch = *patch_of(old_tensor, new_tensor, 2, kBase, kNoLimit);
  ASSERT_EQ(block_kinds(patch), std::vector{PatchBlockKind::kBitmap});
  const std::size_t last_map_byte = kPatchHeaderBytes + kPatchSectionHeaderBytes + 255;
  ASSERT_EQ(patch[last_map_byte], std::byte{0x1f});
  patch[last_map_byte] = std::byte{0x2f};  // element 2044's bit moved to 2045's: as many bits set
  expect_refused(patch, old_tensor, "past the block's last element");
}

}  // namespace
}  // namespace th
