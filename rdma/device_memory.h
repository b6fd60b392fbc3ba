// GPU (CUDA device) memory registered with the NIC, so that one-sided RDMA READs go straight
// between GPUs (GPUDirect RDMA) instead of through pinned host staging over TCP.
//
// The parts, all but the last pure logic (tested without CUDA, ibverbs or a GPU:
// tests/rdma/device_memory_test.cpp):
//   - DeviceMemoryApi: what rdma/ needs of the CUDA driver, behind an interface, so that rdma/
//     builds without the CUDA toolkit (libthclient implements it with the driver API).
//   - GpuRegistrationChoice: how GPU memory is registered, chosen once at transport start and
//     settled at the first registration (dma-buf can only be tried on a real allocation).
//   - AllocationRegistry: one registration per (CUDA allocation, port), shared by every lease,
//     grant and pull inside that allocation, and dropped with the allocation's last lease.
//   - register_by_choice: one allocation registered the way the choice says, falling back once.
//   - register_gpu_allocation: register_by_choice with the verbs calls (device_memory.cpp).
// The choice is the transport's, not per device: a host whose NICs differ in dma-buf support
// (unusual) settles on what the first registration found.
//
// Why whole allocations: PyTorch's caching allocator hands out sub-ranges of big cudaMalloc
// segments; registering each tensor would register the same pages many times (and a registration
// of GPU memory is not cheap). cuMemGetAddressRange tells the enclosing allocation: registered
// once, it covers every tensor carved from it.
//
// Why tied to leases: a registration pins the physical pages it was made on. If the application
// frees an allocation and the allocator hands the same address out again, a registration cached by
// address alone would read the old pages. The owner drops its lease before it frees the memory
// (DataTransport::lease_memory), and the registration goes with the allocation's last lease; a
// later lease of the same address finds no entry and registers afresh.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "net/socket.h"  // net::Fd: the dma-buf fd is closed once registered

namespace th::rdma {

class Device;
class MemoryRegion;

// A CUDA allocation (what cuMemGetAddressRange answers), or any range of device memory.
struct AllocationRange {
  const std::byte* base = nullptr;
  std::uint64_t bytes = 0;

  std::uintptr_t begin() const { return reinterpret_cast<std::uintptr_t>(base); }
  std::uintptr_t end() const { return begin() + bytes; }
  // Whether [pointer, +length) lies inside (no overflow: length is compared with what is left).
  bool contains(const std::byte* pointer, std::uint64_t length) const {
    const auto at = reinterpret_cast<std::uintptr_t>(pointer);
    return at >= begin() && at <= end() && length <= end() - at;
  }
  friend bool operator==(const AllocationRange&, const AllocationRange&) = default;
};

// What rdma/ asks of the CUDA driver (implemented in client/; a fake in the tests). Called from
// connection threads and the client's threads at once: implementations are thread-safe.
class DeviceMemoryApi {
 public:
  virtual ~DeviceMemoryApi() = default;
  // The whole allocation that holds `device_pointer` (cuMemGetAddressRange); nullopt when it is not
  // device memory this process can see.
  virtual std::optional<AllocationRange> allocation_of(const std::byte* device_pointer) = 0;
  // A dma-buf file descriptor for [base, +bytes) (cuMemGetHandleForAddressRange with
  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), which the caller closes; -1 and `why` when the driver,
  // the GPU or the kernel cannot. `base` and `bytes` are an allocation as allocation_of told it.
  virtual int dmabuf_fd(const std::byte* base, std::uint64_t bytes, std::string& why) = 0;
};

// How GPU memory is registered with the NIC.
enum class GpuRegistration : std::uint8_t {
  kDmaBuf,   // ibv_reg_dmabuf_mr on a dma-buf the CUDA driver exports (kernel 5.12+, CUDA 11.7+)
  kPeerMem,  // ibv_reg_mr on the device pointer: the nvidia-peermem kernel module resolves it
  kNone,     // not registered: GPU memory goes over TCP, staged through pinned host memory
};
// "dma-buf", "peermem", "staging" (as in the logs and TransportStats::device_registration).
std::string_view gpu_registration_name(GpuRegistration method);

