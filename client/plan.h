// How a shard's registered tensors appear on the data plane (not installed): the plan libthclient
// reads into and serves from, and the checksum its tensors are verified with.
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/types.h"

namespace th::client_impl {

// Tensors below this size travel packed into one buffer per shard (paper §4.3.2): one request
// instead of hundreds of tiny ones.
constexpr std::uint64_t kPackedTensorBytesMax = 2ull << 20;
inline std::uint64_t checksum(const std::byte* data, std::uint64_t bytes) { return XXH3_64bits(data, bytes); }

struct Registered {
  std::byte* data = nullptr;
  std::uint64_t bytes = 0;
  DType dtype = DType::kFloat32;
  std::shared_ptr<void> lease;  // lent to the data plane (DataTransport::lease_memory)
};

// How the shard's tensors appear on the data plane: region 0 is the packed buffer of the small
// tensors (if any), then the big tensors, each its own region, in layout (name) order.
struct Plan {
  LayoutRef layout;
  std::vector<std::byte*> tensor_data;  // in layout order
  std::vector<std::uint64_t> packed_offset;  // per tensor: its place in the packed buffer, or none
  std::uint64_t packed_bytes = 0;
  std::vector<std::size_t> big;  // layout indices of the tensors with a region of their own

  static constexpr std::uint64_t kNotPacked = ~0ull;
};

// The plan of the registered tensors (data_path.cpp's seed_copy_of makes one for a seed copy).
Plan make_plan(const std::map<std::string, Registered, std::less<>>& registry);

}  // namespace th::client_impl
