// One-sided RDMA reads behind net::DataTransport (libibverbs; RC queue pairs; no rdma-cm).
//
// A reader pulls a grant like this:
//   1. It dials the source's data port (TCP, the same port the TCP data plane listens on) and sends
//      a hello with its queue pair's address (QPN, PSN, GID, LID, MTU) and the protocol version.
//      A source with RDMA answers with its own and both connect their queue pairs; a source
//      without it closes the connection (it does not speak this protocol), and the reader pulls
//      this pair over TCP: logged once per source, counted in stats. The link (TCP connection and
//      queue pair) is kept for the next versions, while the source keeps it (idle_timeout_ms).
//   2. Per grant it sends an open request (transfer, epoch, the grant's secret) on that TCP
//      connection. The source binds a type-2 memory window per exposed region to this reader's
//      queue pair and answers with the regions' addresses and window keys, and the address and key
//      of a word that counts the grant's ready bytes (pipeline replication: the source's Progress
//      stores every advance there).
//   3. The reader posts chunked RDMA READs straight into its registered targets, several in
//      flight, signalling every few; a partial source is followed by reading its progress word.
//      The source's CPU does not take part.
//   4. The source's revoke() deallocates the grant's windows: a read that arrives later (or a
//      rogue one with a remembered key) fails with a remote access error at the reader, which
//      reports the source as refusing, as over TCP. The links of readers that still have the
//      grant open are told, then cut, and revoke() returns once their queue pairs are destroyed:
//      a READ the device had begun cannot go on after it (a device without windows exposes the
//      whole registration instead; the cut is then what ends its reads).
// Any error completion, timeout or cancel moves the reader's queue pair to the error state, waits
// for its flushed requests (so no READ lands after pull() returns) and drops the link.
//
// Memory is registered once per leased allocation (lease_memory: adjacent leased ranges form one
// run, one registration), cached until the lease is dropped; memory never leased is registered for
// one grant or pull at a time.
//
// GPU memory (on_device regions and targets) is registered through dma-buf or nvidia-peermem, one
// registration per whole CUDA allocation (rdma/device_memory.h), given a DeviceMemoryApi. A grant
// whose GPU memory cannot be registered is answered "unsupported" (its readers pull it over TCP,
// which stages GPU memory through pinned host memory), and a pull into GPU memory that cannot be
// registered goes over TCP whole.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "net/transport.h"
#include "rdma/device_memory.h"

namespace th::rdma {

struct RdmaOptions {
  // The devices to use, one per rail (device i pairs with the peer's device i). Empty: the active
  // devices on this thread's NUMA node, else every active one (choose_devices in verbs.h).
  std::vector<std::string> devices;
  // A complete source of at least this many bytes is read over every rail at once, each rail
  // pulling its own contiguous part (a partial source is followed on rail 0 alone).
  std::uint64_t stripe_bytes_min = 16ull << 20;
  int gid_index = -1;  // -1: the first RoCE v2 GID of an IPv4 address, else 0
  std::uint64_t read_bytes = 1ull << 20;  // one RDMA READ at most
  std::uint32_t reads_in_flight_max = 16;  // posted and not yet completed, per pull
  std::uint32_t signal_every = 4;          // one signalled completion per this many READs
  // A request is retried after 4.096 us << exponent, retry_count times, before the reader's queue
  // pair reports the source gone (14, 7: ~0.5 s).
  std::uint8_t qp_timeout_exponent = 14;
  std::uint8_t qp_retry_count = 7;
  int handshake_timeout_ms = 5'000;  // connect, hello and each open answer
  // The source keeps a reader's link (queue pair, TCP connection) this long between requests, so a
  // link lasts across versions; idle links still make room for new connections.
  int link_idle_timeout_ms = 600'000;
  std::uint32_t grants_per_link_max = 64;        // grants open at once on one link (source side)
  std::uint32_t regions_per_grant_max = 1u << 16;  // in an open answer
  std::uint32_t links_max = 1024;                // reader side: links kept to distinct sources
  std::uint32_t progress_slots = 4096;           // grants exposed at once (source side)
  // How long a source without RDMA is pulled over TCP before this reader tries RDMA again.
  int fallback_recheck_ms = 60'000;
  // Grants are exposed through type-2 memory windows where the device has them (false: never, for a
  // device whose windows misbehave; readers then get the registration's key).
  bool memory_windows = true;
  // revoke() cuts the links of readers that still have the grant open (they may be mid-READ) and
  // waits until their queue pairs are destroyed, at most this long, then logs.
  int revoke_wait_ms = 5'000;
  // revoke() tells the grant's readers on their links at once. Off, a reader learns it from its
  // next READ's remote access error alone (a test turns it off to see the windows cut reads off).
  bool revoke_notices = true;
  // Where the data plane's lines go (libthclient passes its log hook); empty: stderr, "th rdma: ...".
  std::function<void(const std::string&)> log = nullptr;
  // The CUDA driver's answers (libthclient's, when it has CUDA). Null: GPU memory is never
  // registered with the NIC (GpuRegistration::kNone): it goes over TCP, staged.
  std::shared_ptr<DeviceMemoryApi> device_memory = nullptr;
};

class RdmaTransport final : public net::DataTransport {
 public:
  // Opens the device and listens on `tcp.listen` (both protocols, one port). Throws
  // rdma::VerbsError when there is no usable device, net::SocketError when the port cannot be bound.
  RdmaTransport(net::DataServerConfig tcp, RdmaOptions options);
  ~RdmaTransport() override;
  RdmaTransport(const RdmaTransport&) = delete;
  RdmaTransport& operator=(const RdmaTransport&) = delete;

  std::string_view kind() const override { return "rdma"; }
  net::Endpoint endpoint() const override;
  // The devices in use, comma-separated ("mlx5_0,mlx5_1").
  std::string device_names() const;
  void grant(net::GrantKey key, const GrantSecret& secret, std::vector<net::ExposedRegion> regions,
             std::shared_ptr<net::Progress> progress) override;
  void revoke(net::GrantKey key) override;
  net::TransportStats stats() const override;
  net::PullOutcome pull(const net::Endpoint& source, net::GrantKey key, const GrantSecret& secret,
                        std::span<const net::LocalRegion> targets, const net::PullOptions& options) override;
  // on_device: the enclosing CUDA allocation is leased (registered at the first grant or pull that
  // uses it); a pointer the CUDA driver does not know, or a range that leaves its allocation, is
  // logged and not leased (null).
  std::shared_ptr<void> lease_memory(const std::byte* base, std::uint64_t bytes, bool on_device) override;

  struct State;  // shared with the data port's connection threads (transport.cpp)

 private:
  std::shared_ptr<State> state_;  // declared first: outlives the server's connection threads
  std::unique_ptr<net::DataServer> server_;
};

}  // namespace th::rdma
