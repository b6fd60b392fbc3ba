// GPU memory registration logic (rdma/device_memory.h) without a GPU, CUDA or an RDMA device: a
// fake CUDA driver (allocations are numbers, never dereferenced) and a fake registrar that counts.
#include "rdma/device_memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

namespace th::rdma {
namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

const std::byte* at(std::uintptr_t address) { return reinterpret_cast<const std::byte*>(address); }

// The CUDA driver's view: allocations by base. dmabuf_fd hands out a real fd (of /dev/null) when
// dma-buf "works", so that the test can see it closed.
class FakeDeviceMemory final : public DeviceMemoryApi {
 public:
  void allocate(std::uintptr_t base, std::uint64_t bytes) {
    std::lock_guard lock(mutex_);
    allocations_[base] = bytes;
  }
  void free(std::uintptr_t base) {
    std::lock_guard lock(mutex_);
    allocations_.erase(base);
  }
  std::optional<AllocationRange> allocation_of(const std::byte* device_pointer) override {
    std::lock_guard lock(mutex_);
    const auto address = reinterpret_cast<std::uintptr_t>(device_pointer);
    auto after = allocations_.upper_bound(address);
    if (after == allocations_.begin()) return std::nullopt;
    const auto& [base, bytes] = *std::prev(after);
    if (address >= base + bytes) return std::nullopt;
    return AllocationRange{at(base), bytes};
  }
  int dmabuf_fd(const std::byte* base, std::uint64_t bytes, std::string& why) override {
    ++dmabuf_calls;
    EXPECT_EQ(allocation_of(base), (AllocationRange{base, bytes})) << "a whole allocation is exported";
    if (!dmabuf_works) {
      why = "CUDA_ERROR_NOT_SUPPORTED";
      return -1;
    }
    last_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    return last_fd;
  }

  bool dmabuf_works = true;
  int dmabuf_calls = 0;
  int last_fd = -1;

 private:
  std::mutex mutex_;
  std::map<std::uintptr_t, std::uint64_t> allocations_;
};

// A registration that says when it is dropped (as ~MemoryRegion deregisters).
struct FakeRegistration {
  FakeRegistration(std::size_t port_in, AllocationRange range_in, std::atomic<int>& dropped_in)
      : port(port_in), range(range_in), dropped(dropped_in) {}
  ~FakeRegistration() { ++dropped; }
  std::size_t port;
  AllocationRange range;
  std::atomic<int>& dropped;
};

struct Fixture {
  std::shared_ptr<FakeDeviceMemory> api = std::make_shared<FakeDeviceMemory>();
  std::atomic<int> registered{0};
  std::atomic<int> dropped{0};
  std::atomic<bool> fail{false};
  std::chrono::milliseconds registering{0};  // widens the race in the concurrency test
  AllocationRegistry<FakeRegistration> registry{
      api, 2, [this](std::size_t port, const AllocationRange& range) -> Result<std::shared_ptr<FakeRegistration>> {
        if (registering.count() > 0) std::this_thread::sleep_for(registering);
        if (fail) return make_error(Errc::kUnavailable, "ibv_reg_mr failed: Bad address");
        ++registered;
        return std::make_shared<FakeRegistration>(port, range, dropped);
      }};
};

constexpr std::uintptr_t kSegment = 0x7f0000000000;  // a 2 MiB-aligned "cudaMalloc" segment

TEST(DeviceMemoryRegistry, TwoSubRangesOfOneAllocationRegisterItOnce) {
  Fixture f;
  f.api->allocate(kSegment, 20 * kMiB);
  auto first = f.registry.lease(at(kSegment + kMiB), 4 * kMiB);
  auto second = f.registry.lease(at(kSegment + 8 * kMiB), 2 * kMiB);
  ASSERT_TRUE(first.ok()) << first.error().detail;
  ASSERT_TRUE(second.ok()) << second.error().detail;
  EXPECT_EQ(f.registry.allocations(), 1u);
  auto a = f.registry.registration(0, at(kSegment + kMiB), 4 * kMiB);
  auto b = f.registry.registration(0, at(kSegment + 8 * kMiB), 2 * kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a.value(), b.value()) << "one registration, shared";
  EXPECT_EQ(a.value()->range, (AllocationRange{at(kSegment), 20 * kMiB})) << "the whole allocation";
  EXPECT_EQ(f.registered, 1);
  EXPECT_EQ(f.registry.registrations(), 1u);
  // Another port is another device: its own registration.
  auto other_port = f.registry.registration(1, at(kSegment + kMiB), kMiB);
  ASSERT_TRUE(other_port.ok());
  EXPECT_EQ(other_port.value()->port, 1u);
  EXPECT_EQ(f.registered, 2);
}

TEST(DeviceMemoryRegistry, ARangeLeavingItsAllocationIsRefused) {
  Fixture f;
  f.api->allocate(kSegment, 4 * kMiB);
  auto crossing = f.registry.lease(at(kSegment + 4 * kMiB - 16), 32);
  ASSERT_FALSE(crossing.ok());
  EXPECT_EQ(crossing.error().code, Errc::kInvalidArgument);
  EXPECT_NE(crossing.error().detail.find("leaves its allocation"), std::string::npos) << crossing.error().detail;
  auto registered = f.registry.registration(0, at(kSegment + 4 * kMiB - 16), 32);
  ASSERT_FALSE(registered.ok());
  EXPECT_EQ(registered.error().code, Errc::kInvalidArgument);
  // Not device memory at all (a host pointer, or another process's).
  auto unknown = f.registry.lease(at(0x1000), 64);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.error().code, Errc::kInvalidArgument);
  // Overflowing the address space is leaving it too.
  auto huge = f.registry.lease(at(kSegment + kMiB), ~std::uint64_t{0});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(f.registered, 0);
  EXPECT_EQ(f.registry.allocations(), 0u);
}

