// libthclient: the TensorHub client API (DESIGN.md §4, paper §4.2).
//
// One Handle is one shard of one replica: the worker that holds that shard's tensors. A trainer
// with 8-way model parallelism opens 8 handles (one per process), all with the same replica name
// and num_shards = 8; every shard of a replica must make the same calls in the same order (SPMD),
// and every shard gets the same answer (the server runs each call as a transaction of the replica).
//
//   auto handle = th::Handle::open(options).value();   // blocks until the server answered
//   handle->register_tensor("layer0.weight", ptr, bytes, th::DType::kBFloat16);
//   handle->publish(7);             // trainer: version 7 is in my buffers; don't touch them
//   handle->unpublish();            // trainer: I may write my buffers again
//   handle->replicate("latest");    // rollout: bring the latest version into my buffers
//   handle->update("latest");       // rollout: move to a newer version if there is one
//
// Errors are values (th::Result / th::Status, codes in tensorhub/result.h); nothing here throws
// except for bugs (std::logic_error from a failed assertion). Everything this header uses is in
// tensorhub/ (types.h, result.h): the installed package has no other headers.
//
// Threads: a handle runs one I/O thread (control protocol, heartbeats), one data-server thread per
// reader connection and one reader thread. Calls on one handle must come from one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorhub/result.h"
#include "tensorhub/types.h"

