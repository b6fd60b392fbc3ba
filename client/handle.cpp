// libthclient: the shell around the core ShardAgent.
//
// The agent decides everything (what to send, when to retry, which grants to serve, when to fail
// over); the shell carries out its effects on real resources and feeds it what happens:
//   - the control protocol (server_links.cpp): one Cap'n Proto connection per server, opened on
//     demand, with a bounded number of Session.send calls in flight; a lost connection is ServerLost;
//     heartbeats go as UDP datagrams where the server offers it and hears them, as calls otherwise;
//   - the data plane (data_path.cpp): the transport serves grants from the registered tensors (or
//     from an offload copy); one reader thread pulls versions into them and verifies their
//     checksums; offloads: a thread copies the registered tensors to CPU memory;
//   - the application (this file): calls block on a condition variable until the agent's CallDone.
// Everything that touches the agent runs on the I/O thread (a kj event loop, started here); other
// threads hand it work through the loop's executor.
#include "client/handle_impl.h"
#include "client/cuda/ipc.h"
#include "client/convert.h"
#include "client/patch_writer.h"
#include "client/receive.h"
#include "net/token.h"

#ifdef TH_HAVE_RDMA
#include "rdma/transport.h"
#include "rdma/verbs.h"
#endif

namespace th {
namespace client_impl {

Plan make_plan(const std::map<std::string, Registered, std::less<>>& registry) {
  Plan plan;
  if (registry.empty()) return plan;
  std::vector<TensorSpec> specs;
  for (const auto& [name, tensor] : registry) {
    TH_ASSERT(tensor.spec.name == name, "a registered tensor is filed under its name");
    specs.push_back(tensor.spec);
    plan.tensor_data.push_back(tensor.data);
    plan.on_device.push_back(tensor.on_device);
    if (tensor.spec.bytes < kPackedTensorBytesMax) {
      plan.packed_offset.push_back(plan.packed_bytes);
      plan.packed_bytes += tensor.spec.bytes;
    } else {
      plan.packed_offset.push_back(Plan::kNotPacked);
      plan.big.push_back(specs.size() - 1);
    }
  }
  plan.layout = ShardLayout::make(std::move(specs)).value();  // names unique and valid: checked at register
  return plan;
}

}  // namespace client_impl

namespace {

#ifdef TH_HAVE_RDMA
// rdma/'s view of the CUDA driver, for registering GPU tensors with the NIC. CUDA is looked for only
// when GPU memory is first leased (a process of CPU tensors never loads the driver).
class NicGpuMemory final : public rdma::DeviceMemoryApi {
 public:
  std::optional<rdma::AllocationRange> allocation_of(const std::byte* device_pointer) override {
    auto access = gpu();
    if (!access.ok()) return std::nullopt;
    auto range = access.value()->allocation_of(device_pointer);
    if (!range) return std::nullopt;
    return rdma::AllocationRange{range->first, range->second};
  }
  int dmabuf_fd(const std::byte* base, std::uint64_t bytes, std::string& why) override {
    auto access = gpu();
    if (!access.ok()) {
      why = access.error().detail;
      return -1;
    }
    return access.value()->dmabuf_fd(base, bytes, why);
  }
};
#endif

AgentConfig agent_config_of(const ClientOptions& options, ClientId client) {
  return AgentConfig{client, static_cast<std::uint32_t>(std::max<std::size_t>(options.servers.size(), 1)),
                     options.heartbeat_interval_ms, kRetryInitialMs, kRetryMaxMs};
}

OpenRequest open_request_of(const ClientOptions& options, const std::string& data_endpoint) {
  OpenRequest open;
  open.model = options.model;
  open.replica = options.replica;
  open.incarnation = options.incarnation;
  open.incarnation_auto = options.incarnation == 0;
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
    if (!options.data_listen.empty()) net::parse_endpoint(options.data_listen);
  } catch (const net::SocketError& error) {
    return make_error(Errc::kInvalidArgument, error.what());
  }
  if (Status token = net::check_token_size(options.token, "the cluster token (ClientOptions::token)"); !token.ok()) {
    return token;
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

}  // namespace

// ==== Impl ==========================================================================================

Handle::Impl::Impl(ClientOptions options)
    : options_(std::move(options)),
      log_sink_(options_.log, options_.log_level, "thclient " + options_.replica + "/" + std::to_string(options_.shard)),
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

Handle::Impl::~Impl() {
  if (metrics_ != nullptr) client::ClientMetrics::instance().detach(metrics_.get());
  shutdown();
}

void Handle::Impl::taskFailed(kj::Exception&& exception) {
  log(LogLevel::kError, "handle", std::string("internal task failed: ") + exception.getDescription().cStr());
}

void Handle::Impl::log(LogLevel level, std::string_view component, const std::string& line) const {
  log_sink_.log(level, component, line);
}

std::string_view log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "?";
}

Status Handle::Impl::start() {
  if (!options_.metrics_listen.empty()) {
    if (Status serving = client::ClientMetrics::instance().serve(options_.metrics_listen); !serving.ok()) {
      return serving;
    }
  }
  metrics_ = std::make_shared<client::HandleMetrics>(options_, [this] { return stats(); });
  client::ClientMetrics::instance().attach(metrics_);
  if (!options_.tls_ca_file.empty()) {
    auto tls = net::make_client_tls(options_.tls_ca_file);
    if (!tls.ok()) return tls.error();
    tls_ = std::move(tls).value();
  }
  if (options_.transport != "auto" && options_.transport != "rdma" && options_.transport != "tcp") {
    return make_error(Errc::kInvalidArgument,
                      "transport '" + options_.transport + "' is not one of auto, rdma, tcp");
  }
  std::string host_towards_server;  // where peers dial this shard's data port, if it listens on all
  try {
    net::DataServerConfig data;
    data.staging = serve_staging_;
    // Same-host readers of GPU tensors copy device to device (no CUDA call until one asks).
    if (options_.cuda_ipc) data.ipc = make_ipc_exporter();
    data.log = [this](const std::string& line) { log(LogLevel::kWarning, "data", "data server: " + line); };
    data.listen = options_.data_listen.empty() ? net::Endpoint{"0.0.0.0", 0} : net::parse_endpoint(options_.data_listen);
    // A wildcard listen address cannot be dialled: advertise the interface that reaches the server.
    if (options_.data_advertise.empty() && net::is_wildcard_host(data.listen.host)) {
      // The servers in order (a primary that is down or unresolvable leaves the backups).
      std::string why;
      for (const std::string& server : options_.servers) {
        try {
          host_towards_server = net::local_address_towards(net::parse_endpoint(server));
          break;
        } catch (const net::SocketError& error) {
          why += std::string(why.empty() ? "" : "; ") + error.what();
        }
      }
      if (host_towards_server.empty()) {
        // Like a server that does not answer: perhaps for now (DNS, routes), so kUnavailable.
        return make_error(Errc::kUnavailable,
                          "data plane: cannot tell which address of this host peers should dial (" + why +
                              "); set data_advertise, or data_listen to a specific address");
      }
      if (net::is_link_local(host_towards_server)) {
        return make_error(Errc::kInvalidArgument,
                          "data plane: the server is reached over the link-local address " + host_towards_server +
                              ", which peers cannot dial without its interface; set data_advertise");
      }
      const bool v6 = host_towards_server.find(':') != std::string::npos;
      if (options_.data_listen.empty()) {
        data.listen.host = v6 ? "::" : "0.0.0.0";  // the family of the address peers will dial
      } else if (v6 != (data.listen.host.find(':') != std::string::npos)) {
        return make_error(Errc::kInvalidArgument,
                          "data plane: data_listen " + options_.data_listen + " is IPv" + (v6 ? "4" : "6") +
                              " but the server is reached over IPv" + (v6 ? "6" : "4") + " (as " +
                              host_towards_server + "); listen on " + (v6 ? "[::]" : "0.0.0.0") +
                              ", or set data_advertise");
      }
    }
#ifdef TH_HAVE_RDMA
    if (options_.transport != "tcp") {
      try {
        rdma::RdmaOptions rdma_options;
        // "mlx5_0,mlx5_1": one device per rail.
        for (std::size_t at = 0; at < options_.rdma_device.size();) {
          const std::size_t comma = std::min(options_.rdma_device.find(',', at), options_.rdma_device.size());
          if (comma > at) rdma_options.devices.push_back(options_.rdma_device.substr(at, comma - at));
          at = comma + 1;
        }
        rdma_options.gid_index = options_.rdma_gid_index;
        rdma_options.device_memory = std::make_shared<NicGpuMemory>();
        rdma_options.log = [this](const std::string& line) { log(LogLevel::kWarning, "rdma", line); };
        auto rdma = std::make_unique<rdma::RdmaTransport>(data, rdma_options);
        log(LogLevel::kInfo, "rdma", "data plane: RDMA on " + rdma->device_names() + " (TCP with sources that have none)");
        transport_ = std::move(rdma);
      } catch (const rdma::VerbsError& error) {
        if (options_.transport == "rdma") {
          return make_error(Errc::kInvalidArgument, std::string("transport rdma: ") + error.what());
        }
        // "auto" on a host without RDMA is the common case: say so only if it has a device.
        if (!rdma::device_names().empty()) {
          log(LogLevel::kWarning, "rdma", std::string("data plane: TCP, RDMA failed: ") + error.what());
        }
      }
    }
#else
    if (options_.transport == "rdma") {
      return make_error(Errc::kInvalidArgument, "transport rdma: libthclient was built without libibverbs");
    }
#endif
    if (transport_ == nullptr) transport_ = std::make_unique<net::TcpTransport>(data);
  } catch (const net::SocketError& error) {
    return make_error(Errc::kInvalidArgument, std::string("data plane: ") + error.what());
  }
  if (!options_.data_advertise.empty()) {
    advertised_ = options_.data_advertise;
  } else if (!host_towards_server.empty()) {
    advertised_ = net::Endpoint{host_towards_server, transport_->endpoint().port}.to_string();
  } else {
    advertised_ = transport_->endpoint().to_string();
  }

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
          transport_->revoke({e.transfer, e.epoch});
          offload_grants_.erase({e.transfer, e.epoch});
        } else if constexpr (std::is_same_v<T, MakeOffload>) {
          start_offload(e.version);
        } else if constexpr (std::is_same_v<T, FreeOffload>) {
          offloads_.erase(e.version);  // grants still reading it keep it alive until revoked
        } else if constexpr (std::is_same_v<T, CopyFoundCorrupt>) {
          {
            std::lock_guard lock(stats_mutex_);
            ++stats_.copies_found_corrupt;
          }
          log(LogLevel::kError, "handle",
              "readers found " + std::string(e.offload ? "the CPU offload copy" : "the registered tensors") +
                  " of version " + std::to_string(e.version) + " of this shard failing the checksums " +
                  (e.offload ? "they were copied with" : "taken when it was published or received") +
                  ", twice: the server no longer reads from it. Were the tensors written while published "
                  "(between publish() and the return of unpublish()), or rewritten in place by the engine "
                  "after a receive? (Or the bytes broke on the way twice: a NIC or link fault.)");
        } else {
          static_assert(std::is_same_v<T, CallDone>);
          // Holding nothing (unpublished, closed, a receive that failed or was cancelled): nobody
          // reads the buffers any more, they are the application's.
          if (!agent_.held().has_value()) buffers_version_.reset();
          // A failed call may leave a read into the buffers winding down (told to stop just now):
          // the application hears of it once that read let go of them (reader_main).
          if (std::holds_alternative<Error>(e.outcome)) {
            std::lock_guard lock(reader_mutex_);
            if (running_read_ || !read_jobs_.empty()) {
              completion_after_reads_ = {e.call_id, e.outcome};
              return;
            }
          }
          complete_call(e.call_id, e.outcome);
        }
      },
      effect);
}