TEST(DeviceMemoryRegistry, TwoAllocationsRegisterTwice) {
  Fixture f;
  f.api->allocate(kSegment, 2 * kMiB);
  f.api->allocate(kSegment + 2 * kMiB, 2 * kMiB);  // adjacent, but another allocation
  auto first = f.registry.lease(at(kSegment), 2 * kMiB);
  auto second = f.registry.lease(at(kSegment + 2 * kMiB), kMiB);
  ASSERT_TRUE(first.ok() && second.ok());
  auto a = f.registry.registration(0, at(kSegment), kMiB);
  auto b = f.registry.registration(0, at(kSegment + 2 * kMiB), kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a.value(), b.value());
  EXPECT_EQ(f.registered, 2);
  EXPECT_EQ(f.registry.allocations(), 2u);
  // A range over both is in neither: refused, not registered across them.
  auto across = f.registry.registration(0, at(kSegment + kMiB), 2 * kMiB);
  ASSERT_FALSE(across.ok());
  EXPECT_EQ(across.error().code, Errc::kInvalidArgument);
}

TEST(DeviceMemoryRegistry, DroppedWithTheLastLeaseAndAReusedAddressRegistersAfresh) {
  Fixture f;
  f.api->allocate(kSegment, 8 * kMiB);
  auto first = f.registry.lease(at(kSegment), kMiB);
  auto second = f.registry.lease(at(kSegment + kMiB), kMiB);
  ASSERT_TRUE(first.ok() && second.ok());
  std::shared_ptr<FakeRegistration> held = f.registry.registration(0, at(kSegment), kMiB).value();  // a grant's
  std::shared_ptr<void> first_lease = std::move(first).value();
  std::shared_ptr<void> second_lease = std::move(second).value();
  first_lease.reset();
  EXPECT_EQ(f.registry.allocations(), 1u) << "one lease is left";
  EXPECT_EQ(f.registry.registration(0, at(kSegment + kMiB), kMiB).value(), held) << "still cached";
  second_lease.reset();
  EXPECT_EQ(f.registry.allocations(), 0u) << "the last lease took the entry";
  EXPECT_EQ(f.dropped, 0) << "a grant still holds the registration (the owner revokes before freeing)";
  held.reset();
  EXPECT_EQ(f.dropped, 1) << "deregistered once nobody holds it";

  // The application frees the segment and the allocator hands the same address out again, bigger:
  // the new lease must not find the old pages' registration.
  f.api->free(kSegment);
  f.api->allocate(kSegment, 16 * kMiB);
  auto again = f.registry.lease(at(kSegment), kMiB);
  ASSERT_TRUE(again.ok());
  auto fresh = f.registry.registration(0, at(kSegment + 12 * kMiB), kMiB);
  ASSERT_TRUE(fresh.ok()) << fresh.error().detail;
  EXPECT_EQ(fresh.value()->range, (AllocationRange{at(kSegment), 16 * kMiB}));
  EXPECT_EQ(f.registered, 2) << "registered afresh";
}

