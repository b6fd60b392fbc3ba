#include "tools/bench_control.h"

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <vector>

#include "core/agent.h"
#include "net/event_loop.h"
#include "net/tls.h"
#include "net/wire.h"

// Cap'n Proto's generated Server classes have virtual methods and a non-virtual destructor; kj owns
// them through kj::Own, which deletes the most-derived type, so the warning does not apply.
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"

namespace th::bench {
namespace {

constexpr std::uint32_t kSendsInFlightMax = 4;  // Session.send calls per connection, as libthclient
constexpr TimeMs kTickMs = 100;                 // how often agents hear the clock
constexpr std::size_t kLatenciesMax = 20'000'000;  // samples kept for the percentiles

TimeMs now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// What every shard of every replica publishes: tiny, the benchmark is about the control plane.
struct Shape {
  std::vector<LayoutRef> layouts;
  std::vector<ChecksumsRef> checksums;
  explicit Shape(std::uint32_t shards) {
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      layouts.push_back(ShardLayout::make({{"w" + std::to_string(shard), DType::kBFloat16, 1 << 20}}).value());
      checksums.push_back(std::make_shared<const Checksums>(Checksums{shard + 1ULL}));
    }
  }
};

class Load;

struct Client {
  std::uint32_t replica = 0;
  std::uint32_t shard = 0;
  std::unique_ptr<ShardAgent> agent;
  kj::Own<kj::AsyncIoStream> stream;
  kj::Own<capnp::TwoPartyClient> rpc;
  kj::Maybe<wire::Session::Client> session;
  std::vector<net::ToHubMessage> queue;
  std::uint32_t sends_in_flight = 0;
  std::uint64_t round = 1;  // publishes 2 * round + replica % 2, as bench/hub_bench.cpp
  int phase = 0;            // 0 publish, 1 update, 2 unpublish
  std::uint64_t next_call_id = 1;
  double call_started_us = 0;
  bool opened = false;
};

class SinkImpl final : public wire::Sink::Server {
 public:
  SinkImpl(Load& load, Client& client) : load_(load), client_(client) {}
  kj::Promise<void> deliver(DeliverContext context) override;

 private:
  Load& load_;
  Client& client_;
};

class Load : private kj::TaskSet::ErrorHandler {
 public:
  Load(const ControlLoadOptions& options, net::IoLoop& loop)
      : options_(options), loop_(loop), shape_(options.shards), tasks_(*this) {}

  int run();
  void step(Client& client, const AgentInput& input);

 private:
  void taskFailed(kj::Exception&& exception) override {
    if (failures_++ == 0) std::cerr << "th-bench control-load: " << exception.getDescription().cStr() << "\n";
  }
  void connect(Client& client, kj::NetworkAddress& address);
  void apply(Client& client, const AgentEffect& effect);
  void post(Client& client, AgentInput input) {
    tasks_.add(kj::evalLater([this, &client, input = std::move(input)] { step(client, input); }));
  }
  void next_call(Client& client);
  void flush(Client& client);
  kj::Promise<void> tick_loop();
  kj::Promise<void> echo_loop(Client& client);
  void record(double latency_us, bool error);
  kj::Promise<void> wait_for_start();

  const ControlLoadOptions& options_;
  net::IoLoop& loop_;
  Shape shape_;
  std::unique_ptr<kj::TlsContext> tls_;  // before clients_: outlives their streams
  std::vector<std::unique_ptr<Client>> clients_;
  std::uint32_t ready_ = 0;
  bool measuring_ = false;
  std::uint64_t ops_ = 0;
  std::uint64_t errors_ = 0;
  std::string first_error_;
  std::uint64_t failures_ = 0;
  std::vector<double> latencies_us_;
  kj::TaskSet tasks_;
};

kj::Promise<void> SinkImpl::deliver(DeliverContext context) {
  for (auto effect : context.getParams().getEffects()) {
    auto decoded = net::decode(effect);
    if (!decoded.ok()) {
      std::cerr << "th-bench control-load: invalid effect: " << decoded.error().detail << "\n";
      continue;
    }
    load_.step(client_, FromHub{0, std::move(decoded).value()});
  }
  return kj::READY_NOW;
}

void Load::record(double latency_us, bool error) {
  if (!measuring_) return;
  ++ops_;
  if (error) ++errors_;
  if (latencies_us_.size() < kLatenciesMax) latencies_us_.push_back(latency_us);
}

void Load::step(Client& client, const AgentInput& input) {
  AgentEffects effects;
  client.agent->step(input, now_ms(), effects);
  for (const AgentEffect& effect : effects) apply(client, effect);
}

void Load::apply(Client& client, const AgentEffect& effect) {
  std::visit(
      [&](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, SendRequest>) {
          client.queue.push_back(e.request);
          flush(client);
        } else if constexpr (std::is_same_v<T, SendReport>) {
          client.queue.push_back(e.report);
          flush(client);
        } else if constexpr (std::is_same_v<T, BeginRead>) {
          // An instantaneous data plane: the read is done as soon as it starts.
          post(client, ReadFinished{e.read.transfer, e.read.epoch, std::nullopt});
        } else if constexpr (std::is_same_v<T, MakeOffload>) {
          post(client, OffloadFinished{e.version});
        } else if constexpr (std::is_same_v<T, CallDone>) {
          const Error* error = std::get_if<Error>(&e.outcome);
          if (!client.opened) {
            if (error != nullptr) {
              std::cerr << "th-bench control-load: open failed: " << error->detail << "\n";
              std::exit(1);
            }
            client.opened = true;
            if (++ready_ == clients_.size()) std::cout << "control ready " << ready_ << std::endl;
          } else {
            if (error != nullptr && first_error_.empty()) first_error_ = error->detail;
            record(now_us() - client.call_started_us, error != nullptr);
            client.phase = (client.phase + 1) % 3;
            if (client.phase == 0) ++client.round;
          }
          tasks_.add(kj::evalLater([this, &client] { next_call(client); }));
        }
        // Grants, revocations, cancellations and freed offloads concern a data plane there is not.
      },
      effect);
}