// ---- Calls ------------------------------------------------------------------------------------------

void Handle::Impl::complete_call(std::uint64_t call_id, Outcome outcome) {
  {
    std::lock_guard lock(calls_mutex_);
    if (active_receive_ != nullptr && active_receive_->call_id == call_id) {
      active_receive_->finish(std::move(outcome));
      active_receive_.reset();
      call_done_.notify_all();  // a call waiting for an abandoned receive's answer
      return;
    }
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
    if (active_receive_ != nullptr) active_receive_->finish(error);
  }
  call_done_.notify_all();
}

Result<std::shared_ptr<Receive::State>> Handle::Impl::begin_receive(RequestBody body, Plan plan,
                                                                    client::HandleMetrics::Call kind) {
  settle_abandoned_receive();
  std::shared_ptr<Receive::State> state;
  {
    std::lock_guard lock(calls_mutex_);
    if (fatal_) return *fatal_;
    state = std::make_shared<Receive::State>(
        std::move(plan), next_call_id_++,
        [metrics = metrics_, kind](std::string_view result, double seconds) { metrics->record(kind, seconds, result); });
    state->impl = this;
  }
  std::optional<Error> refused;
  const bool sent = on_io([&] {
    if (agent_.call_in_flight()) {
      refused = make_error(Errc::kInvalidArgument, "another call is in flight on this handle: "
                                                   "calls of one handle come from one thread at a time");
      return;
    }
    {
      std::lock_guard lock(calls_mutex_);
      active_receive_ = state;  // before the agent can answer
    }
    step(UserCall{state->call_id, std::move(body)});
  });
  if (!sent) return make_error(Errc::kUnavailable, "the handle is shut down");
  if (refused) return *refused;
  return state;
}