TEST(DeviceMemoryRegistry, AnAllocationFreedUnderALiveLeaseIsRefused) {
  Fixture f;
  f.api->allocate(kSegment, 8 * kMiB);
  auto lease = f.registry.lease(at(kSegment), kMiB);
  ASSERT_TRUE(lease.ok());
  f.api->free(kSegment);  // the application's bug: freed while its lease lives
  f.api->allocate(kSegment, 4 * kMiB);
  auto same_base = f.registry.lease(at(kSegment), kMiB);
  ASSERT_FALSE(same_base.ok());
  EXPECT_EQ(same_base.error().code, Errc::kInvalidArgument);
  f.api->free(kSegment);
  f.api->allocate(kSegment + 2 * kMiB, 8 * kMiB);  // overlaps the stale entry's range
  auto overlapping = f.registry.lease(at(kSegment + 2 * kMiB), kMiB);
  ASSERT_FALSE(overlapping.ok());
  EXPECT_EQ(overlapping.error().code, Errc::kInvalidArgument);
}

TEST(DeviceMemoryRegistry, ConcurrentLeasesRegisterOnce) {
  Fixture f;
  f.registering = std::chrono::milliseconds(20);  // every thread arrives while the first registers
  f.api->allocate(kSegment, 64 * kMiB);
  constexpr int kThreads = 8;
  std::vector<std::shared_ptr<void>> leases(kThreads);
  std::vector<std::shared_ptr<FakeRegistration>> got(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      const std::uintptr_t mine = kSegment + static_cast<std::uintptr_t>(i) * 8 * kMiB;
      auto lease = f.registry.lease(at(mine), 8 * kMiB);
      if (!lease.ok()) return;
      leases[i] = std::move(lease).value();
      auto registration = f.registry.registration(0, at(mine), 8 * kMiB);
      if (registration.ok()) got[i] = registration.value();
    });
  }
  for (auto& thread : threads) thread.join();
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_NE(leases[i], nullptr) << i;
    ASSERT_NE(got[i], nullptr) << i;
    EXPECT_EQ(got[i], got[0]) << i;
  }
  EXPECT_EQ(f.registered, 1);
  // And they end concurrently: the registration goes once, with the last.
  got.clear();
  threads.clear();
  for (int i = 0; i < kThreads; ++i) threads.emplace_back([&, i] { leases[i].reset(); });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(f.registry.allocations(), 0u);
  EXPECT_EQ(f.dropped, 1);
}

TEST(DeviceMemoryRegistry, AFailureIsRememberedUntilTheLeaseEnds) {
  Fixture f;
  f.fail = true;
  f.api->allocate(kSegment, 4 * kMiB);
  std::shared_ptr<void> lease = f.registry.lease(at(kSegment), kMiB).value();
  for (int grant = 0; grant < 3; ++grant) {
    auto registration = f.registry.registration(0, at(kSegment), kMiB);
    ASSERT_FALSE(registration.ok());
    EXPECT_EQ(registration.error().code, Errc::kUnavailable);
  }
  EXPECT_EQ(f.registry.registrations(), 0u);
  f.fail = false;
  EXPECT_FALSE(f.registry.registration(0, at(kSegment), kMiB).ok()) << "not retried for every grant";
  lease.reset();  // the lease ends
  auto again = f.registry.lease(at(kSegment), kMiB);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(f.registry.registration(0, at(kSegment), kMiB).ok()) << "a new lease tries again";
}

TEST(DeviceMemoryRegistry, MemoryNobodyLeasedIsRegisteredPerCaller) {
  Fixture f;
  f.api->allocate(kSegment, 4 * kMiB);
  auto a = f.registry.registration(0, at(kSegment), kMiB);
  auto b = f.registry.registration(0, at(kSegment), kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a.value(), b.value()) << "not cached: nothing would tell us when the memory is freed";
  EXPECT_EQ(a.value()->range, (AllocationRange{at(kSegment), 4 * kMiB}));
  EXPECT_EQ(f.registry.allocations(), 0u);
  EXPECT_EQ(f.registry.registrations(), 2u);
}

