// The TCP data plane: a shard's data server lends its registered tensors to readers under grants the
// hub issued, and a reader pulls them straight into its own registered buffers.
//
// The shape is that of one-sided RDMA reads, so that rdma/ can slot in behind the same calls:
//   source: grant(key, regions, progress)  ~ register memory regions, hand out remote keys
//   reader: read(region index, offset, length) into a local region  ~ RDMA READ(rkey, offset)
//   source: revoke(key)                    ~ deregister: cuts off the reads in flight, then returns
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
#include <list>
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
#include "net/staging.h"

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
  // Also stores every advance into `word` (set to the current count at once) until
  // remove_mirror(word): rdma/ exposes such a word to readers' one-sided reads, so that a reader
  // learns a partial source's progress without the source's CPU on the data path.
  void add_mirror(std::atomic<std::uint64_t>* word);
  void remove_mirror(std::atomic<std::uint64_t>* word);

 private:
  std::atomic<std::uint64_t> ready_bytes_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::atomic<std::uint64_t>*> mirrors_;  // guarded by mutex_
};

// Memory the owner keeps alive and unchanged while a grant exposes it.
// on_device: the memory is a GPU's (CUDA device memory): the CPU cannot touch it, so the TCP
// data plane moves it through pinned host staging (net/staging.h), and a transport that registers
// memory with a NIC registers it as device memory.
struct ExposedRegion {
  const std::byte* base = nullptr;
  std::uint64_t bytes = 0;
  bool on_device = false;
};
// Memory a reader fills.
struct LocalRegion {
  std::byte* base = nullptr;
  std::uint64_t bytes = 0;
  bool on_device = false;
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

struct ReadRequestFrame;  // on the wire: defined in net/data_frames.h
class IpcExporter;        // net/ipc.h
class IpcImporter;
// Every request on the data port starts with a frame of this size whose first 4 bytes are a magic.
inline constexpr std::size_t kDataRequestBytes = 56;
// A server answers a first request of a protocol it does not serve with a 16-byte frame whose first
// 4 bytes are this, then closes: a peer tells "no such protocol here" from a source that died.
inline constexpr std::uint32_t kUnknownProtocolStatus = 0x4e4b4e55;  // UNKN

// What a connection handed to a DataPortExtension may tell its server, and ask it.
class DataConnection {
 public:
  virtual ~DataConnection() = default;
  // Idle: waiting for the peer's next request, so the server may drop the connection to make room
  // for a new one (shutting the socket down). Busy: serving a request; never dropped.
  virtual void set_idle(bool idle) = 0;
  // The server dropped the connection or stops: end it.
  virtual bool dropped() const = 0;
};

// A second protocol on the data port. A connection whose first request starts with magic() is
// handed over to it for good, on the connection's own thread and slot (rdma/ sets up a queue pair
// over it and answers the reader's grant lookups on it, so the port's limits cover it too).
class DataPortExtension {
 public:
  virtual ~DataPortExtension() = default;
  virtual std::uint32_t magic() const = 0;
  // Serves the connection until it ends; `first` is its first request (kDataRequestBytes bytes).
  // Returns why the server ended it, for the log (empty: the peer hung up, or it was dropped).
  virtual std::string serve(const Fd& socket, std::span<const std::byte> first, DataConnection& connection) = 0;
};

struct DataServerConfig {
  Endpoint listen{"127.0.0.1", 0};
  // Concurrent reader connections, and so connection threads: a thread serves one connection and
  // is joined as soon as it ends. When every slot is taken, a new connection takes the slot of the
  // connection idle the longest (none idle: it is refused).
  std::uint32_t connections_max = 256;
  int progress_wait_ms_max = 200;           // how long one read of a partial source waits for bytes
  // The hub tells the reader and the source at the same moment; the reader's first request may
  // arrive before the source heard of the grant. A read of an unknown grant waits this long for it,
  // at most once per connection: a burst of requests for a grant that never comes is refused at once.
  int grant_wait_ms_max = 2000;
  // Connections waiting for a grant at once; beyond, a read of an unknown grant is refused at once.
  // (A waiting connection is busy, so it cannot be dropped to make room: without this cap, anyone
  // who reaches the port could keep every slot waiting by asking for grants that do not exist.)
  std::uint32_t grant_waiters_max = 16;
  // A reader sends its first request as soon as it connects: a connection silent this long after
  // it was accepted is closed, so that silent connections cannot hold the slots readers need.
  int first_request_timeout_ms = 5'000;
  // A reader pipelines its requests, so a connection idle (no request arriving) this long is closed.
  int idle_timeout_ms = 30'000;
  // A response must be sent in full by a deadline: this base, plus its bytes at the slowest rate a
  // reader may drain them. A reader slower than that (trickling, hung, stopped) is cut off and its
  // read fails: it cannot hold a connection thread for long, however it paces its reads.
  int response_ms_base = 5'000;
  std::uint64_t reader_bytes_per_s_min = 1ull << 20;  // a 64 MiB response gets 5 s + 64 s
  std::uint64_t response_bytes_max = 64ull << 20;  // one response carries at most this much
  // A connection is closed once this many of its reads were refused (no grant, a wrong secret, out
  // of bounds): a reader meets a refusal or a few when its grant ends, a guesser meets them for
  // ever, and each one held a connection thread and its slot.
  std::uint32_t refusals_per_connection_max = 8;
  // A server writes at most one line per interval about failing readers and connections (the
  // lines held back are counted on the next): a flood of bad connections must not flood the log.
  int log_interval_ms = 10'000;
  // Where those lines go (libthclient passes its log hook); empty: stderr, "th data server: ...".
  std::function<void(const std::string&)> log = nullptr;
  // Serves the connections that speak another protocol on this port (none: they are closed).
  std::shared_ptr<DataPortExtension> extension = nullptr;
  // Moves regions of GPU memory (on_device) through pinned host memory; a grant of such regions
  // needs one. A connection serving one holds a ring of it for the response.
  std::shared_ptr<StagingPool> staging = nullptr;
  // Hands readers on this host the CUDA IPC handles of granted GPU memory (net/ipc.h), so that they
  // copy it device to device instead of through staging and TCP. Null: every reader uses TCP.
  // (Over IPC, revoke() cannot cut off a copy in flight: net/ipc.h says what keeps reads whole.)
  std::shared_ptr<IpcExporter> ipc = nullptr;
};

// A reader connection, served by its own thread:
//   awaiting first request --request--> busy --response sent--> idle --request--> busy ...
//   awaiting first request / idle --first_request_timeout_ms / idle_timeout_ms, or dropped to make
//       room for a new connection, or the reader hangs up--> finished
//   busy --response deadline passed, revoke() of the grant it is sending, or a send fails--> finished
//   any --a request that is not of the data protocol, or the server stops--> finished
//   finished --the acceptor joins the thread--> gone (its slot is free)
// Only a connection awaiting its first request or idle may be dropped to make room: one that is
// busy (waiting for its grant or for progress, or sending) ends by its own bounded deadlines.
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
  // A read is served only if it presents `secret` (the hub tells it to this source and to the
  // transfer's reader alone): knowing (transfer, epoch) is not enough to read a shard's memory.
  void grant(GrantKey key, const GrantSecret& secret, std::vector<ExposedRegion> regions,
             std::shared_ptr<Progress> progress);
  // Withdraws the grant. Reads that arrive later are refused; a read waiting for progress is
  // refused now, and a connection sending the grant's bytes is cut off (its read fails). It does not
  // wait for any reader: it returns as soon as the threads serving those reads have let go of the
  // memory, after which the owner may change or free it. Unknown keys are ignored.
  void revoke(GrantKey key);

