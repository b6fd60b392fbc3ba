// client/gpu.h over the CUDA runtime (linked statically: it loads the driver on first use, so a
// libthclient built with the toolkit still loads, and refuses kCuda memory with the reason, on a
// machine without an NVIDIA driver).
#include <cuda.h>  // the driver's types, for cuMemGetAddressRange through the runtime's entry point
#include <cuda_runtime_api.h>

#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "client/cuda/checksum.h"
#include "client/cuda/cuda_error.h"
#include "client/cuda/device_scope.h"
#include "client/gpu.h"
#include "core/assert.h"

namespace th::client_impl {
namespace {

using cuda_detail::check;
using cuda_detail::DeviceScope;
using cuda_detail::driver_function;

int device_of_pointer(const void* pointer) {
  cudaPointerAttributes attributes{};
  check(cudaPointerGetAttributes(&attributes, pointer), "cudaPointerGetAttributes");
  return attributes.device;
}

// One CUDA stream of its own (non-blocking: it neither waits for nor holds up the legacy default
// stream the application may use) and an event per copy in flight.
class CudaLane final : public net::CopyLane {
 public:
  explicit CudaLane(int device) : device_(device) {
    DeviceScope scope(device_);
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  ~CudaLane() override {
    DeviceScope scope(device_, /*quiet=*/true);
    cudaStreamSynchronize(stream_);  // a ring waits for its copies; this is for an unwinding one
    for (const Pending& pending : pending_) cudaEventDestroy(pending.event);
    for (cudaEvent_t event : idle_events_) cudaEventDestroy(event);
    cudaStreamDestroy(stream_);
  }

  Ticket to_host(std::byte* host, const std::byte* device, std::uint64_t bytes) override {
    return start(host, device, bytes, cudaMemcpyDeviceToHost);
  }
  Ticket to_device(std::byte* device, const std::byte* host, std::uint64_t bytes) override {
    return start(device, host, bytes, cudaMemcpyHostToDevice);
  }
  void wait(Ticket ticket) override {
    TH_REQUIRE(ticket < next_ticket_, "a copy that was never started");
    // The stream runs its copies in order: the event of `ticket` completing means every earlier
    // one did too, and their events go back to the pool.
    while (!pending_.empty() && pending_.front().ticket <= ticket) {
      const Pending pending = pending_.front();
      const cudaError_t status = pending.ticket == ticket ? cudaEventSynchronize(pending.event) : cudaSuccess;
      pending_.pop_front();
      idle_events_.push_back(pending.event);
      check(status, "cudaEventSynchronize (a staging copy)");
    }
  }

 private:
  struct Pending {
    Ticket ticket;
    cudaEvent_t event;
  };
  Ticket start(void* to, const void* from, std::uint64_t bytes, cudaMemcpyKind kind) {
    DeviceScope scope(device_);
    cudaEvent_t event = nullptr;
    if (idle_events_.empty()) {
      check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    } else {
      event = idle_events_.back();
      idle_events_.pop_back();
    }
    const cudaError_t copied = cudaMemcpyAsync(to, from, bytes, kind, stream_);
    const cudaError_t recorded = copied == cudaSuccess ? cudaEventRecord(event, stream_) : copied;
    if (recorded != cudaSuccess) {
      // A copy queued without its event would run untracked, perhaps after the ring rethrew and
      // the memory it reads was handed back: wait for the stream before saying so.
      cudaStreamSynchronize(stream_);
      idle_events_.push_back(event);
      check(recorded, "cudaMemcpyAsync (a staging copy)");
    }
    pending_.push_back({next_ticket_, event});
    return next_ticket_++;
  }

  const int device_;
  cudaStream_t stream_ = nullptr;
  Ticket next_ticket_ = 0;
  std::deque<Pending> pending_;           // at most a ring's slots: a ring waits before it reuses one
  std::vector<cudaEvent_t> idle_events_;  // as many as were ever pending at once
};

class CudaStaging final : public net::StagingProvider {
 public:
  explicit CudaStaging(int device) : device_(device) {}
  std::unique_ptr<net::CopyLane> make_lane() override { return std::make_unique<CudaLane>(device_); }
  std::shared_ptr<std::byte[]> allocate_pinned(std::uint64_t bytes) override {
    void* memory = nullptr;
    DeviceScope scope(device_);
    // Portable: pinned for every device and context, so a lane on any device copies at full speed.
    check(cudaHostAlloc(&memory, bytes, cudaHostAllocPortable), "cudaHostAlloc (staging)");
    return std::shared_ptr<std::byte[]>(static_cast<std::byte*>(memory), [](std::byte* pinned) { cudaFreeHost(pinned); });
  }