TEST(DeviceMemoryRegistry, ALeaseMayOutliveTheRegistry) {
  std::shared_ptr<void> lease;
  {
    Fixture f;
    f.api->allocate(kSegment, 4 * kMiB);
    lease = f.registry.lease(at(kSegment), kMiB).value();
    ASSERT_TRUE(f.registry.registration(0, at(kSegment), kMiB).ok());
  }  // the transport is gone (its registrations with it)
  lease.reset();  // ends nothing, touches nothing
}

// ---- How GPU memory is registered -------------------------------------------------------------

class FakeSysfs {
 public:
  FakeSysfs() : root_(std::filesystem::temp_directory_path() /
                      ("th-device-memory-test-" + std::to_string(::getpid()) + "-" + std::to_string(next_++))) {
    std::filesystem::create_directories(root_ / "module" / "nvidia");
  }
  ~FakeSysfs() {
    std::error_code ignored;
    std::filesystem::remove_all(root_, ignored);
  }
  void load(const std::string& module) { std::filesystem::create_directories(root_ / "module" / module); }
  const std::filesystem::path& root() const { return root_; }

 private:
  static inline int next_ = 0;
  std::filesystem::path root_;
};

GpuRegistrars<FakeRegistration> fake_registrars(std::atomic<int>& dropped, std::vector<std::string>& calls) {
  GpuRegistrars<FakeRegistration> by;
  by.dmabuf = [&](int fd, const AllocationRange& range) -> Result<std::shared_ptr<FakeRegistration>> {
    EXPECT_GE(::fcntl(fd, F_GETFD), 0) << "the fd is open while it is registered";
    calls.push_back("dma-buf");
    return std::make_shared<FakeRegistration>(0, range, dropped);
  };
  by.peermem = [&](const AllocationRange& range) -> Result<std::shared_ptr<FakeRegistration>> {
    calls.push_back("peermem");
    return std::make_shared<FakeRegistration>(0, range, dropped);
  };
  return by;
}

TEST(GpuRegistrationDetection, PeermemFromSysfsNoneWithoutIt) {
  FakeSysfs sysfs;
  EXPECT_FALSE(peermem_loaded(sysfs.root()));
  EXPECT_FALSE(peermem_loaded(sysfs.root() / "missing"));
  sysfs.load("nv_peer_mem");  // the legacy module counts
  EXPECT_TRUE(peermem_loaded(sysfs.root()));
  FakeSysfs modern;
  modern.load("nvidia_peermem");
  EXPECT_TRUE(peermem_loaded(modern.root()));

  // Without the CUDA driver's answers nothing is registered, peermem or not.
  const auto without_api = GpuRegistrationChoice::detect(nullptr, modern.root());
  EXPECT_EQ(without_api.method(), GpuRegistration::kNone);
  EXPECT_TRUE(without_api.settled());
  EXPECT_EQ(gpu_registration_name(without_api.method()), "staging");
}

TEST(GpuRegistrationDetection, DmaBufWhenTheProbeWorks) {
  FakeSysfs sysfs;
  sysfs.load("nvidia_peermem");
  FakeDeviceMemory api;
  api.allocate(kSegment, 4 * kMiB);
  auto choice = GpuRegistrationChoice::detect(&api, sysfs.root());
  EXPECT_EQ(choice.method(), GpuRegistration::kDmaBuf) << "preferred even with peermem loaded";
  EXPECT_FALSE(choice.settled());
  EXPECT_NE(choice.describe().find("nvidia-peermem"), std::string::npos) << choice.describe();
  std::atomic<int> dropped{0};
  std::vector<std::string> calls;
  std::vector<std::string> logged;
  auto made = register_by_choice<FakeRegistration>(api, choice, {at(kSegment), 4 * kMiB}, fake_registrars(dropped, calls),
                                                   [&](const std::string& line) { logged.push_back(line); });
  ASSERT_TRUE(made.ok()) << made.error().detail;
  EXPECT_EQ(calls, std::vector<std::string>{"dma-buf"});
  EXPECT_EQ(choice.method(), GpuRegistration::kDmaBuf);
  EXPECT_TRUE(choice.settled());
  EXPECT_TRUE(logged.empty());
  errno = 0;
  EXPECT_EQ(::fcntl(api.last_fd, F_GETFD), -1) << "the dma-buf fd is closed once registered";
  EXPECT_EQ(errno, EBADF);

  // Settled: a later failure is that allocation's, not the system's.
  api.dmabuf_works = false;
  api.allocate(kSegment + 4 * kMiB, 4 * kMiB);
  auto later = register_by_choice<FakeRegistration>(api, choice, {at(kSegment + 4 * kMiB), 4 * kMiB},
                                                    fake_registrars(dropped, calls), nullptr);
  ASSERT_FALSE(later.ok());
  EXPECT_EQ(later.error().code, Errc::kUnavailable);
  EXPECT_EQ(choice.method(), GpuRegistration::kDmaBuf);
}

