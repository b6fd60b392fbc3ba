// Same host, GPU to GPU: a reader copies a source's device memory device to device through CUDA IPC
// instead of staging it through TCP (issue 15 part 4). No CUDA here: client/cuda/ipc.h implements
// the exporter and the importer; tests fake them with host memory.
//
// Protocol (on the data port, versioned by the magic "TDI1"): the reader sends an IpcRequestFrame
// (the 56 bytes of every data request: grant key, secret, a page of regions) and the server answers
// an IpcAnswerFrame, then `count` IpcRegionRecords. The server answers only under a live grant whose
// secret matches (the checks of a read, refused alike and counted against the connection's refusal
// limit), only for a complete source (progress == total; a partial one answers kIpcUnsupported),
// and only if it has an exporter (DataServerConfig::ipc; kIpcUnsupported otherwise). A server that
// predates this protocol answers kUnknownProtocolStatus and closes. Every "no" makes the reader pull
// over TCP: IPC is never the reason a read fails.
//
// Where IPC may be used: the answer names the source's IPC domain (its host: boot id, and its PID
// namespace) and its process. The reader uses IPC only if the domain is its own and the process is
// not (CUDA cannot open a handle in the process that exported it).
//
// Integrity (DESIGN.md §5.1). Over TCP, revoke() cuts off every read in flight, so no byte is read
// after it returns. Over IPC the reader's copy engine reads the source's memory itself, and nothing
// the source does can stop a copy in flight. What keeps a read whole instead:
//   - the source changes a granted region only after revoke() returned (unpublish), and a grant key
//     is never granted twice;
//   - the reader asks for the handles under the live grant, copies, and only then asks the server
//     once more (a zero-length read) whether the grant is still live. A live grant after the last
//     copy completed means no revoke() had returned while it ran, so the memory did not change:
//     the read succeeds. A revoked one fails the read as kRefused, as a read cut off over TCP does;
//   - and, as for every read, the reader checks every tensor's checksum afterwards: a torn copy
//     (a source that broke its promise) fails the read, and the hub picks another source.
// What IPC gives up: a handle opens the whole allocation around a region (CUDA exports allocations,
// not ranges), read and write, and a reader keeps its mappings open (bounded, see
// CachingIpcImporter) after the grant ended. The boundary is the host and the secret of one grant,
// not the region; a source that cannot accept that leaves DataServerConfig::ipc null.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/types.h"
#include "net/data_plane.h"

namespace th::net {

// A CUDA IPC memory handle (cudaIpcMemHandle_t), opaque here.
inline constexpr std::size_t kIpcHandleBytes = 64;
using IpcHandleBytes = std::array<std::byte, kIpcHandleBytes>;

// A region as a source exports it: the handle of its enclosing allocation and where it lies in it.
struct IpcExport {
  IpcHandleBytes handle{};
  std::uint64_t offset = 0;            // the region's first byte, from the allocation's base
  std::uint64_t allocation_bytes = 0;  // the allocation's size: offset + region bytes fit in it
};

// The host identity token travels in a fixed field of this size.
inline constexpr std::size_t kIpcHostIdentityBytesMax = 64;

// An allocation of a source, mapped into a reader.
struct IpcMapping {
  std::byte* base = nullptr;
  std::uint64_t bytes = 0;
};

// The source side (client/cuda: cudaIpcGetMemHandle). Called by the data server's connection
// threads, possibly at once.
class IpcExporter {
 public:
  virtual ~IpcExporter() = default;
  // The handle of the allocation holding [base, +bytes), or nullopt where it cannot be exported
  // (memory from cudaMallocAsync pools or expandable segments, an error): that pull goes over TCP.
  virtual std::optional<IpcExport> export_region(const std::byte* base, std::uint64_t bytes) = 0;
  // Who may open the handles: processes whose host_identity() is the same (at most
  // kIpcHostIdentityBytesMax bytes).
  virtual std::string host_identity() = 0;
  // This process, among those: a reader never opens its own process's handles.
  virtual std::uint64_t process_identity() = 0;
};

// The reader side (client/cuda: cudaIpcOpenMemHandle). Used by one pull at a time.
class IpcImporter {
 public:
  virtual ~IpcImporter() = default;
  // The allocation behind `handle`, mapped into this process (kept open for later pulls: see
  // CachingIpcImporter), with its size as this process's driver reports it (never the source's
  // word: a source that lied would steer the copy outside the mapping); base nullptr where it
  // cannot be opened. The mapping stays valid until the next open() or the importer's end.
  virtual IpcMapping open(const IpcHandleBytes& handle) = 0;
  // Device to device; returns when the bytes are on `to_device`. Throws DeviceCopyError.
  virtual void copy(std::byte* to_device, const std::byte* from_device, std::uint64_t bytes) = 0;
  // A copy out of the mapping of `handle` failed: the source may have freed the allocation, so the
  // next open() maps it afresh.
  virtual void forget(const IpcHandleBytes& handle) { (void)handle; }
  // After a pull: the mappings of other handles may be closed (see CachingIpcImporter).
  virtual void keep_only(std::span<const IpcHandleBytes> kept) { (void)kept; }
  virtual std::string host_identity() = 0;
  virtual std::uint64_t process_identity() = 0;
};

// An importer that keeps the last `mappings_max` allocations it opened and closes the least
// recently used beyond that, and all of them at its end. A mapping holds the source's allocation
// (its memory cannot go back to the source's GPU until it is closed), so the bound is on what one
// reader can hold of each source; most shards sit in a few allocations of the caching allocator,
// so a bound this size reopens nothing from one version to the next.
class CachingIpcImporter : public IpcImporter {
 public:
  static constexpr std::size_t kMappingsMaxDefault = 64;
  explicit CachingIpcImporter(std::size_t mappings_max = kMappingsMaxDefault);
  // A subclass's destructor must call close_all(): close_mapping() is its own.
  ~CachingIpcImporter() override;

