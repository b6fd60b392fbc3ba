// libthclient's insides, shared by its files (not installed):
//   handle.cpp      the Handle API, the application's calls, the I/O thread and the agent's effects;
//   server_links.cpp  the connections to th-server (connect, TLS, send, heartbeats, probes, failover);
//   data_path.cpp   serving grants, the reader thread, offload copies and seed reads;
//   receive.cpp     replicate and update in flight (Receive): streaming, checksums per tensor.
#pragma once

#include "tensorhub/client.h"

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "client/log_sink.h"
#include "client/patch_read.h"
#include "client/plan.h"
#include "client/metrics.h"
#include "core/agent.h"
#include "net/data_plane.h"
#include "net/transport.h"
#include "net/event_loop.h"
#include "net/frames.h"
#include "net/heartbeat.h"
#include "net/tls.h"
#include "net/wire.h"

// Cap'n Proto's generated Server classes have virtual methods and a non-virtual destructor; kj owns
// them through kj::Own, which deletes the most-derived type, so the warning does not apply.
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"

namespace th {
namespace client_impl {

struct ReadAttempt;  // client/receive.h

constexpr TimeMs kTickMs = 50;                  // how often the agent hears the clock
constexpr TimeMs kReconnectBackoffInitialMs = 100;
constexpr TimeMs kReconnectBackoffMaxMs = 2000;
constexpr TimeMs kCloseOnDestroyMs = 5000;  // ~Handle waits this long for close() to be answered
// Waits on peers (data_timeout_ms, server_timeout_ms): at most this long, and this long before the
// server told its heartbeat timeout.
constexpr TimeMs kDataTimeoutMaxMs = 600'000;
constexpr TimeMs kDataTimeoutUnknownMs = 20'000;

// Retransmission over TCP is a safety net, not a mechanism: nothing is lost while the connection
// lives, and a lost connection resends everything on the next one. A short first retry multiplied
// a loaded server's work: with 8,192 clients whose calls took seconds, duplicates went out and
// were answered again; the server did 1.5 K ops/s with a 250 ms first retry, 3.5 K with 2 s, 6.5 K
// with 10 s (bench/results/control-plane-*). (An open still goes again every heartbeat interval:
// while a shard opens, that is what keeps it alive; see ShardAgent::on_tick.)
constexpr TimeMs kRetryInitialMs = 10'000;
constexpr TimeMs kRetryMaxMs = 60'000;

inline TimeMs steady_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The staging of a handle's GPU memory (net/staging.h) on its device, made when a ring is first
// needed: a handle with CPU tensors only never calls CUDA.
class GpuStaging final : public net::StagingProvider {
 public:
  void set_device(std::shared_ptr<Gpu> gpu, int device) {
    std::lock_guard lock(mutex_);
    if (made_ == nullptr) made_ = gpu->staging(device);
  }
  std::unique_ptr<net::CopyLane> make_lane() override { return made().make_lane(); }
  std::shared_ptr<std::byte[]> allocate_pinned(std::uint64_t bytes) override { return made().allocate_pinned(bytes); }

 private:
  net::StagingProvider& made() {
    std::lock_guard lock(mutex_);
    TH_ASSERT(made_ != nullptr, "GPU memory is staged only after a GPU tensor was registered");
    return *made_;
  }
  std::mutex mutex_;
  std::shared_ptr<net::StagingProvider> made_;
};

// A CPU copy of the shard's regions (an offload replica), in the same region order.
struct OffloadCopy {
  std::vector<std::byte> bytes;
  std::vector<net::ExposedRegion> regions;
  std::shared_ptr<void> lease;  // of `bytes`, lent to the data plane; declared last: dropped first
};

}  // namespace client_impl
using namespace client_impl;  // this header is libthclient's own: its three files only

class Handle::Impl : private kj::TaskSet::ErrorHandler {
 public:
  explicit Impl(ClientOptions options);
  ~Impl();