  struct Stats {
    std::uint64_t bytes_served = 0;
    std::uint64_t reads_served = 0;
    std::uint64_t reads_refused = 0;
    std::uint64_t reads_cut_off = 0;        // a response not sent in full: revoked, or a slow reader
    std::uint64_t connections_dropped = 0;  // closed while idle: to make room, or after a timeout
    std::uint32_t connections_open = 0;     // connection threads not yet joined
    std::uint32_t connections_idle = 0;     // of those, awaiting a request
    std::uint64_t ipc_answers = 0;          // pages of CUDA IPC handles sent (net/ipc.h)
  };
  Stats stats() const;

 private:
  struct Grant;
  struct Connection;
  class Log;
  class ExtensionConnection;
  std::string serve_extension(Connection& self, const ReadRequestFrame& first);
  void accept_loop();
  void admit(Fd& waiting);
  void serve(Connection& self);
  bool answer(Connection& self, const ReadRequestFrame& request, int& grant_wait_left_ms);
  bool answer_ipc(Connection& self, const ReadRequestFrame& request, int& grant_wait_left_ms);
  std::map<GrantKey, std::shared_ptr<Grant>>::iterator wait_for_grant(std::unique_lock<std::mutex>& lock, GrantKey key,
                                                                      int& grant_wait_left_ms);
  bool refuse(Connection& self, std::uint32_t status);
  void log(const std::string& line);

  DataServerConfig config_;
  Fd listener_;
  Endpoint endpoint_;
  Wakeup wakeup_;  // a connection finished (join it), or the server stops
  std::unique_ptr<Log> log_;

  mutable std::mutex mutex_;
  // Set under mutex_, so that a wait on one of its condition variables cannot miss it.
  std::atomic<bool> stopping_{false};
  std::condition_variable drained_;
  std::condition_variable granted_;
  std::map<GrantKey, std::shared_ptr<Grant>> grants_;
  // Grants revoked lately: a read of one is refused at once, not after grant_wait_ms_max.
  static constexpr std::size_t kRevokedRemembered = 1024;
  std::deque<GrantKey> revoked_;
  std::uint32_t grant_waiters_ = 0;  // guarded by mutex_
  bool revoked_recently(GrantKey key) const {
    return std::find(revoked_.begin(), revoked_.end(), key) != revoked_.end();
  }
  // Every connection whose thread is not yet joined (at most connections_max); only the acceptor
  // adds and removes entries, and each thread changes its own entry, all under mutex_.
  std::list<Connection> connections_;
  Stats stats_;