void Handle::Impl::cancel_call(std::uint64_t call_id) {
  on_io([&] { step(UserCancel{call_id}); });
}

void Handle::Impl::settle_abandoned_receive(std::optional<TimeMs> timeout_ms) {
  std::unique_lock lock(calls_mutex_);
  auto settled = [&] {
    if (active_receive_ == nullptr || fatal_) return true;
    std::lock_guard state_lock(active_receive_->mutex);
    return !active_receive_->abandoned;
  };
  if (timeout_ms) {
    call_done_.wait_for(lock, std::chrono::milliseconds(*timeout_ms), settled);
  } else {
    call_done_.wait(lock, settled);
  }
}

bool Handle::Impl::receive_running() {
  std::lock_guard lock(calls_mutex_);
  return active_receive_ != nullptr;
}

void Handle::Impl::end_receive(TimeMs timeout_ms) {
  std::shared_ptr<Receive::State> running;
  {
    std::lock_guard lock(calls_mutex_);
    running = active_receive_;
  }
  if (running == nullptr) return;
  cancel_call(running->call_id);
  std::unique_lock lock(running->mutex);
  running->changed.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return running->outcome.has_value(); });
}

Outcome Handle::Impl::call(RequestBody body, std::optional<TimeMs> deadline_ms) {
  settle_abandoned_receive(deadline_ms);
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
      return make_error(Errc::kUnavailable, "no server answered within " + std::to_string(*deadline_ms) + " ms" +
                                                (last_server_error_.empty() ? "" : " (last: " + last_server_error_ + ")") +
                                                (http_hint_.empty() ? "" : "; " + http_hint_));
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

Status Handle::Impl::register_tensor(TensorSpec spec, void* data, MemoryKind memory) {
  const std::string& name = spec.name;
  const std::uint64_t bytes = spec.bytes;
  if (data == nullptr && bytes > 0) return make_error(Errc::kInvalidArgument, "tensor '" + name + "' has no memory");
  if (auto alone = ShardLayout::make({spec}); !alone.ok()) return alone.error();
  // GPU memory: which device (one per handle), checked here, off the I/O thread (the first CUDA
  // call of the process loads the driver). An empty tensor has nothing to move: it stays a CPU one.
  std::shared_ptr<Gpu> device_access;
  int device = -1;
  if (memory == MemoryKind::kCuda && bytes > 0) {
    auto access = gpu();
    if (!access.ok()) return make_error(access.error().code, "tensor '" + name + "': " + access.error().detail);
    device_access = access.value();
    auto found = device_access->device_of(static_cast<const std::byte*>(data), bytes);
    if (!found.ok()) {
      return make_error(Errc::kInvalidArgument, "tensor '" + name + "' (MemoryKind::kCuda): " + found.error().detail);
    }
    device = found.value();
  }
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
    if (device >= 0 && gpu_device_ >= 0 && device != gpu_device_) {
      status = make_error(Errc::kInvalidArgument, "tensor '" + name + "' is on CUDA device " + std::to_string(device) +
                                                      ", this handle's other GPU tensors on device " +
                                                      std::to_string(gpu_device_) + ": one device per handle");
      return;
    }
    if (device >= 0 && gpu_device_ < 0) {
      gpu_ = device_access;
      gpu_device_ = device;
      gpu_staging_->set_device(gpu_, device);
      log(LogLevel::kInfo, "handle", "GPU tensors on CUDA device " + std::to_string(device) +
                                         ": moved over TCP through pinned staging, checked on the GPU");
    }
    const bool on_device = device >= 0;
    auto lease = transport_->lease_memory(static_cast<std::byte*>(data), bytes, on_device);
    std::string key = name;
    registry_.emplace(std::move(key), Registered{static_cast<std::byte*>(data), std::move(spec), std::move(lease), on_device});
    plan_stale_ = true;
    held_checksums_.reset();  // another layout: no patch is against what the old one held
    kept_patch_.reset();
    written_patches_.clear();
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
    held_checksums_.reset();
    kept_patch_.reset();
    written_patches_.clear();
  });
  return status;
}