// Whether the nvidia-peermem module (or its predecessor nv_peer_mem) is loaded, from
// `sysfs_root`/module/<name> (the tests point it at a directory of their own).
bool peermem_loaded(const std::filesystem::path& sysfs_root);

// How GPU memory is registered in this process: chosen at transport start (detect) and settled at
// the first dma-buf registration, because whether the GPU driver exports dma-bufs and whether the
// NIC's driver imports them can only be told by trying it on a real allocation.
//
// States and transitions:
//   start: without a DeviceMemoryApi, kNone for good (nothing tells us the allocations to
//          register). With it: dma-buf, unsettled, its fallback peermem if the module is loaded,
//          else kNone.
//   dma-buf, unsettled --dmabuf_worked--> dma-buf, settled
//   dma-buf, unsettled --dmabuf_failed--> fallback, settled (this system cannot; logged once)
//   dma-buf, settled   --dmabuf_failed--> unchanged (dma-buf works here: that allocation alone failed)
//   peermem, kNone: final.
// The first failure before any success is taken as the system's (a GPU driver without dma-buf
// export, a kernel before 5.12, a NIC driver without dma-buf import: rxe has none). An allocation
// dma-buf cannot take for its own reasons (one not page-aligned) is refused before trying.
// Thread-safe.
class GpuRegistrationChoice {
 public:
  GpuRegistrationChoice(bool have_api, bool peermem);
  // From the api's presence and sysfs (sysfs_root: "/sys" but in tests).
  static GpuRegistrationChoice detect(const DeviceMemoryApi* api, const std::filesystem::path& sysfs_root);
  GpuRegistrationChoice(const GpuRegistrationChoice&) = delete;
  GpuRegistrationChoice& operator=(const GpuRegistrationChoice&) = delete;

  GpuRegistration method() const;
  bool settled() const;
  // A line for the transport's log at start: the method and, while unsettled, what follows it.
  std::string describe() const;

  void dmabuf_worked();
  struct AfterFailure {
    GpuRegistration method;  // to use now (dma-buf: it worked before; this allocation failed alone)
    bool changed;            // this call moved off dma-buf (the caller logs it, once)
  };
  AfterFailure dmabuf_failed();

 private:
  mutable std::mutex mutex_;
  GpuRegistration method_;
  GpuRegistration fallback_;
  bool settled_;
};

// The registrations of leased GPU allocations, one per (allocation, port), handed out as shared
// references. `Registration` is MemoryRegion in the transport and a fake in the tests; the
// registrar makes one for a whole allocation on a port, or says why it cannot.
//
// Bounds: an entry exists only while at least one lease of its allocation lives, so the map holds
// at most as many entries as there are distinct leased allocations (the application's live CUDA
// allocations, a handful of segments per GPU with PyTorch), each with at most `ports` registrations.
// A registration a grant or pull still holds outlives its entry until that grant is revoked or that
// pull ends (the owner revokes before it frees).
//
// Concurrency: lease() and registration() are called from the data port's connection threads and
// the client's threads; the lease tokens die on any thread. One mutex guards the map; the
// registrar (which may take a while: it pins GPU pages) runs outside it, under the entry's own
// mutex, so that one allocation is registered once however many threads ask at the same moment
// while different allocations register in parallel.
template <typename Registration>
class AllocationRegistry {
 public:
  using Registrar = std::function<Result<std::shared_ptr<Registration>>(std::size_t port, const AllocationRange&)>;

  AllocationRegistry(std::shared_ptr<DeviceMemoryApi> api, std::size_t ports, Registrar registrar)
      : api_(std::move(api)), shared_(std::make_shared<Shared>()), ports_(ports), registrar_(std::move(registrar)) {
    TH_REQUIRE(api_ != nullptr, "an allocation registry needs the CUDA driver's answers");
    TH_REQUIRE(ports_ > 0);
    TH_REQUIRE(registrar_ != nullptr);
  }
  AllocationRegistry(const AllocationRegistry&) = delete;
  AllocationRegistry& operator=(const AllocationRegistry&) = delete;

