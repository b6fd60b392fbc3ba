// libthclient: the shell around the core ShardAgent.
//
// The agent decides everything (what to send, when to retry, which grants to serve, when to fail
// over); this file carries out its effects on real resources and feeds it what happens:
//   - the control protocol: one Cap'n Proto connection per server, opened on demand, with a bounded
//     number of Session.send calls in flight; a lost connection is ServerLost; heartbeats go as UDP
//     datagrams where the server offers it and hears them, as calls otherwise;
//   - the data plane: a DataServer serves grants from the registered tensors (or from an offload
//     copy); one reader thread pulls versions into them and verifies their checksums;
//   - offloads: a thread copies the registered tensors to CPU memory;
//   - the application: calls block on a condition variable until the agent's CallDone.
// Everything that touches the agent runs on the I/O thread (a kj event loop); other threads hand it
// work through the loop's executor.
#include "tensorhub/client.h"

#include <capnp/rpc-twoparty.h>
#include <xxhash.h>

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
#include <thread>

#include "core/agent.h"
#include "net/data_plane.h"
#include "net/event_loop.h"
#include "net/heartbeat.h"
#include "net/tls.h"
#include "net/wire.h"

// Cap'n Proto's generated Server classes have virtual methods and a non-virtual destructor; kj owns
// them through kj::Own, which deletes the most-derived type, so the warning does not apply.
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"

namespace th {
namespace {

// Tensors below this size travel packed into one buffer per shard (paper §4.3.2): one request
// instead of hundreds of tiny ones.
constexpr std::uint64_t kPackedTensorBytesMax = 2ull << 20;
constexpr std::uint32_t kSendsInFlightMax = 4;  // Session.send calls per server connection
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

AgentConfig agent_config_of(const ClientOptions& options, ClientId client) {
  return AgentConfig{client, static_cast<std::uint32_t>(std::max<std::size_t>(options.servers.size(), 1)),
                     options.heartbeat_interval_ms, kRetryInitialMs, kRetryMaxMs};
}

OpenRequest open_request_of(const ClientOptions& options, const std::string& data_endpoint) {
  OpenRequest open;
  open.model = options.model;
  open.replica = options.replica;
  open.incarnation = options.incarnation;
  open.shard = options.shard;
  open.num_shards = options.num_shards;
  open.datacenter = options.datacenter;
  open.spot = options.spot;
  open.role = options.role;
  open.retention = options.retention;
  open.data_endpoint = data_endpoint;
  return open;
}

// Everything about the options that can be judged before anything starts, so that a bad option
// is a typed error at once rather than a server's silence or an open that times out.
Status validate(const ClientOptions& options) {
  if (options.servers.empty() || options.servers.size() > limits::kShardsMax) {
    return make_error(Errc::kInvalidArgument, "give 1 to 256 server addresses");
  }
  try {
    for (const std::string& server : options.servers) net::parse_endpoint(server);
    net::parse_endpoint(options.data_listen);
  } catch (const net::SocketError& error) {
    return make_error(Errc::kInvalidArgument, error.what());
  }
  if (Status valid = validate(agent_config_of(options, 1)); !valid.ok()) return valid;
  if (options.data_streams == 0 || options.data_streams > net::kPullStreamsMax) {
    return make_error(Errc::kInvalidArgument, "data_streams must be in 1.." + std::to_string(net::kPullStreamsMax));
  }
  if (options.data_timeout_ms < 0 || options.data_timeout_ms > kDataTimeoutMaxMs) {
    return make_error(Errc::kInvalidArgument, "data_timeout_ms must be in 0..600000 (0: from the server's heartbeat timeout)");
  }
  if (options.server_timeout_ms < 0 || options.server_timeout_ms > kDataTimeoutMaxMs) {
    return make_error(Errc::kInvalidArgument, "server_timeout_ms must be in 0..600000 (0: from the server's heartbeat timeout)");
  }
  if (options.tls_ca_file.empty() && !options.tls_server_name.empty()) {
    return make_error(Errc::kInvalidArgument, "tls_server_name needs tls_ca_file (TLS is off without a CA file)");
  }
  // A chunk is one response of the peer's data server.
  const std::uint64_t chunk_bytes_max = net::DataServerConfig{}.response_bytes_max;
  if (options.chunk_bytes == 0 || options.chunk_bytes > chunk_bytes_max) {
    return make_error(Errc::kInvalidArgument, "chunk_bytes must be in 1.." + std::to_string(chunk_bytes_max));
  }
  // What the hub would refuse (names, shard numbers, retention), with the advertised endpoint's
  // length if one is given (the listen address's is short).
  return validate(open_request_of(options, options.data_advertise));
}

TimeMs steady_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::uint64_t checksum(const std::byte* data, std::uint64_t bytes) { return XXH3_64bits(data, bytes); }

struct Registered {
  std::byte* data = nullptr;
  std::uint64_t bytes = 0;
  DType dtype = DType::kFloat32;
};

// How the shard's tensors appear on the data plane: region 0 is the packed buffer of the small
// tensors (if any), then the big tensors, each its own region, in layout (name) order.
struct Plan {
  LayoutRef layout;
  std::vector<std::byte*> tensor_data;  // in layout order
  std::vector<std::uint64_t> packed_offset;  // per tensor: its place in the packed buffer, or none
  std::uint64_t packed_bytes = 0;
  std::vector<std::size_t> big;  // layout indices of the tensors with a region of their own