TEST(GpuRegistrationDetection, PeermemWhenDmaBufFailsAtFirstUse) {
  FakeSysfs sysfs;
  sysfs.load("nvidia_peermem");
  FakeDeviceMemory api;
  api.dmabuf_works = false;
  api.allocate(kSegment, 4 * kMiB);
  api.allocate(kSegment + 4 * kMiB, 4 * kMiB);
  auto choice = GpuRegistrationChoice::detect(&api, sysfs.root());
  std::atomic<int> dropped{0};
  std::vector<std::string> calls;
  std::vector<std::string> logged;
  const auto log = [&](const std::string& line) { logged.push_back(line); };
  auto first = register_by_choice<FakeRegistration>(api, choice, {at(kSegment), 4 * kMiB}, fake_registrars(dropped, calls), log);
  ASSERT_TRUE(first.ok()) << first.error().detail;
  EXPECT_EQ(calls, std::vector<std::string>{"peermem"});
  EXPECT_EQ(choice.method(), GpuRegistration::kPeerMem);
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_NE(logged[0].find("CUDA_ERROR_NOT_SUPPORTED"), std::string::npos) << logged[0];
  auto second = register_by_choice<FakeRegistration>(api, choice, {at(kSegment + 4 * kMiB), 4 * kMiB},
                                                     fake_registrars(dropped, calls), log);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(api.dmabuf_calls, 1) << "dma-buf is not tried again";
  EXPECT_EQ(logged.size(), 1u) << "the change is logged once";
}

TEST(GpuRegistrationDetection, StagingWhenNeitherWorks) {
  FakeSysfs sysfs;  // no peermem
  FakeDeviceMemory api;
  api.dmabuf_works = false;
  api.allocate(kSegment, 4 * kMiB);
  auto choice = GpuRegistrationChoice::detect(&api, sysfs.root());
  std::atomic<int> dropped{0};
  std::vector<std::string> calls;
  auto made = register_by_choice<FakeRegistration>(api, choice, {at(kSegment), 4 * kMiB}, fake_registrars(dropped, calls), nullptr);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.error().code, Errc::kUnavailable);
  EXPECT_TRUE(calls.empty());
  EXPECT_EQ(choice.method(), GpuRegistration::kNone);
  EXPECT_EQ(gpu_registration_name(choice.method()), "staging");
}

TEST(GpuRegistrationDetection, AnUnalignedAllocationDoesNotDecideForTheSystem) {
  FakeSysfs sysfs;
  FakeDeviceMemory api;
  api.allocate(kSegment + 512, kMiB);  // a small cudaMalloc sharing a page
  auto choice = GpuRegistrationChoice::detect(&api, sysfs.root());
  std::atomic<int> dropped{0};
  std::vector<std::string> calls;
  auto made = register_by_choice<FakeRegistration>(api, choice, {at(kSegment + 512), kMiB}, fake_registrars(dropped, calls), nullptr);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(api.dmabuf_calls, 0);
  EXPECT_EQ(choice.method(), GpuRegistration::kDmaBuf);
  EXPECT_FALSE(choice.settled());
}

// cuMemGetHandleForAddressRange takes whole pages: an allocation that begins on a page but ends
// inside one is refused alone, and dma-buf stays the choice for the others.
TEST(GpuRegistrationDetection, AnAllocationEndingMidPageDoesNotDecideForTheSystem) {
  FakeSysfs sysfs;
  FakeDeviceMemory api;
  api.allocate(kSegment, kMiB + 512);
  auto choice = GpuRegistrationChoice::detect(&api, sysfs.root());
  std::atomic<int> dropped{0};
  std::vector<std::string> calls;
  auto made = register_by_choice<FakeRegistration>(api, choice, {at(kSegment), kMiB + 512}, fake_registrars(dropped, calls), nullptr);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(api.dmabuf_calls, 0);
  EXPECT_EQ(choice.method(), GpuRegistration::kDmaBuf);
  EXPECT_FALSE(choice.settled());
}

}  // namespace
}  // namespace th::rdma