namespace th {

// Where a registered tensor lives. kCuda: CUDA device memory (cudaMalloc, PyTorch's allocator;
// not managed or pinned host memory, which are kCpu). A handle's GPU tensors are all on one
// device. They move through pinned host staging over TCP (the copies overlapping the network), or
// straight to and from the NIC over RDMA where GPU memory can be registered with it (dma-buf,
// nvidia-peermem); their checksums are computed on the GPU. A libthclient built without the CUDA
// Toolkit, or a host without a CUDA device, refuses kCuda with kInvalidArgument saying which.
enum class MemoryKind : std::uint8_t { kCpu, kCuda };

// How serious a line of libthclient's log is.
enum class LogLevel : std::uint8_t { kDebug, kInfo, kWarning, kError };
std::string_view log_level_name(LogLevel level);  // "debug", "info", "warning", "error"

// Receives libthclient's log lines: the level, the part of the library ("handle", "control": the
// server connections, "data": reads and the data server, "rdma") and the text, one line without a
// newline. Called on a thread of the handle's own, one line at a time, in order, so that a slow
// hook stalls nothing else: lines queue (1,024 at most; past that they are dropped, and the hook
// is told how many). An exception from the hook is caught and that line goes to stderr. It must
// not call into the handle; ~Handle waits for the lines queued before it.
using LogHook = std::function<void(LogLevel level, std::string_view component, std::string_view message)>;

struct ClientOptions {
  std::vector<std::string> servers;  // "host:port" of th-server: the primary, then backups in order
  std::string token;                 // the cluster token (th-server --token-file)
  std::string model;
  std::string replica;               // the replica's name, the same on all its shards
  // Which life of the replica this is. 0 (the default): the server chooses, so that a restarted
  // process needs no bookkeeping: it replaces the replica if its shard is still held by a process
  // the server has not noticed gone (the next incarnation), else joins the replica its peers of a
  // restart are opening (the same one), else 1 (Handle::incarnation() says which). A number:
  // that incarnation, as before (a restarted replica must then open with a larger one).
  std::uint64_t incarnation = 0;
  std::uint32_t shard = 0;
  std::uint32_t num_shards = 1;
  std::string datacenter = "default";
  bool spot = false;                 // may vanish without notice: never counted on for retention
  std::string role;                  // free label ("trainer", "rollout") for wait(kRoleHolds)
  Retention retention;               // what this replica asks the server to keep readable
  // Where this shard serves its tensors to peers, and the address peers dial for it.
  // Default (both empty): listen on every interface, on a port the kernel chooses, and advertise
  // the address of this host's interface that reaches the servers (the first one in order that a
  // route reaches: the way the control connection goes), so that readers on other hosts can dial
  // it. open() fails with kUnavailable if no route reaches any server, and with kInvalidArgument
  // if the route is an IPv6 link-local address (peers cannot dial it without its interface). A
  // data_listen on a wildcard address ("0.0.0.0:P", "[::]:P") is advertised the same way; any
  // other is advertised as it is, with the port the kernel chose. data_advertise overrides all of
  // this (NAT, several interfaces). Note: a worker that reaches the server as 127.0.0.1 (on the
  // server's own host) advertises 127.0.0.1, which workers on other hosts cannot dial: name the
  // server by an address the other hosts use too. The data port serves only readers the server
  // granted a read (a 128-bit secret per transfer).
  std::string data_listen;
  std::string data_advertise;
  // How bytes move between peers: "auto" uses one-sided RDMA reads where this host has an RDMA
  // device with an active port and the source does too, else TCP (chosen per source, logged,
  // counted in HandleStats); "rdma" is the same but open() fails when this host has no usable
  // device; "tcp" never uses RDMA. Either way the data port serves TCP readers too.
  std::string transport = "auto";
  // The RDMA devices, comma-separated, one per rail ("mlx5_0,mlx5_1": device i pairs with device i
  // of the peer; a big read is striped over all). Empty: the active devices on the NUMA node this
  // process runs on, else every active one.
  std::string rdma_device;
  int rdma_gid_index = -1;     // -1: the first RoCE v2 GID of an IPv4 address, else 0
  TimeMs heartbeat_interval_ms = 1000;
  // open() gives up with kUnavailable if no server answered in this time. Later calls wait for as
  // long as it takes (servers fail over; use a call's own timeout where it has one).
  TimeMs open_timeout_ms = 30'000;
  std::uint64_t chunk_bytes = 8ull << 20;  // data-plane request size
  std::uint64_t read_rate_bytes_per_s = 0;  // cap on this shard's receive rate (0: none)
  std::uint32_t data_streams = 1;  // connections per read of a complete source (1..16)
  // After a source fails mid-read, the next source's read goes on after the tensors that arrived
  // whole and verify against their checksums, rather than from byte 0 (issue 34). Off: from 0
  // (the behaviour before; bench/run-fanout-failure compares the two).
  bool resume_reads = true;
  // A source that sends nothing for this long has failed: the read is reported and the server
  // picks another source. 0: twice the server's heartbeat timeout (it evicts a silent peer by then
  // and moves this reader elsewhere, which stops the read at once), or 20 s before it is known.
  TimeMs data_timeout_ms = 0;
  // A server that answers nothing for this long is taken for hung: the handle drops the connection
  // and fails over as if it had closed (a stopped server keeps its TCP connections open). 0: twice
  // the server's heartbeat timeout, or 20 s before it is known.
  TimeMs server_timeout_ms = 0;
  // TLS on the control connection (th-server --tls-cert/--tls-key): the server's certificate must
  // chain to a CA of this PEM file and carry `tls_server_name` (default: the host of the server's
  // address; a server reached by IP address needs the certificate's DNS name here). Empty: clear
  // text. A certificate that fails the check fails open() with kPermissionDenied, like a wrong token.
  std::string tls_ca_file;
  std::string tls_server_name;
  // Serve Prometheus metrics of this process's handles (GET /metrics) on HOST:PORT (port 0: any
  // free port; Handle::metrics_address() says which). One endpoint per process: every handle shows
  // on it, whichever opened it; a handle naming another address fails open(). Empty: none
  // (handles still count; a later handle may start the endpoint).
  std::string metrics_listen;
  // Where log lines go: lines below log_level are dropped; the rest go to `log`, or, without one,
  // to stderr as "thclient REPLICA/SHARD LEVEL COMPONENT: MESSAGE" (one write per line).
  LogLevel log_level = LogLevel::kInfo;
  LogHook log;
  // GPU tensors between processes of one host (a colocated trainer and rollout): copied device to
  // device through CUDA IPC instead of through staging and TCP loopback, where both ends allow it.
  // A reader then maps the source's whole CUDA allocation (a PyTorch segment may hold other
  // tensors, optimizer state, KV cache), read and write; and the handle it was given opens that
  // allocation again, in any process of the host, for as long as the allocation lives. So a
  // same-host reader the server granted a read can read and write all of it: turn this off on the
  // sources where processes of one host do not trust each other (a source with it off answers
  // no handles). Readers and sources on other hosts are never affected.
  bool cuda_ipc = true;
};

struct ReplicateInfo {
  Version version = 0;
  std::string source_replica;  // whom the bytes came from
};

struct UpdateInfo {
  UpdateStatus status = UpdateStatus::kNoNewerVersion;
  std::optional<Version> version;  // held now; none: the shard holds no version (not version 0)
  std::string source_replica;
};

struct HandleStats {
  std::uint64_t bytes_received = 0;
  std::uint64_t bytes_served = 0;
  std::uint64_t reads_failed = 0;       // a source failed; the server picked another
  std::uint64_t checksum_failures = 0;  // received bytes that did not match their checksum
  // Times the server said readers found this shard's copy failing its checksums twice and reads
  // from it no more: its tensors changed while published (or its bytes broke on the way twice).
  // Each is also logged as an error. A publisher sees it first: a trainer writing while published.
  std::uint64_t copies_found_corrupt = 0;
  double last_read_seconds = 0;         // duration of the last completed read of a version
  double last_pull_seconds = 0;         // of which moving the bytes (the rest: checksums, unpacking)
  std::uint64_t last_read_bytes = 0;
  std::string reading_from;  // the source replica of the read in progress ("" when none)
  std::string transport;     // the data plane this shard runs: "tcp" or "rdma" (see ClientOptions::transport)
  std::uint64_t pulls_rdma = 0;       // reads done with one-sided RDMA reads
  std::uint64_t pulls_tcp = 0;        // reads over TCP
  std::uint64_t pulls_fell_back = 0;  // of those, because the source could not do RDMA
  std::uint64_t memory_registrations = 0;  // NIC registrations made (per allocation, not per version)
  std::uint64_t servers_lost = 0;          // control connections lost (each followed by a failover or reconnect)
  std::uint64_t pulls_ipc = 0;  // reads whose GPU tensors were copied from a same-host source over CUDA IPC
  // Reads that went on from the tensors an earlier read of the same call verified, after its
  // source failed, and the bytes they did not pull again.
  std::uint64_t reads_resumed = 0;
  std::uint64_t bytes_resumed = 0;
  // Delta versions: reads that applied a patch (and the bytes they pulled, patches and tensors read
  // whole), patch reads that failed (the bytes were read next), and versions this shard published
  // with patches (and their bytes).
  std::uint64_t patch_reads = 0;
  std::uint64_t patch_bytes_received = 0;
  std::uint64_t patch_reads_failed = 0;
  std::uint64_t patches_published = 0;
  std::uint64_t patch_bytes_published = 0;
  // How GPU tensors meet the NIC under transport rdma: "dma-buf", "peermem", or "staging" (through
  // pinned host memory over TCP; also the answer under transport tcp).
  std::string gpu_registration = "staging";
};

// A tensor of the version a Receive brings in: in its registered buffer, every byte there and
// verified against the publisher's checksum.
struct ReceivedTensor {
  std::string name;
  void* data = nullptr;  // the registered buffer
  std::uint64_t bytes = 0;
  DType dtype = DType::kFloat32;
  Version version = 0;
};

struct ReceiveProgress {
  std::optional<Version> version;      // the version being received, once a read of it began
  std::uint64_t bytes_ready = 0;       // of this shard's tensors, arrived (the current read's)
  std::uint64_t bytes_total = 0;       // of this shard's registered tensors
  std::uint32_t tensors_handed_out = 0;  // by next()
  std::uint32_t tensors_total = 0;
  bool done = false;                   // the call has its answer (wait() returns at once)
};

// A replicate or update in flight (Handle::replicate_async, update_async): the application goes on
// while the version arrives, takes each tensor as soon as it is complete and verified (next()), and
// may give up (cancel()). Methods may be called from any thread, next() from one at a time.
// Until the call has its answer the handle takes no other call (they fail with kInvalidArgument,
// as any call made while one is in flight). A Receive must not outlive its Handle's destructor:
// once the handle is gone every method answers kUnavailable.
class Receive {
 public:
  // An unfinished receive is cancelled (it does not wait: the next call on the handle waits for
  // the server's answer to the cancel).
  ~Receive();
  Receive(const Receive&) = delete;
  Receive& operator=(const Receive&) = delete;