 private:
  const int device_;
};

using MemGetAddressRange = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr pointer);
using MemGetHandleForAddressRange = CUresult (*)(void* handle, CUdeviceptr base, size_t size,
                                                 CUmemRangeHandleType type, unsigned long long flags);


// Non-blocking streams for the synchronous batches (copies, checksums), per device, lent to one
// thread at a time. cudaStreamPerThread would be simpler, but it synchronises with the legacy
// default stream, where PyTorch queues its kernels: our copies would wait for the application's
// work and hold it up. Bounded by the threads that copy at once (a handle's few).
class StreamPool {
 public:
  ~StreamPool() {
    for (auto& [device, streams] : idle_) {
      DeviceScope scope(device, /*quiet=*/true);
      for (cudaStream_t stream : streams) cudaStreamDestroy(stream);
    }
  }
  // On `device`, which the caller made current.
  cudaStream_t take(int device) {
    {
      std::lock_guard lock(mutex_);
      auto& streams = idle_[device];
      if (!streams.empty()) {
        cudaStream_t stream = streams.back();
        streams.pop_back();
        return stream;
      }
    }
    cudaStream_t stream = nullptr;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return stream;
  }
  void give_back(int device, cudaStream_t stream) {
    std::lock_guard lock(mutex_);
    idle_[device].push_back(stream);
  }

 private:
  std::mutex mutex_;
  std::map<int, std::vector<cudaStream_t>> idle_;
};

// A device made current and one of its pool streams, for a scope.
class OnDevice {
 public:
  OnDevice(StreamPool& pool, int device) : scope_(device), pool_(pool), device_(device), stream_(pool.take(device)) {}
  ~OnDevice() { pool_.give_back(device_, stream_); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
  cudaStream_t stream() const { return stream_; }

 private:
  DeviceScope scope_;
  StreamPool& pool_;
  const int device_;
  const cudaStream_t stream_;
};

class CudaGpu final : public Gpu {
 public:
  CudaGpu()
      : address_range_(driver_function<MemGetAddressRange>("cuMemGetAddressRange")),
        range_handle_(driver_function<MemGetHandleForAddressRange>("cuMemGetHandleForAddressRange")) {}

  Result<int> device_of(const std::byte* data, std::uint64_t bytes) override {
    cudaPointerAttributes attributes{};
    if (const cudaError_t status = cudaPointerGetAttributes(&attributes, data); status != cudaSuccess) {
      cudaGetLastError();  // not sticky, but clear it so the next call does not see it
      return make_error(Errc::kInvalidArgument, std::string("not CUDA memory: ") + cudaGetErrorString(status));
    }
    switch (attributes.type) {
      case cudaMemoryTypeDevice:
        break;
      case cudaMemoryTypeManaged:
        return make_error(Errc::kInvalidArgument, "managed (unified) memory: register it as CPU memory");
      case cudaMemoryTypeHost:
        return make_error(Errc::kInvalidArgument, "pinned host memory: register it as CPU memory");
      default:
        return make_error(Errc::kInvalidArgument, "not CUDA device memory (pageable host memory?)");
    }
    if (address_range_ != nullptr && bytes > 0) {
      CUdeviceptr base = 0;
      size_t size = 0;
      DeviceScope scope(attributes.device);
      if (address_range_(&base, &size, reinterpret_cast<CUdeviceptr>(data)) == CUDA_SUCCESS) {
        const auto begin = reinterpret_cast<std::uintptr_t>(data);
        if (begin + bytes > base + size) {
          return make_error(Errc::kInvalidArgument,
                            std::to_string(bytes) + " bytes from this pointer run " +
                                std::to_string(begin + bytes - (base + size)) + " bytes past the end of its allocation");
        }
      }
    }
    return attributes.device;
  }

  void to_host(std::span<const Copy> copies) override { copy_all(copies, cudaMemcpyDeviceToHost); }
  void to_device(std::span<const Copy> copies) override { copy_all(copies, cudaMemcpyHostToDevice); }

  std::uint64_t checksum(const std::byte* device, std::uint64_t bytes) override {
    OnDevice on(streams_, device_of_pointer(device));
    try {
      return cuda::device_checksum(device, bytes, on.stream());
    } catch (const cuda::CudaError& error) {
      throw net::DeviceCopyError(std::string("checksum on the GPU: ") + error.what());
    }
  }