  Status start();  // threads up, open answered
  // Set while an application call runs (see OneCallAtATime).
  std::atomic<bool> user_call_busy_{false};
  // This handle's section of the process's metrics (attached from start() until ~Impl).
  std::shared_ptr<client::HandleMetrics> metrics_;
  Outcome call(RequestBody body, std::optional<TimeMs> deadline_ms = std::nullopt);
  Status register_tensor(TensorSpec spec, void* data, MemoryKind memory);
  Status unregister_tensor(std::string_view name);
  Status write_tensor(std::string_view name, const void* source, DType source_dtype);
  Result<Version> publish(Version version, void* cuda_stream);
  // Starts a replicate or update (validated by the caller) whose answer goes to the State it
  // returns; at most one in flight (the agent refuses a second call).
  Result<std::shared_ptr<Receive::State>> begin_receive(RequestBody body, Plan plan, client::HandleMetrics::Call kind);
  // Receive::cancel: asks the hub to end call `call_id` (nothing if it is not the one in flight).
  void cancel_call(std::uint64_t call_id);
  // Before a call: a Receive dropped unfinished was cancelled; its answer is awaited first, so
  // that the next call is not refused as "in flight".
  void settle_abandoned_receive(std::optional<TimeMs> timeout_ms = std::nullopt);
  bool receive_running();
  // ~Handle: cancels a Receive still running and waits up to `timeout_ms` for its answer.
  void end_receive(TimeMs timeout_ms);
  void interrupt(const std::string& why);
  Plan plan_copy();
  bool is_open();
  void shutdown();

  std::uint64_t client_id() const { return client_id_; }
  std::uint64_t incarnation();
  std::string data_endpoint() const { return advertised_; }
  HandleStats stats() const;

 private:
  struct Link;
  struct ReadJob {
    StartRead read;
    std::shared_ptr<std::atomic<bool>> cancelled;
    std::shared_ptr<net::Progress> progress;
    Plan plan;
    std::byte* packed = nullptr;
    std::shared_ptr<OffloadCopy> seed;  // offload seeding: the CPU copy read into (kept alive)
    // Who hears the read's progress and checks its tensors with it (the Receive of the call it
    // serves; a State of its own for a seed copy).
    std::shared_ptr<Receive::State> stream;
    // A patch read: the checksums of the version the buffers held (its base), where known.
    ChecksumsRef base_checksums = nullptr;
  };

  void taskFailed(kj::Exception&& exception) override;
  void io_main(std::promise<void>& ready);
  // On the I/O thread.
  void step(const AgentInput& input);
  void apply(const AgentEffect& effect);
  void post(AgentInput input);  // step later (never re-enter the agent from its own effects)
  void send_to(std::uint32_t server, net::ToHubMessage message);
  void connect(std::uint32_t server);
  // Writes the queued messages as frames (with an ack asked, if none is awaited).
  void flush(Link& link);
  // An empty frame asking for an ack: whether the server is alive (and a heartbeat there).
  void probe(Link& link);
  // Reads the server's frames until the connection ends.
  kj::Promise<void> read_frames(std::uint32_t server, std::uint64_t generation);
  void on_frame(Link& link, wire::ServerFrame::Reader frame);
  void lose(std::uint32_t server, std::uint64_t generation, const std::string& why);
  void serve(const ServeRead& grant);
  void start_read(const StartRead& read);
  void start_seed_read(const StartRead& read);
  void join_reported_threads();
  void start_offload(Version version);
  kj::Promise<void> tick_loop();
  // Gives up on links whose server answers nothing (it hangs) and probes the quiet ones.
  void check_links();
  TimeMs server_timeout_ms() const;
  // Probes per server timeout on a link where nothing else asks the server anything.
  static constexpr TimeMs kProbesPerTimeout = 2;
  // Other threads: run `work` on the I/O thread (false once it stopped).
  bool on_io(kj::Function<void()> work);
  void reader_main();
  void run_read(ReadJob& job);
  // run_read's for a source of another layout (StartRead::reshard set).
  void run_reshard_read(ReadJob& job);
  // run_read's for a patch (StartRead::patch set; client/patch_read.h).
  void run_patch_read(ReadJob& job);
  // The end of a read handed out only once whole (across layouts, or a patch): stats, progress,
  // what the buffers hold, and the agent's ReadFinished. `assembled`: after a read across
  // layouts, the checksums of what landed.
  void finish_whole_read(const ReadJob& job, std::optional<ReadFailure> failure, std::uint64_t bytes, double seconds,
                         ChecksumsRef assembled, std::shared_ptr<KeptPatch> kept);
  // What every read of the buffers pulls with (chunks, rate, streams, timeout, staging).
  net::PullOptions pull_options_for_reads() const;
  // A read into the buffers verified `version` whole (I/O thread): what they hold, to patch next.
  void hold_verified(Version version, ChecksumsRef checksums, std::shared_ptr<KeptPatch> kept);
  void complete_call(std::uint64_t call_id, Outcome outcome);
  void fail_everything(Error error);
  // Asks `server`, once, whether it speaks HTTP (it hung up on the hello, or kept quiet for
  // kHelloQuietMs); note_http records one that does: open()'s error names it, and open() fails at
  // once when every server does (a metrics port given as the server, say).
  void probe_http(std::uint32_t server);
  void note_http(std::uint32_t server);
  static constexpr TimeMs kHelloQuietMs = 1'000;
  void log(LogLevel level, std::string_view component, const std::string& line) const;

