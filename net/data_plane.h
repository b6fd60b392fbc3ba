// The TCP data plane: a shard's data server lends its registered tensors to readers under grants the
// hub issued, and a reader pulls them straight into its own registered buffers.
//
// The shape is that of one-sided RDMA reads, so that rdma/ can slot in behind the same calls:
//   source: grant(key, regions, progress)  ~ register memory regions, hand out remote keys
//   reader: read(region index, offset, length) into a local region  ~ RDMA READ(rkey, offset)
//   source: revoke(key)                    ~ deregister: returns once no read is in flight
// TCP needs the source's CPU to send; RDMA would not. Either way a read is served only inside a
// region exposed under a live grant, and never after revoke() returned (integrity, DESIGN.md §5.1).
//
// Pipeline replication: the regions of a copy still being received are exposed with a Progress
// counter (bytes ready, in layout order). A reader of such a partial source gets the ready prefix
// of what it asks for; when nothing is ready the server waits (a bounded time) for more.
#pragma once

#include <algorithm>
#include <atomic>
#include <compare>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/types.h"
#include "net/socket.h"

namespace th::net {

// The hub's grant for one transfer's reads: (transfer, epoch).
struct GrantKey {
  TransferId transfer = 0;
  std::uint32_t epoch = 0;
  friend auto operator<=>(const GrantKey&, const GrantKey&) = default;
};

// Bytes of a copy that are ready to be read, counted in layout order across its regions. A complete
// copy is ready in full from the start; a receiving copy advances as its own reads land.
class Progress {
 public:
  explicit Progress(std::uint64_t ready_bytes = 0) : ready_bytes_(ready_bytes) {}
  std::uint64_t ready_bytes() const { return ready_bytes_.load(std::memory_order_acquire); }
  // Never moves backwards.
  void advance_to(std::uint64_t ready_bytes);
  // Waits until more than `beyond` bytes are ready, `stop()` holds, or the timeout passes.
  void wait_beyond(std::uint64_t beyond, int timeout_ms, const std::function<bool()>& stop);
  // Wakes every waiter (to look at its stop condition).
  void wake_all();

 private:
  std::atomic<std::uint64_t> ready_bytes_;
  std::mutex mutex_;
  std::condition_variable changed_;
};

// Memory the owner keeps alive and unchanged while a grant exposes it.
struct ExposedRegion {
  const std::byte* base = nullptr;
  std::uint64_t bytes = 0;
};
// Memory a reader fills.
struct LocalRegion {
  std::byte* base = nullptr;
  std::uint64_t bytes = 0;
};

// Why a read failed: typed, because the agent reports a refused source differently from one that
// is unreachable.
enum class ReadError : std::uint8_t {
  kRefused,      // no live grant, or outside the exposed regions: the source will not serve it
  kUnreachable,  // the connection failed or the source stopped answering
  kStalled,      // a partial source made no progress for the stall limit
  kCancelled,    // the reader gave up (its transfer was cancelled)
};
std::string_view read_error_name(ReadError error);

struct DataServerConfig {
  Endpoint listen{"127.0.0.1", 0};
  std::uint32_t connections_max = 256;      // concurrent reader connections
  int progress_wait_ms_max = 200;           // how long one read of a partial source waits for bytes
  // The hub tells the reader and the source at the same moment; the reader's first request may
  // arrive before the source heard of the grant. A read of an unknown grant waits this long for it.
  int grant_wait_ms_max = 2000;
  int io_timeout_ms = 30'000;               // a reader that stops reading is dropped after this
  std::uint64_t response_bytes_max = 64ull << 20;  // one response carries at most this much
};

class DataServer {
 public:
  // Listens at once; throws SocketError if the address cannot be bound.
  explicit DataServer(DataServerConfig config);
  ~DataServer();  // closes every connection and joins every thread
  DataServer(const DataServer&) = delete;
  DataServer& operator=(const DataServer&) = delete;

  // Where readers connect ("host:port", with the port the kernel chose).
  Endpoint endpoint() const { return endpoint_; }

  // Exposes `regions` (in layout order) to reads under `key`. The regions must stay alive and
  // unchanged (up to progress) until revoke(key) returns. Granting a key twice is a bug.
  void grant(GrantKey key, std::vector<ExposedRegion> regions, std::shared_ptr<Progress> progress);
  // Withdraws the grant. Reads that arrive later are refused; returns once no read under the grant
  // is in flight, after which the owner may change or free the memory. Unknown keys are ignored.
  void revoke(GrantKey key);

  struct Stats {
    std::uint64_t bytes_served = 0;
    std::uint64_t reads_served = 0;
    std::uint64_t reads_refused = 0;
  };
  Stats stats() const;

 private:
  struct Grant;
  void accept_loop();
  void serve(Fd connection);

  DataServerConfig config_;
  Fd listener_;
  Endpoint endpoint_;
  std::atomic<bool> stopping_{false};

  mutable std::mutex mutex_;
  std::condition_variable drained_;
  std::condition_variable granted_;
  std::map<GrantKey, std::shared_ptr<Grant>> grants_;
  // Grants revoked lately: a read of one is refused at once, not after grant_wait_ms_max.
  static constexpr std::size_t kRevokedRemembered = 1024;
  std::deque<GrantKey> revoked_;
  bool revoked_recently(GrantKey key) const {
    return std::find(revoked_.begin(), revoked_.end(), key) != revoked_.end();
  }
  std::vector<int> open_connections_;  // to shut them down on stop (guarded by mutex_)
  std::uint32_t connections_ = 0;
  Stats stats_;

  std::vector<std::thread> connection_threads_;  // guarded by mutex_
  std::thread acceptor_;
};

struct PullOptions {
  std::uint64_t chunk_bytes = 8ull << 20;  // one request
  // How often on_progress hears of a growing prefix while a response arrives: a reader of this
  // shard (pipeline replication) trails it by about this much, at every hop of a chain.
  std::uint64_t progress_step_bytes = 1ull << 20;
  std::uint32_t depth = 4;                 // requests in flight on the connection (complete sources)
  // Connections used at once for a complete source, each pulling whole regions (helps on links
  // with a large bandwidth-delay product, where one TCP stream does not fill the pipe).
  std::uint32_t streams = 1;
  bool partial = false;                    // the source is still receiving (pipeline replication)
  int connect_timeout_ms = 5'000;
  int io_timeout_ms = 30'000;
  int stall_ms_max = 60'000;
  // Caps the receive rate (0: none), e.g. to leave a shared NIC to the training job's own traffic.
  std::uint64_t rate_bytes_per_s = 0;  // a partial source that makes no progress this long has failed
  // Polled between chunks: true stops the pull with kCancelled.
  std::function<bool()> cancelled;
  // Called as the prefix of the targets (layout order) that has arrived grows: a receiving shard
  // exposes it to its own readers from here.
  std::function<void(std::uint64_t ready_bytes)> on_progress;
};

inline constexpr std::uint32_t kPullStreamsMax = 16;

struct PullOutcome {
  std::uint64_t bytes = 0;          // bytes that landed in the targets
  std::optional<ReadError> error;   // none: every byte arrived
  std::string detail;               // what failed, for logs
  bool ok() const { return !error.has_value(); }
};

// Pulls every byte of the regions exposed under `key` at `source` into `targets` (same sizes, same
// order). Data lands directly in the targets: no staging copy. I/O failures are outcomes, not
// exceptions: a source that fails is an expected event the agent reports.
PullOutcome pull(const Endpoint& source, GrantKey key, std::span<const LocalRegion> targets,
                 const PullOptions& options);

}  // namespace th::net