const Plan& Handle::Impl::plan() {
  if (plan_stale_) {
    plan_ = make_plan(registry_);
    if (std::find(plan_.on_device.begin(), plan_.on_device.end(), true) != plan_.on_device.end()) {
      plan_.gpu = gpu_;
      plan_.gpu_device = gpu_device_;
    }
    packed_lease_.reset();  // before the buffer moves: a registration of the old one would read stale
    packed_.assign(plan_.packed_bytes, std::byte{0});
    packed_lease_ = transport_->lease_memory(packed_.data(), packed_.size(), false);
    plan_stale_ = false;
  }
  return plan_;
}

std::uint64_t Handle::Impl::incarnation() {
  std::uint64_t incarnation = 0;
  on_io([&] { incarnation = agent_.incarnation(); });
  return incarnation;
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

Result<Version> Handle::Impl::publish(Version version, void* cuda_stream) {
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
    } else if (agent_.call_in_flight()) {
      refused = make_error(Errc::kInvalidArgument, "another call is in flight on this handle: "
                                                   "calls of one handle come from one thread at a time");
    } else if (buffers_version_.has_value() || agent_.held().has_value()) {
      refused = make_error(Errc::kAlreadyHolding, "the shard already holds a version: unpublish first");
    }
  });
  if (refused) return *refused;
  // Checksums of what the buffers hold now, and the packed copy of the small tensors.
  const auto& tensors = current.layout->tensors();
  auto checksums = std::make_shared<Checksums>(tensors.size());
  try {
    if (current.gpu != nullptr) {
      // The application's kernels that write the GPU tensors must be done before we read them.
      current.gpu->synchronize(current.gpu_device, cuda_stream);
      // Small GPU tensors: into the packed buffer in one batch, then hashed there on the CPU.
      std::vector<Gpu::Copy> gather;
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        if (current.device_tensor(i) && current.packed_offset[i] != Plan::kNotPacked) {
          gather.push_back({current.tensor_data[i], packed_.data() + current.packed_offset[i], tensors[i].bytes});
        }
      }
      current.gpu->to_host(gather);
    }
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const bool packed = current.packed_offset[i] != Plan::kNotPacked;
      if (packed && !current.device_tensor(i)) {
        std::memcpy(packed_.data() + current.packed_offset[i], current.tensor_data[i], tensors[i].bytes);
      }
      if (packed) {
        (*checksums)[i] = checksum(packed_.data() + current.packed_offset[i], tensors[i].bytes);
      } else if (current.device_tensor(i)) {
        (*checksums)[i] = current.gpu->checksum(current.tensor_data[i], tensors[i].bytes);
      } else {
        (*checksums)[i] = checksum(current.tensor_data[i], tensors[i].bytes);
      }
    }
  } catch (const net::DeviceCopyError& error) {
    return make_error(Errc::kUnavailable, std::string("publish: reading the GPU tensors failed: ") + error.what());
  }
  // Delta versions: the patches write_tensor recorded against the version the buffers held before.
  PatchRef patch;
  std::shared_ptr<KeptPatch> kept;
  on_io([&] {
    if (held_checksums_ && held_checksums_->first < version && !written_patches_.empty()) {
      const Version base = held_checksums_->first;
      auto made = std::make_shared<KeptPatch>();
      made->version = version;
      made->patches.resize(tensors.size());
      PatchInfo info{base, std::vector<std::uint64_t>(tensors.size(), 0)};
      bool any = false;
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        auto written = written_patches_.find(tensors[i].name);
        if (written == written_patches_.end() || written->second.base != base || !written->second.patch) continue;
        info.tensor_bytes[i] = written->second.patch->size();
        made->patches[i] = std::move(*written->second.patch);
        any = true;
      }
      if (any) {
        made->info = std::make_shared<const PatchInfo>(std::move(info));
        patch = made->info;
        kept = std::move(made);
      }
    }
    written_patches_.clear();  // a patch is of the version it was written for
    buffers_version_ = version;
    buffers_progress_ = std::make_shared<net::Progress>(current.layout->total_bytes());
    // Before the call: the server may send a reader to it as soon as the publish completes,
    // before this thread hears the answer.
    kept_patch_ = kept;
  });
  const ChecksumsRef published = checksums;
  Outcome outcome = call(PublishRequest{version, current.layout, std::move(checksums), patch});
  if (std::holds_alternative<Error>(outcome)) {
    // The buffers hold what was written, which is not the base any more, nor a version.
    on_io([&] {
      held_checksums_.reset();
      kept_patch_.reset();
    });
  } else {
    on_io([&] { hold_verified(version, published, kept); });
    if (patch != nullptr) {
      std::uint64_t bytes = 0;
      for (std::uint64_t size : patch->tensor_bytes) bytes += size;
      std::lock_guard lock(stats_mutex_);
      ++stats_.patches_published;
      stats_.patch_bytes_published += bytes;
    }
  }
  if (const Error* error = std::get_if<Error>(&outcome)) {
    on_io([&] {
      if (!agent_.held().has_value()) buffers_version_.reset();
    });
    return *error;
  }
  return std::get<PublishOk>(outcome).version;
}