  std::thread acceptor_;
};

// Tells on_progress of a prefix that threads of one pull (streams, rails) grow, outside their own
// locks: one call at a time, each prefix larger than the last told (a smaller one that comes late
// is not told). The other threads then go on receiving while on_progress runs.
class OrderedProgress {
 public:
  explicit OrderedProgress(const std::function<void(std::uint64_t)>& on_progress) : on_progress_(on_progress) {}
  void tell(std::uint64_t prefix_bytes) {
    if (!on_progress_) return;
    std::lock_guard lock(mutex_);
    if (prefix_bytes <= told_bytes_) return;
    told_bytes_ = prefix_bytes;
    on_progress_(prefix_bytes);
  }

 private:
  const std::function<void(std::uint64_t)>& on_progress_;
  std::mutex mutex_;
  std::uint64_t told_bytes_ = 0;
};

struct PullOptions {
  std::uint64_t chunk_bytes = 8ull << 20;  // one request
  // How often on_progress hears of a growing prefix while a response arrives: a reader of this
  // shard (pipeline replication) trails it by about this much, at every hop of a chain. Also the
  // size of one receive: the reader hashes each step as it arrives (client/receive.h), and a step
  // of 256 KiB is still in cache then (bench/results/data-pair-2026-12-06.md: in a bare stream,
  // 1 MiB steps hashed at half the speed and the stream ran 20 % slower; th-bench pair's reader
  // spent 15 % more CPU per GB).
  std::uint64_t progress_step_bytes = 256ull << 10;
  std::uint32_t depth = 4;                 // requests in flight on the connection (complete sources)
  // Connections used at once for a complete source, each pulling whole regions (helps on links
  // with a large bandwidth-delay product, where one TCP stream does not fill the pipe).
  std::uint32_t streams = 1;
  bool partial = false;                    // the source is still receiving (pipeline replication)
  int connect_timeout_ms = 5'000;
  int io_timeout_ms = 30'000;
  // A partial source that makes no progress this long has failed. Progress is its own ready
  // prefix's: a reader resumed ahead of it waits while it catches up (kSourceAdvanced), for at
  // most ten times this without a byte.
  int stall_ms_max = 60'000;
  // Caps the receive rate (0: none), e.g. to leave a shared NIC to the training job's own traffic.
  std::uint64_t rate_bytes_per_s = 0;
  // Resume: the first `start_bytes` of the targets (layout order) hold the version already (a
  // reader verified them after its last source failed); only the rest is pulled, and on_progress
  // counts from here. Over TCP one connection pulls the rest; a pull through CUDA IPC is not
  // taken (it would copy everything again). All of it held: nothing is pulled, no source asked.
  std::uint64_t start_bytes = 0;
  // Polled between chunks: true stops the pull with kCancelled.
  std::function<bool()> cancelled;
  // Called as the prefix of the targets (layout order) that has arrived grows: a receiving shard
  // exposes it to its own readers from here (and hashes what arrived: it may take a while). One
  // call at a time; a pull of several threads tells it through an OrderedProgress.
  std::function<void(std::uint64_t ready_bytes)> on_progress;
  // Moves bytes into targets of GPU memory (on_device): each connection borrows a ring for the
  // pull. A response into GPU memory is told to on_progress once it is all on the device.
  std::shared_ptr<StagingPool> staging = nullptr;
  // Copies GPU regions device to device from a source on this host through CUDA IPC (net/ipc.h),
  // for a complete source whose every GPU region the source exports; any other case, or any "no"
  // on the way, pulls over TCP as without it. Null: always TCP.
  std::shared_ptr<IpcImporter> ipc = nullptr;
};

inline constexpr std::uint32_t kPullStreamsMax = 16;

struct PullOutcome {
  std::uint64_t bytes = 0;          // bytes that landed in the targets
  std::optional<ReadError> error;   // none: every byte arrived
  std::string detail;               // what failed, for logs
  bool ok() const { return !error.has_value(); }
  std::uint64_t bytes_over_ipc = 0;  // of `bytes`, copied device to device through CUDA IPC
  std::string ipc_fallback = {};     // why a pull with PullOptions::ipc went over TCP after all (logs)
};

// Pulls every byte of the regions exposed under `key` at `source` into `targets` (same sizes, same
// order). Data lands directly in the targets: no staging copy. I/O failures are outcomes, not
// exceptions: a source that fails is an expected event the agent reports.
PullOutcome pull(const Endpoint& source, GrantKey key, const GrantSecret& secret, std::span<const LocalRegion> targets,
                 const PullOptions& options);

}  // namespace th::net