  static constexpr std::uint64_t kNotPacked = ~0ull;
};

Plan make_plan(const std::map<std::string, Registered, std::less<>>& registry) {
  Plan plan;
  if (registry.empty()) return plan;
  std::vector<TensorSpec> specs;
  for (const auto& [name, tensor] : registry) {
    specs.push_back({name, tensor.dtype, tensor.bytes});
    plan.tensor_data.push_back(tensor.data);
    if (tensor.bytes < kPackedTensorBytesMax) {
      plan.packed_offset.push_back(plan.packed_bytes);
      plan.packed_bytes += tensor.bytes;
    } else {
      plan.packed_offset.push_back(Plan::kNotPacked);
      plan.big.push_back(specs.size() - 1);
    }
  }
  plan.layout = ShardLayout::make(std::move(specs)).value();  // names unique and valid: checked at register
  return plan;
}

// A CPU copy of the shard's regions (an offload replica), in the same region order.
struct OffloadCopy {
  std::vector<std::byte> bytes;
  std::vector<net::ExposedRegion> regions;
};

// Offload seeding: fills `copy` (empty) with a CPU buffer laid out like the buffers of `layout`
// would be on the data plane (the packed small tensors, then each big one), and returns the plan
// that reads into it in place. Allocates gigabytes: called on the seed's own thread.
Plan seed_copy_of(const LayoutRef& layout, OffloadCopy& copy) {
  Plan plan;
  plan.layout = layout;
  std::uint64_t big_bytes = 0;
  for (const TensorSpec& tensor : layout->tensors()) {
    if (tensor.bytes < kPackedTensorBytesMax) {
      plan.packed_offset.push_back(plan.packed_bytes);
      plan.packed_bytes += tensor.bytes;
    } else {
      plan.packed_offset.push_back(Plan::kNotPacked);
      plan.big.push_back(plan.packed_offset.size() - 1);
      big_bytes += tensor.bytes;
    }
  }
  TH_ASSERT(copy.bytes.empty() && copy.regions.empty(), "a seed copy is filled once");
  copy.bytes.resize(plan.packed_bytes + big_bytes);
  if (plan.packed_bytes > 0) copy.regions.push_back({copy.bytes.data(), plan.packed_bytes});
  std::byte* at = copy.bytes.data() + plan.packed_bytes;
  const auto& tensors = layout->tensors();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (plan.packed_offset[i] != Plan::kNotPacked) {
      plan.tensor_data.push_back(copy.bytes.data() + plan.packed_offset[i]);  // read in place
    } else {
      plan.tensor_data.push_back(at);
      copy.regions.push_back({at, tensors[i].bytes});
      at += tensors[i].bytes;
    }
  }
  TH_ASSERT(at == copy.bytes.data() + copy.bytes.size(), "a seed copy has the layout's size");
  return plan;
}

}  // namespace

// ==== Impl ==========================================================================================

class Handle::Impl : private kj::TaskSet::ErrorHandler {
 public:
  explicit Impl(ClientOptions options);
  ~Impl();

  Status start();  // threads up, open answered
  // Set while an application call runs (see OneCallAtATime).
  std::atomic<bool> user_call_busy_{false};
  Outcome call(RequestBody body, std::optional<TimeMs> deadline_ms = std::nullopt);
  Status register_tensor(std::string name, void* data, std::uint64_t bytes, DType dtype, MemoryKind memory);
  Status unregister_tensor(std::string_view name);
  Result<Version> publish(Version version);
  Plan plan_copy();
  bool is_open();
  void shutdown();

  std::uint64_t client_id() const { return client_id_; }
  std::string data_endpoint() const { return advertised_; }
  HandleStats stats() const;

 private:
  struct Link;
  class SinkImpl;
  struct ReadJob {
    StartRead read;
    std::shared_ptr<std::atomic<bool>> cancelled;
    std::shared_ptr<net::Progress> progress;
    Plan plan;
    std::byte* packed = nullptr;
    std::shared_ptr<OffloadCopy> seed;  // offload seeding: the CPU copy read into (kept alive)
  };

  void taskFailed(kj::Exception&& exception) override;
  void io_main(std::promise<void>& ready);
  // On the I/O thread.
  void step(const AgentInput& input);
  void apply(const AgentEffect& effect);
  void post(AgentInput input);  // step later (never re-enter the agent from its own effects)
  void send_to(std::uint32_t server, net::ToHubMessage message);
  void connect(std::uint32_t server);
  void flush(Link& link);
  // One Session.send of the first `count` queued messages (0: a probe that the server is alive).
  void send_batch(Link& link, std::size_t count);
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
  static constexpr TimeMs kProbesPerTimeout = 4;
  // Other threads: run `work` on the I/O thread (false once it stopped).
  bool on_io(kj::Function<void()> work);
  void reader_main();
  void run_read(ReadJob& job);
  void complete_call(std::uint64_t call_id, Outcome outcome);
  void fail_everything(Error error);
  void log(const std::string& line) const;

  ClientOptions options_;
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
  std::unique_ptr<net::DataServer> data_server_;
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
  std::map<std::uint32_t, std::unique_ptr<Link>> links_;
  std::map<std::uint32_t, std::pair<TimeMs, TimeMs>> reconnect_;  // server -> (not before, backoff)
  std::uint64_t next_generation_ = 1;
  std::map<std::string, Registered, std::less<>> registry_;
  // Rebuilt when first needed after the registry changed (registering N tensors stays linear).
  Plan plan_;
  bool plan_stale_ = false;
  const Plan& plan();
  std::vector<std::byte> packed_;  // the packed small tensors (region 0)
  // What the registered buffers hold now: a version and how much of it is ready (pipeline).
  std::optional<Version> buffers_version_;
  std::shared_ptr<net::Progress> buffers_progress_;
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
  bool reader_stopping_ = false;

  mutable std::mutex stats_mutex_;
  HandleStats stats_;
};

// ---- Server links -----------------------------------------------------------------------------------

struct Handle::Impl::Link {
  std::uint32_t server = 0;
  std::uint64_t generation = 0;
  kj::Own<kj::AsyncIoStream> stream;
  // The server's address as the socket reached it (heartbeat datagrams go there): read before TLS
  // wraps the socket, since a TLS stream has no address.
  std::optional<sockaddr_storage> peer;
  kj::Own<capnp::TwoPartyClient> rpc;
  kj::Maybe<wire::Session::Client> session;
  std::vector<net::ToHubMessage> queue;
  std::uint32_t sends_in_flight = 0;
  // Heartbeats as datagrams (net/heartbeat.h), once the server offered a channel at connect.
  std::unique_ptr<net::HeartbeatSender> heartbeats;
  net::HeartbeatKey heartbeat_key{};
  std::uint64_t heartbeat_count = 0;  // of the last datagram sent (the server refuses counts it saw)
  // The server's last Session.send reply said it hears them: heartbeats stop going as calls.
  bool heartbeat_datagrams_heard = false;
  // A server that is alive answers; one that hangs (stopped, swapping, wedged) keeps the TCP
  // connection open and answers nothing. Since when something of ours has waited for an answer
  // (the connect, or a send; 0: nothing waits), and when the server last answered.
  TimeMs waiting_since_ms = 0;
  TimeMs heard_ms = 0;
};

class Handle::Impl::SinkImpl final : public wire::Sink::Server {
 public:
  SinkImpl(Impl& impl, std::uint32_t server) : impl_(impl), server_(server) {}