Status Handle::Impl::write_tensor(std::string_view name, const void* source, DType source_dtype) {
  if (source == nullptr) return make_error(Errc::kInvalidArgument, "write_tensor: no source for tensor '" + std::string(name) + "'");
  std::optional<Error> refused;
  Registered target;
  std::optional<std::pair<Version, ChecksumsRef>> held;
  std::size_t index = 0;
  on_io([&] {
    auto found = registry_.find(name);
    if (found == registry_.end()) {
      refused = make_error(Errc::kInvalidArgument, "write_tensor: no tensor '" + std::string(name) + "' is registered");
    } else if (buffers_version_.has_value() || agent_.held().has_value() || agent_.call_in_flight()) {
      refused = make_error(Errc::kAlreadyHolding, "write_tensor: the shard holds a version: unpublish first (tensors "
                                                  "change only while not published)");
    } else if (found->second.on_device) {
      refused = make_error(Errc::kInvalidArgument, "write_tensor: tensor '" + std::string(name) +
                                                       "' is GPU memory; patches of GPU tensors are not built yet "
                                                       "(copy it and publish: it is read whole)");
    } else if (found->second.spec.bytes % dtype_bytes(found->second.spec.dtype) != 0) {
      refused = make_error(Errc::kInvalidArgument,
                           "write_tensor: tensor '" + std::string(name) + "' is " + std::to_string(found->second.spec.bytes) +
                               " bytes, not a whole number of " + std::string(dtype_name(found->second.spec.dtype)) +
                               " elements: write_tensor writes whole elements");
    } else if (!convertible(source_dtype, found->second.spec.dtype)) {
      refused = make_error(Errc::kInvalidArgument, "write_tensor: tensor '" + std::string(name) + "' is " +
                                                       std::string(dtype_name(found->second.spec.dtype)) + ", which " +
                                                       std::string(dtype_name(source_dtype)) + " does not convert to");
    } else {
      target = found->second;
      held = held_checksums_;
      const Plan& current = plan();
      while (current.layout->tensors()[index].name != name) ++index;
      // The base: what the tensor held when the buffers last held a version whole (its layout
      // unchanged since: registering again makes the checksums another layout's). A tensor
      // written twice since no longer holds it: the second write records no patch (read whole).
      if (held && (held->second == nullptr || held->second->size() != current.layout->tensors().size())) held.reset();
      if (written_patches_.contains(name)) held.reset();
    }
  });
  if (refused) return *refused;
  const std::uint64_t count = target.spec.bytes / dtype_bytes(target.spec.dtype);
  if (!held) {
    // Nothing to patch against (the first version, or the buffers were written otherwise).
    convert_elements(source_dtype, static_cast<const std::byte*>(source), target.spec.dtype, target.data, count);
    on_io([&] { written_patches_[std::string(name)] = WrittenPatch{0, std::nullopt}; });
    return Unit{};
  }
  PatchWriter writer(target.spec.dtype, std::span<std::byte>(target.data, target.spec.bytes), (*held->second)[index]);
  writer.write(source_dtype, static_cast<const std::byte*>(source), count);
  std::optional<std::vector<std::byte>> patch = writer.finish();
  on_io([&] { written_patches_[std::string(name)] = WrittenPatch{held->first, std::move(patch)}; });
  return Unit{};
}