  // Lends [pointer, +bytes) of device memory until the returned token is dropped. Errors
  // (kInvalidArgument: the application handed us a bad pointer): not device memory, a range that
  // leaves its allocation, or an allocation that changed under a live lease (freed before its lease
  // was dropped). The token holds no memory and may outlive the registry (it then does nothing).
  Result<std::shared_ptr<void>> lease(const std::byte* pointer, std::uint64_t bytes) {
    TH_REQUIRE(pointer != nullptr);
    TH_REQUIRE(bytes > 0);
    Result<AllocationRange> found = enclosing(pointer, bytes);
    if (!found) return found.error();
    const AllocationRange allocation = std::move(found).value();
    std::shared_ptr<Entry> entry;
    {
      std::lock_guard lock(shared_->mutex);
      auto& entries = shared_->entries;
      auto at = entries.find(allocation.begin());
      if (at != entries.end()) {
        if (!(at->second->range == allocation)) {
          return make_error(Errc::kInvalidArgument,
                            "device allocation at " + hex(allocation.begin()) + " changed size under a live lease (" +
                                std::to_string(at->second->range.bytes) + " -> " + std::to_string(allocation.bytes) +
                                " bytes): freed before its lease was dropped?");
        }
        entry = at->second;
      } else {
        // Live allocations do not overlap: an overlapping entry is one freed under its lease.
        if (const Entry* other = overlapping(allocation)) {
          return make_error(Errc::kInvalidArgument,
                            "device allocation [" + hex(allocation.begin()) + ", " + hex(allocation.end()) +
                                ") overlaps a leased one at " + hex(other->range.begin()) +
                                ": freed before its lease was dropped?");
        }
        entry = std::make_shared<Entry>(allocation, ports_);
        entries.emplace(allocation.begin(), entry);
      }
      ++entry->leases;
      TH_ASSERT(entry->live);
    }
    std::weak_ptr<Shared> weak_shared = shared_;
    std::weak_ptr<Entry> weak_entry = entry;
    return std::shared_ptr<void>(const_cast<std::byte*>(pointer), [weak_shared, weak_entry](void*) {
      const auto registry = weak_shared.lock();
      const auto leased = weak_entry.lock();
      if (registry != nullptr && leased != nullptr) release(*registry, leased);
    });
  }

  // The registration on `port` of the allocation around [pointer, +bytes): the leased allocation's
  // (made at the first call, then shared), else, for memory nobody leased, one of its allocation
  // kept by the caller alone (as host memory never leased is registered per grant or pull). Errors:
  // kInvalidArgument as lease() says; the registrar's own. A leased allocation's failure is
  // remembered until its last lease ends (not retried for every grant and pull: they go over TCP).
  Result<std::shared_ptr<Registration>> registration(std::size_t port, const std::byte* pointer, std::uint64_t bytes) {
    TH_REQUIRE(port < ports_);
    TH_REQUIRE(pointer != nullptr);
    TH_REQUIRE(bytes > 0);
    std::shared_ptr<Entry> entry;
    {
      std::lock_guard lock(shared_->mutex);
      entry = leased_around(pointer, bytes);
      if (entry != nullptr && entry->registrations[port] != nullptr) return entry->registrations[port];
      if (entry != nullptr && entry->failures[port]) return *entry->failures[port];
    }
    if (entry == nullptr) {
      Result<AllocationRange> found = enclosing(pointer, bytes);
      if (!found) return found.error();
      return register_counted(port, found.value());
    }
    // One registrar call per entry at a time: whoever comes second finds it registered.
    std::lock_guard registering(entry->registering);
    {
      std::lock_guard lock(shared_->mutex);
      if (entry->registrations[port] != nullptr) return entry->registrations[port];
      if (entry->failures[port]) return *entry->failures[port];
    }
    Result<std::shared_ptr<Registration>> made = register_counted(port, entry->range);
    std::lock_guard lock(shared_->mutex);
    // The last lease may have ended meanwhile (and the memory been freed and leased afresh: a new
    // entry): then this registration is not cached, and serves only this caller, whose grant or
    // pull keeps its memory alive.
    if (!entry->live) return made;
    if (made) {
      entry->registrations[port] = made.value();
    } else {
      entry->failures[port] = made.error();
    }
    return made;
  }

  // Registrations the registrar made (each of a whole allocation on one port).
  std::uint64_t registrations() const {
    std::lock_guard lock(shared_->mutex);
    return shared_->registrations;
  }
  // Allocations leased now.
  std::size_t allocations() const {
    std::lock_guard lock(shared_->mutex);
    return shared_->entries.size();
  }