  kj::Promise<void> deliver(DeliverContext context) override {
    for (auto effect : context.getParams().getEffects()) {
      auto decoded = net::decode(effect);
      if (!decoded.ok()) {
        impl_.log("server " + std::to_string(server_) + " sent an invalid message: " + decoded.error().detail);
        continue;
      }
      impl_.step(FromHub{server_, std::move(decoded).value()});
    }
    return kj::READY_NOW;
  }

 private:
  Impl& impl_;
  std::uint32_t server_;
};

Handle::Impl::Impl(ClientOptions options)
    : options_(std::move(options)),
      client_id_([] {
        std::random_device entropy;  // a handle id unique in the job: 64 random bits (never 0)
        std::uint64_t id = 0;
        while (id == 0) id = (static_cast<std::uint64_t>(entropy()) << 32) ^ entropy();
        return id;
      }()),
      client_secret_([] {
        std::random_device entropy;  // the kernel's getrandom: 128 bits proving the id is ours
        std::array<kj::byte, kClientSecretBytes> secret{};
        for (std::size_t i = 0; i < secret.size(); i += 4) {
          const std::uint32_t word = entropy();
          std::memcpy(secret.data() + i, &word, 4);
        }
        return secret;
      }()),
      agent_(agent_config_of(options_, client_id_)) {}

Handle::Impl::~Impl() { shutdown(); }

void Handle::Impl::taskFailed(kj::Exception&& exception) {
  log(std::string("internal task failed: ") + exception.getDescription().cStr());
}

void Handle::Impl::log(const std::string& line) const {
  std::cerr << "thclient " << options_.replica << "/" << options_.shard << ": " << line << "\n";
}

Status Handle::Impl::start() {
  if (!options_.tls_ca_file.empty()) {
    auto tls = net::make_client_tls(options_.tls_ca_file);
    if (!tls.ok()) return tls.error();
    tls_ = std::move(tls).value();
  }
  try {
    net::DataServerConfig data;
    data.listen = net::parse_endpoint(options_.data_listen);
    data_server_ = std::make_unique<net::DataServer>(data);
  } catch (const net::SocketError& error) {
    return make_error(Errc::kInvalidArgument, std::string("data plane: ") + error.what());
  }
  advertised_ = options_.data_advertise.empty() ? data_server_->endpoint().to_string() : options_.data_advertise;

  std::promise<void> ready;
  auto up = ready.get_future();
  io_thread_ = std::thread([this, &ready] { io_main(ready); });
  up.wait();
  reader_thread_ = std::thread([this] { reader_main(); });

  Outcome opened = call(open_request_of(options_, advertised_), options_.open_timeout_ms);
  if (const Error* error = std::get_if<Error>(&opened)) return *error;
  return Unit{};
}

void Handle::Impl::io_main(std::promise<void>& ready) {
  net::IoLoop loop;
  kj::TaskSet tasks(*this);
  auto stop = kj::newPromiseAndFulfiller<void>();
  loop_ = &loop;
  tasks_ = &tasks;
  executor_ = &kj::getCurrentThreadExecutor();
  stop_ = kj::mv(stop.fulfiller);
  tasks.add(tick_loop());
  ready.set_value();
  stop.promise.wait(loop.wait_scope());
  // Tear down the capnp objects on their own thread.
  io_stopped_.store(true);
  links_.clear();
}

bool Handle::Impl::on_io(kj::Function<void()> work) {
  if (io_stopped_.load()) return false;
  try {
    executor_->executeSync(kj::mv(work));
    return true;
  } catch (const kj::Exception& exception) {
    return false;  // the loop is gone
  }
}

kj::Promise<void> Handle::Impl::tick_loop() {
  return loop_->timer().afterDelay(kTickMs * kj::MILLISECONDS).then([this] {
    step(AgentTick{});
    check_links();
    return tick_loop();
  });
}

TimeMs Handle::Impl::server_timeout_ms() const {
  if (options_.server_timeout_ms > 0) return options_.server_timeout_ms;
  const TimeMs told = server_heartbeat_timeout_ms_.load();
  return told > 0 ? std::min<TimeMs>(2 * told, kDataTimeoutMaxMs) : kDataTimeoutUnknownMs;
}

void Handle::Impl::check_links() {
  const TimeMs now = steady_now_ms();
  const TimeMs timeout_ms = server_timeout_ms();
  // Also at most half the server's heartbeat timeout (the default timeouts give that anyway): the
  // server counts a probe as a heartbeat, which keeps this client alive while its datagrams are
  // lost, until a reply says so and it beats by calls again.
  const TimeMs told_ms = server_heartbeat_timeout_ms_.load();
  const TimeMs probe_ms = told_ms > 0 ? std::min(timeout_ms / kProbesPerTimeout, told_ms / 2) : timeout_ms / kProbesPerTimeout;
  std::vector<std::pair<std::uint32_t, std::uint64_t>> hung;
  for (auto& [server, link] : links_) {
    if (link->waiting_since_ms != 0) {
      if (now - link->waiting_since_ms > timeout_ms) hung.emplace_back(server, link->generation);
    } else if (link->session != nullptr && now - link->heard_ms > probe_ms) {
      // Nothing of ours waits (heartbeats go as datagrams, which nobody answers): ask something
      // of the server now and then, so that it is seen to hang while nothing else would tell.
      send_batch(*link, 0);
    }
  }
  for (const auto& [server, generation] : hung) {
    lose(server, generation, "the server answered nothing for " + std::to_string(timeout_ms) + " ms (hung?)");
  }
}

void Handle::Impl::step(const AgentInput& input) {
  AgentEffects effects;
  agent_.step(input, steady_now_ms(), effects);
  for (const AgentEffect& effect : effects) apply(effect);
}

void Handle::Impl::post(AgentInput input) {
  tasks_->add(kj::evalLater([this, input = std::move(input)]() { step(input); }));
}

