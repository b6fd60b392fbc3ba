// libthclient's access to GPU memory (issue 15), without naming CUDA: client/cuda/cuda_device.cu
// implements it with the CUDA runtime when the toolkit was found at build time, and
// client/cuda/no_cuda.cpp says why there is none otherwise. Not installed.
//
// Device errors (a failed copy or kernel) throw net::DeviceCopyError: I/O logistics of the
// device, which the data path turns into a failed read, verification or offload.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <span>

#include "net/staging.h"
#include "tensorhub/result.h"

namespace th::client_impl {

class Gpu {
 public:
  virtual ~Gpu() = default;

  // The CUDA device whose memory [data, +bytes) is, all of it inside one allocation; an error
  // (kInvalidArgument, saying what it is instead) for host, managed or unknown memory.
  virtual Result<int> device_of(const std::byte* data, std::uint64_t bytes) = 0;
  // Copies, all started at once on a non-blocking stream of libthclient's and waited for together
  // (the small tensors of a shard travel packed: hundreds of copies, one wait). They neither wait
  // for nor hold up the application's streams, the legacy default stream included.
  struct Copy {
    std::byte* device;
    std::byte* host;
    std::uint64_t bytes;
  };
  virtual void to_host(std::span<const Copy> copies) = 0;
  virtual void to_device(std::span<const Copy> copies) = 0;
  // The tensor checksum (client/checksum.h) of device memory, computed on its GPU: only the
  // digests (8 bytes per MiB) come to the host.
  virtual std::uint64_t checksum(const std::byte* device, std::uint64_t bytes) = 0;
  // Page-locks [host, +bytes) until the returned token is dropped, so that copies from a GPU into
  // it run at full speed (an offload copy); nullptr where it cannot (the copy is then slower).
  virtual std::shared_ptr<void> pin_host(std::byte* host, std::uint64_t bytes) = 0;
  // Blocks until the work queued on `stream` (a cudaStream_t) completed; nullptr: until all work
  // on `device` did.
  virtual void synchronize(int device, void* stream) = 0;
  // Copy lanes and pinned memory for the staging rings of the TCP data plane, on `device`.
  virtual std::shared_ptr<net::StagingProvider> staging(int device) = 0;
  // Makes the writes a NIC made into `device`'s memory (RDMA READs into GPU tensors) visible to
  // kernels (the checksums', the application's): nothing where the GPU orders them already,
  // cudaDeviceFlushGPUDirectRDMAWrites where it can flush, else DeviceCopyError.
  virtual void flush_remote_writes(int device) = 0;

  // For registering GPU memory with a NIC (rdma/device_memory.h's DeviceMemoryApi):
  // the whole allocation that holds `pointer` (cuMemGetAddressRange), as (base, bytes);
  virtual std::optional<std::pair<const std::byte*, std::uint64_t>> allocation_of(const std::byte* pointer) = 0;
  // a dma-buf file descriptor of [base, +bytes) (cuMemGetHandleForAddressRange), which the caller
  // closes; -1 and `why` where the driver or the kernel cannot.
  virtual int dmabuf_fd(const std::byte* base, std::uint64_t bytes, std::string& why) = 0;
};

// The process's GPU access, made on first use, or why there is none ("built without the CUDA
// Toolkit", "no CUDA device: ..."): kInvalidArgument, for the register call that needed it.
Result<std::shared_ptr<Gpu>> gpu();

}  // namespace th::client_impl
