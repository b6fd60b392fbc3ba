// Owning wrappers of the libibverbs objects rdma/ uses, and the one place their calls are checked.
//
// Every failing verbs call throws VerbsError naming the call and errno (I/O logistics, as a
// SocketError is for TCP): the transport turns it into a failed read or a fallback to TCP. Each
// object is neither copyable nor movable and frees its verbs resource in its destructor; owners
// destroy them in dependency order (windows, then queue pairs, then regions and queues, then the
// protection domain, then the device context), which member order gives.
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace th::rdma {

struct VerbsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The names of the RDMA devices this process can open ("rxe0", "mlx5_0"), in the kernel's order.
std::vector<std::string> device_names();

struct DeviceInfo {
  std::string name;
  int numa_node = -1;  // from sysfs (-1: unknown, as for soft-RoCE)
  bool active = false;  // port 1 is ACTIVE
};
// Every device, with its NUMA node and port state (opens each for a moment).
std::vector<DeviceInfo> list_devices();
// The devices a process on NUMA node `node` (-1: unknown) uses: the active ones on that node, else
// (none there, or the node unknown) every active one; sorted by name, so that device i of one host
// pairs with device i of another (rail i of a rail-optimised network).
std::vector<std::string> choose_devices(std::vector<DeviceInfo> devices, int node);
// The NUMA node of the CPU this thread runs on (-1: unknown).
int current_numa_node();

using Gid = std::array<std::uint8_t, 16>;

// How a queue pair is reached: exchanged over TCP before it is connected.
struct QueuePairAddress {
  std::uint32_t qp_number = 0;
  std::uint32_t packet_sequence = 0;  // the first PSN this side sends
  std::uint16_t lid = 0;              // InfiniBand; 0 on RoCE
  std::uint8_t mtu = IBV_MTU_1024;    // ibv_mtu of the port
  Gid gid{};
  std::uint8_t read_atoms = 1;        // READs it takes outstanding (max_dest_rd_atomic)
};

class Device {
 public:
  // Opens `name` (empty: the first device with an active port). gid_index < 0: the first RoCE v2
  // GID of an IPv4 address on port 1, else index 0. Throws VerbsError when there is none.
  Device(const std::string& name, int gid_index);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const std::string& name() const { return name_; }
  ibv_context* context() const { return context_; }
  ibv_pd* protection_domain() const { return pd_; }
  std::uint8_t port() const { return 1; }
  int gid_index() const { return gid_index_; }
  const Gid& gid() const { return gid_; }
  std::uint16_t lid() const { return lid_; }
  ibv_mtu active_mtu() const { return mtu_; }
  // Type-2 memory windows (bound to one queue pair, invalidated on demand): what revocation uses.
  bool has_memory_windows() const { return memory_windows_; }
  std::uint32_t max_read_atoms() const { return max_read_atoms_; }

 private:
  std::string name_;
  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  int gid_index_ = 0;
  Gid gid_{};
  std::uint16_t lid_ = 0;
  ibv_mtu mtu_ = IBV_MTU_1024;
  bool memory_windows_ = false;
  std::uint32_t max_read_atoms_ = 1;
};

// Memory exported as a dma-buf (GPU memory: rdma/device_memory.h): its fd, and the byte of it
// where a registration begins.
struct DmaBuf {
  int fd = -1;
  std::uint64_t offset = 0;
};

// A registered memory region.
class MemoryRegion {
 public:
  // `access`: IBV_ACCESS_* flags.
  MemoryRegion(const Device& device, void* base, std::uint64_t bytes, int access);
  // [offset, +bytes) of a dma-buf, addressed by work requests as [iova, +bytes) (ibv_reg_dmabuf_mr).
  // The fd stays the caller's: the region holds its own reference to the dma-buf, so the caller may
  // close it at once.
  MemoryRegion(const Device& device, DmaBuf source, std::uintptr_t iova, std::uint64_t bytes, int access);
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  ibv_mr* get() const { return mr_; }
  // The addresses work requests name. Kept here, not read from mr_->addr: libibverbs sets that to
  // the dma-buf offset for a dma-buf region, not to its iova.
  std::uintptr_t begin() const { return begin_; }
  std::uintptr_t end() const { return begin_ + bytes_; }
  bool covers(std::uintptr_t at, std::uint64_t bytes) const { return at >= begin() && bytes <= end() - at && at <= end(); }

 private:
  ibv_mr* mr_ = nullptr;
  std::uintptr_t begin_ = 0;
  std::uint64_t bytes_ = 0;
};

// A completion queue with its own event channel, so a thread can wait for completions with a
// timeout (poll on fd()) instead of spinning.
class CompletionQueue {
 public:
  CompletionQueue(const Device& device, int entries);
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;
  ibv_cq* get() const { return cq_; }
  // Polls up to `count` completions into `out` without blocking.
  int poll(ibv_wc* out, int count);
  // Waits up to timeout_ms for a completion event (after which poll() again), or for `watch` (a
  // file descriptor, -1: none) to become readable or close.
  struct Woken {
    bool completion = false;
    bool watched = false;
  };
  Woken wait(int timeout_ms, int watch = -1);

 private:
  ibv_comp_channel* channel_ = nullptr;
  ibv_cq* cq_ = nullptr;
  bool armed_ = false;
};

// A reliable-connection queue pair: INIT at construction, connect() to RTS once the peer's
// address is known. Its completions (both directions) go to one queue.
class QueuePair {
 public:
  QueuePair(const Device& device, CompletionQueue& cq, std::uint32_t send_entries, std::uint32_t read_atoms);
  ~QueuePair();
  QueuePair(const QueuePair&) = delete;
  QueuePair& operator=(const QueuePair&) = delete;
  ibv_qp* get() const { return qp_; }
  QueuePairAddress local_address(std::uint32_t packet_sequence) const;
  // RTR then RTS against `remote`, at the smaller of both MTUs, with at most the smaller of both
  // ends' read_atoms READs outstanding each way. `timeout_exponent`: a request is retried after
  // 4.096 us << it, retry_count times, before it fails (the peer is gone).
  void connect(const QueuePairAddress& local, const QueuePairAddress& remote, std::uint8_t timeout_exponent,
               std::uint8_t retry_count);
  std::uint32_t read_atoms() const { return read_atoms_; }
  // Moves to the error state: every posted request completes (flushed) soon after.
  void fail();

 private:
  const Device& device_;
  ibv_qp* qp_ = nullptr;
  std::uint32_t read_atoms_ = 1;
};

// A type-2 memory window: a remote key for a sub-range of a region, bound to one queue pair by a
// work request, and dead the moment it is deallocated (a read through it then fails remotely).
class MemoryWindow {
 public:
  explicit MemoryWindow(const Device& device);
  ~MemoryWindow();
  MemoryWindow(const MemoryWindow&) = delete;
  MemoryWindow& operator=(const MemoryWindow&) = delete;
  ibv_mw* get() const { return mw_; }

 private:
  ibv_mw* mw_ = nullptr;
};

}  // namespace th::rdma
