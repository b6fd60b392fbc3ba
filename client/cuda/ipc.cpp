// client/cuda/ipc.h over the CUDA runtime (cudaIpcGetMemHandle, cudaIpcOpenMemHandle).
// Failures are values (nullopt, nullptr) or net::DeviceCopyError (a failed copy): a pull that
// cannot use IPC goes over TCP, never fails for it.
#include "client/cuda/ipc.h"

#include <cuda.h>  // the driver's types, for cuMemGetAddressRange through the runtime's entry point
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <string>

#include "client/cuda/device_scope.h"
#include "core/assert.h"

namespace th::client_impl {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == net::kIpcHandleBytes);

using cuda_detail::check;
// Restores the thread's own context, none included: restoring "device 0" would make a context on
// GPU 0 in every process (cuda_device.cpp).
using cuda_detail::DeviceScope;

using MemGetAddressRange = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr pointer);

class CudaIpcExporter final : public net::IpcExporter {
 public:
  std::optional<net::IpcExport> export_region(const std::byte* base, std::uint64_t bytes) override {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, base) != cudaSuccess || attributes.type != cudaMemoryTypeDevice) {
      cudaGetLastError();  // clear it: the next call must not see it
      return std::nullopt;
    }
    const MemGetAddressRange address_range = address_range_function();
    if (address_range == nullptr) return std::nullopt;
    try {
      DeviceScope scope(attributes.device);
      // cudaIpcGetMemHandle exports a whole allocation and must be given its base: the region's
      // place in it travels as an offset.
      CUdeviceptr allocation = 0;
      size_t allocation_bytes = 0;
      if (address_range(&allocation, &allocation_bytes, reinterpret_cast<CUdeviceptr>(base)) != CUDA_SUCCESS) {
        return std::nullopt;
      }
      const auto begin = reinterpret_cast<std::uintptr_t>(base);
      if (begin < allocation || begin - allocation > allocation_bytes || bytes > allocation_bytes - (begin - allocation)) {
        return std::nullopt;  // not inside one allocation
      }
      cudaIpcMemHandle_t handle{};
      if (cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(allocation)) != cudaSuccess) {
        // cudaMallocAsync pools and cuMemCreate (expandable segments) cannot be exported this way.
        cudaGetLastError();
        return std::nullopt;
      }
      net::IpcExport exported;
      std::memcpy(exported.handle.data(), &handle, sizeof handle);
      exported.offset = begin - allocation;
      exported.allocation_bytes = allocation_bytes;
      return exported;
    } catch (const net::DeviceCopyError&) {
      cudaGetLastError();
      return std::nullopt;
    }
  }
  std::string host_identity() override { return net::local_host_identity(); }
  std::uint64_t process_identity() override { return static_cast<std::uint64_t>(::getpid()); }

 private:
  // A driver function through the runtime's entry point (no link against libcuda), looked up on
  // first use (the lookup initialises the runtime).
  MemGetAddressRange address_range_function() {
    std::call_once(looked_up_, [this] {
      void* function = nullptr;
      cudaDriverEntryPointQueryResult found{};
      if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &function, 12000, cudaEnableDefault, &found) !=
              cudaSuccess ||
          found != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        return;
      }
      address_range_ = reinterpret_cast<MemGetAddressRange>(function);
    });
    return address_range_;
  }
  std::once_flag looked_up_;
  MemGetAddressRange address_range_ = nullptr;  // set once, under looked_up_
};

class CudaIpcImporter final : public net::CachingIpcImporter {
 public:
  explicit CudaIpcImporter(int device) : device_(device) { TH_REQUIRE(device >= 0); }
  ~CudaIpcImporter() override {
    close_all();
    if (stream_ != nullptr) {
      try {
        DeviceScope scope(device_);
        cudaStreamSynchronize(stream_);
        cudaStreamDestroy(stream_);
      } catch (const net::DeviceCopyError&) {
        // The device is gone: nothing left to release.
      }
    }
  }

  void copy(std::byte* to_device, const std::byte* from_device, std::uint64_t bytes) override {
    if (bytes == 0) return;
    DeviceScope scope(device_);
    if (stream_ == nullptr) {
      // Non-blocking: it neither waits for nor holds up the application's legacy default stream.
      check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (IPC)");
    }
    // Peer to peer when the source's allocation is on another GPU (through the peer access that
    // cudaIpcMemLazyEnablePeerAccess set up), device to device on the same one.
    const cudaError_t started = cudaMemcpyAsync(to_device, from_device, bytes, cudaMemcpyDeviceToDevice, stream_);
    // Wait for what was started even if the start failed: nothing may run after we return.
    const cudaError_t waited = cudaStreamSynchronize(stream_);
    check(started, "cudaMemcpyAsync (device to device over CUDA IPC)");
    check(waited, "cudaStreamSynchronize (IPC)");
  }
  std::string host_identity() override { return net::local_host_identity(); }
  std::uint64_t process_identity() override { return static_cast<std::uint64_t>(::getpid()); }

 protected:
  net::IpcMapping open_mapping(const net::IpcHandleBytes& handle) override {
    static const auto address_range = cuda_detail::driver_function<MemGetAddressRange>("cuMemGetAddressRange");
    if (address_range == nullptr) return {};  // the mapping's size could not be known
    try {
      DeviceScope scope(device_);
      cudaIpcMemHandle_t cuda_handle{};
      std::memcpy(&cuda_handle, handle.data(), sizeof cuda_handle);
      void* base = nullptr;
      // Fails in the process that exported the handle, for a freed allocation, or where this
      // device cannot reach the source's (no peer access): the reader then uses TCP.
      if (cudaIpcOpenMemHandle(&base, cuda_handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
        cudaGetLastError();
        return {};
      }
      // The size of what was mapped, as this process's driver sees it: the bounds every copy out
      // of it is checked against (the source's own word is not trusted).
      CUdeviceptr mapped = 0;
      size_t mapped_bytes = 0;
      if (address_range(&mapped, &mapped_bytes, reinterpret_cast<CUdeviceptr>(base)) != CUDA_SUCCESS ||
          mapped != reinterpret_cast<CUdeviceptr>(base)) {
        cudaIpcCloseMemHandle(base);
        return {};
      }
      return {static_cast<std::byte*>(base), static_cast<std::uint64_t>(mapped_bytes)};
    } catch (const net::DeviceCopyError&) {
      cudaGetLastError();
      return {};
    }
  }
  void close_mapping(std::byte* base) override {
    try {
      DeviceScope scope(device_);
      if (cudaIpcCloseMemHandle(base) != cudaSuccess) cudaGetLastError();  // nothing else to do with it
    } catch (const net::DeviceCopyError&) {
      cudaGetLastError();
    }
  }

 private:
  const int device_;
  cudaStream_t stream_ = nullptr;  // made at the first copy (one pull at a time uses an importer)
};

}  // namespace

std::shared_ptr<net::IpcExporter> make_ipc_exporter() { return std::make_shared<CudaIpcExporter>(); }

std::shared_ptr<net::IpcImporter> make_ipc_importer(int device) { return std::make_shared<CudaIpcImporter>(device); }

}  // namespace th::client_impl