void Handle::Impl::apply(const AgentEffect& effect) {
  std::visit(
      [this](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, SendRequest>) {
          send_to(e.server, e.request);
        } else if constexpr (std::is_same_v<T, SendReport>) {
          send_to(e.server, e.report);
        } else if constexpr (std::is_same_v<T, BeginRead>) {
          if (e.read.offload_copy != 0) {
            start_seed_read(e.read);
          } else {
            start_read(e.read);
          }
        } else if constexpr (std::is_same_v<T, CancelRead>) {
          if (auto seed = seed_reads_.find(e.transfer); seed != seed_reads_.end()) {
            seed->second.cancelled->store(true);
            seed_reads_.erase(seed);
            return;
          }
          std::lock_guard lock(reader_mutex_);
          for (ReadJob& job : read_jobs_) {
            if (job.read.transfer == e.transfer) job.cancelled->store(true);
          }
          if (running_read_ && running_read_->transfer == e.transfer) running_read_->cancelled->store(true);
        } else if constexpr (std::is_same_v<T, GrantServe>) {
          serve(e.grant);
        } else if constexpr (std::is_same_v<T, RevokeServe>) {
          // Blocks until no read under the grant is in flight: the integrity barrier.
          data_server_->revoke({e.transfer, e.epoch});
          offload_grants_.erase({e.transfer, e.epoch});
        } else if constexpr (std::is_same_v<T, MakeOffload>) {
          start_offload(e.version);
        } else if constexpr (std::is_same_v<T, FreeOffload>) {
          offloads_.erase(e.version);  // grants still reading it keep it alive until revoked
        } else {
          static_assert(std::is_same_v<T, CallDone>);
          if (std::holds_alternative<UnpublishOk>(e.outcome) || std::holds_alternative<CloseOk>(e.outcome)) {
            buffers_version_.reset();  // nobody reads the buffers any more: they are the application's
          }
          complete_call(e.call_id, e.outcome);
        }
      },
      effect);
}

void Handle::Impl::send_to(std::uint32_t server, net::ToHubMessage message) {
  auto found = links_.find(server);
  if (found == links_.end()) {
    connect(server);
    found = links_.find(server);
  }
  Link& link = *found->second;
  if (const auto* report = std::get_if<Report>(&message);
      report != nullptr && std::holds_alternative<Heartbeat>(report->body) && link.heartbeats != nullptr) {
    // Also as a call until the server says it hears the datagrams (they may be filtered on the way).
    link.heartbeats->send(net::seal(report->client, report->session, ++link.heartbeat_count, link.heartbeat_key));
    if (link.heartbeat_datagrams_heard) return;
  }
  link.queue.push_back(std::move(message));
  flush(link);
}

void Handle::Impl::connect(std::uint32_t server) {
  auto fresh = std::make_unique<Link>();
  fresh->server = server;
  fresh->generation = next_generation_++;
  const std::uint64_t generation = fresh->generation;
  const TimeMs not_before = reconnect_.contains(server) ? reconnect_[server].first : 0;
  const TimeMs delay_ms = std::max<TimeMs>(0, not_before - steady_now_ms());
  fresh->waiting_since_ms = steady_now_ms() + delay_ms;  // for the TCP connect, then the connect call
  links_[server] = std::move(fresh);
  const std::string address = options_.servers.at(server);
  auto find_link = [this, server, generation]() -> Link* {
    auto found = links_.find(server);
    return found != links_.end() && found->second->generation == generation ? found->second.get() : nullptr;
  };
  tasks_->add(
      loop_->timer()
          .afterDelay(delay_ms * kj::MILLISECONDS)
          .then([this, address] { return loop_->io().getNetwork().parseAddress(address); })
          .then([](kj::Own<kj::NetworkAddress> resolved) { return resolved->connect().attach(kj::mv(resolved)); })
          .then([this, address, find_link](kj::Own<kj::AsyncIoStream> stream) -> kj::Promise<kj::Own<kj::AsyncIoStream>> {
            if (Link* link = find_link(); link != nullptr) {
              sockaddr_storage peer{};
              kj::uint length = sizeof peer;
              try {
                stream->getpeername(reinterpret_cast<sockaddr*>(&peer), &length);
                link->peer = peer;
              } catch (const kj::Exception&) {
                // No address (not a socket): heartbeats go as calls.
              }
            }
            if (tls_ == nullptr) return kj::mv(stream);
            return tls_->wrapClient(kj::mv(stream), net::tls_server_name(address, options_.tls_server_name));
          })
          .then([this, server, generation, find_link](kj::Own<kj::AsyncIoStream> stream) -> kj::Promise<void> {
            Link* link = find_link();
            if (link == nullptr) return kj::READY_NOW;
            link->stream = kj::mv(stream);
            link->rpc = kj::heap<capnp::TwoPartyClient>(*link->stream);
            tasks_->add(link->rpc->onDisconnect().then(
                [this, server, generation] { lose(server, generation, "the server closed the connection"); }));
            auto request = link->rpc->bootstrap().castAs<wire::Hub>().connectRequest();
            request.setToken(options_.token);
            request.setSink(kj::heap<SinkImpl>(*this, server));
            request.setClientName(options_.replica + "/" + std::to_string(options_.shard));
            request.setClient(client_id_);
            request.setClientSecret(kj::arrayPtr(client_secret_.data(), client_secret_.size()));
            // Pipelined: the queued messages go out on the promised session at once, in the same
            // flight as bootstrap and connect. On a busy server every round trip waits behind the
            // other connections' calls, so an open that needs one round trip instead of three is
            // answered that much sooner. A refused token fails those calls and this promise.
            auto connected = request.send();
            link->session = connected.getSession();
            flush(*link);
            return connected.then([this, server, find_link](auto response) {
              Link* connected_link = find_link();
              if (connected_link == nullptr) return;
              reconnect_.erase(server);
              connected_link->heard_ms = steady_now_ms();
              connected_link->waiting_since_ms = connected_link->sends_in_flight > 0 ? connected_link->heard_ms : 0;
              if (response.getHeartbeatTimeoutMs() > 0) {
                server_heartbeat_timeout_ms_.store(response.getHeartbeatTimeoutMs());
              }
              const auto channel = response.getHeartbeats();
              const auto key = net::key_from_bytes({channel.getKey().begin(), channel.getKey().size()});
              if (channel.getPort() == 0 || !key || !connected_link->peer) return;
              try {
                connected_link->heartbeats = std::make_unique<net::HeartbeatSender>(*connected_link->peer, channel.getPort());
                connected_link->heartbeat_key = *key;
              } catch (const net::SocketError& error) {
                log(std::string("heartbeats go as calls: ") + error.what());
              }
            });
          })
          .catch_([this, server, generation, address](kj::Exception&& exception) {
            const std::string why = exception.getDescription().cStr();
            if (why.find("wrong cluster token") != std::string::npos) {
              fail_everything(make_error(Errc::kPermissionDenied, "server " + address + " refused the cluster token"));
            } else if (tls_ != nullptr && net::is_certificate_refusal(why)) {
              // A wrong CA file or server name, or an impostor: retrying cannot help.
              fail_everything(make_error(Errc::kPermissionDenied, "server " + address + ": TLS: " + why));
            }
            // (Refused because another connection holds our id with another secret: someone else
            // uses it. Retried with backoff like any lost server; it succeeds once that one is gone.)
            lose(server, generation, "cannot reach server " + address + ": " + why);
          }));
}

