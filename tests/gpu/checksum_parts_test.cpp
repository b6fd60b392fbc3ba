// The checksum's CPU side (issue 15), without a GPU: the decomposition of XXH3's long path that
// the kernel runs (client/cuda/xxh3_parts.h, compiled here by g++) equals XXH3_64bits; the blocked
// checksum (client/checksum.h) equals its definition, computed here independently; and
// device_checksums's layout (client/cuda/checksum_blocks.h), run on host memory with xxh3_by_parts
// doing the kernel's work, gives that checksum for every tensor of a batch.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>

#include "client/checksum.h"
#include "client/cuda/checksum_blocks.h"
#include "client/cuda/xxh3_parts.h"
#include "core/assert.h"
#include "tests/gpu/checksum_test_data.h"

namespace th {
namespace {

using client_impl::checksum;
using cuda::xxh3::xxh3_by_parts;
using test::kBlockBytes;
using test::random_bytes;
using Lengths = std::initializer_list<std::uint64_t>;

// The definition, straight from client/checksum.h: XXH3 per 1 MiB block, then XXH3 over the
// digests written out as little-endian bytes.
std::uint64_t blocked_reference(const std::vector<std::byte>& data) {
  std::vector<unsigned char> digest_bytes;
  for (std::uint64_t offset = 0; offset < data.size(); offset += kBlockBytes) {
    const std::uint64_t length = std::min<std::uint64_t>(kBlockBytes, data.size() - offset);
    const std::uint64_t digest = XXH3_64bits(data.data() + offset, length);
    for (int byte = 0; byte < 8; ++byte) digest_bytes.push_back(static_cast<unsigned char>(digest >> (8 * byte)));
  }
  return XXH3_64bits(digest_bytes.data(), digest_bytes.size());
}

TEST(Xxh3Parts, EqualXxh3ForEveryLongPathLength) {
  const std::vector<std::byte> data = random_bytes(1, 3 * kBlockBytes);
  for (std::uint64_t length : test::long_path_lengths()) {
    ASSERT_LE(length, data.size());
    ASSERT_EQ(xxh3_by_parts(data.data(), length), XXH3_64bits(data.data(), length)) << "length " << length;
  }
}

TEST(Xxh3Parts, EqualXxh3OnFreshBytesPerLength) {
  // Bytes drawn per length, so that no length's input is a prefix of another's.
  std::uint64_t seed = 100;
  for (std::uint64_t length : Lengths{241, 1025, 4097, 65599, kBlockBytes + 1, 3 * kBlockBytes - 1}) {
    const std::vector<std::byte> data = random_bytes(++seed, length);
    EXPECT_EQ(xxh3_by_parts(data.data(), length), XXH3_64bits(data.data(), length)) << "length " << length;
  }
}

TEST(Xxh3Parts, EqualXxh3AtEveryAlignment) {
  // A tensor may start anywhere: unaligned words are assembled from bytes (the kernel's path too).
  const std::vector<std::byte> data = random_bytes(2, 70000 + 16);
  for (std::uint64_t offset = 0; offset < 16; ++offset) {
    for (std::uint64_t length : Lengths{241, 1024, 1089, 33 * 1024 + 5, 70000}) {
      EXPECT_EQ(xxh3_by_parts(data.data() + offset, length), XXH3_64bits(data.data() + offset, length))
          << "offset " << offset << " length " << length;
    }
  }
}

TEST(Xxh3Parts, EqualXxh3OnConstantInputs) {
  // All-zero and all-one bytes: words equal to or the complement of the secret's are no special case.
  for (std::byte fill : {std::byte{0x00}, std::byte{0xFF}}) {
    const std::vector<std::byte> data(kBlockBytes, fill);
    for (std::uint64_t length : Lengths{241, 1024, 1025, kBlockBytes}) {
      EXPECT_EQ(xxh3_by_parts(data.data(), length), XXH3_64bits(data.data(), length)) << "length " << length;
    }
  }
}

TEST(Xxh3Parts, ShapeOfTheLongPath) {
  using cuda::xxh3::long_shape;
  EXPECT_EQ(long_shape(241).full_blocks, 0u);
  EXPECT_EQ(long_shape(241).last_stripes, 3u);  // (240 / 64): the last stripe overlaps the third
  EXPECT_EQ(long_shape(1024).full_blocks, 0u);  // an exact internal block is not scrambled...
  EXPECT_EQ(long_shape(1024).last_stripes, 15u);  // ...its 16th stripe is the last stripe
  EXPECT_EQ(long_shape(1025).full_blocks, 1u);
  EXPECT_EQ(long_shape(1025).last_stripes, 0u);
  EXPECT_EQ(long_shape(kBlockBytes).full_blocks, 1023u);  // so a checksum block has 1024 internal blocks at most
  EXPECT_EQ(long_shape(kBlockBytes).last_stripes, 15u);
}

TEST(Xxh3Parts, RefusesShortInputs) {
  const std::vector<std::byte> data = random_bytes(3, 240);
  EXPECT_THROW(xxh3_by_parts(data.data(), 240), RequirementFailure);
}

// The AVX2 build of XXH3 (client/xxh3_avx2.cpp), which checksum() uses on such a CPU, gives
// libxxhash's digest for every length and alignment, the short paths included.
TEST(Xxh3Avx2, EqualsLibxxhash) {
  if (!client_impl::xxh3_avx2_usable()) GTEST_SKIP() << "no AVX2 build here, or no AVX2 on this CPU";
  const std::vector<std::byte> data = random_bytes(11, 3 * kBlockBytes + 64);
  std::vector<std::uint64_t> lengths = test::long_path_lengths();
  for (std::uint64_t length = 0; length <= 240; ++length) lengths.push_back(length);
  for (std::uint64_t offset : Lengths{0, 1, 7, 33}) {
    for (std::uint64_t length : lengths) {
      ASSERT_LE(offset + length, data.size());
      ASSERT_EQ(client_impl::xxh3_64_avx2(data.data() + offset, length), XXH3_64bits(data.data() + offset, length))
          << "offset " << offset << " length " << length;
    }
  }
}

TEST(BlockedChecksum, ABlockIsXxh3OfItsBytes) {
  const std::vector<std::byte> data = random_bytes(12, kBlockBytes);
  for (std::uint64_t length : Lengths{0, 1, 240, 241, 4096, kBlockBytes - 1, kBlockBytes}) {
    EXPECT_EQ(client_impl::checksum_block(data.data(), length), XXH3_64bits(data.data(), length)) << "length " << length;
  }
  EXPECT_THROW(client_impl::checksum_block(nullptr, 1), RequirementFailure);
  const std::vector<std::byte> longer(kBlockBytes + 1);
  EXPECT_THROW(client_impl::checksum_block(longer.data(), longer.size()), RequirementFailure);
}

TEST(BlockedChecksum, EqualsItsDefinition) {
  const std::vector<std::byte> all = random_bytes(4, 3 * kBlockBytes + 17);
  for (std::uint64_t length : Lengths{0, 1, 17, 240, 241, kBlockBytes - 1, kBlockBytes, kBlockBytes + 1,
                               kBlockBytes + 240, kBlockBytes + 241, 2 * kBlockBytes, 3 * kBlockBytes + 17}) {
    const std::vector<std::byte> data(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(length));
    EXPECT_EQ(checksum(data.data(), length), blocked_reference(data)) << "length " << length;
  }
}

TEST(BlockedChecksum, OfNothingIsXxh3OfNothing) {
  EXPECT_EQ(checksum(nullptr, 0), XXH3_64bits(nullptr, 0));
  EXPECT_THROW(checksum(nullptr, 1), RequirementFailure);
}

TEST(BlockedChecksum, OfOneShortBlockIsXxh3OfItsDigest) {
  // Up to 240 bytes, the one block takes XXH3's short paths (on the host, also for device memory).
  for (std::uint64_t length : Lengths{1, 16, 17, 128, 129, 240}) {
    const std::vector<std::byte> data = random_bytes(5, length);
    const std::uint64_t digest = XXH3_64bits(data.data(), length);
    EXPECT_EQ(checksum(data.data(), length), client_impl::checksum_of_digests({&digest, 1})) << "length " << length;
  }
}

TEST(BlockedChecksum, ChangesWithAnyFlippedByte) {
  std::vector<std::byte> data = random_bytes(6, 3 * kBlockBytes + 17);
  const std::uint64_t original = checksum(data.data(), data.size());
  // Each block's first and last byte, and one inside; the 17-byte last block is a short one.
  for (std::uint64_t at : Lengths{0, 4095, kBlockBytes - 1, kBlockBytes, kBlockBytes + 777, 2 * kBlockBytes - 1,
                           2 * kBlockBytes, 3 * kBlockBytes - 1, 3 * kBlockBytes, 3 * kBlockBytes + 16}) {
    data[at] ^= std::byte{0x01};
    EXPECT_NE(checksum(data.data(), data.size()), original) << "byte " << at;
    data[at] ^= std::byte{0x01};
  }
  EXPECT_EQ(checksum(data.data(), data.size()), original);
}

TEST(BlockedChecksum, DependsOnTheBlocksOrder) {
  std::vector<std::byte> data = random_bytes(7, 2 * kBlockBytes);
  const std::uint64_t original = checksum(data.data(), data.size());
  std::swap_ranges(data.begin(), data.begin() + kBlockBytes, data.begin() + kBlockBytes);
  EXPECT_NE(checksum(data.data(), data.size()), original);
}

// device_checksums's steps on host memory: the plan, then the kernel's loop over slots (a thread
// block per slot; xxh3_by_parts does what its threads do), the short blocks copied out and hashed,
// and the digests combined per tensor.
std::vector<std::uint64_t> emulated_device_checksums(std::span<const cuda::DeviceSpan> tensors) {
  const cuda::BlockPlan plan = cuda::plan_blocks(tensors);
  std::vector<std::uint64_t> digests(plan.slots);
  for (std::uint64_t slot = 0; slot < plan.slots; ++slot) {
    const cuda::BlockInput block =
        cuda::block_input(plan.table.data(), static_cast<std::uint32_t>(plan.table.size()), slot);
    if (block.bytes <= cuda::xxh3::kMidSizeMax) continue;
    digests[slot] = xxh3_by_parts(reinterpret_cast<const std::byte*>(block.data), block.bytes);
  }
  std::vector<std::byte> tails(plan.short_blocks.size() * cuda::xxh3::kMidSizeMax);
  for (std::size_t i = 0; i < plan.short_blocks.size(); ++i) {
    std::memcpy(tails.data() + i * cuda::xxh3::kMidSizeMax, plan.short_blocks[i].data, plan.short_blocks[i].bytes);
  }
  cuda::hash_short_blocks(plan, tails, digests);
  std::vector<std::uint64_t> out(tensors.size());
  cuda::combine_digests(plan, digests, out);
  return out;
}

TEST(DeviceLayout, PlansASlotPerBlock) {
  const std::vector<std::byte> data = random_bytes(8, 4 * kBlockBytes);
  const std::byte* base = data.data();
  const std::vector<cuda::DeviceSpan> tensors = {
      {base, 3 * kBlockBytes + 17},  // slots 0-3, the last one short
      {nullptr, 0},                  // none
      {base + 1, 240},               // slot 4, short
      {base + 2, kBlockBytes},       // slot 5
      {base + 3, kBlockBytes + 241},  // slots 6-7, the last one long
  };
  const cuda::BlockPlan plan = cuda::plan_blocks(tensors);
  EXPECT_EQ(plan.slots, 8u);
  EXPECT_EQ(plan.first_slot, (std::vector<std::uint64_t>{0, 4, 4, 5, 6}));
  ASSERT_EQ(plan.table.size(), 4u);
  ASSERT_EQ(plan.short_blocks.size(), 2u);
  EXPECT_EQ(plan.short_blocks[0].slot, 3u);
  EXPECT_EQ(plan.short_blocks[0].data, base + 3 * kBlockBytes);
  EXPECT_EQ(plan.short_blocks[0].bytes, 17u);
  EXPECT_EQ(plan.short_blocks[1].slot, 4u);
  EXPECT_EQ(plan.short_blocks[1].bytes, 240u);

  const auto count = static_cast<std::uint32_t>(plan.table.size());
  const std::uint32_t expected_tensor[] = {0, 0, 0, 0, 1, 2, 3, 3};  // table entries (the empty tensor has none)
  for (std::uint64_t slot = 0; slot < plan.slots; ++slot) {
    EXPECT_EQ(cuda::find_tensor(plan.table.data(), count, slot), expected_tensor[slot]) << "slot " << slot;
  }
  EXPECT_EQ(cuda::block_input(plan.table.data(), count, 2).bytes, kBlockBytes);
  EXPECT_EQ(cuda::block_input(plan.table.data(), count, 3).bytes, 17u);
  EXPECT_EQ(cuda::block_input(plan.table.data(), count, 7).bytes, 241u);
  EXPECT_EQ(cuda::block_input(plan.table.data(), count, 7).data,
            reinterpret_cast<const std::uint8_t*>(base + 3 + kBlockBytes));
}

TEST(DeviceLayout, EmulatedBatchEqualsChecksumPerTensor) {
  // Thousands of tensors at unaligned offsets: empty, short, long, and some of several blocks.
  std::mt19937_64 generator(9);
  std::vector<std::uint64_t> offsets;
  std::vector<std::uint64_t> lengths;
  std::uint64_t end = 0;
  for (int i = 0; i < 3000; ++i) {
    std::uint64_t bytes = 241 + generator() % 4096;
    if (i % 7 == 0) bytes = generator() % 241;
    if (i % 500 == 1) bytes = kBlockBytes + generator() % (2 * kBlockBytes);
    end += generator() % 16;
    offsets.push_back(end);
    lengths.push_back(bytes);
    end += bytes;
  }
  const std::vector<std::byte> data = random_bytes(10, end);
  std::vector<cuda::DeviceSpan> tensors;
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    tensors.push_back({lengths[i] == 0 ? nullptr : data.data() + offsets[i], lengths[i]});
  }
  const std::vector<std::uint64_t> out = emulated_device_checksums(tensors);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    ASSERT_EQ(out[i], checksum(tensors[i].data, lengths[i])) << "tensor " << i << ", " << lengths[i] << " bytes";
  }
  EXPECT_TRUE(emulated_device_checksums({}).empty());
}

TEST(DeviceLayout, RefusesATensorWithoutData) {
  const cuda::DeviceSpan tensor{nullptr, 1};
  EXPECT_THROW(cuda::plan_blocks({&tensor, 1}), RequirementFailure);
}

}  // namespace
}  // namespace th
