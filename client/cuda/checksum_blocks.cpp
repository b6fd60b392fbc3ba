#include "client/cuda/checksum_blocks.h"

#include <xxhash.h>

#include "core/assert.h"

namespace th::cuda {

using client_impl::checksum_blocks;
using client_impl::kChecksumBlockBytes;
using xxh3::kMidSizeMax;

BlockPlan plan_blocks(std::span<const DeviceSpan> tensors) {
  BlockPlan plan;
  plan.first_slot.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const DeviceSpan& tensor = tensors[i];
    TH_REQUIRE(tensor.data != nullptr || tensor.bytes == 0, "tensor", i, "has no data for", tensor.bytes, "bytes");
    plan.first_slot.push_back(plan.slots);
    const std::uint64_t blocks = checksum_blocks(tensor.bytes);
    if (blocks == 0) continue;
    plan.table.push_back({reinterpret_cast<const std::uint8_t*>(tensor.data), tensor.bytes, plan.slots});
    const std::uint64_t last_offset = (blocks - 1) * kChecksumBlockBytes;
    if (tensor.bytes - last_offset <= kMidSizeMax) {
      plan.short_blocks.push_back({plan.slots + blocks - 1, tensor.data + last_offset, tensor.bytes - last_offset});
    }
    plan.slots += blocks;
  }
  TH_ASSERT(plan.short_blocks.size() <= plan.table.size());
  return plan;
}

void hash_short_blocks(const BlockPlan& plan, std::span<const std::byte> tails, std::span<std::uint64_t> digests) {
  TH_REQUIRE(tails.size() == plan.short_blocks.size() * kMidSizeMax, tails.size(), "bytes of tails");
  TH_REQUIRE(digests.size() == plan.slots, digests.size(), "digests for", plan.slots, "slots");
  for (std::size_t i = 0; i < plan.short_blocks.size(); ++i) {
    const ShortBlock& block = plan.short_blocks[i];
    TH_ASSERT(block.slot < digests.size());
    TH_ASSERT(block.bytes <= kMidSizeMax);
    digests[block.slot] = XXH3_64bits(tails.data() + i * kMidSizeMax, block.bytes);
  }
}

void combine_digests(const BlockPlan& plan, std::span<const std::uint64_t> digests, std::span<std::uint64_t> out) {
  TH_REQUIRE(digests.size() == plan.slots, digests.size(), "digests for", plan.slots, "slots");
  TH_REQUIRE(out.size() == plan.first_slot.size(), out.size(), "results for", plan.first_slot.size(), "tensors");
  for (std::size_t i = 0; i < out.size(); ++i) {
    // A tensor's slots run to the next tensor's first one (or the end).
    const std::uint64_t end = i + 1 < out.size() ? plan.first_slot[i + 1] : plan.slots;
    TH_ASSERT(plan.first_slot[i] <= end && end <= plan.slots);
    out[i] = client_impl::checksum_of_digests(digests.subspan(plan.first_slot[i], end - plan.first_slot[i]));
  }
}

}  // namespace th::cuda