void Handle::Impl::flush(Link& link) {
  if (link.session == nullptr) return;  // connecting: the queue goes once the session is there
  while (link.sends_in_flight < kSendsInFlightMax && !link.queue.empty()) {
    send_batch(link, std::min(link.queue.size(), net::kMessagesPerCallMax));
  }
}

void Handle::Impl::send_batch(Link& link, std::size_t count) {
  TH_ASSERT(count <= link.queue.size());
  KJ_IF_MAYBE(session, link.session) {
    auto request = session->sendRequest();
    auto list = request.initMessages(static_cast<unsigned>(count));
    for (std::size_t i = 0; i < count; ++i) net::encode(link.queue[i], list[static_cast<unsigned>(i)]);
    link.queue.erase(link.queue.begin(), link.queue.begin() + static_cast<long>(count));
    ++link.sends_in_flight;
    if (link.waiting_since_ms == 0) link.waiting_since_ms = steady_now_ms();
    const std::uint32_t server = link.server;
    const std::uint64_t generation = link.generation;
    auto answered = [this](Link& sent) {
      --sent.sends_in_flight;
      sent.heard_ms = steady_now_ms();
      sent.waiting_since_ms = sent.sends_in_flight > 0 ? sent.heard_ms : 0;
      flush(sent);
    };
    tasks_->add(request.send().then(
        [this, server, generation, answered](auto response) {
          auto found = links_.find(server);
          if (found == links_.end() || found->second->generation != generation) return;
          Link& sent = *found->second;
          sent.heartbeat_datagrams_heard = sent.heartbeats != nullptr && response.getHeartbeatDatagramsHeard();
          answered(sent);
        },
        [this, server, generation, answered](kj::Exception&& exception) {
          if (exception.getType() == kj::Exception::Type::DISCONNECTED) {
            lose(server, generation, "the connection broke");
          } else {
            // Our own message was refused: a bug here or a server of another version.
            log(std::string("the server refused a message: ") + exception.getDescription().cStr());
            auto found = links_.find(server);
            if (found != links_.end() && found->second->generation == generation) answered(*found->second);
          }
        }));
  }
}

void Handle::Impl::lose(std::uint32_t server, std::uint64_t generation, const std::string& why) {
  auto found = links_.find(server);
  if (found == links_.end() || found->second->generation != generation) return;
  log("lost server " + options_.servers.at(server) + ": " + why);
  std::unique_ptr<Link> link = std::move(found->second);
  links_.erase(found);
  auto& [not_before, backoff] = reconnect_[server];
  backoff = backoff == 0 ? kReconnectBackoffInitialMs : std::min(backoff * 2, kReconnectBackoffMaxMs);
  not_before = steady_now_ms() + backoff;
  // Destroy the connection after the current callback unwinds; tell the agent.
  tasks_->add(kj::evalLater([link = std::move(link)] {}));
  post(ServerLost{server});
}

// ---- Data plane -------------------------------------------------------------------------------------

namespace {

std::vector<net::ExposedRegion> regions_of(const Plan& plan, const std::byte* packed) {
  std::vector<net::ExposedRegion> regions;
  if (plan.packed_bytes > 0) regions.push_back({packed, plan.packed_bytes});
  for (std::size_t index : plan.big) regions.push_back({plan.tensor_data[index], plan.layout->tensors()[index].bytes});
  return regions;
}

}  // namespace

void Handle::Impl::serve(const ServeRead& grant) {
  const net::GrantKey key{grant.transfer, grant.epoch};
  if (grant.kind == CopyKind::kOffload) {
    auto found = offloads_.find(grant.version);
    if (found == offloads_.end()) {
      log("asked to serve offload copy of version " + std::to_string(grant.version) + ", which is not here");
      return;  // the reader is refused and reports it; the server picks another source
    }
    offload_grants_[key] = found->second;
    data_server_->grant(key, grant.secret, found->second->regions, std::make_shared<net::Progress>(found->second->bytes.size()));
    return;
  }
  if (!buffers_version_ || *buffers_version_ != grant.version || buffers_progress_ == nullptr) {
    log("asked to serve version " + std::to_string(grant.version) + ", which the buffers do not hold");
    return;
  }
  const Plan& current = plan();  // first: it may rebuild packed_
  data_server_->grant(key, grant.secret, regions_of(current, packed_.data()), buffers_progress_);
}

void Handle::Impl::start_read(const StartRead& read) {
  // Another read of the same version (another source, after a failure) rewrites the same bytes:
  // what is already ready stays ready for our own readers. A new version starts from nothing.
  if (!buffers_version_ || *buffers_version_ != read.version || buffers_progress_ == nullptr) {
    buffers_version_ = read.version;
    buffers_progress_ = std::make_shared<net::Progress>(0);
  }
  ReadJob job{read, std::make_shared<std::atomic<bool>>(false), buffers_progress_, plan(), packed_.data(),
              nullptr};
  std::lock_guard lock(reader_mutex_);
  // One read at a time into these buffers: a newer one replaces whatever is queued or running.
  for (ReadJob& queued : read_jobs_) queued.cancelled->store(true);
  if (running_read_) running_read_->cancelled->store(true);
  read_jobs_.push_back(std::move(job));
  reader_wakeup_.notify_one();
}

