// The tensor checksum (client/checksum.h's blocked checksum) of CUDA device memory, computed on
// the device that holds it: only the block digests (8 bytes per MiB) and the bytes of a last block
// of at most 240 bytes come to the host, never the weights. The result equals
// client_impl::checksum of the same bytes in host memory.
//
// Failures of the CUDA runtime (a bad pointer, a failed kernel) throw CudaError.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "client/cuda/checksum_blocks.h"  // DeviceSpan
#include "client/cuda/cuda_error.h"

namespace th::cuda {

// The checksum of [device_data, +bytes), all of it memory of the current device. Runs on `stream`
// (after the work queued there before, so a copy into the tensor on `stream` is hashed once
// complete) and waits for it.
std::uint64_t device_checksum(const std::byte* device_data, std::uint64_t bytes, cudaStream_t stream);

// out[i] = the checksum of tensors[i], for all at once: one kernel over every block of every tensor
// (a shard's hundreds of small tensors cost one launch and one wait, not hundreds).
void device_checksums(std::span<const DeviceSpan> tensors, std::span<std::uint64_t> out, cudaStream_t stream);

}  // namespace th::cuda
