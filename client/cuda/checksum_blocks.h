// How device_checksums (checksum.cu) lays out the blocked checksums of many tensors for one kernel,
// in CUDA-free code: the host's plan, the kernel's lookup from a digest slot to its bytes, and the
// host's last steps. tests/gpu/checksum_parts_test.cpp runs all of it on host memory, with
// xxh3_by_parts standing in for the kernel's per-block work.
//
// Every checksum block (client/checksum.h: 1 MiB, the last one shorter) of every tensor gets a
// digest slot, a tensor's blocks consecutive ones, so a tensor's checksum is checksum_of_digests of
// its slots. Blocks of more than 240 bytes are hashed by the kernel; a block of at most 240 bytes
// (only a tensor's last block can be one) takes XXH3's short paths on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "client/checksum.h"
#include "client/cuda/xxh3_parts.h"

namespace th::cuda {

// A tensor in device memory: `data` may be null when `bytes` is 0, and need not be aligned.
struct DeviceSpan {
  const std::byte* data = nullptr;
  std::uint64_t bytes = 0;
};

// A tensor with at least one block, as the kernel sees it.
struct TensorBlocks {
  const std::uint8_t* data;
  std::uint64_t bytes;
  std::uint64_t first_slot;  // the digest slot of its block 0
};

// A block of at most xxh3::kMidSizeMax bytes, hashed on the host.
struct ShortBlock {
  std::uint64_t slot;
  const std::byte* data;
  std::uint64_t bytes;
};

struct BlockPlan {
  std::uint64_t slots = 0;               // digest slots: all blocks of all tensors
  std::vector<std::uint64_t> first_slot;  // per tensor given, its block 0's slot
  std::vector<TensorBlocks> table;        // the tensors with a block; first_slot ascends strictly from 0
  std::vector<ShortBlock> short_blocks;   // at most one per entry of table, ascending slots
};

// The plan for `tensors`, which stay valid for the call.
BlockPlan plan_blocks(std::span<const DeviceSpan> tensors);

// The index in table[0, count) of the tensor holding slot `slot` (< the plan's slots): the last
// entry whose first_slot <= slot. Entries ascend strictly from 0, so it lies in [low, high) and
// high - low halves each step: at most 32 steps for a 32-bit count.
TH_HD std::uint32_t find_tensor(const TensorBlocks* table, std::uint32_t count, std::uint64_t slot) {
  std::uint32_t low = 0;
  std::uint32_t high = count;
  while (high - low > 1) {
    const std::uint32_t middle = low + (high - low) / 2;
    if (table[middle].first_slot <= slot) {
      low = middle;
    } else {
      high = middle;
    }
  }
  return low;
}

struct BlockInput {
  const std::uint8_t* data;
  std::uint64_t bytes;  // 1 to kChecksumBlockBytes
};

// The bytes of slot `slot`.
TH_HD BlockInput block_input(const TensorBlocks* table, std::uint32_t count, std::uint64_t slot) {
  const TensorBlocks& tensor = table[find_tensor(table, count, slot)];
  const std::uint64_t offset = (slot - tensor.first_slot) * client_impl::kChecksumBlockBytes;
  const std::uint64_t rest = tensor.bytes - offset;
  return {tensor.data + offset, rest < client_impl::kChecksumBlockBytes ? rest : client_impl::kChecksumBlockBytes};
}

// Fills the short blocks' digests; tails holds short_blocks[i]'s bytes at i * xxh3::kMidSizeMax.
void hash_short_blocks(const BlockPlan& plan, std::span<const std::byte> tails, std::span<std::uint64_t> digests);

// out[i] = tensor i's checksum, from the digests of all slots.
void combine_digests(const BlockPlan& plan, std::span<const std::uint64_t> digests, std::span<std::uint64_t> out);

}  // namespace th::cuda