void Handle::Impl::interrupt(const std::string& why) {
  {
    std::lock_guard lock(calls_mutex_);
    if (!fatal_) fatal_ = make_error(Errc::kUnavailable, "interrupted: " + why);
    if (active_receive_ != nullptr) active_receive_->finish(*fatal_);
  }
  call_done_.notify_all();
}

HandleStats Handle::Impl::stats() const {
  std::lock_guard lock(stats_mutex_);
  HandleStats stats = stats_;
  if (transport_ != nullptr) {
    const net::TransportStats transport = transport_->stats();
    stats.bytes_served = transport.bytes_served;
    stats.pulls_rdma = transport.pulls_rdma;
    stats.pulls_tcp = transport.pulls_tcp;
    stats.pulls_fell_back = transport.pulls_fell_back;
    stats.memory_registrations = transport.memory_registrations;
    stats.transport = std::string(transport_->kind());
    if (!transport.device_registration.empty()) stats.gpu_registration = transport.device_registration;
  }
  return stats;
}

void Handle::Impl::shutdown() {
  // A Receive that outlives the handle answers kUnavailable and no longer reaches it.
  std::shared_ptr<Receive::State> receive;
  {
    std::lock_guard lock(calls_mutex_);
    receive = std::exchange(active_receive_, nullptr);
  }
  if (receive != nullptr) {
    receive->finish(make_error(Errc::kUnavailable, "the handle is closed"));
    std::lock_guard lock(receive->impl_mutex);
    receive->impl = nullptr;
  }
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
  transport_.reset();
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

using Call = client::HandleMetrics::Call;

template <typename T>
std::string result_label(const Result<T>& result) {
  if (!result.ok()) return std::string(errc_name(result.error().code));
  if constexpr (std::is_same_v<T, UpdateInfo>) {
    if (result.value().status != UpdateStatus::kUpdated) return std::string(update_status_name(result.value().status));
  }
  return "ok";
}

// Runs a public call's body, and records how long it held the caller and its result.
template <typename Body>
auto recorded(const std::shared_ptr<client::HandleMetrics>& metrics, Call call, const Body& body) {
  const auto started = std::chrono::steady_clock::now();
  auto result = body();
  metrics->record(call, std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
                  result_label(result));
  return result;
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
  // A handle dropped while open leaves politely, but never waits long for it: a receive still
  // running is cancelled first (if its answer does not come, the server evicts the shard later).
  impl_->end_receive(kCloseOnDestroyMs);
  if (impl_->is_open() && !impl_->receive_running()) (void)impl_->call(CloseRequest{}, kCloseOnDestroyMs);
}

Status Handle::register_tensor(std::string name, void* data, std::uint64_t bytes, DType dtype, MemoryKind memory) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return impl_->register_tensor(TensorSpec{std::move(name), dtype, bytes}, data, memory);
}

