#include "rdma/device_memory.h"

#include <unistd.h>

#include <system_error>

#include "rdma/verbs.h"

namespace th::rdma {

std::string_view gpu_registration_name(GpuRegistration method) {
  switch (method) {
    case GpuRegistration::kDmaBuf:
      return "dma-buf";
    case GpuRegistration::kPeerMem:
      return "peermem";
    case GpuRegistration::kNone:
      return "staging";
  }
  TH_ASSERT(false, "a GpuRegistration", static_cast<int>(method));
  return "?";
}

bool peermem_loaded(const std::filesystem::path& sysfs_root) {
  // nvidia-peermem (the driver's own, since 465) or the older out-of-tree nv_peer_mem: either lets
  // ibv_reg_mr take a device pointer.
  for (const char* module : {"nvidia_peermem", "nv_peer_mem"}) {
    std::error_code error;  // unreadable counts as absent
    if (std::filesystem::exists(sysfs_root / "module" / module, error)) return true;
  }
  return false;
}

GpuRegistrationChoice::GpuRegistrationChoice(bool have_api, bool peermem)
    : method_(have_api ? GpuRegistration::kDmaBuf : GpuRegistration::kNone),
      fallback_(have_api && peermem ? GpuRegistration::kPeerMem : GpuRegistration::kNone),
      settled_(!have_api) {
  TH_ASSERT(fallback_ != GpuRegistration::kDmaBuf);
}

GpuRegistrationChoice GpuRegistrationChoice::detect(const DeviceMemoryApi* api, const std::filesystem::path& sysfs_root) {
  return GpuRegistrationChoice(api != nullptr, peermem_loaded(sysfs_root));
}

GpuRegistration GpuRegistrationChoice::method() const {
  std::lock_guard lock(mutex_);
  return method_;
}

bool GpuRegistrationChoice::settled() const {
  std::lock_guard lock(mutex_);
  return settled_;
}

std::string GpuRegistrationChoice::describe() const {
  std::lock_guard lock(mutex_);
  switch (method_) {
    case GpuRegistration::kDmaBuf:
      if (settled_) return "GPU memory is registered with the NIC through dma-buf";
      return "GPU memory is registered with the NIC through dma-buf if the first registration works, else " +
             std::string(fallback_ == GpuRegistration::kPeerMem ? "through nvidia-peermem"
                                                                : "staged through host memory over TCP (no nvidia-peermem)");
    case GpuRegistration::kPeerMem:
      return "GPU memory is registered with the NIC through nvidia-peermem";
    case GpuRegistration::kNone:
      return "GPU memory is staged through host memory over TCP (not registered with the NIC: no CUDA driver "
             "given to the transport, or neither dma-buf nor nvidia-peermem)";
  }
  TH_ASSERT(false, "a GpuRegistration", static_cast<int>(method_));
  return "";
}

void GpuRegistrationChoice::dmabuf_worked() {
  std::lock_guard lock(mutex_);
  TH_ASSERT(method_ == GpuRegistration::kDmaBuf, "dma-buf is tried only while chosen");
  settled_ = true;
}

GpuRegistrationChoice::AfterFailure GpuRegistrationChoice::dmabuf_failed() {
  std::lock_guard lock(mutex_);
  if (method_ != GpuRegistration::kDmaBuf) return {method_, false};  // another thread's failure moved it first
  if (settled_) return {method_, false};
  method_ = fallback_;
  settled_ = true;
  TH_ASSERT(method_ != GpuRegistration::kDmaBuf);
  return {method_, true};
}

std::uint64_t host_page_bytes() {
  static const std::uint64_t page_bytes = [] {
    const long bytes = ::sysconf(_SC_PAGESIZE);
    return bytes > 0 ? static_cast<std::uint64_t>(bytes) : std::uint64_t{4096};
  }();
  return page_bytes;
}

Result<std::shared_ptr<MemoryRegion>> register_gpu_allocation(const Device& device, DeviceMemoryApi& api,
                                                              GpuRegistrationChoice& choice,
                                                              const AllocationRange& allocation, int access,
                                                              const std::function<void(const std::string&)>& log) {
  // VerbsError (the call and its errno) becomes this allocation's error: it goes over TCP, staged.
  GpuRegistrars<MemoryRegion> by;
  by.dmabuf = [&](int fd, const AllocationRange& range) -> Result<std::shared_ptr<MemoryRegion>> {
    try {
      return std::make_shared<MemoryRegion>(device, DmaBuf{fd, 0}, range.begin(), range.bytes, access);
    } catch (const VerbsError& error) {
      return make_error(Errc::kUnavailable, error.what());
    }
  };
  by.peermem = [&](const AllocationRange& range) -> Result<std::shared_ptr<MemoryRegion>> {
    try {
      return std::make_shared<MemoryRegion>(device, const_cast<std::byte*>(range.base), range.bytes, access);
    } catch (const VerbsError& error) {
      return make_error(Errc::kUnavailable, std::string(error.what()) + " (GPU memory through nvidia-peermem)");
    }
  };
  return register_by_choice(api, choice, allocation, by, log);
}

}  // namespace th::rdma