void Load::next_call(Client& client) {
  RequestBody body;
  const std::uint32_t shard = client.shard;
  switch (client.phase) {
    case 0:
      body = PublishRequest{2 * client.round + client.replica % 2, shape_.layouts[shard], shape_.checksums[shard]};
      break;
    case 1:
      body = UpdateRequest{Selector::latest(), shape_.layouts[shard]};
      break;
    default:
      body = UnpublishRequest{};
  }
  client.call_started_us = now_us();
  step(client, UserCall{client.next_call_id++, std::move(body)});
}

void Load::flush(Client& client) {
  KJ_IF_MAYBE(session, client.session) {
    while (client.sends_in_flight < kSendsInFlightMax && !client.queue.empty()) {
      const std::size_t count = std::min(client.queue.size(), net::kMessagesPerCallMax);
      auto request = session->sendRequest();
      auto list = request.initMessages(static_cast<unsigned>(count));
      for (std::size_t i = 0; i < count; ++i) net::encode(client.queue[i], list[static_cast<unsigned>(i)]);
      client.queue.erase(client.queue.begin(), client.queue.begin() + static_cast<long>(count));
      ++client.sends_in_flight;
      tasks_.add(request.send().ignoreResult().then([this, &client] {
        --client.sends_in_flight;
        flush(client);
      }));
    }
  }
}

// A client id unique across load processes, from replica and shard (0 names no client).
ClientId client_id_of(const Client& client) {
  return ((static_cast<ClientId>(client.replica) << 8) | client.shard) + 1;
}

void Load::connect(Client& client, kj::NetworkAddress& address) {
  client.stream = address.connect().wait(loop_.wait_scope());
  if (tls_ != nullptr) {
    client.stream = tls_->wrapClient(kj::mv(client.stream), net::tls_server_name(options_.server, options_.tls_server_name))
                        .wait(loop_.wait_scope());
  }
  client.rpc = kj::heap<capnp::TwoPartyClient>(*client.stream);
  auto request = client.rpc->bootstrap().castAs<wire::Hub>().connectRequest();
  request.setToken(options_.token);
  request.setSink(kj::heap<SinkImpl>(*this, client));
  request.setClientName("bench-" + std::to_string(client.replica) + "/" + std::to_string(client.shard));
  // A benchmark's clients are not attacked: a secret derived from the id is enough.
  const ClientId id = client_id_of(client);
  kj::byte secret[16] = {};
  std::memcpy(secret, &id, sizeof id);
  request.setClient(id);
  request.setClientSecret(kj::arrayPtr(secret, sizeof secret));
  auto connected = request.send();
  client.session = connected.getSession();
  tasks_.add(connected.ignoreResult());
}

kj::Promise<void> Load::tick_loop() {
  return loop_.timer().afterDelay(kTickMs * kj::MILLISECONDS).then([this] {
    const TimeMs now = now_ms();
    for (auto& client : clients_) {
      if (client->agent == nullptr) continue;
      const auto due = client->agent->next_deadline_ms();
      if (due && *due <= now) step(*client, AgentTick{});
    }
    return tick_loop();
  });
}

kj::Promise<void> Load::echo_loop(Client& client) {
  KJ_IF_MAYBE(session, client.session) {
    auto request = session->sendRequest();
    auto report = request.initMessages(1)[0].initReport();
    report.setClient(client.replica);
    report.setSession(1);
    report.getBody().setHeartbeat();
    const double started = now_us();
    return request.send().ignoreResult().then([this, &client, started] {
      record(now_us() - started, false);
      return echo_loop(client);
    });
  }
  return kj::READY_NOW;
}

kj::Promise<void> Load::wait_for_start() {
  if (options_.start_file.empty() || std::filesystem::exists(options_.start_file)) return kj::READY_NOW;
  return loop_.timer().afterDelay(10 * kj::MILLISECONDS).then([this] { return wait_for_start(); });
}