namespace {

// The bytes of a buffer of `shape` elements of `dtype`, or why there is no such buffer.
Result<std::uint64_t> buffer_bytes(const std::string& name, DType dtype, const Shape& shape) {
  if (static_cast<int>(dtype) >= kDTypeCount) return make_error(Errc::kInvalidArgument, "tensor '" + name + "' has no valid dtype");
  if (shape.size() > limits::kBoxRankMax) {
    return make_error(Errc::kInvalidArgument, "tensor '" + name + "': shape " + describe_shape(shape) +
                                                  " has more than " + std::to_string(limits::kBoxRankMax) + " dimensions");
  }
  const std::optional<std::uint64_t> elements = checked_element_count(shape);
  std::uint64_t bytes = 0;
  if (!elements || __builtin_mul_overflow(*elements, dtype_bytes(dtype), &bytes)) {
    return make_error(Errc::kInvalidArgument, "tensor '" + name + "': shape " + describe_shape(shape) + " is too big");
  }
  return bytes;
}

}  // namespace

Status Handle::register_tensor(std::string name, void* data, DType dtype, Shape shape, MemoryKind memory) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  auto bytes = buffer_bytes(name, dtype, shape);
  if (!bytes.ok()) return bytes.error();
  TensorSpec spec{std::move(name), dtype, bytes.value()};
  spec.kind = TensorKind::kLocal;
  spec.shape = std::move(shape);
  return impl_->register_tensor(std::move(spec), data, memory);
}

Status Handle::register_piece(std::string name, void* data, DType dtype, Shape global_shape, Box box,
                              MemoryKind memory) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  // The box is checked against the shape first, so that the size below is the box's.
  if (Status placed = check_box(name, global_shape, box); !placed) return placed;
  auto bytes = buffer_bytes(name, dtype, box.extent);
  if (!bytes.ok()) return bytes.error();
  TensorSpec spec{std::move(name), dtype, bytes.value()};
  spec.kind = TensorKind::kPiece;
  spec.shape = std::move(global_shape);
  spec.box = std::move(box);
  return impl_->register_tensor(std::move(spec), data, memory);
}
Status Handle::unregister_tensor(std::string_view name) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return impl_->unregister_tensor(name);
}
Result<Version> Handle::publish(Version version, void* cuda_stream) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return recorded(impl_->metrics_, Call::kPublish, [&] { return impl_->publish(version, cuda_stream); });
}
Status Handle::write_tensor(std::string_view name, const void* source, DType source_dtype) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return impl_->write_tensor(name, source, source_dtype);
}
Status Handle::unpublish() {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return recorded(impl_->metrics_, Call::kUnpublish, [&] { return as_status(impl_->call(UnpublishRequest{})); });
}