void Handle::Impl::start_seed_read(const StartRead& read) {
  TH_ASSERT(read.layout != nullptr, "a seed read names its layout");
  if (auto previous = seed_reads_.find(read.transfer); previous != seed_reads_.end()) {
    previous->second.cancelled->store(true);  // from the source this read replaces
  }
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  seed_reads_[read.transfer] = SeedRead{read.version, cancelled};
  // A fresh buffer each time (a replaced read may still be writing into the old one). The agent
  // grants reads of it only once it is whole, after this thread has said so through the loop.
  auto copy = std::make_shared<OffloadCopy>();
  offloads_[read.version] = copy;
  auto fail = [this, read](const std::string& why) {
    log("seed of version " + std::to_string(read.version) + ": " + why);
    post(ReadFinished{read.transfer, read.epoch, ReadFailure::kSourceUnreachable});
  };
  if (threads_closed_) return;  // closing: nobody waits for it
  join_reported_threads();
  const std::uint64_t id = next_offload_id_++;
  try {
    offload_threads_[id] = std::thread([this, id, read, copy, cancelled] {
      try {
        Plan plan = seed_copy_of(read.layout, *copy);
        std::byte* packed = copy->bytes.data();
        ReadJob job{read, cancelled, std::make_shared<net::Progress>(0), std::move(plan), packed, copy};
        run_read(job);
      } catch (const std::bad_alloc&) {
        on_io([this, read] {
          log("seed of version " + std::to_string(read.version) + ": no memory for the CPU copy");
          step(ReadFinished{read.transfer, read.epoch, ReadFailure::kSourceUnreachable});
        });
      }
      on_io([this, id, transfer = read.transfer, cancelled] {
        if (auto entry = seed_reads_.find(transfer);
            entry != seed_reads_.end() && entry->second.cancelled == cancelled) {
          seed_reads_.erase(entry);
        }
        offloads_reported_.push_back(id);
      });
    });
  } catch (const std::system_error& error) {
    offload_threads_.erase(id);
    fail(std::string("no thread to read it: ") + error.what());
  }
}

void Handle::Impl::join_reported_threads() {
  for (std::uint64_t done : offloads_reported_) {
    // (Shutdown may have taken the thread to join it itself.)
    if (auto thread = offload_threads_.find(done); thread != offload_threads_.end()) {
      thread->second.join();
      offload_threads_.erase(thread);
    }
  }
  offloads_reported_.clear();
}

void Handle::Impl::reader_main() {
  for (;;) {
    ReadJob job;
    {
      std::unique_lock lock(reader_mutex_);
      reader_wakeup_.wait(lock, [&] { return reader_stopping_ || !read_jobs_.empty(); });
      if (reader_stopping_) return;
      job = std::move(read_jobs_.front());
      read_jobs_.pop_front();
      running_read_ = RunningRead{job.read.transfer, job.cancelled};
    }
    if (!job.cancelled->load()) run_read(job);
    std::lock_guard lock(reader_mutex_);
    running_read_.reset();
  }
}

void Handle::Impl::run_read(ReadJob& job) {
  const Plan& plan = job.plan;
  std::vector<net::LocalRegion> targets;
  for (const net::ExposedRegion& region : regions_of(plan, job.packed)) {
    targets.push_back({const_cast<std::byte*>(region.base), region.bytes});
  }
  net::PullOptions pull_options;
  pull_options.chunk_bytes = options_.chunk_bytes;
  pull_options.partial = job.read.source.partial;
  pull_options.rate_bytes_per_s = options_.read_rate_bytes_per_s;
  pull_options.streams = options_.data_streams;
  pull_options.io_timeout_ms = static_cast<int>(data_timeout_ms());
  {
    std::lock_guard lock(stats_mutex_);
    stats_.reading_from = job.read.source.replica;
  }
  pull_options.cancelled = [&] { return job.cancelled->load(); };
  pull_options.on_progress = [&](std::uint64_t ready) { job.progress->advance_to(ready); };
  const auto started = std::chrono::steady_clock::now();
  net::PullOutcome outcome = [&] {
    try {
      return net::pull(net::parse_endpoint(job.read.source.endpoint), {job.read.transfer, job.read.epoch},
                       job.read.secret, targets, pull_options);
    } catch (const net::SocketError& bad_endpoint) {
      return net::PullOutcome{0, net::ReadError::kUnreachable, bad_endpoint.what()};
    }
  }();
  if (outcome.error == net::ReadError::kCancelled || job.cancelled->load()) return;
  std::optional<ReadFailure> failure;
  if (!outcome.ok()) {
    log(outcome.detail);
    failure = outcome.error == net::ReadError::kRefused ? ReadFailure::kSourceRefused
                                                         : ReadFailure::kSourceUnreachable;
  } else {
    // Scatter the packed tensors, then check every tensor against the checksum of its publisher.
    const auto& tensors = plan.layout->tensors();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      // (A seed copy keeps its packed tensors where they arrived.)
      if (plan.packed_offset[i] != Plan::kNotPacked && job.seed == nullptr) {
        std::memcpy(plan.tensor_data[i], job.packed + plan.packed_offset[i], tensors[i].bytes);
      }
    }
    const Checksums* expected = job.read.checksums.get();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (expected == nullptr || expected->size() != tensors.size() ||
          checksum(plan.tensor_data[i], tensors[i].bytes) != (*expected)[i]) {
        log("tensor '" + tensors[i].name + "' of version " + std::to_string(job.read.version) + " from " +
            job.read.source.replica + " does not match its checksum");
        failure = ReadFailure::kChecksumMismatch;
        break;
      }
    }
  }
  {
    std::lock_guard lock(stats_mutex_);
    stats_.bytes_received += outcome.bytes;
    stats_.reading_from.clear();
    if (failure) {
      ++stats_.reads_failed;
      if (*failure == ReadFailure::kChecksumMismatch) ++stats_.checksum_failures;
    } else {
      stats_.last_read_bytes = outcome.bytes;
      stats_.last_read_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    }
  }
  on_io([this, finished = ReadFinished{job.read.transfer, job.read.epoch, failure}] { step(finished); });
}

void Handle::Impl::start_offload(Version version) {
  if (!buffers_version_ || *buffers_version_ != version) {
    log("asked to offload version " + std::to_string(version) + ", which the buffers do not hold");
    return;  // the server times the offload out and carries on
  }
  // Copy on a thread of its own: gigabytes must not stall heartbeats. The buffers do not change
  // meanwhile: the application's unpublish() is still blocked.
  if (threads_closed_) return;
  join_reported_threads();
  const Plan& current = plan();  // first: it may rebuild packed_
  auto regions = regions_of(current, packed_.data());
  const std::uint64_t id = next_offload_id_++;
  offload_threads_[id] = std::thread([this, id, version, regions = std::move(regions)] {
    auto copy = std::make_shared<OffloadCopy>();
    std::uint64_t total = 0;
    for (const auto& region : regions) total += region.bytes;
    copy->bytes.resize(total);
    std::uint64_t at = 0;
    for (const auto& region : regions) {
      std::memcpy(copy->bytes.data() + at, region.base, region.bytes);
      copy->regions.push_back({copy->bytes.data() + at, region.bytes});
      at += region.bytes;
    }
    on_io([this, id, version, copy] {
      offloads_reported_.push_back(id);
      // A seed of this version started meanwhile (after a re-open): its buffer stays.
      const bool seeding = std::any_of(seed_reads_.begin(), seed_reads_.end(),
                                       [&](const auto& seed) { return seed.second.version == version; });
      if (!seeding) offloads_[version] = copy;
      step(OffloadFinished{version});
    });
  });
}