 private:
  struct Entry {
    Entry(const AllocationRange& range_in, std::size_t ports)
        : range(range_in), registrations(ports), failures(ports) {}
    const AllocationRange range;
    std::uint64_t leases = 0;  // guarded by Shared::mutex
    bool live = true;          // in the map; guarded by Shared::mutex
    // Per port, the registration or why there is none (at most one of them). Guarded by Shared::mutex.
    std::vector<std::shared_ptr<Registration>> registrations;
    std::vector<std::optional<Error>> failures;
    std::mutex registering;    // held across the registrar call (not Shared::mutex)
  };
  // What the lease tokens reach (weakly): the registry may go first.
  struct Shared {
    mutable std::mutex mutex;
    std::map<std::uintptr_t, std::shared_ptr<Entry>> entries;  // by allocation base; see Bounds
    std::uint64_t registrations = 0;
  };

  static std::string hex(std::uintptr_t value) {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string text;
    do {
      text.insert(text.begin(), kDigits[value & 0xf]);
      value >>= 4;
    } while (value != 0);
    return "0x" + text;
  }

  static void release(Shared& shared, const std::shared_ptr<Entry>& entry) {
    std::vector<std::shared_ptr<Registration>> dropped;  // deregistered after the lock is let go
    {
      std::lock_guard lock(shared.mutex);
      TH_ASSERT(entry->leases > 0, "a lease ends once");
      if (--entry->leases > 0) return;
      entry->live = false;
      const auto at = shared.entries.find(entry->range.begin());
      TH_ASSERT(at != shared.entries.end() && at->second == entry, "a live entry is in the map");
      shared.entries.erase(at);
      dropped.swap(entry->registrations);
    }
  }

  Result<AllocationRange> enclosing(const std::byte* pointer, std::uint64_t bytes) const {
    const std::optional<AllocationRange> allocation = api_->allocation_of(pointer);
    const auto at = reinterpret_cast<std::uintptr_t>(pointer);
    if (!allocation || allocation->bytes == 0) {
      return make_error(Errc::kInvalidArgument, hex(at) + " is not device memory this process can see");
    }
    if (!allocation->contains(pointer, bytes)) {
      return make_error(Errc::kInvalidArgument,
                        "device range [" + hex(at) + ", +" + std::to_string(bytes) + ") leaves its allocation [" +
                            hex(allocation->begin()) + ", " + hex(allocation->end()) + ")");
    }
    return *allocation;
  }

  // The leased entry whose allocation holds [pointer, +bytes), if any. Called with the mutex held.
  std::shared_ptr<Entry> leased_around(const std::byte* pointer, std::uint64_t bytes) const {
    auto after = shared_->entries.upper_bound(reinterpret_cast<std::uintptr_t>(pointer));
    if (after == shared_->entries.begin()) return nullptr;
    const std::shared_ptr<Entry>& entry = std::prev(after)->second;
    return entry->range.contains(pointer, bytes) ? entry : nullptr;
  }

  // An entry overlapping `allocation` (its neighbours by base). Called with the mutex held.
  const Entry* overlapping(const AllocationRange& allocation) const {
    const auto& entries = shared_->entries;
    auto after = entries.lower_bound(allocation.begin());
    if (after != entries.end() && after->second->range.begin() < allocation.end()) return after->second.get();
    if (after != entries.begin() && std::prev(after)->second->range.end() > allocation.begin()) {
      return std::prev(after)->second.get();
    }
    return nullptr;
  }

  Result<std::shared_ptr<Registration>> register_counted(std::size_t port, const AllocationRange& allocation) {
    Result<std::shared_ptr<Registration>> made = registrar_(port, allocation);
    if (made) {
      TH_ASSERT(made.value() != nullptr, "a registrar returns a registration or an error");
      std::lock_guard lock(shared_->mutex);
      ++shared_->registrations;
    }
    return made;
  }

  const std::shared_ptr<DeviceMemoryApi> api_;
  const std::shared_ptr<Shared> shared_;
  const std::size_t ports_;
  const Registrar registrar_;
};

// The host's page size: a dma-buf registration maps whole pages, so an allocation must begin on one.
std::uint64_t host_page_bytes();