namespace {

// replicate and update, blocking or not: the arguments are checked here (an error is recorded at
// once), the call's answer goes to the Receive's State (which records it when it comes).
Result<std::shared_ptr<Receive::State>> launch_receive(Handle::Impl& impl, Call kind, std::string_view selector,
                                                       TimeMs timeout_ms) {
  auto launched = [&]() -> Result<std::shared_ptr<Receive::State>> {
    auto parsed = parse_selector(selector);
    if (!parsed.ok()) return parsed.error();
    if (timeout_ms < 0 || timeout_ms > limits::kDeadlineMsMax) {
      return make_error(Errc::kInvalidArgument, "timeout_ms is outside 0.." + std::to_string(limits::kDeadlineMsMax));
    }
    Plan plan = impl.plan_copy();
    if (plan.layout == nullptr) {
      return make_error(Errc::kInvalidArgument, std::string("register the shard's tensors before ") +
                                                    (kind == Call::kUpdate ? "updating" : "replicating"));
    }
    RequestBody body = kind == Call::kUpdate ? RequestBody(UpdateRequest{parsed.value(), plan.layout})
                                             : RequestBody(ReplicateRequest{parsed.value(), plan.layout, timeout_ms});
    return impl.begin_receive(std::move(body), std::move(plan), kind);
  }();
  if (!launched.ok()) impl.metrics_->record(kind, 0, errc_name(launched.error().code));
  return launched;
}

}  // namespace

Result<ReplicateInfo> Handle::replicate(std::string_view selector, TimeMs timeout_ms) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  auto launched = launch_receive(*impl_, Call::kReplicate, selector, timeout_ms);
  if (!launched.ok()) return launched.error();
  auto answer = Receive(std::move(launched).value()).wait();
  if (!answer.ok()) return answer.error();
  TH_ASSERT(answer.value().version.has_value(), "a replicate that succeeded names its version");
  return ReplicateInfo{*answer.value().version, answer.value().source_replica};
}

Result<UpdateInfo> Handle::update(std::string_view selector) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  auto launched = launch_receive(*impl_, Call::kUpdate, selector, 0);
  if (!launched.ok()) return launched.error();
  return Receive(std::move(launched).value()).wait();
}

Result<std::unique_ptr<Receive>> Handle::replicate_async(std::string_view selector, TimeMs timeout_ms) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  auto launched = launch_receive(*impl_, Call::kReplicate, selector, timeout_ms);
  if (!launched.ok()) return launched.error();
  return std::unique_ptr<Receive>(new Receive(std::move(launched).value()));
}

Result<std::unique_ptr<Receive>> Handle::update_async(std::string_view selector) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  auto launched = launch_receive(*impl_, Call::kUpdate, selector, 0);
  if (!launched.ok()) return launched.error();
  return std::unique_ptr<Receive>(new Receive(std::move(launched).value()));
}

Result<ListSnapshot> Handle::list() {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return recorded(impl_->metrics_, Call::kList, [&]() -> Result<ListSnapshot> {
    auto answer = as_result<ListOk>(impl_->call(ListRequest{}));
    if (!answer.ok()) return answer.error();
    return *answer.value().snapshot;
  });
}

Status Handle::wait(const WaitPredicate& predicate, TimeMs timeout_ms) {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return recorded(impl_->metrics_, Call::kWait, [&]() -> Status {
    if (timeout_ms < 0 || timeout_ms > limits::kDeadlineMsMax) {
      return make_error(Errc::kInvalidArgument, "timeout_ms is outside 0.." + std::to_string(limits::kDeadlineMsMax));
    }
    return as_status(impl_->call(WaitRequest{predicate, timeout_ms}));
  });
}

Status Handle::close() {
  OneCallAtATime exclusive(impl_->user_call_busy_);
  if (exclusive.refused()) return OneCallAtATime::error();
  return recorded(impl_->metrics_, Call::kClose, [&] { return as_status(impl_->call(CloseRequest{})); });
}
void Handle::interrupt(const std::string& why) { impl_->interrupt(why); }
std::string Handle::data_endpoint() const { return impl_->data_endpoint(); }
std::uint64_t Handle::client_id() const { return impl_->client_id(); }
std::uint64_t Handle::incarnation() const { return impl_->incarnation(); }
HandleStats Handle::stats() const { return impl_->stats(); }
std::string Handle::metrics_address() { return client::ClientMetrics::instance().address(); }

}  // namespace th