  // The next tensor of this shard whose bytes are all here and match their checksum: the small
  // tensors (under 2 MiB, which travel packed together, in name order) first, each group of about
  // 4 MiB of them as soon as it is in, then the others in name order, as they arrive; each is
  // handed out once. Blocks until one is ready (timeout_ms 0: no limit). Returns nothing
  // once every tensor was handed out, or once the call ended without moving any (update's
  // kNoNewerVersion, kNotYet); the call's error if it failed before all were handed out;
  // kTimeout ("no tensor ... yet") if timeout_ms passed first, the call going on.
  // The bytes stay in the registered buffers: copy them out, or leave them there. If the read of
  // the version fails over to another source, that source writes the same bytes again into every
  // buffer (handed out or not), and the call's answer comes only after every tensor was verified
  // once more; if the call fails, the tensors handed out do not make a whole version.
  Result<std::optional<ReceivedTensor>> next(TimeMs timeout_ms = 0);
  // Blocks until the call has its answer and returns it (for replicate: status kUpdated).
  Result<UpdateInfo> wait();
  // Whether the call has its answer, waiting up to timeout_ms for it.
  bool wait_for(TimeMs timeout_ms);
  ReceiveProgress progress() const;
  // Asks the server to end the call for the whole replica (every shard's call ends with
  // kCancelled, unless it completed first); returns at once: wait() for the answer. The handle
  // then takes calls again; the buffers hold no version after a cancelled receive.
  void cancel();