// ---- Calls ------------------------------------------------------------------------------------------

void Handle::Impl::complete_call(std::uint64_t call_id, Outcome outcome) {
  {
    std::lock_guard lock(calls_mutex_);
    auto found = calls_.find(call_id);
    if (found == calls_.end()) return;  // the caller gave up (open deadline)
    found->second = std::move(outcome);
  }
  call_done_.notify_all();
}

void Handle::Impl::fail_everything(Error error) {
  {
    std::lock_guard lock(calls_mutex_);
    fatal_ = error;
  }
  call_done_.notify_all();
}

Outcome Handle::Impl::call(RequestBody body, std::optional<TimeMs> deadline_ms) {
  std::uint64_t id = 0;
  {
    std::lock_guard lock(calls_mutex_);
    if (fatal_) return *fatal_;
    id = next_call_id_++;
    calls_[id] = std::nullopt;
  }
  const bool sent = on_io([this, id, body = std::move(body)]() mutable {
    if (agent_.call_in_flight()) {
      complete_call(id, make_error(Errc::kInvalidArgument, "another call is in flight on this handle: "
                                                           "calls of one handle come from one thread at a time"));
      return;
    }
    step(UserCall{id, std::move(body)});
  });
  std::unique_lock lock(calls_mutex_);
  if (!sent) {
    calls_.erase(id);
    return make_error(Errc::kUnavailable, "the handle is shut down");
  }
  auto answered = [&] { return calls_.at(id).has_value() || fatal_.has_value(); };
  if (deadline_ms) {
    if (!call_done_.wait_for(lock, std::chrono::milliseconds(*deadline_ms), answered)) {
      calls_.erase(id);
      return make_error(Errc::kUnavailable, "no server answered within " + std::to_string(*deadline_ms) + " ms");
    }
  } else {
    call_done_.wait(lock, answered);
  }
  if (!calls_.at(id).has_value()) {
    calls_.erase(id);
    return *fatal_;
  }
  Outcome outcome = std::move(*calls_.at(id));
  calls_.erase(id);
  return outcome;
}

Status Handle::Impl::register_tensor(std::string name, void* data, std::uint64_t bytes, DType dtype,
                                     MemoryKind memory) {
  if (memory == MemoryKind::kCuda) {
    return make_error(Errc::kInvalidArgument, "CUDA memory needs the RDMA/CUDA transport, which this build lacks");
  }
  if (data == nullptr && bytes > 0) return make_error(Errc::kInvalidArgument, "tensor '" + name + "' has no memory");
  if (auto alone = ShardLayout::make({TensorSpec{name, dtype, bytes}}); !alone.ok()) return alone.error();
  Status status = Unit{};
  on_io([&] {
    if (agent_.held().has_value() || agent_.call_in_flight() || buffers_version_.has_value()) {
      status = make_error(Errc::kAlreadyHolding, "tensors can change only while the shard holds no version");
      return;
    }
    if (registry_.contains(name)) {
      status = make_error(Errc::kInvalidArgument, "tensor '" + name + "' is already registered");
      return;
    }
    if (registry_.size() >= limits::kTensorsPerShardMax) {
      status = make_error(Errc::kLimitExceeded, "too many tensors in one shard");
      return;
    }
    registry_.emplace(std::move(name), Registered{static_cast<std::byte*>(data), bytes, dtype});
    plan_stale_ = true;
  });
  return status;
}

Status Handle::Impl::unregister_tensor(std::string_view name) {
  Status status = Unit{};
  on_io([&] {
    if (agent_.held().has_value() || agent_.call_in_flight() || buffers_version_.has_value()) {
      status = make_error(Errc::kAlreadyHolding, "tensors can change only while the shard holds no version");
      return;
    }
    auto found = registry_.find(name);
    if (found == registry_.end()) {
      status = make_error(Errc::kInvalidArgument, "tensor '" + std::string(name) + "' is not registered");
      return;
    }
    registry_.erase(found);
    plan_stale_ = true;
  });
  return status;
}

const Plan& Handle::Impl::plan() {
  if (plan_stale_) {
    plan_ = make_plan(registry_);
    packed_.assign(plan_.packed_bytes, std::byte{0});
    plan_stale_ = false;
  }
  return plan_;
}

bool Handle::Impl::is_open() {
  bool open = false;
  on_io([&] { open = agent_.phase() != AgentPhase::kIdle && agent_.phase() != AgentPhase::kClosed; });
  return open;
}

Plan Handle::Impl::plan_copy() {
  Plan copy;
  on_io([&] { copy = plan(); });
  return copy;
}

Result<Version> Handle::Impl::publish(Version version) {
  // State checks and the claim on the buffers happen on the I/O thread; hashing gigabytes does not
  // (heartbeats and grants would wait behind it). The application's calls come from one thread, so
  // nothing registers or publishes in between, and no reader can be granted these buffers (nor
  // read the packed buffer) before buffers_version_ is set below.
  std::optional<Error> refused;
  Plan current;
  on_io([&] {
    current = plan();
    if (current.layout == nullptr) {
      refused = make_error(Errc::kInvalidArgument, "register the shard's tensors before publishing");
    } else if (buffers_version_.has_value() || agent_.held().has_value()) {
      refused = make_error(Errc::kAlreadyHolding, "the shard already holds a version: unpublish first");
    }
  });
  if (refused) return *refused;
  // Checksums of what the buffers hold now, and the packed copy of the small tensors.
  const auto& tensors = current.layout->tensors();
  auto checksums = std::make_shared<Checksums>();
  checksums->reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    checksums->push_back(checksum(current.tensor_data[i], tensors[i].bytes));
    if (current.packed_offset[i] != Plan::kNotPacked) {
      std::memcpy(packed_.data() + current.packed_offset[i], current.tensor_data[i], tensors[i].bytes);
    }
  }
  on_io([&] {
    buffers_version_ = version;
    buffers_progress_ = std::make_shared<net::Progress>(current.layout->total_bytes());
  });
  Outcome outcome = call(PublishRequest{version, current.layout, std::move(checksums)});
  if (const Error* error = std::get_if<Error>(&outcome)) {
    on_io([&] {
      if (!agent_.held().has_value()) buffers_version_.reset();
    });
    return *error;
  }
  return std::get<PublishOk>(outcome).version;
}