  IpcMapping open(const IpcHandleBytes& handle) final;
  void forget(const IpcHandleBytes& handle) final;
  std::size_t mappings_open() const;
  // Closes every mapping but those of `kept` (the handles a pull just used): a mapping holds the
  // source's allocation, which the source may free once the grant ends (closing after the
  // source's cudaFree is undefined behaviour in CUDA), so no more than one grant's stay open.
  void keep_only(std::span<const IpcHandleBytes> kept) final;

 protected:
  // Maps the allocation (base nullptr: it cannot be), with the size the driver reports.
  virtual IpcMapping open_mapping(const IpcHandleBytes& handle) = 0;
  virtual void close_mapping(std::byte* base) = 0;
  void close_all();

 private:
  struct Mapping {
    IpcHandleBytes handle;
    IpcMapping mapped;
  };
  const std::size_t mappings_max_;
  mutable std::mutex mutex_;
  std::list<Mapping> mappings_;  // most recently used first; at most mappings_max_
};

// The host identity of this process for IpcExporter/IpcImporter::host_identity(): the kernel's
// boot id and this process's PID namespace, "boot:<uuid> pidns:<inode>". Processes in different
// PID namespaces (containers) do not try: CUDA IPC between them needs what a container may not share.
std::string local_host_identity();

// ---- On the wire (the data port; little-endian, fixed sizes) ---------------------------------------

inline constexpr std::uint32_t kIpcMagic = 0x31494454;  // "TDI1"
// Region records in one answer: a grant holds at most kTensorsPerShardMax + 1 regions, so a reader
// asks in pages (at most 129 of them, ~96 KiB each, on one connection).
inline constexpr std::uint32_t kIpcRegionsPerAnswerMax = 1024;

struct IpcRequestFrame {
  std::uint32_t magic = kIpcMagic;
  std::uint32_t epoch = 0;
  std::uint64_t transfer = 0;
  std::uint32_t first_region = 0;
  std::uint32_t regions = 0;  // at most kIpcRegionsPerAnswerMax
  std::uint64_t reserved[2] = {0, 0};
  GrantSecret secret{};
};
static_assert(sizeof(IpcRequestFrame) == 56);

// Statuses of an answer: those of a read (0 ok, 1 no grant, 2 out of bounds), and this.
inline constexpr std::uint32_t kIpcUnsupported = 3;  // a partial source, or no exporter: use TCP

struct IpcAnswerFrame {
  std::uint32_t status = 0;
  std::uint32_t count = 0;          // records that follow (status ok only)
  std::uint32_t grant_regions = 0;  // regions in the whole grant
  std::uint32_t reserved = 0;
  std::uint64_t process = 0;        // the exporter's process_identity()
  std::array<char, kIpcHostIdentityBytesMax> host{};  // its host_identity(), zero-padded
};
static_assert(sizeof(IpcAnswerFrame) == 88);

struct IpcRegionRecord {
  std::uint32_t exported = 0;  // 1: the handle below opens it; 0: it goes over TCP
  std::uint32_t reserved = 0;
  std::uint64_t bytes = 0;     // the region's, as granted
  std::uint64_t offset = 0;
  std::uint64_t allocation_bytes = 0;
  IpcHandleBytes handle{};
};
static_assert(sizeof(IpcRegionRecord) == 96);

// ---- Between net/data_plane.cpp, net/data_pull.cpp and net/ipc.cpp -------------------------------

namespace ipc_detail {

// The records of `regions` (a page of a grant), each exported if it is on the device and the
// exporter can. Does not throw (an exporter that throws leaves its region unexported).
std::vector<IpcRegionRecord> export_records(IpcExporter& exporter, std::span<const ExposedRegion> regions);
// An ok answer's header, without its count and grant_regions.
IpcAnswerFrame answer_header(IpcExporter& exporter);

// What the IPC reader needs of the TCP one (net/data_pull.cpp).
struct TcpSide {
  // A TCP pull of a run of regions: part[i] is the source's region first_region + i.
  std::function<PullOutcome(std::span<const LocalRegion> part, std::uint32_t first_region,
                            const PullOptions& options)>
      pull;
  // Whether the grant is still live at the source (a zero-length read): none, or why not.
  std::function<std::optional<ReadError>()> still_granted;
};

// Pulls the targets' device regions over IPC and the others over TCP, in layout order. nullopt:
// IPC could not be used (why: in `fallback`), and the caller pulls the whole grant over TCP (any
// bytes already copied are copied again: the source is complete and unchanged). Otherwise the
// pull's outcome, which may be a failure of its TCP part, a cancel, or a grant revoked meanwhile.
std::optional<PullOutcome> pull_over_ipc(const Endpoint& source, GrantKey key, const GrantSecret& secret,
                                         std::span<const LocalRegion> targets, const PullOptions& options,
                                         const TcpSide& tcp, std::string& fallback);

}  // namespace ipc_detail
}  // namespace th::net