  ClientOptions options_;
  // Declared early: destroyed after every thread that logs (reader, I/O, data server) stopped.
  mutable client::LogSink log_sink_;
  ClientId client_id_;
  // The server's heartbeat timeout, told at connect (0: not yet): bounds the waits on peers.
  std::atomic<TimeMs> server_heartbeat_timeout_ms_{0};
  TimeMs data_timeout_ms() const {
    if (options_.data_timeout_ms > 0) return options_.data_timeout_ms;
    const TimeMs told = server_heartbeat_timeout_ms_.load();
    return told > 0 ? std::min<TimeMs>(2 * told, kDataTimeoutMaxMs) : kDataTimeoutUnknownMs;
  }
  // Proves to a server that a connection of ours speaks for client_id_ (kept for the handle's life,
  // so that a reconnect before the server saw the old connection close is recognised).
  static constexpr std::size_t kClientSecretBytes = 16;
  std::array<kj::byte, kClientSecretBytes> client_secret_;
  ShardAgent agent_;
  // How this shard's bytes move, both ways (net/transport.h): the only data-plane object here.
  std::unique_ptr<net::DataTransport> transport_;
  std::string advertised_;

  // I/O thread state.
  std::thread io_thread_;
  net::IoLoop* loop_ = nullptr;
  const kj::Executor* executor_ = nullptr;
  kj::Own<kj::PromiseFulfiller<void>> stop_;
  kj::TaskSet* tasks_ = nullptr;
  // Set when options_.tls_ca_file is: every control connection is wrapped in TLS. Declared before
  // links_ so that it outlives their streams.
  std::unique_ptr<kj::TlsContext> tls_;
  bool ever_connected_ = false;  // a server answered a connect call (I/O thread)
  std::set<std::uint32_t> http_probed_;  // servers probe_http asked (at most options_.servers)
  std::set<std::uint32_t> http_servers_;  // servers found to speak HTTP
  std::map<std::uint32_t, std::unique_ptr<Link>> links_;
  std::map<std::uint32_t, std::pair<TimeMs, TimeMs>> reconnect_;  // server -> (not before, backoff)
  std::uint64_t next_generation_ = 1;
  std::map<std::string, Registered, std::less<>> registry_;
  // Rebuilt when first needed after the registry changed (registering N tensors stays linear).
  Plan plan_;
  bool plan_stale_ = false;
  const Plan& plan();
  std::vector<std::byte> packed_;  // the packed small tensors (region 0)
  // GPU tensors (MemoryKind::kCuda): the process's CUDA access and the one device they are all on,
  // set by the first one registered (I/O thread); the staging rings of the TCP data plane make
  // their CUDA streams on that device when first needed.
  std::shared_ptr<Gpu> gpu_;
  int gpu_device_ = -1;
  std::shared_ptr<GpuStaging> gpu_staging_ = std::make_shared<GpuStaging>();
  // Rings for serving (one per connection answering from GPU memory) and for pulling (one per
  // stream of a pull, held for the pull): apart, so that neither can starve the other.
  std::shared_ptr<net::StagingPool> serve_staging_ = std::make_shared<net::StagingPool>(gpu_staging_, net::StagingConfig{});
  // Maps same-host sources' GPU allocations (CUDA IPC); the reader thread's, made at its first read
  // into GPU memory when options_.cuda_ipc allows.
  std::shared_ptr<net::IpcImporter> ipc_importer_;
  std::shared_ptr<net::StagingPool> pull_staging_ =
      std::make_shared<net::StagingPool>(gpu_staging_, net::StagingConfig{.rings_max = net::kPullStreamsMax});
  std::shared_ptr<void> packed_lease_;  // packed_ lent to the data plane (dropped before it changes)
  // What the registered buffers hold now: a version and how much of it is ready (pipeline).
  std::optional<Version> buffers_version_;
  std::shared_ptr<net::Progress> buffers_progress_;
  // Delta versions (I/O thread): the version the buffers last held whole and its checksums (the
  // base of the next patch, as writer or reader; kept across unpublish, dropped once a read
  // writes them), the patch that version came with (served onwards), and what write_tensor
  // recorded since (by tensor name; nullopt: written, no patch).
  std::optional<std::pair<Version, ChecksumsRef>> held_checksums_;
  std::shared_ptr<KeptPatch> kept_patch_;
  struct WrittenPatch {
    Version base = 0;
    std::optional<std::vector<std::byte>> patch;
  };
  std::map<std::string, WrittenPatch, std::less<>> written_patches_;
  std::map<Version, std::shared_ptr<OffloadCopy>> offloads_;
  std::map<net::GrantKey, std::shared_ptr<OffloadCopy>> offload_grants_;  // keeps copies alive
  // One thread per offload copy, joined once its copy was reported (a finished thread that is never
  // joined keeps its stack: a trainer offloads every step).
  std::map<std::uint64_t, std::thread> offload_threads_;
  std::vector<std::uint64_t> offloads_reported_;  // their threads are returning
  // Offload seeding: a thread per seed read (the hub has one read at a time per replica, plus
  // reads replaced by a newer epoch that are winding down), beside the reader thread, so that a
  // slow cross-datacenter read never delays the buffers'.
  struct SeedRead {
    Version version = 0;
    std::shared_ptr<std::atomic<bool>> cancelled;
  };
  std::map<TransferId, SeedRead> seed_reads_;
  bool threads_closed_ = false;  // shutdown: no new offload or seed thread
  std::uint64_t next_offload_id_ = 1;
  std::atomic<bool> io_stopped_{false};