HandleStats Handle::Impl::stats() const {
  std::lock_guard lock(stats_mutex_);
  HandleStats stats = stats_;
  if (data_server_ != nullptr) stats.bytes_served = data_server_->stats().bytes_served;
  return stats;
}

void Handle::Impl::shutdown() {
  {
    std::lock_guard lock(reader_mutex_);
    reader_stopping_ = true;
    for (ReadJob& job : read_jobs_) job.cancelled->store(true);
    if (running_read_) running_read_->cancelled->store(true);
  }
  reader_wakeup_.notify_all();
  if (reader_thread_.joinable()) reader_thread_.join();
  if (io_thread_.joinable()) {
    // Offload threads report through the loop: let them finish first.
    std::map<std::uint64_t, std::thread> offloads;
    on_io([&] {
      threads_closed_ = true;
      for (auto& [transfer, seed] : seed_reads_) seed.cancelled->store(true);
      offloads.swap(offload_threads_);
    });
    for (auto& [id, thread] : offloads) thread.join();
    on_io([this] { stop_->fulfill(); });
    io_thread_.join();
  }
  data_server_.reset();
}

// ==== Handle ========================================================================================

namespace {

// The application calls a handle from one thread at a time. A call made while another one runs is
// refused with a typed error, never interleaved: a tensor registered while publish() hashes the
// buffers changed the published layout under its readers (every read of that version failed).
class OneCallAtATime {
 public:
  explicit OneCallAtATime(std::atomic<bool>& busy) : busy_(busy), entered_(!busy.exchange(true)) {}
  ~OneCallAtATime() {
    if (entered_) busy_.store(false);
  }
  OneCallAtATime(const OneCallAtATime&) = delete;
  OneCallAtATime& operator=(const OneCallAtATime&) = delete;
  bool refused() const { return !entered_; }
  static Error error() {
    return make_error(Errc::kInvalidArgument,
                      "another call is in flight on this handle: calls of one handle come from one thread at a time");
  }

 private:
  std::atomic<bool>& busy_;
  bool entered_;
};

template <typename T>
Result<T> as_result(Outcome outcome) {
  if (Error* error = std::get_if<Error>(&outcome)) return std::move(*error);
  return std::get<T>(std::move(outcome));
}
Status as_status(Outcome outcome) {
  if (Error* error = std::get_if<Error>(&outcome)) return std::move(*error);
  return Unit{};
}
}  // namespace

Handle::Handle(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Handle>> Handle::open(ClientOptions options) {
  if (Status valid = validate(options); !valid.ok()) return valid.error();
  auto impl = std::make_unique<Impl>(std::move(options));
  if (Status started = impl->start(); !started.ok()) return started.error();
  return std::unique_ptr<Handle>(new Handle(std::move(impl)));
}

Handle::~Handle() {
  // A handle dropped while open leaves politely, but never waits long for it.
  if (impl_->is_open()) (void)impl_->call(CloseRequest{}, kCloseOnDestroyMs);
}

Status Handle::register_tensor(std::string name, void* data, std::uint64_t bytes, DType dtype, MemoryKind memory) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return impl_->register_tensor(std::move(name), data, bytes, dtype, memory);
}
Status Handle::unregister_tensor(std::string_view name) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return impl_->unregister_tensor(name);
}
Result<Version> Handle::publish(Version version) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return impl_->publish(version);
}
Status Handle::unpublish() {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return as_status(impl_->call(UnpublishRequest{}));
}

Result<ReplicateInfo> Handle::replicate(std::string_view selector, TimeMs timeout_ms) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  auto parsed = parse_selector(selector);
  if (!parsed.ok()) return parsed.error();
  if (timeout_ms < 0 || timeout_ms > limits::kDeadlineMsMax) {
    return make_error(Errc::kInvalidArgument, "timeout_ms is outside 0.." + std::to_string(limits::kDeadlineMsMax));
  }
  const Plan plan = impl_->plan_copy();
  if (plan.layout == nullptr) return make_error(Errc::kInvalidArgument, "register the shard's tensors before replicating");
  auto answer = as_result<ReplicateOk>(impl_->call(ReplicateRequest{parsed.value(), plan.layout, timeout_ms}));
  if (!answer.ok()) return answer.error();
  return ReplicateInfo{answer.value().version, answer.value().source_replica};
}

Result<UpdateInfo> Handle::update(std::string_view selector) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  auto parsed = parse_selector(selector);
  if (!parsed.ok()) return parsed.error();
  const Plan plan = impl_->plan_copy();
  if (plan.layout == nullptr) return make_error(Errc::kInvalidArgument, "register the shard's tensors before updating");
  auto answer = as_result<UpdateOk>(impl_->call(UpdateRequest{parsed.value(), plan.layout}));
  if (!answer.ok()) return answer.error();
  return UpdateInfo{answer.value().status, answer.value().version, answer.value().source_replica};
}

Result<ListSnapshot> Handle::list() {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  auto answer = as_result<ListOk>(impl_->call(ListRequest{}));
  if (!answer.ok()) return answer.error();
  return *answer.value().snapshot;
}

Status Handle::wait(const WaitPredicate& predicate, TimeMs timeout_ms) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  if (timeout_ms < 0 || timeout_ms > limits::kDeadlineMsMax) {
    return make_error(Errc::kInvalidArgument, "timeout_ms is outside 0.." + std::to_string(limits::kDeadlineMsMax));
  }
  return as_status(impl_->call(WaitRequest{predicate, timeout_ms}));
}

Status Handle::close() {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return as_status(impl_->call(CloseRequest{}));
}
std::string Handle::data_endpoint() const { return impl_->data_endpoint(); }
std::uint64_t Handle::client_id() const { return impl_->client_id(); }
HandleStats Handle::stats() const { return impl_->stats(); }

}  // namespace th