// The two ways to register a whole allocation (verbs calls in the transport, fakes in the tests).
// Each returns the registration or an error saying why it could not.
template <typename Registration>
struct GpuRegistrars {
  // A dma-buf whose byte 0 is the allocation's first, registered at iova = the allocation's base
  // (so that work requests name device addresses). The fd stays the caller's.
  std::function<Result<std::shared_ptr<Registration>>(int dmabuf_fd, const AllocationRange&)> dmabuf;
  // The device pointer itself (nvidia-peermem resolves it to GPU pages).
  std::function<Result<std::shared_ptr<Registration>>(const AllocationRange&)> peermem;
};

// register_by_choice (below) with the verbs calls: ibv_reg_dmabuf_mr or ibv_reg_mr on `device`, `access`
// as for host memory (register_access in protocol.h).
Result<std::shared_ptr<MemoryRegion>> register_gpu_allocation(const Device& device, DeviceMemoryApi& api,
                                                              GpuRegistrationChoice& choice,
                                                              const AllocationRange& allocation, int access,
                                                              const std::function<void(const std::string&)>& log);

// ---- register_by_choice -------------------------------------------------------------------------

// Registers the whole `allocation` as `choice` says: dma-buf (the api exports an fd, closed here
// once registered: the registration holds its own reference to the dma-buf), falling to the
// choice's fallback when the first dma-buf attempt fails; the device pointer with nvidia-peermem;
// kNone is an error ("staging"). `log` hears the change of method (once).
// Errors are kUnavailable: this allocation goes over TCP, staged.
template <typename Registration>
Result<std::shared_ptr<Registration>> register_by_choice(DeviceMemoryApi& api, GpuRegistrationChoice& choice,
                                                         const AllocationRange& allocation,
                                                         const GpuRegistrars<Registration>& by,
                                                         const std::function<void(const std::string&)>& log) {
  TH_REQUIRE(allocation.base != nullptr);
  TH_REQUIRE(allocation.bytes > 0);
  // At most two methods: dma-buf, then (after its first failure) the fallback, which is never dma-buf.
  constexpr int kMethodsTriedMax = 2;
  for (int tried = 0; tried < kMethodsTriedMax; ++tried) {
    const GpuRegistration method = choice.method();
    if (method == GpuRegistration::kNone) {
      return make_error(Errc::kUnavailable, "GPU memory is not registered with the NIC here (no dma-buf, no "
                                            "nvidia-peermem): it is staged through host memory over TCP");
    }
    if (method == GpuRegistration::kPeerMem) return by.peermem(allocation);
    TH_ASSERT(method == GpuRegistration::kDmaBuf);
    if (allocation.begin() % host_page_bytes() != 0 || allocation.bytes % host_page_bytes() != 0) {
      // This allocation's own limit (cuMemGetHandleForAddressRange takes whole pages; a small
      // cudaMalloc shares one): not the system's, so dma-buf stays the choice for the others.
      return make_error(Errc::kUnavailable, "a GPU allocation that does not begin and end on a page cannot be "
                                            "registered through dma-buf");
    }
    std::string why;
    {
      const net::Fd fd(api.dmabuf_fd(allocation.base, allocation.bytes, why));
      if (fd.valid()) {
        Result<std::shared_ptr<Registration>> made = by.dmabuf(fd.get(), allocation);
        if (made) {
          choice.dmabuf_worked();
          return made;  // the fd closes here; the registration keeps the dma-buf alive
        }
        why = made.error().detail;
      } else if (why.empty()) {
        why = "the CUDA driver exported no dma-buf";
      }
    }
    const GpuRegistrationChoice::AfterFailure after = choice.dmabuf_failed();
    if (after.changed && log) {
      log("GPU memory: dma-buf registration does not work here (" + why + "); registering it through " +
          std::string(gpu_registration_name(after.method)) + " from now on");
    }
    if (after.method == GpuRegistration::kDmaBuf) {
      return make_error(Errc::kUnavailable, "dma-buf registration of a GPU allocation failed: " + why);
    }
  }
  TH_ASSERT(false, "the fallback of dma-buf is another method");
  return make_error(Errc::kUnavailable, "unreachable");
}

}  // namespace th::rdma