  struct State;

 private:
  friend class Handle;
  explicit Receive(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

// Called with each tensor of a replicate or update as soon as all its bytes are verified (as
// Receive::next hands them out: the small tensors first, then the others in name order), on the
// calling thread, one at a time: for what an engine does itself as weights land (fp8 quantization
// with scales, fusing, post-processing) while the rest are still on the wire. A read from a source
// of another layout verifies its tensors only once all of them are assembled: its tensors then
// come in one burst, after the read.
using TensorHook = std::function<void(const ReceivedTensor& tensor)>;

class Handle {
 public:
  // Connects, authenticates and opens the shard. Blocks until the server answered (for a shard of
  // a replica that re-opens after a failover, until every shard re-opened).
  static Result<std::unique_ptr<Handle>> open(ClientOptions options);
  // Closes the shard if it is open (bounded wait), then stops every thread.
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  // Tensors of this shard, by unique name; their layout (names, dtypes, sizes; in name order) must
  // be the same on every replica of the model. Only while the shard holds no version (before the
  // first publish/replicate, or after unpublish). The memory must stay valid until unregistered or
  // the handle is gone. Immediate.
  // Three ways to say what a tensor is (README "Layouts"):
  //  - bytes: `bytes` of `dtype`, nothing more; matched with other replicas by name, dtype, size;
  //  - a shape: this shard's own tensor of `shape` (row-major); a replica whose shard says another
  //    shape for it (a transposed 64×32 for a 32×64) is refused with kLayoutMismatch;
  //  - a piece: the box `box` of the model's tensor `name` of `global_shape`. The pieces of one
  //    tensor on a replica's shards must tile it (no overlap, no gap; checked at publish), and
  //    readers compare the global shape and box.
  Status register_tensor(std::string name, void* data, std::uint64_t bytes, DType dtype,
                         MemoryKind memory = MemoryKind::kCpu);
  Status register_tensor(std::string name, void* data, DType dtype, Shape shape,
                         MemoryKind memory = MemoryKind::kCpu);
  Status register_piece(std::string name, void* data, DType dtype, Shape global_shape, Box box,
                        MemoryKind memory = MemoryKind::kCpu);
  Status unregister_tensor(std::string_view name);

  // Delta versions (README "Delta versions"): writes the tensor's new value, `source` (its element
  // count, of `source_dtype`: the tensor's own, or float32 into bfloat16/float16 with rounding to
  // nearest even), into its registered buffer, and records what changed against the version the
  // buffer held, which this shard published or received last. The next publish() announces the
  // patches of the tensors written so (a tensor with more than 40 % of its bytes changed, or written
  // otherwise, has none: it is read whole), and rollouts that hold that version pull the patches, a
  // few percent of the bytes at RL learning rates, instead of the whole version. Between unpublish()
  // (or before the first publish) and publish(); CPU tensors only, for now (a GPU tensor is refused
  // kInvalidArgument: copy it and publish, no patch). A tensor written after write_tensor by other
  // means makes a patch that readers' checksums refuse: they then read the bytes.
  Status write_tensor(std::string_view name, const void* source, DType source_dtype);

  // Promises that the registered tensors hold `version` and will not change until unpublish().
  // Blocks until every shard of the replica published; then readers may pull from here.
  // GPU tensors are read once the work queued on `cuda_stream` (a cudaStream_t) is done; nullptr:
  // once all work on their device is (cudaDeviceSynchronize).
  Result<Version> publish(Version version, void* cuda_stream = nullptr);
  // Withdraws the promise. Blocks until no reader reads these buffers any more (after an offload to
  // CPU memory if this was the last copy of a retained version). Then the tensors may change.
  Status unpublish();
  // Brings a version ("42", "latest", "latest-2") into the registered tensors. Blocks until it
  // exists and every shard received it, verified against its checksums; 0: no timeout. GPU
  // tensors' bytes are then visible to every stream (the copies were waited for). The copy
  // then serves other readers (even while it is still being received). The tensors must not be
  // written while the call runs (nor until unpublish() after it): each piece is verified as it
  // arrives, and a write behind the reader's back is served on to other readers, whose checksums
  // refuse it and, twice so, stop reading from this replica.
  Result<ReplicateInfo> replicate(std::string_view selector, TimeMs timeout_ms = 0);
  // Moves to a newer version if one is available (like unpublish + replicate), else returns at
  // once with kNoNewerVersion or kNotYet.
  Result<UpdateInfo> update(std::string_view selector = "latest");
  // replicate and update without blocking: the call runs while the application takes the tensors
  // as they arrive (Receive::next), watches progress, or cancels. Errors of the arguments come
  // back at once; the call's own answer from Receive::wait.
  Result<std::unique_ptr<Receive>> replicate_async(std::string_view selector, TimeMs timeout_ms = 0);
  Result<std::unique_ptr<Receive>> update_async(std::string_view selector = "latest");
  // replicate and update that hand each tensor to `hook` as soon as it is verified, and return
  // once the hook has had every tensor and the call its answer. If the hook throws, the call is
  // cancelled (for every shard) unless it already had its answer, that answer is waited for, and
  // the exception propagates: a cancelled call leaves the buffers holding no version; one that was
  // answered already (its last tensors, or a read across layouts, whose tensors come after the
  // answer) leaves the version in them.
  Result<ReplicateInfo> replicate(std::string_view selector, TimeMs timeout_ms, const TensorHook& hook);
  Result<UpdateInfo> update(std::string_view selector, const TensorHook& hook);
  // The model's versions and replicas. Immediate.
  Result<ListSnapshot> list();
  // Blocks until the predicate holds; 0: no timeout.
  Status wait(const WaitPredicate& predicate, TimeMs timeout_ms = 0);
  // Leaves: blocks until readers of this replica drained. The handle is then done.
  Status close();

  // Makes the call that waits on this handle now (a Receive's too), and every later one, return
  // kUnavailable ("interrupted: <why>") at once. The only call another thread may make while one runs: for a
  // language binding's Ctrl-C, or a process that shuts down. Then the handle can only be dropped
  // (the server evicts the shard after its heartbeat timeout).
  void interrupt(const std::string& why);

  // This shard's data-plane address (what peers connect to).
  std::string data_endpoint() const;
  // The id the server knows this handle by (th-server's logs name clients by it).
  std::uint64_t client_id() const;
  // The replica's incarnation this shard is part of now (chosen by the server, or advanced after
  // an eviction).
  std::uint64_t incarnation() const;
  HandleStats stats() const;
  // Where this process serves its metrics (ClientOptions::metrics_listen), with the port chosen;
  // "" if it does not.
  static std::string metrics_address();

  class Impl;

 private:
  explicit Handle(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace th