int Load::run() {
  if (options_.shards == 0 || options_.clients % options_.shards != 0) {
    std::cerr << "th-bench control-load: --clients must be a multiple of --shards\n";
    return 2;
  }
  if (!options_.tls_ca_file.empty()) {
    auto tls = net::make_client_tls(options_.tls_ca_file);
    if (!tls.ok()) {
      std::cerr << "th-bench control-load: " << tls.error().detail << "\n";
      return 2;
    }
    tls_ = std::move(tls).value();
  }
  auto address = loop_.io().getNetwork().parseAddress(options_.server).wait(loop_.wait_scope());
  for (std::uint32_t i = 0; i < options_.clients; ++i) {
    auto client = std::make_unique<Client>();
    client->replica = options_.first_replica + i / options_.shards;
    client->shard = i % options_.shards;
    connect(*client, *address);
    clients_.push_back(std::move(client));
  }
  if (options_.echo) {
    std::cout << "control ready " << clients_.size() << std::endl;
  } else {
    tasks_.add(tick_loop());
    for (auto& client : clients_) {
      const ClientId id = client_id_of(*client);
      // Heartbeats every 5 s: their cost is the idle-fleet benchmark's subject, not this one's.
      // Retransmissions as libthclient's (TCP loses nothing while the connection lives).
      client->agent = std::make_unique<ShardAgent>(AgentConfig{id, 1, 5000, options_.retry_initial_ms, 60000});
      OpenRequest open;
      open.model = "bench-control";
      open.replica = "replica-" + std::to_string(client->replica);
      open.incarnation = 1;
      open.shard = client->shard;
      open.num_shards = options_.shards;
      open.datacenter = "dc0";
      open.role = client->replica == 0 ? "trainer" : "rollout";
      open.data_endpoint = "127.0.0.1:1";
      step(*client, UserCall{client->next_call_id++, std::move(open)});
    }
    while (ready_ < clients_.size()) {
      loop_.timer().afterDelay(10 * kj::MILLISECONDS).wait(loop_.wait_scope());
      if (failures_ > 0) return 1;
    }
  }
  wait_for_start().wait(loop_.wait_scope());
  measuring_ = true;
  const double started_us = now_us();
  if (options_.echo) {
    for (auto& client : clients_) tasks_.add(echo_loop(*client));
  }
  loop_.timer().afterDelay(static_cast<std::int64_t>(options_.seconds * 1000) * kj::MILLISECONDS).wait(loop_.wait_scope());
  measuring_ = false;
  const double window_s = (now_us() - started_us) / 1e6;
  std::sort(latencies_us_.begin(), latencies_us_.end());
  auto percentile = [&](double p) {
    return latencies_us_.empty() ? 0.0 : latencies_us_[static_cast<std::size_t>(p * double(latencies_us_.size() - 1))];
  };
  std::cout << std::fixed << std::setprecision(1) << "RESULT control_ops=" << ops_ << " control_seconds=" << window_s << " control_p50_us=" << percentile(0.5)
            << " control_p99_us=" << percentile(0.99) << " control_errors=" << errors_ << std::endl;
  if (!first_error_.empty()) std::cerr << "th-bench control-load: first error: " << first_error_ << "\n";
  std::cout.flush();
  std::_Exit(failures_ > 0 ? 1 : 0);  // 8,192 connections need no orderly goodbye
}

// ---- The echo server ----------------------------------------------------------------------------

class EchoSession final : public wire::Session::Server {
 protected:
  kj::Promise<void> send(SendContext) override { return kj::READY_NOW; }
};

class EchoHub final : public wire::Hub::Server {
 protected:
  kj::Promise<void> connect(ConnectContext context) override {
    context.getResults().setSession(kj::heap<EchoSession>());
    return kj::READY_NOW;
  }
};

struct EchoConnection {
  kj::Own<kj::AsyncIoStream> stream;
  kj::Own<capnp::TwoPartyVatNetwork> network;
  kj::Own<capnp::RpcSystem<capnp::rpc::twoparty::VatId>> rpc;
};

}  // namespace

int run_control_load(const ControlLoadOptions& options) {
  net::IoLoop loop;
  Load load(options, loop);
  return load.run();
}

int run_echo_server(const std::string& listen) {
  net::IoLoop loop;
  auto listener = loop.io().getNetwork().parseAddress(listen).wait(loop.wait_scope())->listen();
  std::cout << "echo listening on " << listen.substr(0, listen.rfind(':')) << ":" << listener->getPort() << std::endl;
  std::vector<std::unique_ptr<EchoConnection>> connections;
  std::function<kj::Promise<void>()> accept = [&]() -> kj::Promise<void> {
    return listener->accept().then([&](kj::Own<kj::AsyncIoStream> stream) {
      auto connection = std::make_unique<EchoConnection>();
      connection->stream = kj::mv(stream);
      connection->network =
          kj::heap<capnp::TwoPartyVatNetwork>(*connection->stream, capnp::rpc::twoparty::Side::SERVER);
      connection->rpc = kj::heap(capnp::makeRpcServer(*connection->network, kj::heap<EchoHub>()));
      connections.push_back(std::move(connection));
      return accept();
    });
  };
  accept().wait(loop.wait_scope());
  return 0;
}

}  // namespace th::bench
