// How a shard's registered tensors appear on the data plane (not installed): the plan libthclient
// reads into and serves from, and the checksum its tensors are verified with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "client/checksum.h"
#include "client/gpu.h"
#include "core/types.h"

namespace th::client_impl {

// Tensors below this size travel packed into one buffer per shard (paper §4.3.2): one request
// instead of hundreds of tiny ones.
constexpr std::uint64_t kPackedTensorBytesMax = 2ull << 20;

struct Registered {
  std::byte* data = nullptr;
  TensorSpec spec;  // name, dtype, bytes and what the tensor is (a shard's own, a piece)
  std::shared_ptr<void> lease;  // lent to the data plane (DataTransport::lease_memory)
  bool on_device = false;       // CUDA device memory (MemoryKind::kCuda)
};

// How the shard's tensors appear on the data plane: region 0 is the packed buffer of the small
// tensors (if any), then the big tensors, each its own region, in layout (name) order.
struct Plan {
  LayoutRef layout;
  std::vector<std::byte*> tensor_data;  // in layout order
  std::vector<std::uint64_t> packed_offset;  // per tensor: its place in the packed buffer, or none
  std::uint64_t packed_bytes = 0;
  std::vector<std::size_t> big;  // layout indices of the tensors with a region of their own
  // Per tensor (layout order): CUDA device memory. The packed buffer is host memory always: small
  // GPU tensors are copied into it at publish and out of it once verified.
  std::vector<bool> on_device;
  std::shared_ptr<Gpu> gpu;  // set when any tensor is on a device
  int gpu_device = -1;       // the CUDA device they are on (one per handle)

  static constexpr std::uint64_t kNotPacked = ~0ull;
  bool device_tensor(std::size_t index) const { return !on_device.empty() && on_device[index]; }
};

// The plan of the registered tensors (data_path.cpp's seed_copy_of makes one for a seed copy).
Plan make_plan(const std::map<std::string, Registered, std::less<>>& registry);

}  // namespace th::client_impl