  std::shared_ptr<void> pin_host(std::byte* host, std::uint64_t bytes) override {
    if (bytes == 0) return nullptr;
    // Portable: pinned for every context, whichever device the copy runs on.
    if (cudaHostRegister(host, bytes, cudaHostRegisterPortable) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return std::shared_ptr<void>(host, [](void* pinned) { cudaHostUnregister(pinned); });
  }

  void synchronize(int device, void* stream) override {
    DeviceScope scope(device);
    if (stream == nullptr) return check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize (the application's stream)");
  }

  std::shared_ptr<net::StagingProvider> staging(int device) override { return std::make_shared<CudaStaging>(device); }

  void flush_remote_writes(int device) override {
    DeviceScope scope(device);
    int ordering = 0;
    check(cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, device), "cudaDeviceGetAttribute");
    // Where the GPU orders NIC writes for its own kernels already, there is nothing to flush.
    if (ordering >= cudaGPUDirectRDMAWritesOrderingOwner) return;
    int options = 0;
    check(cudaDeviceGetAttribute(&options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, device), "cudaDeviceGetAttribute");
    if ((options & cudaFlushGPUDirectRDMAWritesOptionHost) == 0) {
      throw net::DeviceCopyError("CUDA device " + std::to_string(device) +
                                 " can neither order nor flush writes a NIC made into its memory (GPUDirect RDMA): "
                                 "use transport \"tcp\" for its tensors");
    }
    check(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                             cudaFlushGPUDirectRDMAWritesToOwner),
          "cudaDeviceFlushGPUDirectRDMAWrites");
  }

  std::optional<std::pair<const std::byte*, std::uint64_t>> allocation_of(const std::byte* pointer) override {
    if (address_range_ == nullptr) return std::nullopt;
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess || attributes.type != cudaMemoryTypeDevice) {
      cudaGetLastError();
      return std::nullopt;
    }
    DeviceScope scope(attributes.device);
    CUdeviceptr base = 0;
    size_t size = 0;
    if (address_range_(&base, &size, reinterpret_cast<CUdeviceptr>(pointer)) != CUDA_SUCCESS) return std::nullopt;
    return std::pair{reinterpret_cast<const std::byte*>(base), static_cast<std::uint64_t>(size)};
  }

  int dmabuf_fd(const std::byte* base, std::uint64_t bytes, std::string& why) override {
    if (range_handle_ == nullptr) {
      why = "the driver has no cuMemGetHandleForAddressRange (CUDA 11.7+)";
      return -1;
    }
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, base) != cudaSuccess || attributes.type != cudaMemoryTypeDevice) {
      cudaGetLastError();
      why = "not CUDA device memory";
      return -1;
    }
    DeviceScope scope(attributes.device);  // the driver call works in the allocation's context
    int fd = -1;
    const CUresult status = range_handle_(&fd, reinterpret_cast<CUdeviceptr>(base), bytes,
                                          CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
    if (status != CUDA_SUCCESS) {
      why = "cuMemGetHandleForAddressRange failed (CUresult " + std::to_string(static_cast<int>(status)) +
            "): this GPU, driver or kernel cannot export dma-bufs";
      return -1;
    }
    return fd;
  }

 private:
  void copy_all(std::span<const Copy> copies, cudaMemcpyKind kind) {
    if (copies.empty()) return;
    // A pool stream: ordered after nothing but this batch. (A handle's GPU tensors are all on one
    // device: Handle::register_tensor checks.)
    OnDevice on(streams_, device_of_pointer(copies.front().device));
    cudaError_t status = cudaSuccess;
    for (const Copy& copy : copies) {
      if (copy.bytes == 0) continue;
      void* to = kind == cudaMemcpyHostToDevice ? static_cast<void*>(copy.device) : static_cast<void*>(copy.host);
      const void* from = kind == cudaMemcpyHostToDevice ? static_cast<const void*>(copy.host) : copy.device;
      status = cudaMemcpyAsync(to, from, copy.bytes, kind, on.stream());
      if (status != cudaSuccess) break;
    }
    // Wait for what was started even if one failed to start: nothing may run after we return.
    const cudaError_t waited = cudaStreamSynchronize(on.stream());
    check(status, "cudaMemcpyAsync");
    check(waited, "cudaStreamSynchronize");
  }

  const MemGetAddressRange address_range_;
  const MemGetHandleForAddressRange range_handle_;
  StreamPool streams_;
};

}  // namespace

Result<std::shared_ptr<Gpu>> gpu() {
  static std::once_flag once;
  static Result<std::shared_ptr<Gpu>> made = make_error(Errc::kInvalidArgument, "not looked for yet");
  std::call_once(once, [] {
    int devices = 0;
    if (const cudaError_t status = cudaGetDeviceCount(&devices); status != cudaSuccess || devices == 0) {
      made = make_error(Errc::kInvalidArgument,
                        std::string("no CUDA device here (") +
                            (status != cudaSuccess ? cudaGetErrorString(status) : "the driver sees none") +
                            "), so GPU memory cannot be registered");
      return;
    }
    made = std::shared_ptr<Gpu>(std::make_shared<CudaGpu>());
  });
  return made;
}

}  // namespace th::client_impl