  // Calls of the application.
  mutable std::mutex calls_mutex_;
  std::condition_variable call_done_;
  std::map<std::uint64_t, std::optional<Outcome>> calls_;
  std::optional<Error> fatal_;  // the token was refused: every call fails with it
  // The replicate or update in flight, if it was started by begin_receive (its answer goes there).
  std::shared_ptr<Receive::State> active_receive_;
  std::string last_server_error_;  // why the last server link was lost (for open()'s timeout)
  std::string http_hint_;          // a server that speaks HTTP (note_http), for open()'s timeout
  std::uint64_t next_call_id_ = 1;

  // The reader thread.
  std::thread reader_thread_;
  std::mutex reader_mutex_;
  std::condition_variable reader_wakeup_;
  std::deque<ReadJob> read_jobs_;
  struct RunningRead {
    TransferId transfer = 0;
    std::shared_ptr<std::atomic<bool>> cancelled;
  };
  std::optional<RunningRead> running_read_;  // the job the reader thread is on
  // The last read into the buffers that ended without all its bytes (its source failed, or the
  // server moved it to another source): the next read of the same transfer goes on from the
  // tensors it verified (Receive::State::resume). The reader thread's own.
  struct Resumable {
    TransferId transfer = 0;
    std::uint32_t epoch = 0;
    std::shared_ptr<net::Progress> progress;
    std::shared_ptr<Receive::State> stream;
    std::shared_ptr<ReadAttempt> attempt;
  };
  std::optional<Resumable> resumable_;
  // A failed call's answer, held until the reader let go of the buffers (see apply(CallDone)).
  std::optional<std::pair<std::uint64_t, Outcome>> completion_after_reads_;
  bool reader_stopping_ = false;

  mutable std::mutex stats_mutex_;
  HandleStats stats_;
};

struct Handle::Impl::Link {
  std::uint32_t server = 0;
  std::uint64_t generation = 0;
  kj::Maybe<kj::Promise<void>> connecting;  // TCP connect, TLS handshake
  bool connected = false;                    // the server welcomed our hello
  // The server's address as the socket reached it (heartbeat datagrams go there), read once the TCP
  // connection is up.
  std::optional<sockaddr_storage> peer;
  // The framed connection (net/frames.h), once TCP (and TLS) are up: hello and the queue go at once.
  kj::Own<net::FrameStream> frames;
  kj::Maybe<kj::Promise<void>> reading;  // read_frames
  std::vector<net::ToHubMessage> queue;  // until the connection is up
  // The ack the last frame that asked for one named (0: none awaited). One at a time: it is the
  // evidence that the server is alive and feeding the hub, not flow control (TCP is).
  std::uint64_t ack_awaited = 0;
  std::uint64_t acks_asked = 0;
  // Heartbeats as datagrams (net/heartbeat.h), once the server offered a channel at connect.
  std::unique_ptr<net::HeartbeatSender> heartbeats;
  net::HeartbeatKey heartbeat_key{};
  std::uint64_t heartbeat_count = 0;  // of the last datagram sent (the server refuses counts it saw)
  // The server's last ack said it hears them: heartbeats stop going as messages.
  bool heartbeat_datagrams_heard = false;
  // A server that is alive answers; one that hangs (stopped, swapping, wedged) keeps the TCP
  // connection open and answers nothing. Since when something of ours has waited for an answer
  // (the welcome, or an ack; 0: nothing waits), and when the server last sent a frame.
  TimeMs waiting_since_ms = 0;
  TimeMs heard_ms = 0;
};

}  // namespace th
